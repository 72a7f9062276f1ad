"""Swin Transformer backbone under any plan: shifted-window attention, patch merging.

Layer ``i`` of the plan is one Swin block (see :mod:`megatron_auto.families.vision.config` for
the stage shapes). A block is pre-norm like the ViT layer, but attention runs inside
non-overlapping ``w x w`` windows of the token grid, with a learned relative position bias per
head, and every odd block of a stage first rolls the grid by ``w // 2`` (shifted windows),
masking the pairs of tokens that the roll brought together from opposite borders (additive
-100, as in the paper).

Patch merging belongs to the first block of every stage after the first (``downsample``), so it
takes that layer's strategy: its layout, data parallelism and recompute. It is small and
replicated over the block's TP group.

Tensor parallelism splits by heads, as for GPT: the fused ``qkv`` projection
(``(heads, 3, head_dim, h)`` rows) is column-parallel, ``proj`` row-parallel, the MLP as in
:class:`~megatron_auto.models.transformer.MLP`, and the relative position bias table
``((2w-1)^2, heads)`` is split along its head dimension, each rank adding only its heads' bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.context import LayerGroups, ParallelContext
from ..parallel.random import TENSOR_PARALLEL, RNGTracker, checkpoint, fork, replicated_dropout
from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..families.vision.config import SwinStageShape, VisionConfig
from .transformer import MLP
from .recompute import whole_layer_only
from .vit import VisionStage, layer_model_config

#: additive attention bias between tokens that only a cyclic shift made neighbours
SHIFT_MASK_VALUE = -100.0


def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """(b, H, W, C) -> (b, num_windows, window*window, C), windows row-major."""
    b, h, w, c = x.shape
    x = x.view(b, h // window, window, w // window, window, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, -1, window * window, c)


def window_reverse(windows: torch.Tensor, window: int, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`window_partition`: (b, num_windows, window*window, C) -> (b, H, W, C)."""
    b, c = windows.shape[0], windows.shape[-1]
    x = windows.view(b, h // window, w // window, window, window, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)


def relative_position_index(window: int) -> torch.Tensor:
    """(N, N) index into the ``(2w-1)^2`` bias table for every pair of tokens of a window."""
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window),
                                        indexing="ij")).flatten(1)  # (2, N)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)  # (N, N, 2)
    return rel[..., 0] * (2 * window - 1) + rel[..., 1]


