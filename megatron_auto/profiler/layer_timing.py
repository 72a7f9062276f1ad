"""How the model profilers time a layer and fit the times: interleaved rounds of every
micro-batch size (optionally started on every rank at once), and the straight-line and
TP-efficiency fits of what they measured (docs/profiling.md §2)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Set by :func:`ranks_measure_together`: called before every timing round.
_ROUND_BARRIER: list[Callable[[], None]] = []


@contextlib.contextmanager
def ranks_measure_together(barrier: Callable[[], None]) -> Any:
    """Inside, every timing round of the profilers starts with ``barrier()``.

    For runs whose every rank measures the model at once (``--auto-parallel`` on ranks that
    share a machine): each round is then timed while every rank runs the same work, as in
    the training step that follows, instead of while another rank happens to meter memory or
    sit between measurements. Every rank must run the same measurements (the same model and
    config), or the barriers do not pair up.
    """
    _ROUND_BARRIER.append(barrier)
    try:
        yield
    finally:
        _ROUND_BARRIER.pop()


def _time_rounds(forwards: Sequence[Callable[[], torch.Tensor]], warmup: int, iters: int,
                 device: torch.device) -> tuple[list[float], list[float]]:
    """Median seconds of the forward and of the backward of each closure.

    Each of ``warmup + iters`` rounds runs every closure once (one forward and backward each,
    the two halves timed separately): interleaving the micro-batch sizes puts a slow stretch
    of a shared machine on all of them alike rather than on one size, which would bend the
    fitted line (one size timed alone per block left a CPU profile's per-call constant
    anywhere between 0 and 9.9 ms from run to run). Timing both halves of the same step keeps
    the forward and backward medians comparable.
    """
    fwd: list[list[float]] = [[] for _ in forwards]
    bwd: list[list[float]] = [[] for _ in forwards]
    for i in range(warmup + iters):
        for barrier in _ROUND_BARRIER[-1:]:
            barrier()
        for k, forward in enumerate(forwards):
            _sync(device)
            start = time.perf_counter()
            out = forward()
            _sync(device)
            middle = time.perf_counter()
            out.backward(torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out))
            _sync(device)
            if i >= warmup:
                fwd[k].append(middle - start)
                bwd[k].append(time.perf_counter() - middle)
    return ([float(np.median(x)) for x in fwd], [float(np.median(x)) for x in bwd])


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
