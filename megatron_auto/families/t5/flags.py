"""Flags of the T5 encoder-decoder (``pretrain_t5.py``) and their conversion into a T5Config.

Megatron-LM's names: ``--encoder-num-layers --decoder-num-layers`` (default ``--num-layers``),
``--encoder-seq-length`` (default ``--seq-length``), ``--decoder-seq-length``,
``--kv-channels`` and ``--vocab-extra-ids`` (a data flag of every script; the T5 script
defaults it to 100); Megatron-core's ``--relative-attention-num-buckets`` and
``--relative-attention-max-distance``; ``--position-embedding-type relative|learned`` (T5's
default ``relative``).
"""

from __future__ import annotations

import argparse
from typing import Any

from ...arguments import DEFAULT_MOCK_VOCAB_SIZE
from ...config import ConfigError
from ...run_flag_checks import warn_ignored_model_flags
from .config import T5_POSITION_EMBEDDING_TYPES, T5Config

#: Defaults of the T5 script (the embedded run): a small CPU-friendly model.
T5_DEFAULTS = {"num_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
               "seq_length": 128, "vocab_extra_ids": 100, "position_embedding_type": "relative"}
#: The decoder's default length: the targets of span corruption over 128 tokens fit in 32.
DEFAULT_DECODER_SEQ_LENGTH = 32


def add_t5_args(parser: argparse.ArgumentParser, *,
                script_defaults: bool = True) -> argparse.ArgumentParser:
    """The encoder-decoder flags; ``script_defaults`` replaces the GPT defaults of the shared
    flags by :data:`T5_DEFAULTS` (the CLI, which serves GPT too, applies them itself)."""
    g = parser.add_argument_group("T5")
    g.add_argument("--encoder-num-layers", type=int, default=None, help="default: --num-layers")
    g.add_argument("--decoder-num-layers", type=int, default=None, help="default: --num-layers")
    g.add_argument("--encoder-seq-length", type=int, default=None, help="default: --seq-length")
    g.add_argument("--decoder-seq-length", type=int, default=DEFAULT_DECODER_SEQ_LENGTH)
    g.add_argument("--kv-channels", type=int, default=None,
                   help="width of one attention head; default: hidden size / heads")
    g.add_argument("--relative-attention-num-buckets", type=int, default=32)
    g.add_argument("--relative-attention-max-distance", type=int, default=128)
    if not any("--vocab-extra-ids" in a.option_strings for a in parser._actions):
        # the planning CLI has no data flags; the pretrain scripts take it from arguments.py
        g.add_argument("--vocab-extra-ids", type=int, default=None, help="default: 100")
    for action in parser._actions:
        if action.dest == "position_embedding_type":  # the shared flag gains T5's relative
            action.choices = sorted(set(action.choices or ()) | set(T5_POSITION_EMBEDDING_TYPES))
        if not script_defaults and action.dest in T5_DEFAULTS:
            # the CLI: tell a given value (--hidden-size 256) from the GPT default it equals
            action.__class__ = _marking(type(action))
    if script_defaults:
        parser.set_defaults(**T5_DEFAULTS)
    return parser


def _marking(kind: type) -> type:
    """``kind`` of argparse action that also records that its flag was given."""

    class Marking(kind):  # type: ignore[misc, valid-type]
        def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
            super().__call__(parser, namespace, values, option_string)
            setattr(namespace, f"{self.dest}_given", True)
    return Marking


def apply_t5_defaults(args: argparse.Namespace, parser_defaults: dict) -> None:
    """Give every shared flag left at ``parser_defaults`` (the GPT defaults) the T5 script's
    default, so that the CLI describes the model the script would train (a flag given on the
    command line keeps its value even when it equals the GPT default)."""
    for dest, value in T5_DEFAULTS.items():
        if getattr(args, f"{dest}_given", False):
            continue
        if getattr(args, dest, None) in (None, parser_defaults.get(dest)):
            setattr(args, dest, value)


def _warn_shadowed(args: argparse.Namespace) -> None:
    """The shared flags a T5 reads only as defaults (``--num-layers`` once both layer counts
    are given, ``--seq-length`` once ``--encoder-seq-length`` is) and the ones it never reads
    (``--rotary-base``: T5 has no rotary embeddings; ``--eod-mask-loss``: its loss is over the
    span-corruption targets), when typed."""
    given = getattr(args, "given_flags", None)
    if given is None:
        return
    ignored = ["rotary_base", "eod_mask_loss"]
    if args.encoder_num_layers is not None and args.decoder_num_layers is not None:
        ignored.append("num_layers")
    if args.encoder_seq_length is not None:
        ignored.append("seq_length")
    warn_ignored_model_flags(given, ignored, args, "t5",
                             "--encoder-num-layers, --decoder-num-layers and "
                             "--encoder-seq-length set its shape; it has no rotary embeddings "
                             "and its loss is over the span targets")


def t5_config_from_args(args: argparse.Namespace) -> T5Config:
    """The :class:`T5Config` the flags describe; ``ConfigError`` names a bad flag."""
    if args.position_embedding_type not in T5_POSITION_EMBEDDING_TYPES:
        raise ConfigError(f"--position-embedding-type={args.position_embedding_type}: T5 takes "
                          f"{' or '.join(T5_POSITION_EMBEDDING_TYPES)}")
    if (getattr(args, "vocab_extra_ids", 0) or 0) < 1:
        raise ConfigError(f"--vocab-extra-ids={getattr(args, 'vocab_extra_ids', 0)}: T5 span "
                          f"corruption needs sentinel tokens from the tokenizer's extra ids; "
                          f"add --vocab-extra-ids 100")
    if args.untie_embeddings_and_output_weights:
        raise ConfigError("--untie-embeddings-and-output-weights: T5 ties its LM head to the word "
                          "embeddings (as Megatron-LM's T5); drop the flag")
    # ``is None``, not ``or``: a given 0 is refused by T5Config, never replaced by the default
    def given_or(value: Any, default: Any) -> Any:
        return default if value is None else value

    _warn_shadowed(args)
    return T5Config(
        encoder_num_layers=given_or(args.encoder_num_layers, args.num_layers),
        decoder_num_layers=given_or(args.decoder_num_layers, args.num_layers),
        hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
        seq_length=given_or(args.encoder_seq_length, args.seq_length),
        decoder_seq_length=args.decoder_seq_length,
        max_position_embeddings=args.max_position_embeddings,
        vocab_size=args.vocab_size or DEFAULT_MOCK_VOCAB_SIZE,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.norm_epsilon, init_method_std=args.init_method_std,
        position_embedding_type=args.position_embedding_type,
        activation="swiglu" if args.swiglu else "gelu",
        normalization=args.normalization.lower(),
        add_bias_linear=not getattr(args, "disable_bias_linear", False),
        openai_gelu=getattr(args, "openai_gelu", False),
        num_query_groups=((getattr(args, "num_query_groups", None) or 1)
                          if getattr(args, "group_query_attention", False) else None),
        relative_attention_num_buckets=args.relative_attention_num_buckets,
        relative_attention_max_distance=args.relative_attention_max_distance)
