"""Per-layer-type profiles: the numbers the cost model needs, analytic or measured.

A profile says, per layer type, how long its forward takes per sample (and per call), how many
parameters it has and how many bytes of activations it keeps per sample; and the same for the
embedding (first stage) and the LM head (last stage). Three sources fill it: :func:`analytic_profile`
(FLOPs and shapes; needs no GPU), a measured file written by the profiler (format
``megatron_auto.model_profile`` version 1, :meth:`ModelProfile.load`), and the Galvatron importer.

Units are SI throughout: seconds, bytes, samples. "Per sample" means per sequence of the layer's
sequence length; times are at tensor-parallel degree 1 unless a per-tp table says otherwise.
Formulas are in docs/cost_model.md §2. The per-part records (:class:`LayerTypeProfile`,
:class:`EmbeddingProfile`) live in ``profile_records.py``; this module holds the whole-model
record, its file format and the analytic builder.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping

from ...utils.jsonfile import read_json, write_json
from ..cost import gpu_terms
from .attention_terms import attention_times, cross_attention_flops, layer_core_flops
from .cluster_model import ClusterModel
from .model_spec import LayerType, ModelSpec, TrainingSpec
from .profile_records import EmbeddingProfile, LayerTypeProfile, ProfileError
from .profile_records import need as _need

PROFILE_FORMAT = "megatron_auto.model_profile"
PROFILE_VERSION = 1
SOURCES = ("analytic", "measured", "galvatron")
# Kernel launches and small ops of one transformer layer's forward, charged per call: about 25
# kernels at ~2 us. A guess for the analytic profile; measured profiles replace it.
ANALYTIC_LAYER_CALL_OVERHEAD_S = 50e-6


@dataclass(frozen=True)
class ModelProfile:
    """Everything the cost model needs about a model, keyed by layer-type name."""

    layer_types: Mapping[str, LayerTypeProfile]
    embedding: EmbeddingProfile
    precision: str
    source: str
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", dict(self.layer_types))
        _need(self.precision in ("fp32", "bf16", "fp16"), "precision", self.precision,
              "choose one of fp32, bf16, fp16")
        _need(self.source in SOURCES, "source", self.source, f"choose one of {', '.join(SOURCES)}")
        _need(len(self.layer_types) >= 1, "layer_types", {}, "needs one entry per layer type")
        for key, lt in self.layer_types.items():
            _need(key == lt.name, f"layer_types.{key}.name", lt.name, "must equal its key")

    def check_matches(self, spec: ModelSpec, precision: str) -> None:
        """Raise ``ProfileError`` unless this profile covers ``spec``'s layer types and precision."""
        missing = [t.name for t in spec.layer_types if t.name not in self.layer_types]
        _need(not missing, "layer_types", sorted(self.layer_types),
              f"has no entry for layer type(s) {missing} of model {spec.name!r}; profile the model "
              f"again or use the analytic profile")
        _need(self.precision == precision, "precision", self.precision,
              f"the run trains in {precision}; profile in that precision")

    # --------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        layers = {}
        for key, lt in self.layer_types.items():
            d = asdict(lt)
            d["forward_time_by_tp"] = {str(t): list(v) for t, v in lt.forward_time_by_tp.items()}
            d["activation_bytes_by_tp"] = {str(t): v for t, v in lt.activation_bytes_by_tp.items()}
            if lt.activation_bytes_by_tp_sp:
                d["activation_bytes_by_tp_sp"] = {str(t): v
                                                  for t, v in lt.activation_bytes_by_tp_sp.items()}
            else:  # absent = none measured: profiles without SP stay as they were
                del d["activation_bytes_by_tp_sp"]
            if not lt.tp_replicated_parameter_count:
                del d["tp_replicated_parameter_count"]
            # absent = not measured / no GQA / none: profiles without them stay as they were
            if lt.attention_time_by_seq_length:
                d["attention_time_by_seq_length"] = {
                    str(n): v for n, v in lt.attention_time_by_seq_length.items()}
            else:
                del d["attention_time_by_seq_length"]
            for name in ("kv_bytes_per_sample", "attention_kept_quadratic_bytes",
                         "module_saved_bytes", "module_forward_time_s", "moe_load_imbalance"):
                if not d[name]:
                    del d[name]
            layers[key] = d
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "precision": self.precision,
                "source": self.source, "metadata": dict(self.metadata), "layer_types": layers,
                "embedding": asdict(self.embedding)}

    @classmethod
    def from_dict(cls, data: Any) -> "ModelProfile":
        _need(isinstance(data, Mapping), "<root>", type(data).__name__, "must be a JSON object")
        _need(data.get("format") == PROFILE_FORMAT, "format", data.get("format"),
              f'must be "{PROFILE_FORMAT}" (a Galvatron profile? convert it with '
              f"`megatron-auto import-galvatron`)")
        _need(data.get("version") == PROFILE_VERSION, "version", data.get("version"),
              f"this megatron_auto reads model profile version {PROFILE_VERSION}")
        known = {"format", "version", "precision", "source", "metadata", "layer_types", "embedding"}
        unknown = sorted(set(data) - known)
        _need(not unknown, "<keys>", unknown, f"unknown key(s); allowed: {sorted(known)}")
        layers = data.get("layer_types")
        _need(isinstance(layers, Mapping) and bool(layers), "layer_types", layers,
              "must be an object mapping layer-type names to their profiles")
        parsed = {}
        for key, d in layers.items():
            parsed[key] = _build(LayerTypeProfile, d, f"layer_types.{key}")
        emb = _build(EmbeddingProfile, data.get("embedding"), "embedding")
        metadata = data.get("metadata", {})
        _need(isinstance(metadata, Mapping), "metadata", metadata, "must be an object")
        return cls(layer_types=parsed, embedding=emb, precision=data.get("precision"),
                   source=data.get("source"), metadata=metadata)

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ModelProfile":
        data = read_json(path, "--model-profile", ProfileError,
                         syntax_fix="profile again or fix the file")
        try:
            profile = cls.from_dict(data)
        except ProfileError as err:
            raise ProfileError(f"--model-profile {path}: {err}") from None
        for layer in profile.layer_types.values():
            # Not a field (not saved, not compared): names the file in errors found later,
            # when the search asks for a TP degree the file does not have.
            object.__setattr__(layer, "_origin", str(path))
        return profile


