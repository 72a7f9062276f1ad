"""Readers for Galvatron 2.4 profile files, in Galvatron's own units (ms, MB, GB/s).

Galvatron (PKU-DAIR/Hetu-Galvatron) writes one JSON file per measurement (see
shared/reference/galvatron.md §4). This module only *reads and checks* them; ``galvatron.py``
converts the result into our ModelProfile, ClusterSpec and Plan. Both the 2.4 layout (records
nested under the sequence length, keys carrying ``_seq{s}``) and the older flat layout are read.

Units as in the files: compute times in ms per sample per layer (forward only), memory in MB
(2**20 bytes), bandwidth in GB/s (1e9 B/s), SP times in ms per message size.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..jsonfile import read_json as _read_json


class GalvatronFormatError(ValueError):
    """A Galvatron file we cannot read; the message names the file, the key and the fix."""


def read_json(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """Load a JSON object from ``path``; errors say which Galvatron file was expected."""
    data = _read_json(path, what, GalvatronFormatError,
                      syntax_fix="re-run Galvatron's profiler")
    if not isinstance(data, dict):
        raise GalvatronFormatError(f"{what} {path}: must hold a JSON object, got "
                                   f"{type(data).__name__}")
    return data


def _number(path: Any, key: str, value: Any, fix: str = "re-run Galvatron's profiler") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise GalvatronFormatError(f"{path}: key {key!r} has value {value!r}, expected a number; "
                                   f"{fix}")
    return float(value)


# ------------------------------------------------------------------ computation profile
_LAYER_24 = re.compile(r"^layertype_(\d+)_bsz(\d+)_seq(\d+)$")
_LAYER_OLD = re.compile(r"^layertype_(\d+)(?:_bsz(\d+))?$")
_OTHER = re.compile(r"^layertype_other(?:_(\d+))?_bsz(\d+)_seq\[?([\d,\s]+)\]?$")
_RAW = re.compile(r"^layernum\[([\d,\s]+)\]_bsz(\d+)(?:_seq(\d+))?$")


@dataclass(frozen=True)
class GalvatronComputation:
    """Forward time per sample: ``layers[type][(bsz, seq)]`` ms per layer; ``other`` likewise for
    the embedding + head (``seq`` is None in the old layout, which records one sequence length)."""

    path: str
    layers: Mapping[int, Mapping[tuple[int, int | None], float]]
    other: Mapping[tuple[int, int | None], float] = field(default_factory=dict)

    def layer_ms(self, layer_type: int, seq: int | None) -> tuple[float, str]:
        """ms per sample per layer at ``seq`` (see :func:`_pick_seq`), and a note on the choice."""
        if layer_type not in self.layers:
            raise GalvatronFormatError(
                f"computation profile {self.path}: no layertype_{layer_type}_* key; it has layer "
                f"types {sorted(self.layers)}; profile the model with Galvatron first")
        return _pick(self.layers[layer_type], seq, f"{os.path.basename(self.path)} layertype_"
                     f"{layer_type}")

    def other_ms(self, seq: int | None) -> tuple[float, str]:
        if not self.other:
            return 0.0, "no layertype_other record (embedding/head time taken as 0)"
        return _pick(self.other, seq, f"{os.path.basename(self.path)} layertype_other")


def _pick(records: Mapping[tuple[int, int | None], float], seq: int | None,
          what: str) -> tuple[float, str]:
    """Per-sample ms at sequence ``seq``: exact match, else the next longer profiled sequence
    (conservative). Several batch sizes: the smallest batch (per-sample time is largest there,
    again conservative)."""
    by_seq: dict[int | None, list[tuple[int, float]]] = {}
    for (bsz, s), ms in records.items():
        by_seq.setdefault(s, []).append((bsz, ms))
    chosen = _pick_seq(list(by_seq), seq, what)
    bsz, ms = min(by_seq[chosen])
    note = f"{what}: bsz{bsz}" + ("" if chosen is None else f" seq{chosen}")
    return ms, note


def _pick_seq(available: list[int | None], seq: int | None, what: str) -> int | None:
    """The profiled sequence length to use for ``seq``: itself, else the next longer one.

    A longer sequence than any profiled is refused: time and memory grow faster than linearly
    with it (attention), so extrapolating would under-estimate both.
    """
    known = sorted(s for s in available if s is not None)
    if not known or seq is None:
        return None if None in available else (known[-1] if known else None)
    if seq in known:
        return seq
    longer = [s for s in known if s > seq]
    if not longer:
        raise GalvatronFormatError(
            f"{what}: profiled up to sequence length {known[-1]} but the model has --seq-length="
            f"{seq}; profile it at that length with Galvatron (--profile_max_seq_length)")
    return longer[0]


def read_computation(path: str | os.PathLike) -> GalvatronComputation:
    """Read ``computation_profiling_*.json`` (2.4 or older layout)."""
    data = read_json(path, "computation profile")
    layers: dict[int, dict[tuple[int, int | None], float]] = {}
    other: dict[tuple[int, int | None], float] = {}
    raw: dict[tuple[int, int | None], dict[int, float]] = {}
    for key, value in data.items():
        if m := _LAYER_24.match(key):
            layers.setdefault(int(m[1]), {})[(int(m[2]), int(m[3]))] = _number(path, key, value)
        elif m := _OTHER.match(key):
            seqs = [int(s) for s in m[3].split(",") if s.strip()]
            other[(int(m[2]), seqs[0] if len(seqs) == 1 else None)] = _number(path, key, value)
        elif m := _LAYER_OLD.match(key):
            bsz = int(m[2]) if m[2] else 1
            layers.setdefault(int(m[1]), {})[(bsz, None)] = _number(path, key, value)
        elif m := _RAW.match(key):
            nums = [int(x) for x in m[1].split(",")]
            seq = int(m[3]) if m[3] else None
            raw.setdefault((int(m[2]), seq), {})[sum(nums)] = _number(path, key, value)
        else:
            raise GalvatronFormatError(
                f"computation profile {path}: unknown key {key!r}; expected layertype_<i>_bsz<b>_"
                f"seq<s>, layertype_other_bsz<b>_seq<s>, layertype_<i> or layernum[<L>]_bsz<b>; "
                f"is this a computation_profiling_*.json file?")
    if not layers:
        raise GalvatronFormatError(f"computation profile {path}: no layertype_<i> key; run "
                                   f"Galvatron's computation profiler to completion")
    if not other and len(layers) == 1:
        # Older files keep only the raw totals; recover the embedding/head time as Galvatron's
        # post-processing does: (T(L_min) - L_min * t * b) / b, floored at 0.
        (t_type, per_layer), = layers.items()
        for (bsz, seq), totals in raw.items():
            rec = per_layer.get((bsz, seq)) or per_layer.get((1, seq)) or per_layer.get((1, None))
            if rec is None:
                continue
            l_min = min(totals)
            other[(bsz, seq)] = max(0.0, (totals[l_min] - l_min * rec * bsz) / bsz)
    return GalvatronComputation(path=str(path), layers=layers, other=other)


# ----------------------------------------------------------------------- memory profile
@dataclass(frozen=True)
class GalvatronLayerMemory:
    """One layer type's memory at one sequence length (MB)."""

    parameter_mb: float  # parameter memory of one layer as profiled (= model states / 4)
    activation_mb_per_sample: Mapping[int, float]  # by TP degree, no recompute
    checkpoint_mb_per_sample: float  # kept per sample when the layer recomputes


