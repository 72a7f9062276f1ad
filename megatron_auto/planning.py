"""The planner's inputs for one model on one cluster, built the same way for every caller.

``megatron-auto plan/evaluate/explain`` and ``--auto-parallel`` (``auto.py``) both call
:func:`planning_inputs`, so a plan searched by the CLI and a plan searched at the start of a
training run see the same model spec, precision, profile and memory budget. What differs is only
where the cluster and the model profile come from, which the caller decides and passes in: a
preset, a file or a measurement (``auto.py`` measures on the spot; the CLI reads
``--model-profile``); without a profile the analytic one is derived from the shapes and the
cluster's peak FLOP/s.

Pure (the planner's data types, no torch), so the planning CLI starts without torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .config import ArgumentError, ModelConfig
from .families.registry import family_of
from .planner.inputs.hardware import ClusterSpec
from .planner.inputs.model_spec import ModelSpec, TrainingSpec
from .planner.inputs.profiles import ModelProfile, analytic_profile, with_analytic_layer_types
from .planner.search.driver import SearchOptions


@dataclass(frozen=True)
class PlanningInputs:
    """Everything ``planner.search.search`` / ``evaluate`` take besides the options."""

    config: ModelConfig
    spec: ModelSpec
    training: TrainingSpec
    cluster: ClusterSpec
    profile: ModelProfile
    budget_bytes: int


def runtime_options(options: SearchOptions, config: Any) -> SearchOptions:
    """``options`` limited to the plans the runtime trains for ``config``: a family whose stages
    run no Megatron sequence parallelism or no interleaved schedule (T5 and the image
    classifiers: they refuse such plans) has neither searched. Raises ``ArgumentError`` when
    the caller pinned one of them (``--sequence-parallel``, a virtual size > 1).

    Ring attention runs without attention dropout (``plan_cp.cp_model_problem``), so with
    ``--attention-dropout`` > 0 the search offers CP layers Ulysses only, and keeps cp 1 when
    ``--cp-comm-type p2p`` left it no CP mode; a pinned cp > 1 with ``p2p`` raises."""
    family = family_of(config)
    changes: dict[str, Any] = {}
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout > 0 and "ring" in options.cp_modes and options.cp != 1:
        modes = tuple(m for m in options.cp_modes if m != "ring")
        if modes:
            changes["cp_modes"] = modes
        elif options.cp is not None:
            raise ArgumentError(f"--cp-comm-type=p2p: ring attention runs without attention "
                                f"dropout but --attention-dropout={dropout}; set "
                                f"--attention-dropout 0 or use --cp-comm-type a2a (Ulysses)")
        else:  # ring was the only mode asked for: no CP layer can run
            changes["cp"] = 1
    if not family.sequence_parallel:
        if options.sequence_parallel:
            raise ArgumentError(f"--sequence-parallel: the {config.model_type} model does not "
                                f"run sequence parallelism yet; drop the flag")
        changes["sequence_parallel"] = False
    if not family.interleaved:
        if min(options.virtual_sizes) > 1:
            raise ArgumentError(f"--num-layers-per-virtual-pipeline-stage: the "
                                f"{config.model_type} model runs only non-interleaved "
                                f"schedules; drop the flag")
        changes["virtual_sizes"] = (1,)
    if not getattr(config, "runs_module_recompute", True) and options.activation_offload:
        changes["activation_offload"] = False  # its layers refuse layers[i].offload
    return dataclasses.replace(options, **changes) if changes else options


def planning_inputs(config: ModelConfig, cluster: ClusterSpec, *, precision: str,
                    global_batch_size: int, memory_budget_gb: float | None = None,
                    profile: ModelProfile | None = None,
                    complete_profile: bool = False) -> PlanningInputs:
    """Spec, training spec, profile and per-device budget of ``config`` on ``cluster``.

    ``profile`` (measured or imported) must describe this model at this ``precision`` (checked,
    ``ProfileError`` naming the mismatch); ``None`` takes the analytic profile.
    ``complete_profile``: layer types the profile lacks are derived from the analytic profile
    on the measured clock (``profiles.with_analytic_layer_types``; ``--auto-parallel``'s
    measured profile of an MoE model) instead of refused.
    ``memory_budget_gb`` ``None`` is the device's memory. Raises ``ArgumentError`` for a
    non-positive batch and ``ClusterError`` for a budget that leaves nothing for the model,
    both naming the flag.
    """
    if global_batch_size < 1:
        raise ArgumentError(f"--global-batch-size={global_batch_size}: must be a positive integer")
    spec = family_of(config).model_spec(config)
    training = TrainingSpec(global_batch_size=global_batch_size, precision=precision)
    budget = cluster.budget_bytes(memory_budget_gb)
    if profile is None:
        profile = analytic_profile(spec, training, cluster)
    else:
        if complete_profile:
            profile = with_analytic_layer_types(profile, spec, training, cluster)
        profile.check_matches(spec, precision)
    return PlanningInputs(config=config, spec=spec, training=training, cluster=cluster,
                          profile=profile, budget_bytes=budget)
