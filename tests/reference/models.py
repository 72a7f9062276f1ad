"""Plain-PyTorch GPT and BERT, written from the architectures' definitions.

A pre-norm Transformer (GPT-2 / Megatron-LM order): ``x + Attn(Norm(x))``, then
``h + MLP(Norm(h))``, a final norm, and a language-model head over the vocabulary.

- Positions: learned absolute embeddings added to the token embeddings, or rotary embeddings
  (RoPE, Su et al. 2021) applied to queries and keys. RoPE is written in its complex form: the
  dimension pairs ``(i, i + d/2)`` of a head are the complex number ``x_i + j x_{i+d/2}``,
  multiplied by ``exp(j * p * base^(-2i/d))`` at position ``p`` (the "rotate-half" pairing of
  GPT-NeoX, LLaMA and Megatron-LM).
- Norms: LayerNorm ``(x - mean) / sqrt(var + eps) * w + b`` (biased variance) or RMSNorm
  ``x / sqrt(mean(x^2) + eps) * w``.
- Attention: softmax(q k^T / sqrt(d)) v per head, causal (GPT) or over the unpadded keys
  (BERT). Grouped-query attention: ``H`` query heads share ``G`` key/value heads, query head
  ``j`` reading key/value head ``j // (H / G)`` (LLaMA-2, Megatron's ``num_query_groups``).
- MLP: ``W_out act(W_in x)`` with GELU (erf form, or GPT-2's tanh approximation), or SwiGLU
  ``W_down (silu(W_gate x) * (W_up x))`` (Shazeer 2020).
- Head: the token-embedding matrix (tied) or a separate matrix (untied), no bias.
- Loss: cross entropy over the embedding's rows (the padded vocabulary: padded rows are real
  logits), averaged over the masked tokens of the whole batch.
- BERT (Devlin et al. 2019, Megatron's heads): token + position + token-type embeddings,
  bidirectional layers masked by the padding, the MLM head ``Norm(gelu(W x + b))`` times the
  tied embeddings plus an output bias, and the sentence-order head ``W_s tanh(W_p x_0 + b_p) +
  b_s`` on the first token. The loss is the mean MLM cross entropy over the masked tokens plus
  the mean sentence-order cross entropy over the samples.

Parameters have this module's own names (``blocks.0.attn.wq``, ...): a test maps them onto the
package's layout explicitly. :func:`initial_weights` draws them by a rule of this module alone.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class RefConfig:
    """Shape and variant of a reference model (``vocab_size``: the embedding's rows)."""

    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    num_layers: int
    seq_length: int
    positions: str = "learned"  # "learned" | "rope"
    rope_base: float = 10000.0
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    norm_eps: float = 1e-5
    activation: str = "gelu"  # "gelu" | "gelu_tanh" | "swiglu"
    bias: bool = True  # biases of the attention and MLP projections
    tied_head: bool = True
    causal: bool = True  # GPT; False with the BERT heads below
    num_token_types: int = 0  # BERT
    sentence_order_head: bool = False  # BERT

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# ------------------------------------------------------------------------------- elementary maths
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps) * weight + bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate ``x`` (b, heads, s, d) by its positions 0..s-1 (complex form, see module doc)."""
    s, d = x.shape[-2], x.shape[-1]
    half = d // 2
    # fp32 angle tables, as the published GPT-NeoX/LLaMA code computes them (fp64 tables would
    # differ from every fp32 implementation by ~1e-6 rad at position 16, which moves a 4-step
    # gradient norm by ~5e-6 relative)
    freq = base ** (-torch.arange(half, dtype=torch.float32) * 2.0 / d)  # (d/2,)
    angle = torch.arange(s, dtype=torch.float32)[:, None] * freq[None, :]  # (s, d/2)
    turn = torch.polar(torch.ones_like(angle), angle).to(torch.complex64)
    z = torch.complex(x[..., :half], x[..., half:]) * turn
    return torch.cat([z.real, z.imag], dim=-1)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-position ``-log softmax(logits)[target]``."""
    return torch.logsumexp(logits, -1) - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x @ weight.t()
    return y if bias is None else y + bias


# ----------------------------------------------------------------------------------- modules
class Norm(nn.Module):
    def __init__(self, config: RefConfig) -> None:
        super().__init__()
        self.kind, self.eps = config.norm, config.norm_eps
        self.weight = nn.Parameter(torch.empty(config.hidden_size))
        self.bias = (nn.Parameter(torch.empty(config.hidden_size))
                     if config.norm == "layernorm" else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rmsnorm":
            return rms_norm(x, self.weight, self.eps)
        return layer_norm(x, self.weight, self.bias, self.eps)


def _matrix(rows: int, cols: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, cols))


def _vector(size: int, present: bool = True) -> nn.Parameter | None:
    return nn.Parameter(torch.empty(size)) if present else None


