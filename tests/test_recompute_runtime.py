"""Module recompute in the runtime (models/recompute.py): what re-runs, and that it trains the
same model.

1. Counting: one forward+backward of a layer per recompute value calls core attention, the MLP
   and the norms exactly once more for each recomputed module (and the whole layer again for
   ``full``): recompute really happens, and nothing else re-runs.
2. Dropout on: every module choice trains exactly the numbers of no recompute on a tp 2 layout
   (recomputed dropout masks, replicated and tensor-parallel streams, equal the forward's).
3. Equivalence (fp32, dropout off, 3 steps, relative 1e-5 against one process): granularities
   mixed per layer under TP, SP, pipeline stages, interleaving and ZeRO.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from dist_utils import run_distributed
from harness import layer, layer_and_input, plan_of, run_plans
from megatron_auto.plan import Plan
from test_equivalence import CONFIG, GPT, gpt_recipe

pytestmark = pytest.mark.multirank

VALUES = [False, "selective", ["mlp"], ["norm"], ["core_attn", "mlp", "norm"], True]


def _count_worker(rank, world_size, values, sp):
    from megatron_auto.models import transformer as tf
    from megatron_auto.parallel.context import ParallelContext

    calls: Counter = Counter()

    def counting(cls, name, key):
        original = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            calls[key, getattr(self, "_owner", id(self))] += 1
            return original(self, *args, **kwargs)
        setattr(cls, name, wrapped)

    counting(tf.SelfAttention, "core_attention", "core_attn")
    counting(tf.MLP, "forward", "mlp")
    counting(tf.TransformerLayer, "_norm", "norm")
    counting(tf.TransformerLayer, "_forward", "layer")
    tp = world_size
    plan = Plan.from_dict(plan_of(world_size, [layer(tp=tp, sp=sp)] * 4, vocab_tp=tp))
    groups = ParallelContext(plan).layer_groups(0)
    config = replace(CONFIG, hidden_dropout=0.1, attention_dropout=0.1)
    out = []
    for value in values:
        module, x = layer_and_input(config, groups, 2, sp=sp, seed=0, recompute=value)
        for child in (module, module.self_attention, module.mlp):
            child._owner = "layer"  # one key per module kind for this layer
        calls.clear()
        module(x).sum().backward()
        out.append({key: n for (key, _), n in calls.items()})
    return out


@pytest.mark.parametrize("world_size, sp", [(1, False), (2, True)])
def test_recomputed_modules_run_twice_and_only_they(world_size, sp):
    counts = run_distributed(_count_worker, world_size, VALUES, sp)[0]
    once = {"core_attn": 1, "mlp": 1, "norm": 2, "layer": 1}
    expected = [
        once,
        {**once, "core_attn": 2},
        {**once, "mlp": 2},
        {**once, "norm": 4},
        {"core_attn": 2, "mlp": 2, "norm": 4, "layer": 1},
        {"core_attn": 2, "mlp": 2, "norm": 4, "layer": 2},  # full: the whole layer again
    ]
    assert counts == expected


def test_dropout_masks_replay_for_every_module_choice():
    config = replace(CONFIG, hidden_dropout=0.1, attention_dropout=0.1)
    plans = [plan_of(2, [layer(tp=2, recompute=v)] * 4, vocab_tp=2)
             for v in (False, "selective", ["mlp", "norm"], ["core_attn", "norm"], True)]
    base, *others = run_plans(gpt_recipe(config), 2, plans, steps=3)
    assert abs(base.losses[0] - GPT.reference().losses[0]) > 1e-4  # dropout really on
    for index, other in enumerate(others, 1):
        assert other.losses == pytest.approx(base.losses, rel=1e-6), f"plan {index}"
        assert set(other.state) == set(base.state), f"plan {index}"
        for name, value in base.state.items():
            torch.testing.assert_close(other.state[name], value, rtol=1e-6, atol=1e-7,
                                       msg=lambda m, n=name, i=index: f"plan {i}: {n}: {m}")


MODULE_PLANS = {
    # granularities mixed per layer, TP of three degrees (strided too), ZeRO-2/3
    "mixed-tp-zero": plan_of(4, [layer(tp=2, recompute="selective"),
                                 layer(tp=2, recompute=["mlp"], dp_mode="zero3"),
                                 layer(tp=1, recompute=["norm", "core_attn"], dp_mode="zero2"),
                                 layer(tp=4, consecutive=False,
                                       recompute=["core_attn", "mlp", "norm"])],
                             vocab_tp=2),
    # SP layers with module recompute across a stage boundary, full next to them, zero1
    "sp-pp2": plan_of(4, [layer(tp=2, sp=True, recompute="selective"),
                          layer(tp=2, sp=True, recompute=["mlp", "norm"]),
                          layer(tp=2, sp=True, recompute=True),
                          layer(dp_mode="zero1", recompute=["mlp"])],
                      layers_per_stage=(2, 2), num_microbatches=2, vocab_tp=2),
    # interleaved 1F1B (v=2), gpipe-free, module recompute in every chunk
    "interleaved": plan_of(4, [layer(tp=2, recompute=["norm"]), layer(tp=2, recompute="selective"),
                               layer(tp=2, sp=True, recompute=["mlp"]), layer(tp=2)],
                           layers_per_stage=(1, 1, 1, 1), virtual_size=2, num_microbatches=2,
                           vocab_tp=2),
}


@pytest.mark.parametrize("name", list(MODULE_PLANS))
def test_module_recompute_plans_match_one_process(name):
    GPT.check_named(4, MODULE_PLANS, name)
