"""The T5 family: two layer types (encoder, decoder), ``pretrain_t5.py``.

The stages run neither sequence parallelism nor the interleaved schedule (they refuse such
plans), so the family says so and the search leaves both out.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Mapping

from ...arguments import check_model_option_args
from ...config import filled
from ...planner.inputs.model_spec import LayerType, ModelSpec
from ..family import Family, flags_of
from .hf_config import MODEL_TYPES as HF_MODEL_TYPES, read_t5
from ..gpt.family import CHECKPOINT_FIELDS, PLAN_RECORD_KEYS, plan_record
from .config import T5Config
from .flags import add_t5_args, apply_t5_defaults, t5_config_from_args

T5_PLAN_RECORD_KEYS = PLAN_RECORD_KEYS + (
    "encoder_num_layers", "decoder_num_layers", "decoder_seq_length", "kv_channels",
    "relative_attention_num_buckets", "relative_attention_max_distance")

T5_CHECKPOINT_FIELDS = {
    **CHECKPOINT_FIELDS, "model_type": "the entry script (pretrain_t5.py)",
    "encoder_num_layers": "--encoder-num-layers", "decoder_num_layers": "--decoder-num-layers",
    "kv_channels": "--kv-channels",
    "relative_attention_num_buckets": "--relative-attention-num-buckets",
}


def model_spec(cfg: T5Config) -> ModelSpec:
    """Layer types ``t5_encoder`` (``s_e`` tokens, carrying the decoder's ``s_d`` embedded
    tokens) and ``t5_decoder`` (``s_d`` tokens, cross-attention over ``s_e``, carrying the
    encoder output), in that order.

    The embedding holds the word (and learned position) table; the head its bias, the
    decoder's final norm and the tied word copy, and projects the ``s_d`` decoder tokens.
    The encoder's final norm and the relative bias tables (a few KB) are counted in the
    head's parameters, though they live on the stages of the last encoder layer and of
    each stack."""
    enc = LayerType(name="t5_encoder", hidden_size=cfg.hidden_size,
                    num_attention_heads=cfg.num_attention_heads,
                    ffn_hidden_size=filled(cfg.ffn_hidden_size), seq_length=cfg.seq_length,
                    count=cfg.encoder_num_layers, activation=cfg.activation, causal=False,
                    add_bias_linear=cfg.add_bias_linear, normalization=cfg.normalization,
                    kv_channels=filled(cfg.kv_channels), carried_seq_length=cfg.decoder_seq_length)
    dec = dataclasses.replace(enc, name="t5_decoder", seq_length=cfg.decoder_seq_length,
                              count=cfg.decoder_num_layers, causal=True,
                              cross_attention_seq_length=cfg.seq_length,
                              carried_seq_length=cfg.seq_length)
    h, v = cfg.hidden_size, cfg.padded_vocab_size
    positions = (filled(cfg.max_position_embeddings) if cfg.position_embedding_type == "learned"
                 else 0)
    norm = 2 * h if cfg.normalization == "layernorm" else h
    stacked = ModelSpec.stacked([(enc, cfg.encoder_num_layers), (dec, cfg.decoder_num_layers)],
                                vocab_size=v, embedding_hidden_size=h, seq_length=cfg.seq_length,
                                name="t5")
    return dataclasses.replace(
        stacked, tied_embeddings=True, config=plan_record(cfg, T5_PLAN_RECORD_KEYS),
        num_position_embeddings=positions, embedding_parameter_count=(v + positions) * h,
        head_parameter_count=2 * norm + v + cfg.relative_bias_parameters(),
        head_tokens=cfg.decoder_seq_length, head_hidden_size=h)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The T5 flags on ``megatron-auto``, whose shared flags keep the GPT defaults."""
    add_t5_args(parser, script_defaults=False)


def from_flags(args: argparse.Namespace, defaults: Mapping[str, Any]) -> T5Config:
    """``pretrain_t5.py``'s conversion, with its defaults for the shared flags left alone."""
    check_model_option_args(args)
    t5 = argparse.Namespace(**vars(args))
    apply_t5_defaults(t5, dict(defaults))
    return t5_config_from_args(t5)


def model_flags(cfg: T5Config) -> list[str]:
    """The ``pretrain_t5.py`` shape flags of ``cfg``."""
    return flags_of(cfg, {
        "--encoder-num-layers": "encoder_num_layers", "--decoder-num-layers": "decoder_num_layers",
        "--hidden-size": "hidden_size", "--num-attention-heads": "num_attention_heads",
        "--kv-channels": "kv_channels", "--ffn-hidden-size": "ffn_hidden_size",
        "--encoder-seq-length": "seq_length", "--decoder-seq-length": "decoder_seq_length",
        "--vocab-size": "vocab_size"})


FAMILIES = (
    Family(name="t5", config_class=T5Config, model_spec=model_spec, from_flags=from_flags,
           stage="megatron_auto.models.t5:T5Stage",
           profiler="megatron_auto.profiler.t5_profiler:T5_PROFILER", add_flags=add_flags,
           help="t5 (encoder-decoder, with pretrain_t5.py's flags)",
           checkpoint_fields=T5_CHECKPOINT_FIELDS, entry_script="pretrain_t5.py",
           script_flags=model_flags, hf_model_types=HF_MODEL_TYPES, hf_config=read_t5),
)
