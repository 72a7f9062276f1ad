"""Hugging Face configs of the GPT and BERT families (``--hf-config``, families/hf_config.py).

Decoders (``gpt`` family): GPT-2 (``gpt2``), LLaMA 2/3 (``llama``), Mistral (``mistral``),
Qwen2/2.5 (``qwen2``) and Mixtral (``mixtral``, a mixture of experts: its fields need the MoE
flags). Encoders (``bert`` family): ``megatron-bert`` (our BERT exactly) and ``bert`` (priced as
Megatron's pre-LayerNorm BERT: the planning commands only). Every value lands on the flag
Megatron users know; what our models do not have is refused naming the field.
"""

from __future__ import annotations

import argparse

from ..hf_reader import HFConfigError, HFReader

TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
#: Decoders with rotary embeddings, SwiGLU and RMSNorm (the LLaMA layout); none of their
#: config classes ties the head by default.
LLAMA_LIKE = ("llama", "mistral", "qwen2", "mixtral")
DECODER_MODEL_TYPES = ("gpt2",) + LLAMA_LIKE
ENCODER_MODEL_TYPES = ("megatron-bert", "bert")


def read_decoder(r: HFReader) -> None:
    """A decoder's config -> the ``pretrain_gpt.py`` model flags."""
    if r.config["model_type"] == "gpt2":
        _gpt2(r)
    else:
        _llama_like(r, r.config["model_type"])


def _positions(r: HFReader, key: str) -> None:
    """The position table bounds the sequence; the run's --seq-length defaults to it."""
    r.take("max_position_embeddings", key)
    if "max_position_embeddings" in r.values:
        r.set("seq_length", key, r.values["max_position_embeddings"])


def _gpt2(r: HFReader) -> None:
    for dest, key in (("num_layers", "n_layer"), ("hidden_size", "n_embd"),
                      ("num_attention_heads", "n_head"), ("vocab_size", "vocab_size")):
        r.take(dest, key)
    _positions(r, "n_positions")
    inner = r.get("n_inner")
    if inner is None and "hidden_size" in r.values:
        r.set("ffn_hidden_size", "n_inner", 4 * r.values["hidden_size"])  # GPT-2's default
    else:
        r.take("ffn_hidden_size", "n_inner")
    r.take("norm_epsilon", "layer_norm_epsilon", float)
    r.take("init_method_std", "initializer_range", float)
    r.take("hidden_dropout", "resid_pdrop", float)
    r.take("attention_dropout", "attn_pdrop", float)
    r.cost_only(r.get("embd_pdrop", r.get("resid_pdrop")) == r.get("resid_pdrop"), "embd_pdrop",
                r.get("embd_pdrop"), "the residual dropout resid_pdrop")
    _gelu(r, "activation_function", "gelu_new")
    r.cost_only(bool(r.get("scale_attn_weights", True)), "scale_attn_weights", False,
                "attention scaled by 1/sqrt(head_dim)")
    r.cost_only(not r.get("scale_attn_by_inverse_layer_idx", False),
                "scale_attn_by_inverse_layer_idx", True, "the same attention scale in every layer")
    r.need(not r.get("add_cross_attention", False), "add_cross_attention", True,
           "a decoder with cross-attention is not a GPT; megatron_auto has none")
    _learned_layernorm_gelu(r, positions_key="model_type", act_key="activation_function",
                            heads_key="n_head")


def _transformers_shape(r: HFReader, norm_key: str) -> None:
    """The shape keys the LLaMA-like and BERT configs of transformers name alike (layers,
    widths, heads, vocabulary, position table), the norm epsilon (``norm_key``) and the init
    std."""
    for dest, key in (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
                      ("num_attention_heads", "num_attention_heads"),
                      ("ffn_hidden_size", "intermediate_size"), ("vocab_size", "vocab_size")):
        r.take(dest, key)
    _positions(r, "max_position_embeddings")
    r.take("norm_epsilon", norm_key, float)
    r.take("init_method_std", "initializer_range", float)