@dataclass(frozen=True)
class GalvatronOtherMemory:
    """Embedding + head memory for one pipeline position, by vocab-TP degree (MB)."""

    model_states_mb: Mapping[int, float]
    activation_mb_per_sample: Mapping[int, float]


@dataclass(frozen=True)
class GalvatronMemory:
    path: str
    layers: Mapping[int, Mapping[int | None, GalvatronLayerMemory]]
    # "pp_off", "pp_on_first", "pp_on_last" -> seq (None: old layout) -> record
    other: Mapping[str, Mapping[int | None, GalvatronOtherMemory]]
    sequence_parallel: bool

    def layer(self, layer_type: int, seq: int | None) -> tuple[GalvatronLayerMemory, int | None]:
        if layer_type not in self.layers:
            raise GalvatronFormatError(
                f"memory profile {self.path}: no layertype_{layer_type} record; it has "
                f"{sorted(self.layers)}; profile the model's memory with Galvatron first")
        recs = self.layers[layer_type]
        chosen = _pick_seq(list(recs), seq, f"memory profile {self.path} layertype_{layer_type}")
        return recs[chosen], chosen

    def other_record(self, position: str, seq: int | None) -> GalvatronOtherMemory:
        recs = self.other[position]
        return recs[_pick_seq(list(recs), seq, f"memory profile {self.path} other_memory_{position}")]


