"""The checks of a plan's per-layer expert fields (``ep``, ``expert_tp``, ``expert_dp_mode``),
kept out of plan.py (which raises what these return as ``PlanError``). Pure, no torch.

Only MoE layers may carry ``ep`` / ``expert_tp`` above 1 (the model says which layers are MoE);
``ep`` must divide the layer's data-parallel ranks and the expert count, ``expert_tp`` the
layer's ``tp`` and the expert width; an MoE layer runs without sequence parallelism, and one
with expert fields without context parallelism.
"""

from __future__ import annotations

from typing import Any

_DP_MODES = ("ddp", "zero1", "zero2", "zero3")


def _power_of_two(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and x & (x - 1) == 0


def expert_field_error(layer: Any, where: str, dp: int) -> str | None:
    """The first problem of one ``layers[i]`` entry's expert fields on its own (``dp``: the
    layer's data-parallel ranks), as a one-line message, or None."""
    if not (_power_of_two(layer.ep) and dp % layer.ep == 0):
        return (f"plan field {where}.ep={layer.ep}: must be a power of two dividing the layer's "
                f"{dp} data-parallel ranks (the experts are split over ep of them); use a "
                f"divisor of {dp}, or change tp")
    if not (_power_of_two(layer.expert_tp) and layer.tp % layer.expert_tp == 0):
        return (f"plan field {where}.expert_tp={layer.expert_tp}: must be a power of two "
                f"dividing the layer's tp={layer.tp} (each expert is split over expert_tp of "
                f"its TP ranks); use a divisor of {layer.tp}, or raise tp")
    if layer.expert_dp_mode is not None and layer.expert_dp_mode not in _DP_MODES:
        return (f"plan field {where}.expert_dp_mode={layer.expert_dp_mode}: choose one of "
                f"{', '.join(_DP_MODES)} (absent: the layer's dp_mode)")
    expert_fields = (layer.ep != 1 or layer.expert_tp != 1
                     or layer.expert_dp_mode is not None)
    if expert_fields and layer.cp > 1:
        return (f"plan field {where}.cp={layer.cp}: an expert-parallel layer runs without "
                f"context parallelism; set cp to 1, or ep and expert_tp to 1 and drop "
                f"expert_dp_mode")
    if expert_fields and layer.sequence_parallel:
        return (f"plan field {where}.sequence_parallel=True: an MoE layer runs without "
                f"sequence parallelism; set it to false")
    return None


def model_expert_error(model: Any, i: int, layer: Any) -> str | None:
    """The first problem of layer ``i``'s expert fields against the model (MoE or not), or
    None."""
    check = getattr(model, "check_expert_parallel", None)
    expert_fields = layer.ep != 1 or layer.expert_tp != 1 or layer.expert_dp_mode is not None
    if check is None:
        if expert_fields:
            return (f"plan field layers[{i}].ep={layer.ep}: the {model.model_type} model has no "
                    f"MoE layers; set ep and expert_tp to 1 and drop expert_dp_mode")
        return None
    try:
        check(i, layer.ep, layer.expert_tp, layer.tp)
    except ValueError as err:
        return str(err)
    if model.is_moe_layer(i) and layer.sequence_parallel:
        return (f"plan field layers[{i}].sequence_parallel=True: layer {i} is an MoE layer, "
                f"which runs without sequence parallelism; set it to false (or drop "
                f"--sequence-parallel)")
    if not model.is_moe_layer(i) and layer.expert_dp_mode is not None:
        return (f"plan field layers[{i}].expert_dp_mode={layer.expert_dp_mode}: layer {i} is "
                f"dense; drop expert_dp_mode")
    return None
