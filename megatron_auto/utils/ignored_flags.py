"""Megatron-LM flags accepted and ignored (docs/training.md): a Megatron launch script runs.

:data:`IGNORED_MEGATRON_FLAGS` lists flags that select kernels, overlap or implementations this
runtime has no variant of; the pretrain scripts accept them (``add_ignored_megatron_args``) and
one warning names those given (``warn_ignored_megatron_flags``). Pure standard library.
"""

from __future__ import annotations

import argparse

from .flag_warnings import warn_flag

# Megatron-LM flags that a Megatron launch script passes and that change nothing here (kernel
# fusions, overlap and implementation switches this runtime has no variant of, data-loader
# knobs): accepted so the script runs, and named in one warning. Flag -> its value's metavar
# (None: a switch) and its choices (None: any). Never list a flag this project implements or
# means to (--sequence-parallel, --transformer-impl transformer_engine, --fp8-format,
# --disable-bias-linear, --openai-gelu, --group-query-attention, --num-query-groups, ...):
# ignoring those would train another model than asked. Listed in docs/training.md.
IGNORED_MEGATRON_FLAGS: dict[str, tuple[str | None, tuple[str, ...] | None]] = {
    "--use-mcore-models": (None, None),
    "--use-flash-attn": (None, None),
    "--no-masked-softmax-fusion": (None, None),
    "--no-bias-gelu-fusion": (None, None),
    "--no-bias-swiglu-fusion": (None, None),
    "--no-bias-dropout-fusion": (None, None),
    "--no-rope-fusion": (None, None),
    "--no-gradient-accumulation-fusion": (None, None),
    "--no-async-tensor-model-parallel-allreduce": (None, None),
    "--overlap-grad-reduce": (None, None),
    "--overlap-param-gather": (None, None),
    "--no-persist-layer-norm": (None, None),
    "--attention-softmax-in-fp32": (None, None),
    "--accumulate-allreduce-grads-in-fp32": (None, None),
    "--use-cpu-initialization": (None, None),
    "--no-create-attention-mask-in-dataloader": (None, None),
    "--manual-gc": (None, None),
    "--log-throughput": (None, None),
    # The backend follows the device (NCCL on CUDA, gloo on CPU).
    "--distributed-backend": ("BACKEND", ("nccl", "gloo")),
    "--num-workers": ("N", None),
    "--dataloader-type": ("TYPE", ("single", "cyclic", "external")),
    "--attention-backend": ("BACKEND", None),
    # Checkpoints here are always torch.distributed.checkpoint files (docs/training.md).
    "--ckpt-format": ("FORMAT", ("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor")),
}


def _ignored_dest(flag: str) -> str:
    return "ignored_" + flag.lstrip("-").replace("-", "_")


def add_ignored_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """:data:`IGNORED_MEGATRON_FLAGS`; an absent one leaves no attribute (``SUPPRESS``), so the
    namespace tells exactly which were typed."""
    g = parser.add_argument_group("Megatron-LM flags accepted and ignored (one warning names "
                                  "them)")
    for flag, (metavar, choices) in IGNORED_MEGATRON_FLAGS.items():
        if metavar is None:
            g.add_argument(flag, dest=_ignored_dest(flag), action="store_true",
                           default=argparse.SUPPRESS, help="no effect here")
        else:
            g.add_argument(flag, dest=_ignored_dest(flag), metavar=metavar, choices=choices,
                           default=argparse.SUPPRESS, help="no effect here")
    return parser


def warn_ignored_megatron_flags(args: argparse.Namespace) -> None:
    """One warning naming the ignored Megatron-LM flags the command line gave."""
    ignored = [flag if metavar is None else f"{flag}={getattr(args, _ignored_dest(flag))}"
               for flag, (metavar, _) in IGNORED_MEGATRON_FLAGS.items()
               if hasattr(args, _ignored_dest(flag))]
    if ignored:
        warn_flag(f"Megatron-LM flags ignored (no effect in megatron_auto; see "
                  f"docs/training.md): {' '.join(ignored)}", stacklevel=3)