def fill_attention_defaults(profile: ModelProfile, spec: ModelSpec, backend: str = "math"
                            ) -> ModelProfile:
    """``profile`` with an ``attention_time_by_seq_length`` for every layer type that has none
    (a profile written before the field existed, or imported): the layer's measured forward
    time per sample times the score matmuls' share of its FLOPs, at the layer's length (the
    quadratic rule of :meth:`LayerTypeProfile.attention_time` extends it), and the key width of
    its shape. Layer types with a table are kept; returns ``profile`` itself when all have."""
    missing = [lt for lt in spec.layer_types
               if lt.name in profile.layer_types
               and not profile.layer_types[lt.name].attention_time_by_seq_length]
    if not missing:
        return profile
    layers = dict(profile.layer_types)
    for lt in missing:
        lp = layers[lt.name]
        share = gpu_terms.attention_score_flops(lt.seq_length, lt.attended_tokens,
                                                lt.attention_width, lt.causal,
                                                backend) / layer_core_flops(lt, backend)
        kv = lp.kv_bytes_per_sample or (lp.hidden_bytes_per_sample * lt.kv_size / lt.hidden_size
                                        if lt.kv_size != lt.hidden_size else 0.0)
        filled = replace(lp, attention_time_by_seq_length={
            lt.seq_length: lp.forward_time_per_sample_s * share}, kv_bytes_per_sample=kv)
        if hasattr(lp, "_origin"):
            object.__setattr__(filled, "_origin", getattr(lp, "_origin"))
        layers[lt.name] = filled
    return replace(profile, layer_types=layers)


