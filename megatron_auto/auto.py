"""``--auto-parallel``: profile what is missing, search on one rank, broadcast the plan.

This module joins the profilers and the planner for a training run (docs/design.md §2). The training
run (``training/pretrain.py``) calls :func:`plan_for_run` collectively on every rank with the
:class:`~megatron_auto.run_config.SearchPins` its command line was converted into:

1. **Cluster.** ``--cluster NAME|FILE`` when given; otherwise the hardware profile measured on
   this very cluster, cached (keyed by world size, node shape, device, backend and torch
   version) so that only the first run pays for it. Profiling is collective: rank 0 decides
   whether the cache hits and every rank follows the same decision.
2. **Model profile.** Measured by rank 0 on its device with the runtime's own layers (cached by
   the model profiler); the other ranks wait at a barrier.
3. **Search** on rank 0 only (the planner is pure computation) on the same planning inputs as
   ``megatron-auto plan`` (``planning.planning_inputs``), with every flag the user set
   explicitly next to ``--auto-parallel`` pinned (``--tensor-model-parallel-size``,
   ``--pipeline-model-parallel-size``, ``--micro-batch-size`` with both of those,
   ``--use-distributed-optimizer``); the rest is searched.
4. The plan (or the error) is broadcast as JSON, so every rank trains with exactly the same plan
   or stops with the same message. Rank 0 prints the explain table; ``--plan-out`` is written by
   the training loop.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .config import ArgumentError, ModelConfig
from .parallel.device import resolve_device
from .plan import Plan, PlanError
from .planner import report
from .planner.inputs.hardware import ClusterSpec
from .planner.interop.megatron_flags import to_megatron_flags
from .planner.inputs.presets import get_cluster
from .planner.inputs.profiles import ModelProfile
from .planner.inputs.pins import search_options
from .planner.search.driver import InfeasibleError, SearchOptions, search
from .planning import planning_inputs, runtime_options
from .profiler import cache as profile_cache
from .profiler.cache import default_cache_dir
from .profiler.hardware_profiler import PROFILER_REVISION, HardwareProfilerConfig, profile_hardware
from .profiler.lookup import cache_key, get_or_create_model_profile, has_profiler, measure_model
from .run_config import SearchPins
from .utils.flag_warnings import warn_flag

logger = logging.getLogger("megatron_auto")


class AutoParallelError(ValueError):
    """--auto-parallel could not produce a plan; the message says why and what to change."""


# --------------------------------------------------------------------------- search options
def search_options_for(pins: SearchPins, world_size: int,
                       num_layers: int | None = None) -> SearchOptions:
    """Planner options from the flags the user pinned (``planner.inputs.pins.search_options``,
    the mapping ``megatron-auto plan`` uses too); everything else stays searchable. Says so
    when a typed flag is not a pin here; raises ``AutoParallelError`` naming the flag."""
    tp, pp = pins.tensor_model_parallel_size, pins.pipeline_model_parallel_size
    if pins.micro_batch_size is not None and (tp is None or pp is None):
        warn_flag(f"--micro-batch-size={pins.micro_batch_size} is ignored by --auto-parallel "
                  f"unless --tensor-model-parallel-size and --pipeline-model-parallel-size pin "
                  f"the data-parallel size too; the planner chooses the micro-batch count")
    try:
        options = search_options(pins, world_size, num_layers,
                                 micro_batch_size=pins.micro_batch_size,
                                 global_batch_size=pins.batch, show_progress=True,
                                 optimality_gap=getattr(pins, "optimality_gap", None))
    except ValueError as err:
        raise AutoParallelError(str(err)) from None
    if pins.recompute_granularity is not None:
        warn_flag(f"--recompute-granularity={pins.recompute_granularity}: recompute is decided "
                  f"per layer by --auto-parallel; the flag is ignored")
    return options


# --------------------------------------------------------------------------- profiles
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
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    backend = dist.get_backend() if dist.is_initialized() else "none"
    slug = "".join(c if c.isalnum() else "-" for c in name.lower())
    return cache_dir / (f"cluster-{slug}-{world_size // local_world}x{local_world}-{backend}-"
                        f"torch{torch.__version__.split('+')[0]}-r{PROFILER_REVISION}.json")


def resolve_cluster(name: str | None, world_size: int, cache_dir: Path) -> ClusterSpec:
    """``--cluster NAME|FILE`` or a measured (and cached) hardware profile. Collective."""
    if name:
        # Rank 0 reads it and the others receive it: on several nodes without a shared file
        # system only the first node needs the file (profile-hardware writes it there). An
        # error there stops every rank alike.
        loaded: tuple[ClusterSpec | None, Exception | None] = (None, None)
        if _rank() == 0:
            try:
                loaded = (get_cluster(name), None)
            except Exception as err:  # noqa: BLE001 - re-raised below on every rank
                loaded = (None, err)
        cluster, error = _broadcast(loaded)
        if error is not None:
            raise error
        if cluster.world_size < world_size:
            raise AutoParallelError(
                f"--cluster {name}: describes {cluster.world_size} devices but this run "
                f"has {world_size} ranks; choose a cluster with at least {world_size} devices or "
                f"omit --cluster to measure this one")
        return cluster
    device = resolve_device()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    path = cluster_cache_path(cache_dir, world_size, local, device)
    hit = _broadcast(path.exists() if _rank() == 0 else None)
    if hit:
        logger.info("> --auto-parallel: using the cached hardware profile %s", path)
        return _broadcast(ClusterSpec.load(path) if _rank() == 0 else None)
    logger.info("> --auto-parallel: measuring the hardware (once; cached in %s)", path)
    spec = _broadcast(profile_hardware(HardwareProfilerConfig()).to_cluster_spec())
    if _rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        spec.save(path)  # atomic: ranks of a later run may read it
    return spec


def describes_this_machine(cluster: ClusterSpec) -> bool:
    """Whether ``cluster`` is of this machine's device kind, so that measuring the model here
    informs the plan (a preset of other GPUs gets the analytic model profile instead)."""
    device = resolve_device()
    if device.type == "cuda":
        return cluster.device_name == torch.cuda.get_device_name(device)
    return cluster.device_name.lower().startswith("cpu")


def contend_while_profiling(model_config: ModelConfig, precision: str, cache_dir: Path) -> bool:
    """When rank 0 is about to measure the model (no cached profile), every rank measures it
    at the same time, so that compute is timed under the same sharing of the machine as the
    training that follows (CPU ranks share cores; on GPUs each rank has its own device and this
    only costs the few seconds of the measurement). Only rank 0's profile is kept (cached by
    :func:`_measured_profile`); the others' are discarded. Each timing round starts on
    every rank at once (the profilers' ``barrier``). Collective; returns whether the ranks
    measure (rank 0 then measures with that barrier too)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    key = cache_key(model_config, precision, resolve_device())
    cached = _broadcast(profile_cache.load_cached(key, cache_dir) is not None
                        if _rank() == 0 else None)
    if not cached and _rank() != 0:
        measure_model(model_config, precision, resolve_device(), barrier=dist.barrier)
    return not cached


def _measured_profile(model_config: Any, precision: str, cache_dir: Path,
                      together: bool) -> ModelProfile:
    """The model profile measured on this device by the config's family's profiler (cached);
    ``together``: the other ranks measure at once (:func:`contend_while_profiling`). Rank 0."""
    return get_or_create_model_profile(model_config, precision, resolve_device(),
                                       cache_dir=cache_dir,
                                       barrier=dist.barrier if together else None)


# --------------------------------------------------------------------------- entry point
def plan_for_run(pins: SearchPins, model_config: Any, world_size: int, *,
                 precision: str = "fp32") -> Plan:
    """Profile, search and broadcast: the plan every rank of this run trains with (validated
    against ``model_config``). Collective; raises ``AutoParallelError`` on every rank alike."""
    cache_dir = Path(default_cache_dir())
    cluster = resolve_cluster(pins.cluster, world_size, cache_dir)
    try:
        cluster.budget_bytes(pins.memory_budget_gb)  # a bad budget stops every rank at once
    except ValueError as err:
        raise AutoParallelError(str(err)) from None
    try:
        options = runtime_options(search_options_for(pins, world_size, model_config.num_layers),
                                  model_config)
    except ArgumentError as err:
        raise AutoParallelError(str(err)) from None

    # Measured on this device (cached), or analytic when the cluster is other hardware or the
    # model's family has no profiler.
    measure = describes_this_machine(cluster) and has_profiler(model_config)
    together = measure and contend_while_profiling(model_config, precision, cache_dir)
    outcome: dict[str, Any] | None = None
    if _rank() == 0:
        try:
            profile = (_measured_profile(model_config, precision, cache_dir, together) if measure
                       else None)
            inputs = planning_inputs(model_config, cluster, precision=precision,
                                     global_batch_size=pins.batch,
                                     memory_budget_gb=pins.memory_budget_gb, profile=profile,
                                     complete_profile=True)
            result = search(inputs.spec, inputs.training, cluster, inputs.profile,
                            inputs.budget_bytes, options, world_size=world_size)
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
