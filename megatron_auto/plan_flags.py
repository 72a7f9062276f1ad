"""The flags that say where a run's parallel plan comes from, and their conversion into
``run_config``'s plan sources.

``--plan FILE``, ``--auto-parallel`` (the layout flags the user typed become
:class:`SearchPins`) or the classic layout flags (Megatron-LM names: tensor, pipeline,
virtual-pipeline, sequence- and context-parallel sizes, recompute, distributed optimizer,
Megatron-FSDP; a :class:`ClassicLayout`). ``arguments.py`` adds this group to the pretrain
scripts' parser; the ``megatron-auto`` CLI reuses its helpers on its own parsers.

The layout flags default to ``None`` so that a typed value, even one equal to Megatron's
default, is told apart from an absent one without re-parsing. Pure: no torch.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, NoReturn

from .config import ArgumentError

if TYPE_CHECKING:
    # annotations only: run_config's dataclasses, imported where built (below)
    from .run_config import ClassicLayout, PlanFile, SearchPins

# Megatron's values of the layout flags: typed next to --plan, these are no conflict.
LAYOUT_DEFAULTS = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                   "use_distributed_optimizer": False, "recompute_granularity": None,
                   "recompute_method": None, "recompute_num_layers": None,
                   "recompute_modules": None,
                   "decoder_first_pipeline_num_layers": None,
                   "decoder_last_pipeline_num_layers": None, "sequence_parallel": False,
                   "num_layers_per_virtual_pipeline_stage": None,
                   "pipeline_model_parallel_layout": None, "use_megatron_fsdp": False,
                   "data_parallel_sharding_strategy": None, "context_parallel_size": 1,
                   "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1}


def fail(flag: str, value: object, fix: str) -> NoReturn:
    """Raise ``ArgumentError`` ``<flag>=<value>: <fix>`` (the entry points print it)."""
    raise ArgumentError(f"{flag}={value}: {fix}")


def add_parallelism_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``parallelism`` group: the layout flags, ``--plan``, ``--auto-parallel`` and the
    search's budget and cluster."""
    p = parser.add_argument_group("parallelism")
    # Default None (= 1): a typed value pins the choice for --auto-parallel.
    p.add_argument("--tensor-model-parallel-size", type=int, default=None, help="default: 1")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=None, help="default: 1")
    p.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    p.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    p.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    p.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    p.add_argument("--recompute-num-layers", type=int, default=None)
    p.add_argument("--recompute-modules", nargs="+", default=None, metavar="MODULE",
                   help="with --recompute-granularity selective: the modules every layer "
                        "recomputes (core_attn, mlp, layernorm; default core_attn)")
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's distributed optimizer: shard the optimizer state over "
                        "data parallelism (every layer gets dp_mode zero1)")
    p.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="keep a share of the optimizer (fp32 masters, Adam moments) in host "
                        "memory and step it there (plan pipeline.optimizer_offload_fraction)")
    p.add_argument("--optimizer-offload-fraction", type=float, default=None, metavar="F",
                   help="with --optimizer-cpu-offload: the share in [0, 1] (default 1.0)")
    add_sp_and_virtual_pipeline_args(p)
    add_layout_and_fsdp_args(p)
    p.add_argument("--auto-parallel", action="store_true",
                   help="search the per-layer parallel plan (profile, then plan, then train)")
    p.add_argument("--plan", default=None, metavar="FILE", help="train with this plan file")
    p.add_argument("--plan-out", default=None, metavar="FILE",
                   help="write the plan in use (searched, given or from classic flags)")
    p.add_argument("--memory-budget-gb", type=float, default=None,
                   help="per-device memory budget for --auto-parallel (default: device memory)")
    p.add_argument("--cluster", default=None, metavar="NAME|FILE",
                   help="hardware profile for --auto-parallel (preset name or JSON file)")
    p.add_argument("--host-memory-budget-gb", type=float, default=None, metavar="X",
                   help="host memory per device (GB = 1e9 bytes) --auto-parallel may fill with "
                        "offloaded optimizer state and activations (default: no offload)")
    p.add_argument("--optimality-gap", type=float, default=None, metavar="GAP",
                   help="--auto-parallel stops searching once its plan is within this relative "
                        "gap of the search's lower bound (default 0.01; 0 proves the optimum)")
    add_cp_min_seq_length_arg(p)
    return parser


