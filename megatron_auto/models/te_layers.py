"""``--transformer-impl transformer_engine``: the transformer layer built from Transformer
Engine modules, behind the interface and the parameter names of :class:`TransformerLayer`.

Transformer Engine (``transformer_engine.pytorch``) fuses the norm into the following projection
(``LayerNormLinear``), runs attention in its own fused kernels (``DotProductAttention``) and,
with ``--fp8-format``, the GEMMs in FP8 (``fp8_autocast`` with a ``DelayedScaling`` recipe).
The layer here wires those modules exactly where the local layer has its own:

- ``self_attention.linear_qkv``: ``LayerNormLinear(h, h + 2 g d, parallel_mode="column")`` (``g``
  key/value groups: ``3h`` without grouped-query attention) whose norm
  is the local ``input_layernorm``; ``self_attention.core``: ``DotProductAttention`` over this
  rank's heads (``qkv_format="bshd"``, ``attn_mask_type`` causal / no_mask / arbitrary);
  ``self_attention.linear_proj``: ``Linear(h, h, parallel_mode="row")``;
- ``mlp.linear_fc1``: ``LayerNormLinear(h, f or 2f, parallel_mode="column")`` with the local
  ``pre_mlp_layernorm``; ``mlp.linear_fc2``: ``Linear(f, h, parallel_mode="row")``;
- every module gets the layer's TP group and size (``tp_group``, ``tp_size``) as TE's own
  arguments, and ``sequence_parallel=False`` (see below).

Parameter names. The fused norms' parameters (TE's ``layer_norm_weight`` / ``layer_norm_bias``)
are also registered as ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight`` (the same
tensors), before the modules that use them, so ``named_parameters`` yields the local layer's
FQNs: the plan-independent init, FSDP2 (shared parameters inside one unit), the weight-decay
rule and checkpoints see the same names and shapes as with ``--transformer-impl local``, and a
checkpoint moves between the two implementations. The weight layouts are the local ones (QKV
interleaved per head, SwiGLU gate/up interleaved): this layer splits the projections' outputs
itself, as the local one does, and applies rotary embeddings between ``linear_qkv`` and the
attention kernel.

Not wired: sequence parallelism (TE leaves the TP all-reduce of the norm-weight gradients to the
framework; refused with a clear error), FP8 amax reduction across ranks (each rank keeps its
own scaling history: ``reduce_amax=False``, so no collective runs inside a layer).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, ModelConfig
from ..parallel.context import LayerGroups
from ..parallel.random import TENSOR_PARALLEL, RNGTracker
from .moe import MoELayer
from .transformer import Rotary, TransformerLayer, apply_rotary
from .recompute import whole_layer_only


class TransformerImplError(ConfigError):
    """``--transformer-impl transformer_engine`` cannot run here; names the cause and the fix."""


def import_transformer_engine() -> Any:
    """``transformer_engine.pytorch``, or :class:`TransformerImplError` naming why not."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except Exception as err:  # noqa: BLE001 - TE fails in many ways (missing, CUDA, ABI)
        raise TransformerImplError(
            f"--transformer-impl=transformer_engine: Transformer Engine does not import here "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no detail'}); "
            f"install transformer_engine[pytorch] for this torch or use --transformer-impl "
            f"local") from None


def fp8_recipe(fp8_format: str) -> Any:
    """TE's ``DelayedScaling`` recipe for ``--fp8-format`` (``hybrid``: E4M3 forward, E5M2
    backward; ``e4m3``: E4M3 both ways), without cross-rank amax reduction."""
    recipe = importlib.import_module("transformer_engine.common.recipe")
    fmt = recipe.Format.HYBRID if fp8_format == "hybrid" else recipe.Format.E4M3
    return recipe.DelayedScaling(fp8_format=fmt, reduce_amax=False)


class _RngView:
    """What TE's ``get_rng_state_tracker()`` must return: an object whose ``fork()`` is a
    context on the tensor-parallel stream (each TP rank's heads draw their own dropout)."""

    def __init__(self, rng: RNGTracker) -> None:
        self.rng = rng

    def fork(self, name: str = "model-parallel-rng") -> contextlib.AbstractContextManager:
        return self.rng.fork(TENSOR_PARALLEL)


class _NormView(nn.Module):
    """The local norm's names (``weight``, ``bias``) for the parameters a fused
    ``LayerNormLinear`` owns: the same tensors, registered here first."""

    is_norm = True  # models/init.py: norm weights start at 1

    def __init__(self, fused: nn.Module) -> None:
        super().__init__()
        self.weight = fused.layer_norm_weight
        bias = getattr(fused, "layer_norm_bias", None)
        if bias is not None:
            self.bias = bias


