"""The GPT and BERT families: one layer type each (and one for MoE layers), ``ModelConfig`` with ``model_type`` ``gpt``
(causal decoder, ``pretrain_gpt.py``) or ``bert`` (bidirectional encoder with token types and
the sentence-order head, ``pretrain_bert.py``).

Also what the other language-model families reuse: :data:`PLAN_RECORD_KEYS` (the config fields a
plan records) and :data:`CHECKPOINT_FIELDS` (the fields a checkpoint must agree on).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Mapping

from ...arguments import check_model_option_args, model_config_from_args
from ...config import ModelConfig, filled
from ...planner.inputs.model_spec import ExpertSpec, LayerType, ModelSpec
from ..family import Family, flags_of
from .flags import moe_flags
from .hf_config import DECODER_MODEL_TYPES, ENCODER_MODEL_TYPES, read_decoder, read_encoder

#: ``ModelConfig`` fields a plan's ``model`` record keeps: what decides the costs (and
#: ``model_type``, the family), not dropout or init, which must not invalidate a plan.
PLAN_RECORD_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                    "seq_length", "max_position_embeddings", "vocab_size",
                    "make_vocab_size_divisible_by", "position_embedding_type", "activation",
                    "normalization", "untie_embeddings_and_output_weights", "model_type",
                    "num_tokentypes", "num_query_groups", "add_bias_linear")

#: Model-config fields that decide parameter names and shapes (or what they mean), with the
#: flag that sets each one; a checkpoint loads only into a model that agrees on all of them.
CHECKPOINT_FIELDS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads", "ffn_hidden_size": "--ffn-hidden-size",
    "padded_vocab_size": "--vocab-size / --make-vocab-size-divisible-by",
    "position_embedding_type": "--position-embedding-type",
    "max_position_embeddings": "--max-position-embeddings", "activation": "--swiglu",
    "normalization": "--normalization",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "model_type": "the entry script (pretrain_gpt.py / pretrain_bert.py)",
    "bert_binary_head": "--bert-no-binary-head", "num_tokentypes": "the entry script",
    "query_groups": "--group-query-attention --num-query-groups",
    "add_bias_linear": "--disable-bias-linear", "add_qkv_bias": "--add-qkv-bias",
    "openai_gelu": "--openai-gelu",
}
#: The GPT family's: the MoE parameters' names and shapes too.
GPT_CHECKPOINT_FIELDS = {
    **CHECKPOINT_FIELDS,
    "moe_shape": "--num-experts / --moe-ffn-hidden-size / --moe-layer-freq / "
                 "--moe-shared-expert-intermediate-size",
}


def plan_record(config: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """The fields of ``config`` named in ``keys``, in the config's field order."""
    return {k: v for k, v in config.to_dict().items() if k in keys}


def model_spec(cfg: ModelConfig) -> ModelSpec:
    """One layer type named after the family (causal for GPT); learned positions and BERT's
    token types count as position rows of the embedding. An MoE model (``--num-experts``)
    has a second type, ``<family>_moe``, for its MoE layers (``--moe-layer-freq``): the same
    attention, shared experts as its dense MLP (width 0 without them) and the routed experts
    in ``LayerType.moe``; the dense type only when some layer is dense."""
    dense = LayerType(name=cfg.model_type, hidden_size=cfg.hidden_size,
                      num_attention_heads=cfg.num_attention_heads,
                      ffn_hidden_size=filled(cfg.ffn_hidden_size), seq_length=cfg.seq_length,
                      count=cfg.num_layers, activation=cfg.activation, causal=cfg.causal,
                      num_query_groups=cfg.num_query_groups or 0,
                      add_bias_linear=cfg.add_bias_linear, normalization=cfg.normalization,
                      add_qkv_bias=cfg.add_qkv_bias)
    types: tuple[LayerType, ...] = (dense,)
    order = (0,) * cfg.num_layers
    if cfg.moe is not None:
        moe_layers = set(cfg.moe.moe_layers(cfg.num_layers))
        experts = ExpertSpec(num_experts=cfg.moe.num_experts, topk=cfg.moe.router_topk,
                             ffn_hidden_size=cfg.expert_ffn_hidden_size,
                             capacity_factor=cfg.moe.expert_capacity_factor or 0.0)
        moe_type = dataclasses.replace(
            dense, name=f"{cfg.model_type}_moe", count=len(moe_layers), moe=experts,
            ffn_hidden_size=cfg.moe.shared_expert_intermediate_size or 0)
        kinds = [1 if i in moe_layers else 0 for i in range(cfg.num_layers)]
        if len(moe_layers) == cfg.num_layers:
            types, order = (moe_type,), (0,) * cfg.num_layers
        else:
            types = (dataclasses.replace(dense, count=cfg.num_layers - len(moe_layers)),
                     moe_type)
            order = tuple(kinds)
    positions = (filled(cfg.max_position_embeddings) if cfg.position_embedding_type == "learned"
                 else 0)
    return ModelSpec(layer_types=types, layer_order=order,
                     vocab_size=cfg.padded_vocab_size, embedding_hidden_size=cfg.hidden_size,
                     seq_length=cfg.seq_length,
                     tied_embeddings=not cfg.untie_embeddings_and_output_weights,
                     name=cfg.model_type, num_position_embeddings=positions + cfg.num_tokentypes,
                     config=_plan_record(cfg))


