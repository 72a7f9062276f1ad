"""Reader for Galvatron 2.4 memory profiles (``memory_profiling_*.json``), in its units (MB).

Every layout the 2.4 release ships: derived records flat (one sequence length, named in the file
name) or nested by sequence length(s) (``"512"``, ``"[3136,784,196,49]"`` for multi-type models),
plain and Megatron sequence-parallel (``*_sp``, every activation split by tp), beside the raw
runs ``<pp>_<tp>_<dp>[_vtp][_c][_sp]`` (with checkpointing, with vocab tp) whose keys are checked
but whose values are Galvatron's intermediate data. ``galvatron.py`` converts the records.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .galvatron_files import GalvatronFormatError, Seqs, number, parse_seqs, pick_seq, read_json


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


OTHER_POSITIONS = ("pp_off", "pp_on_first", "pp_on_last")


@dataclass(frozen=True)
class GalvatronMemoryRecords:
    """The derived records of one variant (plain, or Megatron-SP ``*_sp``):
    ``layers[type][seqs]`` and ``other[position][seqs]``."""

    path: str
    suffix: str  # "" or "_sp", for messages
    layers: Mapping[int, Mapping[Seqs | None, GalvatronLayerMemory]]
    other: Mapping[str, Mapping[Seqs | None, GalvatronOtherMemory]]

    def layer(self, layer_type: int, seq: int | None) -> tuple[GalvatronLayerMemory, int | None]:
        if layer_type not in self.layers:
            raise GalvatronFormatError(
                f"memory profile {self.path}: no layertype_{layer_type}{self.suffix} record; it "
                f"has layer types {sorted(self.layers)}; profile the model's memory with Galvatron")
        recs = self.layers[layer_type]
        chosen = pick_seq(list(recs), None if seq is None else (seq,),
                           f"memory profile {self.path} layertype_{layer_type}{self.suffix}")
        return recs[chosen], None if chosen is None else chosen[0]

    def other_record(self, position: str, seqs: Seqs | int | None) -> GalvatronOtherMemory:
        if isinstance(seqs, int):
            seqs = (seqs,)
        recs = self.other[position]
        what = f"memory profile {self.path} other_memory_{position}{self.suffix}"
        return recs[pick_seq(list(recs), seqs, what)]


@dataclass(frozen=True)
class GalvatronMemory:
    """A memory profile: the plain records (our runtime's tensor parallelism) and the Megatron
    sequence-parallel ones (``*_sp``: every activation split by tp), each None when absent."""

    path: str
    plain: GalvatronMemoryRecords | None
    megatron_sp: GalvatronMemoryRecords | None
    #: Galvatron 3's ``model_config`` block (the profiled model's sizes), None in 2.4 files
    model_config: Mapping[str, Any] | None = None

    @property
    def sequence_parallel(self) -> bool:
        """True when only ``*_sp`` records exist (the primary records are SP measurements)."""
        return self.plain is None

    @property
    def primary(self) -> GalvatronMemoryRecords:
        rec = self.plain or self.megatron_sp
        assert rec is not None  # read_memory refuses a file with neither
        return rec

    def layer(self, layer_type: int, seq: int | None) -> tuple[GalvatronLayerMemory, int | None]:
        return self.primary.layer(layer_type, seq)

    def other_record(self, position: str, seqs: Seqs | int | None) -> GalvatronOtherMemory:
        return self.primary.other_record(position, seqs)


_MEM_LAYER = re.compile(r"^layertype_(\d+)(_sp)?$")
_MEM_OTHER = re.compile(r"^other_memory_(pp_off|pp_on_first|pp_on_last)(_sp)?$")
# Raw runs: <pp>_<tp>_<dp>[_vtp][_c][_sp] -> layernum[...]_bsz<b>[_seq...]_rank<r>_{ms,act,act_peak}
_MEM_RAW = re.compile(r"^\d+_\d+_\d+(?:_vtp)?(?:_c)?(?:_sp)?$")
_MEM_RAW_KEY = re.compile(r"^layernum\[[\d,\s]+\]_bsz\d+(?:_seq(?:\d+|\[[\d,\s]+\]))?"
                          r"_rank\d+_(?:ms|act|act_peak)$")


def _tp_table(path: Any, key: str, table: Any) -> dict[int, float]:
    """``{"1": MB, "2": MB, ...}`` (or one number: vocab tp 1, older files); tp 1 is required
    because every other degree is priced relative to it."""
    if isinstance(table, (int, float)) and not isinstance(table, bool):
        return {1: float(table)}
    if not isinstance(table, Mapping):
        raise GalvatronFormatError(f"memory profile {path}: key {key!r} must map TP degrees to MB, "
                                   f"got {table!r}; re-run Galvatron's memory profiler")
    out = {}
    for k, v in table.items():
        if not str(k).isdigit() or int(k) < 1:
            raise GalvatronFormatError(f"memory profile {path}: key {key}.{k}: expected a TP "
                                       f"degree (1, 2, 4, ...); re-run Galvatron's memory profiler")
        out[int(k)] = number(path, f"{key}.{k}", v)
    if 1 not in out:
        raise GalvatronFormatError(
            f"memory profile {path}: key {key} has TP degrees {sorted(out)} but no 1; the import "
            f"prices every degree from the tp 1 record: profile memory from tp 1 with Galvatron")
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
    ckpt = number(path, f"{key}.tp_activation_per_bsz_dict.checkpoint", acts.pop("checkpoint"))
    return GalvatronLayerMemory(
        parameter_mb=number(path, f"{key}.parameter_size", rec["parameter_size"]),
        activation_mb_per_sample=_tp_table(path, f"{key}.tp_activation_per_bsz_dict", acts),
        checkpoint_mb_per_sample=ckpt)


def _is_seq_key(k: Any) -> bool:
    return bool(re.match(r"^(\d+|\[[\d,\s]+\])$", str(k)))


def _layer_records(path: Any, key: str, value: Any) -> dict[Seqs | None, GalvatronLayerMemory]:
    if isinstance(value, Mapping) and "parameter_size" in value:
        return {None: _layer_record(path, key, value)}  # flat: the length is in the file name
    if isinstance(value, Mapping) and value and all(_is_seq_key(k) for k in value):
        return {parse_seqs(str(s)): _layer_record(path, f"{key}.{s}", r) for s, r in value.items()}
    raise GalvatronFormatError(
        f"memory profile {path}: key {key!r} is neither a record with parameter_size nor records "
        f"by sequence length; re-run Galvatron's memory profiler")


def _other_records(path: Any, key: str, value: Any) -> dict[Seqs | None, GalvatronOtherMemory]:
    def one(where: str, rec: Any) -> GalvatronOtherMemory:
        if not isinstance(rec, Mapping) or "model_states" not in rec or "activation" not in rec:
            raise GalvatronFormatError(f"memory profile {path}: key {where} needs 'model_states' "
                                       f"and 'activation'; re-run Galvatron's memory profiler")
        return GalvatronOtherMemory(_tp_table(path, f"{where}.model_states", rec["model_states"]),
                                    _tp_table(path, f"{where}.activation", rec["activation"]))

    if not isinstance(value, Mapping):
        raise GalvatronFormatError(f"memory profile {path}: key {key!r} must be an object")
    if "model_states" in value:
        return {None: one(key, value)}
    bad = [s for s in value if not _is_seq_key(s)]
    if bad or not value:
        raise GalvatronFormatError(f"memory profile {path}: key {key}.{bad[0] if bad else ''}: "
                                   f"expected records by sequence length (\"512\" or "
                                   f"\"[3136,784]\") with 'model_states' and 'activation'")
    return {parse_seqs(str(s)): one(f"{key}.{s}", rec) for s, rec in value.items()}


def read_memory(path: str | os.PathLike) -> GalvatronMemory:
    """Read ``memory_profiling_*.json``: the derived records, plain and ``*_sp``, flat (one length,
    in the file name) or nested by sequence length(s). Raw ``<pp>_<tp>_<dp>[_vtp][_c][_sp]`` runs
    are Galvatron's intermediate data: their keys are checked, their values not used."""
    data = read_json(path, "memory profile")
    layers: dict[str, dict[int, dict[Seqs | None, GalvatronLayerMemory]]] = {"": {}, "_sp": {}}
    other: dict[str, dict[str, dict[Seqs | None, GalvatronOtherMemory]]] = {"": {}, "_sp": {}}
    model_config = data.pop("model_config", None)  # Galvatron 3; galvatron_v3.py checks it
    for key, value in data.items():
        if m := _MEM_LAYER.match(key):
            layers[m[2] or ""][int(m[1])] = _layer_records(path, key, value)
        elif m := _MEM_OTHER.match(key):
            other[m[2] or ""][m[1]] = _other_records(path, key, value)
        elif _MEM_RAW.match(key):
            bad = [k for k in (value if isinstance(value, Mapping) else [repr(value)])
                   if not _MEM_RAW_KEY.match(str(k))]
            if bad:
                raise GalvatronFormatError(
                    f"memory profile {path}: raw run {key!r} holds {bad[0]!r}; expected "
                    f"layernum[<L>,...]_bsz<b>[_seq<s>]_rank<r>_{{ms,act,act_peak}}")
        else:
            raise GalvatronFormatError(
                f"memory profile {path}: unknown key {key!r}; expected layertype_<i>[_sp], "
                f"other_memory_{{pp_off,pp_on_first,pp_on_last}}[_sp] or raw runs "
                f"<pp>_<tp>_<dp>[_vtp][_c][_sp] (Galvatron 2.4 layouts); is this a "
                f"memory_profiling_*.json file?")
    sets: dict[str, GalvatronMemoryRecords | None] = {}
    for suffix in ("", "_sp"):
        if not layers[suffix] and not other[suffix]:
            sets[suffix] = None
            continue
        missing = ([] if layers[suffix] else [f"layertype_<i>{suffix}"]) + \
            [f"other_memory_{p}{suffix}" for p in OTHER_POSITIONS if p not in other[suffix]]
        if missing:
            raise GalvatronFormatError(f"memory profile {path}: missing key(s) {missing}; re-run "
                                       f"Galvatron's memory profiler with pp 1 and pp 2")
        sets[suffix] = GalvatronMemoryRecords(str(path), suffix, layers[suffix], other[suffix])
    if sets[""] is None and sets["_sp"] is None:
        raise GalvatronFormatError(
            f"memory profile {path}: no derived 'layertype_<i>' record (only raw runs?); let "
            f"Galvatron's memory profiler finish its post-processing, or check the file kind")
    return GalvatronMemory(path=str(path), plain=sets[""], megatron_sp=sets["_sp"],
                           model_config=model_config)
