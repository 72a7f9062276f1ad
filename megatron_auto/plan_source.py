"""The one place a plan is made from a plan file or from the classic Megatron flags.

Three sources (docs/design.md §2; their dataclasses are in ``run_config.py``), chosen once from the
flags by ``arguments.parse_run_config``:

- :class:`PlanFile` (``--plan FILE``): the file rules; its ``global_batch_size`` and
  ``num_microbatches`` set the batch (``--global-batch-size``, when given, must equal it;
  ``--micro-batch-size`` is ignored with a warning);
- :class:`ClassicLayout` (Megatron's ``--tensor-model-parallel-size``,
  ``--pipeline-model-parallel-size``, ``--recompute-*``, ``--use-distributed-optimizer``): a
  uniform plan through the same runtime path (with ``--sequence-parallel`` and
  ``--num-layers-per-virtual-pipeline-stage`` too); ``--use-distributed-optimizer`` maps to
  ``dp_mode="zero1"`` on every layer (Megatron's distributed optimizer: optimizer state sharded
  over data parallelism);
- :class:`SearchPins` (``--auto-parallel``): the planner, with every layout flag the user typed
  pinned (``None`` = not typed, searched). ``auto.plan_for_run`` makes that plan: it needs
  torch (profiling) and the world, so it lives above this module.

:func:`make_plan` makes (and validates) the plan of a file or of the classic flags; it is pure,
like everything this module imports. Every error names the flag or plan field, the value and
the fix.
"""

from __future__ import annotations

import dataclasses

from .config import ArgumentError, ModelConfig
from .plan import Plan, PlanError
from .planner.interop.megatron_flags import MegatronFlagError, plan_from_megatron_flags
from .run_config import DEFAULT_GLOBAL_BATCH_SIZE, ClassicLayout, PlanFile
from .run_flag_checks import warn_sequence_parallel_at_tp1
from .utils.flag_warnings import warn_flag

def make_plan(source: PlanFile | ClassicLayout, model_config: ModelConfig,
              world_size: int) -> Plan:
    """The validated plan of a plan file or of the classic flags, for ``world_size`` ranks."""
    if isinstance(source, PlanFile):
        return plan_from_file(source, model_config, world_size)
    if isinstance(source, ClassicLayout):
        return plan_from_classic_flags(source, model_config, world_size)
    raise TypeError(f"make_plan: {type(source).__name__} is made by auto.plan_for_run")


def plan_from_file(source: PlanFile, model_config: ModelConfig, world_size: int) -> Plan:
    plan = Plan.load(source.path)
    if plan.world_size != world_size:
        raise PlanError(f"--plan {source.path}: plan field world_size={plan.world_size} but this "
                        f"run has {world_size} ranks; launch with --nproc-per-node x nodes = "
                        f"{plan.world_size} or make a plan for {world_size} ranks")
    plan.validate(model_config)
    gbs = source.global_batch_size
    if gbs is not None and gbs != plan.global_batch_size:
        raise ArgumentError(
            f"--global-batch-size={gbs}: differs from the plan's global_batch_size="
            f"{plan.global_batch_size} in {source.path}; drop --global-batch-size or make a plan "
            f"for this batch size")
    if source.micro_batch_size is not None:
        warn_flag(f"--micro-batch-size={source.micro_batch_size} is ignored with --plan: each "
                  f"layer's micro-batch follows from the plan (global_batch_size "
                  f"{plan.global_batch_size} / num_microbatches {plan.num_microbatches} / dp)",
                  stacklevel=2)
    return plan


def plan_from_classic_flags(layout: ClassicLayout, model_config: ModelConfig,
                            world_size: int) -> Plan:
    """The uniform plan of Megatron's layout flags; shared by the pretrain scripts and
    ``megatron-auto evaluate``/``explain``."""
    tp = layout.tensor_model_parallel_size or 1
    if layout.sequence_parallel and not getattr(model_config, "runs_sequence_parallel", True):
        raise ArgumentError(f"--sequence-parallel: the {model_config.model_type} model does not "
                            f"run sequence parallelism yet; drop the flag")
    if layout.sequence_parallel and tp == 1:
        warn_sequence_parallel_at_tp1()
    model_config.check_tensor_parallel(tp)
    model_config.check_vocab_parallel(tp, what="--tensor-model-parallel-size")
    pp = layout.pipeline_model_parallel_size or 1
    if pp > model_config.num_layers:
        raise ArgumentError(f"--pipeline-model-parallel-size={pp}: exceeds --num-layers="
                            f"{model_config.num_layers}; every stage needs a layer")
    global_batch = layout.global_batch_size if layout.global_batch_size is not None \
        else DEFAULT_GLOBAL_BATCH_SIZE
    micro_batch = layout.micro_batch_size
    if micro_batch is None:
        # Default: the largest of 4, 2, 1 that splits each replica's share of the batch.
        cp = layout.context_parallel_size or 1
        per_replica = global_batch // max(1, world_size // (tp * pp * cp))
        micro_batch = next(d for d in (4, 2, 1) if per_replica % d == 0 or d == 1)
    try:
        plan = plan_from_megatron_flags(
            world_size=world_size, num_layers=model_config.num_layers,
            global_batch_size=global_batch, micro_batch_size=micro_batch,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            use_distributed_optimizer=layout.use_distributed_optimizer,
            recompute_granularity=layout.recompute_granularity,
            recompute_method=layout.recompute_method,
            recompute_num_layers=layout.recompute_num_layers,
            recompute_modules=layout.recompute_modules,
            decoder_first_pipeline_num_layers=layout.decoder_first_pipeline_num_layers,
            decoder_last_pipeline_num_layers=layout.decoder_last_pipeline_num_layers,
            sequence_parallel=layout.sequence_parallel,
            num_layers_per_virtual_pipeline_stage=layout.num_layers_per_virtual_pipeline_stage,
            pipeline_model_parallel_layout=layout.pipeline_model_parallel_layout,
            use_megatron_fsdp=layout.use_megatron_fsdp,
            data_parallel_sharding_strategy=layout.data_parallel_sharding_strategy,
            context_parallel_size=layout.context_parallel_size,
            cp_comm_type=layout.cp_comm_type,
            expert_model_parallel_size=layout.expert_model_parallel_size,
            expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
            moe_layers=sorted(getattr(model_config, "moe_layers", None) or ()))
    except MegatronFlagError as err:
        raise ArgumentError(str(err)) from None
    if layout.optimizer_offload_fraction:
        try:
            plan = dataclasses.replace(plan, pipeline=dataclasses.replace(
                plan.pipeline, optimizer_offload_fraction=layout.optimizer_offload_fraction))
        except PlanError as err:
            raise ArgumentError(f"--optimizer-cpu-offload: {err}") from None
    plan.validate(model_config)
    return plan
