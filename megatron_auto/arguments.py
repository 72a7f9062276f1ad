"""Command-line flags (Megatron-LM names), converted once into a :class:`RunConfig`.

This is the only module that knows argparse for training flags (docs/design.md §8): an entry
point calls :func:`parse_run_config` on its argv and hands the result to
``training.pretrain.pretrain()``; nothing below sees an argparse namespace. The ``megatron-auto``
CLI reuses the flag groups (:func:`add_model_args`) and the converters
(:func:`model_config_from_args`; ``plan_flags.classic_layout_from_args``) on its own parsers.

Defaults describe the embedded run (``torchrun --standalone --nproc-per-node 2 pretrain_gpt.py``
with no other flag): a 4-layer, 256-wide GPT on the corpus shipped with the package.

Where the parallel plan comes from is decided in the same parse (the flags and their
conversion: ``plan_flags.py``; the plan itself: ``plan_source.py``): ``--plan FILE``,
``--auto-parallel`` (the layout flags the user typed become ``SearchPins``), or the classic
flags (a uniform plan).

Pure: no torch, so the planning CLI starts fast.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

from .config import (DEFAULT_GLOBAL_BATCH_SIZE, FP8_FORMATS, TRANSFORMER_IMPLS, ArgumentError,
                     ConfigError, ModelConfig, resolve_precision)
from .families.gpt.config import MoEConfig, MoEConfigError
from .families.gpt.flags import add_moe_model_args, moe_config_from_args
from .plan_flags import add_parallelism_args, check_plan_flags, plan_source_from_args
from .run_flag_checks import check_output_flags, given_flags, warn_inapplicable_flags
from .utils.ignored_flags import (IGNORED_MEGATRON_FLAGS, add_ignored_megatron_args,
                                  warn_ignored_megatron_flags)
from .utils.flag_warnings import warn_flag

if TYPE_CHECKING:
    # annotations only: run_config's dataclasses, imported where built (below)
    from .run_config import RunConfig

# run_config's dataclasses are imported by the functions that build them: the planning
# commands parse the model flags here without them (their creation is a fifth of
# ``megatron-auto plan``'s package imports).

__all__ = ["DEFAULT_GLOBAL_BATCH_SIZE", "DEFAULT_MOCK_VOCAB_SIZE", "IGNORED_MEGATRON_FLAGS",
           "ArgumentError", "ConfigError", "add_ignored_megatron_args", "add_model_args", "build_parser",
           "model_config_from_args", "parse_run_config", "run_config_from_args"]

# Model vocabulary when neither a tokenizer nor --vocab-size says otherwise (mock data).
DEFAULT_MOCK_VOCAB_SIZE = 8192

# Float flags whose non-finite value (inf, nan: argparse's float() accepts both) is rejected.
_FINITE_FLAGS = ("lr", "min_lr", "clip_grad", "weight_decay", "adam_beta1", "adam_beta2",
                 "adam_eps", "loss_scale", "memory_budget_gb", "optimality_gap")
# ----------------------------------------------------------------------------- flag groups
def add_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Model shape flags (Megatron-LM names); defaults are the embedded small GPT."""
    g = parser.add_argument_group("model")
    g.add_argument("--hf-config", default=None, metavar="FILE_OR_DIR",
                   help="a Hugging Face config.json (or the directory holding it): the model "
                        "flags take its values; model flags given as well override them")
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
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases in the QKV, attention output and MLP projections (LLaMA)")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="a bias on the QKV projection only, with --disable-bias-linear (Qwen2)")
    g.add_argument("--openai-gelu", action="store_true",
                   help="GeLU's tanh approximation (GPT-2's gelu_new) instead of the erf form")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention: --num-query-groups key/value heads")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads with --group-query-attention (default 1, as Megatron)")
    return add_moe_model_args(parser)


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
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true",
                   help="stop the run (exit 2) when an iteration's loss or gradients are inf/nan, "
                        "naming the iteration and the rank; fp16 overflow skips stay skips")
    # Megatron's opposite switch (its default is on; here off): accepted, it keeps the default.
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", default=False, help="the default here")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="fp16 static loss scale; default: dynamic scaling")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer (the schedule stays eager)")
    g.add_argument("--transformer-impl", default="local", choices=TRANSFORMER_IMPLS,
                   help="local (ours, default) or transformer_engine (Transformer Engine's "
                        "LayerNormLinear / Linear / DotProductAttention; needs the package)")
    g.add_argument("--fp8-format", default=None, choices=FP8_FORMATS,
                   help="train the GEMMs in FP8 with Transformer Engine's delayed scaling "
                        "(hybrid: E4M3 forward, E5M2 backward); needs --transformer-impl "
                        "transformer_engine")
    g.add_argument("--compile-backend", default=None,
                   help="torch.compile backend for --compile: inductor (default), aot_eager, "
                        "eager")
    add_parallelism_args(parser)
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
    g.add_argument("--vocab-extra-ids", type=int, default=0,
                   help="sentinel tokens <extra_id_i> added to the tokenizer (T5 span "
                        "corruption; pretrain_t5.py: default 100)")
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
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="per-iteration phase timers (Megatron's): 0 none, 1 forward/backward, "
                        "pipeline waits, DP sync, optimizer; 2 finer, and CUDA synchronised at "
                        "every timer (docs/training.md)")
    g.add_argument("--timing-log-option", default="minmax", choices=["max", "minmax", "all"],
                   help="timers on the console: max over ranks, (min, max), or every rank")
    g.add_argument("--save", default=None, metavar="DIR",
                   help="save checkpoints (torch.distributed.checkpoint) to DIR/iter_NNNNNNN "
                        "every --save-interval iterations and at the end")
    g.add_argument("--load", default=None, metavar="DIR",
                   help="resume from DIR's latest checkpoint; it may have been saved under "
                        "another plan or world size (it is resharded). A missing or empty DIR "
                        "starts from scratch, so '--save D --load D' serves the first launch "
                        "and every restart")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0, metavar="MIN",
                   help="collective timeout: a rank waiting this long on a dead peer stops "
                        "(default 10, as Megatron)")
    g.add_argument("--save-interval", type=int, default=None, metavar="N",
                   help="iterations between checkpoints (needs --save)")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background (torch.distributed.checkpoint."
                        "async_save): training stalls only while the state is copied (needs "
                        "--save)")
    g.add_argument("--overwrite", action="store_true",
                   help="let --save replace a checkpoint of another run there (without it, a "
                        "--save directory holding one is refused unless --load continues it)")
    g.add_argument("--no-load-fallback", dest="load_fallback", action="store_false",
                   help="stop at a damaged --load checkpoint instead of loading the newest "
                        "intact older one")
    g.add_argument("--exit-signal-handler", dest="exit_signal_handler", action="store_true",
                   default=None,
                   help="on SIGTERM (preemption; torchrun forwards it) finish the iteration, "
                        "save (with --save) and exit 0 on every rank together. Default: on "
                        "when --save is given")
    g.add_argument("--no-exit-signal-handler", dest="exit_signal_handler",
                   action="store_false", help="keep SIGTERM's default action (end at once)")
    g.add_argument("--exit-duration-in-mins", type=float, default=None, metavar="MIN",
                   help="save (with --save) and exit 0 once the run has lasted MIN minutes")
    g.add_argument("--exit-interval", type=int, default=None, metavar="N",
                   help="save (with --save) and exit 0 at the first iteration divisible by N")
    t = parser.add_argument_group("TensorBoard and Weights & Biases (the metrics-file records)")
    t.add_argument("--tensorboard-dir", default=None, metavar="DIR")
    t.add_argument("--tensorboard-log-interval", type=int, default=1, metavar="N",
                   help="keep the training records of every N-th iteration")
    t.add_argument("--log-timers-to-tensorboard", action="store_true")
    t.add_argument("--log-memory-to-tensorboard", action="store_true")
    t.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    t.add_argument("--wandb-project", default=None)
    t.add_argument("--wandb-exp-name", default=None)
    t.add_argument("--wandb-save-dir", default=None, metavar="DIR")
    return parser


