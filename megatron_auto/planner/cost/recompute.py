"""The cost of recomputing single modules of a layer (plan ``recompute`` "selective" or a list).

What models/recompute.py does, priced per module ``m`` of a layer at TP ``t``:

- ``core_attn``: the checkpoint keeps q, k, v (which attention keeps anyway) and releases what
  the attention kernel keeps beyond them: the profile's ``attention_kept_quadratic_bytes`` when
  it has them, else ``gpu_terms.attention_kept_bytes`` (math kernel: softmax output, its
  dropout mask and the dropped-out probabilities, ``(2 beta + mask) a s k`` per sample,
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Table 2; fused kernels keep only a log-sum-exp, so nothing worth recomputing), split over TP
  with the heads. Backward re-runs the core attention once: ``profile.attention_time``.
- ``mlp``: the checkpoint keeps the MLP input (fc1 keeps it anyway) and releases fc1's output
  and the activation's output, ``2 beta s f`` (GeLU) or ``3 beta s f`` (SwiGLU: gate, up and
  their product) per sample, split over TP. Backward re-runs the MLP: the forward time times
  the MLP's share of the layer's FLOPs.
- ``norm``: the checkpoint keeps the norm's input and the next projection still keeps the norm's
  output, so only the norm's statistics (a few bytes per token) are released: priced as
  nothing released and no time, unless measured. The search never prefers it; plans may still
  ask for it.

A measured profile (profiler/module_profiler.py) carries each module's saved bytes and forward
time per sample at tp 1 (``module_saved_bytes``, ``module_forward_time_s``); where a module has
them they replace the analytic terms above: ``core_attn`` and ``mlp`` bytes and time split by
``t`` (heads, FFN columns), ``norm`` on every TP rank whole. The core attention's time is then
the measured ``attention_time`` at the layer's length.

While backward rebuilds a module its released bytes exist again for that module's backward
only: the largest module's bytes of one micro-batch are transient (a peak term).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from ..inputs.attention_terms import layer_core_flops
from ..inputs.model_spec import LayerType
from ..inputs.profile_records import LayerTypeProfile
from .gpu_terms import NO_SCORES_BACKENDS, attention_kept_bytes


@dataclass(frozen=True)
class ModuleRecompute:
    """Per sample at one TP degree: bytes a micro-batch no longer keeps, the largest single
    module's share of them (transient while it is rebuilt), and forward seconds re-run."""

    released_bytes: float = 0.0
    largest_module_bytes: float = 0.0
    forward_time_s: float = 0.0


NONE = ModuleRecompute()


def module_terms(profile: LayerTypeProfile, layer_type: LayerType, modules: Collection[str],
                 tp: int, samples: float, compute_bytes: int, mask_bytes: int
                 ) -> ModuleRecompute:
    """What recomputing ``modules`` of one layer of ``layer_type`` saves and
    costs for ``samples`` samples per rank (module docstring). Empty ``modules``: nothing."""
    if not modules:
        return NONE
    per_module: dict[str, float] = {}
    time = 0.0
    beta = compute_bytes
    saved, forward = profile.module_saved_bytes, profile.module_forward_time_s
    if "core_attn" in modules and "core_attn" in saved:  # measured: split with the heads
        per_module["core_attn"] = saved["core_attn"] / tp
        time += profile.attention_time(layer_type.seq_length, samples, tp)
    elif "core_attn" in modules and profile.attention_backend not in NO_SCORES_BACKENDS:
        kept = profile.attention_kept_quadratic_bytes or attention_kept_bytes(
            beta, layer_type.num_attention_heads, layer_type.seq_length,
            layer_type.attended_tokens, profile.attention_backend, mask_bytes)
        per_module["core_attn"] = kept / tp
        time += profile.attention_time(layer_type.seq_length, samples, tp)
    if "mlp" in modules and "mlp" in saved:  # measured: split with the FFN columns
        per_module["mlp"] = saved["mlp"] / tp
        time += forward.get("mlp", 0.0) * samples / tp
    elif "mlp" in modules:
        s, f, h = layer_type.seq_length, layer_type.ffn_hidden_size, layer_type.hidden_size
        mats = 3 if layer_type.activation == "swiglu" else 2
        per_module["mlp"] = mats * beta * s * f / tp
        share = 2 * s * h * f * mats / layer_core_flops(layer_type, profile.attention_backend)
        time += share * profile.forward_time(samples, tp)
    if "norm" in modules and "norm" in saved:  # measured: the statistics, on every TP rank
        per_module["norm"] = saved["norm"]
        time += forward.get("norm", 0.0) * samples
    released = sum(per_module.values())
    return ModuleRecompute(released_bytes=released * samples,
                           largest_module_bytes=max(per_module.values(), default=0.0) * samples,
                           forward_time_s=time)
