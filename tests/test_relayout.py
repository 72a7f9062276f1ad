"""Relayout between every pair of layouts of a 4-rank stage, checked against batch slicing.

(The local-or-gather decision itself is tested in test_layout.py.)"""

from __future__ import annotations

import itertools

import pytest
import torch

from dist_utils import run_distributed
from megatron_auto.layout import StageLayout
from megatron_auto.parallel.context import ParallelContext
from megatron_auto.parallel.redistribute import batch_chunk, relayout
from megatron_auto.plan import LayerStrategy, Plan, PipelineSpec, VocabStrategy

LAYOUTS = [(1, True), (2, True), (2, False), (4, True)]


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
        if y is not x:  # a moved slice is its own tensor: it keeps no source or gather alive
            assert y.untyped_storage().nbytes() == y.numel() * y.element_size()
        (y * batch_chunk(upstream, dst)).sum().backward()
        torch.testing.assert_close(x.grad, batch_chunk(upstream, src), rtol=0, atol=0)
        checked.append(f"{LAYOUTS[a]}->{LAYOUTS[b]}")
    with pytest.raises(ValueError, match="relayout between different stages"):
        relayout(full, ctx.layer_groups(0), StageLayout(1, 1, True), ctx)
    return checked


@pytest.mark.multirank
def test_relayout_all_pairs_on_four_ranks() -> None:
    results = run_distributed(_worker, 4)
    assert len(results[0]) == 16


@pytest.mark.single
def test_batch_chunk_rejects_indivisible_batch() -> None:
    class G:
        slice_size, slice_rank, layout = 4, 1, StageLayout(0, 1, True)  # batch slices

    with pytest.raises(ValueError, match="micro-batch of 6 samples is not divisible by the 4"):
        batch_chunk(torch.zeros(6, 2), G())
