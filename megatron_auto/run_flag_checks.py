"""The pretrain scripts' output paths and the flags that cannot apply, checked while parsing.

:func:`check_output_flags` runs the shared output-path checks (``utils/output_paths.py``) on
every path a training run writes, before the world is joined, so that a ``--save`` directory
that cannot be written stops the run before its first iteration (it used to fail at the first
save, with a traceback and the iterations lost). What each output does when it already exists
is the run's contract, documented in docs/training.md: checkpoints are added to ``--save``
(an existing checkpoint of another run there is refused unless ``--load`` continues it or
``--overwrite`` is given: ``training/pretrain.py``), ``--metrics-file`` is appended to,
``--plan-out`` is rewritten, TensorBoard and W&B add their own new files.

:func:`warn_inapplicable_flags` warns once (``utils/flag_warnings.py``) for each flag given
where it cannot do anything: experiment-log options without a sink, timers at
``--timing-log-level 0``, ``--compile-backend`` without ``--compile``;
:func:`warn_sequence_parallel_at_tp1` for ``--sequence-parallel`` at tensor-parallel size 1.
:func:`given_flags` tells which flags the command line typed, for the model families that
ignore some shared model flags (``families/*/flags.py``, :func:`warn_ignored_model_flags`).
Pure.
"""

from __future__ import annotations

import argparse
from typing import Iterable, Sequence

from .config import ArgumentError
from .utils.flag_warnings import warn_flag
from .utils.output_paths import check_output_dir, check_output_file

__all__ = ["check_output_flags", "given_flags", "warn_ignored_model_flags",
           "warn_inapplicable_flags", "warn_sequence_parallel_at_tp1"]

_UNSEEN = object()


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> frozenset[str]:
    """The destinations ``argv`` sets, whatever their values (a flag typed with its default
    value counts). argparse fills a destination with its default only when the namespace
    lacks it, so a namespace pre-filled with a marker keeps the marker where nothing was
    typed."""
    # Actions that build on the value already there (append, extend, count) start from None,
    # which they all accept; the others from a marker no flag can produce.
    accumulating = {action.dest for action in parser._actions
                    if isinstance(action, (argparse._AppendAction, argparse._AppendConstAction,
                                           argparse._CountAction))}
    marked = argparse.Namespace(**{action.dest: None if action.dest in accumulating else _UNSEEN
                                   for action in parser._actions
                                   if action.dest is not argparse.SUPPRESS})
    parser.parse_args(argv, marked)
    return frozenset(dest for dest, value in vars(marked).items()
                     if value is not (None if dest in accumulating else _UNSEEN))


def check_output_flags(args: argparse.Namespace) -> None:
    """``ArgumentError`` for an output path of the run that cannot be written (nothing is
    created here: the writers make their directories)."""
    if args.save:
        check_output_dir(args.save, "--save", ArgumentError)
    if args.tensorboard_dir:
        check_output_dir(args.tensorboard_dir, "--tensorboard-dir", ArgumentError)
    if args.wandb_project and args.wandb_save_dir:
        check_output_dir(args.wandb_save_dir, "--wandb-save-dir", ArgumentError)
    if args.data_cache_path:
        check_output_dir(args.data_cache_path, "--data-cache-path", ArgumentError)
    if args.metrics_file:
        check_output_file(args.metrics_file, "--metrics-file", ArgumentError, append=True)
    if args.plan_out:
        check_output_file(args.plan_out, "--plan-out", ArgumentError)


# Data flags that only matter when a tokenizer is built (not with --mock-data).
_TOKENIZER_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")


def warn_inapplicable_flags(args: argparse.Namespace) -> None:
    """One warning per flag that is given but changes nothing in this run."""
    for flag in ("memory_budget_gb", "cluster", "optimality_gap", "cp_min_seq_length"):
        if getattr(args, flag, None) is not None and not args.auto_parallel:
            warn_flag(f"--{flag.replace('_', '-')}={getattr(args, flag)} only guides "
                      f"--auto-parallel and is ignored without it")
    if args.mock_data:  # random token ids: the vocabulary is --vocab-size, no tokenizer is built
        given = [f"--{flag.replace('_', '-')}={getattr(args, flag)}" for flag in _TOKENIZER_FLAGS
                 if getattr(args, flag) is not None]
        if given:
            warn_flag(f"{' '.join(given)}: ignored with --mock-data (random token ids; the "
                      f"vocabulary is --vocab-size)")
    if args.auto_parallel and args.sequence_parallel and args.tensor_model_parallel_size == 1:
        warn_sequence_parallel_at_tp1()
    sink = args.tensorboard_dir or args.wandb_project
    if not sink:
        for flag in ("log_timers_to_tensorboard", "log_memory_to_tensorboard",
                     "log_validation_ppl_to_tensorboard"):
            if getattr(args, flag):
                warn_flag(f"--{flag.replace('_', '-')}: there is no --tensorboard-dir or "
                          f"--wandb-project to log to; add one or drop the flag")
        if args.tensorboard_log_interval != 1:
            warn_flag(f"--tensorboard-log-interval={args.tensorboard_log_interval}: there is no "
                      f"--tensorboard-dir or --wandb-project to log to; add one or drop the flag")
    if args.log_timers_to_tensorboard and sink and args.timing_log_level == 0:
        warn_flag("--log-timers-to-tensorboard: --timing-log-level=0 (the default) records no "
                  "timers; add --timing-log-level 1 or 2")
    if not args.wandb_project:
        for flag in ("wandb_save_dir", "wandb_exp_name"):
            if getattr(args, flag) is not None:
                warn_flag(f"--{flag.replace('_', '-')}={getattr(args, flag)}: applies to a W&B "
                          f"run, and there is none without --wandb-project; add it or drop the "
                          f"flag")
    if args.compile_backend is not None and not args.compile:
        warn_flag(f"--compile-backend={args.compile_backend}: only chooses the backend of "
                  f"--compile; add --compile or drop the flag")


def warn_sequence_parallel_at_tp1() -> None:
    """``--sequence-parallel`` where every layer has tp 1 (the classic flags' default, or a
    pinned ``--tensor-model-parallel-size 1``): Megatron-LM turns it off with a warning, and so
    do the classic flags, ``--auto-parallel`` and ``megatron-auto plan`` here (a plan file's
    ``sequence_parallel`` at tp 1 is refused instead: a plan states each layer exactly)."""
    warn_flag("--sequence-parallel: does nothing with --tensor-model-parallel-size 1 (sequence "
              "parallelism splits over the tensor-parallel group, as in Megatron-LM); raise "
              "the TP size or drop the flag", stacklevel=3)


def warn_ignored_model_flags(given: Iterable[str] | None, ignored: Iterable[str],
                             args: argparse.Namespace, model: str, why: str) -> None:
    """One warning naming every flag of ``ignored`` (destinations) that ``given`` holds: the
    ``model`` does not read them (``why``). ``given`` None: unknown, nothing is said."""
    if given is None:
        return
    typed = [dest for dest in ignored if dest in set(given)]
    if not typed:
        return
    flags = " ".join(f"--{dest.replace('_', '-')}={getattr(args, dest)}" for dest in typed)
    warn_flag(f"{flags}: ignored by the {model} model ({why})", stacklevel=3)
