"""``megatron-auto profile-model``, ``profile-hardware`` and ``calibrate`` subcommands.

``megatron_auto/cli.py`` registers them, handing over its shared model flags (this module never
imports the top-level CLI)::

    add_profile_model_parser(sub, add_model_flags, model_config_from_flags)
    add_profile_hardware_parser(sub)
    add_calibrate_parser(sub)

Each ``add_*`` function adds one subparser and sets ``func`` to its handler; a handler takes the
parsed namespace and returns the exit status. Errors are ``ValueError`` subclasses whose message
names the flag, the value and the fix (``cli.main`` prints them as one line, status 2).

Importing this module loads no torch: the measuring modules (``model_profiler``,
``hardware_profiler``) are imported by the handlers that run them, so ``megatron-auto --help``
and the planning subcommands stay torch-free. Calibration is pure fitting
(:mod:`megatron_auto.planner.calibrate`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any, Callable

from ..config import ModelConfig
from ..families.registry import spec_of_record
from ..run_config import resolve_precision
from ..planner.calibrate import calibrate_files
from ..planner.inputs.hardware import ClusterSpec

logger = logging.getLogger(__name__)

_FMT = argparse.RawDescriptionHelpFormatter

PROFILE_MODEL_EPILOG = """examples:
  # measure a GPT layer, the embedding and the head on this machine's GPU (or CPU), cached
  megatron-auto profile-model --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \\
      --seq-length 1024 --bf16 --out gpt-1024.profile.json
  # then plan with it
  megatron-auto plan ... --bf16 --model-profile gpt-1024.profile.json
  # re-measure although a cached profile exists; choose the micro-batch sizes of the fit
  megatron-auto profile-model --hidden-size 512 --num-attention-heads 8 --force \\
      --batch-sizes 2 4 8 16
The cache lives in $MEGATRON_AUTO_CACHE or ~/.cache/megatron_auto/profiles (--cache-dir)."""

PROFILE_HARDWARE_EPILOG = """examples:
  # one process per device; rank 0 writes the cluster profile
  torchrun --nproc-per-node 8 -m megatron_auto.cli profile-hardware --out cluster.json
  # two nodes (run on both; node boundaries come from torchrun's LOCAL_WORLD_SIZE); keep
  # every timing for the record
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 \\
      -m megatron_auto.cli profile-hardware --out cluster-2x8.json --raw-out cluster-2x8.raw.json
  # then
  megatron-auto plan ... --cluster cluster.json
Without torchrun it profiles this one device (compute only, no communication)."""

CALIBRATE_EPILOG = """examples:
  # train with a plan and a metrics file, then correct the profiles from what was measured
  torchrun --nproc-per-node 8 pretrain_gpt.py ... --plan plan.json --metrics-file run1.jsonl
  megatron-auto calibrate --run run1.jsonl plan.json --run run2.jsonl plan2.json \\
      --cluster cluster.json --model-profile gpt.profile.json
  # a preset cluster is not overwritten: name the output
  megatron-auto calibrate --run run1.jsonl plan.json --cluster a100-40g-1x8 --bf16 \\
      --cluster-out a100-calibrated.json
Fits the compute time scale and overlap slowdown to iteration_time_s, and the memory reserve
and activation scale to peak_memory_bytes (least squares; docs/profiling.md)."""


def _precision(args: argparse.Namespace, default: str | None) -> str | None:
    """The package's one precision rule (``run_config.resolve_precision``) on these flags."""
    return resolve_precision(getattr(args, "bf16", False), getattr(args, "fp16", False), default)


# --------------------------------------------------------------------------- profile-model
def add_profile_model_parser(
        subparsers: Any, add_model_flags: Callable[[argparse.ArgumentParser], None],
        model_config_from_flags: Callable[[argparse.Namespace], ModelConfig]
) -> argparse.ArgumentParser:
    """``profile-model``: measure the model's layer, embedding and head (cached).

    ``add_model_flags`` adds the model shape flags every ``megatron-auto`` subcommand shares and
    ``model_config_from_flags`` turns them into a :class:`ModelConfig` (``megatron_auto.cli``
    owns both; passing them in keeps the profiler below the top-level CLI).
    """
    p = subparsers.add_parser("profile-model", help="measure a model's layer/embedding/head costs",
                              description=cmd_profile_model.__doc__, epilog=PROFILE_MODEL_EPILOG,
                              formatter_class=_FMT, allow_abbrev=False)
    add_model_flags(p)
    g = p.add_argument_group("profiling")
    g.add_argument("--bf16", action="store_true", help="bf16 mixed precision (autocast)")
    g.add_argument("--fp16", action="store_true", help="fp16 mixed precision (autocast)")
    g.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if present)")
    g.add_argument("--out", default=None, metavar="FILE",
                   help="also write the profile here (for --model-profile)")
    g.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="default: $MEGATRON_AUTO_CACHE or ~/.cache/megatron_auto/profiles")
    g.add_argument("--force", action="store_true", help="measure even if a cached profile exists")
    g.add_argument("--batch-sizes", type=int, nargs="+", default=None, metavar="B",
                   help="micro-batch sizes of the linear fits (default 2 4 8 on CPU, 2 4 6 8 on GPU)")
    g.add_argument("--iters", type=int, default=9,  # ModelProfilerConfig.iters (that module imports torch)
                   help="timed rounds, every size once per round (default 9)")
    g.add_argument("--warmup-iters", type=int, default=2)
    g.add_argument("--tp-degrees", type=int, nargs="+", default=None, metavar="T",
                   help="also time the layer's TP shard at these degrees >= 2 (default: the "
                        "powers of two up to the local ranks under torchrun, none alone)")
    g.add_argument("--json", action="store_true", help="print the profile JSON")
    p.set_defaults(func=cmd_profile_model, model_config_from_flags_=model_config_from_flags)
    return p