_OTHER_POSITIONS = ("pp_off", "pp_on_first", "pp_on_last")


def _int_keys(path: Any, key: str, table: Any) -> dict[int, float]:
    if isinstance(table, (int, float)) and not isinstance(table, bool):
        return {1: float(table)}  # older files: one value, vocab TP 1
    if not isinstance(table, Mapping):
        raise GalvatronFormatError(f"memory profile {path}: key {key!r} must map TP degrees to MB, "
                                   f"got {table!r}; re-run Galvatron's memory profiler")
    out = {}
    for k, v in table.items():
        if not str(k).isdigit():
            raise GalvatronFormatError(f"memory profile {path}: key {key}.{k}: expected a TP degree")
        out[int(k)] = _number(path, f"{key}.{k}", v)
    return out


def _layer_record(path: Any, key: str, rec: Any) -> GalvatronLayerMemory:
    if not isinstance(rec, Mapping) or "parameter_size" not in rec \
            or "tp_activation_per_bsz_dict" not in rec:
        raise GalvatronFormatError(
            f"memory profile {path}: key {key!r} needs 'parameter_size' and "
            f"'tp_activation_per_bsz_dict'; re-run Galvatron's memory profiler (post-processing)")
    acts = dict(rec["tp_activation_per_bsz_dict"])
    if "checkpoint" not in acts:
        raise GalvatronFormatError(f"memory profile {path}: key {key}.tp_activation_per_bsz_dict "
                                   f"has no 'checkpoint' entry; profile with checkpointing on")
    ckpt = _number(path, f"{key}.tp_activation_per_bsz_dict.checkpoint", acts.pop("checkpoint"))
    return GalvatronLayerMemory(
        parameter_mb=_number(path, f"{key}.parameter_size", rec["parameter_size"]),
        activation_mb_per_sample=_int_keys(path, f"{key}.tp_activation_per_bsz_dict", acts),
        checkpoint_mb_per_sample=ckpt)


def read_memory(path: str | os.PathLike) -> GalvatronMemory:
    """Read ``memory_profiling_*.json``: the derived records (raw ``{pp}_{tp}_{dp}`` runs are
    Galvatron's intermediate data and are skipped). Prefers non-SP records when both exist."""
    data = read_json(path, "memory profile")
    has_plain = any(re.match(r"^layertype_\d+$", k) for k in data)
    sp = not has_plain and any(re.match(r"^layertype_\d+_sp$", k) for k in data)
    suffix = "_sp" if sp else ""
    layers: dict[int, dict[int | None, GalvatronLayerMemory]] = {}
    other: dict[str, dict[int | None, GalvatronOtherMemory]] = {}
    for key, value in data.items():
        if m := re.match(rf"^layertype_(\d+){suffix}$", key):
            if isinstance(value, Mapping) and "parameter_size" in value:
                layers[int(m[1])] = {None: _layer_record(path, key, value)}
            elif isinstance(value, Mapping) and value and all(str(k).isdigit() for k in value):
                layers[int(m[1])] = {int(s): _layer_record(path, f"{key}.{s}", r)
                                     for s, r in value.items()}
            else:
                raise GalvatronFormatError(
                    f"memory profile {path}: key {key!r} is neither a record with parameter_size "
                    f"nor records by sequence length; re-run Galvatron's memory profiler")
        elif m := re.match(rf"^other_memory_(pp_off|pp_on_first|pp_on_last){suffix}$", key):
            other[m[1]] = _other_records(path, key, value)
    if not layers:
        raise GalvatronFormatError(
            f"memory profile {path}: no derived 'layertype_<i>' record (only raw runs?); let "
            f"Galvatron's memory profiler finish its post-processing, or check the file kind")
    missing = [p for p in _OTHER_POSITIONS if p not in other]
    if missing:
        raise GalvatronFormatError(f"memory profile {path}: missing key(s) "
                                   f"{['other_memory_' + p + suffix for p in missing]}; re-run "
                                   f"Galvatron's memory profiler with pp 1 and pp 2")
    return GalvatronMemory(path=str(path), layers=layers, other=other, sequence_parallel=sp)


