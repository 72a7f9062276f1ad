"""Interleaved 1F1B (``pipeline.virtual_size`` > 1): order, equivalence, memory, bad input.

Equivalence runs train a tiny 10-layer GPT (fp32, dropout off, AdamW with clipping, 3 steps)
under interleaved plans and compare losses, gradient norms and updated parameters with one
process, relative 1e-5 (the docs/design.md §4 invariant).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness import Equivalence, layer, plan_of
from megatron_auto.parallel.interleaved import gradient_send_releases
from megatron_auto.schedule import interleaved_order, num_warmup
from megatron_auto.plan import Plan, PlanError
from test_equivalence import CONFIG, gpt_recipe

CONFIG10 = replace(CONFIG, num_layers=10)


# ------------------------------------------------------------------------------- order
def _simulate(pp: int, v: int, num_mb: int) -> int:
    """Run every stage's order with non-blocking sends and blocking receives; return the number
    of rounds, or fail on a deadlock. A forward of chunk c > 0 needs the forward of chunk c - 1
    (another stage) done; a backward of chunk c needs its own forward and, below the last
    chunk, the backward of chunk c + 1."""
    orders = [interleaved_order(pp, v, num_mb, k) for k in range(pp)]
    done: set = set()
    cursor = [0] * pp
    last = pp * v - 1
    rounds = 0
    while any(c < len(o) for c, o in zip(cursor, orders)):
        progressed = []
        for k in range(pp):
            if cursor[k] == len(orders[k]):
                continue
            fwd, mb, chunk = orders[k][cursor[k]]
            need = ([(True, mb, chunk - 1)] if fwd and chunk > 0 else []) if fwd else \
                [(True, mb, chunk)] + ([(False, mb, chunk + 1)] if chunk < last else [])
            if all(n in done for n in need):
                progressed.append((k, (fwd, mb, chunk)))
        assert progressed, f"deadlock at pp={pp} v={v} M={num_mb}: cursors {cursor}"
        for k, op in progressed:
            done.add(op)
            cursor[k] += 1
        rounds += 1
    return rounds


@pytest.mark.single
@pytest.mark.parametrize("pp,v", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 3)])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_order_runs_every_chunk_once_and_never_deadlocks(pp, v, groups):
    num_mb = groups * pp
    for k in range(pp):
        order = interleaved_order(pp, v, num_mb, k)
        chunks = range(k, pp * v, pp)
        assert sorted(o for o in order if o[0]) == sorted((True, m, c) for m in range(num_mb)
                                                          for c in chunks)
        assert sorted(o for o in order if not o[0]) == sorted((False, m, c) for m in range(num_mb)
                                                              for c in chunks)
        # Megatron's warm-up forwards, then (unless all forwards were warm-up) the first
        # steady-state forward, then the first backward
        warmup, total = num_warmup(pp, v, num_mb, k), num_mb * v
        first_backward = next(i for i, o in enumerate(order) if not o[0])
        assert first_backward == (total if warmup == total else warmup + 1)
    _simulate(pp, v, num_mb)
    _check_releases(pp, v, num_mb)


def _check_releases(pp: int, v: int, num_mb: int) -> None:
    """Waiting for a gradient send where ``gradient_send_releases`` says cannot block: its
    receiver (the previous ring rank's backward of that chunk) has run before the forward
    whose message releases it (the simulator's dependencies), and every gradient send is
    released at most once."""
    last = pp * v - 1
    released: set = set()
    for k in range(pp):
        prev = interleaved_order(pp, v, num_mb, (k - 1) % pp)
        position = {op: i for i, op in enumerate(prev)}
        for (mb, chunk), sends in gradient_send_releases(pp, v, num_mb, k).items():
            assert chunk % pp == k and chunk > 0
            producer = position[(True, mb, chunk - 1)]  # the forward that sends (mb, chunk)
            for sent in sends:
                assert sent[1] < last and (sent[1] + 1) % pp == k  # one of k's gradient sends
                assert position[(False, *sent)] < producer
                assert (k, sent) not in released
                released.add((k, sent))


@pytest.mark.single
def test_warmup_counts_by_hand():
    # pp=4, v=2, M=8: stage k warms up 2*(4-k-1) + (2-1)*4 forwards
    assert [num_warmup(4, 2, 8, k) for k in range(4)] == [10, 8, 6, 4]
    # M == pp: everything forward first (Megatron's rule)
    assert num_warmup(2, 2, 2, 0) == 4
    # stage 1 of pp=2, v=2, M=4: 0 + 2 = 2 warm-up forwards (micro-batches 0, 1 of chunk 1),
    # then forward of micro-batch 0 on chunk 3 and at once its backward
    assert interleaved_order(2, 2, 4, 1)[:4] == [(True, 0, 1), (True, 1, 1), (True, 0, 3),
                                                 (False, 0, 3)]
    # non-interleaved 1F1B (v = 1): pp - k - 1 warm-up forwards, even when M == pp
    assert [num_warmup(4, 1, 8, k) for k in range(4)] == [3, 2, 1, 0]
    assert [num_warmup(4, 1, 4, k) for k in range(4)] == [3, 2, 1, 0]
    assert num_warmup(4, 1, 2, 0) == 2
    assert interleaved_order(2, 1, 3, 0) == [(True, 0, 0), (True, 1, 0), (False, 0, 0),
                                             (True, 2, 0), (False, 1, 0), (False, 2, 0)]


# ------------------------------------------------------------------------ equivalence
GPT10 = Equivalence(gpt_recipe(CONFIG10), "gpt 10 layers")


def plan10(world_size, layers, chunks, *, virtual_size=2, num_microbatches=4, **kw):
    return plan_of(world_size, layers, layers_per_stage=chunks, virtual_size=virtual_size,
                   num_microbatches=num_microbatches, **kw)


INTERLEAVED_PLANS = {
    # 2 stages of 2 ranks (dp 2), v=2, uneven chunks 3+2+1+4, M=4 (two groups of pp)
    "pp2-v2-uneven": (4, plan10(4, [layer()] * 10, (3, 2, 1, 4))),
    # M == pp: every stage runs all its forwards first
    "pp2-v2-M2": (4, plan10(4, [layer(tp=2)] * 10, (2, 3, 3, 2), num_microbatches=2,
                             vocab_tp=2)),
    # 4 stages of one rank, v=2, uneven chunks, M=8
    "pp4-v2-uneven": (4, plan10(4, [layer()] * 10, (2, 1, 1, 1, 1, 1, 2, 1), num_microbatches=8)),
    # recompute, ZeRO-1/2/3, tp and strided layouts inside the chunks; zero2 vocab
    "pp2-v2-mixed": (4, plan10(4, [layer(dp_mode="zero1"), layer(tp=2, recompute=True),
                                   layer(dp_mode="zero3"), layer(dp_mode="zero2", recompute=True),
                                   layer(tp=2, consecutive=False), layer(dp_mode="zero3"),
                                   layer(tp=2, dp_mode="zero1"), layer(recompute=True),
                                   layer(dp_mode="zero2"), layer(tp=2, dp_mode="zero3")],
                               (2, 3, 2, 3), vocab_dp_mode="zero2")),
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(INTERLEAVED_PLANS))
def test_interleaved_plan_matches_one_process(name):
    assert {world for world, _ in INTERLEAVED_PLANS.values()} == {4}
    GPT10.check_named(4, {n: plan for n, (_, plan) in INTERLEAVED_PLANS.items()}, name)


# ------------------------------------------------------------------------- bad input
@pytest.mark.single
def test_bad_interleaved_plans_name_the_field_and_the_fix():
    good = plan10(4, [layer()] * 10, (3, 2, 1, 4))
    with pytest.raises(PlanError, match=r"pipeline\.virtual_size=3: layers_per_stage lists 4 "
                                        r"model chunks, which must be pipeline\.size x "
                                        r"virtual_size = 2 x 3 = 6; .* or use virtual_size=2"):
        Plan.from_dict(dict(good, pipeline=dict(good["pipeline"], virtual_size=3)))
    with pytest.raises(PlanError, match=r"num_microbatches=1: the interleaved schedule "
                                        r"\(pipeline\.virtual_size=2\) runs micro-batches in "
                                        r"groups of pipeline\.size=2; use a multiple of 2"):
        Plan.from_dict(dict(good, num_microbatches=1))
    with pytest.raises(PlanError, match=r"pipeline\.schedule='gpipe': virtual_size=2 runs"):
        Plan.from_dict(dict(good, pipeline=dict(good["pipeline"], schedule="gpipe")))
    with pytest.raises(PlanError, match=r"pipeline\.virtual_size=0: must be a positive"):
        Plan.from_dict(dict(good, pipeline=dict(good["pipeline"], virtual_size=0)))


@pytest.mark.single
def test_virtual_size_round_trips_and_v1_files_stay_as_they_were():
    plan = Plan.from_dict(INTERLEAVED_PLANS["pp4-v2-uneven"][1])
    assert plan.virtual_size == 2 and plan.num_chunks == 8
    assert plan.stage_chunks(1) == [1, 5] and plan.stage_layers(1) == [2, 6]
    assert Plan.from_dict(plan.to_dict()) == plan
    plain = plan_of(2, [layer()] * 4, layers_per_stage=(2, 2))
    assert "virtual_size" not in plain["pipeline"]
    assert Plan.from_dict(plain).virtual_size == 1


@pytest.mark.single
def test_callers_of_contiguous_stages_refuse_interleaved_plans_clearly():
    """A caller that asks for one contiguous range per stage (the vision models) gets a clear
    error from an interleaved plan, whose stages hold several chunks."""
    plan = Plan.from_dict(INTERLEAVED_PLANS["pp2-v2-uneven"][1])
    with pytest.raises(PlanError, match=r"pipeline\.virtual_size=2: an interleaved stage holds "
                                        r"several chunks \(see stage_layers\)"):
        plan.stage_layer_range(0)
