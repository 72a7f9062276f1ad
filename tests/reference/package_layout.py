"""The bridge between the reference's weights and the package's documented global layouts.

Written from the layout megatron_auto documents (models/transformer.py's module docstring), not
from its code, and importing nothing of it: ``config`` is any object with ``ModelConfig``'s
fields. The package's fused QKV projection holds, per key/value group, that group's query heads,
then its key head, then its value head; SwiGLU's first MLP projection interleaves its rows as
``(gate_0, up_0, gate_1, up_1, ...)``. Everything else is a rename.
"""

from __future__ import annotations

from typing import Any

import torch

from .models import RefConfig

_HEADS = {"pos_embed": "embedding.position_embeddings.weight",
          "type_embed": "embedding.tokentype_embeddings.weight", "head": "output_layer.weight",
          "mlm_w": "lm_head.dense.weight", "mlm_b": "lm_head.dense.bias",
          "mlm_out_b": "lm_head.bias", "pool_w": "pooler.weight", "pool_b": "pooler.bias",
          "sop_w": "binary_head.weight", "sop_b": "binary_head.bias",
          "tok_embed": "embedding.word_embeddings.weight"}


def ref_config(config: Any) -> RefConfig:
    """The reference model of a package ``ModelConfig`` (embedding rows: the padded vocabulary)."""
    bert = config.model_type == "bert"
    return RefConfig(
        vocab_size=config.padded_vocab_size, hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads, num_kv_heads=config.query_groups,
        ffn_size=config.ffn_hidden_size, num_layers=config.num_layers,
        seq_length=config.seq_length, positions=config.position_embedding_type,
        rope_base=config.rotary_base, norm=config.normalization,
        norm_eps=config.layernorm_epsilon,
        activation=("swiglu" if config.activation == "swiglu"
                    else "gelu_tanh" if config.openai_gelu else "gelu"),
        bias=config.add_bias_linear, tied_head=not config.untie_embeddings_and_output_weights,
        causal=not bert, num_token_types=config.num_tokentypes,
        sentence_order_head=bert and config.bert_binary_head)


def _renames(num_layers: int) -> dict[str, str]:
    names = dict(_HEADS)
    norms = {"norm_f": "final_norm", "mlm_norm": "lm_head.norm"}
    for i in range(num_layers):
        a, m = f"blocks.{i}.attn.", f"blocks.{i}.mlp."
        attn, mlp = f"layers.{i}.self_attention.", f"layers.{i}.mlp."
        norms[f"blocks.{i}.norm1"] = f"layers.{i}.input_layernorm"
        norms[f"blocks.{i}.norm2"] = f"layers.{i}.pre_mlp_layernorm"
        names.update({a + "wo": attn + "linear_proj.weight", a + "bo": attn + "linear_proj.bias",
                      m + "w_in": mlp + "linear_fc1.weight", m + "b_in": mlp + "linear_fc1.bias",
                      m + "w_out": mlp + "linear_fc2.weight",
                      m + "b_out": mlp + "linear_fc2.bias"})
    for src, dst in norms.items():
        names[src + ".weight"], names[src + ".bias"] = dst + ".weight", dst + ".bias"
    return names


def to_package(ref: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The reference's weights under the package's FQNs and global layouts."""
    g, out = config.query_groups, {}
    for src, dst in _renames(config.num_layers).items():
        if src in ref:
            out[dst] = ref[src]
    for i in range(config.num_layers):
        a, m = f"blocks.{i}.attn.", f"blocks.{i}.mlp."
        attn, mlp = f"layers.{i}.self_attention.", f"layers.{i}.mlp."
        for kind, p in (("weight", "w"), ("bias", "b")):
            if a + p + "q" in ref:  # per group: its query heads, its key head, its value head
                per = [ref[a + p + c].unflatten(0, (g, -1)) for c in "qkv"]
                out[attn + f"linear_qkv.{kind}"] = torch.cat(per, dim=1).flatten(0, 1)
            if m + p + "_gate" in ref:  # SwiGLU: rows (gate_0, up_0, gate_1, up_1, ...)
                out[mlp + f"linear_fc1.{kind}"] = torch.stack(
                    [ref[m + p + "_gate"], ref[m + p + "_up"]], dim=1).flatten(0, 1)
    return out


def from_package(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_package`: the package's full tensors under the reference's names."""
    g, d, out = config.query_groups, config.hidden_size // config.num_attention_heads, {}
    n = config.num_attention_heads // g  # query heads per group
    for src, dst in _renames(config.num_layers).items():
        if dst in state and not (config.activation == "swiglu" and "linear_fc1" in dst):
            out[src] = state[dst]
    for i in range(config.num_layers):
        a, m = f"blocks.{i}.attn.", f"blocks.{i}.mlp."
        attn, mlp = f"layers.{i}.self_attention.", f"layers.{i}.mlp."
        for kind, p in (("weight", "w"), ("bias", "b")):
            fused = state.get(attn + f"linear_qkv.{kind}")
            if fused is not None:
                per = fused.unflatten(0, (g, (n + 2) * d))
                q, k, v = per.split([n * d, d, d], dim=1)
                out[a + p + "q"], out[a + p + "k"], out[a + p + "v"] = (
                    t.flatten(0, 1) for t in (q, k, v))
            fc1 = state.get(mlp + f"linear_fc1.{kind}")
            if fc1 is not None and config.activation == "swiglu":
                pairs = fc1.unflatten(0, (-1, 2))
                out[m + p + "_gate"], out[m + p + "_up"] = pairs[:, 0], pairs[:, 1]
    return out