def cmd_profile_model(args: argparse.Namespace) -> int:
    """Measure (or reuse from the cache) the model profile and print a summary."""
    from ..parallel.device import resolve_device  # noqa: PLC0415 - lazy: torch (seconds to import), only when measuring
    from .lookup import lookup_or_measure  # noqa: PLC0415 - lazy: torch and the models
    from .measure import ModelProfilerConfig  # noqa: PLC0415 - lazy: torch

    config = args.model_config_from_flags_(args)
    precision = _precision(args, "fp32")
    resolve_device(args.device)  # a --device that does not exist here stops before measuring
    settings = ModelProfilerConfig(batch_sizes=tuple(args.batch_sizes or ()),
                                   warmup_iters=args.warmup_iters, iters=args.iters,
                                   tp_degrees=(tuple(args.tp_degrees) if args.tp_degrees
                                               else None))
    found = lookup_or_measure(config, precision, args.device, args.cache_dir, config=settings,
                              force=args.force)  # the config's family measures it
    profile, cached = found.profile, not found.measured
    if args.out:
        profile.save(args.out)
    if args.json:
        print(json.dumps(profile.to_dict(), indent=2))
        return 0
    emb = profile.embedding
    print(f"model profile ({profile.precision}, {profile.metadata.get('device', '?')}"
          f"{', from the cache' if cached else ''})")
    for name, lt in profile.layer_types.items():  # one type (GPT, BERT, ViT) or several (Swin)
        label = "layer" if len(profile.layer_types) == 1 else f"layer {name}"
        print(f"  {label}: {lt.parameter_count:,} parameters; forward "
              f"{lt.forward_time_per_sample_s * 1e3:.3f} ms/sample + "
              f"{lt.forward_time_constant_s * 1e3:.3f} ms; backward x"
              f"{lt.backward_forward_ratio:.2f}")
        if lt.measured_tp_degrees():
            print(f"  {label} TP efficiency (measured shards): " + ", ".join(
                f"tp{t} {lt.tp_efficiency(t):.2f}" for t in lt.measured_tp_degrees())
                + f"; replicated fraction {lt.tp_replicated_fraction:.3f}")
        print(f"  {label} activations per sample: {lt.activation_replicated_bytes / 2**20:.2f} "
              f"MiB replicated + {lt.activation_split_bytes / 2**20:.2f} MiB split by tp; "
              f"recompute keeps {lt.recompute_bytes_per_sample / 2**20:.2f} MiB")
    print(f"  head: forward {emb.head_forward_time_per_sample_s * 1e3:.3f} ms/sample; logits "
          f"transient {emb.head_transient_split_bytes / 2**20:.2f} MiB/sample (split by vocab tp)")
    if args.out:
        print(f"  wrote {args.out}")
    return 0


