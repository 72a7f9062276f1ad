"""Megatron's ``--expert-tensor-parallel-size`` (issue 25 item 3) on the classic flags: every
MoE layer's ``expert_tp`` in the uniform plan (dense layers untouched), bad values in one line
naming the flag, and the Megatron-flag export writing it whenever it differs from the layers'
tp (Megatron's default expert TP is ``--tensor-model-parallel-size``, ours 1). The run end to
end: tests/test_moe_expert_tp.py (``pretrain_gpt.py`` with the flag on 2 gloo ranks)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.pure


def _flags_plan(etp: int, moe_layers=(0, 2), tp: int = 2, ep: int = 1, **kw):
    from megatron_auto.planner.interop.megatron_flags import plan_from_megatron_flags

    return plan_from_megatron_flags(world_size=4, num_layers=4, global_batch_size=8,
                                    micro_batch_size=1, tensor_model_parallel_size=tp,
                                    expert_model_parallel_size=ep,
                                    expert_tensor_parallel_size=etp, moe_layers=moe_layers,
                                    model={"moe": {"num_experts": 4, "layer_freq": 2}}, **kw)


def test_the_flag_sets_every_moe_layer_and_only_those():
    plan = _flags_plan(2)
    assert [(la.ep, la.expert_tp) for la in plan.layers] == [(1, 2), (1, 1), (1, 2), (1, 1)]
    plan = _flags_plan(2, ep=2)
    assert [(la.ep, la.expert_tp) for la in plan.layers] == [(2, 2), (1, 1), (2, 2), (1, 1)]
    assert [la.expert_tp for la in _flags_plan(1).layers] == [1, 1, 1, 1]


@pytest.mark.parametrize("etp,kw,message", [
    (4, {}, "--expert-tensor-parallel-size=4: must be a power of two dividing "
            "--tensor-model-parallel-size=2"),
    (2, {"tp": 1}, "--expert-tensor-parallel-size=2: must be a power of two dividing "
                   "--tensor-model-parallel-size=1"),
    (0, {}, "--expert-tensor-parallel-size=0: must be a positive integer"),
    (2, {"moe_layers": ()}, "--expert-tensor-parallel-size=2: the model has no MoE layers"),
])
def test_bad_values_name_the_flag(etp, kw, message):
    from megatron_auto.planner.interop.megatron_flags import MegatronFlagError

    with pytest.raises(MegatronFlagError) as err:
        _flags_plan(etp, **kw)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def _exported_etp(plan):
    from megatron_auto.planner.interop.megatron_flags import to_megatron_flags

    flags, reasons = to_megatron_flags(plan)
    assert not reasons and flags is not None, reasons
    if "--expert-tensor-parallel-size" not in flags:
        return None
    return flags[flags.index("--expert-tensor-parallel-size") + 1]


def test_the_export_writes_what_megatron_would_not_default_to():
    assert _exported_etp(_flags_plan(1)) == "1"  # tp 2, experts replicated: Megatron needs it
    assert _exported_etp(_flags_plan(2)) is None  # expert TP = tp: Megatron's default
    assert _exported_etp(_flags_plan(1, tp=1)) is None


def test_the_export_refuses_expert_tp_that_differs_between_moe_layers():
    from dataclasses import replace

    from megatron_auto.planner.interop.megatron_flags import to_megatron_flags

    plan = _flags_plan(2)
    layers = list(plan.layers)
    layers[2] = replace(layers[2], expert_tp=1)
    flags, reasons = to_megatron_flags(replace(plan, layers=tuple(layers)))
    assert flags is None and any("--expert-tensor-parallel-size" in r for r in reasons)