def _plan_record(cfg: ModelConfig) -> dict[str, Any]:
    """The plan's model record; ``add_qkv_bias`` only when set, so that plans of models
    without it stay as they were."""
    record = plan_record(cfg, PLAN_RECORD_KEYS)
    if cfg.add_qkv_bias:
        record["add_qkv_bias"] = True
    if cfg.moe is not None:  # likewise the MoE settings, only for MoE models
        record["moe"] = cfg.moe.to_dict()
    return record


def gpt_from_flags(args: argparse.Namespace, defaults: Mapping[str, Any]) -> ModelConfig:
    """The pretrain scripts' conversion of the model flags."""
    check_model_option_args(args)
    return model_config_from_args(args)


def bert_from_flags(args: argparse.Namespace, defaults: Mapping[str, Any]) -> ModelConfig:
    """As ``pretrain_bert.py``: GPT's flags, bidirectional, with two token types."""
    return dataclasses.replace(gpt_from_flags(args, defaults), model_type="bert",
                               num_tokentypes=2)


def model_flags(config: ModelConfig) -> list[str]:
    """The ``pretrain_gpt.py`` / ``pretrain_bert.py`` model flags that build ``config``."""
    out = flags_of(config, {
        "--num-layers": "num_layers", "--hidden-size": "hidden_size",
        "--num-attention-heads": "num_attention_heads", "--ffn-hidden-size": "ffn_hidden_size",
        "--seq-length": "seq_length", "--max-position-embeddings": "max_position_embeddings",
        "--vocab-size": "vocab_size",
        "--make-vocab-size-divisible-by": "make_vocab_size_divisible_by"})
    out += ["--norm-epsilon", repr(config.layernorm_epsilon)]
    if config.position_embedding_type == "rope":
        out += ["--position-embedding-type", "rope", "--rotary-base", repr(config.rotary_base)]
    if config.activation == "swiglu":
        out.append("--swiglu")
    if config.normalization == "rmsnorm":
        out += ["--normalization", "RMSNorm"]
    if config.untie_embeddings_and_output_weights:
        out.append("--untie-embeddings-and-output-weights")
    if not config.add_bias_linear:
        out.append("--disable-bias-linear")
    if config.add_qkv_bias and not config.add_bias_linear:
        out.append("--add-qkv-bias")
    if config.openai_gelu:
        out.append("--openai-gelu")
    if config.num_query_groups is not None:
        out += ["--group-query-attention", "--num-query-groups", str(config.num_query_groups)]
    return out + moe_flags(config.moe)


def _language_model(name: str, from_flags: Any, stage: str, help_text: str,
                    hf_architectures: tuple[str, ...], entry_script: str,
                    hf_model_types: tuple[str, ...], hf_config: Any) -> Family:
    """GPT and BERT differ only in these; both run SP and the interleaved schedule."""
    return Family(name=name, config_class=ModelConfig, model_spec=model_spec,
                  from_flags=from_flags, stage=stage,
                  profiler="megatron_auto.profiler.model_profiler:GPT_PROFILER", help=help_text,
                  checkpoint_fields=GPT_CHECKPOINT_FIELDS, sequence_parallel=True,
                  interleaved=True,
                  hf_architectures=hf_architectures, entry_script=entry_script,
                  script_flags=model_flags, hf_model_types=hf_model_types, hf_config=hf_config)


FAMILIES = (
    _language_model("gpt", gpt_from_flags, "megatron_auto.models.gpt:GPTStage",
                    "gpt (causal decoder, default)", ("gpt2", "llama", "mixtral"),
                    "pretrain_gpt.py",
                    DECODER_MODEL_TYPES, read_decoder),
    _language_model("bert", bert_from_flags, "megatron_auto.models.bert:BertStage",
                    "bert (encoder)", ("megatron-bert",), "pretrain_bert.py",
                    ENCODER_MODEL_TYPES, read_encoder),
)