def _other_records(path: Any, key: str, value: Any) -> dict[int | None, GalvatronOtherMemory]:
    if not isinstance(value, Mapping):
        raise GalvatronFormatError(f"memory profile {path}: key {key!r} must be an object")
    if "model_states" in value:
        return {None: GalvatronOtherMemory(_int_keys(path, f"{key}.model_states", value["model_states"]),
                                           _int_keys(path, f"{key}.activation", value.get("activation", 0.0)))}
    out = {}
    for s, rec in value.items():
        if not str(s).isdigit() or not isinstance(rec, Mapping) or "model_states" not in rec:
            raise GalvatronFormatError(f"memory profile {path}: key {key}.{s}: expected records "
                                       f"by sequence length with 'model_states' and 'activation'")
        out[int(s)] = GalvatronOtherMemory(_int_keys(path, f"{key}.{s}.model_states", rec["model_states"]),
                                           _int_keys(path, f"{key}.{s}.activation", rec.get("activation", 0.0)))
    return out


# -------------------------------------------------------------------- hardware profiles
def read_allreduce(path: str | os.PathLike) -> dict[tuple[int, bool], float]:
    """``allreduce_bandwidth_*.json`` -> {(group size, consecutive): GB/s}."""
    data = read_json(path, "all-reduce bandwidth file")
    out = {}
    for key, value in data.items():
        m = re.match(r"^allreduce_size_(\d+)_consec_([01])$", key)
        if not m:
            raise GalvatronFormatError(f"all-reduce bandwidth file {path}: unknown key {key!r}; "
                                       f"expected allreduce_size_<g>_consec_<0|1>")
        out[(int(m[1]), m[2] == "1")] = _number(path, key, value)
    if not out:
        raise GalvatronFormatError(f"all-reduce bandwidth file {path}: empty; re-run Galvatron's "
                                   f"hardware profiler")
    return out


def read_p2p(path: str | os.PathLike) -> dict[int, float]:
    """``p2p_bandwidth_*.json`` -> {pp size: GB/s}."""
    data = read_json(path, "p2p bandwidth file")
    out = {}
    for key, value in data.items():
        m = re.match(r"^pp_size_(\d+)$", key)
        if not m:
            raise GalvatronFormatError(f"p2p bandwidth file {path}: unknown key {key!r}; expected "
                                       f"pp_size_<p>")
        out[int(m[1])] = _number(path, key, value)
    return out


def read_overlap(path: str | os.PathLike) -> float:
    """``overlap_coefficient.json`` -> the slowdown factor (>= 1)."""
    data = read_json(path, "overlap coefficient file")
    if "overlap_coe" not in data:
        raise GalvatronFormatError(f"overlap coefficient file {path}: key 'overlap_coe' missing; "
                                   f"expected {{\"overlap_coe\": 1.12}}")
    return max(1.0, _number(path, "overlap_coe", data["overlap_coe"]))


def read_sp_time(path: str | os.PathLike) -> dict[str, dict[int, dict[int, float]]]:
    """``sp_time_*.json`` -> {"allreduce"|"all2all": {group: {MB: ms}}} (optional file)."""
    data = read_json(path, "sp_time file")
    out: dict[str, dict[int, dict[int, float]]] = {"allreduce": {}, "all2all": {}}
    for key, value in data.items():
        m = re.match(r"^(allreduce|all2all)_size_(\d+)_(\d+)MB_time$", key)
        if not m:
            raise GalvatronFormatError(f"sp_time file {path}: unknown key {key!r}; expected "
                                       f"allreduce_size_<g>_<n>MB_time or all2all_size_<g>_<n>MB_time")
        out[m[1]].setdefault(int(m[2]), {})[int(m[3])] = _number(path, key, value)
    return out


def cluster_shape_from_name(path: str | os.PathLike) -> tuple[int, int] | None:
    """``(nodes, gpus per node)`` from Galvatron's ``..._<n>nodes_<g>gpus_per_node...`` file names."""
    m = re.search(r"(\d+)nodes_(\d+)gpus_per_node", os.path.basename(os.fspath(path)))
    return (int(m[1]), int(m[2])) if m else None
