"""Context parallelism's communication: the ring's key/value hop and Ulysses' all-to-alls.

A CP group (``LayerGroups.cp_group``, ``cp`` ranks) holds the ``2cp`` equal sequence chunks of
the same samples, CP rank ``r`` the chunks ``r`` and ``2cp-1-r`` (``layout.cp_chunks``: causal
attention then costs every rank the same). This module has the data movement only; the
attention maths that uses it is ``models/cp_attention.py``.

- :func:`ring_exchange`: one hop around the ring, every rank sending a buffer to CP rank
  ``r+1`` and receiving one from ``r-1`` with ``batch_isend_irecv`` (started before the
  caller's computation and waited for after it, so the hop overlaps one block of attention).
- :func:`sequence_to_heads` / :func:`heads_to_sequence`: Ulysses' all-to-all from
  ``(b, heads, s/cp, d)`` (this rank's chunks, every head) to ``(b, heads/cp, s, d)`` (every
  chunk, this rank's heads) and back, through one autograd function (each swap's backward is
  the other's forward).
- :func:`sequence_chunks`: this rank's two chunks of a whole-sequence tensor (token ids,
  labels, masks, position tables), the data path's share of CP.

Why not PyTorch's own ``torch.distributed.tensor.experimental.context_parallel`` (read in torch
2.13): it dispatches only the CUDA flash / memory-efficient / cuDNN SDPA kernels (the CPU
kernel ``_scaled_dot_product_flash_attention_for_cpu`` has no CP handler, so gloo/CPU runs would
silently compute local attention), refuses an attention mask (BERT's padding mask), has no
grouped-query attention (its kernels need as many key/value heads as query heads), and works on
DTensors over a DeviceMesh, whereas our activations are plain tensors split by our own layouts.
The ring here is a few dozen lines of p2p on any backend.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..layout import cp_chunks


def sequence_chunks(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """CP rank ``cp_rank``'s chunks ``r`` and ``2cp-1-r`` of ``x`` along ``dim`` (of ``2cp``
    equal chunks), concatenated in that order; ``x`` itself when ``cp == 1``."""
    if cp == 1:
        return x
    s = x.shape[dim]
    if s % (2 * cp):
        raise ValueError(f"sequence length {s} is not divisible by 2 x cp = {2 * cp}")
    c = s // (2 * cp)
    first, second = cp_chunks(cp_rank, cp)
    return torch.cat([x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)], dim=dim)


def sequence_positions(cp_rank: int, cp: int, seq_length: int,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of CP rank ``cp_rank``'s tokens, in the order it holds them."""
    return sequence_chunks(torch.arange(seq_length, device=device), cp_rank, cp, dim=0)


class RingHop:
    """One pending hop of :func:`ring_exchange`: :meth:`wait` returns the received buffers."""

    def __init__(self, works: list[Any], received: list[torch.Tensor]) -> None:
        self._works, self._received = works, received

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        return self._received


def ring_exchange(buffers: list[torch.Tensor], cp_ranks: list[int], cp_rank: int) -> RingHop:
    """Start sending each of ``buffers`` to the next CP rank and receiving the previous rank's
    buffers of the same shapes and dtypes (global ranks ``cp_ranks``, in CP-rank order), one
    ``batch_isend_irecv``. Every rank of the CP group calls it at the same point; wait on the
    result before reading what arrives or changing what is sent."""
    cp = len(cp_ranks)
    nxt, prev = cp_ranks[(cp_rank + 1) % cp], cp_ranks[(cp_rank - 1) % cp]
    ops, received = [], []
    for buffer in buffers:
        buffer = buffer.contiguous()
        got = torch.empty_like(buffer)
        ops += [dist.P2POp(dist.isend, buffer, nxt), dist.P2POp(dist.irecv, got, prev)]
        received.append(got)
    return RingHop(dist.batch_isend_irecv(ops), received)


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-to-all over dim 0 (one equal part per rank, part ``i`` to rank ``i``)."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous like ``x`` (empty_like keeps a view's strides)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    b, heads, s, d = x.shape
    if heads % cp:
        raise ValueError(f"{heads} local heads are not divisible by cp={cp} (Ulysses)")
    parts = x.reshape(b, cp, heads // cp, s, d).transpose(0, 1)  # part i: rank i's heads
    got = _all_to_all(parts, group)  # got[i]: CP rank i's chunks of this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, heads // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    b, heads, s_all, d = x.shape
    s = s_all // cp
    parts = x.reshape(b, heads, cp, s, d).permute(2, 0, 1, 3, 4)  # part i: rank i's chunks
    got = _all_to_all(parts, group)  # got[i]: this rank's chunks of CP rank i's heads
    return got.transpose(0, 1).reshape(b, cp * heads, s, d)


class _UlyssesSwap(torch.autograd.Function):
    """One Ulysses all-to-all, ``swap`` one of :data:`_SWAPS`: forward runs the swap, backward
    its inverse on the gradient (both are one all-to-all over the CP group)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, cp: int, swap: str) -> torch.Tensor:
        ctx.group, ctx.cp, ctx.swap = group, cp, swap
        return _SWAPS[swap][0](x, group, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _SWAPS[ctx.swap][1](grad, ctx.group, ctx.cp), None, None, None


# swap name -> (forward, its inverse)
_SWAPS = {"seq_to_heads": (_seq_to_heads, _heads_to_seq),
          "heads_to_seq": (_heads_to_seq, _seq_to_heads)}


def sequence_to_heads(x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    """``(b, heads, s/cp, d)`` of this rank's chunks -> ``(b, heads/cp, s, d)``: CP rank ``r``
    keeps heads ``[r heads/cp, (r+1) heads/cp)``, the sequence in CP-rank order of the chunks
    (rank 0's two chunks, then rank 1's, ...). One all-to-all; backward the inverse."""
    return x if cp == 1 else _UlyssesSwap.apply(x, group, cp, "seq_to_heads")


def heads_to_sequence(x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    """The inverse of :func:`sequence_to_heads`."""
    return x if cp == 1 else _UlyssesSwap.apply(x, group, cp, "heads_to_seq")