# ------------------------------------------------------------------------ profile-hardware
def add_profile_hardware_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``profile-hardware``: measure collectives, p2p, overlap and FLOP/s (under torchrun)."""
    p = subparsers.add_parser("profile-hardware", help="measure this cluster (run under torchrun)",
                              description=cmd_profile_hardware.__doc__,
                              epilog=PROFILE_HARDWARE_EPILOG, formatter_class=_FMT,
                              allow_abbrev=False)
    add_hardware_flags(p)
    p.set_defaults(func=cmd_profile_hardware)
    return p


def add_hardware_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The hardware profiler's flags (``profile-hardware``)."""
    parser.add_argument("--out", required=True, help="cluster profile JSON to write (rank 0)")
    parser.add_argument("--raw-out", default=None, help="also write every timing here (rank 0)")
    parser.add_argument("--name", default=None, help="cluster name (default measured-<device>-NxD)")
    parser.add_argument("--message-sizes", type=int, nargs="+", default=None, metavar="BYTES",
                        help="message sizes to fit bandwidth and latency from "
                             "(default 64K/1M/4M on CPU, 1M/16M/128M on GPU)")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per size (default 10)")
    parser.add_argument("--warmup-iters", type=int, default=1)
    parser.add_argument("--devices-per-node", type=int, default=None,
                        help="ranks per node (default: torchrun's LOCAL_WORLD_SIZE)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                        help="default: nccl when CUDA is available, else gloo")
    return parser


def profile_hardware_from_args(args: argparse.Namespace) -> ClusterSpec:
    """Initialise torch.distributed from torchrun's env when needed, profile, write on rank 0.

    Collective over the world: every rank calls it with the same flags; every rank returns the
    same :class:`ClusterSpec`.
    """
    import torch  # noqa: PLC0415 - lazy: torch (seconds to import), only when measuring
    import torch.distributed as dist  # noqa: PLC0415 - lazy: torch

    from .hardware_profiler import HardwareProfilerConfig, profile_hardware  # noqa: PLC0415 - lazy: torch

    config = HardwareProfilerConfig(message_sizes=tuple(args.message_sizes or ()),
                                    warmup_iters=args.warmup_iters, iters=args.iters,
                                    devices_per_node=args.devices_per_node, name=args.name)
    own_group = False
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        else:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        dist.init_process_group(backend)
        own_group = True
    try:
        profile = profile_hardware(config)
        spec = profile.to_cluster_spec(config.name)
        if not dist.is_initialized() or dist.get_rank() == 0:
            spec.save(args.out)
            if args.raw_out:
                with open(args.raw_out, "w", encoding="utf-8") as fh:
                    json.dump(profile.to_dict(), fh, indent=2)
            logger.info("wrote %s (all-reduce busbw %s)", args.out,
                        {f"{g}{'c' if c else 's'}": f"{v / 1e9:.2f} GB/s"
                         for (g, c), v in spec.allreduce_busbw_table.items()})
        return spec
    finally:
        if own_group:
            dist.destroy_process_group()


def cmd_profile_hardware(args: argparse.Namespace) -> int:
    """Profile the cluster this process belongs to and write the cluster JSON on rank 0."""
    spec = profile_hardware_from_args(args)
    if int(os.environ.get("RANK", "0")) == 0:
        table = ", ".join(f"{g}{'' if c else ' strided'}: {v / 1e9:.2f} GB/s"
                          for (g, c), v in sorted(spec.allreduce_busbw_table.items()))
        print(f"wrote {args.out}: {spec.world_size} device(s) ({spec.device_name}); all-reduce "
              f"busbw {table or 'not measured (one process)'}; overlap slowdown "
              f"{spec.overlap_slowdown:.3f}")
    return 0


# ------------------------------------------------------------------------------- calibrate
def add_calibrate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``calibrate``: fit correction terms to measured runs and write them into the profiles."""
    p = subparsers.add_parser("calibrate", help="correct cluster/model profiles from measured runs",
                              description=cmd_calibrate.__doc__, epilog=CALIBRATE_EPILOG,
                              formatter_class=_FMT, allow_abbrev=False)
    p.add_argument("--run", nargs=2, action="append", required=True,
                   metavar=("METRICS", "PLAN"),
                   help="a run's --metrics-file and the plan it trained with (repeat for more)")
    p.add_argument("--cluster", required=True, metavar="NAME|FILE",
                   help="the cluster the plans were priced with (preset or JSON)")
    p.add_argument("--model-profile", default=None, metavar="FILE",
                   help="the model profile they were priced with (default: analytic)")
    p.add_argument("--cluster-out", default=None, metavar="FILE",
                   help="default: overwrite --cluster (required when it is a preset)")
    p.add_argument("--model-profile-out", default=None, metavar="FILE",
                   help="default: overwrite --model-profile")
    p.add_argument("--bf16", action="store_true", help="the runs trained in bf16")
    p.add_argument("--fp16", action="store_true", help="the runs trained in fp16")
    p.add_argument("--skip-iterations", type=int, default=2, metavar="N",
                   help="warm-up records to drop from each metrics file (default 2)")
    p.add_argument("--json", action="store_true", help="print the fitted terms as JSON")
    p.set_defaults(func=cmd_calibrate)
    return p


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit time scale, latency scale, overlap slowdown, memory reserve and activation scale."""
    if args.skip_iterations < 0:
        raise ValueError(f"--skip-iterations {args.skip_iterations}: must be >= 0")
    precision = _precision(args, None if args.model_profile else "fp32")
    result = calibrate_files([tuple(r) for r in args.run], args.cluster, args.model_profile,
                             spec_of=spec_of_record, cluster_out=args.cluster_out,
                             model_profile_out=args.model_profile_out, precision=precision,
                             skip_iterations=args.skip_iterations)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.summary())
        print(f"wrote {args.cluster_out or args.cluster}"
              + (f" and {args.model_profile_out or args.model_profile}" if args.model_profile
                 else ""))
    return 0
