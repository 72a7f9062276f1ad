"""Context-parallel core attention: ring attention and Ulysses (``cp_mode`` of a plan layer).

Inputs are this CP rank's queries, keys and values ``(b, heads, s/cp, d)`` / ``(b, groups,
s/cp, d)`` of its two sequence chunks ``r`` and ``2cp-1-r`` (``layout.cp_chunks``), in that
order; the output is this rank's ``(b, heads, s/cp, d)``, the rows of exact attention over the
whole sequence.

Ring (:class:`RingAttention`). Keys and values travel around the CP group, one hop per step
(``parallel.context_parallel.ring_exchange``, started before a step's computation and waited for
after it). At each step a rank attends its queries to the chunks it holds, in fp32, and merges
the partial results with a running row maximum and sum of exponentials (log-sum-exp), the
blockwise softmax: no rank ever holds scores of more than one chunk pair. Causal masking is per
chunk pair: a query chunk attends an earlier key chunk whole, its own chunk with the triangular
mask, a later one not at all (skipped), so with the load-balanced chunk order every rank does
the same work. Backward recomputes each block's probabilities from the saved log-sum-exp and
sends the key/value gradients around the ring with the keys and values, so that after ``cp``
hops each rank holds the gradient of its own keys and values. The blockwise maths is written
here rather than taken from an SDPA variant that returns the log-sum-exp: torch 2.13's CPU
flash kernel returns it, but has no backward taking it as input for a block, and the masked
blocks of BERT's padding need an explicit mask anyway.

Ulysses (:func:`ulysses_attention`). One all-to-all gives every CP rank the whole sequence of
``heads/cp`` heads (and ``groups/cp`` key/value groups), attention runs as without CP (SDPA,
after putting the sequence back in natural order), and one all-to-all returns the rank's chunks
of every head. Needs heads and key/value groups divisible by ``cp`` (per TP rank; the plan
validates ``cp x tp``).

Masks: ``keep`` is the (b, s) key-keep mask of the whole sequence (1 = real token; None: every
key), the same on every CP rank, so each block indexes the keys it holds without communication.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..layout import cp_chunks
from ..parallel.context_parallel import (heads_to_sequence, ring_exchange, sequence_positions,
                                         sequence_to_heads)


def _expand_kv(x: torch.Tensor, per_group: int) -> torch.Tensor:
    """(b, groups, s, d) -> (b, heads, s, d): query head ``j`` uses group ``j // per_group``."""
    return x if per_group == 1 else x.repeat_interleave(per_group, dim=1)


