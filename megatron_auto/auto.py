"""``--auto-parallel``: profile what is missing, search on one rank, broadcast the plan.

This module joins the profilers and the planner for a training run (DESIGN §2). It is called
collectively by every rank from :func:`megatron_auto.arguments.resolve_plan`:

1. **Cluster.** ``--cluster NAME|FILE`` when given; otherwise the hardware profile measured on
   this very cluster, cached (keyed by world size, node shape, device, backend and torch
   version) so that only the first run pays for it. Profiling is collective: rank 0 decides
   whether the cache hits and every rank follows the same decision.
2. **Model profile.** Measured by rank 0 on its device with the runtime's own layers (cached by
   the model profiler); the other ranks wait at a barrier.
3. **Search** on rank 0 only (the planner is pure computation), with every flag the user set
   explicitly next to ``--auto-parallel`` pinned (``--tensor-model-parallel-size``,
   ``--pipeline-model-parallel-size``, ``--micro-batch-size`` with both of those,
   ``--use-distributed-optimizer``); the rest is searched.
4. The plan (or the error) is broadcast as JSON, so every rank trains with exactly the same plan
   or stops with the same message. Rank 0 prints the explain table; ``--plan-out`` is written by
   the training loop.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .config import ModelConfig
from .parallel.device import resolve_device
from .plan import Plan, PlanError
from .planner.hardware import ClusterSpec
from .planner.megatron_flags import to_megatron_flags
from .planner.model_spec import ModelSpec, TrainingSpec
from .planner import report
from .vision_config import VisionConfig

logger = logging.getLogger("megatron_auto")

# Flags that pin a planner choice when the user writes them next to --auto-parallel.
PINNABLE_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "micro_batch_size", "use_distributed_optimizer", "recompute_granularity",
                  "global_batch_size")


class AutoParallelError(ValueError):
    """--auto-parallel could not produce a plan; the message says why and what to change."""


# --------------------------------------------------------------------------- explicit flags
def explicit_flags(argv: Sequence[str], parser: argparse.ArgumentParser) -> set[str]:
    """Destinations the user set on the command line (as opposed to parser defaults).

    Re-parses ``argv`` with every default suppressed, so only what was typed appears.
    """
    quiet = argparse.ArgumentParser(add_help=False, allow_abbrev=parser.allow_abbrev)
    for action in parser._actions:  # noqa: SLF001 - argparse has no public action list
        if isinstance(action, argparse._HelpAction):  # noqa: SLF001
            continue
        kwargs: dict[str, Any] = {"dest": action.dest, "default": argparse.SUPPRESS}
        if action.nargs == 0:
            kwargs["action"] = "store_const"
            kwargs["const"] = action.const if action.const is not None else True
        else:
            kwargs["nargs"] = action.nargs
        if action.option_strings:
            quiet.add_argument(*action.option_strings, **kwargs)
    known, _ = quiet.parse_known_args(list(argv))
    return set(vars(known))


def _argv_of(args: argparse.Namespace) -> list[str]:
    return list(getattr(args, "argv_", None) or sys.argv[1:])


# --------------------------------------------------------------------------- search options
def search_options_for(args: argparse.Namespace, explicit: set[str], world_size: int,
                       global_batch_size: int):
    """Planner options from the flags the user pinned; everything else stays searchable."""
    from .planner.search import SearchOptions  # noqa: PLC0415 - planner front door

    tp = args.tensor_model_parallel_size if "tensor_model_parallel_size" in explicit else None
    pp = args.pipeline_model_parallel_size if "pipeline_model_parallel_size" in explicit else None
    num_microbatches = None
    if "micro_batch_size" in explicit:
        if tp is None or pp is None:
            logger.warning("--micro-batch-size=%s is ignored by --auto-parallel unless "
                           "--tensor-model-parallel-size and --pipeline-model-parallel-size pin "
                           "the data-parallel size too; the planner chooses the micro-batch "
                           "count", args.micro_batch_size)
        else:
            dp = world_size // (tp * pp)
            per_step = args.micro_batch_size * dp
            if per_step <= 0 or global_batch_size % per_step:
                raise AutoParallelError(
                    f"--micro-batch-size={args.micro_batch_size}: times the data-parallel size "
                    f"{dp} must divide --global-batch-size={global_batch_size}")
            num_microbatches = global_batch_size // per_step
    dp_modes = ("zero2",) if getattr(args, "use_distributed_optimizer", False) else \
        ("ddp", "zero2", "zero3")
    if "recompute_granularity" in explicit:
        logger.warning("--recompute-granularity is decided per layer by --auto-parallel; the "
                       "flag is ignored")
    return SearchOptions(tp=tp, pp=pp, num_microbatches=num_microbatches, dp_modes=dp_modes,
                         show_progress=True)


def precision_of(args: argparse.Namespace) -> str:
    return "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) \
        else "fp32"


# --------------------------------------------------------------------------- profiles
def _device() -> torch.device:
    return resolve_device()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (identity in a world of one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def cluster_cache_path(cache_dir: Path, world_size: int, local_world: int,
                       device: torch.device) -> Path:
    from .profiler.hardware_profiler import PROFILER_REVISION  # noqa: PLC0415

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    backend = dist.get_backend() if dist.is_initialized() else "none"
    slug = "".join(c if c.isalnum() else "-" for c in name.lower())
    return cache_dir / (f"cluster-{slug}-{world_size // local_world}x{local_world}-{backend}-"
                        f"torch{torch.__version__.split('+')[0]}-r{PROFILER_REVISION}.json")


def resolve_cluster(args: argparse.Namespace, world_size: int, cache_dir: Path) -> ClusterSpec:
    """``--cluster`` or a measured (and cached) hardware profile. Collective over the world."""
    from .planner.presets import get_cluster  # noqa: PLC0415

    if args.cluster:
        cluster = get_cluster(args.cluster)
        if cluster.world_size < world_size:
            raise AutoParallelError(
                f"--cluster {args.cluster}: describes {cluster.world_size} devices but this run "
                f"has {world_size} ranks; choose a cluster with at least {world_size} devices or "
                f"omit --cluster to measure this one")
        return cluster
    device = _device()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    path = cluster_cache_path(cache_dir, world_size, local, device)
    hit = _broadcast(path.exists() if _rank() == 0 else None)
    if hit:
        logger.info("> --auto-parallel: using the cached hardware profile %s", path)
        return _broadcast(ClusterSpec.load(path) if _rank() == 0 else None)
    from .profiler.hardware_profiler import HardwareProfilerConfig, profile_hardware  # noqa: PLC0415

    logger.info("> --auto-parallel: measuring the hardware (once; cached in %s)", path)
    spec = _broadcast(profile_hardware(HardwareProfilerConfig()).to_cluster_spec())
    if _rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        spec.save(path)  # atomic: ranks of a later run may read it
    return spec


def describes_this_machine(cluster: ClusterSpec) -> bool:
    """Whether ``cluster`` is of this machine's device kind, so that measuring the model here
    informs the plan (a preset of other GPUs gets the analytic model profile instead)."""
    device = _device()
    if device.type == "cuda":
        return cluster.device_name == torch.cuda.get_device_name(device)
    return cluster.device_name.lower().startswith("cpu")


def contend_while_profiling(model_config: ModelConfig, precision: str, cache_dir: Path) -> None:
    """When rank 0 is about to measure the model (no cached profile), every rank measures it
    at the same time, so that compute is timed under the same sharing of the machine as the
    training that follows (CPU ranks share cores; on GPUs each rank has its own device and this
    only costs the few seconds of the measurement). Only rank 0's profile is kept (cached by
    :func:`resolve_model_profile`); the others' are discarded. Collective."""
    from .profiler import cache as profile_cache  # noqa: PLC0415
    from .profiler.model_profiler import profile_cache_key, profile_model  # noqa: PLC0415

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if isinstance(model_config, VisionConfig):
        from .profiler.vision_profiler import (  # noqa: PLC0415 - the vision models
            profile_vision_model as profile_model, vision_profile_cache_key as profile_cache_key)
    key = profile_cache_key(model_config, precision, _device())
    cached = _broadcast(profile_cache.load_cached(key, cache_dir) is not None
                        if _rank() == 0 else None)
    if not cached and _rank() != 0:
        profile_model(model_config, precision, _device())