def _shard_info(module: nn.Module, groups: LayerGroups, dims: dict[str, int]) -> nn.Module:
    """Record how the TE module's parameters are sharded (``models/init.py`` reads it)."""
    module.tp_shard_dims = dims
    module.tp_rank = groups.tp_rank
    module.tp_size = groups.tp_size
    module.tp_group = groups.tp_group
    return module


def _te_kwargs(groups: LayerGroups, device: torch.device | None) -> dict[str, Any]:
    return dict(sequence_parallel=False, tp_group=groups.tp_group, tp_size=groups.tp_size,
                params_dtype=torch.float32, device=device if device is not None else "cuda")


class TESelfAttention(nn.Module):
    """Attention from TE modules; the call signature of the local ``SelfAttention`` except that
    the input is the layer input (the norm is fused into ``linear_qkv``)."""

    def __init__(self, te: Any, config: ModelConfig, groups: LayerGroups,
                 rng: RNGTracker | None, *, causal: bool, device: torch.device | None) -> None:
        super().__init__()
        h, bias = config.hidden_size, config.add_bias_linear
        norm = "RMSNorm" if config.normalization == "rmsnorm" else "LayerNorm"
        kw = _te_kwargs(groups, device)
        self.linear_qkv = _shard_info(te.LayerNormLinear(
            h, h + 2 * config.kv_size, eps=config.layernorm_epsilon, bias=config.qkv_bias,
            normalization=norm, parallel_mode="column", **kw), groups, {"weight": 0, "bias": 0})
        self.core = te.DotProductAttention(
            config.num_attention_heads, config.head_dim, num_gqa_groups=config.query_groups,
            attention_dropout=config.attention_dropout, qkv_format="bshd",
            attn_mask_type="causal" if causal else "no_mask", sequence_parallel=False,
            tp_size=groups.tp_size, tp_group=groups.tp_group,
            get_rng_state_tracker=(lambda: _RngView(rng)) if rng is not None else None)
        self.linear_proj = _shard_info(te.Linear(h, h, bias=bias, parallel_mode="row", **kw),
                                       groups, {"weight": 1})
        self.num_local_heads = config.num_attention_heads // groups.tp_size
        self.num_local_groups = config.query_groups // groups.tp_size
        self.heads_per_group = config.num_attention_heads // config.query_groups
        self.head_dim = config.head_dim

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                rotary: Rotary = None) -> torch.Tensor:
        qkv = self.linear_qkv(x)  # (b, s, (h + 2 g d)/tp): norm(x) projected
        b, s = qkv.shape[:2]
        n = self.heads_per_group  # the local layer's layout: per key/value group, n queries, k, v
        qkv = qkv.view(b, s, self.num_local_groups, n + 2, self.head_dim)
        if n == 1:
            q, k, v = qkv.unbind(3)  # each (b, s, heads, d): TE's bshd
        else:
            q = qkv[:, :, :, :n].flatten(2, 3)  # (b, s, heads, d), group-major
            k, v = qkv[:, :, :, n], qkv[:, :, :, n + 1]  # (b, s, groups, d)
        if rotary is not None:  # apply_rotary works on (b, heads, s, d)
            q = apply_rotary(q.transpose(1, 2), *rotary).transpose(1, 2)
            k = apply_rotary(k.transpose(1, 2), *rotary).transpose(1, 2)
        if attn_mask is None:
            out = self.core(q, k, v)
        else:  # ours: True = attend; TE's: True = masked out
            out = self.core(q, k, v, attention_mask=~attn_mask, attn_mask_type="arbitrary")
        return self.linear_proj(out.reshape(b, s, self.num_local_heads * self.head_dim))


class TEMLP(nn.Module):
    """``fc2(act(fc1(norm(x))))`` with the norm fused into fc1 (TE ``LayerNormLinear``)."""

    def __init__(self, te: Any, config: ModelConfig, groups: LayerGroups, *,
                 device: torch.device | None) -> None:
        super().__init__()
        h, f, bias = config.hidden_size, config.ffn_hidden_size, config.add_bias_linear
        self.swiglu = config.activation == "swiglu"
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        norm = "RMSNorm" if config.normalization == "rmsnorm" else "LayerNorm"
        kw = _te_kwargs(groups, device)
        self.linear_fc1 = _shard_info(te.LayerNormLinear(
            h, 2 * f if self.swiglu else f, eps=config.layernorm_epsilon, bias=bias,
            normalization=norm, parallel_mode="column", **kw), groups, {"weight": 0, "bias": 0})
        self.linear_fc2 = _shard_info(te.Linear(f, h, bias=bias, parallel_mode="row", **kw),
                                      groups, {"weight": 1})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.swiglu:
            y = y.unflatten(-1, (-1, 2))  # rows interleave (gate, up), as in the local MLP
            y = torch.nn.functional.silu(y[..., 0]) * y[..., 1]
        else:
            y = torch.nn.functional.gelu(y, approximate=self.gelu_approximate)
        return self.linear_fc2(y)


