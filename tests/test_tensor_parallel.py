"""TP layers, vocab-parallel cross entropy and the RNG tracker against unsharded references.

Each worker builds the layer on a TP group of all ranks, loads its shard of a full reference
weight, and compares outputs and input/weight gradients with the unsharded torch module on the
same inputs. Tolerance: fp32 sums in a different order, so rtol=1e-5, atol=1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_distributed
from megatron_auto.parallel.context import ParallelContext
from megatron_auto.parallel.random import REPLICATED, TENSOR_PARALLEL, RNGTracker, checkpoint
from megatron_auto.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                                    VocabParallelEmbedding,
                                                    vocab_parallel_cross_entropy)
from megatron_auto.plan import Plan

TOL = dict(rtol=1e-5, atol=1e-6)


def _groups(world_size: int, consecutive: bool = True):
    plan = Plan.uniform(world_size, 1, global_batch_size=world_size, tp=world_size,
                        tp_consecutive=consecutive)
    return ParallelContext(plan).layer_groups(0)


def _chunk(t: torch.Tensor, dim: int, groups) -> torch.Tensor:
    return t.chunk(groups.tp_size, dim=dim)[groups.tp_rank]


def _linear_worker(rank: int, world_size: int) -> None:
    g = _groups(world_size)
    gen = torch.Generator().manual_seed(0)
    b, s, h_in, h_out = 2, 3, 8, 12
    ref = torch.nn.Linear(h_in, h_out)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(h_out, h_in, generator=gen))
        ref.bias.copy_(torch.randn(h_out, generator=gen))
    x_full = torch.randn(b, s, h_in, generator=gen)
    up = torch.randn(b, s, h_out, generator=gen)  # upstream gradient of the full output
    x_ref = x_full.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * up).sum().backward()

    for gather_output in (False, True):
        col = ColumnParallelLinear(h_in, h_out, g, gather_output=gather_output)
        with torch.no_grad():
            col.weight.copy_(_chunk(ref.weight, 0, g))
            col.bias.copy_(_chunk(ref.bias, 0, g))
        x = x_full.clone().requires_grad_()
        y = col(x)
        want_y = y_ref if gather_output else _chunk(y_ref, -1, g)
        torch.testing.assert_close(y, want_y.detach(), **TOL)
        (y * (up if gather_output else _chunk(up, -1, g))).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
        torch.testing.assert_close(col.weight.grad, _chunk(ref.weight.grad, 0, g), **TOL)
        torch.testing.assert_close(col.bias.grad, _chunk(ref.bias.grad, 0, g), **TOL)

    ref2 = torch.nn.Linear(h_out, h_in)  # row-parallel reference: in=h_out, out=h_in
    with torch.no_grad():
        ref2.weight.copy_(torch.randn(h_in, h_out, generator=gen))
        ref2.bias.copy_(torch.randn(h_in, generator=gen))
    z_full = torch.randn(b, s, h_out, generator=gen)
    up2 = torch.randn(b, s, h_in, generator=gen)
    z_ref = z_full.clone().requires_grad_()
    (ref2(z_ref) * up2).sum().backward()
    for input_is_parallel in (True, False):
        row = RowParallelLinear(h_out, h_in, g, input_is_parallel=input_is_parallel)
        with torch.no_grad():
            row.weight.copy_(_chunk(ref2.weight, 1, g))
            row.bias.copy_(ref2.bias)
        z = (_chunk(z_full, -1, g) if input_is_parallel else z_full).clone().requires_grad_()
        out = row(z)
        torch.testing.assert_close(out, ref2(z_full).detach(), **TOL)
        (out * up2).sum().backward()
        want = _chunk(z_ref.grad, -1, g) if input_is_parallel else z_ref.grad
        torch.testing.assert_close(z.grad, want, **TOL)
        torch.testing.assert_close(row.weight.grad, _chunk(ref2.weight.grad, 1, g), **TOL)
        torch.testing.assert_close(row.bias.grad, ref2.bias.grad, **TOL)


def _vocab_worker(rank: int, world_size: int) -> None:
    g = _groups(world_size, consecutive=False)
    gen = torch.Generator().manual_seed(1)
    vocab, h = 16, 6
    table = torch.randn(vocab, h, generator=gen)
    tokens = torch.randint(0, vocab, (3, 5), generator=gen)
    up = torch.randn(3, 5, h, generator=gen)
    ref = table.clone().requires_grad_()
    (F.embedding(tokens, ref) * up).sum().backward()
    emb = VocabParallelEmbedding(vocab, h, g)
    with torch.no_grad():
        emb.weight.copy_(_chunk(table, 0, g))
    out = emb(tokens)
    torch.testing.assert_close(out, F.embedding(tokens, table), **TOL)
    (out * up).sum().backward()
    torch.testing.assert_close(emb.weight.grad, _chunk(ref.grad, 0, g), **TOL)

    # cross entropy with large logits (stability) and an upstream weight per token
    logits = torch.randn(4, 7, vocab, generator=gen) * 30.0 + 1000.0
    target = torch.randint(0, vocab, (4, 7), generator=gen)
    weight = torch.rand(4, 7, generator=gen)
    ref_logits = logits.clone().requires_grad_()
    ref_loss = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1),
                               reduction="none").view(4, 7)
    (ref_loss * weight).sum().backward()
    mine = _chunk(logits, -1, g).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, target, g)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-4)
    (loss * weight).sum().backward()
    torch.testing.assert_close(mine.grad, _chunk(ref_logits.grad, -1, g), **TOL)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_linear_layers_match_unsharded(world_size: int) -> None:
    run_distributed(_linear_worker, world_size)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_embedding_and_cross_entropy_match_unsharded(world_size: int) -> None:
    run_distributed(_vocab_worker, world_size)


@pytest.mark.single
def test_cross_entropy_single_rank_path_and_bf16_logits() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 11, generator=gen).to(torch.bfloat16)
    target = torch.randint(0, 11, (3,), generator=gen)
    loss = vocab_parallel_cross_entropy(logits, target)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), target, reduction="none"))


@pytest.mark.multirank
def test_bad_tensor_parallel_sizes_are_named() -> None:
    def worker(rank: int, world_size: int) -> None:
        g = _groups(world_size)
        with pytest.raises(ValueError, match="output features=6 is not divisible by the "
                                             "tensor-parallel size 4"):
            ColumnParallelLinear(3, 6, g)
        with pytest.raises(ValueError, match="vocabulary rows=10"):
            VocabParallelEmbedding(10, 3, g)

    run_distributed(worker, 4)


def _rng_worker(rank: int, world_size: int) -> dict:
    tracker = RNGTracker(7, stage=0, local_index=rank)
    default_before = torch.get_rng_state()
    with tracker.fork(REPLICATED):
        rep = torch.rand(4)
    with tracker.fork(TENSOR_PARALLEL):
        sharded = torch.rand(4)
    with tracker.fork(REPLICATED):
        rep2 = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), default_before)  # the default stream is untouched
    return {"rep": rep, "rep2": rep2, "sharded": sharded}


@pytest.mark.multirank
def test_rng_streams_replicated_vs_per_rank() -> None:
    results = run_distributed(_rng_worker, 2)
    assert torch.equal(results[0]["rep"], results[1]["rep"])
    assert torch.equal(results[0]["rep2"], results[1]["rep2"])
    assert not torch.equal(results[0]["rep"], results[0]["rep2"])  # the stream advances
    assert not torch.equal(results[0]["sharded"], results[1]["sharded"])
    again = RNGTracker(7, stage=0, local_index=0)  # deterministic from (seed, stage, index)
    with again.fork(TENSOR_PARALLEL):
        assert torch.equal(torch.rand(4), results[0]["sharded"])


@pytest.mark.single
def test_checkpoint_replays_dropout_masks() -> None:
    def block(x: torch.Tensor, tracker: RNGTracker) -> torch.Tensor:
        with tracker.fork(TENSOR_PARALLEL):
            y = F.dropout(x * 2.0, p=0.5, training=True)
        with tracker.fork(REPLICATED):
            return F.dropout(y.sin(), p=0.3, training=True)

    x0 = torch.randn(64, 32)
    grads = []
    for recompute in (False, True):
        tracker = RNGTracker(3, stage=0, local_index=0)
        x = x0.clone().requires_grad_()
        if recompute:
            out = checkpoint(lambda t: block(t, tracker), tracker, x)
        else:
            out = block(x, tracker)
        with tracker.fork(TENSOR_PARALLEL):  # advance the stream between forward and backward
            torch.rand(10)
        out.sum().backward()
        grads.append((out.detach(), x.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=0)


def _comm_worker(rank: int, world_size: int) -> None:
    import warnings

    from megatron_auto.parallel import comm

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the torch 2.13 deprecation warnings must not appear
        out = torch.empty(2 * world_size, 3)
        comm.all_gather_into_tensor(out, torch.full((2, 3), float(rank)))
        assert out[:, 0].tolist() == [float(r) for r in range(world_size) for _ in range(2)]
        mine = torch.empty(1, 3)
        comm.reduce_scatter_tensor(mine, torch.arange(world_size * 3.0).view(world_size, 3))
        want = world_size * torch.arange(rank * 3.0, rank * 3.0 + 3).view(1, 3)
        torch.testing.assert_close(mine, want)
        cat = comm.all_gather_dim(torch.full((2, 1), float(rank)), None, dim=-1)
        assert cat.shape == (2, world_size) and cat[0].tolist() == list(map(float, range(world_size)))


@pytest.mark.multirank
def test_comm_shim_gathers_and_scatters_without_warnings() -> None:
    run_distributed(_comm_worker, 2)
