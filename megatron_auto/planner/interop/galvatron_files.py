"""Readers for Galvatron 2.4 profile files, in Galvatron's own units (ms, MB, GB/s).

Galvatron (PKU-DAIR/Hetu-Galvatron) writes one JSON file per measurement. This module only
*reads and checks* them; ``galvatron.py`` converts the result into our ModelProfile, ClusterSpec
and Plan. Here: the shared pieces (JSON, numbers, sequence-length keys), the computation profile
and the hardware files; the memory profile is ``galvatron_memory.py``. Every layout the 2.4
release ships is read: time profiles in static, batch and sequence modes (with or without the
length in the key), multi-type models (``layernum[a,b,...]`` and ``seq[s1,s2,...]``: T5's
encoder/decoder, Swin's four stages). Anything else is refused naming the file and the key.

Units as in the files: compute times in ms per sample per layer (forward only), memory in MB
(2**20 bytes), bandwidth in GB/s (1e9 B/s), SP times in ms per message size.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ...utils.jsonfile import read_json as _read_json


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


def number(path: Any, key: str, value: Any, fix: str = "re-run Galvatron's profiler") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise GalvatronFormatError(f"{path}: key {key!r} has value {value!r}, expected a number; "
                                   f"{fix}")
    return float(value)


# ------------------------------------------------------------------ sequence lengths
# A sequence "key" is a tuple with one length per layer type as Galvatron writes it (``seq512``
# -> (512,), ``seq[3136,784,196,49]`` -> four lengths), or None where the layout records no
# length (the older files profile one length, named in the file name).
Seqs = tuple[int, ...]


def parse_seqs(text: str | None) -> Seqs | None:
    if text is None:
        return None
    return tuple(int(x) for x in text.strip("[]").split(",") if x.strip())


def _seq_text(seqs: Seqs | None) -> str:
    if seqs is None:
        return "?"
    return str(seqs[0]) if len(seqs) == 1 else "[" + ",".join(map(str, seqs)) + "]"


def pick_seq(available: list[Seqs | None], wanted: Seqs | None, what: str) -> Seqs | None:
    """The profiled sequence lengths to use for ``wanted``: itself, else the shortest profiled
    one at least as long in every position (conservative), else the unnamed (None) record.

    A longer sequence than any profiled is refused: time and memory grow faster than linearly
    with it (attention), so extrapolating would under-estimate both.
    """
    known = [s for s in available if s is not None]
    if wanted is None or not known:
        if None in available:
            return None
        return max(known, key=sum) if known else None
    if wanted in known:
        return wanted
    longer = [s for s in known if len(s) == len(wanted) and all(a >= b for a, b in zip(s, wanted))]
    if longer:
        return min(longer, key=sum)
    if None in available:
        return None
    longest = max(known, key=sum)
    raise GalvatronFormatError(
        f"{what}: profiled up to sequence length {_seq_text(longest)} but the model has "
        f"--seq-length={_seq_text(wanted)}; profile it at that length with Galvatron "
        f"(--profile_max_seq_length)")


# ------------------------------------------------------------------ computation profile
# Keys Galvatron 2.4 and older write into computation_profiling_*.json:
#   layertype_<i>_bsz<b>_seq<s>   derived forward ms per sample per layer (2.4, static/batch/
#                                 sequence modes: one or many b, one or many s)
#   layertype_<i>_bsz<b>          batch mode without a length (LLaMA's files)
#   layertype_<i>                 older static layout, one value
#   layertype_other[_<i>][_bsz<b>][_seq<s>|_seq[s,...]]  embedding + head, same units
#   layernum[<L>,...]_bsz<b>[_seq<s>|_seq[s,...]]        raw totals (ms per iteration)
_LAYER = re.compile(r"^layertype_(\d+)(?:_bsz(\d+))?(?:_seq(\d+))?$")
_OTHER = re.compile(r"^layertype_other(?:_(\d+))?(?:_bsz(\d+))?(?:_seq(\d+|\[[\d,\s]+\]))?$")
_RAW = re.compile(r"^layernum\[([\d,\s]+)\]_bsz(\d+)(?:_seq(\d+|\[[\d,\s]+\]))?$")

# Galvatron 3's per-module times (``--profile_unit attention|mlp``): a suffix on either kind
_UNIT = re.compile(r"^(?:layertype_|layernum\[).*_(attention|mlp)$")

TimeRecords = Mapping[tuple[int | None, "Seqs | None"], float]


@dataclass(frozen=True)
class GalvatronTime:
    """Forward time of one layer (or of embedding + head) for a call on ``b`` samples:
    ``per_sample_ms * b + per_call_ms``, and a note saying where it came from."""

    per_sample_ms: float
    per_call_ms: float
    note: str


@dataclass(frozen=True)
class GalvatronComputation:
    """Forward ms per sample: ``layers[type][(bsz, seqs)]``; ``other`` likewise for embedding +
    head. ``bsz`` is None for the one-value layouts, ``seqs`` None where no length is recorded."""

    path: str
    layers: Mapping[int, TimeRecords]
    other: TimeRecords = field(default_factory=dict)

    def layer_time(self, layer_type: int, seq: int | None) -> GalvatronTime:
        """Layer ``layer_type``'s time at sequence ``seq`` (see :func:`_fit_time`)."""
        if layer_type not in self.layers:
            raise GalvatronFormatError(
                f"computation profile {self.path}: no layertype_{layer_type}_* key; it has layer "
                f"types {sorted(self.layers)}; profile the model with Galvatron first")
        return _fit_time(self.layers[layer_type], None if seq is None else (seq,),
                         f"computation profile {self.path} layertype_{layer_type}")

    def other_time(self, seqs: Seqs | None) -> GalvatronTime:
        """Embedding + head time for the model's per-type sequence lengths ``seqs``."""
        return _fit_time(self.other, seqs, f"computation profile {self.path} layertype_other")


