"""The methods compared in every cell, each a restricted space of the same planner.

A method is a search space name of ``planner.search`` plus option pins; all of them are searched
by the same engine with the same memory step and priced by the same cost model (``evaluate``), so
a difference between two columns is a difference of the spaces, never of two estimators.
``ours`` is the full space; the two ablations remove one ingredient each, and every baseline is a
sub-space of ``ours`` (so ``ours`` is never below any of them, equality allowed).

The grid makes that hold even when a search stops at its time limit: the methods of a cell run
in :data:`RUN_ORDER` (the cheap, small spaces first), and each search starts from the fastest
plans found so far that :func:`in_space` finds in its own space (``search``'s ``incumbents``;
module ``warm``). A seeded search returns a plan at least as fast as each seed, and its answer
is still a plan of its own space, which ``in_space`` checks rule by rule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..plan import Plan, even_partition
from ..planner.inputs.model_spec import ModelSpec
from ..planner.search.driver import SearchOptions, spaces_of
from ..planner.search.spaces import layer_strategies, vocab_tps


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
#: The order the methods of a cell are searched in: the table's, small spaces first, each
#: ``ours`` variant after every space inside it (it starts from their plans), ``ours`` last.
RUN_ORDER: tuple[str, ...] = tuple(METHODS)


def in_space(plan: Plan, spec: ModelSpec, method: Method, devices_per_node: int) -> bool:
    """Whether ``plan`` is a plan of ``method``'s search space on ``plan.world_size`` devices:
    its pipeline degree, schedule, partition rule and virtual size, every layer's strategy (as
    ``spaces.layer_strategies`` lists them for that layer) and the vocabulary's layout."""
    options = method.options()
    pipe, world = plan.pipeline, plan.world_size
    schedule = options.schedule or "1f1b"  # the full space searches 1f1b only (gpipe: same
    if pipe.schedule != schedule or pipe.virtual_size not in options.virtual_sizes:  # time)
        return False
    pp, n = pipe.size, plan.stage_size
    if pipe.virtual_size > 1 and (pipe.schedule != "1f1b" or pp == 1
                                  or plan.num_microbatches % pp):
        return False  # the search's interleaved tasks (task_list.interleaves)
    b_m = plan.global_batch_size // plan.num_microbatches
    for space in spaces_of(method.space, options, world):
        if space.pps is not None and pp not in space.pps:
            continue
        # the even split of an interleaved plan is even over its pp * v chunks
        if ((space.even_split or options.partition == "even")
                and tuple(pipe.layers_per_stage) != even_partition(spec.num_layers,
                                                                   pipe.num_chunks)):
            continue
        rules = space.rules
        if not all(s in layer_strategies(spec.layer_types[spec.layer_order[i]], n, b_m, rules,
                                         devices_per_node)
                   for i, s in enumerate(plan.layers)):
            continue
        vocab = plan.vocab
        if space.vocab_tp == "layer":
            tps = list(rules.tps or ())
        elif isinstance(space.vocab_tp, int):
            tps = [space.vocab_tp]
        else:
            tps = vocab_tps(spec.vocab_size, n, b_m, dataclasses.replace(rules, tps=None),
                            devices_per_node)
        modes = ("ddp",) if n // vocab.tp == 1 else (space.vocab_modes or options.dp_modes)
        if vocab.tp in tps and vocab.dp_mode in modes:
            return True
    return False


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