def resolve_model_profile(model_config: ModelConfig, spec: ModelSpec, precision: str,
                          cluster: ClusterSpec, cache_dir: Path | None, measure: bool):
    """A measured model profile (cached by the model profiler) or, when ``measure`` is false
    (a preset cluster describes other hardware), the analytic one. Call on rank 0 only."""
    from .planner.profiles import analytic_profile  # noqa: PLC0415

    training = TrainingSpec(global_batch_size=1, precision=precision)
    if not measure:
        return analytic_profile(spec, training, cluster)
    if isinstance(model_config, VisionConfig):
        from .profiler.vision_profiler import lookup_or_measure_vision  # noqa: PLC0415 - models

        return lookup_or_measure_vision(model_config, precision, _device(),
                                        cache_dir=cache_dir).profile
    from .profiler.model_profiler import get_or_create_model_profile  # noqa: PLC0415

    return get_or_create_model_profile(model_config, precision, _device(), cache_dir=cache_dir)


# --------------------------------------------------------------------------- entry point
def plan_for_run(args: argparse.Namespace, model_config: ModelConfig, world_size: int) -> Plan:
    """Profile, search and broadcast: the plan every rank of this run trains with."""
    from .arguments import DEFAULT_GLOBAL_BATCH_SIZE, build_parser  # noqa: PLC0415 - lazy cycle
    from .planner.search import InfeasibleError, search  # noqa: PLC0415
    from .profiler.cache import default_cache_dir  # noqa: PLC0415

    if args.plan:
        raise AutoParallelError("--auto-parallel and --plan given together: --plan trains "
                                "with a fixed plan; drop one of them")
    explicit = explicit_flags(_argv_of(args), build_parser())
    global_batch = args.global_batch_size or DEFAULT_GLOBAL_BATCH_SIZE
    precision = precision_of(args)
    cache_dir = Path(default_cache_dir())
    cluster = resolve_cluster(args, world_size, cache_dir)
    try:
        budget = cluster.budget_bytes(args.memory_budget_gb)
    except ValueError as err:
        raise AutoParallelError(str(err)) from None
    spec = ModelSpec.from_model_config(model_config)
    options = search_options_for(args, explicit, world_size, global_batch)

    measure = describes_this_machine(cluster)
    if measure:
        contend_while_profiling(model_config, precision, cache_dir)
    outcome: dict[str, Any] | None = None
    if _rank() == 0:
        try:
            profile = resolve_model_profile(model_config, spec, precision, cluster, cache_dir,
                                            measure=measure)
            training = TrainingSpec(global_batch_size=global_batch, precision=precision)
            result = search(spec, training, cluster, profile, budget, options,
                            world_size=world_size)
            plan = Plan.from_dict({**result.plan.to_dict(), "model": model_config.to_dict()})
            text = report.render_explain(plan, result.estimate.to_dict(),
                                         getattr(result.estimate, "per_layer", ()),
                                         to_megatron_flags(plan), None,
                                         title="--auto-parallel plan")
            logger.info("%s", text)
            outcome = {"plan": plan.to_dict()}
        except (InfeasibleError, ValueError) as err:
            outcome = {"error": f"--auto-parallel: {err}"}
    outcome = _broadcast(outcome)
    if "error" in outcome:
        raise AutoParallelError(outcome["error"])
    plan = Plan.from_dict(outcome["plan"])
    try:
        plan.validate(model_config)
    except PlanError as err:  # a planner bug, not user input: say so plainly
        raise AutoParallelError(f"--auto-parallel produced an invalid plan ({err}); please "
                                f"report it with the command line") from None
    return plan
