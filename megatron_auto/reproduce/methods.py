"""The methods compared in every cell, each a restricted space of the same planner.

A method is a search space name of ``planner.search`` plus option pins; all of them are searched
by the same engine with the same memory step and priced by the same cost model (``evaluate``), so
a difference between two columns is a difference of the spaces, never of two estimators.
``ours`` is the full space; the two ablations remove one ingredient each, and every baseline is a
sub-space of ``ours`` (so ``ours`` is never below any of them, equality allowed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..planner.search import SearchOptions


class MethodError(ValueError):
    """An unknown method name."""


@dataclass(frozen=True)
class Method:
    name: str
    label: str  # column header in the tables
    space: str
    pins: Mapping[str, Any] = field(default_factory=dict)
    ours: bool = False  # one of our variants (not a baseline)

    def options(self, **extra: Any) -> SearchOptions:
        """Search options of this method; ``extra`` (time limit, memory step, progress) must not
        contradict the method's own pins."""
        clash = sorted(set(extra) & set(self.pins))
        if clash:
            raise MethodError(f"method {self.name}: {', '.join(clash)} is fixed by the method")
        return dataclasses.replace(SearchOptions(space=self.space, include_baselines=False,
                                                 show_progress=False),
                                   **{**self.pins, **extra})


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ddp", "PyTorch DDP", "dp"),
    Method("zero3", "ZeRO-3 (FSDP)", "zero3"),
    Method("megatron-tp", "Megatron TP", "tp"),
    Method("pp-gpipe", "PP (GPipe)", "pp", {"schedule": "gpipe"}),
    Method("pp-1f1b", "PP (1F1B)", "pp", {"schedule": "1f1b"}),
    Method("3d", "3D grid", "megatron3d", {"allow_recompute": False}),
    Method("3d-recompute", "3D grid + recompute", "megatron3d"),
    Method("galvatron-base", "Galvatron-base", "galvatron-base"),
    Method("ours-no-bmw", "ours w/o BMW", "full", {"partition": "even"}, ours=True),
    Method("ours-no-recompute", "ours w/o recompute", "full", {"allow_recompute": False},
           ours=True),
    Method("ours", "ours", "full", ours=True),
)}
OURS = "ours"


def select_methods(names: str | Sequence[str] | None) -> list[Method]:
    """Methods by name (comma-separated), in the table's column order; ``None`` = all."""
    if names is None:
        return list(METHODS.values())
    chosen = [x.strip() for x in (names.split(",") if isinstance(names, str) else names)
              if x.strip()]
    unknown = [n for n in chosen if n not in METHODS]
    if unknown or not chosen:
        raise MethodError(f"--methods {','.join(unknown) or '(empty)'}: unknown method; choose "
                          f"from {', '.join(METHODS)}")
    return [m for m in METHODS.values() if m.name in chosen]