def _gelu(r: HFReader, key: str, default: str) -> None:
    """The GeLU of config key ``key``: exact, or the tanh approximation (``--openai-gelu``);
    another activation is priced as GeLU (cost only)."""
    act = r.get(key, default)
    if act in TANH_GELUS + ("gelu",):
        r.set("openai_gelu", key, act in TANH_GELUS)
    else:
        r.cost_only(False, key, act, "GeLU")
        r.set("openai_gelu", key, False)


def _learned_layernorm_gelu(r: HFReader, *, positions_key: str, act_key: str,
                            heads_key: str) -> None:
    """The flags a GPT-2 or BERT config implies (each set from the key named): learned
    positions, a GeLU MLP, LayerNorm, biases, one key/value head per head, and the output
    layer tied to the embedding unless ``tie_word_embeddings`` is false."""
    r.set("position_embedding_type", positions_key, "learned")
    r.set("swiglu", act_key, False)
    r.set("normalization", "model_type", "LayerNorm")
    r.set("disable_bias_linear", "model_type", False)
    r.set("group_query_attention", heads_key, False)
    r.set("untie_embeddings_and_output_weights", "tie_word_embeddings",
          not r.get("tie_word_embeddings", True))


def _rope(r: HFReader) -> float:
    """RoPE's base; any scaling variant is refused (only plain rotary embeddings here).
    transformers 5 writes ``rope_parameters``, 4 ``rope_theta`` and ``rope_scaling``."""
    params = r.get("rope_parameters", {}) or {}
    scaling = r.get("rope_scaling", {}) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    key = "rope_parameters.rope_type" if params.get("rope_type") else "rope_scaling.rope_type"
    r.need(kind == "default", key, kind, "rope scaling is not implemented (only unscaled rotary "
           "embeddings); plan the model without it")
    partial = params.get("partial_rotary_factor", r.get("partial_rotary_factor", 1.0))
    r.need(partial == 1.0, "partial_rotary_factor", partial,
           "rotary embeddings on part of each head are not implemented")
    theta = params.get("rope_theta", r.get("rope_theta", 10000.0))
    r.need(isinstance(theta, (int, float)) and not isinstance(theta, bool) and theta > 0,
           "rope_theta", theta, "must be a positive number")
    return float(theta)


def _llama_like(r: HFReader, kind: str) -> None:
    _transformers_shape(r, "rms_norm_eps")
    r.take("attention_dropout", "attention_dropout", float)
    r.set("hidden_dropout", "model_type", 0.0)  # these models have no residual dropout
    act = r.get("hidden_act", "silu")
    r.need(act == "silu", "hidden_act", act, "our SwiGLU gates with SiLU; only silu is modelled")
    heads, hidden = r.get("num_attention_heads"), r.get("hidden_size")
    head_dim = r.get("head_dim")
    if head_dim is not None and heads and hidden:
        r.need(head_dim * heads == hidden, "head_dim", head_dim,
               f"our heads are hidden_size / num_attention_heads = {hidden // heads} wide")
    groups = r.get("num_key_value_heads", heads)
    if groups is not None and groups != heads:
        r.set("group_query_attention", "num_key_value_heads", True)
        r.take("num_query_groups", "num_key_value_heads")
    else:
        r.set("group_query_attention", "num_key_value_heads", False)
    r.set("position_embedding_type", "model_type", "rope")
    r.set("rotary_base", "rope_theta", _rope(r))
    r.set("swiglu", "hidden_act", True)
    r.set("normalization", "model_type", "RMSNorm")
    r.set("untie_embeddings_and_output_weights", "tie_word_embeddings",
          not r.get("tie_word_embeddings", False))
    if kind == "qwen2":  # q, k, v projections with biases, output and MLP without
        r.set("disable_bias_linear", "model_type", True)
        r.set("add_qkv_bias", "model_type", True)
    else:
        attention_bias = bool(r.get("attention_bias", False))
        mlp_bias = bool(r.get("mlp_bias", False))
        r.need(attention_bias == mlp_bias, "mlp_bias", mlp_bias,
               f"--disable-bias-linear drops the biases of all four projections together; "
               f"attention_bias={attention_bias} and mlp_bias must agree")
        r.set("disable_bias_linear", "attention_bias", not attention_bias)
        r.set("add_qkv_bias", "attention_bias", False)
    _sliding_window(r, kind)
    if kind == "mixtral":
        _experts(r)