def add_cp_min_seq_length_arg(group: Any) -> None:
    """The planner's ``--cp-min-seq-length`` (``plan`` and ``--auto-parallel``)."""
    group.add_argument("--cp-min-seq-length", type=int, default=None, metavar="TOKENS",
                       help="the search tries context parallelism from this sequence length "
                            "on (default 8192; lower it to plan cp for shorter sequences)")


def check_plan_flags(args: argparse.Namespace) -> None:
    """Refuse a layout flag typed with a value other than Megatron's next to ``--plan``."""
    if args.plan and getattr(args, "optimizer_cpu_offload", False):
        fail("--optimizer-cpu-offload", True, f"conflicts with --plan {args.plan}, whose "
             f"pipeline.optimizer_offload_fraction says it; drop the flag or edit the plan")
    if args.plan:
        for flag, default in LAYOUT_DEFAULTS.items():
            value = getattr(args, flag, None)
            if value is not None and value != default:
                fail("--" + flag.replace("_", "-"), value,
                     f"conflicts with --plan {args.plan}, which sets the layout (tp, pp, dp "
                     f"mode, recompute per layer); drop the flag or edit the plan")


def add_sp_and_virtual_pipeline_args(group: Any) -> None:
    """Megatron's ``--sequence-parallel`` and ``--num-layers-per-virtual-pipeline-stage`` (the
    pretrain scripts' and ``megatron-auto``'s classic layout)."""
    group.add_argument("--sequence-parallel", action="store_true",
                       help="Megatron-SP on every layer: norms, dropout and residuals split "
                            "along the sequence over the TP group (at TP 1: a warning, no effect)")
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       metavar="N", help="interleaved 1F1B: model chunks of N layers, "
                                         "pp x v of them (needs pp > 1)")
    group.add_argument("--context-parallel-size", type=int, default=None, metavar="CP",
                       help="context parallelism: every sample's sequence split over CP ranks "
                            "(2 chunks each; --seq-length divisible by 2 x CP; default 1, and "
                            "with --auto-parallel the search chooses it for long sequences)")
    group.add_argument("--cp-comm-type", default=None, choices=["p2p", "a2a"],
                       help="p2p: ring attention (keys/values around the CP group); a2a: "
                            "Ulysses all-to-all (heads divisible by CP x TP); default p2p, "
                            "searched with --auto-parallel")
    group.add_argument("--expert-model-parallel-size", type=int, default=None, metavar="EP",
                       help="MoE layers: the experts split over EP of each layer's "
                            "data-parallel ranks (default 1; with --auto-parallel searched "
                            "per MoE layer, a typed value pins it)")
    group.add_argument("--expert-tensor-parallel-size", type=int, default=None, metavar="ETP",
                       help="MoE layers: each expert split over ETP of the layer's TP ranks "
                            "(default 1: the experts replicated over TP; Megatron's default is "
                            "--tensor-model-parallel-size, so its export writes the value)")


def add_layout_and_fsdp_args(group: Any) -> None:
    """Megatron-Core's ``--pipeline-model-parallel-layout`` and Megatron-FSDP's
    ``--use-megatron-fsdp --data-parallel-sharding-strategy`` (classic layouts)."""
    group.add_argument("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
                       help="the pipeline partition as Megatron-Core writes it: chunks in model "
                            "order split by |, E embedding, t layer, L loss, x*n repeats "
                            "(e.g. 'Et*3|t*5L'; pp x v chunks: interleaved when v > 1)")
    group.add_argument("--use-megatron-fsdp", action="store_true",
                       help="Megatron-FSDP: with --data-parallel-sharding-strategy optim, "
                            "optim_grads or optim_grads_params every layer is zero1, zero2 or "
                            "zero3")
    group.add_argument("--data-parallel-sharding-strategy", default=None,
                       choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])


