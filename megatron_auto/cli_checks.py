"""``megatron-auto``'s checks before a subcommand works: its output paths, and the model flags
that the chosen ``--model-type`` does not read.

Output paths (the shared checks of ``utils/output_paths.py``): every file or directory a
subcommand writes is checked writable before it searches, prices, measures or reads. What an
existing output becomes is each subcommand's contract (docs/cli.md, "Outputs"): the files
``plan --plan-out`` (default ``plan.json``), ``evaluate --plan-out``, ``explain --plot``,
``plot-metrics -o``, ``import-galvatron``'s ``--*-out``, ``profile-model --out`` and
``profile-hardware --out/--raw-out`` are results of the command and are rewritten (atomically:
a reader sees the old file or the new one); ``calibrate`` writes back into ``--cluster`` /
``--model-profile`` unless ``--cluster-out`` / ``--model-profile-out`` are given (its documented
default); ``reproduce --out DIR`` and ``--results`` are resumed and appended to, never
truncated. None of them takes ``--overwrite``.

Model flags: ``--model-type`` picks a family, and the flags the other registered families add
(the vision flags for a GPT, the T5 flags for a ViT, ...) are then read by nobody: one warning names them
(``utils/flag_warnings.py``), as the pretrain scripts do.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Callable, Sequence

from .families.registry import families, get_family
from .plan_errors import PlanError
from .plan_recompute import normalize_recompute
from .planner.cost.offload import host_budget_problem
from .planner.inputs.hardware import GB
from .planner.search.options import GALVATRON_SPACE
from .run_flag_checks import given_flags
from .utils.flag_warnings import warn_flag
from .utils.output_paths import check_output_dir, check_output_file

__all__ = ["check_outputs", "command_given_flags", "module_recompute_choices",
           "warn_other_family_flags", "with_host_budget"]

# (destination, flag) of the files each subcommand writes; "dir" entries are directories,
# "append" files are extended, "plot" files get matplotlib's suffix rule.
_OUTPUTS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "plan": (("plan_out", "--plan-out", "file"),),
    "evaluate": (("plan_out", "--plan-out", "file"),),
    "explain": (("plot", "--plot", "plot"),),
    "plot-metrics": (("output", "--output", "plot"),),
    "import-galvatron": (("model_profile_out", "--model-profile-out", "file"),
                         ("cluster_out", "--cluster-out", "file"),
                         ("plan_out", "--plan-out", "file")),
    "profile-model": (("out", "--out", "file"), ("cache_dir", "--cache-dir", "dir")),
    "profile-hardware": (("out", "--out", "file"), ("raw_out", "--raw-out", "file")),
    "calibrate": (("cluster_out", "--cluster-out", "file"),
                  ("model_profile_out", "--model-profile-out", "file")),
    "reproduce": (("out", "--out", "dir"), ("results", "--results", "append"),
                  ("table_out", "--table-out", "file")),
}


def check_outputs(args: argparse.Namespace) -> None:
    """``OutputPathError`` (one line, exit 2) for an output path of ``args.command`` that cannot
    be written; nothing is created."""
    for dest, flag, kind in _OUTPUTS.get(args.command, ()):
        path = getattr(args, dest, None)
        if not path:
            continue
        if kind == "dir":
            check_output_dir(path, flag)
            continue
        if kind == "plot":
            from .utils.plots import plot_path  # noqa: PLC0415 - start-up time of the others
            path = plot_path(path)
        check_output_file(path, flag, append=kind == "append")
    if args.command == "calibrate":  # the default writes back into the profiles it read
        if args.cluster_out is None and os.path.isfile(args.cluster):
            check_output_file(args.cluster, "--cluster")
        if args.model_profile_out is None and args.model_profile:
            check_output_file(args.model_profile, "--model-profile")


def command_given_flags(parser: argparse.ArgumentParser,
                        argv: Sequence[str]) -> frozenset[str] | None:
    """The destinations ``argv`` (``COMMAND FLAGS...``) types for its subcommand, or None when
    the parser has no such subcommand."""
    if not argv:
        return None
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and argv[0] in action.choices:
            return given_flags(action.choices[argv[0]], list(argv[1:]))
    return None


def _family_flags() -> list[tuple[Callable[[argparse.ArgumentParser], None], tuple[str, ...]]]:
    """Per flag adder of the registered families (vit and swin share one), the destinations it
    adds: a parser of those flags alone, built per call (only when model flags are given)."""
    out: list[tuple[Callable[[argparse.ArgumentParser], None], tuple[str, ...]]] = []
    for family in families():
        add = family.add_flags
        if add is None or any(known is add for known, _ in out):
            continue
        parser = argparse.ArgumentParser(add_help=False)
        parser.add_argument("--position-embedding-type", choices=["learned"])  # T5 widens it
        add(parser)
        out.append((add, tuple(a.dest for a in parser._actions
                               if a.dest != "position_embedding_type")))
    return out


def warn_other_family_flags(args: argparse.Namespace) -> None:
    """One warning naming the given flags of the families ``--model-type`` did not choose."""
    given = getattr(args, "given_flags", None)
    if not given or not hasattr(args, "model_type"):
        return
    adders = _family_flags()
    own = get_family(args.model_type).add_flags
    own_dests = {dest for add, dests in adders if add is own for dest in dests}
    unused = [dest for add, dests in adders if add is not own for dest in dests
              if dest in given and dest not in own_dests]
    if unused:
        flags = " ".join(f"--{d.replace('_', '-')}={getattr(args, d)}" for d in unused)
        warn_flag(f"{flags}: ignored with --model-type {args.model_type} (they describe "
                  f"another model family; pick its --model-type or drop them)")


def module_recompute_choices(values: list[str]) -> tuple:
    """``--search-module-recompute`` values as plan recompute values (one line per bad one)."""
    out = []
    for text in values:
        try:
            value = normalize_recompute(text if text in ("none", "selective", "full")
                                        else text.split("+"), "--search-module-recompute")
        except PlanError as err:
            raise ValueError(str(err).replace("plan field ", "")) from None
        if isinstance(value, bool):
            raise ValueError(f"--search-module-recompute={text}: none and full are always "
                             f"searched; give selective or a module list such as core_attn+mlp")
        out.append(value)
    return tuple(dict.fromkeys(out))


def with_host_budget(estimate: Any, host_budget_gb: float | None) -> Any:
    """``estimate`` with the host budget recorded; one line (``ValueError``) when a bad budget
    or an offload plan's host memory does not fit it (``planner/cost/offload.py``)."""
    problem = host_budget_problem(getattr(estimate, "host_memory_bytes", 0.0), host_budget_gb,
                                  getattr(estimate, "host_optimizer_bytes", 0.0))
    if problem:
        raise ValueError(problem)
    if host_budget_gb is None or estimate is None:
        return estimate
    return dataclasses.replace(estimate, host_memory_budget_bytes=host_budget_gb * GB)


# ``megatron-auto plan``'s flags of the SearchOptions fields its errors name.
_OPTION_FLAGS = {"space": "--search-space", "time_limit_s": "--time-limit",
                 "optimality_gap": "--optimality-gap",
                 "tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
                 "vocab_tp": "--vocab-tensor-parallel-size",
                 "num_microbatches": "--num-microbatches", "schedule": "--schedule"}


def with_flag_names(text: str) -> str:
    """A search option error (``search option tp=3: ...``) with the flag's name instead."""
    for field_name, flag in _OPTION_FLAGS.items():
        text = text.replace(f"search option {field_name}=", f"{flag}=")
    return text


def search_space_conflict(args: argparse.Namespace) -> str | None:
    """The error of ``plan`` flags that leave the chosen ``--search-space`` empty, or None."""
    if args.search_space == GALVATRON_SPACE and args.use_distributed_optimizer:
        return ("--use-distributed-optimizer with --search-space galvatron: Galvatron's DP "
                "flavours are ZeRO-2 and ZeRO-3 (SDP), not zero1; drop one of them")
    return None