def build_parser(description: str = "Train a GPT with a per-layer parallel plan.") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    for add in (add_model_args, add_training_args, add_data_args, add_logging_args,
                add_ignored_megatron_args):
        add(parser)
    return parser


#: ``(args, typed destinations, the parser's destinations)``: fills the model flags from
#: ``--hf-config`` (``families.hf_config.apply_hf_config``, which this base layer cannot import:
#: the entry points pass it in).
ModelFileReader = Callable[[argparse.Namespace, frozenset, frozenset], Any]


def parse_run_config(argv: Sequence[str] | None = None,
                     parser: argparse.ArgumentParser | None = None, *,
                     model_config_from_args: Callable[[argparse.Namespace], Any] | None = None,
                     read_model_file: ModelFileReader | None = None) -> RunConfig:
    """The :class:`RunConfig` of ``argv`` (default ``sys.argv[1:]``), checked.

    ``parser`` extends :func:`build_parser` with a script's own flags and
    ``model_config_from_args`` converts them into its model config (the vision classifiers'
    ``VisionConfig``); by default the model is this module's :class:`ModelConfig`.
    ``read_model_file`` fills the model flags from ``--hf-config`` before they are checked (a
    typed flag wins); without it ``--hf-config`` is refused.
    Raises ``ConfigError`` (``ArgumentError`` for flag combinations) naming the flag, its value
    and the fix; argparse itself exits with status 2 on unknown flags.
    """
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    args.given_flags = given_flags(parser, argv)  # for the families that ignore shared flags
    if getattr(args, "hf_config", None):
        if read_model_file is None:
            _fail("--hf-config", args.hf_config, "this entry point cannot read Hugging Face "
                  "configs; run a pretrain script or megatron-auto")
        read_model_file(args, args.given_flags,
                        frozenset(a.dest for a in parser._actions if a.dest != argparse.SUPPRESS))
    check_args(args)
    return run_config_from_args(args, model_config_from_args or model_config_from_args_default)


