"""Context parallelism in the plan, the flags and the reports (torch-free): the bad inputs are
one line naming the field or flag, the value and the fix; Megatron's ``--context-parallel-size``
/ ``--cp-comm-type`` build uniform plans and the export writes them back; ``explain`` shows cp.
The runtime's equivalence tests are tests/test_context_parallel.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_auto.config import ModelConfig
from megatron_auto.plan import Plan, PlanError
from megatron_auto.planner.interop.megatron_flags import (MegatronFlagError,
                                                          plan_from_megatron_flags,
                                                          to_megatron_flags)
from megatron_auto.planner.report import render_layers

pytestmark = pytest.mark.pure

MODEL = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                    seq_length=16, vocab_size=60, make_vocab_size_divisible_by=16,
                    hidden_dropout=0.0, attention_dropout=0.0)


def _plan(cp, cp_mode="ring", tp=1, world=2, pp=1):
    return Plan.uniform(world, 4, global_batch_size=8, num_microbatches=2, tp=tp, pp=pp,
                        cp=cp, cp_mode=cp_mode)


def test_sequence_not_divisible_by_two_cp_is_one_line():
    with pytest.raises(PlanError, match=r"^plan field layers\[0\]\.cp=4: --seq-length=12 must be "
                                        r"divisible by 2 x cp = 8 .*change the sequence length"):
        _plan(4, world=4).validate(replace(MODEL, seq_length=12))


def test_ulysses_heads_not_divisible_by_cp_tp_is_one_line():
    gqa = replace(MODEL, num_query_groups=2)
    with pytest.raises(PlanError, match=r"cp_mode='ulysses': --num-query-groups=2 must be "
                                        r"divisible by cp x tp = 2 x 2 = 4.*--cp-comm-type p2p"):
        _plan(2, "ulysses", tp=2, world=4).validate(gqa)
    _plan(2, "ring", tp=2, world=4).validate(gqa)  # ring has no head rule


def test_cp_with_a_model_that_cannot_use_it_is_one_line():
    from megatron_auto.families.t5.config import T5Config
    t5 = T5Config(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                  seq_length=16, vocab_size=60)
    with pytest.raises(PlanError, match=r"layers\[0\]\.cp=2: the t5 model does not run context "
                                        r"parallelism; set cp to 1"):
        _plan(2).check_model(t5)


def test_ring_with_attention_dropout_is_one_line():
    with pytest.raises(PlanError, match=r"--attention-dropout 0 or use cp_mode ulysses"):
        _plan(2).validate(replace(MODEL, attention_dropout=0.1))
    _plan(2, "ulysses").validate(replace(MODEL, attention_dropout=0.1))


def test_one_cp_degree_per_plan():
    plan = _plan(2, world=4)
    with pytest.raises(PlanError, match=r"layers\[1\]\.cp=1: every layer takes the plan's one "
                                        r"context-parallel degree"):
        replace(plan, layers=(plan.layers[0], replace(plan.layers[1], cp=1)) + plan.layers[2:])


@pytest.mark.parametrize("cp,comm,tp,pp", [(2, "p2p", 1, 1), (2, "a2a", 2, 1), (4, "p2p", 1, 2)])
def test_megatron_flags_build_uniform_cp_plans_and_export_them(cp, comm, tp, pp):
    plan = plan_from_megatron_flags(world_size=8, num_layers=4,
                                    global_batch_size=16, micro_batch_size=2,
                                    tensor_model_parallel_size=tp,
                                    pipeline_model_parallel_size=pp,
                                    context_parallel_size=cp, cp_comm_type=comm)
    mode = {"p2p": "ring", "a2a": "ulysses"}[comm]
    assert {(s.cp, s.cp_mode, s.tp) for s in plan.layers} == {(cp, mode, tp)}
    slices = 8 // (tp * pp * cp)  # Megatron's data-parallel size
    assert plan.num_microbatches == 16 // (2 * slices)
    plan.validate(MODEL)
    flags, reasons = to_megatron_flags(plan)
    assert reasons == []
    assert flags[flags.index("--context-parallel-size") + 1] == str(cp)
    assert flags[flags.index("--cp-comm-type") + 1] == comm
    assert flags[flags.index("--micro-batch-size") + 1] == "2"


def test_plans_without_cp_export_no_cp_flags_and_keep_their_files():
    plan = plan_from_megatron_flags(world_size=4, num_layers=4, global_batch_size=8,
                                    micro_batch_size=2, cp_comm_type="a2a")
    assert all(s.cp == 1 and s.cp_mode == "ring" for s in plan.layers)
    assert all("cp" not in d and "cp_mode" not in d for d in plan.to_dict()["layers"])
    flags, _ = to_megatron_flags(plan)
    assert "--context-parallel-size" not in flags and "--cp-comm-type" not in flags


def test_mixed_cp_modes_have_no_megatron_flags():
    plan = _plan(2)
    mixed = replace(plan, layers=(replace(plan.layers[0], cp_mode="ulysses"),) + plan.layers[1:])
    flags, reasons = to_megatron_flags(mixed)
    assert flags is None and any("--cp-comm-type" in r for r in reasons)


def test_bad_cp_flags_are_one_line():
    with pytest.raises(MegatronFlagError, match=r"^--cp-comm-type=all_gather: .*choose one"):
        plan_from_megatron_flags(world_size=4, num_layers=4, global_batch_size=8,
                                 micro_batch_size=1, context_parallel_size=2,
                                 cp_comm_type="all_gather")
    with pytest.raises(MegatronFlagError, match=r"--context-parallel-size=4 = 8 must divide the "
                                                r"world size 4"):
        plan_from_megatron_flags(world_size=4, num_layers=4, global_batch_size=8,
                                 micro_batch_size=1, tensor_model_parallel_size=2,
                                 context_parallel_size=4)


def test_cp_flags_pin_the_search_and_their_absence_searches_it():
    from megatron_auto.planner.inputs.pins import search_options
    from megatron_auto.run_config import SearchPins
    pinned = search_options(SearchPins(context_parallel_size=2, cp_comm_type="a2a"), 8, 4)
    assert (pinned.cp, pinned.cp_modes) == (2, ("ulysses",))
    free = search_options(SearchPins(), 8, 4)
    assert (free.cp, free.cp_modes) == (None, ("ring", "ulysses"))


def test_explain_shows_cp_only_for_cp_plans():
    text = render_layers(_plan(2, "ulysses", world=4))
    header, _, row = text.splitlines()[:3]
    assert header.split()[:5] == ["layers", "stage", "tp", "dp", "cp"]
    assert "2 ulysses" in row and row.split()[3] == "2"  # dp: the batch slices (4 / cp 2)
    assert "cp" not in render_layers(_plan(1)).splitlines()[0].split()
