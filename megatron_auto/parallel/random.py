"""Dropout randomness that is deterministic, TP-aware and safe under recomputation.

Two named generator streams per rank, both seeded from the run seed and the pipeline stage:

- ``REPLICATED``: the same seed on every rank of a stage. Used for dropout on activations that
  are replicated over the TP group (hidden dropout after a row-parallel layer, embedding dropout),
  so every TP rank drops the same elements and the replicas stay identical.
- ``TENSOR_PARALLEL``: a different seed per rank. Used inside TP-sharded regions (dropout on the
  attention probabilities of this rank's heads) so different shards get independent masks.

A stream is used through ``with tracker.fork(name): ...``, which swaps it in as the device's
default generator (``F.dropout`` and SDPA draw from that) and swaps it out afterwards. Every rank
of a stage performs the same random calls with the same shapes, so the replicated streams stay
in step whatever the layout of each layer.

Recomputation: :func:`checkpoint` snapshots the tracker's states before the forward and, when
``torch.utils.checkpoint`` re-runs the function in backward, replays from that snapshot and then
restores the states of that moment, so recomputed dropout masks equal the original ones.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

REPLICATED = "replicated"
TENSOR_PARALLEL = "tensor-parallel"


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from any printable parts (stable across runs and machines)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _fresh_state(seed: int, device: torch.device) -> torch.Tensor:
    saved = _get_state(device)
    try:
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        return _get_state(device)
    finally:
        _set_state(saved, device)


class RNGTracker:
    """Named generator streams of one rank (see module docstring)."""

    def __init__(self, seed: int, *, stage: int, local_index: int,
                 device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {
            REPLICATED: _fresh_state(derive_seed(seed, "replicated", stage), self.device),
            TENSOR_PARALLEL: _fresh_state(derive_seed(seed, "tensor-parallel", stage, local_index),
                                          self.device),
        }

    @contextlib.contextmanager
    def fork(self, name: str) -> Iterator[None]:
        """Run the block with stream ``name`` as the default generator of the device."""
        if name not in self.states:
            raise KeyError(f"unknown RNG stream {name!r}; known: {sorted(self.states)}")
        saved = _get_state(self.device)
        _set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(saved, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states)  # the tensors are never mutated in place, a shallow copy suffices

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)


def fork(tracker: RNGTracker | None, name: str, *,
         draws: bool = True) -> contextlib.AbstractContextManager:
    """``tracker.fork(name)`` around code that ``draws`` random numbers; nothing without a
    tracker (one process outside a stage: torch's default generator) or without draws."""
    if tracker is None or not draws:
        return contextlib.nullcontext()
    return tracker.fork(name)


def replicated_dropout(x: torch.Tensor, p: float, tracker: RNGTracker | None,
                       training: bool) -> torch.Tensor:
    """Dropout of an activation replicated over the TP group: the ``REPLICATED`` stream, so
    every TP rank drops the same elements; ``x`` itself in eval or with ``p == 0``."""
    if not training or p == 0.0:
        return x
    with fork(tracker, REPLICATED):
        return F.dropout(x, p, training=True)


def checkpoint(fn: Callable[..., Any], tracker: RNGTracker | None, *args: Any) -> Any:
    """``torch.utils.checkpoint`` (non-reentrant) of ``fn(*args)`` that replays ``tracker``.

    The default generator is preserved by torch itself (``preserve_rng_state``); the tracker's
    streams are replayed here.
    """
    if tracker is None:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    start_states = tracker.get_states()
    calls = 0

    def run(*inner: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*inner)
        now = tracker.get_states()
        tracker.set_states(start_states)
        try:
            return fn(*inner)
        finally:
            tracker.set_states(now)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)
