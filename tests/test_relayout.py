"""Relayout between every pair of layouts of a 4-rank stage, checked against batch slicing."""

from __future__ import annotations

import itertools

import pytest
import torch

from dist_utils import run_distributed
from megatron_auto.parallel.context import Layout, ParallelContext, tp_dp_rank
from megatron_auto.parallel.redistribute import batch_chunk, relayout, relayout_is_local
from megatron_auto.plan import LayerStrategy, Plan, PipelineSpec, VocabStrategy

LAYOUTS = [(1, True), (2, True), (2, False), (4, True)]


def test_local_relayout_decision_hand_cases() -> None:
    n = 4
    # tp4 (1 chunk) -> anything: every chunk lies in the whole batch
    assert relayout_is_local(Layout(0, 4, True), Layout(0, 1, True), n)
    # tp2 consecutive: chunks [0,0,1,1]; tp1: [0,1,2,3] -> nested (0,1 in 0; 2,3 in 1)
    assert relayout_is_local(Layout(0, 2, True), Layout(0, 1, True), n)
    # tp2 strided: chunks [0,1,0,1]; tp1 chunk 1 of 4 is not inside strided chunk 1 of 2
    assert not relayout_is_local(Layout(0, 2, False), Layout(0, 1, True), n)
    # fewer replicas never local
    assert not relayout_is_local(Layout(0, 1, True), Layout(0, 2, True), n)
    assert not relayout_is_local(Layout(0, 2, True), Layout(0, 2, False), n)


def test_local_decision_matches_interval_containment_brute_force() -> None:
    n, b = 16, 64
    layouts = [Layout(0, tp, c) for tp in (1, 2, 4, 8, 16) for c in (True, False)
               if c or tp not in (1, n)]

    def interval(layout: Layout, j: int) -> tuple[int, int]:
        dp = n // layout.tp
        d = tp_dp_rank(j, n, layout.tp, layout.consecutive)[1]
        return d * b // dp, (d + 1) * b // dp

    for src in layouts:
        for dst in layouts:
            want = all(interval(src, j)[0] <= interval(dst, j)[0]
                       and interval(dst, j)[1] <= interval(src, j)[1] for j in range(n))
            assert relayout_is_local(src, dst, n) == want, (src, dst)


def _worker(rank: int, world_size: int) -> list[str]:
    layers = tuple(LayerStrategy(tp=tp, tp_consecutive=c) for tp, c in LAYOUTS)
    plan = Plan(world_size=4, global_batch_size=8, num_microbatches=1,
                pipeline=PipelineSpec(1, "1f1b", (len(layers),)), vocab=VocabStrategy(tp=1),
                layers=layers)
    ctx = ParallelContext(plan)
    full = torch.arange(8 * 3, dtype=torch.float64).view(8, 3)
    upstream = torch.randn(8, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    checked = []
    for a, b in itertools.product(range(len(LAYOUTS)), repeat=2):
        src, dst = ctx.layer_groups(a), ctx.layer_groups(b)
        x = batch_chunk(full, src).clone().requires_grad_()
        y = relayout(x, src, dst, ctx)
        torch.testing.assert_close(y, batch_chunk(full, dst), rtol=0, atol=0)
        (y * batch_chunk(upstream, dst)).sum().backward()
        torch.testing.assert_close(x.grad, batch_chunk(upstream, src), rtol=0, atol=0)
        checked.append(f"{LAYOUTS[a]}->{LAYOUTS[b]}")
    with pytest.raises(ValueError, match="relayout between different stages"):
        relayout(full, ctx.layer_groups(0), Layout(1, 1, True), ctx)
    return checked


def test_relayout_all_pairs_on_four_ranks() -> None:
    results = run_distributed(_worker, 4)
    assert len(results[0]) == 16


def test_batch_chunk_rejects_indivisible_batch() -> None:
    class G:
        dp_size, dp_rank, layout = 4, 1, Layout(0, 1, True)

    with pytest.raises(ValueError, match="micro-batch of 6 samples is not divisible by the 4"):
        batch_chunk(torch.zeros(6, 2), G())
