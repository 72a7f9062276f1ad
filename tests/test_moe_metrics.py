"""The MoE metrics of an iteration (training/moe_metrics.py, docs/design.md §5.3) are the same
under every plan and are what the definitions give.

One process, two-rank expert parallelism (ep 2 over dp 2) and two-rank tensor parallelism train
the same MoE GPT (top-2 with shared experts, every other layer MoE, load-balancing and z-loss
on) for three steps; each step's ``moe_aux_loss`` and ``moe_z_loss`` agree with one process's to
rtol 1e-5 and the per-expert counts exactly. The one-process values are checked against the
token-by-token reference (tests/reference/moe.py) run on the router inputs and router weights
each MoE block saw in that step. Then ``pretrain_gpt.py`` writes them: the console line shows
``load_balancing_loss``, ``z_loss`` and the counts, and the metrics file carries the keys.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from harness import RTOL, STEPS, layer, plan_of, run_main, metrics_records
from megatron_auto.families.registry import family_of
from reference.moe import RefMoE, moe_forward
from test_moe_equivalence import CONFIGS, MODELS, moe_layers

pytestmark = pytest.mark.multirank

CONFIG = CONFIGS["top2-shared"]


def _recording_stage(config, ctx, seed):
    """The GPT stage, with each MoE block's input and router weight kept per forward (not the
    recomputes) on ``stage.router_inputs``."""
    from megatron_auto.models.moe import MoELayer, _in_backward

    stage = family_of(config).build_stage(config, ctx, seed)
    stage.router_inputs = []

    def keep(name):
        def hook(module, args):
            if not _in_backward():
                stage.router_inputs.append((name, args[0].detach().clone(),
                                            module.router.weight.detach().clone()))
        return hook

    for name, module in stage.named_modules():
        if isinstance(module, MoELayer):
            module.register_forward_pre_hook(keep(name))
    return stage


def _take_inputs(trainer):
    out, trainer.stage.router_inputs = trainer.stage.router_inputs, []
    return out


RECIPE = dataclasses.replace(MODELS["top2-shared"].recipe, stage=_recording_stage,
                             observe=_take_inputs)
PLANS = {
    "ep2": moe_layers(plan_of(2, [layer()] * 4), "top2-shared", ep=2),
    "tp2": plan_of(2, [layer(tp=2)] * 4, vocab_tp=2),
}


@functools.lru_cache(maxsize=None)
def _runs():
    from harness import run_named

    one = run_named(RECIPE, 1, {"one": plan_of(1, [layer()] * 4)})["one"]
    return one, run_named(RECIPE, 2, PLANS)


def _reference_metrics(inputs):
    """moe_aux_loss, moe_z_loss and the counts per MoE layer from the reference block."""
    moe = CONFIG.moe
    cfg = RefMoE(num_experts=moe.num_experts, topk=moe.router_topk, activation="swiglu")
    h, f = CONFIG.hidden_size, CONFIG.expert_ffn_hidden_size
    zeros = {"gate": torch.zeros(f, h, dtype=torch.float64),
             "up": torch.zeros(f, h, dtype=torch.float64),
             "down": torch.zeros(h, f, dtype=torch.float64)}  # the experts do not matter here
    per_layer: dict[str, list] = {}
    for name, x, router in inputs:
        _, balance, z, counts = moe_forward(x.double(), router.double(),
                                            [zeros] * moe.num_experts, cfg)
        per_layer.setdefault(name, []).append((balance, z, counts))
    assert len(per_layer) == len(CONFIG.moe_layers)
    aux, zl, tokens = [], [], []
    for name in sorted(per_layer, key=lambda n: int(n.split(".")[1])):
        mbs = per_layer[name]  # one entry per micro-batch
        balance = [float(v) for b, _, _ in mbs for v in b]
        zs = [float(v) for _, z, _ in mbs for v in z]
        aux.append(sum(balance) / len(balance))
        zl.append(sum(zs) / len(zs))
        tokens.append([sum(c[e] for _, _, c in mbs) for e in range(moe.num_experts)])
    return sum(aux) / len(aux), sum(zl) / len(zl), tokens


def test_one_process_metrics_match_the_reference_block():
    one, _ = _runs()
    observed = one.observed[0]
    assert len(observed) == STEPS
    for step, (result, inputs) in enumerate(zip(one.results, observed)):
        metrics = result["moe_metrics"]
        aux, z, tokens = _reference_metrics(inputs)
        assert metrics["moe_aux_loss"] == pytest.approx(aux, rel=RTOL), step
        assert metrics["moe_z_loss"] == pytest.approx(z, rel=RTOL), step
        assert metrics["moe_tokens_per_expert"] == tokens, step
        # top-2, dropless: every token of the global batch is assigned twice per layer
        assert all(sum(c) == 8 * CONFIG.seq_length * 2 for c in tokens)


@pytest.mark.parametrize("plan", list(PLANS))
def test_metrics_equal_across_plans(plan):
    one, runs = _runs()
    got = [r["moe_metrics"] for r in runs[plan].results]
    want = [r["moe_metrics"] for r in one.results]
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want)):
        assert set(g) == {"moe_aux_loss", "moe_z_loss", "moe_tokens_per_expert"}
        for key in ("moe_aux_loss", "moe_z_loss"):
            assert g[key] == pytest.approx(w[key], rel=RTOL), (plan, step, key)
        assert g["moe_tokens_per_expert"] == w["moe_tokens_per_expert"], (plan, step)


MOE_FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "128",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "4",
             "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data", "--train-iters", "2",
             "--log-interval", "2", "--num-experts", "4", "--moe-router-topk", "2",
             "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "0.01",
             "--moe-z-loss-coeff", "0.001", "--swiglu", "--disable-bias-linear"]


def test_pretrain_prints_and_writes_the_moe_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    [(code, out)] = run_main("pretrain_gpt", 1, [*MOE_FLAGS, "--metrics-file", str(metrics)],
                             capture="stdout")
    assert code == 0, out[-2000:]
    [record] = metrics_records(metrics)
    lines = [line for line in out.splitlines() if "iteration        2/" in line]
    assert len(lines) == 1, out[-2000:]
    assert f"load_balancing_loss: {record['moe_aux_loss']:.6E}" in lines[0]
    assert f"z_loss: {record['moe_z_loss']:.6E}" in lines[0]
    counts = record["moe_tokens_per_expert"]
    # two MoE layers (every layer by default), two iterations of 4 x 16 tokens, top-2
    assert len(counts) == 2 and all(sum(c) == 2 * 4 * 16 * 2 for c in counts)
    assert "tokens per expert: " + ",".join(
        str(a + b) for a, b in zip(*counts)) in lines[0]
    assert record["moe_aux_loss"] > 0 and record["moe_z_loss"] > 0
