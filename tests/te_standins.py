"""CPU stand-ins for Transformer Engine and apex, for testing our wiring without the packages.

Each class has the constructor and call signature of the real one (Transformer Engine 2.x
``transformer_engine.pytorch.LayerNormLinear`` / ``Linear`` / ``DotProductAttention`` /
``fp8_autocast`` and ``transformer_engine.common.recipe``; apex ``normalization.FusedLayerNorm`` /
``FusedRMSNorm``, as their documentation states them) and the numerics of our local layers
(the same torch ops and TP mappings), so a test comparing ``--transformer-impl
transformer_engine`` with ``local`` checks argument mapping, TP groups, parameter names and
shapes, and numerics, not TE's kernels. ``CALLS`` records every construction's arguments.

``install(monkeypatch)`` puts them in ``sys.modules`` (forked gloo ranks inherit them).
"""

from __future__ import annotations

import contextlib
import enum
import importlib.machinery
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_auto.parallel.mappings import copy_to_tensor_parallel, reduce_from_tensor_parallel

CALLS: list[tuple[str, dict[str, Any]]] = []


def _tp_size(tp_group: Any, tp_size: int) -> int:
    # TE: the group's size when a group is given, else tp_size
    return dist.get_world_size(tp_group) if tp_group is not None else tp_size


class LayerNormLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_group: Any = None, tp_size: int = 1, get_rng_state_tracker: Any = None,
                 init_method: Any = None, bias: bool = True, normalization: str = "LayerNorm",
                 return_bias: bool = False, params_dtype: torch.dtype | None = None,
                 parallel_mode: str | None = None, return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False, parameters_split: Any = None,
                 zero_centered_gamma: bool = False, device: Any = "cuda",
                 ub_overlap_ag: bool = False, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_name: str | None = None,
                 delay_wgrad_compute: bool = False, symmetric_ar_type: str | None = None,
                 name: str | None = None) -> None:
        super().__init__()
        CALLS.append(("LayerNormLinear", {k: v for k, v in locals().items()
                                          if k not in ("self", "__class__")}))
        assert normalization in ("LayerNorm", "RMSNorm") and parallel_mode in (None, "column",
                                                                               "row")
        self.tp_group, self.tp_size = tp_group, _tp_size(tp_group, tp_size)
        self.parallel_mode, self.eps, self.normalization = parallel_mode, eps, normalization
        self.in_features = in_features
        out = out_features // self.tp_size if parallel_mode == "column" else out_features
        kw = dict(device=device, dtype=params_dtype)
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, **kw))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.zeros(in_features, **kw))
        else:
            self.register_parameter("layer_norm_bias", None)
        self.weight = nn.Parameter(torch.empty(out, in_features, **kw))
        self.bias = nn.Parameter(torch.zeros(out, **kw)) if bias else None

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None,
                fp8_output: bool = False) -> torch.Tensor:
        if self.normalization == "LayerNorm":
            x = F.layer_norm(inp, (self.in_features,), self.layer_norm_weight,
                             self.layer_norm_bias, self.eps)
        else:
            x = F.rms_norm(inp, (self.in_features,), self.layer_norm_weight, self.eps)
        if self.parallel_mode == "column" and self.tp_size > 1:
            x = copy_to_tensor_parallel(x, self.tp_group)  # the input gradient is all-reduced
        return F.linear(x, self.weight, self.bias)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group: Any = None, tp_size: int = 1,
                 get_rng_state_tracker: Any = None, rng_tracker_name: str | None = None,
                 init_method: Any = None, bias: bool = True, return_bias: bool = False,
                 params_dtype: torch.dtype | None = None, parallel_mode: str | None = None,
                 parameters_split: Any = None, device: Any = "cuda",
                 ub_overlap_rs: bool = False, ub_overlap_ag: bool = False,
                 ub_name: str | None = None, delay_wgrad_compute: bool = False,
                 symmetric_ar_type: str | None = None, name: str | None = None) -> None:
        super().__init__()
        CALLS.append(("Linear", {k: v for k, v in locals().items()
                                 if k not in ("self", "__class__")}))
        assert parallel_mode in (None, "column", "row")
        self.tp_group, self.tp_size = tp_group, _tp_size(tp_group, tp_size)
        self.parallel_mode = parallel_mode
        kw = dict(device=device, dtype=params_dtype)
        local_in = in_features // self.tp_size if parallel_mode == "row" else in_features
        local_out = out_features // self.tp_size if parallel_mode == "column" else out_features
        self.weight = nn.Parameter(torch.empty(local_out, local_in, **kw))
        self.bias = nn.Parameter(torch.zeros(local_out, **kw)) if bias else None

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None,
                fp8_output: bool = False) -> torch.Tensor:
        if self.parallel_mode == "row" and self.tp_size > 1:
            y = reduce_from_tensor_parallel(F.linear(inp, self.weight), self.tp_group)
            return y if self.bias is None else y + self.bias  # bias after the reduction
        return F.linear(inp, self.weight, self.bias)