class Attention(nn.Module):
    def __init__(self, config: RefConfig) -> None:
        super().__init__()
        h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
        self.config = config
        self.wq, self.bq = _matrix(h, h), _vector(h, config.bias)
        self.wk, self.bk = _matrix(kv, h), _vector(kv, config.bias)
        self.wv, self.bv = _matrix(kv, h), _vector(kv, config.bias)
        self.wo, self.bo = _matrix(h, h), _vector(h, config.bias)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        c = self.config
        b, s, _ = x.shape
        q = linear(x, self.wq, self.bq).view(b, s, c.num_heads, c.head_dim).transpose(1, 2)
        k = linear(x, self.wk, self.bk).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = linear(x, self.wv, self.bv).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
        if c.positions == "rope":
            q, k = rope(q, c.rope_base), rope(k, c.rope_base)
        share = c.num_heads // c.num_kv_heads  # query heads per key/value head
        k = k.repeat_interleave(share, dim=1)  # query head j reads key/value head j // share
        v = v.repeat_interleave(share, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(c.head_dim)  # (b, H, s, s)
        allowed = torch.ones(s, s, dtype=torch.bool)
        if c.causal:
            allowed = allowed.tril()
        allowed = allowed[None, None]
        if keep is not None:  # (b, s): 1 for a real token; padded keys are never attended
            allowed = allowed & keep.bool()[:, None, None, :]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # (b, H, s, d)
        return linear(out.transpose(1, 2).reshape(b, s, -1), self.wo, self.bo)


class MLP(nn.Module):
    def __init__(self, config: RefConfig) -> None:
        super().__init__()
        h, f = config.hidden_size, config.ffn_size
        self.activation = config.activation
        if config.activation == "swiglu":
            self.w_gate, self.b_gate = _matrix(f, h), _vector(f, config.bias)
            self.w_up, self.b_up = _matrix(f, h), _vector(f, config.bias)
        else:
            self.w_in, self.b_in = _matrix(f, h), _vector(f, config.bias)
        self.w_out, self.b_out = _matrix(h, f), _vector(h, config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            y = silu(linear(x, self.w_gate, self.b_gate)) * linear(x, self.w_up, self.b_up)
        elif self.activation == "gelu_tanh":
            y = gelu_tanh(linear(x, self.w_in, self.b_in))
        else:
            y = gelu(linear(x, self.w_in, self.b_in))
        return linear(y, self.w_out, self.b_out)


class Block(nn.Module):
    def __init__(self, config: RefConfig) -> None:
        super().__init__()
        self.norm1, self.attn = Norm(config), Attention(config)
        self.norm2, self.mlp = Norm(config), MLP(config)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), keep)
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """GPT (``causal``) or BERT (the BERT heads when ``sentence_order_head``)."""

    def __init__(self, config: RefConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.tok_embed = _matrix(config.vocab_size, h)
        self.pos_embed = _matrix(config.seq_length, h) if config.positions == "learned" else None
        self.type_embed = (_matrix(config.num_token_types, h) if config.num_token_types
                           else None)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm_f = Norm(config)
        self.head = None if config.tied_head else _matrix(config.vocab_size, h)
        if not config.causal:  # BERT's MLM head transform and output bias
            self.mlm_w, self.mlm_b = _matrix(h, h), _vector(h)
            self.mlm_norm = Norm(config)
            self.mlm_out_b = _vector(config.vocab_size)
        if config.sentence_order_head:
            self.pool_w, self.pool_b = _matrix(h, h), _vector(h)
            self.sop_w, self.sop_b = _matrix(2, h), _vector(2)

    def hidden(self, tokens: torch.Tensor, types: torch.Tensor | None = None,
               keep: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok_embed[tokens]  # (b, s, h)
        if self.pos_embed is not None:
            x = x + self.pos_embed[: tokens.shape[1]]
        if self.type_embed is not None and types is not None:
            x = x + self.type_embed[types]
        for block in self.blocks:
            x = block(x, keep)
        return self.norm_f(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.tok_embed if self.head is None else self.head).t()

    def gpt_loss(self, tokens: torch.Tensor, labels: torch.Tensor,
                 loss_mask: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over the batch's masked tokens."""
        ce = cross_entropy(self.logits(self.hidden(tokens)), labels)
        return (ce * loss_mask).sum() / loss_mask.sum()

    def bert_loss(self, tokens: torch.Tensor, types: torch.Tensor, padding_mask: torch.Tensor,
                  labels: torch.Tensor, loss_mask: torch.Tensor,
                  is_random: torch.Tensor) -> torch.Tensor:
        """Mean MLM cross entropy over the masked tokens + mean sentence-order cross entropy."""
        x = self.hidden(tokens, types, padding_mask)
        y = self.mlm_norm(gelu(linear(x, self.mlm_w, self.mlm_b)))
        ce = cross_entropy(self.logits(y) + self.mlm_out_b, labels.clamp(min=0))
        loss = (ce * loss_mask).sum() / loss_mask.sum()
        if self.config.sentence_order_head:
            pooled = torch.tanh(linear(x[:, 0], self.pool_w, self.pool_b))
            loss = loss + cross_entropy(linear(pooled, self.sop_w, self.sop_b),
                                        is_random.long()).mean()
        return loss


# ------------------------------------------------------------------------------- initialisation
def _is_norm_weight(name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 1 and "norm" in parts[-2] and parts[-1] == "weight"


def initial_weights(model: nn.Module, *, matrix_gain: float = 1.0, norm_spread: float = 0.2,
                    bias_std: float = 0.1) -> dict[str, torch.Tensor]:
    """Fill ``model``'s parameters by this module's rule and return a copy by name.

    Each tensor comes from a generator seeded with the CRC-32 of its name (no global seed, no
    package code): matrices ``N(0, (gain / sqrt(fan_in))^2)`` (embedding tables use their
    width), norm weights ``1 + N(0, norm_spread^2)``, biases ``N(0, bias_std^2)``. Norm weights
    away from one and non-zero biases make every parameter change the loss from the first step,
    so a sub-layer that drops or misuses one shows at once.
    """
    out = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() >= 2:
                value = noise * (matrix_gain / math.sqrt(param.shape[-1]))
            elif _is_norm_weight(name):
                value = 1.0 + norm_spread * noise
            else:
                value = bias_std * noise
            param.copy_(value)
            out[name] = value.clone()
    return out
