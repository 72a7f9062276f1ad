"""The one timing loop of the profilers, and the fits of what it measured (docs/profiling.md §2).

:func:`time_rounds` times the model profiler's layers (a forward and a backward per micro-batch
size) and the hardware profiler's collectives (one call per message size) alike: interleaved
rounds of every step, each phase synchronised, medians. A barrier, when the caller passes one,
starts every round on every rank at once. :func:`fit_line` and :func:`fit_replicated_fraction`
turn the model profiler's medians into a profile's lines.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np
import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU, where ops are synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_rounds(steps: Sequence[Sequence[Callable[[], Any]]], warmup: int, iters: int,
                device: torch.device, *, before: Callable[[], Any] | None = None,
                barrier: Callable[[], Any] | None = None) -> list[tuple[float, ...]]:
    """Median seconds of every phase of every step over ``iters`` rounds (after ``warmup``).

    A step is a sequence of phases run back to back, each timed from the end of the previous
    one (a layer's forward then its backward; a collective is one phase). Each of ``warmup +
    iters`` rounds calls ``barrier`` (when given) and then runs every step once, ``before``
    (untimed: e.g. a gap of compute ahead of a communication call) ahead of each. Interleaving
    the steps puts a slow stretch of a shared machine on all of them alike rather than on one
    micro-batch or message size, which would bend the fitted line: one size timed alone per
    block left a CPU profile's per-call constant anywhere between 0 and 9.9 ms from run to run,
    and the fitted CPU all-reduce latency 2.5 ms in one quiet run and 3.7 ms in the next.
    Timing the phases of one step together keeps, e.g., the forward and backward medians
    comparable. The barrier is for ranks that measure at once (``--auto-parallel``, a
    collective benchmark): every round then runs while every rank runs the same work, as in
    the training step that follows; every rank must time the same rounds, or the barriers do
    not pair up.
    """
    samples: list[list[list[float]]] = [[[] for _ in phases] for phases in steps]
    for i in range(warmup + iters):
        if barrier is not None:
            barrier()
        for k, phases in enumerate(steps):
            if before is not None:
                before()
            sync(device)
            last = time.perf_counter()
            for j, phase in enumerate(phases):
                phase()
                sync(device)
                now = time.perf_counter()
                if i >= warmup:
                    samples[k][j].append(now - last)
                last = now
    return [tuple(float(np.median(x)) for x in step) for step in samples]


def forward_backward(forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None],
                                                                   Callable[[], None]]:
    """The two phases of a training step of ``forward`` (which returns what to back-propagate:
    a scalar gets gradient 1, a tensor a random gradient), for :func:`time_rounds`."""
    box: list[torch.Tensor] = []

    def run_forward() -> None:
        box.append(forward())

    def run_backward() -> None:
        out = box.pop()
        out.backward(torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out))
    return run_forward, run_backward


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = alpha * x + beta`` with ``alpha, beta >= 0``.

    Timing noise can make the unconstrained fit negative; then the line through the origin
    (``beta = 0``) is used, and failing that the slope of the largest point.
    """
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    alpha, beta = np.polyfit(x, y, 1)
    if alpha > 0 and beta >= 0:
        return float(alpha), float(beta)
    through_origin = float((x @ y) / (x @ x))
    if through_origin > 0:
        return through_origin, 0.0
    return max(0.0, float(y[np.argmax(x)] / x.max())), 0.0


def fit_replicated_fraction(by_tp: dict[int, tuple[float, float]]) -> float:
    """``rho`` of ``slope_t = slope_1 ((1 - rho)/t + rho)``, least squares over the degrees
    t > 1 of a per-tp table of ``(per_sample_s, constant_s)``, clipped to [0, 1]."""
    base = by_tp.get(1, (0.0, 0.0))[0]
    pairs = [(slope - base / t, base * (1 - 1 / t)) for t, (slope, _) in by_tp.items() if t > 1]
    den = sum(x * x for _, x in pairs)
    if base <= 0 or den <= 0:
        return 0.0
    return min(1.0, max(0.0, sum(y * x for y, x in pairs) / den))