# ----------------------------------------------------------------------------- checks
def _fail(flag: str, value: object, fix: str) -> NoReturn:
    raise ArgumentError(f"{flag}={value}: {fix}")


def _check_transformer_impl(args: argparse.Namespace) -> None:
    """--transformer-impl / --fp8-format: refuse at start what cannot run here (the package is
    looked up, not imported: importing it would load torch and CUDA)."""
    impl, fp8 = getattr(args, "transformer_impl", "local"), getattr(args, "fp8_format", None)
    te_missing = importlib.util.find_spec("transformer_engine") is None
    if fp8 is not None and impl != "transformer_engine":
        _fail("--fp8-format", fp8, "needs --transformer-impl transformer_engine (FP8 GEMMs are "
              "Transformer Engine's); add it or drop --fp8-format")
    if impl == "transformer_engine" and te_missing:
        _fail("--transformer-impl", impl, "Transformer Engine is not installed here (no module "
              "transformer_engine); install transformer_engine[pytorch] or use "
              "--transformer-impl local")
    if impl == "transformer_engine" and getattr(args, "sequence_parallel", False):
        _fail("--transformer-impl", impl, "not wired with --sequence-parallel yet (the TP "
              "all-reduce of the norm-weight gradients that Megatron adds after Transformer "
              "Engine's backward is missing); drop one of them")


