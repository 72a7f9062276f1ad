"""Expert tensor parallelism (``expert_tp > 1``) trains like one process, and its checkpoints
reshard to and from plans without it.

Each expert's fc1 is split over ``expert_tp`` members of the layer's TP group along its output
rows (a contiguous chunk of SwiGLU's interleaved rows) and fc2 along its input columns, inside
the EP split of the experts. The harness of tests/test_moe_equivalence.py: fp32, dropout off,
three AdamW steps, losses relative 1e-5, gradient norms 1e-4, every parameter ``rtol 1e-5,
atol 1e-6``, and the MoE statistics (assignments per expert, auxiliary-loss sums) equal to one
process. Plans on 4 ranks: tp 2 with expert_tp 2 (ep 1); ep 2 x tp 2 x expert_tp 2 with
recompute; tp 4 with expert_tp 2 (two expert-TP replicas per TP group: only replica 0 counts
the experts in the gradient norm, which a double count would change); expert_tp 2 with ZeRO-1
and with ZeRO-3 experts over their expert-DP group. SwiGLU (top-2, shared experts) and GELU (top-1, capacity).

Checkpoints (tests/test_moe_checkpoint.py's recipe): saved after 2 of 4 steps, loaded under
another plan, the last two steps equal the uninterrupted one-process run: expert_tp 2 -> one
process, ep 2 x expert_tp 2 -> ep 2 x expert_tp 1, one process -> ep 2 x expert_tp 2 with ZeRO-3
experts in a ZeRO-1 layer, expert_tp 2 with ZeRO-3 experts over 2 expert-DP ranks (FSDP2
shards of the expert-TP shards) -> ep 2 x expert_tp 2.
"""

from __future__ import annotations

import functools

import pytest

from harness import Trained, assert_same_training, layer, plan_of, run_phase
from test_moe_checkpoint import MOE_CKPT, ONE, SPLIT, STEPS as CKPT_STEPS
from test_moe_equivalence import CONFIGS, MODELS, moe_layers, summed_stats

pytestmark = pytest.mark.multirank

TP2 = plan_of(4, [layer(tp=2)] * 4, vocab_tp=2)
ETP_PLANS = {  # (base plan, fields of the MoE layers)
    "tp2-etp2": (TP2, dict(expert_tp=2)),
    "ep2-tp2-etp2-recompute": (plan_of(4, [layer(tp=2, recompute=True)] * 4, vocab_tp=2),
                               dict(ep=2, expert_tp=2)),
    "tp4-etp2": (plan_of(4, [layer(tp=4)] * 4, vocab_tp=4), dict(expert_tp=2)),
    "tp2-etp2-experts-zero1": (TP2, dict(expert_tp=2, expert_dp_mode="zero1")),
    "tp2-etp2-experts-zero3": (TP2, dict(expert_tp=2, expert_dp_mode="zero3")),
}


@functools.lru_cache(maxsize=None)
def _four_rank(name: str) -> dict[str, Trained]:
    plans = {k: moe_layers(base, name, **fields) for k, (base, fields) in ETP_PLANS.items()}
    return MODELS[name].run_named(4, plans)


@pytest.mark.parametrize("model", list(CONFIGS))
@pytest.mark.parametrize("plan", list(ETP_PLANS))
def test_expert_tp_plan_matches_one_process(model, plan):
    trained = _four_rank(model)[plan]
    MODELS[model].check(trained, plan)
    stats, ref_stats = summed_stats(trained), summed_stats(MODELS[model].reference())
    assert [sorted(s) for s in stats] == [sorted(s) for s in ref_stats]
    for step, (got, want) in enumerate(zip(stats, ref_stats)):
        for index, values in want.items():
            assert got[index]["tokens_per_expert"].tolist() == \
                values["tokens_per_expert"].tolist(), (model, plan, step)
            for key in ("balance_sum", "z_sum"):
                assert abs(got[index][key].item() - values[key].item()) <= \
                    1e-5 * abs(values[key].item()) + 1e-9, (model, plan, step, key)


# ------------------------------------------------------------------------------ checkpoints
_CONFIG = MOE_CKPT.config


def _experts(plan: dict, **fields) -> dict:
    out = dict(plan, layers=[dict(x) for x in plan["layers"]])
    for i in _CONFIG.moe_layers:
        out["layers"][i].update(fields)
    return out


ETP2 = _experts(TP2, expert_tp=2)
EP2_ETP2 = _experts(TP2, ep=2, expert_tp=2)
EP2 = _experts(TP2, ep=2)
EP2_ETP2_ZERO = _experts(plan_of(4, [layer(tp=2, dp_mode="zero1")] * 4, vocab_tp=2),
                         ep=2, expert_tp=2, expert_dp_mode="zero3")
