"""Plain PyTorch ViT and Swin classifiers: the same math as ours, none of our machinery.

Baselines for ``bench_models.py`` and an independent cross-check for the tests (they load our
parameters by name, so the two must compute the same loss and gradients). Written the way a
single-GPU user would: ``nn.Linear``, ``nn.LayerNorm``, explicit window bookkeeping; the Swin
attention spells out ``softmax(q k^T / sqrt(d) + bias + mask) v``.

The fused QKV rows follow our global layout ``(heads, 3, head_dim)``, so the names and shapes of
every parameter match ours exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plain_t5 import Mlp  # the same two-layer GELU MLP (and parameter names)


class Attention(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.linear_qkv = nn.Linear(h, 3 * h)
        self.linear_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.linear_qkv(x).view(b, s, self.heads, 3, h // self.heads).permute(
            3, 0, 2, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, h))


class EncoderLayer(nn.Module):
    def __init__(self, h: int, heads: int, ffn: int, eps: float) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(h, eps=eps)
        self.self_attention = Attention(h, heads)
        self.pre_mlp_layernorm = nn.LayerNorm(h, eps=eps)
        self.mlp = Mlp(h, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Embedding(nn.Module):
    def __init__(self, cfg, vit: bool) -> None:
        super().__init__()
        h = cfg.embedding_hidden_size
        self.p = cfg.patch_dim
        self.proj = nn.Linear(cfg.num_channels * self.p * self.p, h)
        if vit:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, h))
            self.position_embeddings = nn.Parameter(torch.zeros(cfg.seq_length, h))
        else:
            self.norm = nn.LayerNorm(h, eps=cfg.layernorm_epsilon)
        self.vit = vit

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # unfold = the patches of a stride-p convolution, each flattened as (C, p, p)
        x = self.proj(F.unfold(images, self.p, stride=self.p).transpose(1, 2))
        if self.vit:
            x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1)
            return x + self.position_embeddings
        return self.norm(x)


class Head(nn.Module):
    def __init__(self, h: int, classes: int, eps: float, cls_pool: bool) -> None:
        super().__init__()
        self.final_norm = nn.LayerNorm(h, eps=eps)
        self.output_layer = nn.Linear(h, classes)
        self.cls_pool = cls_pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.final_norm(x)
        return self.output_layer(x[:, 0] if self.cls_pool else x.mean(1))


class PlainViT(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.embedding = Embedding(cfg, vit=True)
        self.layers = nn.ModuleList(
            EncoderLayer(cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size,
                         cfg.layernorm_epsilon) for _ in range(cfg.num_layers))
        self.head = Head(cfg.hidden_size, cfg.num_classes, cfg.layernorm_epsilon, True)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embedding(images)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# ---------------------------------------------------------------------------------- Swin
class WindowAttention(nn.Module):
    def __init__(self, h: int, heads: int, window: int) -> None:
        super().__init__()
        self.heads, self.window = heads, window
        self.linear_qkv = nn.Linear(h, 3 * h)
        self.linear_proj = nn.Linear(h, h)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, heads))
        ys, xs = torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")
        ys, xs = ys.flatten(), xs.flatten()
        dy = ys[:, None] - ys[None, :] + window - 1
        dx = xs[:, None] - xs[None, :] + window - 1
        self.register_buffer("index", dy * (2 * window - 1) + dx, persistent=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        bw, n, h = x.shape  # (batch * windows, tokens, width)
        d = h // self.heads
        q, k, v = self.linear_qkv(x).view(bw, n, self.heads, 3, d).permute(3, 0, 2, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * d ** -0.5
        scores = scores + self.relative_position_bias_table[self.index].permute(2, 0, 1)
        if mask is not None:
            nw = mask.shape[0]
            scores = (scores.view(bw // nw, nw, self.heads, n, n) + mask[None, :, None]
                      ).view(bw, self.heads, n, n)
        out = scores.softmax(-1) @ v
        return self.linear_proj(out.transpose(1, 2).reshape(bw, n, h))


class Merge(nn.Module):
    def __init__(self, c: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * c, eps=eps)
        self.reduction = nn.Linear(4 * c, 2 * c, bias=False)

    def forward(self, x: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
        b, _, c = x.shape
        x = x.view(b, gh, gw, c)
        parts = [x[:, r::2, s::2] for s in (0, 1) for r in (0, 1)]  # (0,0) (1,0) (0,1) (1,1)
        return self.reduction(self.norm(torch.cat(parts, -1).view(b, -1, 4 * c)))


class Block(nn.Module):
    def __init__(self, h, heads, ffn, gh, gw, window, shift, merge, eps) -> None:
        super().__init__()
        self.gh, self.gw, self.window, self.shift = gh, gw, window, shift
        if merge:
            self.downsample = Merge(h // 2, eps)
        self.input_layernorm = nn.LayerNorm(h, eps=eps)
        self.self_attention = WindowAttention(h, heads, window)
        self.pre_mlp_layernorm = nn.LayerNorm(h, eps=eps)
        self.mlp = Mlp(h, ffn)
        self.register_buffer("mask", self._mask() if shift else None, persistent=False)

    def _windows(self, x: torch.Tensor) -> torch.Tensor:
        b, _, _, c = x.shape
        w = self.window
        x = x.view(b, self.gh // w, w, self.gw // w, w, c).transpose(2, 3)
        return x.reshape(-1, w * w, c)

    def _unwindows(self, x: torch.Tensor, b: int) -> torch.Tensor:
        w, c = self.window, x.shape[-1]
        x = x.view(b, self.gh // w, self.gw // w, w, w, c).transpose(2, 3)
        return x.reshape(b, self.gh, self.gw, c)

    def _mask(self) -> torch.Tensor:
        area = torch.zeros(1, self.gh, self.gw, 1)
        cuts = (0, -self.window, -self.shift, None)
        n = 0
        for r in range(3):
            for s in range(3):
                area[:, cuts[r]:cuts[r + 1], cuts[s]:cuts[s + 1]] = n
                n += 1
        ids = self._windows(area).squeeze(-1)
        return (ids[:, None, :] != ids[:, :, None]).float() * -100.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "downsample"):
            x = self.downsample(x, 2 * self.gh, 2 * self.gw)
        b, s, c = x.shape
        y = self.input_layernorm(x).view(b, self.gh, self.gw, c)
        if self.shift:
            y = y.roll((-self.shift, -self.shift), (1, 2))
        y = self._unwindows(self.self_attention(self._windows(y), self.mask), b)
        if self.shift:
            y = y.roll((self.shift, self.shift), (1, 2))
        x = x + y.reshape(b, s, c)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class PlainSwin(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.embedding = Embedding(cfg, vit=False)
        blocks = []
        for st in cfg.swin_stages():
            for j in range(st.depth):
                blocks.append(Block(st.hidden_size, st.num_heads, cfg.swin_mlp_ratio * st.hidden_size,
                                    st.grid_h, st.grid_w, st.window, st.shift if j % 2 else 0,
                                    j == 0 and st.index > 0, cfg.layernorm_epsilon))
        self.layers = nn.ModuleList(blocks)
        self.head = Head(cfg.final_hidden_size, cfg.num_classes, cfg.layernorm_epsilon, False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embedding(images)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def plain_model(cfg) -> nn.Module:
    """The plain classifier of a :class:`~megatron_auto.families.vision.config.VisionConfig`."""
    return PlainViT(cfg) if cfg.model_type == "vit" else PlainSwin(cfg)
