"""The checks of a plan's per-layer ``offload`` field (activation offload), kept out of plan.py,
which raises what these return as ``PlanError``. Pure, no torch.

``layers[i].offload`` says which of the layer's saved activations live in host memory between
its forward and its backward (parallel/offload.py moves them):

- ``false`` (the default; ``to_dict`` omits it, so plans without offload stay byte-identical);
- ``true``: everything the layer saves for backward (parameters excepted, they stay resident);
- a list of module names from :data:`OFFLOAD_MODULES`: what those modules save (``core_attn``:
  q, k, v and what the attention kernel keeps; ``mlp``: fc1's input, its output and the
  activation's; ``norm``: the two norms' inputs and statistics). ``[]`` is ``false``.

Offload moves what a layer keeps, recompute avoids keeping it: a module is offloaded or
recomputed, not both, and a fully recomputed layer (which keeps only its input) is not
offloaded. An MoE layer offloads as a whole (``true``) or its attention and norms; its expert
block's (``mlp``) saved tensors are not priced on their own yet.
"""

from __future__ import annotations

from typing import Any, Union

from .plan_errors import PlanError

#: The modules ``layers[i].offload`` may name, in canonical order (the recompute list's names).
OFFLOAD_MODULES = ("core_attn", "mlp", "norm")
OffloadValue = Union[bool, tuple[str, ...]]


def offload_value_problem(value: Any, where: str) -> str | None:
    """Why ``value`` is not a valid ``offload`` value, as one line naming ``where``, or None."""
    if value is True or value is False:
        return None
    choices = ", ".join(OFFLOAD_MODULES)
    if not (isinstance(value, (list, tuple)) and all(isinstance(m, str) for m in value)):
        return (f"plan field {where}={value!r}: must be true, false or a list of module names "
                f"from {choices}")
    unknown = [m for m in value if m not in OFFLOAD_MODULES]
    if unknown:
        return (f"plan field {where}={list(value)!r}: unknown module name(s) {unknown}; choose "
                f"from {choices} (or true for every saved activation of the layer)")
    if len(set(value)) != len(value):
        return f"plan field {where}={list(value)!r}: names a module twice; list each once"
    return None


def normalize_offload(value: Any, where: str = "offload") -> OffloadValue:
    """A value's canonical form (:func:`canonical_offload`), or ``PlanError`` naming ``where``."""
    problem = offload_value_problem(value, where)
    if problem:
        raise PlanError(problem)
    return canonical_offload(value)


def canonical_offload(value: bool | list[str] | tuple[str, ...]) -> OffloadValue:
    """A valid value's canonical form: a bool, or the modules in :data:`OFFLOAD_MODULES` order
    (``[]`` -> ``False``), so equal choices compare equal."""
    if value is True or value is False:
        return value
    modules = tuple(m for m in OFFLOAD_MODULES if m in value)
    return modules if modules else False


def offload_parts(value: OffloadValue) -> tuple[bool, frozenset[str]]:
    """``(the whole layer, modules offloaded on their own)`` of a canonical offload value."""
    if value is True or value is False:
        return value, frozenset()
    return False, frozenset(value)


def offload_label(value: OffloadValue) -> str:
    """``none``, ``all`` or the modules joined by ``+`` (reports, logs)."""
    if isinstance(value, bool):
        return "all" if value else "none"
    return "+".join(value)


def offload_layer_problem(offload: OffloadValue, full_recompute: bool,
                          recompute_modules: frozenset[str], where: str) -> str | None:
    """Why a layer's ``offload`` does not combine with its ``recompute`` (one line), or None."""
    if offload is False:
        return None
    if full_recompute:
        return (f"plan field {where}.offload={_show(offload)}: the layer recomputes in full "
                f"(recompute=true) and keeps only its input; set offload to false, or recompute "
                f"to selective/a module list/false")
    both = sorted(recompute_modules & offload_parts(offload)[1])
    if both:
        return (f"plan field {where}.offload={_show(offload)}: module(s) {both} are recomputed "
                f"too (recompute drops what offload would move); name each module in one of "
                f"the two lists")
    return None


def offload_model_problem(model: Any, i: int, layer: Any) -> str | None:
    """Why ``model`` cannot run layer ``i``'s ``offload`` (one line), or None. The layers that
    recompute single modules (GPT/BERT, local implementation) are the ones that offload them."""
    offload, where = layer.offload, f"layers[{i}]"
    if offload is False:
        return None
    model_type = getattr(model, "model_type", "this")
    moe_layer = i in getattr(model, "moe_layers", ())
    if not getattr(model, "runs_module_recompute", True):
        return (f"plan field {where}.offload={_show(offload)}: the {model_type} model does not "
                f"offload activations yet; set offload to false")
    if moe_layer and "mlp" in offload_parts(offload)[1]:
        return (f"plan field {where}.offload={_show(offload)}: an MoE layer's expert block is "
                f"offloaded with the whole layer only; use true, or name core_attn/norm")
    return None


def _show(value: OffloadValue) -> str:
    return "true" if value is True else repr(list(value))  # type: ignore[arg-type]
