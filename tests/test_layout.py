"""megatron_auto.layout: layouts, groups, batch slices and relayouts, checked by simulation."""

from __future__ import annotations

import pytest

from megatron_auto.layout import (Layout, all_layouts, batch_slice, dp_group_ranks, layout_of,
                                  make_layout, relayout_collectives, relayout_is_local,
                                  relayout_step, slice_bounds, tp_dp_rank, tp_group_ranks,
                                  vocab_layout)
from megatron_auto.plan import LayerStrategy

pytestmark = pytest.mark.pure

SIZES = (1, 2, 4, 8, 16)


def test_make_layout_normalises_moot_order_and_rejects_bad_tp() -> None:
    assert make_layout(1, False, 4) == Layout(1, True)
    assert make_layout(4, False, 4) == Layout(4, True)
    assert make_layout(2, False, 4) == Layout(2, False)
    assert layout_of(LayerStrategy(tp=2, tp_consecutive=False), 2) == Layout(2, True)
    assert vocab_layout(2, 8) == Layout(2, True)
    with pytest.raises(ValueError, match="tp=3: must be a positive divisor of the 4 ranks"):
        make_layout(3, True, 4)


def test_all_layouts_counts() -> None:
    assert [len(all_layouts(n)) for n in (1, 2, 4, 8, 16)] == [1, 2, 4, 6, 8]


