"""A transformer layer's modules measured one by one: what recomputing each releases and repeats.

The plan's per-layer ``recompute`` may name single modules (``core_attn``, ``mlp``, ``norm``;
models/recompute.py). Recomputing a module keeps its inputs (the checkpoint holds them) and
drops everything else the module saves for backward; backward then re-runs the module's
forward. So the two numbers the cost model needs per module are the bytes the module saves
beyond its inputs and its forward time. This profiler measures both on the runtime's own
modules of the layer being profiled, each called on its own inputs:

- ``core_attn``: ``SelfAttention.core_attention`` (scores, softmax, attention dropout, the
  weighted sum) on random q, k, v of this layer's heads;
- ``mlp``: ``layer.mlp`` on a random ``(b, s, h)``;
- ``norm``: one norm on a random ``(b, s, h)``, counted twice (a layer has two).

Bytes are the distinct storages autograd saves while the module runs, leaving out parameters
and the module's inputs (``activation_meter.SavedTensorMeter``); time is the median forward
of the profiler's timing rounds (``timing.time_rounds``, barrier included). Both are fitted
over the micro-batch sizes (slopes: per sample).

The core attention is also measured at shorter sequence lengths (:data:`LENGTH_FRACTIONS` of
the layer's), which gives what context parallelism and the quadratic rule of
``LayerTypeProfile.attention_time`` need: ``attention_time_by_seq_length`` measured rather
than derived from the layer's FLOPs, and ``attention_kept_quadratic_bytes``, the part of the
kept bytes that grows with the square of the length (a least-squares fit of
``bytes(L) / L = a + c L`` over the lengths; the quadratic part at the layer's length is
``c s^2``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .activation_meter import SavedTensorMeter
from .measure import Barrier, ModelProfilerConfig
from .timing import fit_line, time_rounds

#: Lengths at which the core attention is measured, as fractions of the layer's sequence
#: length (those that leave at least :data:`MIN_LENGTH` tokens).
LENGTH_FRACTIONS = (0.25, 0.5, 1.0)
MIN_LENGTH = 8


def _saved_bytes(module: torch.nn.Module, run: Callable[[], torch.Tensor],
                 inputs: Sequence[torch.Tensor]) -> float:
    meter = SavedTensorMeter(module, exclude=inputs, classifier=lambda t, m: True)
    with meter:
        out = run()
    del out
    return float(meter.total_bytes)


def _series(module: torch.nn.Module, make: Callable[[int], tuple[Callable[[], Any], list]],
            sizes: Sequence[int], config: ModelProfilerConfig, dev: torch.device,
            barrier: Barrier) -> tuple[float, float]:
    """(bytes saved per sample, forward seconds per sample) of ``make(b)``'s closure."""
    runs = [make(b) for b in sizes]
    saved = [_saved_bytes(module, run, inputs) for run, inputs in runs]
    times = [t for (t,) in time_rounds([[run] for run, _ in runs], config.warmup_iters,
                                       config.iters, dev, barrier=barrier)]
    return fit_line(sizes, saved)[0], fit_line(sizes, times)[0]


def attention_lengths(seq_length: int) -> tuple[int, ...]:
    """The sequence lengths the core attention is measured at (the layer's own included)."""
    lengths = {max(1, int(round(seq_length * f))) for f in LENGTH_FRACTIONS}
    return tuple(sorted(n for n in lengths if n >= MIN_LENGTH or n == seq_length))


def quadratic_bytes(lengths: Sequence[int], per_sample: Sequence[float], seq_length: int) -> float:
    """``c s^2`` of the least-squares ``bytes(L) / L = a + c L`` (0 with one length or c < 0)."""
    if len(lengths) < 2:
        return 0.0
    x = np.asarray(lengths, dtype=np.float64)
    c = float(np.polyfit(x, np.asarray(per_sample, dtype=np.float64) / x, 1)[0])
    return max(0.0, c) * seq_length ** 2


def profile_modules(layer: Any, cfg: Any, sizes: Sequence[int], config: ModelProfilerConfig,
                    dev: torch.device, amp: Callable[[], contextlib.AbstractContextManager],
                    barrier: Barrier) -> dict[str, Any]:
    """The ``LayerTypeProfile`` fields of the module docstring for ``layer`` (a
    ``TransformerLayer`` at tp 1 in training mode): ``module_saved_bytes``,
    ``module_forward_time_s``, ``attention_time_by_seq_length`` and
    ``attention_kept_quadratic_bytes``."""
    s, h = cfg.seq_length, cfg.hidden_size
    attention = layer.self_attention
    heads, groups, d = attention.num_local_heads, attention.num_local_groups, attention.head_dim

    def attention_run(length: int) -> Callable[[int], tuple[Callable[[], Any], list]]:
        def make(b: int) -> tuple[Callable[[], Any], list]:
            q = torch.randn(b, heads, length, d, device=dev, requires_grad=True)
            k = torch.randn(b, groups, length, d, device=dev, requires_grad=True)
            v = torch.randn(b, groups, length, d, device=dev, requires_grad=True)

            def run() -> torch.Tensor:
                with amp():
                    return attention.core_attention(q, k, v, None)
            return run, [q, k, v]
        return make

    def hidden_run(fn: Callable[[torch.Tensor], torch.Tensor]
                   ) -> Callable[[int], tuple[Callable[[], Any], list]]:
        def make(b: int) -> tuple[Callable[[], Any], list]:
            x = torch.randn(b, s, h, device=dev, requires_grad=True)

            def run() -> torch.Tensor:
                with amp():
                    return fn(x)
            return run, [x]
        return make

    lengths = attention_lengths(s)
    by_length = {n: _series(attention, attention_run(n), sizes, config, dev, barrier)
                 for n in lengths}
    mlp_bytes, mlp_time = _series(layer.mlp, hidden_run(layer.mlp), sizes, config, dev, barrier)
    norm = layer.input_layernorm  # at tp 1 (no SP) the layer applies its norms as they are
    norm_bytes, norm_time = _series(norm, hidden_run(norm), sizes, config, dev, barrier)
    attn_bytes, attn_time = by_length[s]
    return {
        "module_saved_bytes": {"core_attn": attn_bytes, "mlp": mlp_bytes,
                               "norm": 2 * norm_bytes},
        "module_forward_time_s": {"core_attn": attn_time, "mlp": mlp_time,
                                  "norm": 2 * norm_time},
        "attention_time_by_seq_length": {n: t for n, (_, t) in by_length.items()},
        "attention_kept_quadratic_bytes": quadratic_bytes(
            lengths, [b for b, _ in by_length.values()], s),
    }
