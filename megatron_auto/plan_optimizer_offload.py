"""The plan's ``pipeline.optimizer_offload_fraction`` field (optimizer offload), kept out of
plan.py, which calls these. Pure, no torch.

``pipeline.optimizer_offload_fraction`` says which share of a stage's optimizer lives in host
memory (parallel/optimizer_offload.py runs it): the fp32 master weights and both Adam moments of
that share of the parameters (by bytes, a fixed split in parameter order) are kept on the host
and stepped there; the gradients go down, the updated parameters come back up every step.

- ``0`` (the default; ``to_dict`` omits it, so plans without optimizer offload stay
  byte-identical): everything on the device;
- one number in [0, 1]: the same share on every stage;
- a list of ``pipeline.size`` numbers in [0, 1]: one per stage (what the search writes).

The host optimizer works on whole plain tensors: ``ddp`` and ``zero1`` parameters (a zero1
rank offloads a share of its own slice); the FSDP2 modes (``zero2``/``zero3``, DTensor shards)
are refused on a stage that offloads.
"""

from __future__ import annotations

from typing import Any, Union

from .plan_errors import PlanError

FIELD = "pipeline.optimizer_offload_fraction"
#: The data-parallel modes whose parameters the host optimizer can step.
OFFLOADABLE_DP_MODES = ("ddp", "zero1")
FractionValue = Union[float, tuple[float, ...]]


def _is_fraction(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 <= float(x) <= 1.0


def parse_fraction(data: Any) -> FractionValue:
    """The field's value from a ``pipeline`` JSON object (absent: 0.0), or ``PlanError``."""
    value = data.get("optimizer_offload_fraction", 0.0)
    if isinstance(value, list):
        if not all(_is_fraction(x) for x in value):
            raise PlanError(f"plan field {FIELD}={value!r}: every entry must be a number in "
                            f"[0, 1] (the share of that stage's optimizer kept on the host)")
        return tuple(float(x) for x in value)
    if not _is_fraction(value):
        raise PlanError(f"plan field {FIELD}={value!r}: must be a number in [0, 1] (0: no "
                        f"optimizer offload, 1: the whole optimizer on the host) or a list of "
                        f"such numbers, one per pipeline stage")
    return float(value)


def fraction_dict(value: FractionValue) -> dict[str, Any]:
    """What ``pipeline.to_dict`` adds: nothing when no stage offloads."""
    if isinstance(value, tuple):
        return {"optimizer_offload_fraction": list(value)} if any(value) else {}
    return {"optimizer_offload_fraction": value} if value else {}


def stage_fraction(value: FractionValue, stage: int) -> float:
    """The share of ``stage``'s optimizer on the host."""
    return float(value[stage]) if isinstance(value, tuple) else float(value)


def fraction_problem(plan: Any) -> str | None:
    """Why ``plan``'s optimizer offload is invalid (one line), or None."""
    value = plan.pipeline.optimizer_offload_fraction
    if isinstance(value, tuple):
        if len(value) != plan.pp_size:
            return (f"plan field {FIELD}={list(value)!r}: lists {len(value)} stage(s) but "
                    f"pipeline.size={plan.pp_size}; give one number per stage or a single number")
        if not all(_is_fraction(x) for x in value):
            return f"plan field {FIELD}={list(value)!r}: every entry must be a number in [0, 1]"
    elif not _is_fraction(value):
        return f"plan field {FIELD}={value!r}: must be a number in [0, 1]"
    for stage in range(plan.pp_size):
        if stage_fraction(value, stage) == 0.0:
            continue
        for i in plan.stage_layers(stage):
            layer = plan.layers[i]
            for mode, name in ((layer.dp_mode, "dp_mode"),
                               (layer.experts_dp_mode, "expert_dp_mode")):
                if mode not in OFFLOADABLE_DP_MODES:
                    return (f"plan field {FIELD}={_show(value)}: stage {stage} offloads its "
                            f"optimizer but layers[{i}].{name}={mode!r}; the host optimizer "
                            f"steps ddp and zero1 parameters only: use ddp/zero1 there, or "
                            f"fraction 0 for stage {stage}")
        if stage in (0, plan.pp_size - 1) and plan.vocab.dp_mode not in OFFLOADABLE_DP_MODES:
            return (f"plan field {FIELD}={_show(value)}: stage {stage} offloads its optimizer "
                    f"but vocab.dp_mode={plan.vocab.dp_mode!r}; use ddp/zero1 for the vocab, or "
                    f"fraction 0 for stage {stage}")
    return None


def _show(value: FractionValue) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)
