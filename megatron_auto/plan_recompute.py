"""A layer's recompute choice in a plan (``layers[i].recompute``): the modules it can name, its
canonical form and how it reads in reports. Pure, no torch; ``plan.py`` keeps the field.

A choice is ``false`` (nothing), ``true`` (the whole layer), ``"selective"`` (core attention,
Megatron's selective recompute) or a list of modules; :func:`normalize_recompute` maps each
spelling to one canonical value so equal choices compare equal.
"""

from __future__ import annotations

from typing import Any, Union

from .plan_errors import need

#: The parts of a transformer layer that ``layers[i].recompute`` can name in a list: core
#: attention (scores, softmax, attention dropout), the MLP, the two norms. ``"selective"`` is
#: ``["core_attn"]`` (Megatron's selective recompute); ``true`` is the whole layer.
RECOMPUTE_MODULES = ("core_attn", "mlp", "norm")
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RecomputeValue = Union[bool, str, tuple[str, ...]]


def normalize_recompute(value: Any, where: str = "recompute") -> RecomputeValue:
    """One layer's recompute choice in its canonical form, or ``PlanError`` naming ``where``.

    ``false``/``"none"``/``[]`` -> ``False``; ``true``/``"full"`` -> ``True``; ``"selective"`` and
    ``["core_attn"]`` -> ``"selective"``; any other module list -> a tuple in
    :data:`RECOMPUTE_MODULES` order. Canonical forms make equal choices compare equal, and keep
    the booleans every plan written before module recompute holds (their files are unchanged).
    """
    if value is True or value is False:
        return value
    if isinstance(value, str):
        need(value in RECOMPUTE_GRANULARITIES, where, value,
             f"choose true, false, one of {', '.join(RECOMPUTE_GRANULARITIES)}, or a list of "
             f"modules from {', '.join(RECOMPUTE_MODULES)}")
        return {"none": False, "full": True}.get(value, value)  # type: ignore[return-value]
    need(isinstance(value, (list, tuple)) and all(isinstance(m, str) for m in value), where,
         value, f"must be true, false, one of {', '.join(RECOMPUTE_GRANULARITIES)}, or a list "
         f"of module names from {', '.join(RECOMPUTE_MODULES)}")
    unknown = [m for m in value if m not in RECOMPUTE_MODULES]
    need(not unknown, where, list(value), f"unknown module name(s) {unknown}; choose from "
         f"{', '.join(RECOMPUTE_MODULES)} (or true for the whole layer)")
    need(len(set(value)) == len(value), where, list(value), "names a module twice; list each "
         "once")
    modules = tuple(m for m in RECOMPUTE_MODULES if m in value)
    if not modules:
        return False
    return "selective" if modules == ("core_attn",) else modules


def recompute_parts(value: RecomputeValue) -> tuple[bool, frozenset[str]]:
    """``(whole layer, modules recomputed on their own)`` of a canonical recompute value."""
    if value is True:
        return True, frozenset()
    if value is False:
        return False, frozenset()
    return False, frozenset(("core_attn",) if value == "selective" else value)


def recompute_label(value: RecomputeValue) -> str:
    """``none``, ``full``, ``selective`` or the modules joined by ``+`` (reports, logs)."""
    if isinstance(value, bool):
        return "full" if value else "none"
    return value if isinstance(value, str) else "+".join(value)