def check_args(args: argparse.Namespace) -> None:
    """Reject contradictory flags at start, naming the flag, its value and the fix."""
    resolve_precision(args.bf16, args.fp16)
    warn_ignored_megatron_flags(args)
    _check_transformer_impl(args)
    if args.mock_data and args.data_path:
        _fail("--data-path", " ".join(args.data_path),
              "cannot be combined with --mock-data; drop one of them")
    if args.plan and args.auto_parallel:
        _fail("--plan", args.plan, "cannot be combined with --auto-parallel (which searches a "
                                   "plan); drop one of them")
    if args.train_iters < 0:
        _fail("--train-iters", args.train_iters, "must be >= 0 (0 with --save writes the "
                                                 "initial checkpoint and trains nothing)")
    if args.train_iters == 0 and not args.save:
        _fail("--train-iters", 0, "trains nothing; it only writes the initial checkpoint with "
                                  "--save DIR: add --save, or give a positive count")
    for flag in ("log_interval", "eval_interval", "seq_length"):
        value = getattr(args, flag)
        if value < 1:
            _fail("--" + flag.replace("_", "-"), value, "must be a positive integer")
    if args.eval_iters < 0:
        _fail("--eval-iters", args.eval_iters, "must be >= 0 (0 disables evaluation)")
    for flag in ("micro_batch_size", "global_batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            _fail("--" + flag.replace("_", "-"), value, "must be a positive integer")
    for flag in _FINITE_FLAGS:  # nan passes every comparison below, inf most of them
        value = getattr(args, flag, None)
        if value is not None and not math.isfinite(value):
            _fail("--" + flag.replace("_", "-"), value, "must be a finite number")
    if args.lr <= 0:
        _fail("--lr", args.lr, "must be positive")
    if not 0 <= args.min_lr <= args.lr:
        _fail("--min-lr", args.min_lr, f"must be between 0 and --lr={args.lr}")
    warmup = _warmup_iters(args)
    if warmup < 0:
        _fail("--lr-warmup-iters", warmup, "must be >= 0")
    decay_iters = _decay_iters(args)
    if args.lr_decay_style != "constant" and warmup > decay_iters:
        _fail("--lr-warmup-iters", warmup,
              f"must not exceed --lr-decay-iters={decay_iters} (default --train-iters)")
    if args.clip_grad < 0:
        _fail("--clip-grad", args.clip_grad, "must be >= 0 (0 disables clipping)")
    if (getattr(args, "optimality_gap", None) or 0) < 0:
        _fail("--optimality-gap", args.optimality_gap, "must be >= 0 (e.g. 0.01; 0 proves)")
    cp_min = getattr(args, "cp_min_seq_length", None)
    if cp_min is not None and cp_min < 1:
        _fail("--cp-min-seq-length", cp_min, "must be a positive number of tokens (e.g. 256)")
    if args.weight_decay < 0:
        _fail("--weight-decay", args.weight_decay, "must be >= 0")
    if args.loss_scale is not None and not args.fp16:
        _fail("--loss-scale", args.loss_scale, "only applies to --fp16; add --fp16 or drop it")
    if args.loss_scale is not None and args.loss_scale <= 0:
        _fail("--loss-scale", args.loss_scale, "must be positive")
    if args.normalization.lower() not in ("layernorm", "rmsnorm"):
        _fail("--normalization", args.normalization, "choose LayerNorm or RMSNorm")
    check_model_option_args(args)
    if args.save_interval is not None:
        if not args.save:
            _fail("--save-interval", args.save_interval,
                  "needs --save DIR (where the checkpoints go); add it or drop --save-interval")
        if args.save_interval < 1:
            _fail("--save-interval", args.save_interval, "must be a positive integer")
    if args.load is not None and os.path.exists(args.load) and not os.path.isdir(args.load):
        _fail("--load", args.load, "is a file, not a directory; give the --save directory of an "
              "earlier run")
    if args.async_save and not args.save:
        _fail("--async-save", True, "needs --save DIR (where the checkpoints go); add it or drop "
              "--async-save")
    if args.exit_duration_in_mins is not None and not (
            math.isfinite(args.exit_duration_in_mins) and args.exit_duration_in_mins > 0):
        _fail("--exit-duration-in-mins", args.exit_duration_in_mins,
              "must be a positive number of minutes (e.g. 230)")
    if args.exit_interval is not None and args.exit_interval < 1:
        _fail("--exit-interval", args.exit_interval, "must be a positive integer")
    if not (math.isfinite(args.distributed_timeout_minutes)
            and args.distributed_timeout_minutes > 0):
        _fail("--distributed-timeout-minutes", args.distributed_timeout_minutes,
              "must be a positive number of minutes (e.g. 10)")
    warn_inapplicable_flags(args)
    check_output_flags(args)
    if args.tokenizer_type is not None and not (args.data_path or args.mock_data):
        _fail("--tokenizer-type", args.tokenizer_type,
              "needs --data-path (the embedded default brings its own tokenizer)")
    check_plan_flags(args)


def check_model_option_args(args: argparse.Namespace) -> None:
    """The attention / MLP option flags that only mean something together."""
    if getattr(args, "num_query_groups", None) is not None and not args.group_query_attention:
        _fail("--num-query-groups", args.num_query_groups,
              "needs --group-query-attention (Megatron ignores it otherwise); add that flag or "
              "drop --num-query-groups")
    if getattr(args, "openai_gelu", False) and getattr(args, "swiglu", False):
        _fail("--openai-gelu", True, "selects the GeLU approximation but --swiglu replaces GeLU "
              "by SiLU gating; drop one of them")


def _num_query_groups(args: argparse.Namespace) -> int | None:
    """Key/value heads: --num-query-groups (default 1) with --group-query-attention, else one
    per attention head (None lets ModelConfig fill that in)."""
    if not getattr(args, "group_query_attention", False):
        return None
    return 1 if args.num_query_groups is None else args.num_query_groups


def _decay_iters(args: argparse.Namespace) -> int:
    """--lr-decay-iters, default --train-iters (1 for --train-iters 0, which writes the initial
    checkpoint and never evaluates the schedule: the checkpoint holds no schedule)."""
    return args.lr_decay_iters if args.lr_decay_iters is not None else max(args.train_iters, 1)


def _warmup_iters(args: argparse.Namespace) -> int:
    """--lr-warmup-iters, default 10% of --train-iters."""
    return args.lr_warmup_iters if args.lr_warmup_iters is not None else args.train_iters // 10


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
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=getattr(args, "add_qkv_bias", False), openai_gelu=args.openai_gelu,
        num_query_groups=_num_query_groups(args),
        transformer_impl=getattr(args, "transformer_impl", "local"),
        fp8_format=getattr(args, "fp8_format", None), moe=_moe_config(args))


