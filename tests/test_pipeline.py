"""Pipeline schedules against a one-process reference, with a small stand-in stage model.

The stand-in is a toy language model (embedding, tanh(Linear) layers, linear head, summed cross
entropy) split into stages by the plan's layers_per_stage; every rank of a stage computes the
whole micro-batch, so no data-parallel reduction is needed and the per-rank gradients must equal
the single-process gradients of the global mean loss. tanh saves its output for backward, which
also checks that dropping the sent output keeps what backward needs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import run_distributed
from megatron_auto.parallel.pipeline import forward_backward

VOCAB, HIDDEN, SEQ = 11, 8, 5


class ToyStage(nn.Module):
    """Layers ``layer_ids`` of a toy LM; identical weights whatever the split (seeded per name)."""

    def __init__(self, layer_ids: range, num_layers: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        gen = torch.Generator().manual_seed(7)
        emb = torch.randn(VOCAB, HIDDEN, generator=gen)
        weights = [torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN ** 0.5 for _ in range(num_layers)]
        head = torch.randn(VOCAB, HIDDEN, generator=gen)
        self.emb = nn.Parameter(emb) if first else None
        self.layers = nn.ParameterDict({str(i): nn.Parameter(weights[i].clone()) for i in layer_ids})
        self.head = nn.Parameter(head) if last else None

    def forward(self, x, *, labels=None, loss_mask=None):
        if self.first:
            x = self.emb[x]  # (b, s, h)
        for w in self.layers.values():
            x = torch.tanh(x @ w.t())
        if not self.last:
            return x
        logits = x @ self.head.t()
        ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
        return (ce * loss_mask.flatten()).sum(), loss_mask.sum()

    def input_shape(self, b: int) -> tuple[int, ...]:
        return (b, SEQ, HIDDEN)

    output_shape = input_shape


class RecordingSync:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def set_microbatch(self, index: int, num_microbatches: int) -> None:
        self.calls.append(("mb", index, num_microbatches))

    def finish_grad_sync(self) -> None:
        self.calls.append(("finish",))


def make_batch(global_batch: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (global_batch, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (global_batch, SEQ), generator=gen)
    loss_mask = (torch.rand(global_batch, SEQ, generator=gen) > 0.2).float()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


def split(batch: dict, num_mb: int) -> list[dict]:
    return [{k: v.chunk(num_mb)[i] for k, v in batch.items()} for i in range(num_mb)]


def reference(layers_per_stage, num_mb_global_batch, seed):
    num_layers = sum(layers_per_stage)
    model = ToyStage(range(num_layers), num_layers, True, True)
    batch = make_batch(num_mb_global_batch, seed)
    loss_sum, tokens = model(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"])
    (loss_sum / tokens).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return float(loss_sum.detach() / tokens), grads


def _pipeline_worker(rank, world_size, layers_per_stage, schedule, cases, autocast_dtype):
    pp = len(layers_per_stage)
    n = world_size // pp
    stage_id = rank // n
    start = sum(layers_per_stage[:stage_id])
    results = []
    for num_mb, global_batch, seed in cases:
        ctx = SimpleNamespace(
            stage=stage_id, num_stages=pp, is_first_stage=stage_id == 0,
            is_last_stage=stage_id == pp - 1,
            prev_rank=rank - n if stage_id > 0 else None,
            next_rank=rank + n if stage_id < pp - 1 else None,
            device=torch.device("cpu"),
            plan=SimpleNamespace(microbatch_size=global_batch // num_mb))
        stage = ToyStage(range(start, start + layers_per_stage[stage_id]), sum(layers_per_stage),
                         ctx.is_first_stage, ctx.is_last_stage)
        batch = make_batch(global_batch, seed)
        sync = RecordingSync()
        losses = forward_backward(stage, sync, ctx, split(batch, num_mb), schedule=schedule,
                                  total_tokens=float(batch["loss_mask"].sum()),
                                  autocast_dtype=autocast_dtype)
        grads = {name: p.grad.clone() for name, p in stage.named_parameters()}
        results.append({"losses": losses, "grads": grads, "calls": sync.calls})
    return results


CASES = [(1, 4, 0), (3, 6, 1), (6, 6, 2)]  # (micro-batches, global batch, seed): 1, < and > stages


@pytest.mark.multirank
@pytest.mark.parametrize("layers_per_stage,world_size", [((3,), 1), ((3, 1), 4), ((1, 2, 1, 1), 4)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_schedule_matches_one_process(layers_per_stage, world_size, schedule):
    per_rank = run_distributed(_pipeline_worker, world_size, layers_per_stage, schedule, CASES, None)
    pp = len(layers_per_stage)
    for case_index, (num_mb, global_batch, seed) in enumerate(CASES):
        ref_loss, ref_grads = reference(layers_per_stage, global_batch, seed)
        seen = set()
        for rank, results in enumerate(per_rank):
            res = results[case_index]
            is_last = rank // (world_size // pp) == pp - 1
            assert res["calls"] == [("mb", k, num_mb) for k in range(num_mb)] + [("finish",)]
            if is_last:
                assert len(res["losses"]) == num_mb
                loss = sum(l for l, _ in res["losses"]) / sum(t for _, t in res["losses"])
                assert loss == pytest.approx(ref_loss, rel=1e-6)
            else:
                assert res["losses"] == []
            for name, grad in res["grads"].items():
                torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7)
                seen.add(name)
        assert seen == set(ref_grads)  # every parameter lives on some stage


@pytest.mark.multirank
def test_bf16_autocast_pipeline_close_to_fp32():
    per_rank = run_distributed(_pipeline_worker, 2, (2, 1), "1f1b", [(2, 4, 3)], torch.bfloat16)
    ref_loss, ref_grads = reference((2, 1), 4, 3)
    last = per_rank[1][0]
    loss = sum(l for l, _ in last["losses"]) / sum(t for _, t in last["losses"])
    assert loss == pytest.approx(ref_loss, rel=3e-2)
    for res in (per_rank[0][0], last):
        for name, grad in res["grads"].items():
            assert grad.dtype == torch.float32  # master params stay fp32
            torch.testing.assert_close(grad, ref_grads[name], rtol=0.1, atol=2e-2)


@pytest.mark.single
def test_forward_only_returns_losses_without_gradients():
    stage = ToyStage(range(2), 2, True, True)
    ctx = SimpleNamespace(stage=0, num_stages=1, is_first_stage=True, is_last_stage=True,
                          prev_rank=None, next_rank=None, device=torch.device("cpu"),
                          plan=SimpleNamespace(microbatch_size=2))
    batch = make_batch(4, 5)
    sync = RecordingSync()
    losses = forward_backward(stage, sync, ctx, split(batch, 2), schedule="1f1b",
                              total_tokens=float(batch["loss_mask"].sum()), forward_only=True)
    assert len(losses) == 2 and sync.calls == []
    assert all(p.grad is None for p in stage.parameters())
    ref_loss, _ = reference((2,), 4, 5)
    assert sum(l for l, _ in losses) / sum(t for _, t in losses) == pytest.approx(ref_loss, rel=1e-6)


@pytest.mark.single
def test_loss_scale_multiplies_gradients():
    ctx = SimpleNamespace(stage=0, num_stages=1, is_first_stage=True, is_last_stage=True,
                          prev_rank=None, next_rank=None, device=torch.device("cpu"),
                          plan=SimpleNamespace(microbatch_size=4))
    batch = make_batch(4, 9)
    grads = []
    for scale in (1.0, 1024.0):
        stage = ToyStage(range(1), 1, True, True)
        forward_backward(stage, None, ctx, split(batch, 1), schedule="gpipe",
                         total_tokens=float(batch["loss_mask"].sum()), loss_scale=scale)
        grads.append(stage.head.grad.clone())
    torch.testing.assert_close(grads[1], grads[0] * 1024.0)


@pytest.mark.single
@pytest.mark.parametrize("kwargs,message", [
    ({"schedule": "interleaved", "total_tokens": 1.0}, "schedule='interleaved'"),
    ({"schedule": "1f1b", "total_tokens": 0.0}, "total_tokens=0.0"),
])
def test_bad_arguments_raise_clear_errors(kwargs, message):
    ctx = SimpleNamespace(is_first_stage=True, is_last_stage=True, plan=SimpleNamespace(microbatch_size=1))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        forward_backward(ToyStage(range(1), 1, True, True), None, ctx, [{}], **kwargs)
    with pytest.raises(ValueError, match="microbatches is empty"):
        forward_backward(ToyStage(range(1), 1, True, True), None, ctx, [], schedule="1f1b",
                         total_tokens=1.0)


@pytest.mark.single
def test_loss_parts_are_collected_per_microbatch():
    class WithParts(ToyStage):
        def forward(self, x, *, sop_weight, **kwargs):
            loss_sum, tokens = super().forward(x, **kwargs)
            self.last_losses = {"part": loss_sum.detach() * 2, "extra": sop_weight}
            return loss_sum, tokens

    ctx = SimpleNamespace(stage=0, num_stages=1, is_first_stage=True, is_last_stage=True,
                          prev_rank=None, next_rank=None, device=torch.device("cpu"),
                          plan=SimpleNamespace(microbatch_size=2))
    batch = make_batch(4, 11)
    micro = [dict(m, sop_weight=torch.tensor(0.5)) for m in split(batch, 2)]
    stage = WithParts(range(1), 1, True, True)
    parts: list[dict] = []
    losses = forward_backward(stage, None, ctx, micro, schedule="1f1b",
                              total_tokens=float(batch["loss_mask"].sum()), loss_parts=parts)
    assert [p["part"] for p in parts] == pytest.approx([2 * l for l, _ in losses])
    assert [p["extra"] for p in parts] == [0.5, 0.5]  # 0-d values reach the stage unchanged


class _OrderRecorder:
    """A stand-in for pipeline._Stage that records the compute order a schedule runs: every
    receive hands out the micro-batch index of the forward about to run, a forward's output
    is its index, so a backward sees the index it belongs to."""

    def __init__(self, num_stages: int, stage: int, num_microbatches: int) -> None:
        self.ctx = SimpleNamespace(num_stages=num_stages, stage=stage)
        self.num_microbatches = num_microbatches
        self.order: list[tuple[bool, int, int]] = []

    def recv_forward(self, *sent):  # every p2p call: nothing to receive here
        return None

    recv_backward = send_forward_recv_backward = send_backward_recv_forward = recv_forward
    send_forward = send_backward = recv_forward

    def forward(self, index, received):
        self.order.append((True, index, self.ctx.stage))
        return index

    def keep(self, output):
        return output

    def backward(self, received, output, grad_output):
        self.order.append((False, output, self.ctx.stage))


@pytest.mark.single
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 1), (2, 4), (4, 2), (4, 4), (4, 9)])
def test_hand_written_loops_run_the_schedule_modules_order(pp, m):
    from megatron_auto.parallel.pipeline import _gpipe, _one_f_one_b
    from megatron_auto.schedule import in_flight, interleaved_order

    for stage in range(pp):
        run = _OrderRecorder(pp, stage, m)
        _one_f_one_b(run)
        assert run.order == interleaved_order(pp, 1, m, stage)
        held = [sum(1 if f else -1 for f, _, _ in run.order[:i + 1]) for i in range(len(run.order))]
        assert max(held) == in_flight("1f1b", pp, stage, m)
        run = _OrderRecorder(pp, stage, m)
        _gpipe(run)
        assert run.order == ([(True, i, stage) for i in range(m)]
                             + [(False, i, stage) for i in range(m)])
        assert in_flight("gpipe", pp, stage, m) == m
