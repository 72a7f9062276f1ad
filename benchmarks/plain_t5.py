"""A plain PyTorch T5: the same math as ``models/t5.py``, none of our machinery.

Baseline for ``bench_models.py`` and an independent cross-check for the tests (it loads our
parameters by name, so the two must compute the same loss and gradients). Written the way a
single-GPU user would: ``nn.Linear``, ``nn.LayerNorm``, attention spelled out as
``softmax(q k^T / sqrt(d) + bias + mask) v``, T5's buckets computed per offset in plain Python.
Parameter names and shapes match ours (fused projections in our ``(heads, parts, kv)`` row
order).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def bucket_of(offset: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's bucket of ``key - query = offset``, one offset at a time."""
    base = 0
    if bidirectional:
        num_buckets //= 2
        if offset > 0:
            base = num_buckets
        distance = abs(offset)
    else:
        distance = max(-offset, 0)
    exact = num_buckets // 2
    if distance < exact:
        return base + distance
    far = exact + int(math.log(distance / exact) / math.log(max_distance / exact)
                      * (num_buckets - exact))
    return base + min(far, num_buckets - 1)


class Bias(nn.Module):
    def __init__(self, buckets: int, heads: int, bidirectional: bool, max_distance: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(buckets, heads))
        self.bidirectional, self.max_distance = bidirectional, max_distance

    def forward(self, s: int) -> torch.Tensor:
        if getattr(self, "_index", None) is None or self._index.shape[0] != s:
            self._index = torch.tensor([[bucket_of(k - q, self.bidirectional,
                                                   self.weight.shape[0], self.max_distance)
                                         for k in range(s)] for q in range(s)],
                                       device=self.weight.device)
        return self.weight[self._index].permute(2, 0, 1)  # (heads, s, s)


class Attention(nn.Module):
    def __init__(self, h: int, heads: int, kv: int, cross: bool) -> None:
        super().__init__()
        self.heads, self.kv, self.cross = heads, kv, cross
        if cross:
            self.linear_q = nn.Linear(h, heads * kv)
            self.linear_kv = nn.Linear(h, 2 * heads * kv)
        else:
            self.linear_qkv = nn.Linear(h, 3 * heads * kv)
        self.linear_proj = nn.Linear(heads * kv, h)

    def _split(self, y: torch.Tensor, parts: int) -> list[torch.Tensor]:
        b, s, _ = y.shape
        return list(y.view(b, s, self.heads, parts, self.kv).permute(3, 0, 2, 1, 4))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None, add: torch.Tensor
                ) -> torch.Tensor:
        if self.cross:
            (q,), (k, v) = self._split(self.linear_q(x), 1), self._split(self.linear_kv(memory), 2)
        else:
            q, k, v = self._split(self.linear_qkv(x), 3)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.kv) + add
        out = torch.softmax(scores, dim=-1) @ v  # (b, heads, s, kv)
        b, _, s, _ = out.shape
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.kv))


class Mlp(nn.Module):
    def __init__(self, h: int, ffn: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(h, ffn)
        self.linear_fc2 = nn.Linear(ffn, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Layer(nn.Module):
    def __init__(self, cfg, decoder: bool, final: bool) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layernorm_epsilon
        args = (h, cfg.num_attention_heads, cfg.kv_channels)
        self.decoder = decoder
        self.input_layernorm = nn.LayerNorm(h, eps=eps)
        self.self_attention = Attention(*args, cross=False)
        if decoder:
            self.pre_cross_attn_layernorm = nn.LayerNorm(h, eps=eps)
            self.cross_attention = Attention(*args, cross=True)
        self.pre_mlp_layernorm = nn.LayerNorm(h, eps=eps)
        self.mlp = Mlp(h, cfg.ffn_hidden_size)
        self.final_layernorm = nn.LayerNorm(h, eps=eps) if final else None

    def forward(self, x, memory, self_add, cross_add):
        x = x + self.self_attention(self.input_layernorm(x), None, self_add)
        if self.decoder:
            x = x + self.cross_attention(self.pre_cross_attn_layernorm(x), memory, cross_add)
        x = x + self.mlp(self.pre_mlp_layernorm(x))
        return x if self.final_layernorm is None else self.final_layernorm(x)


class _Embedding(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.position_embeddings = (nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
                                    if cfg.position_embedding_type == "learned" else None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(torch.arange(ids.shape[1], device=ids.device))
        return x


class _LMHead(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(vocab))


class PlainT5(nn.Module):
    """``forward(batch) -> (sum of masked token cross entropy, masked tokens)``."""

    def __init__(self, cfg) -> None:
        super().__init__()
        if cfg.normalization != "layernorm" or cfg.activation != "gelu":
            raise ValueError("the plain T5 has LayerNorm and GeLU only")
        self.cfg = cfg
        enc = cfg.encoder_num_layers
        self.layers = nn.ModuleDict({str(i): Layer(cfg, decoder=i >= enc, final=i == enc - 1)
                                     for i in range(cfg.num_layers)})
        self.embedding = _Embedding(cfg)
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.lm_head = _LMHead(cfg.padded_vocab_size)
        if cfg.position_embedding_type == "relative":
            nb, heads, md = (cfg.relative_attention_num_buckets, cfg.num_attention_heads,
                             cfg.relative_attention_max_distance)
            self.encoder_relative_bias = Bias(nb, heads, True, md)
            self.decoder_relative_bias = Bias(nb, heads, False, md)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        se, sd = cfg.seq_length, cfg.decoder_seq_length
        enc = self.embedding(batch["tokens"])
        dec = self.embedding(batch["decoder_tokens"])
        neg = torch.finfo(enc.dtype).min
        pad = (1.0 - batch["encoder_mask"].float())[:, None, None, :] * neg  # (b, 1, 1, se)
        causal = torch.full((sd, sd), neg, device=enc.device).triu(1)
        relative = cfg.position_embedding_type == "relative"
        enc_add = pad + (self.encoder_relative_bias(se) if relative else 0.0)
        dec_add = causal + (self.decoder_relative_bias(sd) if relative else 0.0)
        for i in range(cfg.encoder_num_layers):
            enc = self.layers[str(i)](enc, None, enc_add, None)
        for i in range(cfg.encoder_num_layers, cfg.num_layers):
            dec = self.layers[str(i)](dec, enc, dec_add, pad)
        logits = self.final_norm(dec) @ self.embedding.word_embeddings.weight.t() + \
            self.lm_head.bias
        losses = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                                 reduction="none")
        mask = batch["loss_mask"].flatten().float()
        return (losses * mask).sum(), mask.sum()
