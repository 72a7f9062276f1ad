"""GPTStage under TP, mixed per-layer layouts and pipeline stages vs a one-process reference.

Each distributed worker runs forward and backward of one micro-batch, then finishes what the
data-parallel runtime would do with a small stand-in (sum gradients over each parameter's DP
group, and the tied embedding over the first/last-stage pair), gathers full tensors by FQN and
returns them. The reference is the same model under a world-size-1 plan (a forked 1-rank world).
Tolerance: fp32 with different summation orders, rtol=1e-5 and atol=1e-7 on values ~1e-2.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from megatron_auto.config import ModelConfig
from megatron_auto.models.gpt import GPTStage
from megatron_auto.models.init import gather_full_state
from megatron_auto.parallel.context import ParallelContext
from megatron_auto.plan import LayerStrategy, Plan, PipelineSpec, VocabStrategy

pytestmark = pytest.mark.multirank

TOL = dict(rtol=1e-5, atol=1e-7)
CONFIG = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                     seq_length=8, vocab_size=100, make_vocab_size_divisible_by=32,
                     hidden_dropout=0.0, attention_dropout=0.0)
VARIANT = dataclasses.replace(CONFIG, activation="swiglu", normalization="rmsnorm",
                              position_embedding_type="rope",
                              untie_embeddings_and_output_weights=True)
BATCH = 8


def make_batch(config: ModelConfig, batch: int = BATCH, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    s = config.seq_length
    return {"tokens": torch.randint(0, config.vocab_size, (batch, s), generator=gen),
            "labels": torch.randint(0, config.vocab_size, (batch, s), generator=gen),
            "loss_mask": (torch.rand(batch, s, generator=gen) > 0.2).float()}


def plan_of(world_size: int, layers: list[tuple[int, bool, bool]], *, vocab_tp: int,
            layers_per_stage: tuple[int, ...] | None = None) -> Plan:
    strategies = tuple(LayerStrategy(tp=tp, tp_consecutive=c, recompute=r) for tp, c, r in layers)
    lps = layers_per_stage or (len(layers),)
    return Plan(world_size=world_size, global_batch_size=BATCH, num_microbatches=1,
                pipeline=PipelineSpec(len(lps), "1f1b", lps), vocab=VocabStrategy(tp=vocab_tp),
                layers=strategies)


def finish_grad_sync(stage: GPTStage, ctx: ParallelContext) -> None:
    """Stand-in for the data-parallel runtime: DP sums and the tied-embedding sum."""
    for fqn, param in stage.named_parameters():
        if param.grad is None:
            continue
        groups = stage.groups_for_parameter(fqn)
        if groups.dp_size > 1:
            dist.all_reduce(param.grad, group=groups.dp_group)
        if fqn == "embedding.word_embeddings.weight" and ctx.embedding_group is not None:
            dist.all_reduce(param.grad, group=ctx.embedding_group)


def run_stage(stage: torch.nn.Module, ctx: ParallelContext, batch: dict[str, torch.Tensor],
              total_tokens: float, *, first_input: str = "tokens",
              kwargs: dict[str, torch.Tensor] | None = None) -> float | None:
    """Forward + backward of one micro-batch through every stage, p2p by plain send/recv: the
    first stage reads ``batch[first_input]``, every stage gets ``kwargs``, the last one the
    labels and loss mask too.

    Returns the global loss sum on last-stage ranks (summed over vocab-DP chunks), else None.
    """
    kwargs = kwargs or {}
    if ctx.is_first_stage:
        x = batch[first_input]
    else:
        x = torch.empty(stage.input_shape(BATCH))
        dist.recv(x, src=ctx.prev_rank)
        x.requires_grad_()
    last = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]} if ctx.is_last_stage else {}
    out = stage(x, **last, **kwargs)
    loss = None
    if ctx.is_last_stage:
        loss_sum, _ = out
        (loss_sum / total_tokens).backward()
        loss = loss_sum.detach().clone()
        if stage.vocab_groups.dp_size > 1:
            dist.all_reduce(loss, group=stage.vocab_groups.dp_group)
        loss = loss.item()
    else:
        assert tuple(out.shape) == stage.output_shape(BATCH)
        dist.send(out.detach().contiguous(), dst=ctx.next_rank)
        grad = torch.empty_like(out)
        dist.recv(grad, src=ctx.next_rank)
        out.backward(grad)
    if not ctx.is_first_stage:
        dist.send(x.grad.contiguous(), dst=ctx.prev_rank)
    return loss


def _worker(rank: int, world_size: int, plan: Plan, config: ModelConfig) -> dict:
    ctx = ParallelContext(plan)
    stage = GPTStage(config, ctx, seed=42)
    params = gather_full_state(stage, ctx)
    batch = make_batch(config)
    total = batch["loss_mask"].sum().item()
    loss = run_stage(stage, ctx, batch, total)
    finish_grad_sync(stage, ctx)
    return {"stage": ctx.stage, "loss": loss, "params": params,
            "grads": gather_full_state(stage, ctx, grads=True),
            "layers": sorted(stage.layers.keys(), key=int)}


def _reference(config: ModelConfig) -> dict:
    plan = plan_of(1, [(1, True, False)] * config.num_layers, vocab_tp=1)
    return run_distributed(_worker, 1, plan, config)[0]


_REFERENCES: dict = {}


def reference(config: ModelConfig) -> dict:
    key = repr(config)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(config)
    return _REFERENCES[key]


def check_against_reference(results: list[dict], ref: dict) -> None:
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses
    for loss in losses:
        assert loss == pytest.approx(ref["loss"], rel=1e-6)
    seen = set()
    for r in results:
        for fqn, value in r["params"].items():
            # plan-independent init: shards gathered back are bit-identical to the reference
            torch.testing.assert_close(value, ref["params"][fqn], rtol=0, atol=0, msg=fqn)
        for fqn, grad in r["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][fqn], **TOL, msg=fqn)
            seen.add(fqn)
    assert seen == set(ref["grads"]), set(ref["grads"]) ^ seen


PLANS = {
    "tp2": plan_of(4, [(2, True, False)] * 4, vocab_tp=2),
    "tp4": plan_of(4, [(4, True, False)] * 4, vocab_tp=4),
    "mixed": plan_of(4, [(1, True, False), (2, False, True), (4, True, False), (2, True, True)],
                     vocab_tp=2),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_gpt_matches_single_process(name: str) -> None:
    results = run_distributed(_worker, 4, PLANS[name], CONFIG)
    check_against_reference(results, reference(CONFIG))


def test_gpt_variant_swiglu_rmsnorm_rope_untied_mixed_layouts() -> None:
    results = run_distributed(_worker, 4, PLANS["mixed"], VARIANT)
    ref = reference(VARIANT)
    assert "output_layer.weight" in ref["grads"]
    assert "embedding.position_embeddings.weight" not in ref["params"]
    check_against_reference(results, ref)


def test_gpt_pipeline_stages_hold_only_their_layers() -> None:
    # stage 0: layers 0 (tp2 strided), 1 (tp1); stage 1: layers 2, 3 (tp2 consecutive, tp1)
    plan = plan_of(4, [(2, False, False), (1, True, True), (2, True, False), (1, True, False)],
                   vocab_tp=2, layers_per_stage=(2, 2))
    results = run_distributed(_worker, 4, plan, CONFIG)
    for r in results:
        want = ["0", "1"] if r["stage"] == 0 else ["2", "3"]
        assert r["layers"] == want
        names = set(r["params"])
        assert all(n.startswith(("embedding.", "layers.", "final_norm.")) for n in names)
        assert any(n.startswith(f"layers.{want[0]}.") for n in names)
        if r["stage"] == 0:
            assert "final_norm.weight" not in names
            assert "embedding.position_embeddings.weight" in names
        else:  # the last stage keeps the tied word embeddings as its LM head, no positions
            assert "embedding.word_embeddings.weight" in names
            assert "embedding.position_embeddings.weight" not in names
    check_against_reference(results, reference(CONFIG))


def test_gpt_rejects_plan_that_does_not_fit_model() -> None:
    def worker(rank: int, world_size: int) -> str:
        plan = plan_of(2, [(2, True, False)] * 4, vocab_tp=1)
        config = dataclasses.replace(CONFIG, num_attention_heads=1, hidden_size=32)
        try:
            GPTStage(config, ParallelContext(plan))
        except ValueError as err:
            return str(err)
        return "no error"

    msg = run_distributed(worker, 2)[0]
    assert "plan field layers[0].tp=2: must divide --num-attention-heads=1" in msg


def _dropout_worker(rank: int, world_size: int) -> dict:
    config = dataclasses.replace(CONFIG, hidden_dropout=0.2, attention_dropout=0.2)
    batch = make_batch(config)
    out = {}
    for recompute in (False, True):
        plan = plan_of(4, [(2, False, recompute), (2, True, recompute), (1, True, False),
                           (4, True, recompute)], vocab_tp=2)
        ctx = ParallelContext(plan)
        stage = GPTStage(config, ctx, seed=5).train()
        loss_sum, _ = stage(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"])
        loss_sum.backward()
        out[recompute] = (loss_sum.item(), {n: p.grad.clone() for n, p in stage.named_parameters()})
    torch.testing.assert_close(out[True][1], out[False][1], rtol=0, atol=0)
    # dropout with the same seed is deterministic, and differs from the no-dropout model
    no_drop = GPTStage(CONFIG, ctx, seed=5)
    plain_loss = no_drop(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"])[0]
    return {"loss": out[True][0], "loss_no_recompute": out[False][0], "plain": plain_loss.item()}


def test_dropout_is_tp_consistent_and_recompute_replays_masks() -> None:
    results = run_distributed(_dropout_worker, 4)
    for r in results:
        assert r["loss"] == r["loss_no_recompute"]
        assert r["loss"] != r["plain"]
    # vocab tp=2 (consecutive): ranks {0,1} and {2,3} hold the same batch chunk; replicated
    # dropout masks agree inside a TP group, so their losses are identical
    assert results[0]["loss"] == results[1]["loss"]
    assert results[2]["loss"] == results[3]["loss"]


def test_one_rank_plan_runs_without_torch_distributed() -> None:
    assert not dist.is_initialized()
    plan = plan_of(1, [(1, True, False)] * CONFIG.num_layers, vocab_tp=1)
    ctx = ParallelContext(plan)
    assert (ctx.rank, ctx.world_size, ctx.stage_group, ctx.embedding_group) == (0, 1, None, None)
    stage = GPTStage(CONFIG, ctx, seed=42)
    batch = make_batch(CONFIG)
    loss_sum, num_tokens = stage(batch["tokens"], labels=batch["labels"],
                                 loss_mask=batch["loss_mask"])
    (loss_sum / batch["loss_mask"].sum()).backward()
    ref = reference(CONFIG)
    assert loss_sum.item() == pytest.approx(ref["loss"], rel=1e-6)
    assert num_tokens.item() == batch["loss_mask"].sum().item()
    grads = gather_full_state(stage, ctx, grads=True)
    for fqn, grad in ref["grads"].items():
        torch.testing.assert_close(grads[fqn], grad, rtol=1e-6, atol=1e-8, msg=fqn)
