"""Hugging Face T5 configs (``model_type: t5``) as ``pretrain_t5.py``'s flags (``--hf-config``).

T5's layers normalise with RMSNorm (``T5LayerNorm``), have no biases, tie the head to the word
embeddings (v1; v1.1 unties it, which our T5 does not) and use relative position buckets. Its
MLP is ReLU (v1), gated GeLU (v1.1, Flan) or gated SiLU: the gated SiLU is our SwiGLU; ReLU and
gated GeLU cost what GeLU and SwiGLU cost, so the planning commands price them as those (one
warning) and ``pretrain_t5.py`` refuses them.
"""

from __future__ import annotations

from ..hf_reader import HFReader

MODEL_TYPES = ("t5",)


def read_t5(r: HFReader) -> None:
    for dest, key in (("hidden_size", "d_model"), ("num_attention_heads", "num_heads"),
                      ("kv_channels", "d_kv"), ("ffn_hidden_size", "d_ff"),
                      ("encoder_num_layers", "num_layers"), ("vocab_size", "vocab_size"),
                      ("relative_attention_num_buckets", "relative_attention_num_buckets"),
                      ("relative_attention_max_distance", "relative_attention_max_distance")):
        r.take(dest, key)
    if r.get("num_decoder_layers") is not None:
        r.take("decoder_num_layers", "num_decoder_layers")
    elif "encoder_num_layers" in r.values:  # transformers' default: as many as the encoder
        r.set("decoder_num_layers", "num_layers", r.values["encoder_num_layers"])
    r.take("norm_epsilon", "layer_norm_epsilon", float)
    r.take("hidden_dropout", "dropout_rate", float)
    r.take("attention_dropout", "dropout_rate", float)
    proj = r.get("feed_forward_proj", "relu")
    gated = proj.startswith("gated-")
    act = proj[len("gated-"):] if gated else proj
    if gated:
        r.cost_only(act == "silu", "feed_forward_proj", proj, "SwiGLU (a gated SiLU MLP)")
    else:
        r.cost_only(act == "gelu", "feed_forward_proj", proj, "a GeLU MLP")
    r.need(act in ("relu", "gelu", "gelu_new", "silu"), "feed_forward_proj", proj,
           "only relu, gelu, gated-gelu and gated-silu MLPs are known")
    r.set("swiglu", "feed_forward_proj", gated)
    r.need(bool(r.get("tie_word_embeddings", True)), "tie_word_embeddings", False,
           "our T5 ties its LM head to the word embeddings (T5 v1's, Megatron-LM's); an untied "
           "head is another vocab x hidden matrix of weights")
    r.set("position_embedding_type", "model_type", "relative")
    r.set("normalization", "model_type", "RMSNorm")
    r.set("disable_bias_linear", "model_type", True)