def _fit_time(records: TimeRecords, wanted: Seqs | None, what: str) -> GalvatronTime:
    """Time at the chosen sequence length: with several batch sizes, the least-squares line
    through the per-call totals ``ms * b`` (Galvatron's batch mode fits the same line); with one,
    its per-sample value. A negative intercept (noise) is refitted through the origin."""
    chosen = pick_seq(list({s for _, s in records}), wanted, what)
    points = sorted(((b, ms) for (b, s), ms in records.items() if s == chosen),
                    key=lambda p: (p[0] or 0, p[1]))
    where = f"{what.rsplit(' ', 1)[-1]}" + ("" if chosen is None else f" seq{_seq_text(chosen)}")
    sized = [(b, ms) for b, ms in points if b is not None]
    if len(sized) < 2:
        b, ms = (sized or points)[0]
        return GalvatronTime(ms, 0.0, f"{where}: " + (f"bsz{b}" if b else "one value"))
    n = len(sized)
    xs = [float(b) for b, _ in sized]
    ys = [ms * b for b, ms in sized]
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if intercept < 0:
        slope, intercept = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), 0.0
    return GalvatronTime(slope, intercept,
                         f"{where}: linear fit over bsz{sized[0][0]}..{sized[-1][0]} "
                         f"({n} sizes): {slope:.4f} ms/sample + {intercept:.4f} ms/call")


def read_computation(path: str | os.PathLike) -> GalvatronComputation:
    """Read ``computation_profiling_*.json`` in any layout Galvatron 2.4 ships (see above)."""
    data = read_json(path, "computation profile")
    layers: dict[int, dict[tuple[int | None, Seqs | None], float]] = {}
    bare: dict[int, float] = {}
    other: dict[tuple[int | None, Seqs | None], float] = {}
    raw: dict[tuple[int, Seqs | None], dict[tuple[int, ...], float]] = {}
    for key, value in data.items():
        if m := _LAYER.match(key):
            if m[2] is None and m[3] is None:
                bare[int(m[1])] = number(path, key, value)
            else:
                bsz = int(m[2]) if m[2] else None
                layers.setdefault(int(m[1]), {})[(bsz, parse_seqs(m[3]))] = number(path, key, value)
        elif m := _OTHER.match(key):
            other[(int(m[2]) if m[2] else None, parse_seqs(m[3]))] = number(path, key, value)
        elif m := _RAW.match(key):
            counts = tuple(int(x) for x in m[1].split(",") if x.strip())
            raw.setdefault((int(m[2]), parse_seqs(m[3])), {})[counts] = number(path, key, value)
        elif m := _UNIT.match(key):
            raise GalvatronFormatError(
                f"computation profile {path}: key {key!r} times the {m[1]} module alone "
                f"(Galvatron 3's --profile_unit {m[1]}, as in its MoE profiles); megatron_auto "
                f"prices whole layers: profile with --profile_unit all")
        else:
            raise GalvatronFormatError(
                f"computation profile {path}: unknown key {key!r}; expected layertype_<i>_bsz<b>"
                f"[_seq<s>], layertype_other[_<i>]_bsz<b>[_seq<s>], layertype_<i> or "
                f"layernum[<L>,...]_bsz<b>[_seq...] (Galvatron 2.4 layouts); is this a "
                f"computation_profiling_*.json file?")
    for k, ms in bare.items():
        # The one-value layout; where a type also has per-batch records those are the newer
        # measurement (LLaMA's files carry both) and win.
        layers.setdefault(k, {(None, None): ms})
    if not layers:
        raise GalvatronFormatError(f"computation profile {path}: no layertype_<i> key (only raw "
                                   f"layernum[...] totals?); run Galvatron's computation profiler "
                                   f"to completion")
    if not other:
        other = _other_from_raw(path, layers, raw)
    return GalvatronComputation(path=str(path), layers=layers, other=other)