def shifted_window_mask(h: int, w: int, window: int, shift: int) -> torch.Tensor:
    """(num_windows, N, N) additive mask of a grid rolled by ``-shift``; zeros when unshifted."""
    n = window * window
    if shift == 0:
        return torch.zeros((h // window) * (w // window), n, n)
    region = torch.zeros(1, h, w, 1)
    bands = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    label = 0
    for rows in bands:
        for cols in bands:
            region[:, rows, cols, :] = label
            label += 1
    ids = window_partition(region, window).squeeze(-1)[0]  # (num_windows, N)
    different = ids[:, None, :] != ids[:, :, None]
    return torch.zeros(different.shape).masked_fill(different, SHIFT_MASK_VALUE)


class WindowAttention(nn.Module):
    """Multi-head attention inside windows with a relative position bias; this rank's heads."""

    def __init__(self, shape: SwinStageShape, shift: int, groups: LayerGroups,
                 rng: RNGTracker | None, attention_dropout: float) -> None:
        super().__init__()
        h, w = shape.hidden_size, shape.window
        self.num_local_heads = shape.num_heads // groups.tp_size
        self.head_dim = h // shape.num_heads
        self.linear_qkv = ColumnParallelLinear(h, 3 * h, groups)
        self.linear_proj = RowParallelLinear(h, h, groups, input_is_parallel=True)
        self.relative_position_bias_table = nn.Parameter(
            torch.empty((2 * w - 1) ** 2, self.num_local_heads))
        self.tp_group, self.tp_size, self.tp_rank = groups.tp_group, groups.tp_size, groups.tp_rank
        self.tp_shard_dims = {"relative_position_bias_table": 1}  # split by heads
        self.register_buffer("relative_position_index", relative_position_index(w),
                             persistent=False)
        self.shifted = shift > 0
        self.register_buffer("shift_mask", shifted_window_mask(shape.grid_h, shape.grid_w, w,
                                                               shift), persistent=False)
        self.attention_dropout = attention_dropout
        self.rng = rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, num_windows, N, h) replicated on TP -> (b, num_windows, N, h)."""
        b, nw, n, _ = x.shape
        qkv = self.linear_qkv(x).view(b, nw, n, self.num_local_heads, 3, self.head_dim)
        q, k, v = qkv.permute(4, 0, 1, 3, 2, 5).unbind(0)  # each (b, nW, heads, N, d)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        mask = bias.view(n, n, -1).permute(2, 0, 1)  # (heads, N, N)
        if self.shifted:
            mask = mask + self.shift_mask[:, None]  # (nW, heads, N, N)
        mask = mask.to(q.dtype)
        p = self.attention_dropout if self.training else 0.0
        with fork(self.rng, TENSOR_PARALLEL, draws=p > 0.0):  # this rank's heads: own stream
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        out = out.transpose(2, 3).reshape(b, nw, n, self.num_local_heads * self.head_dim)
        return self.linear_proj(out)


class PatchMerging(nn.Module):
    """(b, H*W, C) -> (b, H/2*W/2, 2C): concatenate 2x2 neighbours, norm, project (no bias)."""

    def __init__(self, in_hidden: int, grid_h: int, grid_w: int, eps: float) -> None:
        super().__init__()
        self.grid_h, self.grid_w = grid_h, grid_w
        self.norm = nn.LayerNorm(4 * in_hidden, eps=eps)
        self.reduction = nn.Linear(4 * in_hidden, 2 * in_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, c = x.shape
        x = x.view(b, self.grid_h, self.grid_w, c)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]],
                      dim=-1)  # (b, H/2, W/2, 4C)
        return self.reduction(self.norm(x.view(b, -1, 4 * c)))


class SwinBlock(nn.Module):
    """One Swin block on one layout; input and output (b/dp, tokens, h) replicated on TP."""

    def __init__(self, config: VisionConfig, shape: SwinStageShape, index_in_stage: int,
                 groups: LayerGroups, *, rng: RNGTracker | None = None, merge: bool = False,
                 recompute: bool = False) -> None:
        super().__init__()
        h = shape.hidden_size
        ffn = config.swin_mlp_ratio * h
        layer_config = layer_model_config(config, h, shape.num_heads, ffn, shape.seq_length)
        layer_config.check_tensor_parallel(groups.tp_size, what=f"layer tp (Swin stage "
                                           f"{shape.index + 1})")
        self.downsample = (PatchMerging(h // 2, 2 * shape.grid_h, 2 * shape.grid_w,
                                        config.layernorm_epsilon) if merge else None)
        self.input_layernorm = nn.LayerNorm(h, eps=config.layernorm_epsilon)
        self.shift = shape.shift if index_in_stage % 2 == 1 else 0
        self.self_attention = WindowAttention(shape, self.shift, groups, rng,
                                              config.attention_dropout)
        self.pre_mlp_layernorm = nn.LayerNorm(h, eps=config.layernorm_epsilon)
        self.mlp = MLP(layer_config, groups)
        self.grid = (shape.grid_h, shape.grid_w)
        self.window = shape.window
        self.hidden_dropout = config.hidden_dropout
        self.recompute = whole_layer_only(recompute, "Swin")
        self.rng = rng

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return replicated_dropout(x, self.hidden_dropout, self.rng, self.training)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, _, c = x.shape
        gh, gw = self.grid
        y = x.view(b, gh, gw, c)
        if self.shift:
            y = torch.roll(y, shifts=(-self.shift, -self.shift), dims=(1, 2))
        y = self.self_attention(window_partition(y, self.window))
        y = window_reverse(y, self.window, gh, gw)
        if self.shift:
            y = torch.roll(y, shifts=(self.shift, self.shift), dims=(1, 2))
        return y.reshape(b, gh * gw, c)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.downsample is not None:
            x = self.downsample(x)
        x = x + self._dropout(self._attention(self.input_layernorm(x)))
        return x + self._dropout(self.mlp(self.pre_mlp_layernorm(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b/dp, tokens_in, h_in) -> (b/dp, tokens, h); tokens_in = 4 tokens with merging."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, self.rng, x)
        return self._forward(x)


class SwinStage(VisionStage):
    """One pipeline stage of a Swin classifier (see the module docstring)."""

    def __init__(self, config: VisionConfig, ctx: ParallelContext, *, seed: int = 1234) -> None:
        if config.model_type != "swin":
            raise ValueError(f"SwinStage needs model_type='swin', got {config.model_type!r}; "
                             f"use ViTStage for ViT backbones")
        super().__init__(config, ctx, seed=seed)

    def build_layer(self, index: int, groups: LayerGroups, recompute: bool) -> nn.Module:
        cfg = self.config
        shape = cfg.swin_stage_of_layer(index)
        return SwinBlock(cfg, shape, index - shape.first_layer, groups, rng=self.rng,
                         merge=cfg.has_patch_merging(index), recompute=recompute)