def with_analytic_layer_types(profile: ModelProfile, spec: ModelSpec, training: TrainingSpec,
                              cluster: ClusterModel) -> ModelProfile:
    """``profile`` with an entry for every layer type of ``spec`` it lacks, from the analytic
    profile (bytes from shapes), its times scaled by the measured-over-analytic forward time of
    a layer type both have, so that measured and derived layers are on one clock. The model
    profiler measures the dense layer only (an MoE layer's experts, router and exchanges are
    priced by cost/moe.py from the shapes and the cluster); ``--auto-parallel`` uses this for
    them. ``metadata["analytic_layer_types"]`` names the derived entries and
    ``metadata["analytic_time_scale"]`` the factor; a derived MoE entry takes the router's
    load imbalance the profiler measured (``moe_load_imbalance`` of a measured entry).
    Returns ``profile`` itself when complete."""
    missing = [lt.name for lt in spec.layer_types if lt.name not in profile.layer_types]
    if not missing:
        return profile
    analytic = analytic_profile(spec, training, cluster)
    scale = 1.0
    for name, measured in profile.layer_types.items():
        derived = analytic.layer_types.get(name)
        if derived is not None and derived.forward_time_per_sample_s > 0:
            scale = measured.forward_time_per_sample_s / derived.forward_time_per_sample_s
            break
    layers = dict(profile.layer_types)
    imbalance = max((lt.moe_load_imbalance for lt in profile.layer_types.values()), default=0.0)
    moe_types = {lt.name for lt in spec.layer_types if lt.moe is not None}
    for name in missing:
        lt = analytic.layer_types[name]
        layers[name] = replace(
            lt, moe_load_imbalance=imbalance if name in moe_types else 0.0,
            forward_time_per_sample_s=lt.forward_time_per_sample_s * scale,
            forward_time_constant_s=lt.forward_time_constant_s * scale,
            forward_time_by_tp={t: (a * scale, b * scale)
                                for t, (a, b) in lt.forward_time_by_tp.items()},
            attention_time_by_seq_length={n: v * scale
                                          for n, v in lt.attention_time_by_seq_length.items()})
    metadata = {**profile.metadata, "analytic_layer_types": missing,
                "analytic_time_scale": scale}
    return replace(profile, layer_types=layers, metadata=metadata)


def _build(kind: type, data: Any, where: str) -> Any:
    """Construct dataclass ``kind`` from a JSON object, naming missing/unknown/mistyped fields."""
    _need(isinstance(data, Mapping), where, data, "must be a JSON object")
    names = {f.name for f in fields(kind)}
    unknown = sorted(set(data) - names)
    _need(not unknown, where + ".<keys>", unknown, f"unknown key(s); allowed: {sorted(names)}")
    kwargs = dict(data)
    if kind is LayerTypeProfile:
        if "forward_time_by_tp" in kwargs:
            table = kwargs["forward_time_by_tp"]
            _need(isinstance(table, Mapping), where + ".forward_time_by_tp", table,
                  'must map tp (as a string) to [per_sample_s, constant_s]')
            try:
                kwargs["forward_time_by_tp"] = {int(t): (float(v[0]), float(v[1]))
                                                for t, v in table.items()}
            except (TypeError, ValueError, IndexError):
                raise ProfileError(f"profile field {where}.forward_time_by_tp={table!r}: must map "
                                   f"tp (as a string) to [per_sample_s, constant_s]") from None
        for name in ("activation_bytes_by_tp", "activation_bytes_by_tp_sp",
                     "attention_time_by_seq_length"):
            if name not in kwargs:
                continue
            table = kwargs[name]
            try:
                kwargs[name] = {int(t): float(v) for t, v in table.items()}
            except (AttributeError, TypeError, ValueError):
                what = ("a sequence length (as a string) to seconds per sample"
                        if name == "attention_time_by_seq_length"
                        else "tp (as a string) to bytes per sample")
                raise ProfileError(f"profile field {where}.{name}={table!r}: must "
                                   f"map {what}") from None
    try:
        return kind(**kwargs)
    except TypeError as err:
        missing = sorted(n for n in names if n not in kwargs)
        raise ProfileError(f"profile field {where}: {err}; missing fields may be among "
                           f"{missing}") from None