def _reduce_kv(x: torch.Tensor, per_group: int) -> torch.Tensor:
    """The gradient of :func:`_expand_kv`: sum each group's query heads."""
    if per_group == 1:
        return x
    b, heads, s, d = x.shape
    return x.reshape(b, heads // per_group, per_group, s, d).sum(2)


class _Blocks:
    """The chunk pairs of one ring step: which query chunk attends which key chunk, and how."""

    def __init__(self, cp_rank: int, src: int, cp: int, c: int, causal: bool,
                 keep: torch.Tensor | None, device: torch.device) -> None:
        self.c = c
        self.pairs: list[tuple[int, int, torch.Tensor | None]] = []  # (q part, k part, mask)
        q_chunks, k_chunks = cp_chunks(cp_rank, cp), cp_chunks(src, cp)
        tri = None
        for qi, qc in enumerate(q_chunks):
            for ki, kc in enumerate(k_chunks):
                if causal and kc > qc:
                    continue  # a later key chunk: masked out whole
                mask = None
                if causal and kc == qc:
                    if tri is None:
                        tri = torch.ones(c, c, dtype=torch.bool, device=device).tril()
                    mask = tri
                if keep is not None:
                    k_keep = keep[:, kc * c:(kc + 1) * c].bool()[:, None, None, :]
                    mask = k_keep if mask is None else mask & k_keep
                self.pairs.append((qi, ki, mask))

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return x.narrow(2, i * self.c, self.c)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


class RingAttention(torch.autograd.Function):
    """Exact attention of this rank's queries over the CP group's keys/values (module doc)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                keep: torch.Tensor | None, causal: bool, cp_ranks: list[int],
                cp_rank: int) -> torch.Tensor:
        cp = len(cp_ranks)
        per_group = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        c = q.shape[2] // 2
        qf = q.float()
        b, heads, s_local, d = qf.shape
        row_max = torch.full((b, heads, s_local, 1), float("-inf"), device=q.device)
        row_sum = torch.zeros((b, heads, s_local, 1), device=q.device)
        acc = torch.zeros((b, heads, s_local, d), device=q.device)
        kv = torch.stack([k, v])  # travels in the compute dtype, is computed with in fp32
        for step in range(cp):
            hop = ring_exchange([kv], cp_ranks, cp_rank) if step < cp - 1 else None
            src = (cp_rank - step) % cp
            blocks = _Blocks(cp_rank, src, cp, c, causal, keep, q.device)
            kh, vh = (_expand_kv(t.float(), per_group) for t in kv)
            for qi, ki, mask in blocks.pairs:
                rows = slice(qi * c, (qi + 1) * c)
                s = _scores(blocks.part(qf, qi), blocks.part(kh, ki), mask, scale)
                new_max = torch.maximum(row_max[:, :, rows], s.amax(-1, keepdim=True))
                safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
                decay = torch.exp(row_max[:, :, rows] - safe)
                p = torch.exp(s - safe)
                row_sum[:, :, rows] = row_sum[:, :, rows] * decay + p.sum(-1, keepdim=True)
                acc[:, :, rows] = acc[:, :, rows] * decay + torch.matmul(p, blocks.part(vh, ki))
                row_max[:, :, rows] = new_max
            if hop is not None:
                kv, = hop.wait()
        out = acc / row_sum
        lse = row_max + torch.log(row_sum)
        ctx.save_for_backward(q, k, v, out, lse, keep)
        ctx.args = (causal, cp_ranks, cp_rank, per_group, scale)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse, keep = ctx.saved_tensors
        causal, cp_ranks, cp_rank, per_group, scale = ctx.args
        cp = len(cp_ranks)
        c = q.shape[2] // 2
        qf, dout = q.float(), grad_out.float()
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO * O)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        # The fp32 gradient of a key/value chunk travels behind the chunk: the hop bringing the
        # one of the chunk held is waited for only after this step's computation (overlap)
        dkv_hop = None
        for step in range(cp):
            kv_hop = ring_exchange([kv], cp_ranks, cp_rank) if step < cp - 1 else None
            src = (cp_rank - step) % cp
            blocks = _Blocks(cp_rank, src, cp, c, causal, keep, q.device)
            kh, vh = (_expand_kv(t.float(), per_group) for t in kv)
            dkh, dvh = torch.zeros_like(kh), torch.zeros_like(vh)
            for qi, ki, mask in blocks.pairs:
                rows = slice(qi * c, (qi + 1) * c)
                kk, vv = blocks.part(kh, ki), blocks.part(vh, ki)
                p = torch.exp(_scores(blocks.part(qf, qi), kk, mask, scale) - lse[:, :, rows])
                do = dout[:, :, rows]
                blocks.part(dvh, ki).add_(torch.matmul(p.transpose(-1, -2), do))
                ds = p * (torch.matmul(do, vv.transpose(-1, -2)) - delta[:, :, rows]) * scale
                dq[:, :, rows] += torch.matmul(ds, kk)
                blocks.part(dkh, ki).add_(torch.matmul(ds.transpose(-1, -2),
                                                       blocks.part(qf, qi)))
            dkv = torch.stack([_reduce_kv(dkh, per_group), _reduce_kv(dvh, per_group)])
            if dkv_hop is not None:  # the other ranks' part of this chunk's gradient
                dkv = dkv_hop.wait()[0] + dkv
            dkv_hop = ring_exchange([dkv], cp_ranks, cp_rank)
            if kv_hop is not None:
                kv, = kv_hop.wait()
        assert dkv_hop is not None
        dkv, = dkv_hop.wait()  # cp hops: each rank's own chunk's whole gradient is home
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
                   *, causal: bool, cp_ranks: list[int], cp_rank: int) -> torch.Tensor:
    """Ring attention of this CP rank's chunks (module docstring); ``cp_ranks`` global ranks of
    the CP group in CP-rank order."""
    return RingAttention.apply(q, k, v, keep, causal, list(cp_ranks), cp_rank)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      keep: torch.Tensor | None, *, causal: bool, group: Any, cp: int,
                      dropout_p: float = 0.0) -> torch.Tensor:
    """Ulysses attention (module docstring): all-to-all to head-sharded, SDPA over the whole
    sequence in natural order, all-to-all back to this rank's chunks."""
    s = q.shape[2] * cp
    # the gathered sequence is every rank's chunks in CP-rank order; ``order`` lists their
    # global positions, ``natural`` the permutation that sorts them
    order = torch.cat([sequence_positions(r, cp, s, q.device) for r in range(cp)])
    natural = torch.argsort(order)
    q, k, v = (sequence_to_heads(t, group, cp).index_select(2, natural) for t in (q, k, v))
    mask = None
    if keep is not None:
        mask = keep.bool()[:, None, None, :]
        if causal:
            mask = mask & torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                         is_causal=causal and mask is None, **kwargs)
    return heads_to_sequence(out.index_select(2, order), group, cp)
