"""The ``megatron-auto`` console script: plan, evaluate, explain, import-galvatron.

Every subcommand takes the pretrain scripts' model flags (Megatron-LM names, from
``megatron_auto.arguments.add_model_args``) plus ``--cluster NAME|FILE`` and ``--memory-budget-gb``. Bad input prints
one line naming the flag or field, the value and the fix, and exits with status 2 (no traceback).

``main(argv)`` returns the exit status, so tests call it in-process; the console script
(``megatron_auto.console``, also ``python -m megatron_auto``) calls it and adds the start-up and
exit settings of a short-lived process.

The planning commands (``plan``, ``evaluate``, ``explain``, ``import-galvatron``) never import
torch: this module, the flag converters (``arguments.py``), the plan makers
(``plan_source.py``), the planning inputs (``planning.py``) and the planner are pure, and the
profiler subcommands import their torch-heavy parts only in their handlers. The planner inputs
are built by ``planning.planning_inputs``, the same function ``--auto-parallel`` uses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any, Sequence

from .arguments import DEFAULT_GLOBAL_BATCH_SIZE, add_model_args
from .cli_checks import (check_outputs, command_given_flags, module_recompute_choices,
                         search_space_conflict, warn_other_family_flags, with_flag_names,
                         with_host_budget)
from .config import ModelConfig, resolve_precision
from .families.hf_config import apply_hf_config
from .families.registry import config_from_record, families, family_of, get_family
from .plan import Plan
from .plan_flags import (add_cp_min_seq_length_arg, add_layout_and_fsdp_args,
                         add_sp_and_virtual_pipeline_args, classic_layout_from_args)
from .planner import report
from .planner.inputs.hardware import GB, ClusterSpec
from .planner.interop.megatron_flags import to_megatron_flags
from .planner.inputs.model_spec import TrainingSpec
from .planner.inputs.presets import PRESET_NAMES, get_cluster
from .planner.inputs.profiles import ModelProfile
from .planner.inputs.pins import search_options
from .planner.search.driver import evaluate, search
from .planner.search.infeasible import InfeasibleError
from .planning import PlanningInputs, planning_inputs, runtime_options
from .run_flag_checks import warn_sequence_parallel_at_tp1
from .utils.flag_warnings import one_line_flag_warnings, warn_flag

# Imported where used (start-up time, docs/planner.md §7): the Galvatron readers, the classic
# flags' plan maker, plotting, and the profiler's and reproduce's subcommands, none of which
# ``plan`` needs.

DEFAULT_CLUSTER = "a100-40g-1x8"
DEFAULT_GLOBAL_BATCH = DEFAULT_GLOBAL_BATCH_SIZE  # the pretrain scripts' default


class CliError(ValueError):
    """A bad flag value; printed as one line, exit status 2."""


# ------------------------------------------------------------------------------ model flags
def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The pretrain scripts' model shape flags (Megatron-LM names), ``--model-type`` (one of
    the registered model families) and every family's own flags."""
    add_model_args(parser)
    registered = families()
    parser.add_argument("--model-type", default="gpt", choices=[f.name for f in registered],
                        help=", ".join(f.help or f.name for f in registered))
    added: list[Any] = []
    for family in registered:  # families sharing flags (vit, swin) share the adder: add once
        if family.add_flags is not None and family.add_flags not in added:
            added.append(family.add_flags)
            family.add_flags(parser)


