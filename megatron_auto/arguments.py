"""Command-line flags (Megatron-LM names) and their conversion into typed configuration.

This is the only module that knows argparse for training flags (STYLE principle 7): entry
scripts call :func:`parse_args`, then the ``*_config_from_args`` converters, and everything
below works on dataclasses. The ``megatron-auto`` CLI reuses :func:`add_model_args` and
:func:`model_config_from_args`.

Defaults describe the embedded run (``torchrun --standalone --nproc-per-node 2 pretrain_gpt.py``
with no other flag): a 4-layer, 256-wide GPT on the corpus shipped with the package.

Where the parallel plan comes from (:func:`resolve_plan`):

- ``--plan FILE``: the file rules; its ``global_batch_size`` and ``num_microbatches`` set the
  batch (``--global-batch-size``, when given, must equal it; ``--micro-batch-size`` is ignored
  with a warning).
- classic flags (``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
  ``--recompute-*``, ``--use-distributed-optimizer``): a uniform plan through the same runtime
  path. ``--use-distributed-optimizer`` maps to ``dp_mode="zero1"`` on every layer (Megatron's
  distributed optimizer: optimizer state sharded over data parallelism).
- ``--auto-parallel``: the planner (wired by ``megatron_auto/auto.py`` when present).
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Sequence

from .config import ConfigError, ModelConfig
from .parallel.optimizer import OptimizerConfig
from .plan import Plan, PlanError
from .planner.megatron_flags import MegatronFlagError, plan_from_megatron_flags
from .training.data import DataConfig
from .training.logging import LoggingConfig
from .training.lr_scheduler import LRConfig
from .training.precision import PrecisionConfig

# Model vocabulary when neither a tokenizer nor --vocab-size says otherwise (mock data).
DEFAULT_MOCK_VOCAB_SIZE = 8192


# The global batch when --global-batch-size is not given (training, --auto-parallel, the CLI).
DEFAULT_GLOBAL_BATCH_SIZE = 8


class ArgumentError(ConfigError):
    """An invalid flag combination; the message names the flag, its value and the fix."""


# ----------------------------------------------------------------------------- flag groups
def add_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Model shape flags (Megatron-LM names); defaults are the embedded small GPT."""
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default: --seq-length")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="tokenizer vocabulary; default: the tokenizer's, or "
                        f"{DEFAULT_MOCK_VOCAB_SIZE} with --mock-data")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--position-embedding-type", default="learned", choices=["learned", "rope"])
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP instead of GeLU")
    g.add_argument("--normalization", default="LayerNorm",
                   help="LayerNorm or RMSNorm (case-insensitive)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    return parser


def add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Batch, optimizer, schedule, precision and parallelism flags."""
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples per data-parallel replica per micro-batch (classic flags); "
                        "default: 4")
    g.add_argument("--global-batch-size", type=int, default=None, help="default: 8")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--lr-decay-style", default="cosine",
                   choices=["constant", "linear", "cosine", "WSD"])
    g.add_argument("--lr-warmup-iters", type=int, default=None,
                   help="default: 10%% of --train-iters")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="WSD: length of the final decay phase (default: 10%% of decay iters)")
    g.add_argument("--lr-wsd-decay-style", default="linear",
                   choices=["linear", "cosine", "exponential", "minus_sqrt"])
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="fp16 static loss scale; default: dynamic scaling")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)

    p = parser.add_argument_group("parallelism")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    p.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    p.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    p.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    p.add_argument("--recompute-num-layers", type=int, default=None)
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's distributed optimizer: shard the optimizer state over "
                        "data parallelism (every layer gets dp_mode zero1)")
    p.add_argument("--auto-parallel", action="store_true",
                   help="search the per-layer parallel plan (profile, then plan, then train)")
    p.add_argument("--plan", default=None, metavar="FILE", help="train with this plan file")
    p.add_argument("--plan-out", default=None, metavar="FILE",
                   help="write the plan in use (searched, given or from classic flags)")
    p.add_argument("--memory-budget-gb", type=float, default=None,
                   help="per-device memory budget for --auto-parallel (default: device memory)")
    p.add_argument("--cluster", default=None, metavar="NAME|FILE",
                   help="hardware profile for --auto-parallel (preset name or JSON file)")
    return parser


def add_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="indexed-dataset prefixes, optionally weighted: 0.3 A 0.7 B")
    g.add_argument("--mock-data", action="store_true", help="deterministic random tokens")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--data-cache-path", default=None)
    return parser


def add_logging_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("logging, evaluation and checkpoints")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=50)
    g.add_argument("--eval-iters", type=int, default=5)
    g.add_argument("--metrics-file", default=None, metavar="PATH",
                   help="append one JSON object per logged iteration (rank 0 writes)")
    g.add_argument("--save", default=None, metavar="DIR",
                   help="save checkpoints (torch.distributed.checkpoint) to DIR/iter_NNNNNNN "
                        "every --save-interval iterations and at the end")
    g.add_argument("--load", default=None, metavar="DIR",
                   help="resume from DIR's latest checkpoint; it may have been saved under "
                        "another plan or world size (it is resharded)")
    g.add_argument("--save-interval", type=int, default=None, metavar="N",
                   help="iterations between checkpoints (needs --save)")
    return parser


def build_parser(description: str = "Train a GPT with a per-layer parallel plan.") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    for add in (add_model_args, add_training_args, add_data_args, add_logging_args):
        add(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None,
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse and check flags that need no world size (see :func:`check_args`)."""
    args = (parser or build_parser()).parse_args(argv)
    # Which flags were typed (not defaulted) matters to --auto-parallel (they pin choices).
    args.argv_ = list(argv) if argv is not None else None
    check_args(args)
    return args


# ----------------------------------------------------------------------------- checks
def _fail(flag: str, value: object, fix: str) -> None:
    raise ArgumentError(f"{flag}={value}: {fix}")


def check_args(args: argparse.Namespace) -> None:
    """Reject contradictory flags at start, naming the flag, its value and the fix."""
    if args.bf16 and args.fp16:
        _fail("--bf16", True, "cannot be combined with --fp16; choose one precision")
    if args.mock_data and args.data_path:
        _fail("--data-path", " ".join(args.data_path),
              "cannot be combined with --mock-data; drop one of them")
    if args.plan and args.auto_parallel:
        _fail("--plan", args.plan, "cannot be combined with --auto-parallel (which searches a "
                                   "plan); drop one of them")
    for flag in ("train_iters", "log_interval", "eval_interval", "seq_length"):
        value = getattr(args, flag)
        if value < 1:
            _fail("--" + flag.replace("_", "-"), value, "must be a positive integer")
    if args.eval_iters < 0:
        _fail("--eval-iters", args.eval_iters, "must be >= 0 (0 disables evaluation)")
    for flag in ("micro_batch_size", "global_batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            _fail("--" + flag.replace("_", "-"), value, "must be a positive integer")
    if args.lr <= 0:
        _fail("--lr", args.lr, "must be positive")
    if not 0 <= args.min_lr <= args.lr:
        _fail("--min-lr", args.min_lr, f"must be between 0 and --lr={args.lr}")
    if args.lr_warmup_iters is None:
        args.lr_warmup_iters = args.train_iters // 10
    if args.lr_warmup_iters < 0:
        _fail("--lr-warmup-iters", args.lr_warmup_iters, "must be >= 0")
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    if args.lr_decay_style != "constant" and args.lr_warmup_iters > decay_iters:
        _fail("--lr-warmup-iters", args.lr_warmup_iters,
              f"must not exceed --lr-decay-iters={decay_iters} (default --train-iters)")
    if args.clip_grad < 0:
        _fail("--clip-grad", args.clip_grad, "must be >= 0 (0 disables clipping)")
    if args.weight_decay < 0:
        _fail("--weight-decay", args.weight_decay, "must be >= 0")
    if args.loss_scale is not None and not args.fp16:
        _fail("--loss-scale", args.loss_scale, "only applies to --fp16; add --fp16 or drop it")
    if args.loss_scale is not None and args.loss_scale <= 0:
        _fail("--loss-scale", args.loss_scale, "must be positive")
    if args.normalization.lower() not in ("layernorm", "rmsnorm"):
        _fail("--normalization", args.normalization, "choose LayerNorm or RMSNorm")
    if args.save_interval is not None:
        if not args.save:
            _fail("--save-interval", args.save_interval,
                  "needs --save DIR (where the checkpoints go); add it or drop --save-interval")
        if args.save_interval < 1:
            _fail("--save-interval", args.save_interval, "must be a positive integer")
    if args.load is not None and not os.path.isdir(args.load):
        _fail("--load", args.load, "no such directory; give the --save directory of an earlier run")
    for flag in ("memory_budget_gb", "cluster"):
        if getattr(args, flag) is not None and not args.auto_parallel:
            warnings.warn(f"--{flag.replace('_', '-')}={getattr(args, flag)} only guides "
                          f"--auto-parallel and is ignored without it", stacklevel=2)
    if args.tokenizer_type is not None and not (args.data_path or args.mock_data):
        _fail("--tokenizer-type", args.tokenizer_type,
              "needs --data-path (the embedded default brings its own tokenizer)")


# ----------------------------------------------------------------------------- converters
def model_config_from_args(args: argparse.Namespace, vocab_size: int | None = None) -> ModelConfig:
    """The :class:`ModelConfig` the flags describe; ``vocab_size`` overrides ``--vocab-size``.

    Raises ``ConfigError`` naming the flag when the shape is inconsistent (e.g. hidden size not
    divisible by the head count).
    """
    vocab = vocab_size or args.vocab_size or DEFAULT_MOCK_VOCAB_SIZE
    return ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings,
        vocab_size=vocab, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.norm_epsilon, init_method_std=args.init_method_std,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        activation="swiglu" if args.swiglu else "gelu",
        normalization=args.normalization.lower(),
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights)


def optimizer_config_from_args(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                           adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                           clip_grad=args.clip_grad)


def lr_config_from_args(args: argparse.Namespace) -> LRConfig:
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    return LRConfig(lr=args.lr, min_lr=args.min_lr, decay_style=args.lr_decay_style,
                    warmup_iters=args.lr_warmup_iters, decay_iters=decay_iters,
                    wsd_decay_iters=args.lr_wsd_decay_iters,
                    wsd_decay_style=args.lr_wsd_decay_style)


def precision_config_from_args(args: argparse.Namespace) -> PrecisionConfig:
    return PrecisionConfig(bf16=args.bf16, fp16=args.fp16, loss_scale=args.loss_scale,
                           initial_loss_scale=args.initial_loss_scale,
                           min_loss_scale=args.min_loss_scale,
                           loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis)


def data_config_from_args(args: argparse.Namespace) -> DataConfig:
    return DataConfig(data_path=tuple(args.data_path or ()), mock_data=args.mock_data,
                      split=args.split, tokenizer_type=args.tokenizer_type,
                      tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
                      merge_file=args.merge_file, vocab_size=args.vocab_size,
                      eod_mask_loss=args.eod_mask_loss, cache_dir=args.data_cache_path)


def logging_config_from_args(args: argparse.Namespace) -> LoggingConfig:
    return LoggingConfig(log_interval=args.log_interval, metrics_file=args.metrics_file)


def training_config_from_args(args: argparse.Namespace) -> "TrainingConfig":
    from .training.pretrain import TrainingConfig  # noqa: PLC0415 - pretrain imports this module

    return TrainingConfig(train_iters=args.train_iters, eval_interval=args.eval_interval,
                          eval_iters=args.eval_iters, seed=args.seed)


# ----------------------------------------------------------------------------- the plan
def resolve_plan(args: argparse.Namespace, model_config: ModelConfig, world_size: int) -> Plan:
    """The plan this run trains with: from ``--plan``, ``--auto-parallel`` or classic flags.

    Every error is an ``ArgumentError``/``PlanError`` whose message names the flag or plan field.
    """
    if args.auto_parallel:
        return _auto_plan(args, model_config, world_size)
    if args.plan:
        return _plan_from_file(args, model_config, world_size)
    return plan_from_classic_flags(args, model_config, world_size)


def _auto_plan(args: argparse.Namespace, model_config: ModelConfig, world_size: int) -> Plan:
    from . import auto  # noqa: PLC0415 - profiler and planner are heavy; only this path needs them

    return auto.plan_for_run(args, model_config, world_size)


def _plan_from_file(args: argparse.Namespace, model_config: ModelConfig, world_size: int) -> Plan:
    plan = Plan.load(args.plan)
    if plan.world_size != world_size:
        raise PlanError(f"--plan {args.plan}: plan field world_size={plan.world_size} but this run "
                        f"has {world_size} ranks; launch with --nproc-per-node x nodes = "
                        f"{plan.world_size} or make a plan for {world_size} ranks")
    plan.validate(model_config)
    if args.global_batch_size is not None and args.global_batch_size != plan.global_batch_size:
        _fail("--global-batch-size", args.global_batch_size,
              f"differs from the plan's global_batch_size={plan.global_batch_size} in "
              f"{args.plan}; drop --global-batch-size or make a plan for this batch size")
    if args.micro_batch_size is not None:
        warnings.warn(f"--micro-batch-size={args.micro_batch_size} is ignored with --plan: each "
                      f"layer's micro-batch follows from the plan (global_batch_size "
                      f"{plan.global_batch_size} / num_microbatches {plan.num_microbatches} / dp)",
                      stacklevel=2)
    layout_flags = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                    "use_distributed_optimizer": False, "recompute_granularity": None,
                    "recompute_method": None, "recompute_num_layers": None,
                    "decoder_first_pipeline_num_layers": None,
                    "decoder_last_pipeline_num_layers": None}
    for flag, default in layout_flags.items():
        if getattr(args, flag) != default:
            _fail("--" + flag.replace("_", "-"), getattr(args, flag),
                  f"conflicts with --plan {args.plan}, which sets the layout (tp, pp, dp mode, "
                  f"recompute per layer); drop the flag or edit the plan")
    return plan


