"""Context-parallel core attention: ring attention and Ulysses (``cp_mode`` of a plan layer).

Inputs are this CP rank's queries, keys and values ``(b, heads, s/cp, d)`` / ``(b, groups,
s/cp, d)`` of its two sequence chunks ``r`` and ``2cp-1-r`` (``layout.cp_chunks``), in that
order; the output is this rank's ``(b, heads, s/cp, d)``, the rows of exact attention over the
whole sequence.

Ring (:class:`RingAttention`). Keys and values travel around the CP group, one hop per step
(``parallel.context_parallel.ring_exchange``, started before a step's computation and waited for
after it). At each step a rank attends its queries to the chunks it holds and merges the
partial results by their log-sum-exp (the blockwise softmax, in fp32). Causal masking is per
chunk pair: a query chunk attends an earlier key chunk whole, its own chunk with the triangular
mask, a later one not at all (skipped), so with the load-balanced chunk order every rank does
the same work. Backward computes each block's gradients from the *final* output and
log-sum-exp of its rows, and sends each chunk's fp32 key/value gradient one hop behind the
chunk, so that after ``cp`` hops each rank holds the gradient of its own keys and values.
A block runs torch's CPU flash kernel where it can (``_scaled_dot_product_flash_attention_for_cpu``
returns the log-sum-exp and its backward takes the final output and log-sum-exp: no scores are
materialised); with a padding mask, or off CPU, the block is written out here in fp32.

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
        # (q part, k part, mask, diagonal): the mask for the written-out blocks, the diagonal
        # flag (the same chunk: causal within it) for the flash kernel
        self.pairs: list[tuple[int, int, torch.Tensor | None, bool]] = []
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
                self.pairs.append((qi, ki, mask, causal and kc == qc))

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return x.narrow(2, i * self.c, self.c)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _use_flash(q: torch.Tensor, keep: torch.Tensor | None) -> bool:
    """Whether blocks run torch's CPU flash kernel (which returns the block's log-sum-exp and
    has a backward taking the final output and log-sum-exp, so no block's scores are ever
    materialised): on CPU without a padding mask (whose fully masked rows that kernel does
    not define). Elsewhere the blocks are written out here in fp32, ``c x c`` scores at a
    time (CUDA's kernels take the log-sum-exp in layouts of their own: not wired yet)."""
    return q.device.type == "cpu" and keep is None


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, diag: bool,
                   scale: float, flash: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's normalised output and log-sum-exp ``(b, h, c, 1)``, both fp32; rows with
    no key get output 0 and log-sum-exp -inf."""
    if flash:
        out, lse = _FLASH_CPU(q, k, v, 0.0, diag, scale=scale)
        return out.float(), lse.float().unsqueeze(-1)
    s = _scores(q.float(), k.float(), mask, scale)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v.float()) / total.clamp_min(torch.finfo(torch.float32).tiny)
    lse = torch.where(total > 0, m + torch.log(total), torch.full_like(m, float("-inf")))
    return out, lse


def _block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, mask: Any,
                    diag: bool, scale: float, flash: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of dq, dk, dv (fp32) from the *final* output and log-sum-exp of the
    rows: the block's probabilities are ``exp(scores - lse)`` with that lse, and
    ``delta = rowsum(dO * O)`` of the final O."""
    if flash:
        dq, dk, dv = _FLASH_CPU_BACKWARD(do.to(q.dtype).contiguous(), q, k, v,
                                         out.to(q.dtype).contiguous(),
                                         lse.squeeze(-1).contiguous(), 0.0, diag, scale=scale)
        return dq.float(), dk.float(), dv.float()
    qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
    p = torch.exp(_scores(qf, kf, mask, scale) - lse)
    dv = torch.matmul(p.transpose(-1, -2), dof)
    ds = p * (torch.matmul(dof, vf.transpose(-1, -2)) - delta) * scale
    return torch.matmul(ds, kf), torch.matmul(ds.transpose(-1, -2), qf), dv


def _merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax results of the same rows merged by their log-sum-exp."""
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    merged = out * torch.exp(lse - safe) + torch.nan_to_num(out_b) * torch.exp(lse_b - safe)
    return merged, new


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
        flash = _use_flash(q, keep)
        b, heads, s_local, d = q.shape
        out = torch.zeros((b, heads, s_local, d), device=q.device)
        lse = torch.full((b, heads, s_local, 1), float("-inf"), device=q.device)
        kv = torch.stack([k, v])  # travels in the compute dtype
        for step in range(cp):
            hop = ring_exchange([kv], cp_ranks, cp_rank) if step < cp - 1 else None
            src = (cp_rank - step) % cp
            blocks = _Blocks(cp_rank, src, cp, c, causal, keep, q.device)
            kh, vh = (_expand_kv(t, per_group) for t in kv)
            for qi, ki, mask, diag in blocks.pairs:
                rows = slice(qi * c, (qi + 1) * c)
                out_b, lse_b = _block_forward(blocks.part(q, qi), blocks.part(kh, ki),
                                              blocks.part(vh, ki), mask, diag, scale, flash)
                out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows],
                                                          out_b, lse_b)
            if hop is not None:
                kv, = hop.wait()
        ctx.save_for_backward(q, k, v, out, lse, keep)
        ctx.args = (causal, cp_ranks, cp_rank, per_group, scale, flash)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse, keep = ctx.saved_tensors
        causal, cp_ranks, cp_rank, per_group, scale, flash = ctx.args
        cp = len(cp_ranks)
        c = q.shape[2] // 2
        dout = grad_out.float()
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO * O)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        # The fp32 gradient of a key/value chunk travels behind the chunk: the hop bringing the
        # one of the chunk held is waited for only after this step's computation (overlap)
        dkv_hop = None
        for step in range(cp):
            kv_hop = ring_exchange([kv], cp_ranks, cp_rank) if step < cp - 1 else None
            src = (cp_rank - step) % cp
            blocks = _Blocks(cp_rank, src, cp, c, causal, keep, q.device)
            kh, vh = (_expand_kv(t, per_group) for t in kv)
            dkh = torch.zeros(kh.shape, dtype=torch.float32, device=q.device)
            dvh = torch.zeros_like(dkh)
            for qi, ki, mask, diag in blocks.pairs:
                rows = slice(qi * c, (qi + 1) * c)
                dq_b, dk_b, dv_b = _block_backward(
                    dout[:, :, rows], blocks.part(q, qi), blocks.part(kh, ki),
                    blocks.part(vh, ki), out[:, :, rows], lse[:, :, rows],
                    delta[:, :, rows], mask, diag, scale, flash)
                dq[:, :, rows] += dq_b
                blocks.part(dkh, ki).add_(dk_b)
                blocks.part(dvh, ki).add_(dv_b)
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