def test_groups_partition_the_stage_and_agree_with_positions() -> None:
    for n in SIZES:
        ranks = list(range(10, 10 + n))  # a stage that does not start at rank 0
        for layout in all_layouts(n):
            tps = tp_group_ranks(ranks, layout.tp, layout.consecutive)
            dps = dp_group_ranks(ranks, layout.tp, layout.consecutive)
            assert sorted(r for g in tps for r in g) == ranks
            assert sorted(r for g in dps for r in g) == ranks
            for j, r in enumerate(ranks):
                tp_rank, dp_rank = tp_dp_rank(j, n, layout.tp, layout.consecutive)
                assert tps[dp_rank][tp_rank] == r and dps[tp_rank][dp_rank] == r
                # a TP group shares one batch slice; a DP group holds every slice once
                assert batch_slice(j, n, layout) == (dp_rank, n // layout.tp)
            for g in tps:
                assert len({batch_slice(r - 10, n, layout) for r in g}) == 1


def test_hand_cases() -> None:
    assert tp_group_ranks(range(8), 2, False) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dp_group_ranks(range(8), 2, True) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert batch_slice(1, 4, Layout(2, True)) == (0, 2)
    assert batch_slice(1, 4, Layout(2, False)) == (1, 2)
    assert relayout_is_local(Layout(2, True), Layout(1, True), 4)
    assert not relayout_is_local(Layout(1, True), Layout(2, True), 4)
    # strided tp 2 -> tp 1: rank 1 had half 1 (quarters 2, 3) but needs quarter 1
    assert not relayout_is_local(Layout(2, False), Layout(1, True), 4)
    assert slice_bounds(1, 4, 8) == (2, 4)
    with pytest.raises(ValueError, match="micro-batch of 6 samples is not divisible by the 4"):
        slice_bounds(0, 4, 6)


def _simulate(src: Layout, dst: Layout, n: int, batch: int) -> list[list[int]]:
    """Run every rank's relayout_step on sample ids; gathers concatenate the group's inputs."""
    held = []
    for j in range(n):
        i, count = batch_slice(j, n, src)
        held.append(list(range(*slice_bounds(i, count, batch))))
    out = []
    for j in range(n):
        step = relayout_step(src, dst, n, j)
        data = held[j]
        if step.gather:
            assert j in step.gather_group
            data = [x for member in step.gather_group for x in held[member]]
        per = len(data) // step.keep_count
        out.append(data[step.keep_index * per:(step.keep_index + 1) * per])
    return out


@pytest.mark.parametrize("n", SIZES)
def test_relayout_step_delivers_every_ranks_new_slice(n: int) -> None:
    batch = 2 * n
    for src in all_layouts(n):
        for dst in all_layouts(n):
            got = _simulate(src, dst, n, batch)
            for j in range(n):
                i, count = batch_slice(j, n, dst)
                assert got[j] == list(range(*slice_bounds(i, count, batch))), (src, dst, j)
            # local exactly when every new slice is inside the old one (interval containment)
            inside = all(set(got[j]) <= set(_simulate(src, src, n, batch)[j]) for j in range(n))
            assert relayout_is_local(src, dst, n) == inside
            assert any(relayout_step(src, dst, n, j).gather for j in range(n)) == (not inside)


def test_relayout_collectives_hand_cases() -> None:
    fwd, bwd = relayout_collectives(Layout(1, True), Layout(2, True), 4, 800.0)
    # tp1 -> tp2: each tp2 pair {2d, 2d+1} holds quarters 2d, 2d+1 = half d: gather that half
    # (400 B) over the pair; back: a slice
    assert [(c.kind, c.group_size, c.consecutive, c.nbytes) for c in fwd] == \
        [("all_gather", 2, True, 400.0)]
    assert bwd == ()
    # tp1 -> strided tp2: the pair {j, j+2} holds quarters j, j+2, not a half: the whole
    # micro-batch over tp1's DP group (the stage)
    fwd, _ = relayout_collectives(Layout(1, True), Layout(2, False), 4, 800.0)
    assert [(c.group_size, c.consecutive, c.nbytes) for c in fwd] == [(4, True, 800.0)]
    assert relayout_step(Layout(1, True), Layout(2, True), 4, 3).gather_group == (2, 3)
    fwd, bwd = relayout_collectives(Layout(2, True), Layout(2, False), 4, 800.0)
    # consecutive tp2's DP groups are {0,2},{1,3} (strided); strided tp2's are {0,1},{2,3}
    assert [(c.group_size, c.consecutive) for c in fwd] == [(2, False)]
    assert [(c.group_size, c.consecutive) for c in bwd] == [(2, True)]
    assert relayout_collectives(Layout(2, True), Layout(2, True), 4, 800.0) == ((), ())


# ------------------------------------------------------------------------ context parallelism
def _cp_cases():
    for n in SIZES:
        cp = 2
        while cp <= n:
            yield n, cp
            cp *= 2


@pytest.mark.parametrize("n,cp", list(_cp_cases()))
def test_cp_groups_partition_the_stage(n: int, cp: int) -> None:
    from megatron_auto.layout import (cp_group_ranks, cp_rank, layout_ranks, num_batch_slices,
                                      slice_group_ranks)
    ranks = list(range(5, 5 + n))
    m = n // cp
    for layout in all_layouts(n, cp):
        assert layout.cp == cp and layout.consecutive
        tps = tp_group_ranks(ranks, layout.tp, True, cp)
        slices = slice_group_ranks(ranks, layout.tp, True, cp)
        dps = dp_group_ranks(ranks, layout.tp, True, cp)
        cps = cp_group_ranks(ranks, cp)
        for groups in (tps, slices, dps, cps):
            assert sorted(r for g in groups for r in g) == ranks
        assert num_batch_slices(layout, n) == m // layout.tp
        for j, r in enumerate(ranks):
            tp_rank, slice_rank, dp_rank, c = layout_ranks(j, n, layout)
            assert c == cp_rank(j, n, cp) == j // m
            assert tps[c * (m // layout.tp) + slice_rank][tp_rank] == r
            assert slices[c * layout.tp + tp_rank][slice_rank] == r
            assert dps[tp_rank][dp_rank] == r
            assert cps[j % m][c] == r
            # the slice a rank holds is the one of its position in its CP block
            assert batch_slice(j, n, layout) == (slice_rank, m // layout.tp)
        for g in tps + slices:  # TP and slice groups never leave a CP block
            assert len({(r - 5) // m for r in g}) == 1
        for g in cps:  # a CP group holds one rank of every block, all at the same slice
            assert sorted((r - 5) // m for r in g) == list(range(cp))
            assert len({batch_slice(r - 5, n, layout) for r in g}) == 1
        # the DP group is every rank with the rank's TP rank: dp x cp = n / tp members
        assert all(len(g) == n // layout.tp for g in dps)


def test_cp_chunks_cover_the_sequence_once_balanced() -> None:
    from megatron_auto.layout import cp_chunks, cp_positions
    for cp in (1, 2, 4, 8):
        s = 4 * cp
        every = [p for r in range(cp) for p in cp_positions(r, cp, s)]
        assert sorted(every) == list(range(s))
        # causal work of a rank's queries over all earlier keys: the same on every rank
        work = {sum(p + 1 for p in cp_positions(r, cp, s)) for r in range(cp)}
        assert len(work) == 1
    assert cp_chunks(1, 4) == (1, 6)
    assert cp_positions(0, 2, 8) == [0, 1, 6, 7]
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by 2 x cp = 4"):
        cp_positions(0, 2, 6)


def test_cp_layout_rules() -> None:
    assert make_layout(4, False, 8, 2) == Layout(4, True, 2)  # tp = the block: moot order
    with pytest.raises(ValueError, match="strided TP groups .* not a layout under context"):
        make_layout(2, False, 8, 2)  # tp 2 of a 4-rank block, strided
    with pytest.raises(ValueError, match="tp=4 x cp=4: must divide the 8 ranks"):
        make_layout(4, True, 8, 4)
    assert layout_of(LayerStrategy(tp=2, cp=2), 8) == Layout(2, True, 2)
    assert [len(all_layouts(8, cp)) for cp in (1, 2, 4, 8)] == [6, 3, 2, 1]


@pytest.mark.parametrize("n,cp", [(4, 2), (8, 2), (8, 4), (16, 4)])
def test_cp_relayout_step_delivers_every_ranks_new_slice(n: int, cp: int) -> None:
    batch = 2 * n
    for src in all_layouts(n, cp):
        for dst in all_layouts(n, cp):
            got = _simulate(src, dst, n, batch)
            for j in range(n):
                i, count = batch_slice(j, n, dst)
                assert got[j] == list(range(*slice_bounds(i, count, batch))), (src, dst, j)
                step = relayout_step(src, dst, n, j)
                m = n // cp  # a gather never leaves the rank's CP block
                assert all(g // m == j // m for g in step.gather_group)


def test_cp_relayout_collectives_move_the_blocks_share() -> None:
    # cp 2 on 8 ranks (blocks of 4): tp 1 -> tp 2 gathers the new half of the block's batch
    # over the pair (400 B of an 800 B micro-batch, whose block share is 400 B: 200 B)
    fwd, bwd = relayout_collectives(Layout(1, True, 2), Layout(2, True, 2), 8, 800.0)
    assert [(c.kind, c.group_size, c.consecutive, c.nbytes) for c in fwd] == \
        [("all_gather", 2, True, 200.0)]
    assert bwd == ()
    # tp 2 -> tp 1: the gradient's way; backward gathers over tp 2's slice group {0, 2}
    # (strided inside the 4-rank block: span 4), the block's whole share
    fwd, bwd = relayout_collectives(Layout(2, True, 2), Layout(4, True, 2), 8, 800.0)
    assert [(c.group_size, c.consecutive, c.span, c.nbytes) for c in fwd] == [(2, False, 4, 400.0)]
    with pytest.raises(ValueError, match="relayout between cp=1 and cp=2"):
        relayout_step(Layout(1, True), Layout(1, True, 2), 4, 0)