def _moe_config(args: argparse.Namespace) -> MoEConfig | None:
    """The MoE flags' settings (None: dense), their errors as ``ConfigError``."""
    try:
        return moe_config_from_args(args)
    except MoEConfigError as err:
        raise ConfigError(str(err)) from None


def model_config_from_args_default(args: argparse.Namespace) -> ModelConfig:
    """The language models' :class:`ModelConfig` (the flags' vocabulary or the mock default)."""
    return model_config_from_args(args)


def run_config_from_args(args: argparse.Namespace,
                         model_config_from_args: Callable[[argparse.Namespace], Any] | None = None
                         ) -> RunConfig:
    """Every component's dataclass from a namespace :func:`check_args` accepted."""
    from .run_config import (  # noqa: PLC0415 - run_config's dataclasses
        CheckpointConfig, DataConfig, ExperimentLogConfig, LoggingConfig, LRConfig,
        OptimizerConfig, PrecisionConfig, RunConfig, TrainingConfig)
    decay_iters = _decay_iters(args)
    return RunConfig(
        model=(model_config_from_args or model_config_from_args_default)(args),
        data=DataConfig(data_path=tuple(args.data_path or ()), mock_data=args.mock_data,
                        split=args.split, tokenizer_type=args.tokenizer_type,
                        tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
                        merge_file=args.merge_file, vocab_size=args.vocab_size,
                        eod_mask_loss=args.eod_mask_loss, cache_dir=args.data_cache_path,
                        vocab_extra_ids=args.vocab_extra_ids),
        optimizer=OptimizerConfig(weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                                  adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                                  clip_grad=args.clip_grad),
        lr=LRConfig(lr=args.lr, min_lr=args.min_lr, decay_style=args.lr_decay_style,
                    warmup_iters=_warmup_iters(args), decay_iters=decay_iters,
                    wsd_decay_iters=args.lr_wsd_decay_iters,
                    wsd_decay_style=args.lr_wsd_decay_style),
        precision=PrecisionConfig(bf16=args.bf16, fp16=args.fp16, loss_scale=args.loss_scale,
                                  initial_loss_scale=args.initial_loss_scale,
                                  min_loss_scale=args.min_loss_scale,
                                  loss_scale_window=args.loss_scale_window,
                                  hysteresis=args.hysteresis),
        logging=LoggingConfig(log_interval=args.log_interval, metrics_file=args.metrics_file,
                              timing_log_level=args.timing_log_level,
                              timing_log_option=args.timing_log_option),
        experiment_log=ExperimentLogConfig(
            tensorboard_dir=args.tensorboard_dir,
            tensorboard_log_interval=args.tensorboard_log_interval,
            log_timers_to_tensorboard=args.log_timers_to_tensorboard,
            log_memory_to_tensorboard=args.log_memory_to_tensorboard,
            log_validation_ppl_to_tensorboard=args.log_validation_ppl_to_tensorboard,
            wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name,
            wandb_save_dir=args.wandb_save_dir),
        training=TrainingConfig(train_iters=args.train_iters, eval_interval=args.eval_interval,
                                eval_iters=args.eval_iters, seed=args.seed,
                                compile_backend=((args.compile_backend or "inductor")
                                                 if args.compile else None),
                                check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad,
                                exit_signal_handler=args.exit_signal_handler,
                                exit_duration_in_mins=args.exit_duration_in_mins,
                                exit_interval=args.exit_interval),
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        checkpoint=CheckpointConfig(save=args.save, load=args.load,
                                    save_interval=args.save_interval,
                                    async_save=args.async_save, overwrite=args.overwrite,
                                    load_fallback=args.load_fallback),
        plan_source=plan_source_from_args(args), plan_out=args.plan_out)