def plan_source_from_args(args: argparse.Namespace) -> PlanFile | ClassicLayout | SearchPins:
    """``--plan``, ``--auto-parallel`` (with the pins typed in this parse) or the classic flags."""
    from .run_config import PlanFile, SearchPins  # noqa: PLC0415 - run_config's dataclasses
    if args.plan:
        return PlanFile(args.plan, global_batch_size=args.global_batch_size,
                        micro_batch_size=args.micro_batch_size)
    if args.auto_parallel and getattr(args, "optimizer_cpu_offload", False):
        fail("--optimizer-cpu-offload", True, "--auto-parallel chooses optimizer offload itself "
             "when --host-memory-budget-gb gives it host memory; drop the flag, or write the "
             "plan's pipeline.optimizer_offload_fraction and train it with --plan")
    host_gb = getattr(args, "host_memory_budget_gb", None)
    if host_gb is not None and not args.auto_parallel:
        fail("--host-memory-budget-gb", host_gb, "only --auto-parallel reads it (the search's "
             "host budget); drop it, or add --auto-parallel")
    if args.auto_parallel:
        return SearchPins(sequence_parallel=getattr(args, "sequence_parallel", False),
                          num_layers_per_virtual_pipeline_stage=getattr(
                              args, "num_layers_per_virtual_pipeline_stage", None),
                          tensor_model_parallel_size=args.tensor_model_parallel_size,
                          pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                          global_batch_size=args.global_batch_size,
                          micro_batch_size=args.micro_batch_size,
                          use_distributed_optimizer=args.use_distributed_optimizer,
                          recompute_granularity=args.recompute_granularity,
                          cluster=args.cluster, memory_budget_gb=args.memory_budget_gb,
                          optimality_gap=getattr(args, "optimality_gap", None),
                          cp_min_seq_length=getattr(args, "cp_min_seq_length", None),
                          context_parallel_size=getattr(args, "context_parallel_size", None),
                          cp_comm_type=getattr(args, "cp_comm_type", None),
                          expert_model_parallel_size=getattr(
                              args, "expert_model_parallel_size", None),
                          expert_tensor_parallel_size=getattr(
                              args, "expert_tensor_parallel_size", None),
                          host_memory_budget_gb=host_gb)
    return classic_layout_from_args(args)


def classic_layout_from_args(args: argparse.Namespace) -> ClassicLayout:
    """Megatron's layout and batch flags (the pretrain scripts' and ``megatron-auto``'s)."""
    from .run_config import ClassicLayout  # noqa: PLC0415 - run_config's dataclasses
    return ClassicLayout(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
        use_distributed_optimizer=args.use_distributed_optimizer,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        recompute_modules=(tuple(args.recompute_modules)
                           if getattr(args, "recompute_modules", None) else None),
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        sequence_parallel=getattr(args, "sequence_parallel", False),
        num_layers_per_virtual_pipeline_stage=getattr(
            args, "num_layers_per_virtual_pipeline_stage", None),
        pipeline_model_parallel_layout=getattr(args, "pipeline_model_parallel_layout", None),
        use_megatron_fsdp=getattr(args, "use_megatron_fsdp", False),
        data_parallel_sharding_strategy=getattr(args, "data_parallel_sharding_strategy", None),
        context_parallel_size=getattr(args, "context_parallel_size", None) or 1,
        cp_comm_type=getattr(args, "cp_comm_type", None) or "p2p",
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", None) or 1,
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None) or 1,
        optimizer_offload_fraction=optimizer_offload_from_args(args))


def optimizer_offload_from_args(args: argparse.Namespace) -> float:
    """Megatron's ``--optimizer-cpu-offload [--optimizer-offload-fraction F]`` as the plan's
    share (0 without the flag; 1.0 when the fraction is not given)."""
    fraction = getattr(args, "optimizer_offload_fraction", None)
    if not getattr(args, "optimizer_cpu_offload", False):
        if fraction is not None:
            fail("--optimizer-offload-fraction", fraction,
                 "needs --optimizer-cpu-offload; add it, or drop the fraction")
        return 0.0
    if fraction is None:
        return 1.0
    if not 0.0 <= fraction <= 1.0:
        fail("--optimizer-offload-fraction", fraction, "must be in [0, 1] (1: the whole optimizer)")
    return float(fraction)