def _model_flag_defaults() -> dict[str, Any]:
    """Every model flag's destination and default (a parser of the model flags alone, with
    every family registered now). Built per call, not cached in the module (about 2 ms; only
    some families' conversions and plan-file inputs need it, once or twice a command)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_model_flags(parser)
    return vars(parser.parse_args([]))


def model_config_from_flags(args: argparse.Namespace) -> Any:
    """The config of ``--model-type``'s family from the model flags, through the family's
    conversion (the pretrain scripts' converters, with their defaults where the flag was left
    at the shared default)."""
    return get_family(args.model_type).from_flags(args, _model_flag_defaults())


def _add_common(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
    g = parser.add_argument_group("batch, precision and hardware")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help=f"samples per iteration (default {DEFAULT_GLOBAL_BATCH}; a plan file's own "
                        f"batch wins)")
    g.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    g.add_argument("--fp16", action="store_true", help="fp16 mixed precision")
    g.add_argument("--cluster", default=None, metavar="NAME|FILE",
                   help=f"preset ({', '.join(PRESET_NAMES)}; or <gpu>-<mem>-<N>x<D>) or a cluster "
                        f"JSON file (default: the one a --plan file was searched for, else "
                        f"{DEFAULT_CLUSTER})")
    g.add_argument("--memory-budget-gb", type=float, default=None, metavar="X",
                   help="per-device memory budget in GB = 1e9 bytes, the unit of the presets' "
                        "device memory (default: the device's memory)")
    g.add_argument("--host-memory-budget-gb", type=float, default=None, metavar="X",
                   help="host memory one device's rank may use for offload, in GB = 1e9 bytes: "
                        "plans that offload need one that holds it; given to plan, the search "
                        "also tries optimizer and activation offload within it")
    g.add_argument("--model-profile", default=None, metavar="FILE",
                   help="measured or imported model profile (default: analytic from the shapes)")


def _add_plan_source(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("which plan (one of; default: classic flags)")
    g.add_argument("--plan", default=None, metavar="FILE", help="a megatron_auto plan JSON")
    g.add_argument("--galvatron-config", default=None, metavar="FILE",
                   help="a Galvatron galvatron_config_*.json")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--micro-batch-size", type=int, default=None, help="default: 1")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="+", default=None, metavar="MODULE",
                   help="with --recompute-granularity selective: the modules every layer "
                        "recomputes (core_attn, mlp, layernorm; default core_attn)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    add_sp_and_virtual_pipeline_args(g)
    add_layout_and_fsdp_args(g)


# ------------------------------------------------------------------------------ shared setup
def _precision(args: argparse.Namespace, recorded: str | None = None) -> str:
    """--bf16 / --fp16, else the precision a plan file recorded, else fp32 (Megatron's default)."""
    return resolve_precision(args.bf16, args.fp16, recorded or "fp32")  # type: ignore[return-value]


def _recorded(args: argparse.Namespace) -> dict[str, Any]:
    """What ``plan`` recorded in a plan file's ``search`` (precision, cluster), if anything."""
    if not getattr(args, "plan", None) or getattr(args, "galvatron_config", None):
        return {}
    try:
        search = Plan.load(args.plan).search or {}
    except ValueError:
        return {}  # the real load reports the problem
    return {k: search[k] for k in ("precision", "cluster") if isinstance(search.get(k), str)}


def _cluster(args: argparse.Namespace) -> ClusterSpec:
    """--cluster, else the cluster a plan file was searched for, else the default preset."""
    recorded = _recorded(args).get("cluster")
    if args.cluster is None and recorded:
        try:
            return get_cluster(recorded)
        except ValueError:  # e.g. a cluster file that moved: never a silent substitute
            raise CliError(f"--plan={args.plan}: search.cluster={recorded!r} is neither a preset "
                           f"nor a cluster file here; give --cluster NAME|FILE for the cluster "
                           f"the plan is for (presets: {', '.join(PRESET_NAMES)})") from None
    return get_cluster(args.cluster or DEFAULT_CLUSTER)


def _setup(args: argparse.Namespace, global_batch_size: int | None = None,
           config: ModelConfig | None = None) -> PlanningInputs:
    """The planner's inputs from the flags (and a plan file's record of its search)."""
    config = config or model_config_from_flags(args)
    cluster = _cluster(args)
    profile = ModelProfile.load(args.model_profile) if args.model_profile else None
    inputs = planning_inputs(
        config, cluster, precision=_precision(args, _recorded(args).get("precision")),
        global_batch_size=global_batch_size or args.global_batch_size or DEFAULT_GLOBAL_BATCH,
        memory_budget_gb=args.memory_budget_gb, profile=profile)
    if inputs.budget_bytes > cluster.device_memory_bytes:
        warn_flag(f"--memory-budget-gb={args.memory_budget_gb} exceeds the "
                  f"{cluster.device_memory_bytes / GB:.1f} GB of a {cluster.device_name}")
    return inputs


def _model_flags_given(args: argparse.Namespace) -> bool:
    return any(getattr(args, dest) != default for dest, default in _model_flag_defaults().items())


def _plan_and_model(args: argparse.Namespace, world_size: int) -> tuple[Plan, ModelConfig]:
    """The plan to price and the model it is for.

    A plan file that records its model (``plan.model``, written by ``plan``) needs no model
    flags; model flags given next to it must describe the same model (checked by the plan).
    """
    if args.plan and not args.galvatron_config and not _model_flags_given(args):
        plan = Plan.load(args.plan)
        if plan.model and set(plan.model) >= {"num_layers", "hidden_size", "num_attention_heads"}:
            try:
                config = config_from_record(plan.model)
            except (TypeError, ValueError) as err:
                raise CliError(f"--plan {args.plan}: its model record does not describe a model "
                               f"({err}); give the model flags") from None
            return _given_plan(args, world_size, config), config
    config = model_config_from_flags(args)
    return _given_plan(args, world_size, config), config


def _given_plan(args: argparse.Namespace, world_size: int, config: ModelConfig) -> Plan:
    """The plan from --plan, --galvatron-config or the classic flags (exactly one source)."""
    classic = [f for f in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                           "micro_batch_size", "recompute_granularity", "recompute_modules")
               if getattr(args, f) is not None]
    sources = [s for s in ("plan", "galvatron_config") if getattr(args, s)]
    if len(sources) > 1 or (sources and classic):
        given = ["--" + s.replace("_", "-") for s in sources + classic]
        raise CliError(f"{' and '.join(given)} given together: choose one plan source")
    if not sources:  # made and validated by the classic flags' plan maker
        from .plan_source import plan_from_classic_flags  # noqa: PLC0415 - start-up time
        return plan_from_classic_flags(classic_layout_from_args(args), config, world_size)
    if args.plan:
        plan = Plan.load(args.plan)
    else:
        # Galvatron's --sequence_parallel is a run flag, not in its file: --sequence-parallel
        from .planner.interop import galvatron  # noqa: PLC0415 - start-up time
        plan = galvatron.plan_from_galvatron_config(args.galvatron_config, world_size=world_size,
                                                    sequence_parallel=args.sequence_parallel)
    if plan.world_size != world_size:
        raise CliError(f"plan world_size={plan.world_size} but the cluster has {world_size} "
                       f"devices; choose the matching --cluster")
    if args.global_batch_size is not None and args.global_batch_size != plan.global_batch_size:
        raise CliError(f"--global-batch-size={args.global_batch_size} differs from the plan's "
                       f"global_batch_size={plan.global_batch_size}; drop the flag")
    plan.validate(config)
    return plan


