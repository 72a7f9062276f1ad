"""The plan's error type and its one-line field check, shared by ``plan.py`` and the plan's
field modules (``plan_recompute.py``). Pure, no torch."""

from __future__ import annotations

from typing import Any


class PlanError(ValueError):
    """An invalid plan; the message names the field, the value and how to fix it."""


def need(cond: bool, field_name: str, value: Any, fix: str) -> None:
    """Raise ``PlanError`` (``plan field <field_name>=<value>: <fix>``) unless ``cond``."""
    if not cond:
        raise PlanError(f"plan field {field_name}={value!r}: {fix}")