def _other_from_raw(path: Any, layers: Mapping[int, TimeRecords],
                    raw: Mapping[tuple[int, Seqs | None], Mapping[tuple[int, ...], float]]
                    ) -> dict[tuple[int | None, Seqs | None], float]:
    """Embedding + head time from the raw totals, as Galvatron's post-processing derives it:
    ``(T(fewest layers) - sum_i L_i * t_i * b) / b``, floored at 0, per raw batch size."""
    other: dict[tuple[int | None, Seqs | None], float] = {}
    for (bsz, seqs), totals in raw.items():
        counts = min(totals, key=sum)
        per_layer = []
        for k, n in enumerate(counts):
            recs = layers.get(k, {})
            seq_k = None if seqs is None else (seqs[k] if k < len(seqs) else None)
            ms = next((v for key in ((bsz, (seq_k,) if seq_k else None), (bsz, None),
                                     (None, (seq_k,) if seq_k else None), (None, None))
                       if (v := recs.get(key)) is not None), None)
            if ms is None:
                break
            per_layer.append(n * ms)
        else:
            other[(bsz, seqs)] = max(0.0, (totals[counts] - sum(per_layer) * bsz) / bsz)
    if not other:
        raise GalvatronFormatError(
            f"computation profile {path}: no layertype_other_* key and no raw layernum[...] "
            f"totals at a batch size and length with layertype records, so the embedding/head "
            f"time is unknown; re-run Galvatron's computation profiler (it writes "
            f"layertype_other_bsz<b>_seq<s>)")
    return other


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
        out[(int(m[1]), m[2] == "1")] = number(path, key, value)
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
        out[int(m[1])] = number(path, key, value)
    return out


def read_overlap(path: str | os.PathLike) -> float:
    """``overlap_coefficient.json`` -> the slowdown factor (>= 1)."""
    data = read_json(path, "overlap coefficient file")
    if "overlap_coe" not in data:
        raise GalvatronFormatError(f"overlap coefficient file {path}: key 'overlap_coe' missing; "
                                   f"expected {{\"overlap_coe\": 1.12}}")
    return max(1.0, number(path, "overlap_coe", data["overlap_coe"]))


def read_sp_time(path: str | os.PathLike) -> dict[str, dict[int, dict[int, float]]]:
    """``sp_time_*.json`` -> {"allreduce"|"all2all": {group: {MB: ms}}} (optional file)."""
    data = read_json(path, "sp_time file")
    out: dict[str, dict[int, dict[int, float]]] = {"allreduce": {}, "all2all": {}}
    for key, value in data.items():
        m = re.match(r"^(allreduce|all2all)_size_(\d+)_(\d+)MB_time$", key)
        if not m:
            raise GalvatronFormatError(f"sp_time file {path}: unknown key {key!r}; expected "
                                       f"allreduce_size_<g>_<n>MB_time or all2all_size_<g>_<n>MB_time")
        out[m[1]].setdefault(int(m[2]), {})[int(m[3])] = number(path, key, value)
    return out


def cluster_shape_from_name(path: str | os.PathLike) -> tuple[int, int] | None:
    """``(nodes, gpus per node)`` from Galvatron's ``..._<n>nodes_<g>gpus_per_node...`` file names."""
    m = re.search(r"(\d+)nodes_(\d+)gpus_per_node", os.path.basename(os.fspath(path)))
    return (int(m[1]), int(m[2])) if m else None