def _evaluate(setup: PlanningInputs, plan: Plan, host_budget_gb: float | None = None) -> Any:
    """The estimate of ``plan``; an offload plan's host memory checked against
    ``--host-memory-budget-gb`` (one line when it has none that holds it)."""
    estimate = evaluate(plan, setup.spec, setup.training, setup.cluster, setup.profile,
                        memory_budget_bytes=setup.budget_bytes)
    return with_host_budget(estimate, host_budget_gb)


def _explain_text(setup: PlanningInputs, plan: Plan, estimate: Any, title: str = "Plan") -> str:
    names = [setup.spec.layer_type(i).name for i in range(setup.spec.num_layers)] \
        if len(setup.spec.layer_types) > 1 else None
    return report.render_explain(plan, estimate.to_dict(), getattr(estimate, "per_layer", ()),
                                 to_megatron_flags(plan), names, title=title)


# ------------------------------------------------------------------------------ subcommands
def cmd_plan(args: argparse.Namespace) -> int:
    setup = _setup(args)
    if (args.sequence_parallel and args.tensor_model_parallel_size == 1
            and getattr(setup.config, "runs_sequence_parallel", True)):
        warn_sequence_parallel_at_tp1()
    try:  # the layout flags are pins, as with --auto-parallel (planner.inputs.pins)
        options = search_options(
            args, setup.cluster.world_size, setup.spec.num_layers,
            num_microbatches=args.num_microbatches, schedule=args.schedule,
            allow_recompute=not args.no_recompute, search_batch_size=args.search_batch_size,
            space=args.search_space, time_limit_s=args.time_limit, show_progress=not args.quiet,
            optimality_gap=args.optimality_gap)
    except ValueError as err:
        raise CliError(str(err)) from None
    if args.search_module_recompute:
        options = dataclasses.replace(
            options, module_recompute=module_recompute_choices(args.search_module_recompute))
    options = dataclasses.replace(options, vocab_tp=args.vocab_tensor_parallel_size,
                                  allow_strided_tp=not args.tp_consecutive_only)
    if (conflict := search_space_conflict(args)) is not None:
        raise CliError(conflict)
    try:
        options = runtime_options(options, setup.config)
        options.validate()
        result = search(setup.spec, setup.training, setup.cluster, setup.profile,
                        setup.budget_bytes, options)
    except InfeasibleError:
        raise
    except ValueError as err:  # name our flags, not the SearchOptions fields
        raise CliError(with_flag_names(str(err))) from None
    # Record what the estimate assumed, so evaluate/explain --plan need no repeated flags.
    plan = dataclasses.replace(result.plan, search={
        **(result.plan.search or {}), "precision": setup.training.precision,
        "cluster": args.cluster or setup.cluster.name})
    plan.save(args.plan_out)
    print(_explain_text(setup, plan, result.estimate, title="Searched plan"))
    baselines = {name: (est.to_dict() if est is not None else None)
                 for name, est in (getattr(result, "baselines", None) or {}).items()}
    if baselines:
        print("Against baselines (same cost model):")
        cut = (plan.search or {}).get("baselines_time_limited") or ()
        print(report._indent(report.render_baselines(result.estimate.to_dict(), baselines,
                                                     cut)))
    print(f"\nplan written to {args.plan_out}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    plan, config = _plan_and_model(args, cluster.world_size)
    setup = _setup(args, global_batch_size=plan.global_batch_size, config=config)
    estimate = _evaluate(setup, plan, args.host_memory_budget_gb)
    if args.json:
        print(json.dumps(estimate.to_dict(), indent=2))
    else:
        print("Estimate: " + report.describe_estimate(estimate.to_dict()))
        print(report._indent(report.render_stages(estimate.to_dict())))
    if args.plan_out:
        plan.with_estimate(estimate.to_dict()).save(args.plan_out)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    plan, config = _plan_and_model(args, cluster.world_size)
    setup = _setup(args, global_batch_size=plan.global_batch_size, config=config)
    estimate = _evaluate(setup, plan, args.host_memory_budget_gb)
    print(_explain_text(setup, plan, estimate), end="")
    if args.plot:
        from .utils.plots import plot_plan  # noqa: PLC0415 - start-up time
        written = plot_plan(plan, args.plot, estimate.to_dict(), setup.budget_bytes)
        print(f"\nplot written to {written}")
    return 0


def cmd_plot_metrics(args: argparse.Namespace) -> int:
    from .utils.plots import plot_metrics, read_metrics_file  # noqa: PLC0415 - start-up time
    records = read_metrics_file(args.metrics_file)
    out = args.output or os.path.splitext(args.metrics_file)[0] + ".png"
    print(f"plot written to {plot_metrics(records, out)}")
    return 0


def cmd_import_galvatron(args: argparse.Namespace) -> int:
    from .planner.interop import galvatron  # noqa: PLC0415 - start-up time
    did = []
    if bool(args.computation) != bool(args.memory):
        raise CliError("--computation and --memory go together (both Galvatron model profile "
                       "files are needed); give both")
    if args.computation:
        if not args.model_profile_out:
            raise CliError("--computation/--memory need --model-profile-out FILE to write to")
        config = model_config_from_flags(args)
        spec = family_of(config).model_spec(config)
        training = TrainingSpec(global_batch_size=args.global_batch_size or DEFAULT_GLOBAL_BATCH,
                                precision=_precision(args))
        cluster = get_cluster(args.cluster)
        profile = galvatron.model_profile_from_galvatron(args.computation, args.memory, spec,
                                                         training, cluster)
        profile.save(args.model_profile_out)
        did.append(f"model profile -> {args.model_profile_out} (use --model-profile)")
    if args.allreduce:
        if not args.cluster_out:
            raise CliError("--allreduce needs --cluster-out FILE to write the cluster to")
        cluster = galvatron.cluster_from_galvatron(
            args.allreduce, args.p2p, args.overlap, args.sp_time, gpu=args.gpu,
            num_nodes=args.num_nodes, devices_per_node=args.devices_per_node)
        cluster.save(args.cluster_out)
        did.append(f"cluster ({cluster.world_size} devices) -> {args.cluster_out} (use --cluster)")
    elif args.p2p or args.overlap or args.sp_time:
        raise CliError("--p2p/--overlap/--sp-time refine a cluster: give --allreduce FILE too")
    if args.galvatron_config:
        if not args.plan_out:
            raise CliError("--galvatron-config needs --plan-out FILE to write the plan to")
        world = args.world_size
        plan = galvatron.plan_from_galvatron_config(args.galvatron_config, world_size=world,
                                                    sequence_parallel=args.sequence_parallel)
        plan.save(args.plan_out)
        did.append(f"plan ({plan.world_size} ranks, {plan.num_layers} layers) -> {args.plan_out} "
                   f"(use --plan)")
    if not did:
        raise CliError("nothing to import: give --computation and --memory, --allreduce, or "
                       "--galvatron-config (see --help)")
    print("\n".join(did))
    return 0


# ------------------------------------------------------------------------------ parser
_EPILOGS = {
    "plan": """examples:
  megatron-auto plan --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \\
      --seq-length 512 --global-batch-size 64 --bf16 --cluster a100-40g-1x8 \\
      --memory-budget-gb 16 --plan-out plan.json
  megatron-auto plan ... --search-space megatron3d   # best classic 3D layout only
  megatron-auto plan ... --pipeline-model-parallel-size 2 --time-limit 10""",
    "evaluate": """examples:
  megatron-auto evaluate --plan plan.json --cluster a100-40g-1x8 --json
  megatron-auto evaluate --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \\
      --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 4 \\
      --global-batch-size 64 --bf16 --cluster a100-40g-1x8
  megatron-auto evaluate --galvatron-config galvatron_config_....json --num-layers 24 ...""",
    "explain": """examples:
  megatron-auto explain --plan plan.json --num-layers 24 --hidden-size 1024 \\
      --num-attention-heads 16 --seq-length 512 --bf16 --cluster a100-40g-1x8
  megatron-auto explain --tensor-model-parallel-size 4 --global-batch-size 32 ...""",
    "import-galvatron": """examples:
  megatron-auto import-galvatron --computation computation_profiling_bf16_hidden1024_head16.json \\
      --memory memory_profiling_bf16_hidden1024_head16.json --num-layers 24 --hidden-size 1024 \\
      --num-attention-heads 16 --seq-length 512 --bf16 --model-profile-out bert.profile.json
  megatron-auto import-galvatron --allreduce allreduce_bandwidth_1nodes_8gpus_per_node.json \\
      --p2p p2p_bandwidth_1nodes_8gpus_per_node.json --overlap overlap_coefficient.json \\
      --gpu a100-40g --cluster-out my-a100.cluster.json
  megatron-auto import-galvatron --galvatron-config galvatron_config_..._1nodes_8gpus_per_node_....json \\
      --plan-out plan.json""",
}


# The subcommands this module defines; the others (profiler, reproduce) come from their
# packages, imported only when one of them runs or the full parser is asked for (--help).
OWN_COMMANDS = ("plan", "evaluate", "explain", "import-galvatron", "plot-metrics")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``megatron-auto`` parser. With ``command`` one of ``OWN_COMMANDS``, only that
    subcommand is added (argparse reads only the chosen one's flags, so parsing is the same):
    ``main`` does this to keep the planning commands' start-up short."""
    parser = argparse.ArgumentParser(
        prog="megatron-auto", description="Search, price and explain per-layer parallel plans.",
        allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    fmt = argparse.RawDescriptionHelpFormatter

    def wanted(name: str) -> bool:
        return command not in OWN_COMMANDS or command == name

    if wanted("plan"):
        _add_plan_parser(sub, fmt)
    for name, func, help_text in (("evaluate", cmd_evaluate, "cost-model estimate of a plan"),
                                  ("explain", cmd_explain, "human-readable plan report")):
        if not wanted(name):
            continue
        q = sub.add_parser(name, help=help_text, epilog=_EPILOGS[name], formatter_class=fmt,
                           allow_abbrev=False)
        _add_common(q)
        _add_plan_source(q)
        if name == "explain":
            q.add_argument("--plot", default=None, metavar="FILE",
                           help="also draw the per-layer strategy map and per-stage memory and "
                                "time (.png/.pdf/.svg; needs matplotlib, the 'plots' extra)")
        if name == "evaluate":
            q.add_argument("--json", action="store_true",
                           help="print the estimate as JSON (the plan file's estimate fields)")
            q.add_argument("--plan-out", default=None, metavar="FILE",
                           help="also write the plan with this estimate")
        q.set_defaults(func=func)
    if wanted("import-galvatron"):
        _add_import_galvatron_parser(sub, fmt)
    if wanted("plot-metrics"):
        m = sub.add_parser("plot-metrics", help="plot a --metrics-file: loss, throughput, "
                                                "predicted against measured time and memory",
                           allow_abbrev=False)
        m.add_argument("metrics_file", metavar="METRICS.jsonl")
        m.add_argument("--output", "-o", default=None, metavar="FILE",
                       help="image to write (default: the metrics file with .png)")
        m.set_defaults(func=cmd_plot_metrics)
    if command not in OWN_COMMANDS:
        from .reproduce.cli import add_reproduce_parser  # noqa: PLC0415 - start-up time
        _add_profiler_subcommands(sub)
        add_reproduce_parser(sub)
    return parser


def _add_plan_parser(sub: Any, fmt: Any) -> None:
    p = sub.add_parser("plan", help="search the fastest plan that fits and write it",
                       epilog=_EPILOGS["plan"], formatter_class=fmt, allow_abbrev=False)
    _add_common(p)
    g = p.add_argument_group("search")
    g.add_argument("--plan-out", default="plan.json", metavar="FILE")
    g.add_argument("--search-space", default="full",
                   help="full (default), a baseline space (dp, zero3, tp, pp, megatron3d, "
                        "galvatron-base) or galvatron (Galvatron 2.4's strategy space: ZeRO-2 "
                        "or ZeRO-3 and checkpointing per layer, no interleaving, SP only as "
                        "--sequence-parallel)")
    g.add_argument("--search-batch-size", action="store_true",
                   help="also search the global batch size (default: fixed)")
    g.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="CPU seconds the search may take before it answers with the best plan "
                        "found, not proven optimal (default 10)")
    g.add_argument("--optimality-gap", type=float, default=None, metavar="GAP",
                   help="stop once the answer is within this relative gap of the search's "
                        "lower bound (default 0.01; 0 proves the optimum)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="pin every layer's tp")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None, help="pin pp")
    g.add_argument("--vocab-tensor-parallel-size", type=int, default=None, metavar="TP",
                   help="pin the embedding's and output head's tp (default: searched; "
                        "Galvatron's --disable_vtp 1 is 1)")
    g.add_argument("--tp-consecutive-only", action="store_true",
                   help="TP groups on consecutive ranks only: no strided TP layout is "
                        "searched (Galvatron's --disable_tp_consec 1)")
    g.add_argument("--num-microbatches", type=int, default=None, help="pin the micro-batch count")
    g.add_argument("--schedule", default=None, choices=["1f1b", "gpipe"], help="pin the schedule")
    g.add_argument("--no-recompute", action="store_true", help="never recompute activations")
    g.add_argument("--search-module-recompute", nargs="+", default=None, metavar="VALUE",
                   help="per-layer recompute choices searched beside none and full: selective "
                        "or module lists joined by '+' (e.g. core_attn+mlp)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="pin zero1 (Megatron's distributed optimizer) on every layer")
    add_sp_and_virtual_pipeline_args(g)  # pins: SP on tp > 1 layers; the virtual size
    add_cp_min_seq_length_arg(g)
    g.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=cmd_plan)


def _add_import_galvatron_parser(sub: Any, fmt: Any) -> None:
    r = sub.add_parser("import-galvatron", help="convert Galvatron profiles and plans",
                       epilog=_EPILOGS["import-galvatron"], formatter_class=fmt,
                       allow_abbrev=False)
    add_model_flags(r)
    r.add_argument("--global-batch-size", type=int, default=None, help=argparse.SUPPRESS)
    r.add_argument("--bf16", action="store_true")
    r.add_argument("--fp16", action="store_true")
    r.add_argument("--cluster", default=DEFAULT_CLUSTER, metavar="NAME|FILE",
                   help="device facts for the analytic parts of the model profile")
    g = r.add_argument_group("Galvatron model profile -> --model-profile FILE")
    g.add_argument("--computation", metavar="FILE", help="computation_profiling_*.json")
    g.add_argument("--memory", metavar="FILE", help="memory_profiling_*.json")
    g.add_argument("--model-profile-out", metavar="FILE")
    g = r.add_argument_group("Galvatron hardware profile -> --cluster FILE")
    g.add_argument("--allreduce", metavar="FILE", help="allreduce_bandwidth_*.json")
    g.add_argument("--p2p", metavar="FILE", help="p2p_bandwidth_*.json (optional)")
    g.add_argument("--overlap", metavar="FILE", help="overlap_coefficient.json (optional)")
    g.add_argument("--sp-time", metavar="FILE", help="sp_time_*.json (optional)")
    g.add_argument("--gpu", default="a100-40g",
                   help="device facts Galvatron does not record (default a100-40g)")
    g.add_argument("--num-nodes", type=int, default=None, help="default: from the file name")
    g.add_argument("--devices-per-node", type=int, default=None, help="default: from the file name")
    g.add_argument("--cluster-out", metavar="FILE")
    g = r.add_argument_group("Galvatron plan -> --plan FILE")
    g.add_argument("--galvatron-config", metavar="FILE", help="galvatron_config_*.json")
    g.add_argument("--world-size", type=int, default=None, help="default: from the file name")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="the plan ran with Galvatron's --sequence_parallel (Megatron-SP): every "
                        "layer with TP > 1 gets sequence_parallel (its use_sp=1 is Ulysses, "
                        "refused)")
    g.add_argument("--plan-out", metavar="FILE")
    r.set_defaults(func=cmd_import_galvatron)


def _add_profiler_subcommands(sub: Any) -> None:
    """profile-model, profile-hardware and calibrate live with the profiler (it owns them)."""
    from .profiler.cli import (  # noqa: PLC0415 - start-up time of the planning commands
        add_calibrate_parser, add_profile_hardware_parser, add_profile_model_parser)
    add_profile_model_parser(sub, add_model_flags, model_config_from_flags)
    add_profile_hardware_parser(sub)
    add_calibrate_parser(sub)


def _read_hf_config(parser: argparse.ArgumentParser, command: str,
                    args: argparse.Namespace) -> None:
    """``--hf-config``: the model flags (and ``--model-type``) from the file, unless typed."""
    if not getattr(args, "hf_config", None):
        return
    sub = next(a.choices[command] for a in parser._actions
               if isinstance(a, argparse._SubParsersAction))
    dests = frozenset(a.dest for a in sub._actions if a.dest != argparse.SUPPRESS)
    apply_hf_config(args, args.given_flags or frozenset(), dests,
                    family_dest="model_type" if "model_type" in dests else None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns the exit status (0 ok, 2 bad input)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    # The first word names the subcommand (the top-level parser has no options but --help).
    parser = build_parser(args_list[0] if args_list else None)
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exit_:  # argparse already printed its message
        return int(exit_.code or 0)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    args.given_flags = command_given_flags(parser, args_list)
    try:
        with one_line_flag_warnings():
            _read_hf_config(parser, args_list[0], args)
            warn_other_family_flags(args)
            check_outputs(args)
            return args.func(args)
    except ValueError as err:  # every project error class derives from ValueError
        print(f"megatron-auto {args.command}: error: {err}", file=sys.stderr)
        minimum = getattr(err, "min_memory_bytes", None) or getattr(err, "minimum_bytes", None)
        if minimum:
            print(f"megatron-auto {args.command}: minimum memory that works: "
                  f"--memory-budget-gb {math.ceil(minimum / GB * 100) / 100:.2f}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"megatron-auto {args.command}: error: {err.filename or ''}: {err.strerror}; check "
              f"the path", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