# ------------------------------------------------------------------------- analytic
def analytic_profile(spec: ModelSpec, training: TrainingSpec, cluster: ClusterModel) -> ModelProfile:
    """A profile from shapes alone: FLOPs over sustained FLOP/s, bytes from tensor sizes.

    ``cluster`` is a ``ClusterSpec`` (only ``flops(precision)`` or ``peak_flops`` and
    ``compute_efficiency`` are used). Derivations in docs/cost_model.md §2.
    """
    if hasattr(cluster, "flops"):
        rate = cluster.flops(training.precision)
    else:
        # an object with the two fields alone (ClusterModel itself has flops)
        rate = (getattr(cluster, "peak_flops")[training.precision]
                * getattr(cluster, "compute_efficiency"))
    beta = training.compute_bytes
    # GPU terms (docs/cost_model.md §9): the attention kernel, matmuls on a roofline and
    # element-wise bytes over HBM; a cluster without them prices as before (math, FLOPs only).
    backend = getattr(cluster, "attention_backend", "math")
    hbm = float(getattr(cluster, "hbm_bandwidth", 0.0))
    mask = dropout_mask_bytes(cluster, beta)
    layers = {}
    for lt in spec.layer_types:
        s, h, f, a = lt.seq_length, lt.hidden_size, lt.ffn_hidden_size, lt.num_attention_heads
        p = lt.attention_width  # h unless kv_channels says otherwise (T5)
        mlp_mats = 3 if lt.activation == "swiglu" else 2
        k = lt.attended_tokens  # s, or the w^2 tokens of a window (Swin)
        kv = lt.kv_size  # keys and values: h, or g * head_dim with grouped-query attention
        flops = layer_core_flops(lt, backend)
        # Kept for backward (Korthikanti et al. 2022, generalised to any dtype and FFN width):
        # not split by TP: two norm inputs, the QKV and FC1 inputs (beta*s*h each) and two
        # dropout masks (1 byte per element on CUDA, beta on CPU: dropout_mask_bytes); split: Q, K, V and the projection input (beta*s*(2p + 2kv)),
        # the MLP intermediates, and per head the softmax output, its dropout mask and output.
        replicated = (4 * beta + 2 * mask) * s * h
        mlp_kept = (2 * beta if lt.activation == "gelu" else 3 * beta) * s * f
        split = beta * s * (2 * p + 2 * kv) + mlp_kept + gpu_terms.attention_kept_bytes(
            beta, a, s, k, backend, mask)
        tp_message = 0.0  # 0: the (s, h) hidden state, two TP all-reduces per direction
        recompute_input = beta * s * h
        m = lt.cross_attention_seq_length
        if m:
            # Cross-attention (T5 decoder) over m encoder tokens: query and output projections
            # on s, key/value projections on m, scores and weighted sum s x m. Kept: its norm
            # input, the query input and a dropout mask (replicated), Q, K, V, the projection
            # input and per head the softmax, its mask and output (split), and the encoder
            # output it reads (replicated; an upper bound where decoder layers of one layout
            # share it). Its TP messages: one more all-reduce of (s, h) forward, and backward
            # the query input's and the key/value input's (m, h): three of s and one of m per
            # direction on average become the two priced messages.
            flops += cross_attention_flops(lt, backend)
            replicated += (2 * beta + mask) * s * h + beta * m * h
            split += 2 * beta * s * p + 2 * beta * m * p + gpu_terms.attention_kept_bytes(
                beta, a, s, m, backend, mask)
            tp_message = beta * h * (6 * s + m) / 4
            recompute_input += beta * m * h  # a recomputing decoder layer keeps both inputs
        if lt.carried_seq_length and not m:
            # the carried decoder input rides in the received buffer of an encoder stage
            # (an upper bound: counted per encoder layer, held once per stage)
            replicated += beta * lt.carried_seq_length * h
        if lt.merge_input_hidden:
            # Patch merging (Swin): the 4m-wide concatenation and its normalised copy are kept
            # (replicated); its projection costs 2 * s * 4m * h.
            m = lt.merge_input_hidden
            flops += 2 * s * 4 * m * h
            replicated += 2 * beta * s * 4 * m
        by_tp: dict[int, tuple[float, float]] = {}
        per_sample = flops / rate
        if hbm > 0:
            per_sample, by_tp = _gpu_forward_times(lt, beta, training.mixed, backend, rate, hbm)
        quadratic = (0.0 if backend in gpu_terms.NO_SCORES_BACKENDS or lt.window_size
                     else gpu_terms.attention_kept_bytes(beta, a, s, k, backend, mask))
        layers[lt.name] = LayerTypeProfile(
            attention_time_by_seq_length=attention_times(lt, backend, rate),
            kv_bytes_per_sample=float(beta * s * kv) if kv != h else 0.0,
            attention_kept_quadratic_bytes=float(quadratic),
            name=lt.name, parameter_count=lt.num_parameters,
            # the norms (weights, LayerNorm biases), the two row-parallel biases and an MoE
            # layer's router stay whole
            tp_replicated_parameter_count=(4 if lt.normalization == "layernorm" else 2) * h
            + (2 * h if lt.add_bias_linear else 0) + (lt.moe.num_experts * h if lt.moe else 0),
            forward_time_per_sample_s=per_sample, activation_replicated_bytes=replicated,
            activation_split_bytes=split, recompute_bytes_per_sample=recompute_input,
            hidden_bytes_per_sample=beta * s * h, tp_message_bytes_per_sample=tp_message,
            boundary_bytes_per_sample=(beta * lt.boundary_seq_length * h
                                       if lt.carried_seq_length else 0.0),
            forward_time_constant_s=ANALYTIC_LAYER_CALL_OVERHEAD_S,
            backward_forward_ratio=2.0,
            # Backward scratch: the incoming and outgoing activation gradients (2 x s*h) and the
            # largest split intermediate gradient (the FFN activation or the score matrix).
            backward_scratch_replicated_bytes=2 * beta * s * h,
            backward_scratch_split_bytes=max(beta * s * f * (mlp_mats - 1),
                                             gpu_terms.attention_scratch_bytes(beta, a, s, k, h,
                                                                               backend)),
            weight_copy_bytes_per_parameter=float(beta) if training.mixed else 0.0,
            flops_per_sample=float(flops), forward_time_by_tp=by_tp, attention_backend=backend)
    s, h, v = spec.seq_length, spec.embedding_hidden_size, spec.vocab_size
    # The head projects every token (language models) or one pooled token (classifiers).
    t = spec.head_tokens or s
    head_flops = 2 * t * (spec.head_hidden_size or h) * v
    head_time = head_flops / rate
    if hbm > 0:
        # The head's GEMM on the roofline, then the loss's element-wise passes over the logits:
        # write them (beta), upcast (read beta, write 4), softmax (read 4, write 4 B per logit).
        head_time = (gpu_terms.gemm_time(t, v, spec.head_hidden_size or h, beta, rate, hbm)
                     + (2 * beta + 12) * t * v / hbm)
    emb = EmbeddingProfile(
        embedding_parameters=spec.embedding_parameters, head_parameters=spec.head_parameters,
        tied=spec.tied_embeddings, vocab_size=v, hidden_bytes_per_sample=beta * s * h,
        embedding_forward_time_per_sample_s=0.0,
        head_forward_time_per_sample_s=head_time,
        # Embedding output and its dropout mask; head: final-norm input and the fp32 softmax
        # the vocab-parallel loss keeps for backward (the logits are not kept).
        embedding_activation_bytes=(beta + mask) * s * h,
        head_activation_replicated_bytes=beta * s * h,
        head_activation_split_bytes=4 * t * v,
        # In the loss's forward, beside the shifted fp32 copy: the logits in the compute dtype
        # and, when that is not fp32, their fp32 upcast. Its backward works in place.
        head_transient_split_bytes=(beta + (4 if beta != 4 else 0)) * t * v,
        forward_time_constant_s=ANALYTIC_LAYER_CALL_OVERHEAD_S,
        final_norm_parameters=max(0, spec.head_parameters - (
            0 if spec.tied_embeddings else v * (spec.head_hidden_size or h))),
        replicated_parameters=spec.num_position_embeddings * spec.embedding_hidden_size)
    return ModelProfile(layer_types=layers, embedding=emb, precision=training.precision,
                        source="analytic",
                        metadata={"model": spec.name, "cluster": getattr(cluster, "name", ""),
                                  "sustained_flops": rate,
                                  **({"attention_backend": backend, "hbm_bandwidth": hbm}
                                     if hbm > 0 or backend != "math" else {})})


