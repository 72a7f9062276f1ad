"""Activation offload in the runtime (plan ``layers[i].offload``; models/recompute.py's
LayerLevers around parallel/offload.py).

1. One layer, each offload value, on one rank and on a tp 2 + SP layout: the named modules'
   saved activations really move (bytes counted per module; the modules are disjoint, so their
   sum is the list's; the whole layer moves more), and the output and every gradient equal no
   offload to the bit.
2. Dropout on: offload plans train exactly the numbers of no offload (offload draws nothing).
3. Equivalence (fp32, dropout off, 3 steps, relative 1e-5 against one process): offload mixed
   per layer with recompute under TP (strided too), SP, ZeRO-1/2/3 and pipeline stages.

On CPU host and device memory are one: what is checked is the mechanism and the numbers; the
memory saved is a GPU measurement.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dist_utils import run_distributed
from harness import layer, plan_of, run_plans
from megatron_auto.plan import Plan
from test_equivalence import CONFIG, GPT, gpt_recipe

pytestmark = pytest.mark.multirank

VALUES = [False, ["core_attn"], ["mlp"], ["norm"], ["core_attn", "mlp", "norm"], True]


def _layer_worker(rank, world_size, sp):
    from megatron_auto.models import transformer as tf
    from megatron_auto.parallel.context import ParallelContext
    from megatron_auto.parallel.mappings import scatter_to_sequence

    tp = world_size
    plan = Plan.from_dict(plan_of(world_size, [layer(tp=tp, sp=sp)] * 4, vocab_tp=tp))
    groups = ParallelContext(plan).layer_groups(0)
    torch.manual_seed(0)
    x = torch.randn(2, CONFIG.seq_length, CONFIG.hidden_size)
    if sp:
        x = scatter_to_sequence(x, groups.tp_group)
    results = []
    for value in VALUES:
        module = tf.TransformerLayer(CONFIG, groups, offload=value, sequence_parallel=sp)
        torch.manual_seed(1)
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.02)
        inp = x.clone().requires_grad_()
        out = module(inp)
        out.square().sum().backward()
        grads = [inp.grad] + [p.grad for p in module.parameters()]
        results.append((module.levers.offloaded_bytes, out.detach(), grads))
    return results


@pytest.mark.parametrize("world_size, sp", [(1, False), (2, True)])
def test_offloaded_modules_move_their_activations_and_change_no_number(world_size, sp):
    results = run_distributed(_layer_worker, world_size, sp)[0]
    moved = {str(v): r[0] for v, r in zip(VALUES, results)}
    assert moved["False"] == 0
    singles = [moved[str([m])] for m in ("core_attn", "mlp", "norm")]
    assert all(b > 0 for b in singles), moved
    assert moved[str(["core_attn", "mlp", "norm"])] == sum(singles), moved
    assert moved["True"] > sum(singles), moved  # + the projections' inputs, residuals
    _, out_ref, grads_ref = results[0]
    for value, (_, out, grads) in zip(VALUES[1:], results[1:]):
        assert torch.equal(out, out_ref), value
        assert len(grads) == len(grads_ref)
        for g, g_ref in zip(grads, grads_ref):
            assert torch.equal(g, g_ref), value


def _with_offload(base, offload):
    return replace(base, offload=offload)


def test_dropout_on_offload_plans_train_the_numbers_of_no_offload():
    config = replace(CONFIG, hidden_dropout=0.1, attention_dropout=0.1)
    plans = [plan_of(2, [_with_offload(layer(tp=2, recompute=r), o)] * 4, vocab_tp=2)
             for o, r in ((False, False), (True, False), (["core_attn", "norm"], ["mlp"]),
                          (["mlp"], "selective"))]
    base, *others = run_plans(gpt_recipe(config), 2, plans, steps=3)
    assert abs(base.losses[0] - GPT.reference().losses[0]) > 1e-4  # dropout really on
    for index, other in enumerate(others, 1):
        assert other.losses == pytest.approx(base.losses, rel=1e-6), f"plan {index}"
        for name, value in base.state.items():
            torch.testing.assert_close(other.state[name], value, rtol=1e-6, atol=1e-7,
                                       msg=lambda m, n=name, i=index: f"plan {i}: {n}: {m}")


OFFLOAD_PLANS = {
    # offload mixed per layer with recompute, TP of three degrees (strided too), SP, ZeRO-2/3
    "tp-sp-zero": plan_of(4, [_with_offload(layer(tp=2, sp=True), True),
                              _with_offload(layer(tp=2, dp_mode="zero3", recompute=["mlp"]),
                                            ["core_attn", "norm"]),
                              _with_offload(layer(tp=1, dp_mode="zero2"), ["mlp"]),
                              _with_offload(layer(tp=4, consecutive=False,
                                                  recompute="selective"), True)],
                          vocab_tp=2),
    # two pipeline stages, offload on both sides of the boundary, full recompute and zero1
    "pp2-mixed": plan_of(4, [_with_offload(layer(tp=2), ["core_attn", "mlp", "norm"]),
                             layer(tp=2, recompute=True),
                             _with_offload(layer(dp_mode="zero1"), True),
                             _with_offload(layer(tp=2, sp=True, recompute=["norm"]),
                                           ["core_attn", "mlp"])],
                         layers_per_stage=(2, 2), num_microbatches=2, vocab_tp=2),
}


@pytest.mark.parametrize("name", list(OFFLOAD_PLANS))
def test_offload_plans_match_one_process(name):
    GPT.check_named(4, OFFLOAD_PLANS, name)