CKPT_CASES = {
    "etp2->one": (4, ETP2, 1, ONE),
    "ep2-etp2->ep2-etp1": (4, EP2_ETP2, 4, EP2),
    "one->ep2-etp2-zero1-layer-zero3-experts": (1, ONE, 4, EP2_ETP2_ZERO),
    # FSDP2 shards of expert-TP shards (expert-DP 2): both dims and the DTensor's offsets
    "etp2-zero3-experts->ep2-etp2": (4, _experts(TP2, expert_tp=2, expert_dp_mode="zero3"),
                                     4, EP2_ETP2),
}
_REF: dict[str, Trained] = {}


@pytest.mark.parametrize("name", list(CKPT_CASES))
def test_expert_tp_checkpoint_reshards(tmp_path, name):
    save_world, save_plan, load_world, load_plan = CKPT_CASES[name]
    if "ref" not in _REF:
        _REF["ref"] = run_phase(MOE_CKPT, 1, ONE, 0, CKPT_STEPS)
    run_phase(MOE_CKPT, save_world, save_plan, 0, SPLIT, save_dir=tmp_path)
    resumed = run_phase(MOE_CKPT, load_world, load_plan, SPLIT, CKPT_STEPS, load_dir=tmp_path)
    assert tuple(resumed.state["layers.0.mlp.experts.linear_fc1.weight"].shape) == (
        _CONFIG.moe.num_experts, 2 * _CONFIG.expert_ffn_hidden_size, _CONFIG.hidden_size)
    assert_same_training(_REF["ref"], resumed, name)


# ------------------------------------------------------------------------------ the flag
def test_pretrain_gpt_trains_expert_tp2_like_one_process(tmp_path):
    """``--tensor-model-parallel-size 2 --expert-tensor-parallel-size 2`` on 2 gloo ranks."""
    from harness import metrics_losses, run_main
    from test_moe_flags import MODEL

    from megatron_auto.plan import Plan

    losses = {}
    for world, extra in ((1, []), (2, ["--tensor-model-parallel-size", "2",
                                       "--expert-tensor-parallel-size", "2"])):
        metrics = tmp_path / f"m{world}.jsonl"
        plan_out = tmp_path / f"plan{world}.json"
        assert run_main("pretrain_gpt", world, [*MODEL, *extra, "--metrics-file",
                                                str(metrics), "--plan-out", str(plan_out)],
                        env={"MEGATRON_AUTO_CACHE": str(tmp_path / "cache")}) == [0] * world
        losses[world] = metrics_losses(metrics)
    # the MoE layer (0 of 2, --moe-layer-freq 2) ran with expert TP 2, the dense one without
    trained = Plan.load(tmp_path / "plan2.json")
    assert [(la.tp, la.expert_tp) for la in trained.layers] == [(2, 2), (2, 1)]
    assert sorted(losses[2]) == [1, 2, 3]
    for it, loss in losses[1].items():
        assert losses[2][it] == pytest.approx(loss, rel=1e-5)


def test_auto_parallel_takes_the_flag_as_a_pin(tmp_path):
    # --auto-parallel searches expert TP per MoE layer; a typed value pins it (and the search
    # prices it: planner/cost/moe.py)
    from megatron_auto.plan import Plan
    from harness import run_main
    from test_moe_flags import MODEL

    plan_out = tmp_path / "plan.json"
    argv = [*MODEL, "--auto-parallel", "--tensor-model-parallel-size", "2",
            "--expert-tensor-parallel-size", "2", "--plan-out", str(plan_out)]
    assert run_main("pretrain_gpt", 2, argv,
                    env={"MEGATRON_AUTO_CACHE": str(tmp_path / "cache")}) == [0, 0]
    plan = Plan.load(plan_out)
    moe = [layer for i, layer in enumerate(plan.layers) if i % 2 == 0]  # --moe-layer-freq 2
    assert moe and all(layer.tp == 2 and layer.expert_tp == 2 for layer in moe)


# ------------------------------------------------------------------------------ memory
def test_expert_memory_per_rank_halves_from_expert_tp1_to_expert_tp2():
    """tests/test_moe_memory.py's meter on 2 ranks at tp 2: the routed experts' parameters and
    AdamW moments per rank with expert_tp 2 are exactly half of expert_tp 1's (replicated over
    TP); the rest of the model is unchanged."""
    from dist_utils import run_distributed
    from test_moe_memory import MODEL, _worker

    base = plan_of(2, [layer(tp=2)] * 4, vocab_tp=2)
    plans = [base, moe_layers(base, MODEL, expert_tp=2)]
    per_rank = run_distributed(_worker, 2, plans, CONFIGS[MODEL].to_dict())
    config = CONFIGS[MODEL]
    h, f, e = config.hidden_size, config.expert_ffn_hidden_size, config.moe.num_experts
    full = len(config.moe_layers) * e * 3 * h * f * 4 * 3  # SwiGLU, fp32, param + 2 moments
    for etp1, etp2 in per_rank:
        assert etp1["experts"] == full
        assert etp2["experts"] * 2 == etp1["experts"]
        assert etp2["dense"] == etp1["dense"]
