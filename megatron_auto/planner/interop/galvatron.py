"""Galvatron interop (2.4 and 3): its profiles -> our ModelProfile / ClusterSpec, its plans -> Plan.

Reading and checking the files is ``galvatron_files.py`` (and ``galvatron_memory.py``, and
``galvatron_v3.py`` for what Galvatron 3 adds: CP / expert fields, model_config); this
module converts units and meanings:

- Compute: ``layertype_i`` ms per sample per layer (forward, tp 1) -> seconds per sample; with
  several profiled batch sizes a least-squares line gives a per-call constant too (Galvatron's
  batch mode fits the same line); backward/forward ratio 2 (its
  ``bct_fct_coe``). ``layertype_other`` (embedding + head) is split 50/50 between embedding and
  head, as Galvatron does between the first and last stage.
- Memory: ``parameter_size`` is model states / 4 in MB (16 B/param with Adam) -> parameter count
  ``MB * 2**20 / 4``; ``tp_activation_per_bsz_dict[t]`` MB per sample -> bytes per sample at tp t;
  ``checkpoint`` -> bytes kept per sample when recomputing. Records profiled with Megatron
  sequence parallelism (``*_sp``, Galvatron's global ``--sequence_parallel``) split *all*
  activations by tp, as our ``sequence_parallel`` layers do: their per-tp activations become the
  layer profile's ``activation_bytes_by_tp_sp`` (what the cost model charges an SP layer); for
  files that have only those, the non-SP activations take the tp=1 value with the analytic
  replicated/split ratio. The embedding/head SP records stay in ``metadata["megatron_sp"]``
  (our vocabulary layers never run SP).
  Embedding/head model states (``other_memory_*``) are 16 B/param too.
- What Galvatron does not measure (backward scratch, the fp32 logits transient, autocast weight
  copies) comes from the analytic profile, so the imported profile is never less conservative.
- Plans: ``galvatron_config_*.json`` (per-layer values as comma-joined strings) -> ``Plan``.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from typing import Any, Mapping

from ...plan import LayerStrategy, PipelineSpec, Plan, PlanError, VocabStrategy, even_partition
from ...utils.flag_warnings import warn_flag
from . import galvatron_files as gf
from . import galvatron_memory as gm
from . import galvatron_v3 as v3
from .galvatron_files import GalvatronFormatError
from ..inputs.hardware import GB, ClusterSpec
from ..inputs.model_spec import ModelSpec, TrainingSpec
from ..inputs.presets import make_cluster
from ..inputs.profile_records import LayerTypeProfile
from ..inputs.profiles import ModelProfile, analytic_profile

MB = 2**20
MODEL_STATE_BYTES_PER_PARAM = 16  # fp32 master + grad + Adam m, v (mixed precision or fp32)


def _check_name_matches(path: str, spec: ModelSpec, precision: str) -> None:
    """Galvatron names files ``<kind>_<precision>_hidden{h}_head{a}[_seqlen{s}]`` (or by model,
    ``..._t5-3B``); refuse a file of another model, precision or (older layout, one length per
    file) sequence length."""
    name = os.path.basename(path)
    lt = spec.layer_types[0]
    checks = [("hidden", r"_hidden(\d+)", lt.hidden_size, "--hidden-size"),
              ("head", r"_head(\d+)", lt.num_attention_heads, "--num-attention-heads"),
              ("seqlen", r"_seqlen(\d+)", lt.seq_length, "--seq-length")]
    for label, pattern, value, flag in checks:
        m = re.search(pattern + r"(?=_|\.|$)", name)
        if m and int(m[1]) != value and len(spec.layer_types) == 1:
            raise GalvatronFormatError(
                f"{path}: the file name says {label}={m[1]} but the model has {flag}={value}; "
                f"give the profile of this model or profile it with Galvatron")
    m = re.search(r"_(fp32|bf16|fp16)_", name)
    if m and m[1] != precision:
        raise GalvatronFormatError(
            f"{path}: profiled in {m[1]} but the run trains in {precision} (--bf16/--fp16 select "
            f"it); give a {precision} profile or train in {m[1]}")


def galvatron_type_index(spec: ModelSpec, found: list[int],
                         layer_type_map: Mapping[str, int] | None = None,
                         path: str = "") -> dict[str, int]:
    """Which Galvatron ``layertype_i`` prices each of ``spec``'s layer types.

    ``layer_type_map`` (type name -> i) when given; else the i-th type is Galvatron's i-th when
    the counts agree (T5: 0 = encoder, 1 = decoder); else, for our Swin spec, whose first block
    of a stage is its own ``<stage>_merge`` type (it holds the patch merging), Galvatron's
    stage records price both the stage's ``<stage>`` and ``<stage>_merge`` types.
    """
    names = [lt.name for lt in spec.layer_types]
    if layer_type_map is not None:
        mapping = dict(layer_type_map)
    elif len(found) == len(names):
        mapping = {n: i for i, n in enumerate(names)}
    else:
        plain = [n for n in names if not n.endswith("_merge")]
        merges = {n: n[: -len("_merge")] for n in names if n.endswith("_merge")}
        mapping = {n: i for i, n in enumerate(plain)}
        mapping.update({n: mapping.get(b, -1) for n, b in merges.items()})
        if len(plain) != len(found) or -1 in mapping.values():
            mapping = {}
    missing = [n for n in names if mapping.get(n) not in found]
    if missing or sorted(set(mapping.values())) != found:
        raise GalvatronFormatError(
            f"{path}: holds layer types {found} but the model has {len(names)} ({names}); give "
            f"the profile of this model (Galvatron's layertype_i is the model's i-th layer type: "
            f"T5 0 = encoder, 1 = decoder; Swin 0..3 = its stages) or map them with "
            f"layer_type_map={{name: i}}")
    return {n: mapping[n] for n in names}


def _split_fit(acts: Mapping[int, float], rep: float, split: float) -> tuple[float, float]:
    """Replicated and tp-split bytes per sample from measured ``acts`` (bytes by tp, tp 1
    present): the line ``a + b/t`` through tp 1 and the largest degree; with only tp 1 the
    analytic ``rep:split`` ratio, scaled to the measurement."""
    if len(acts) >= 2:
        t_max = max(acts)
        s = max(0.0, (acts[1] - acts[t_max]) / (1 - 1 / t_max))
        return max(0.0, acts[1] - s), s
    scale = acts[1] / max(rep + split, 1.0)
    return rep * scale, split * scale


def _with_merge(measured: LayerTypeProfile, plain: LayerTypeProfile,
                merge: LayerTypeProfile) -> LayerTypeProfile:
    """``measured`` (a stage's plain block) for a block that also merges patches: parameters
    plus the analytic difference; time and activations scaled by the analytic ratio."""
    def ratio(attr: str) -> float:
        a, b = getattr(merge, attr), getattr(plain, attr)
        return a / b if b > 0 else 1.0

    return replace(
        measured, parameter_count=measured.parameter_count
        + max(0, merge.parameter_count - plain.parameter_count),
        forward_time_per_sample_s=measured.forward_time_per_sample_s
        * ratio("forward_time_per_sample_s"),
        activation_replicated_bytes=measured.activation_replicated_bytes
        * ratio("activation_replicated_bytes"),
        activation_split_bytes=measured.activation_split_bytes * ratio("activation_split_bytes"),
        activation_bytes_by_tp={t: v * ratio("activation_split_bytes")
                                for t, v in measured.activation_bytes_by_tp.items()},
        activation_bytes_by_tp_sp={t: v * ratio("activation_split_bytes")
                                   for t, v in measured.activation_bytes_by_tp_sp.items()},
        recompute_bytes_per_sample=measured.recompute_bytes_per_sample
        * ratio("recompute_bytes_per_sample"),
        flops_per_sample=merge.flops_per_sample)


def _sp_metadata(sp: gm.GalvatronMemoryRecords, spec: ModelSpec, index: Mapping[str, int],
                 seqs: tuple[int, ...]) -> dict[str, Any]:
    """The Megatron sequence-parallel records (``*_sp``) in our units (bytes, parameters), kept
    in the profile's metadata for when our runtime splits activations by tp the same way."""
    def table(values: Mapping[int, float]) -> dict[str, float]:
        return {str(t): v * MB for t, v in sorted(values.items())}

    layers = {}
    for lt in spec.layer_types:
        k = index[lt.name]
        if k not in sp.layers:
            continue
        rec, seq = sp.layer(k, lt.seq_length)
        layers[lt.name] = {"seq_length": seq if seq is not None else lt.seq_length,
                           "parameter_count": round(rec.parameter_mb * MB / 4),
                           "activation_bytes_per_sample_by_tp": table(rec.activation_mb_per_sample),
                           "recompute_bytes_per_sample": rec.checkpoint_mb_per_sample * MB}
    other = {}
    for pos in gm.OTHER_POSITIONS:
        other_rec = sp.other_record(pos, seqs)
        other[pos] = {"model_state_bytes_by_vocab_tp": table(other_rec.model_states_mb),
                      "activation_bytes_per_sample_by_vocab_tp":
                          table(other_rec.activation_mb_per_sample)}
    return {"what": "Galvatron's *_sp records: measured with Megatron sequence parallelism "
                    "(every activation split by tp); the layers' activations price our "
                    "sequence_parallel layers (activation_bytes_by_tp_sp), the embedding/head "
                    "ones are for reference",
            "layer_types": layers, "embedding_head": other}


def _sp_activations(mem: gm.GalvatronMemory, layer_type: int, seq: int,
                    notes: list[str]) -> dict[int, float]:
    """Bytes per sample by tp of layer type ``layer_type`` measured with Megatron-SP (the
    ``*_sp`` records), when measured at two or more tp degrees (one degree says nothing about
    the split); a note says which."""
    if mem.megatron_sp is None or layer_type not in mem.megatron_sp.layers:
        return {}
    try:
        rec, _ = mem.megatron_sp.layer(layer_type, seq)
    except GalvatronFormatError as err:  # the SP records are extra: never block the import
        notes.append(f"layertype_{layer_type}: Megatron-SP records not used: {err}")
        return {}
    acts = {t: v * MB for t, v in rec.activation_mb_per_sample.items()}
    if len(acts) < 2:
        return {}
    notes.append(f"layertype_{layer_type}: sequence-parallel layers priced with the *_sp "
                 f"records (tp {', '.join(str(t) for t in sorted(acts))})")
    return acts


def model_profile_from_galvatron(computation_path: str | os.PathLike,
                                 memory_path: str | os.PathLike, spec: ModelSpec,
                                 training: TrainingSpec, cluster: ClusterSpec,
                                 layer_type_map: Mapping[str, int] | None = None) -> ModelProfile:
    """A ``ModelProfile`` (source "galvatron") from Galvatron's computation and memory files.

    Galvatron's ``layertype_i`` prices ``spec.layer_types[i]`` (several for T5 and Swin; see
    :func:`galvatron_type_index` for our Swin spec's patch-merging types). A merging type gets
    its stage's measured block plus what the analytic profile says the merging adds. Sequence
    lengths are matched exactly when profiled, else the next longer profiled one is used
    (conservative); several profiled batch sizes give a per-sample time and a per-call constant
    (a least-squares line). The plain records price layers without SP; Megatron-SP (``*_sp``)
    records price ``sequence_parallel`` layers (``activation_bytes_by_tp_sp``, measured at two or
    more tp degrees; else SP is priced as the tp=1 value over tp) and, when they are all the file
    has, the non-SP activations too (tp=1 value, analytic tp split); they are kept in
    ``metadata["megatron_sp"]``. Notes on every choice go into ``metadata["notes"]``.
    """
    comp = gf.read_computation(computation_path)
    mem = gm.read_memory(memory_path)
    for path in (comp.path, mem.path):
        _check_name_matches(path, spec, training.precision)
    if mem.model_config is not None:
        v3.check_model_config(mem.path, mem.model_config, spec)
    index = galvatron_type_index(spec, sorted(comp.layers), layer_type_map, comp.path)
    galvatron_type_index(spec, sorted(mem.primary.layers), layer_type_map, mem.path)
    base = analytic_profile(spec, training, cluster)
    beta = training.compute_bytes
    notes: list[str] = []
    layers = {}
    for lt in spec.layer_types:
        k = index[lt.name]
        time = comp.layer_time(k, lt.seq_length)
        notes.append(time.note)
        rec, seq = mem.layer(k, lt.seq_length)
        notes.append(f"memory profile layertype_{k}" + (f": seq{seq}" if seq is not None else ""))
        analytic = base.layer_types[lt.name]
        if lt.name.endswith("_merge") and lt.name[: -len("_merge")] in index:
            analytic = base.layer_types[lt.name[: -len("_merge")]]  # the measured plain block
        params = round(rec.parameter_mb * MB / 4)
        if not 0.5 <= params / max(analytic.parameter_count, 1) <= 2.0:
            raise GalvatronFormatError(
                f"memory profile {mem.path}: layertype_{k} parameter_size={rec.parameter_mb} MB "
                f"means {params} parameters per layer, but the model's layer has "
                f"{analytic.parameter_count}; the profile is of another model: profile this one")
        acts = {t: v * MB for t, v in rec.activation_mb_per_sample.items()}
        if mem.sequence_parallel:
            rep, split = _split_fit({1: acts[1]}, analytic.activation_replicated_bytes,
                                    analytic.activation_split_bytes)
            notes.append(f"layertype_{k}: only sequence-parallel records; tp split of "
                         f"activations from the analytic ratio, scaled to the measured tp=1 value")
        else:
            rep, split = _split_fit(acts, analytic.activation_replicated_bytes,
                                    analytic.activation_split_bytes)
        widest = min(cluster.world_size, lt.num_attention_heads)
        if len(acts) > 1 and widest > max(acts) and not mem.sequence_parallel:
            notes.append(f"layertype_{k}: activations measured up to tp {max(acts)}; larger tp "
                         f"(up to {widest} here) follows the line a + b/tp through the two largest "
                         f"measured degrees")
        acts_sp = _sp_activations(mem, k, lt.seq_length, notes)
        layers[lt.name] = replace(
            analytic, name=lt.name, parameter_count=params, activation_bytes_by_tp_sp=acts_sp,
            forward_time_per_sample_s=time.per_sample_ms / 1000.0,
            forward_time_constant_s=time.per_call_ms / 1000.0, backward_forward_ratio=2.0,
            activation_replicated_bytes=rep, activation_split_bytes=split,
            activation_bytes_by_tp=acts if not mem.sequence_parallel and len(acts) > 1 else {},
            recompute_bytes_per_sample=rec.checkpoint_mb_per_sample * MB,
            forward_time_by_tp={})
        if analytic is not base.layer_types[lt.name]:
            layers[lt.name] = _with_merge(layers[lt.name], analytic, base.layer_types[lt.name])
            notes.append(f"{lt.name}: layertype_{k} (the stage's block) plus the patch merging "
                         f"as the analytic profile prices it")
    seqs = tuple(next(lt.seq_length for lt in spec.layer_types if index[lt.name] == k)
                 for k in sorted(set(index.values())))
    other = comp.other_time(seqs)
    notes.append(other.note)
    first = mem.other_record("pp_on_first", seqs)
    last = mem.other_record("pp_on_last", seqs)
    emb_params = round(first.model_states_mb[1] * MB / MODEL_STATE_BYTES_PER_PARAM)
    last_params = round(last.model_states_mb[1] * MB / MODEL_STATE_BYTES_PER_PARAM)
    head_params = max(0, last_params - (emb_params if spec.tied_embeddings else 0))
    head_acts = {t: v * MB for t, v in last.activation_mb_per_sample.items()}
    a_emb = base.embedding
    h_rep, h_split = _split_fit(head_acts if not mem.sequence_parallel else {1: head_acts[1]},
                                a_emb.head_activation_replicated_bytes,
                                a_emb.head_activation_split_bytes)
    embedding = replace(
        a_emb, embedding_parameters=emb_params, head_parameters=head_params,
        embedding_forward_time_per_sample_s=other.per_sample_ms / 2000.0,
        head_forward_time_per_sample_s=other.per_sample_ms / 2000.0,
        forward_time_constant_s=other.per_call_ms / 2000.0,
        embedding_activation_bytes=first.activation_mb_per_sample[1] * MB,
        head_activation_replicated_bytes=h_rep, head_activation_split_bytes=h_split,
        hidden_bytes_per_sample=float(beta * spec.seq_length * spec.embedding_hidden_size))
    metadata: dict[str, Any] = {"model": spec.name, "computation_file": os.path.basename(comp.path),
                                "memory_file": os.path.basename(mem.path), "notes": notes}
    if mem.megatron_sp is not None:
        try:
            metadata["megatron_sp"] = _sp_metadata(mem.megatron_sp, spec, index, seqs)
        except GalvatronFormatError as err:  # the SP records are extra: never block the import
            notes.append(f"Megatron-SP records not kept: {err}")
    return ModelProfile(layer_types=layers, embedding=embedding, precision=training.precision,
                        source="galvatron", metadata=metadata)


def cluster_from_galvatron(allreduce_path: str | os.PathLike,
                           p2p_path: str | os.PathLike | None = None,
                           overlap_path: str | os.PathLike | None = None,
                           sp_time_path: str | os.PathLike | None = None, *,
                           gpu: str = "a100-40g", num_nodes: int | None = None,
                           devices_per_node: int | None = None,
                           name: str | None = None) -> ClusterSpec:
    """A ``ClusterSpec`` from Galvatron's hardware files on top of a ``gpu`` preset.

    Galvatron's files hold no device facts (FLOP/s, memory), so those come from ``gpu``
    (``presets.make_cluster``). The cluster shape defaults to the one in the file name
    (``..._<n>nodes_<g>gpus_per_node.json``). ``sp_time`` is optional; when given, the intercept
    of a linear fit of its all-reduce times gives the per-call collective latency.
    """
    shape = gf.cluster_shape_from_name(allreduce_path)
    if num_nodes is None or devices_per_node is None:
        if shape is None:
            raise GalvatronFormatError(
                f"all-reduce bandwidth file {allreduce_path}: its name does not say the cluster "
                f"shape (<n>nodes_<g>gpus_per_node); pass --num-nodes and --devices-per-node")
        num_nodes = num_nodes or shape[0]
        devices_per_node = devices_per_node or shape[1]
    table = {k: v * GB for k, v in gf.read_allreduce(allreduce_path).items()}
    world = num_nodes * devices_per_node
    too_big = [g for g, _ in table if g > world]
    if too_big:
        raise GalvatronFormatError(
            f"all-reduce bandwidth file {allreduce_path}: groups of {max(too_big)} ranks do not fit "
            f"a {num_nodes}x{devices_per_node} cluster; give the matching --num-nodes/"
            f"--devices-per-node")
    base = make_cluster(gpu, num_nodes, devices_per_node)
    sources = [f"all-reduce busbw measured by Galvatron ({os.path.basename(os.fspath(allreduce_path))})"]
    fields: dict[str, Any] = {"allreduce_busbw_table": table}
    probe = replace(base, allreduce_busbw_table={})
    in_node = [v for (g, c), v in table.items() if probe.nodes_spanned(g, c) == 1]
    if in_node:
        fields["intra_node_busbw"] = max(in_node)
    crossing = [v / -(-g // probe.nodes_spanned(g, c)) for (g, c), v in table.items()
                if probe.nodes_spanned(g, c) > 1]
    if crossing:
        # Per-GPU share of the inter-node link: the slowest busbw per member GPU on a node.
        fields["inter_node_bw_per_device"] = min(crossing)
        sources.append("inter-node bandwidth per GPU derived from the cross-node entries")
    if p2p_path is not None:
        p2p = {p: v * GB for p, v in gf.read_p2p(p2p_path).items()}
        fields["p2p_bw_table"] = p2p
        if num_nodes == 1 and p2p:
            fields["p2p_intra_bw"] = min(p2p.values())
        elif p2p:
            fields["p2p_inter_bw"] = min(p2p.values())
        sources.append(f"p2p bandwidth measured by Galvatron ({os.path.basename(os.fspath(p2p_path))})")
    if overlap_path is not None:
        fields["overlap_slowdown"] = gf.read_overlap(overlap_path)
        sources.append(f"overlap slowdown {fields['overlap_slowdown']:.4f} measured by Galvatron")
    if sp_time_path is not None:
        latency = _latency_from_sp_time(gf.read_sp_time(sp_time_path))
        if latency is not None:
            fields["collective_latency_s"] = latency
            sources.append(f"collective latency {latency * 1e6:.0f} us fitted to Galvatron's sp_time")
    sources.append("device facts from preset " + gpu + ": " + base.source)
    return replace(base, name=name or f"galvatron-{gpu}-{num_nodes}x{devices_per_node}",
                   source="; ".join(sources), **fields)


def _latency_from_sp_time(sp: Mapping[str, Mapping[int, Mapping[int, float]]]) -> float | None:
    """Per-call latency (seconds): least-squares intercept of all-reduce time vs size over the
    four smallest messages of the largest group (large messages say nothing about latency),
    clamped to [0, the smallest measured time]."""
    groups = sp.get("allreduce", {})
    if not groups:
        return None
    points = sorted(groups[max(groups)].items())[:4]
    if len(points) < 2:
        return None
    xs = [mb for mb, _ in points]
    ys = [ms for _, ms in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return min(max(0.0, (my - slope * mx)), ys[0]) / 1000.0


# ------------------------------------------------------------------------------ plans
_PIPELINES = {"pipedream_flush": "1f1b", "gpipe": "gpipe"}


def _int_list(path: str, data: Mapping[str, Any], key: str, n: int | None) -> list[int]:
    value = data.get(key)
    if value is None:
        raise GalvatronFormatError(f"galvatron config {path}: key {key!r} is missing; it must hold "
                                   f"one comma-separated integer per layer")
    text = str(value)
    try:
        out = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise GalvatronFormatError(f"galvatron config {path}: key {key!r}={text!r} must be "
                                   f"comma-separated integers, e.g. \"1,1,2,2\"") from None
    if n is not None and len(out) != n:
        raise GalvatronFormatError(f"galvatron config {path}: key {key!r} has {len(out)} entries but "
                                   f"tp_sizes_enc has {n}; give one entry per layer")
    return out


def _scalar(path: str, data: Mapping[str, Any], key: str, default: Any = None) -> Any:
    if key not in data:
        if default is None:
            raise GalvatronFormatError(f"galvatron config {path}: key {key!r} is missing; add it")
        return default
    return data[key]


def _int_scalar(path: str, data: Mapping[str, Any], key: str, default: int | None = None, *,
                minimum: int = 0, choices: tuple[int, ...] | None = None) -> int:
    """An integer key (an int, or an integral float or numeric string as JSON writers may
    give it); anything else, a value below ``minimum`` or outside ``choices`` is refused,
    never rounded or read as true."""
    value = _scalar(path, data, key, default)
    number: int | None = None
    if isinstance(value, bool):
        number = None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        number = int(value)
    if number is None:
        raise GalvatronFormatError(f"galvatron config {path}: key {key!r}={value!r} must be an "
                                   f"integer")
    if choices is not None and number not in choices:
        raise GalvatronFormatError(f"galvatron config {path}: key {key!r}={value!r} must be one "
                                   f"of {', '.join(map(str, choices))}")
    if number < minimum:
        raise GalvatronFormatError(f"galvatron config {path}: key {key!r}={value!r} must be at "
                                   f"least {minimum}")
    return number


def _zero_one(path: str, key: str, values: list[int], meaning: str) -> None:
    """Per-layer switches are 0 or 1; another value is refused, not read as on."""
    bad = [i for i, v in enumerate(values) if v not in (0, 1)]
    if bad:
        raise GalvatronFormatError(f"galvatron config {path}: key {key!r} entry {bad[0]} is "
                                   f"{values[bad[0]]}; use 0 or 1 ({meaning})")


def plan_from_galvatron_config(source: str | os.PathLike | Mapping[str, Any], world_size: int | None = None,
                               model: Mapping[str, Any] | None = None, *,
                               sequence_parallel: bool = False) -> Plan:
    """Convert a Galvatron ``galvatron_config_*.json`` (path or loaded dict) into a ``Plan``.

    ``sequence_parallel``: the plan was run with Galvatron's global ``--sequence_parallel``
    (Megatron-SP, not in the file): every layer with tp > 1 gets ``sequence_parallel``. The
    file's own ``use_sp`` is Ulysses sequence parallelism, which is refused.

    ``world_size`` defaults to the ``<n>nodes_<g>gpus_per_node`` part of the file name.
    ``dp_types_enc`` 1 means ZeRO-3, 0 the file's ``default_dp_type`` (``ddp`` or ``zero2``);
    ``embed_sdp`` 1 puts the vocabulary layers on ZeRO-3. Galvatron splits a batch into ``chunks``
    possibly unequal micro-batches; plans need equal ones, so the count becomes the smallest valid
    one >= ``chunks`` (smaller micro-batches: never more activation memory), noted in
    ``plan.search["notes"]``.
    """
    if isinstance(source, Mapping):
        path, data = "<dict>", dict(source)
    else:
        path = os.fspath(source)
        data = gf.read_json(path, "galvatron config")
        if world_size is None and (shape := gf.cluster_shape_from_name(path)) is not None:
            world_size = shape[0] * shape[1]
    if world_size is None:
        raise GalvatronFormatError(f"galvatron config {path}: the world size is not in the file; "
                                   f"pass it (--cluster sets it in the CLI)")
    known = {"pp_deg", "tp_sizes_enc", "tp_consecutive_flags", "dp_types_enc", "use_sp",
             "checkpoint", "global_bsz", "chunks", "pp_division", "pipeline_type",
             "default_dp_type", "vtp", "vsp", "embed_sdp"} | v3.PLAN_KEYS
    unknown = sorted(set(data) - known)
    if unknown:
        raise GalvatronFormatError(f"galvatron config {path}: unknown key(s) {unknown}; known keys "
                                   f"are {sorted(known)} (is this a Galvatron plan file?)")
    tps = _int_list(path, data, "tp_sizes_enc", None)
    n = len(tps)
    consec = _int_list(path, data, "tp_consecutive_flags", n)
    dp_types = _int_list(path, data, "dp_types_enc", n)
    # Galvatron's runtime falls back to --global_checkpoint (default 0) without the key, as its
    # shipped "3D" example plans are written.
    ckpt = _int_list(path, data, "checkpoint", n) if "checkpoint" in data else [0] * n
    _zero_one(path, "tp_consecutive_flags", consec, "1: consecutive TP ranks, 0: strided")
    _zero_one(path, "checkpoint", ckpt, "1: recompute the layer, 0: keep its activations")
    if "use_sp" in data and any(_int_list(path, data, "use_sp", n)):
        raise GalvatronFormatError(f"galvatron config {path}: key 'use_sp' enables Ulysses sequence "
                                   f"parallelism, which megatron_auto does not run; search again "
                                   f"with --sp_space tp")
    if _int_scalar(path, data, "vsp", 0, choices=(0, 1)):
        raise GalvatronFormatError(f"galvatron config {path}: key 'vsp'=1 (Ulysses on the vocabulary "
                                   f"layers) is not supported; search again with vsp off")
    pp = _int_scalar(path, data, "pp_deg", minimum=1)
    division = _int_list(path, data, "pp_division", None) if "pp_division" in data else None
    default_dp = _scalar(path, data, "default_dp_type", "ddp")
    if default_dp not in ("ddp", "zero2"):
        raise GalvatronFormatError(f"galvatron config {path}: key 'default_dp_type'={default_dp!r} "
                                   f"must be 'ddp' or 'zero2'")
    pipeline_type = _scalar(path, data, "pipeline_type", "pipedream_flush")
    if pipeline_type not in _PIPELINES:
        raise GalvatronFormatError(f"galvatron config {path}: key 'pipeline_type'={pipeline_type!r} "
                                   f"must be one of {sorted(_PIPELINES)}")
    bad = [i for i, t in enumerate(dp_types) if t not in (0, 1)]
    if bad:
        raise GalvatronFormatError(f"galvatron config {path}: key 'dp_types_enc' entry {bad[0]} is "
                                   f"{dp_types[bad[0]]}; use 0 (default dp type) or 1 (ZeRO-3)")
    extra, v3_notes = v3.layer_fields(path, data, n, _int_list)
    layers = tuple(LayerStrategy(tp=t, dp_mode="zero3" if d else default_dp,
                                 tp_consecutive=bool(c), recompute=bool(r),
                                 sequence_parallel=sequence_parallel and t > 1,
                                 cp=x.get("cp", 1), ep=x.get("ep", 1),
                                 expert_tp=x.get("expert_tp", 1))
                   for t, c, d, r, x in zip(tps, consec, dp_types, ckpt, extra))
    vocab = VocabStrategy(tp=_int_scalar(path, data, "vtp", 1, minimum=1),
                          dp_mode="zero3" if _int_scalar(path, data, "embed_sdp", 0,
                                                         choices=(0, 1)) else default_dp)
    global_bsz = _int_scalar(path, data, "global_bsz", minimum=1)
    chunks = _int_scalar(path, data, "chunks", 1, minimum=1)
    pipeline = PipelineSpec(size=pp, schedule=_PIPELINES[pipeline_type],
                            layers_per_stage=tuple(division) if division else ())
    if not division:
        pipeline = replace(pipeline, layers_per_stage=even_partition(n, pp))
    notes = [f"imported from Galvatron config {os.path.basename(path)}", *v3_notes]
    if sequence_parallel:
        notes.append("Galvatron's --sequence_parallel: Megatron-SP on every layer with tp > 1")
    last_error: PlanError | None = None
    for m in range(chunks, global_bsz + 1):
        if global_bsz % m:
            continue
        try:
            plan = Plan(world_size=world_size, global_batch_size=global_bsz, num_microbatches=m,
                        pipeline=pipeline, vocab=vocab, layers=layers, model=model,
                        search={"source": "galvatron", "notes": notes})
        except PlanError as err:
            last_error = err
            if "num_microbatches" in str(err) or "micro-batch" in str(err):
                continue
            raise GalvatronFormatError(f"galvatron config {path}: gives an invalid plan: {err}") from None
        if m != chunks:
            notes.append(f"chunks={chunks} does not split global_bsz={global_bsz} into equal "
                         f"micro-batches that every layer's dp divides; using {m} micro-batches")
            warn_flag(f"galvatron config {path}: {notes[-1]} (noted in the plan's search.notes)")
        return plan
    raise GalvatronFormatError(f"galvatron config {path}: no micro-batch count >= chunks={chunks} "
                               f"gives a valid plan ({last_error}); check global_bsz and tp_sizes_enc")


def plan_to_galvatron_config(plan: Plan) -> tuple[dict[str, Any] | None, list[str]]:
    """The Galvatron 2.4 ``galvatron_config`` equivalent of ``plan``, or ``(None, reasons)``.

    Galvatron has one data-parallel type for all non-ZeRO-3 layers (``default_dp_type``), so a
    plan mixing ``ddp`` and ``zero2`` layers, or whose vocabulary uses a third flavour, has none.
    The inverse of :func:`plan_from_galvatron_config` (``chunks`` = ``num_microbatches``).
    """
    modes = {layer.dp_mode for layer in plan.layers} | {plan.vocab.dp_mode}
    defaults = sorted(modes - {"zero3"})
    reasons = []
    if len(defaults) > 1:
        reasons.append(f"layers use both {defaults[0]} and {defaults[1]}; Galvatron has one "
                       f"default_dp_type besides ZeRO-3")
    elif defaults and defaults[0] not in ("ddp", "zero2"):
        reasons.append(f"dp_mode {defaults[0]} has no Galvatron default_dp_type (ddp or zero2)")
    sp = [layer.sequence_parallel for layer in plan.layers if layer.tp > 1]
    if any(sp) and not all(sp):
        reasons.append("sequence_parallel on some tp > 1 layers only; Galvatron's Megatron-SP "
                       "(--sequence_parallel) is global")
    if plan.virtual_size > 1:
        reasons.append(f"pipeline.virtual_size={plan.virtual_size}: Galvatron has no "
                       f"interleaved schedule")
    partial = [i for i, layer in enumerate(plan.layers) if not isinstance(layer.recompute, bool)]
    if partial:
        reasons.append(f"layers {partial} recompute single modules; Galvatron's checkpoint flag "
                       f"is the whole layer or nothing")
    offloaded = [i for i, layer in enumerate(plan.layers) if layer.offload is not False]
    if offloaded:
        reasons.append(f"layers {offloaded} offload activations; Galvatron has no offload")
    extra, v3_reasons = v3.export_fields(plan)
    reasons += v3_reasons
    if reasons:
        return None, reasons
    default = defaults[0] if defaults else "zero2"
    schedule = {v: k for k, v in _PIPELINES.items()}[plan.pipeline.schedule]

    def joined(values: Any) -> str:
        return ",".join(str(int(v)) for v in values)

    config = {
        "pp_deg": plan.pp_size,
        "tp_sizes_enc": joined(layer.tp for layer in plan.layers),
        "tp_consecutive_flags": joined(layer.tp_consecutive for layer in plan.layers),
        "dp_types_enc": joined(layer.dp_mode == "zero3" for layer in plan.layers),
        "use_sp": joined(0 for _ in plan.layers),
        "checkpoint": joined(layer.recompute for layer in plan.layers),
        "global_bsz": plan.global_batch_size, "chunks": plan.num_microbatches,
        "pp_division": joined(plan.pipeline.layers_per_stage), "pipeline_type": schedule,
        "default_dp_type": default, "vtp": plan.vocab.tp, "vsp": 0,
        "embed_sdp": int(plan.vocab.dp_mode == "zero3"), **extra,
    }
    return config, []
