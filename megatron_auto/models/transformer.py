"""One pre-LayerNorm transformer layer, tensor-parallel over the TP group of its own layout.

``x + Dropout(Attention(Norm(x)))`` then ``h + Dropout(MLP(Norm(h)))``. Attention uses one fused
QKV column-parallel projection (this rank's heads), ``F.scaled_dot_product_attention`` over all
local heads at once, and a row-parallel output projection. The MLP is column-parallel fc1
(GELU, or SwiGLU) and row-parallel fc2. Normalisation (LayerNorm/RMSNorm), activation and rotary
position embeddings follow :class:`~megatron_auto.config.ModelConfig`.

Global weight layouts (what the plan-independent init and checkpoints see) are chosen so that
every TP shard is a contiguous chunk of dim 0 for any TP degree dividing the key/value group
count ``g`` (``num_query_groups``; ``g = heads`` without grouped-query attention):
``linear_qkv.weight`` is ``(g, heads/g + 2, head_dim, h)`` flattened to ``(h + 2 g d, h)``: per
group its ``heads/g`` query heads, then its key head, then its value head (Megatron's order;
with ``g = heads`` that is q, k, v of head 0, then of head 1, ...); query head ``j`` uses the
key/value head of group ``j // (heads/g)``. The SwiGLU ``linear_fc1.weight`` interleaves rows as
``(gate_0, up_0, gate_1, up_1, ...)``, i.e. ``(f, 2, h)`` flattened to ``(2f, h)``.
``add_bias_linear=False`` (``--disable-bias-linear``) drops the four projections' biases
(``add_qkv_bias``, ``--add-qkv-bias``, keeps the QKV projection's);
``openai_gelu`` uses GeLU's tanh approximation.

Recompute (``recompute=True``): the layer keeps only its inputs and re-runs its forward in
backward (``torch.utils.checkpoint``, non-reentrant), replaying the TP-aware dropout streams.
``recompute="selective"`` or a module list (``core_attn``, ``mlp``, ``norm``) re-runs only those
modules (models/recompute.py). ``offload`` (``True`` or a module list) keeps the layer's (or those
modules') saved activations in host memory until backward (parallel/offload.py).

Sequence parallelism (``sequence_parallel=True``, Megatron-SP, tp > 1): the layer's input and
output, its norms, hidden dropouts and residual adds are this TP rank's sequence chunk
``(b/dp, s/tp, h)``; the QKV / fc1 projections all-gather the sequence (reduce-scatter in
backward) and the output projections reduce-scatter it (all-gather in backward). The norm
weights (and the row-parallel biases) then see only this rank's positions, so their gradients
are summed over the TP group (``copy_to_tensor_parallel`` on the weights: identity forward,
all-reduce of the gradient). Hidden dropout draws the mask of the whole ``(b/dp, s, h)``
activation from the replicated stream, exactly as the layer without SP does, and keeps this
rank's positions: SP changes no mask, so SP and non-SP layers of one layout train the same
numbers with dropout on too, and the stream stays in step with the rest of the stage.

Context parallelism (the layout's ``cp`` > 1): the layer's input is this CP rank's two sequence
chunks ``(b/dp, s/cp, h)``; everything but core attention is per token and runs unchanged, core
attention is ring attention or Ulysses over the CP group (``cp_mode``, models/cp_attention.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.context import LayerGroups
from ..parallel.mappings import copy_to_tensor_parallel
from ..parallel.random import (REPLICATED, TENSOR_PARALLEL, RNGTracker, checkpoint, fork,
                               replicated_dropout)
from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..plan_recompute import RecomputeValue
from ..plan_offload import OffloadValue
from .cp_attention import ring_attention, ulysses_attention
from .recompute import LayerLevers, split_offload, split_recompute

Rotary = Optional[tuple[torch.Tensor, torch.Tensor]]


def apex_norm(config: ModelConfig) -> nn.Module | None:
    """apex's fused norm (``FusedLayerNorm`` / ``FusedRMSNorm(normalized_shape, eps)``, CUDA
    kernels, the same ``weight`` / ``bias`` parameters and math as torch's), or None when apex
    does not import."""
    try:
        from apex.normalization import FusedLayerNorm, FusedRMSNorm  # noqa: PLC0415 - optional
    except Exception:  # noqa: BLE001 - apex fails to import in many ways (absent, ABI, CUDA)
        return None
    kind = FusedRMSNorm if config.normalization == "rmsnorm" else FusedLayerNorm
    norm = kind(config.hidden_size, eps=config.layernorm_epsilon)
    norm.is_norm = True  # models/init.py: a norm's weight starts at 1
    return norm


def make_norm(config: ModelConfig, *, fused: bool = False) -> nn.Module:
    """LayerNorm or RMSNorm over the hidden size (replicated on every TP rank); with ``fused``
    apex's kernel when apex imports (CUDA layers), else torch's."""
    if fused:
        norm = apex_norm(config)
        if norm is not None:
            return norm
    if config.normalization == "rmsnorm":
        return nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embeddings (non-persistent buffers, recomputable)."""

    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # (max_pos, head_dim)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def tables(self, seq_length: int, position_ids: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of shape (s, d), or (b, 1, s, d) for explicit ``position_ids`` (b, s)."""
        if position_ids is None:
            return self.cos[:seq_length], self.sin[:seq_length]
        return self.cos[position_ids].unsqueeze(1), self.sin[position_ids].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (b, heads, s, d) by the position angles (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class SelfAttention(nn.Module):
    """Multi-head (or grouped-query) self-attention over this rank's ``heads/tp`` query heads
    and ``num_query_groups/tp`` key/value heads."""

    def __init__(self, config: ModelConfig, groups: LayerGroups, rng: RNGTracker | None, *,
                 causal: bool, sequence_parallel: bool = False, cp_mode: str = "ring") -> None:
        super().__init__()
        h, bias = config.hidden_size, config.add_bias_linear
        self.linear_qkv = ColumnParallelLinear(h, h + 2 * config.kv_size, groups,
                                               bias=config.qkv_bias,
                                               sequence_parallel=sequence_parallel)
        self.linear_proj = RowParallelLinear(h, h, groups, bias=bias, input_is_parallel=True,
                                             sequence_parallel=sequence_parallel)
        self.num_local_heads = config.num_attention_heads // groups.tp_size
        self.num_local_groups = config.query_groups // groups.tp_size
        self.heads_per_group = config.num_attention_heads // config.query_groups
        self.head_dim = config.head_dim
        self.attention_dropout = config.attention_dropout
        self.causal = causal
        self.rng = rng
        self.levers = LayerLevers()  # the layer's recompute/offload choices (set by the layer)
        self.groups = groups
        self.cp_mode = cp_mode

    def _context_parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          keep: torch.Tensor | None, p: float) -> torch.Tensor:
        """Core attention over the CP group (models/cp_attention.py); ``keep`` the (b, s) key
        keep mask of the whole sequence or None."""
        g = self.groups
        if self.cp_mode == "ulysses":
            if p > 0.0 and self.rng is not None:
                with self.rng.fork(TENSOR_PARALLEL):
                    return ulysses_attention(q, k, v, keep, causal=self.causal,
                                             group=g.cp_group, cp=g.cp_size, dropout_p=p)
            return ulysses_attention(q, k, v, keep, causal=self.causal, group=g.cp_group,
                                     cp=g.cp_size, dropout_p=p)
        if p > 0.0:  # the plan refuses it (Plan.check_model); a direct caller gets this
            raise ValueError(f"ring attention runs without attention dropout, got {p}; set "
                             f"--attention-dropout 0 or use cp_mode ulysses")
        return ring_attention(q, k, v, keep, causal=self.causal, cp_ranks=g.cp_ranks,
                              cp_rank=g.cp_rank)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       attn_mask: torch.Tensor | None) -> torch.Tensor:
        """Scores, softmax, attention dropout and the weighted sum: (b, heads, s, d). Under
        context parallelism over the CP group (``attn_mask`` then the (b, s) key keep mask)."""
        p = self.attention_dropout if self.training else 0.0
        if self.groups.cp_size > 1:
            return self._context_parallel(q, k, v, attn_mask, p)
        is_causal = self.causal and attn_mask is None
        kwargs = {"enable_gqa": True} if self.heads_per_group > 1 else {}
        with fork(self.rng, TENSOR_PARALLEL, draws=p > 0.0):  # this rank's heads: own stream
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p,
                                                  is_causal=is_causal, **kwargs)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                rotary: Rotary = None) -> torch.Tensor:
        qkv = self.linear_qkv(x)  # (b, s, (h + 2 g d)/tp); the whole sequence also under SP
        b, s = qkv.shape[:2]
        n = self.heads_per_group
        qkv = qkv.view(b, s, self.num_local_groups, n + 2, self.head_dim)
        if n == 1:  # multi-head attention: one query head per key/value head
            q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (b, heads, s, d)
        else:
            q = qkv[:, :, :, :n].flatten(2, 3).transpose(1, 2)  # (b, heads, s, d), group-major
            k = qkv[:, :, :, n].transpose(1, 2)  # (b, groups, s, d)
            v = qkv[:, :, :, n + 1].transpose(1, 2)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        out = self.levers.run("core_attn", self.core_attention, q, k, v, attn_mask)
        out = out.transpose(1, 2).reshape(b, s, self.num_local_heads * self.head_dim)
        return self.linear_proj(out)  # (b, s, h) summed over the TP group; SP: (b, s/tp, h)