def plan_from_classic_flags(args: argparse.Namespace, model_config: ModelConfig,
                            world_size: int) -> Plan:
    """The uniform plan of Megatron's layout flags (unset sizes count as 1); shared by the
    pretrain scripts and ``megatron-auto evaluate``."""
    tp = args.tensor_model_parallel_size or 1
    model_config.check_tensor_parallel(tp)
    model_config.check_vocab_parallel(tp, what="--tensor-model-parallel-size")
    pp = args.pipeline_model_parallel_size or 1
    if pp > model_config.num_layers:
        _fail("--pipeline-model-parallel-size", pp,
              f"exceeds --num-layers={model_config.num_layers}; every stage needs a layer")
    global_batch = args.global_batch_size if args.global_batch_size is not None \
        else DEFAULT_GLOBAL_BATCH_SIZE
    micro_batch = args.micro_batch_size
    if micro_batch is None:
        # Default: the largest of 4, 2, 1 that splits each replica's share of the batch.
        per_replica = global_batch // max(1, world_size // (tp * pp))
        micro_batch = next(d for d in (4, 2, 1) if per_replica % d == 0 or d == 1)
    try:
        return plan_from_megatron_flags(
            world_size=world_size, num_layers=model_config.num_layers,
            global_batch_size=global_batch, micro_batch_size=micro_batch,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            use_distributed_optimizer=args.use_distributed_optimizer,
            recompute_granularity=args.recompute_granularity,
            recompute_method=args.recompute_method,
            recompute_num_layers=args.recompute_num_layers,
            decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
            decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers)
    except MegatronFlagError as err:
        raise ArgumentError(str(err)) from None