class TETransformerLayer(TransformerLayer):
    """The local layer's interface, dropout streams, residuals and recompute, with TE modules
    for the norms, projections and attention kernel (module docstring)."""

    def __init__(self, config: ModelConfig, groups: LayerGroups, *, rng: RNGTracker | None = None,
                 causal: bool = True, recompute: bool = False, sequence_parallel: bool = False,
                 device: torch.device | None = None) -> None:
        nn.Module.__init__(self)
        config.check_tensor_parallel(groups.tp_size, what="layer tp")
        if sequence_parallel:
            raise TransformerImplError(
                "--transformer-impl=transformer_engine: not wired with sequence parallelism "
                "yet (a layer of the plan has sequence_parallel=true); use --transformer-impl "
                "local for sequence-parallel plans")
        te = import_transformer_engine()
        self.sequence_parallel = False
        attention = TESelfAttention(te, config, groups, rng, causal=causal, device=device)
        mlp = TEMLP(te, config, groups, device=device)
        # Registration order = the local layer's, so the shared norm tensors get its names.
        self.input_layernorm = _NormView(attention.linear_qkv)
        self.self_attention = attention
        self.pre_mlp_layernorm = _NormView(mlp.linear_fc1)
        self.mlp = mlp
        self.hidden_dropout = config.hidden_dropout
        self.recompute = whole_layer_only(recompute, "Transformer Engine")
        self.offload_all = False  # refused before construction (make_transformer_layer)
        self.rng = rng
        self.groups = groups
        self.fp8 = fp8_recipe(config.fp8_format) if config.fp8_format else None
        self._te = te

    def _forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None,
                 rotary: Rotary) -> torch.Tensor:
        fp8 = (self._te.fp8_autocast(enabled=True, fp8_recipe=self.fp8)
               if self.fp8 is not None else contextlib.nullcontext())
        with fp8:
            x = x + self._dropout(self.self_attention(x, attn_mask, rotary))
            return x + self._dropout(self.mlp(x))


def make_transformer_layer(config: ModelConfig, groups: LayerGroups, *,
                           rng: RNGTracker | None = None, causal: bool = True,
                           recompute: bool = False, sequence_parallel: bool = False,
                           device: torch.device | None = None, moe: bool = False,
                           expert_groups: Any = None,
                           cp_mode: str = "ring", offload: Any = False) -> nn.Module:
    """The layer ``config.transformer_impl`` asks for (local, or Transformer Engine's); with
    ``moe`` a local layer whose MLP is the MoE block (models/moe.py) on ``expert_groups``
    (``ParallelContext.expert_groups``; None: no expert fields in the plan). ``offload``: the
    plan's activation offload (local layers only)."""
    if moe:
        if sequence_parallel:
            raise ValueError("sequence_parallel=True: an MoE layer runs without sequence "
                             "parallelism; turn SP off for it")
        return TransformerLayer(config, groups, rng=rng, causal=causal, recompute=recompute,
                                fused_norm=device is not None
                                and torch.device(device).type == "cuda",
                                mlp=MoELayer(config, groups, expert_groups=expert_groups),
                                cp_mode=cp_mode, offload=offload)
    if config.transformer_impl == "transformer_engine":
        if groups.cp_size > 1:
            raise ValueError(f"--transformer-impl transformer_engine with context parallelism "
                             f"(cp={groups.cp_size}): our CP attention is the local layer's; "
                             f"use --transformer-impl local or cp 1")
        if offload is not False:
            raise ValueError(f"plan field offload={offload!r}: the Transformer Engine layer does "
                             f"not offload activations yet; use --transformer-impl local or "
                             f"offload false")
        return TETransformerLayer(config, groups, rng=rng, causal=causal, recompute=recompute,
                                  sequence_parallel=sequence_parallel, device=device)
    # apex's fused norms on CUDA when apex imports (torch's otherwise: same parameters)
    return TransformerLayer(config, groups, rng=rng, causal=causal, recompute=recompute,
                            sequence_parallel=sequence_parallel,
                            fused_norm=device is not None and torch.device(device).type == "cuda",
                            cp_mode=cp_mode, offload=offload)