def dropout_mask_bytes(cluster: ClusterModel, beta: int) -> int:
    """Bytes per element of a dropout mask autograd keeps for backward: 1 on CUDA (the fused
    ``native_dropout`` keeps a bool mask); on a CPU cluster (``device_name`` ``cpu…``, what the
    hardware profiler writes there) ``at::dropout`` multiplies the input by a noise tensor of
    the input's dtype and keeps that, ``beta`` bytes (measured: a T5 encoder layer's kept bytes
    on CPU match the analytic ones exactly with ``beta``-byte masks; with 1-byte ones the
    analytic peak was 11-20% short)."""
    return beta if str(getattr(cluster, "device_name", "")).startswith("cpu") else 1


def _gpu_forward_times(lt: LayerType, beta: int, mixed: bool, backend: str, rate: float,
                       hbm: float) -> tuple[float, dict[int, tuple[float, float]]]:
    """Per-sample forward seconds at TP 1 and a ``(per_sample_s, constant_s)`` table for every
    TP degree the layer admits (up to 64): the roofline GEMMs, attention and element-wise
    bytes per sample (``gpu_terms.layer_forward_time``; the replicated element-wise part does not
    shrink with TP, hence a table), and per call the kernel launches plus autocast's weight cast.
    The cast happens once per micro-batch (backward reuses the saved copies) but the profile
    charges backward ``r`` times the forward, so the forward carries ``1/(1 + r)`` of it and
    forward + backward add up to one cast."""
    s, h, f, a = lt.seq_length, lt.hidden_size, lt.ffn_hidden_size, lt.num_attention_heads
    k = lt.attended_tokens
    table = {}
    groups = lt.num_query_groups or a  # TP keeps whole key/value heads
    for tp in gpu_terms.divisors_up_to((a, f, groups), min(a, 64)):
        per_sample = gpu_terms.layer_forward_time(s, h, f, a, k, lt.activation, lt.causal,
                                                  backend, beta, tp, rate, hbm, kv=lt.kv_size)
        if lt.merge_input_hidden:
            per_sample += 2 * s * 4 * lt.merge_input_hidden * h / tp / rate
        per_sample += cross_attention_flops(lt, backend) / tp / rate  # at the FLOP rate
        cast = gpu_terms.weight_cast_bytes(lt.num_parameters / tp, beta, mixed) / hbm
        table[tp] = (per_sample, ANALYTIC_LAYER_CALL_OVERHEAD_S + cast / (1 + 2.0))
    return table[1][0], table
