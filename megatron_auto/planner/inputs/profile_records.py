"""The per-part records of a model profile: a layer type's costs and the embedding's and head's.

:class:`LayerTypeProfile` holds one transformer layer type's forward times, attention times by
sequence length, parameters, kept activation bytes and per-TP tables; :class:`EmbeddingProfile`
the embedding's (first stage) and LM head's (last stage). Each validates itself.
``profiles.py`` holds the whole-model record (``ModelProfile``, its file format) and the
analytic builder. Units are SI throughout: seconds, bytes, samples. Pure, no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from .hardware import ATTENTION_BACKENDS


#: The modules of a layer the profiler measures one by one (``layers[i].recompute`` names).
PROFILED_MODULES = ("core_attn", "mlp", "norm")


class ProfileError(ValueError):
    """A malformed profile; the message names the field, the value and the fix."""


def need(cond: bool, name: str, value: Any, fix: str) -> None:
    """Raise ``ProfileError`` (``profile field <name>=<value>: <fix>``) unless ``cond``."""
    if not cond:
        raise ProfileError(f"profile field {name}={value!r}: {fix}")


def _fit_inverse(table: Mapping[int, float], tp: int) -> float:
    """Value at ``tp`` from a per-tp table: exact when present, else ``a + b/tp`` through the two
    largest measured degrees (activations split by tp plus a replicated part), never negative."""
    if tp in table:
        return float(table[tp])
    keys = sorted(table)
    if len(keys) == 1:
        return float(table[keys[0]])  # nothing known about the split: assume none (conservative)
    t1, t2 = keys[-2], keys[-1]
    b = (table[t1] - table[t2]) / (1.0 / t1 - 1.0 / t2)
    a = table[t1] - b / t1
    return max(0.0, a + b / tp)


@dataclass(frozen=True)
class LayerTypeProfile:
    """Costs of one transformer layer of a given type.

    Time of one forward call on ``b`` samples per rank at tp ``t``:
    ``forward_time_per_sample_s * b / t + forward_time_constant_s`` unless ``forward_time_by_tp``
    holds a measured ``(per_sample_s, constant_s)`` pair for ``t``. Backward is
    ``backward_forward_ratio`` times the forward.

    Activations kept per sample for backward at tp ``t`` (no recompute):
    ``activation_replicated_bytes + activation_split_bytes / t`` unless
    ``activation_bytes_by_tp`` has a measured value for ``t``. ``recompute_bytes_per_sample`` is
    kept instead when the layer recomputes (its input). ``backward_scratch_*`` are transient bytes
    per sample while the layer runs its backward; ``backward_scratch_constant_bytes`` is the part
    of that transient that does not grow with the batch (once per backward at tp 1, split by
    TP): a weight's gradient, made whole before autograd adds it into the kept ``.grad`` (the
    measured intercept; 0 = not measured). Under mixed precision, autocast saves a
    compute-dtype copy of every weight for backward: ``weight_copy_bytes_per_parameter`` per
    parameter per micro-batch in flight. ``hidden_bytes_per_sample`` is one ``(s, h)`` activation
    in the compute dtype (TP messages, p2p, relayouts). Two optional refinements (0: use
    ``hidden_bytes_per_sample``): ``boundary_bytes_per_sample`` is what a relayout or a stage
    boundary next to the layer moves per sample (T5: the hidden state and the carry beside it,
    ``(s_e + s_d, h)``; :attr:`moved_bytes_per_sample`), ``tp_message_bytes_per_sample`` the
    mean size of its TP all-reduces (a T5 decoder layer has more of them, some over the encoder
    tokens; :attr:`tp_bytes_per_sample`).

    Context parallelism reads three more (docs/cost_model.md §11): ``attention_time_by_seq_length``
    (``L`` -> forward seconds per sample of the core attention alone on ``L`` tokens, all heads,
    tp 1; :meth:`attention_time`; absent in older profiles:
    ``profiles.fill_attention_defaults``), ``kv_bytes_per_sample`` (one sample's keys in
    the compute dtype; 0: ``hidden_bytes_per_sample``) and ``attention_kept_quadratic_bytes``
    (kept bytes per sample growing with ``s^2``, which ring attention does not keep).

    Module recompute reads two measured tables (profiler/module_profiler.py; empty in older
    and analytic profiles, which then price the modules analytically: cost/recompute.py):
    ``module_saved_bytes`` (module -> bytes per sample at tp 1 that the module saves for
    backward beyond its own inputs, i.e. what recomputing it releases; ``norm`` counts both
    norms) and ``module_forward_time_s`` (module -> forward seconds per sample at tp 1, what
    recomputing it repeats), for the modules of :data:`PROFILED_MODULES`.
    """

    name: str
    parameter_count: int
    forward_time_per_sample_s: float
    activation_replicated_bytes: float
    activation_split_bytes: float
    recompute_bytes_per_sample: float
    hidden_bytes_per_sample: float
    forward_time_constant_s: float = 0.0
    backward_forward_ratio: float = 2.0
    backward_scratch_replicated_bytes: float = 0.0
    backward_scratch_split_bytes: float = 0.0
    weight_copy_bytes_per_parameter: float = 0.0
    backward_scratch_constant_bytes: float = 0.0
    forward_time_by_tp: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    activation_bytes_by_tp: Mapping[int, float] = field(default_factory=dict)
    flops_per_sample: float = 0.0
    # The SDPA kernel this profile's numbers are for: measured (the profiler records the op that
    # ran) or assumed by the analytic profile (the cluster's attention_backend).
    attention_backend: str = "math"
    tp_replicated_fraction: float = 0.0
    boundary_bytes_per_sample: float = 0.0
    tp_message_bytes_per_sample: float = 0.0
    # Measured with Megatron sequence parallelism (e.g. Galvatron's ``*_sp`` records), per tp.
    activation_bytes_by_tp_sp: Mapping[int, float] = field(default_factory=dict)
    # Of ``parameter_count``, those every TP rank holds whole (norms, row-parallel biases).
    tp_replicated_parameter_count: int = 0
    attention_time_by_seq_length: Mapping[int, float] = field(default_factory=dict)
    kv_bytes_per_sample: float = 0.0
    attention_kept_quadratic_bytes: float = 0.0
    module_saved_bytes: Mapping[str, float] = field(default_factory=dict)
    module_forward_time_s: Mapping[str, float] = field(default_factory=dict)
    # MoE: the router's measured load, most tokens of one expert over the mean per expert, on
    # the profiling batch (profiler/model_profiler.py); 0 = not measured (cost/moe.py then
    # uses its documented LOAD_IMBALANCE).
    moe_load_imbalance: float = 0.0

    @property
    def moved_bytes_per_sample(self) -> float:
        """Bytes per sample of a relayout or stage boundary next to this layer."""
        return self.boundary_bytes_per_sample or self.hidden_bytes_per_sample

    @property
    def tp_bytes_per_sample(self) -> float:
        """Bytes per sample of each of the layer's priced TP all-reduces."""
        return self.tp_message_bytes_per_sample or self.hidden_bytes_per_sample

    def __post_init__(self) -> None:
        object.__setattr__(self, "forward_time_by_tp",
                           {int(k): (float(v[0]), float(v[1])) for k, v in self.forward_time_by_tp.items()})
        for table in ("activation_bytes_by_tp", "activation_bytes_by_tp_sp",
                      "attention_time_by_seq_length"):
            object.__setattr__(self, table,
                               {int(k): float(v) for k, v in getattr(self, table).items()})
        need(self.moe_load_imbalance == 0 or self.moe_load_imbalance >= 1,
             f"layer_types.{self.name}.moe_load_imbalance", self.moe_load_imbalance,
             "is the busiest expert's tokens over the mean: at least 1, or 0 for not measured")
        for table in ("module_saved_bytes", "module_forward_time_s"):
            values = getattr(self, table)
            need(isinstance(values, Mapping), f"layer_types.{self.name}.{table}", values,
                 f"must map module names ({', '.join(PROFILED_MODULES)}) to numbers")
            for module, value in values.items():
                need(module in PROFILED_MODULES, f"layer_types.{self.name}.{table}", module,
                     f"unknown module; choose among {', '.join(PROFILED_MODULES)}")
                need(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
                     f"layer_types.{self.name}.{table}.{module}", value,
                     "must be a finite number >= 0")
            object.__setattr__(self, table, {str(k): float(v) for k, v in values.items()})
        where = f"layer_types.{self.name}."
        need(isinstance(self.parameter_count, int) and self.parameter_count >= 0,
             where + "parameter_count", self.parameter_count, "must be a non-negative integer")
        need(isinstance(self.tp_replicated_parameter_count, int)
             and 0 <= self.tp_replicated_parameter_count <= self.parameter_count,
             where + "tp_replicated_parameter_count", self.tp_replicated_parameter_count,
             "must be an integer between 0 and parameter_count")
        for attr in ("forward_time_per_sample_s", "activation_replicated_bytes",
                     "activation_split_bytes", "recompute_bytes_per_sample",
                     "hidden_bytes_per_sample", "forward_time_constant_s",
                     "backward_scratch_replicated_bytes", "backward_scratch_split_bytes",
                     "weight_copy_bytes_per_parameter", "flops_per_sample",
                     "backward_scratch_constant_bytes", "boundary_bytes_per_sample",
                     "tp_message_bytes_per_sample", "kv_bytes_per_sample",
                     "attention_kept_quadratic_bytes"):
            value = getattr(self, attr)
            need(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
                 where + attr, value, "must be a finite number >= 0")
        need(self.attention_backend in ATTENTION_BACKENDS, where + "attention_backend",
             self.attention_backend, f"choose one of {', '.join(ATTENTION_BACKENDS)}")
        need(isinstance(self.tp_replicated_fraction, (int, float))
             and 0.0 <= self.tp_replicated_fraction <= 1.0, where + "tp_replicated_fraction",
             self.tp_replicated_fraction, "must be a number in [0, 1] (0 = TP divides the "
             "layer's compute perfectly)")
        need(self.backward_forward_ratio > 0, where + "backward_forward_ratio",
             self.backward_forward_ratio, "must be > 0 (2.0 is typical)")
        for t, (slope, const) in self.forward_time_by_tp.items():
            need(t >= 1 and slope >= 0 and const >= 0, where + f"forward_time_by_tp.{t}",
                 (slope, const), "needs tp >= 1 and non-negative (per_sample_s, constant_s)")
        for table in ("activation_bytes_by_tp", "activation_bytes_by_tp_sp"):
            for t, value in getattr(self, table).items():
                need(t >= 1 and value >= 0, where + f"{table}.{t}", value,
                     "needs tp >= 1 and bytes >= 0")
        for length, value in self.attention_time_by_seq_length.items():
            need(length >= 1 and math.isfinite(value) and value >= 0,
                 where + f"attention_time_by_seq_length.{length}", value,
                 "needs a sequence length >= 1 and seconds >= 0")

    def attention_time(self, seq_length: float, samples: float, tp: int) -> float:
        """Forward seconds of the core attention of ``samples`` samples of ``seq_length``
        tokens at TP ``tp`` (heads split evenly): the measured length when there is one, else
        quadratic in the length from the nearest measured one above (the largest when none is
        above). 0 when the profile has no attention times."""
        table = self.attention_time_by_seq_length
        if not table:
            return 0.0
        if seq_length in table:
            per_sample = table[int(seq_length)]
        else:
            above = [length for length in table if length >= seq_length]
            ref = min(above) if above else max(table)
            per_sample = table[ref] * (seq_length / ref) ** 2
        return per_sample * samples / tp

    @property
    def attention_seq_length(self) -> int:
        """The layer's own sequence length: the table's largest (0 without a table)."""
        return max(self.attention_time_by_seq_length, default=0)

    @property
    def kv_bytes(self) -> float:
        """One sample's keys (= its values) in the compute dtype."""
        return self.kv_bytes_per_sample or self.hidden_bytes_per_sample

    def forward_time(self, samples: float, tp: int) -> float:
        """Seconds of one forward call on ``samples`` samples per rank at TP degree ``tp``.

        Raises ``ProfileError`` when the per-tp table holds measured degrees above 1 but not
        ``tp`` (see the class docstring)."""
        if tp in self.forward_time_by_tp:
            slope, const = self.forward_time_by_tp[tp]
            return slope * samples + const
        if self.measured_tp_degrees():
            raise ProfileError(self._missing_tp_message(tp))
        rho = self.tp_replicated_fraction
        return (self.forward_time_per_sample_s * samples * ((1.0 - rho) / tp + rho)
                + self.forward_time_constant_s)

    def measured_tp_degrees(self) -> tuple[int, ...]:
        """The TP degrees above 1 whose times were measured (``forward_time_by_tp``)."""
        return tuple(sorted(t for t in self.forward_time_by_tp if t > 1))

    def tp_efficiency(self, tp: int) -> float:
        """Per-sample compute at tp 1 over ``tp`` times that at ``tp`` (1 = perfect split)."""
        if tp in self.forward_time_by_tp and tp > 1:
            base = self.forward_time_by_tp.get(1, (self.forward_time_per_sample_s, 0.0))[0]
            slope = self.forward_time_by_tp[tp][0]
            return base / (tp * slope) if slope > 0 else 1.0
        if self.measured_tp_degrees() and tp > 1:
            raise ProfileError(self._missing_tp_message(tp))
        return 1.0 / (1.0 + self.tp_replicated_fraction * (tp - 1))

    def _missing_tp_message(self, tp: int) -> str:
        origin = getattr(self, "_origin", "")
        where = f"--model-profile {origin}: " if origin else ""
        have = ", ".join(str(t) for t in sorted(self.forward_time_by_tp))
        return (f"{where}profile field layer_types.{self.name}.forward_time_by_tp has no tp={tp} "
                f"(measured: {have}) but a plan being priced uses it: profile on {tp} local ranks "
                f"(torchrun --nproc-per-node {tp} ...) or with `megatron-auto profile-model "
                f"--tp-degrees {' '.join(str(t) for t in sorted({*self.measured_tp_degrees(), tp}))}`,"
                f" or pin a measured degree (--tensor-model-parallel-size {max(self.measured_tp_degrees())})")

    def activation_bytes(self, tp: int) -> float:
        """Bytes kept per sample for backward at TP degree ``tp`` without recompute."""
        if self.activation_bytes_by_tp:
            return _fit_inverse(self.activation_bytes_by_tp, tp)
        return self.activation_replicated_bytes + self.activation_split_bytes / tp

    def local_parameters(self, tp: int) -> float:
        """Parameters one rank holds at TP degree ``tp``: the split ones over ``tp``, the
        replicated ones (norms, row-parallel biases) whole."""
        replicated = self.tp_replicated_parameter_count
        return (self.parameter_count - replicated) / tp + replicated

    def sequence_parallel_activation_bytes(self, tp: int) -> float:
        """Bytes kept per sample at TP ``tp`` with Megatron sequence parallelism: the measured
        SP table when there is one, else every kept activation split over the TP group,
        ``activation_bytes(1) / tp`` (SP shards the norm inputs, dropout masks and residuals
        along the sequence; the column-parallel inputs are kept as this rank's chunk and
        re-gathered in backward, ``models/transformer.py``)."""
        if self.activation_bytes_by_tp_sp:
            return _fit_inverse(self.activation_bytes_by_tp_sp, tp)
        return self.activation_bytes(1) / tp

    def scratch_bytes(self, tp: int) -> float:
        """Transient bytes per sample while this layer runs its backward."""
        return self.backward_scratch_replicated_bytes + self.backward_scratch_split_bytes / tp

    def scratch_constant_bytes(self, tp: int) -> float:
        """Transient bytes per backward that do not scale with the samples (a weight gradient
        before it is accumulated; the large weights are TP-split)."""
        return self.backward_scratch_constant_bytes / tp