class DotProductAttention(nn.Module):
    def __init__(self, num_attention_heads: int, kv_channels: int | tuple[int, int],
                 num_gqa_groups: int | None = None, attention_dropout: float = 0.0,
                 qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 window_size: tuple[int, int] | None = None, sequence_parallel: bool = False,
                 tp_size: int = 1, get_rng_state_tracker: Any = None, tp_group: Any = None,
                 layer_number: int | None = None, attention_type: str = "self",
                 cp_group: Any = None, cp_global_ranks: Any = None, cp_stream: Any = None,
                 cp_comm_type: str = "p2p", softmax_scale: float | None = None,
                 softmax_type: str = "vanilla") -> None:
        super().__init__()
        CALLS.append(("DotProductAttention", {k: v for k, v in locals().items()
                                              if k not in ("self", "__class__")}))
        assert qkv_format in ("sbhd", "bshd", "thd")
        self.qkv_format, self.attn_mask_type = qkv_format, attn_mask_type
        self.attention_dropout = attention_dropout
        self.get_rng_state_tracker = get_rng_state_tracker
        self.tp_size = _tp_size(tp_group, tp_size)
        self.num_local_heads = num_attention_heads // self.tp_size
        self.num_local_groups = (num_gqa_groups or num_attention_heads) // self.tp_size

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor,
                value_layer: torch.Tensor, attention_mask: torch.Tensor | None = None,
                qkv_format: str | None = None, cu_seqlens_q: Any = None,
                cu_seqlens_kv: Any = None, max_seqlen_q: int | None = None,
                max_seqlen_kv: int | None = None, attn_mask_type: str | None = None,
                window_size: Any = None, checkpoint_core_attention: bool = False,
                core_attention_bias_type: str = "no_bias", core_attention_bias: Any = None,
                alibi_slopes: Any = None, fast_zero_fill: bool = True,
                inference_params: Any = None) -> torch.Tensor:
        fmt = qkv_format or self.qkv_format
        assert fmt == "bshd", "the stand-in implements the bshd layout our layer uses"
        assert query_layer.shape[2] == self.num_local_heads
        assert key_layer.shape[2] == value_layer.shape[2] == self.num_local_groups
        gqa = {"enable_gqa": True} if self.num_local_groups != self.num_local_heads else {}
        mask_type = attn_mask_type or self.attn_mask_type
        q, k, v = (t.transpose(1, 2) for t in (query_layer, key_layer, value_layer))
        p = self.attention_dropout if self.training else 0.0
        mask = None if attention_mask is None else ~attention_mask  # TE: True = masked out
        stream = (self.get_rng_state_tracker().fork()
                  if p > 0.0 and self.get_rng_state_tracker is not None
                  else contextlib.nullcontext())
        with stream:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                 is_causal=mask_type == "causal", **gqa)
        b, s = query_layer.shape[:2]
        return out.transpose(1, 2).reshape(b, s, -1)


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Any = None,
                 fp8_group: Any = None, _graph: bool = False):
    CALLS.append(("fp8_autocast", {"enabled": enabled, "fp8_recipe": fp8_recipe,
                                   "fp8_group": fp8_group}))
    yield  # numerics unchanged: FP8 itself is not emulated on CPU


class Format(enum.Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


class DelayedScaling:
    def __init__(self, margin: int = 0, fp8_format: Format = Format.HYBRID,
                 amax_history_len: int = 1024, amax_compute_algo: str = "max",
                 scaling_factor_compute_algo: Any = None, reduce_amax: bool = True,
                 fp8_dpa: bool = False, fp8_mha: bool = False) -> None:
        self.margin, self.fp8_format, self.reduce_amax = margin, fp8_format, reduce_amax
        self.amax_history_len, self.amax_compute_algo = amax_history_len, amax_compute_algo


class FusedLayerNorm(nn.LayerNorm):
    def __init__(self, normalized_shape: Any, eps: float = 1e-5,
                 elementwise_affine: bool = True) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
        CALLS.append(("FusedLayerNorm", {"normalized_shape": normalized_shape, "eps": eps}))


class FusedRMSNorm(nn.RMSNorm):
    def __init__(self, normalized_shape: Any, eps: float = 1e-5,
                 elementwise_affine: bool = True) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
        CALLS.append(("FusedRMSNorm", {"normalized_shape": normalized_shape, "eps": eps}))


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)  # find_spec finds it
    mod.__dict__.update(attrs)
    return mod


def modules() -> dict[str, types.ModuleType]:
    """The stand-in packages by module name."""
    recipe = _module("transformer_engine.common.recipe", Format=Format,
                     DelayedScaling=DelayedScaling)
    common = _module("transformer_engine.common", recipe=recipe)
    pytorch = _module("transformer_engine.pytorch", LayerNormLinear=LayerNormLinear,
                      Linear=Linear, DotProductAttention=DotProductAttention,
                      fp8_autocast=fp8_autocast)
    te = _module("transformer_engine", pytorch=pytorch, common=common)
    norm = _module("apex.normalization", FusedLayerNorm=FusedLayerNorm,
                   FusedRMSNorm=FusedRMSNorm)
    apex = _module("apex", normalization=norm)
    return {m.__name__: m for m in (te, common, recipe, pytorch, apex, norm)}


def install(monkeypatch: Any) -> list[tuple[str, dict[str, Any]]]:
    """Put the stand-ins in ``sys.modules`` for this test; returns ``CALLS`` (emptied)."""
    for name, mod in modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    CALLS.clear()
    return CALLS
