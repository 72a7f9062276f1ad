"""Throughput arithmetic and the ``--metrics-file`` writer (docs/design.md §5.3).

Model FLOPs count the matrix multiplications of forward and backward (backward = 2 x forward),
per token: per layer ``2 * (2 h^2 + 2 h kv + k h f)`` for the QKV/output projections and the
MLP (``kv`` the key/value width, ``h`` without grouped-query attention; ``k = 2`` for GeLU, 3 for
SwiGLU's gate), ``2 * 2 * s * h`` for attention scores and values,
and ``2 * h * V`` for the LM head. Recomputation is not counted (model FLOPs, not hardware
FLOPs), so TFLOP/s and MFU compare plans fairly.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch

from ..config import ModelConfig

# Dense peak TFLOP/s by CUDA device name fragment: (bf16/fp16, fp32). Spec-sheet values.
_PEAK_TFLOPS = {"H200": (989.0, 67.0), "H100": (989.0, 67.0), "A100": (312.0, 19.5),
                "A800": (312.0, 19.5), "L40S": (362.0, 91.6), "V100": (125.0, 15.7)}


def model_flops_per_token(config: ModelConfig) -> float:
    """Forward + backward model FLOPs for one token (see the module docstring).

    A model config with its own ``model_flops_per_token()`` (the vision classifiers: window
    attention, patch merging) is asked instead.
    """
    own = getattr(config, "model_flops_per_token", None)
    if callable(own):
        return float(own())
    h, f, s = config.hidden_size, config.ffn_hidden_size, config.seq_length
    mlp_mats = 3 if config.activation == "swiglu" else 2
    kv = getattr(config, "kv_size", h)
    per_layer = 2 * (2 * h * h + 2 * h * kv + mlp_mats * h * f) + 4 * s * h
    forward = config.num_layers * per_layer + 2 * h * config.padded_vocab_size
    return 3.0 * forward


def device_peak_tflops(device: torch.device, low_precision: bool) -> float | None:
    """Spec-sheet dense peak of ``device`` for the compute dtype, or None when unknown (CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, (low, fp32) in _PEAK_TFLOPS.items():
        if fragment in name:
            return low if low_precision else fp32
    return None


class MetricsWriter:
    """Appends one JSON object per call to ``path`` (only where ``enabled``, i.e. rank 0)."""

    def __init__(self, path: str | None, enabled: bool) -> None:
        self.path = path if enabled else None
        if self.path:
            parent = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(parent, exist_ok=True)

    def write(self, record: Mapping[str, Any]) -> None:
        if not self.path:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(dict(record), allow_nan=True) + "\n")


def predicted_metrics(estimate: Mapping[str, Any]) -> dict[str, float]:
    """The planner's prediction for a metrics record: iteration time and the largest stage peak."""
    out: dict[str, float] = {}
    if "iteration_time_s" in estimate:
        out["predicted_iteration_time_s"] = float(estimate["iteration_time_s"])
    stages = estimate.get("stages") or []
    if stages and all("peak_memory_bytes" in s for s in stages):
        out["predicted_peak_memory_bytes"] = float(max(s["peak_memory_bytes"] for s in stages))
    return out


def _versus(predicted: float, measured: float | None, unit: float, label: str) -> str:
    if not measured:
        return f"{predicted / unit:.1f} predicted, not measured"
    return (f"{predicted / unit:.1f} predicted vs {measured / unit:.1f} measured "
            f"({(predicted / measured - 1) * 100:+.1f}%) {label}")


def format_prediction_line(record: Mapping[str, Any]) -> str:
    """How far the plan's estimate is from what this run measures (printed once, rank 0)."""
    parts = ["> planner estimate vs this run: iteration time "
             + _versus(record["predicted_iteration_time_s"], record.get("iteration_time_s"),
                       1e-3, "ms")]
    if "predicted_peak_memory_bytes" in record:
        parts.append("peak memory " + _versus(record["predicted_peak_memory_bytes"],
                                              record.get("peak_memory_bytes"), 2**20, "MiB"))
    return " | ".join(parts)