@dataclass(frozen=True)
class EmbeddingProfile:
    """Embedding (first stage) and LM head with loss (last stage), at vocab-TP degree 1.

    Split parts scale with 1/vocab_tp (vocab-parallel rows and logits). The last stage's
    ``head_activation_split_bytes`` is the fp32 softmax the loss keeps (its backward turns it
    into the logits gradient in place); ``head_transient_split_bytes`` (per sample) is what the
    loss adds beside it while it runs: the logits (and, in mixed precision, their fp32 upcast)
    next to the shifted copy that becomes the softmax.
    """

    embedding_parameters: int
    head_parameters: int
    tied: bool
    vocab_size: int
    hidden_bytes_per_sample: float
    embedding_forward_time_per_sample_s: float
    head_forward_time_per_sample_s: float
    embedding_activation_bytes: float
    head_activation_replicated_bytes: float
    head_activation_split_bytes: float
    head_transient_split_bytes: float
    forward_time_constant_s: float = 0.0
    backward_forward_ratio: float = 2.0
    # The final norm's share of head_parameters: under ZeRO the runtime shards it as a unit of
    # its own, apart from an untied output layer (one more gather and reduce-scatter each).
    # 0 = not recorded (profiles written before it): the head is priced as one unit.
    final_norm_parameters: int = 0
    # The replicated share of embedding_parameters (learned position embeddings): every vocab
    # TP rank holds all of it, and it is not tied to the head. 0 = not recorded (profiles
    # written before it): all of embedding_parameters is priced as vocabulary-split rows.
    replicated_parameters: int = 0

    @property
    def split_embedding_parameters(self) -> float:
        """The vocabulary-split rows (the tied word embedding): divided by the vocab TP."""
        return float(self.embedding_parameters - self.replicated_parameters)

    def local_embedding_parameters(self, vocab_tp: int) -> float:
        """The embedding's parameters on one vocab-TP rank."""
        return self.split_embedding_parameters / vocab_tp + self.replicated_parameters

    def __post_init__(self) -> None:
        for attr, value in asdict(self).items():
            if attr == "tied":
                need(isinstance(value, bool), "embedding.tied", value, "must be true or false")
                continue
            need(isinstance(value, (int, float)) and not isinstance(value, bool)
                 and math.isfinite(value) and value >= 0, f"embedding.{attr}", value,
                 "must be a finite number >= 0")