def _sliding_window(r: HFReader, kind: str) -> None:
    """Sliding-window attention is not modelled; where every layer's window covers the
    sequence the run trains, it changes nothing, so only a longer --seq-length is refused."""
    window = r.get("sliding_window")
    if kind == "qwen2":
        layer_types = r.get("layer_types") or []
        uses = bool(r.get("use_sliding_window", False)) or "sliding_attention" in layer_types
        window = window if uses else None
    if window is None:
        return
    where = r.where

    def check(args: argparse.Namespace) -> None:
        seq = getattr(args, "seq_length", None)
        if seq is not None and seq > window:
            raise HFConfigError(
                f"--hf-config={where}: sliding_window={window}: sliding-window attention is not "
                f"modelled (our layers attend every earlier token), which is the same model "
                f"only up to {window} tokens; give --seq-length {window} or less "
                f"(now {seq})")

    r.checks.append(check)


def _experts(r: HFReader) -> None:
    """Mixtral's mixture of experts on the MoE flags (Megatron's names)."""
    moe = "mixture-of-experts layers"
    experts = r.get("num_local_experts")
    r.need(isinstance(experts, int) and experts > 0, "num_local_experts", experts,
           "must be a positive integer")
    r.set("num_experts", "num_local_experts", experts, feature=moe)
    r.set("moe_router_topk", "num_experts_per_tok", r.get("num_experts_per_tok", 2), feature=moe)
    if r.get("intermediate_size") is not None:
        r.set("moe_ffn_hidden_size", "intermediate_size", r.get("intermediate_size"), feature=moe)
    if r.get("router_aux_loss_coef") is not None:
        r.set("moe_aux_loss_coeff", "router_aux_loss_coef", float(r.get("router_aux_loss_coef")),
              feature=moe)
    jitter = r.get("router_jitter_noise", 0.0)
    r.cost_only(not jitter, "router_jitter_noise", jitter, "routing without input jitter")


def read_encoder(r: HFReader) -> None:
    """A BERT's config -> the ``pretrain_bert.py`` model flags."""
    _transformers_shape(r, "layer_norm_eps")
    r.take("hidden_dropout", "hidden_dropout_prob", float)
    r.take("attention_dropout", "attention_probs_dropout_prob", float)
    _gelu(r, "hidden_act", "gelu")
    kind = r.get("position_embedding_type", "absolute")
    r.need(kind == "absolute", "position_embedding_type", kind,
           "only absolute (learned) positions are modelled")
    types = r.get("type_vocab_size", 2)
    r.cost_only(types == 2, "type_vocab_size", types,
                "2 token types (pretrain_bert.py's sentence pairs)")
    r.need(not r.get("is_decoder", False) and not r.get("add_cross_attention", False),
           "is_decoder", True, "a BERT used as a decoder is not modelled")
    # transformers' BERT normalises after each sublayer and the embeddings; ours (Megatron's,
    # and megatron-bert's) before each sublayer, with a final norm: same cost, other model
    r.cost_only(r.config["model_type"] == "megatron-bert", "model_type", r.config["model_type"],
                "Megatron's pre-LayerNorm BERT (megatron-bert)")
    _learned_layernorm_gelu(r, positions_key="position_embedding_type", act_key="hidden_act",
                            heads_key="num_attention_heads")

