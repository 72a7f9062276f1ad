"""Attention's sequence-length terms of a layer profile (docs/cost_model.md §11).

Context parallelism runs a layer's attention on shorter chunks than the layer's sequence
(ring: ``s/cp`` queries against ``s/cp`` keys per step), so a profile records the core
attention's forward time at several lengths (``LayerTypeProfile.attention_time_by_seq_length``).
Here: the FLOP count both the analytic profile and the default share use, and the analytic
table (the documented default for profiles without one is ``profiles.fill_attention_defaults``).
Pure arithmetic on shapes.
"""

from __future__ import annotations

from ..cost import gpu_terms
from .model_spec import LayerType


def cross_attention_flops(lt: LayerType, backend: str = "math") -> float:
    """Forward FLOPs per sample of a layer's cross-attention (T5 decoder, 0 without): query and
    output projections on its ``s`` tokens, key/value projections on the ``m`` encoder tokens,
    scores and weighted sum over ``s x m``."""
    m = lt.cross_attention_seq_length
    if not m:
        return 0.0
    s, h, p = lt.seq_length, lt.hidden_size, lt.attention_width
    return 2 * s * 2 * h * p + 2 * m * 2 * h * p + gpu_terms.attention_score_flops(
        s, m, p, False, backend)


def layer_core_flops(lt: LayerType, backend: str = "math") -> float:
    """Forward FLOPs per sample of a layer's projections, MLP and self-attention (2 FLOPs per
    multiply-add): Q + output projection (2hp, p = heads x head_dim: h unless kv_channels says
    otherwise), K and V (2h*kv), MLP (2 or 3 h*f), attention scores and the weighted sum
    (2 * s * k * p each)."""
    s, h, f, p = lt.seq_length, lt.hidden_size, lt.ffn_hidden_size, lt.attention_width
    mlp_mats = 3 if lt.activation == "swiglu" else 2
    return 2 * s * (2 * h * p + 2 * h * lt.kv_size + mlp_mats * h * f) + \
        gpu_terms.attention_score_flops(s, lt.attended_tokens, p, lt.causal, backend)


# Sequence lengths of an analytic profile's attention times: the layer's and its halvings (the
# chunk lengths context parallelism runs attention on), down to 1/64 of it.
ATTENTION_LENGTH_HALVINGS = 6


def attention_times(lt: LayerType, backend: str, rate: float) -> dict[int, float]:
    """Core-attention forward seconds per sample at the layer's sequence length and its
    halvings: the score matmuls' FLOPs at the sustained rate (quadratic in the length; windowed
    attention: linear, each token attends its window)."""
    out = {}
    length = lt.seq_length
    for _ in range(ATTENTION_LENGTH_HALVINGS + 1):
        k = lt.window_size ** 2 if lt.window_size else length
        out[length] = gpu_terms.attention_score_flops(length, k, lt.attention_width, lt.causal,
                                                      backend) / rate
        if length % 2:
            break
        length //= 2
    return out
