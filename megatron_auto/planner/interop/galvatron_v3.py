"""What Galvatron 3 (its main branch) adds to the 2.4 files, read and checked.

``galvatron.py`` reads the 2.4 layouts, which 3.0 still writes (sequence-length keyed time and
memory records, ``*_sp`` records); this module holds the 3.0 additions:

- Plans (``galvatron_config_*.json``): ``cp_sizes_enc`` (context-parallel degree per layer),
  ``ep_sizes_enc`` / ``tp_of_ep_sizes_enc`` (MoE expert parallelism and the experts' tensor
  parallelism per layer) and ``dispatcher`` (``alltoall`` / ``allgather``: how tokens reach the
  experts). They become our layers' ``cp`` (``cp_mode`` ring) / ``ep`` / ``expert_tp``. What
  we do not run is
  refused in one line: CP degrees that differ between layers (ours is one degree per plan) and
  an unknown dispatcher.
- Memory profiles: the ``model_config`` block (``dim``, ``n_heads``, ``n_kv_heads``,
  ``ffn_dim``, ``n_layers``, ...) that names the profiled model; those fields are checked against
  the model being planned, naming the field and both values (``vocab_size`` is not: ours is
  padded).
- Computation profiles: per-module times (Galvatron's ``--profile_unit attention`` / ``mlp``,
  keys ending ``_attention`` / ``_mlp``, what its MoE profiles hold) are refused: our cost model
  prices whole layers, so a layer time from one module would under-estimate it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ...plan import Plan
from .galvatron_files import GalvatronFormatError
from ..inputs.model_spec import ModelSpec

#: Plan keys Galvatron 3 writes beside the 2.4 ones
PLAN_KEYS = frozenset({"cp_sizes_enc", "ep_sizes_enc", "tp_of_ep_sizes_enc", "dispatcher"})
DISPATCHERS = ("alltoall", "allgather")


def layer_fields(path: str, data: Mapping[str, Any], n: int,
                 int_list: Callable[[str, Mapping[str, Any], str, int], list[int]]
                 ) -> tuple[list[dict[str, int]], list[str]]:
    """Per layer the ``LayerStrategy`` fields the Galvatron 3 keys of plan ``data`` set (``cp``,
    ``ep``, ``expert_tp``; absent keys leave them at 1), and notes for the plan's search notes.
    ``int_list`` reads one comma-separated per-layer key (galvatron.py's checks)."""
    fields: list[dict[str, int]] = [{} for _ in range(n)]
    notes: list[str] = []
    if "cp_sizes_enc" in data:
        cps = int_list(path, data, "cp_sizes_enc", n)
        if any(c < 1 for c in cps):
            raise GalvatronFormatError(f"galvatron config {path}: key 'cp_sizes_enc' has "
                                       f"{min(cps)}; a context-parallel degree is at least 1")
        if len(set(cps)) > 1:
            raise GalvatronFormatError(
                f"galvatron config {path}: key 'cp_sizes_enc' gives the layers different "
                f"context-parallel degrees {sorted(set(cps))}; megatron_auto runs one CP degree "
                f"for the whole plan: search again with one cp size")
        if cps and cps[0] > 1:
            for f in fields:
                f["cp"] = cps[0]
            notes.append(f"cp_sizes_enc: context parallelism {cps[0]} on every layer (our "
                         f"cp_mode ring; the file names no mode)")
    for key, name in (("ep_sizes_enc", "ep"), ("tp_of_ep_sizes_enc", "expert_tp")):
        if key not in data:
            continue
        values = int_list(path, data, key, n)
        if any(v < 1 for v in values):
            raise GalvatronFormatError(f"galvatron config {path}: key {key!r} has {min(values)}; "
                                       f"a parallel degree is at least 1")
        for f, v in zip(fields, values):
            if v > 1:
                f[name] = v
    if "dispatcher" in data:
        dispatcher = data["dispatcher"]
        if dispatcher not in DISPATCHERS:
            raise GalvatronFormatError(
                f"galvatron config {path}: key 'dispatcher'={dispatcher!r} is not one of "
                f"{', '.join(DISPATCHERS)}; megatron_auto models those token dispatchers only")
        if any("ep" in f for f in fields):
            notes.append(f"dispatcher {dispatcher}: a communication choice; megatron_auto's MoE "
                         f"runtime uses its own all-to-all dispatch (the same model)")
    return fields, notes


def export_fields(plan: Plan) -> tuple[dict[str, str], list[str]]:
    """The Galvatron 3 keys for ``plan`` (only those that differ from 2.4's defaults), and the
    reasons the plan has no Galvatron equivalent (empty when it has one)."""
    out: dict[str, str] = {}
    reasons = []
    layers = plan.layers
    if any(layer.cp > 1 for layer in layers):
        out["cp_sizes_enc"] = ",".join(str(layer.cp) for layer in layers)
        modes = sorted({layer.cp_mode for layer in layers if layer.cp > 1} - {"ring"})
        if modes:
            reasons.append(f"cp_mode {modes[0]}: Galvatron's cp_sizes_enc names no mode (its "
                           f"use_sp is a separate Ulysses switch); plan with cp_mode ring")
    if any(layer.ep > 1 or layer.expert_tp > 1 for layer in layers):
        out["ep_sizes_enc"] = ",".join(str(layer.ep) for layer in layers)
        out["tp_of_ep_sizes_enc"] = ",".join(str(layer.expert_tp) for layer in layers)
    odd = [i for i, layer in enumerate(layers)
           if layer.expert_dp_mode not in (None, layer.dp_mode)]
    if odd:
        reasons.append(f"layers {odd} give their experts another expert_dp_mode than the layer's "
                       f"dp_mode; Galvatron has one data-parallel type per layer")
    return out, reasons


def check_model_config(path: str, config: Any, spec: ModelSpec) -> None:
    """Galvatron 3's ``model_config`` block of a memory profile against the planned model:
    a field that disagrees stops the import naming it, both values and the fix."""
    if not isinstance(config, Mapping):
        raise GalvatronFormatError(f"memory profile {path}: key 'model_config' must be an "
                                   f"object naming the profiled model, got {config!r}")
    lt = spec.layer_types[0]
    ours = {"dim": (lt.hidden_size, "--hidden-size"),
            "n_heads": (lt.num_attention_heads, "--num-attention-heads"),
            "n_kv_heads": (lt.num_query_groups or lt.num_attention_heads, "--num-query-groups"),
            "ffn_dim": (lt.ffn_hidden_size, "--ffn-hidden-size")}
    if len(spec.layer_types) == 1:
        ours["n_layers"] = (spec.num_layers, "--num-layers")
    for key, (value, flag) in ours.items():
        if key not in config:
            continue
        theirs = config[key]
        if isinstance(theirs, bool) or not isinstance(theirs, int):
            raise GalvatronFormatError(f"memory profile {path}: model_config.{key}={theirs!r} "
                                       f"must be an integer")
        if theirs != value:
            raise GalvatronFormatError(
                f"memory profile {path}: model_config.{key}={theirs} but the model has "
                f"{flag}={value}; give the profile of this model or profile it with Galvatron")