class MLP(nn.Module):
    """``fc2(act(fc1(x)))`` with fc1 column-parallel and fc2 row-parallel; ``ffn_hidden_size``
    overrides the config's width (an MoE layer's shared experts)."""

    def __init__(self, config: ModelConfig, groups: LayerGroups, *,
                 sequence_parallel: bool = False, ffn_hidden_size: int | None = None) -> None:
        super().__init__()
        h, bias = config.hidden_size, config.add_bias_linear
        f = ffn_hidden_size or config.ffn_hidden_size
        self.swiglu = config.activation == "swiglu"
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        self.linear_fc1 = ColumnParallelLinear(h, 2 * f if self.swiglu else f, groups, bias=bias,
                                               sequence_parallel=sequence_parallel)
        self.linear_fc2 = RowParallelLinear(f, h, groups, bias=bias, input_is_parallel=True,
                                            sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.swiglu:
            y = y.unflatten(-1, (-1, 2))  # (b, s, f/tp, 2): rows interleave (gate, up)
            y = F.silu(y[..., 0]) * y[..., 1]
        else:
            y = F.gelu(y, approximate=self.gelu_approximate)
        return self.linear_fc2(y)


class TransformerLayer(nn.Module):
    """A pre-norm transformer layer on one layout; input and output (b/dp, s, h) replicated on
    TP, or with ``sequence_parallel`` this TP rank's sequence chunk (b/dp, s/tp, h)."""

    def __init__(self, config: ModelConfig, groups: LayerGroups, *, rng: RNGTracker | None = None,
                 causal: bool = True, recompute: RecomputeValue = False,
                 sequence_parallel: bool = False, fused_norm: bool = False,
                 mlp: nn.Module | None = None, cp_mode: str = "ring",
                 offload: OffloadValue = False) -> None:
        super().__init__()
        config.check_tensor_parallel(groups.tp_size, what="layer tp")
        if sequence_parallel and (groups.tp_size == 1 or config.seq_length % groups.tp_size):
            raise ValueError(f"sequence_parallel=True: needs tp > 1 dividing --seq-length="
                             f"{config.seq_length} (tp={groups.tp_size}); change tp or turn SP off")
        self.sequence_parallel = sequence_parallel
        self.normalization = config.normalization
        self.input_layernorm = make_norm(config, fused=fused_norm)
        self.self_attention = SelfAttention(config, groups, rng, causal=causal,
                                            sequence_parallel=sequence_parallel, cp_mode=cp_mode)
        self.pre_mlp_layernorm = make_norm(config, fused=fused_norm)
        # ``mlp``: another block in the MLP's place (an MoE layer's, models/moe.py)
        self.mlp = mlp if mlp is not None else MLP(config, groups,
                                                   sequence_parallel=sequence_parallel)
        self.hidden_dropout = config.hidden_dropout
        # recompute: the whole layer; recompute_modules: single modules (models/recompute.py)
        self.recompute, self.recompute_modules = split_recompute(recompute)
        if mlp is not None and "mlp" in self.recompute_modules:
            # an MoE block's recompute (its router statistics, the "experts" module) is not
            # wired and priced yet: refused rather than run unpriced
            raise ValueError(f"plan field recompute={recompute!r}: 'mlp' on an MoE layer is not "
                             f"supported yet; use core_attn/norm, or true for the whole layer")
        # offload_all: every saved activation of the layer; else the named modules'
        self.offload_all, offload_modules = split_offload(offload)
        if self.offload_all and self.recompute:
            raise ValueError("plan field offload=true: the layer recomputes in full and keeps "
                             "only its input; set offload or recompute to false")
        if mlp is not None and "mlp" in offload_modules:
            raise ValueError("plan field offload=['mlp']: an MoE layer's expert block is "
                             "offloaded with the whole layer only; use true, or core_attn/norm")
        self.levers = LayerLevers(self.recompute_modules, offload_modules, rng)
        self.self_attention.levers = self.levers
        self.rng = rng
        self.groups = groups

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return replicated_dropout(x, self.hidden_dropout, self.rng, self.training)
        if not self.training or self.hidden_dropout == 0.0:
            return x
        # SP: the whole activation's mask (same draws as without SP), this rank's positions
        tp, local = self.groups.tp_size, x.shape[1]
        full = (x.shape[0], local * tp) + tuple(x.shape[2:])
        with fork(self.rng, REPLICATED):
            drawn = F.dropout(torch.ones(full, dtype=x.dtype, device=x.device),
                              self.hidden_dropout, training=True)
        keep = drawn.narrow(1, self.groups.tp_rank * local, local) != 0  # bool: 1 B saved
        del drawn
        return x * keep * (1.0 / (1.0 - self.hidden_dropout))

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return norm(x)
        # this rank's positions only: the weight gradients are summed over the TP group
        group = self.groups.tp_group
        weight = copy_to_tensor_parallel(norm.weight, group)
        if self.normalization == "layernorm":  # torch's or apex's norm: same parameters
            bias = getattr(norm, "bias", None)
            bias = None if bias is None else copy_to_tensor_parallel(bias, group)
            return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)
        return F.rms_norm(x, norm.normalized_shape, weight, norm.eps)

    def _forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None,
                 rotary: Rotary) -> torch.Tensor:
        run = self.levers.run
        normed = run("norm", self._norm, self.input_layernorm, x)
        x = x + self._dropout(self.self_attention(normed, attn_mask, rotary))
        normed = run("norm", self._norm, self.pre_mlp_layernorm, x)
        return x + self._dropout(run("mlp", self.mlp, normed))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                rotary: Rotary = None) -> torch.Tensor:
        """``x`` (b/dp, s, h), or (b/dp, s/tp, h) with SP; ``attn_mask`` bool, True = attend,
        broadcastable to (b/dp, heads, s, s) (None: causal or full); ``rotary`` (cos, sin)
        tables or None. Under context parallelism (``groups.cp_size`` > 1) ``s`` is this CP
        rank's two chunks (``s/cp`` tokens) and ``attn_mask`` the (b/dp, s) key keep mask of the
        whole sequence (``models/cp_attention.py``)."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, self.rng, x, attn_mask, rotary)
        if self.offload_all and torch.is_grad_enabled():
            with self.levers.offloader(x.device):
                return self._forward(x, attn_mask, rotary)
        return self._forward(x, attn_mask, rotary)
