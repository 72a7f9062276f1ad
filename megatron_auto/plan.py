"""The parallel plan: the one contract between the planner and the runtime (docs/design.md §5.2).

A plan says, for a world of ``world_size`` ranks, how many pipeline stages there are and which
layers each holds, and for every transformer layer its tensor-parallel degree, the layout of its
TP groups, its data-parallel flavour and whether it recomputes activations. Plans are frozen
dataclasses that validate themselves and round-trip to the versioned JSON file.

Rank rules (docs/design.md §4): stage ``k`` owns ranks ``[k*N/pp, (k+1)*N/pp)``; inside a stage layer
``i`` has ``tp_i`` ranks per TP group and ``dp_i = (N/pp)/tp_i`` replicas, each replica processing
``global_batch/num_microbatches/dp_i`` samples of every micro-batch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from .config import ModelConfig
from .plan_cp import cp_model_problem
from .plan_errors import PlanError
from .plan_errors import need as _need
from .plan_experts import expert_field_error, model_expert_error
from .plan_layer import LayerStrategy, VocabStrategy, int_field
from .plan_offload import offload_layer_problem, offload_model_problem
from .plan_optimizer_offload import FractionValue, fraction_dict, fraction_problem, parse_fraction
from .plan_recompute import RecomputeValue, normalize_recompute
from .utils.jsonfile import read_json, write_json

PLAN_FORMAT = "megatron_auto.plan"
PLAN_VERSION = 1
# The data-parallel flavours plans accept, the runtime trains, the cost model prices and the
# search's default space holds (``zero1`` is Megatron's distributed optimizer).
DP_MODES = ("ddp", "zero1", "zero2", "zero3")
ALL_DP_MODES = DP_MODES
SCHEDULES = ("1f1b", "gpipe")
# Context-parallel attention: ``ring`` passes keys and values around the CP group (Megatron's
# ``--cp-comm-type p2p``), ``ulysses`` all-to-alls from sequence- to head-sharded (``a2a``).
CP_MODES = ("ring", "ulysses")


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _is_positive_int(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


@dataclass(frozen=True)
class PipelineSpec:
    """Pipeline degree, schedule and partition.

    ``virtual_size`` v > 1 is the interleaved 1F1B schedule (Megatron's virtual pipeline):
    ``layers_per_stage`` then lists ``size * v`` model chunks in model order and chunk ``c``
    runs on stage ``c % size``.
    """

    size: int = 1
    schedule: str = "1f1b"
    layers_per_stage: tuple[int, ...] = ()
    virtual_size: int = 1
    optimizer_offload_fraction: FractionValue = 0.0  # host share per stage (plan_optimizer_offload)

    @property
    def num_chunks(self) -> int:
        return self.size * self.virtual_size

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size, "schedule": self.schedule,
                               "layers_per_stage": list(self.layers_per_stage)}
        if self.virtual_size != 1:  # absent = 1: non-interleaved files stay as they were
            out["virtual_size"] = self.virtual_size
        return {**out, **fraction_dict(self.optimizer_offload_fraction)}

    @classmethod
    def from_dict(cls, data: Any) -> "PipelineSpec":
        _need(isinstance(data, Mapping), "pipeline", data,
              'must be an object like {"size": 2, "schedule": "1f1b", "layers_per_stage": [2, 2]}')
        keys = ("size", "schedule", "layers_per_stage", "virtual_size", "optimizer_offload_fraction")
        unknown = sorted(set(data) - set(keys))
        _need(not unknown, "pipeline.<keys>", unknown, f"unknown key(s); allowed: {', '.join(keys)}")
        size = int_field(data, "size", "pipeline.")
        virtual = int_field(data, "virtual_size", "pipeline.") if "virtual_size" in data else 1
        lps = data.get("layers_per_stage")
        _need(isinstance(lps, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in lps),
              "pipeline.layers_per_stage", lps,
              "must be a list of integers, one per stage (size * virtual_size chunks)")
        return cls(size=size, schedule=data.get("schedule", "1f1b"), layers_per_stage=tuple(lps),
                   virtual_size=virtual, optimizer_offload_fraction=parse_fraction(data))


def even_partition(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Split ``num_layers`` into ``num_stages`` counts differing by at most one (extra layers first)."""
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (1 if k < extra else 0) for k in range(num_stages))


@dataclass(frozen=True)
class Plan:
    """A complete parallel plan. Build with :meth:`uniform`, :meth:`from_dict` or :meth:`load`."""

    world_size: int
    global_batch_size: int
    num_microbatches: int
    pipeline: PipelineSpec
    vocab: VocabStrategy
    layers: tuple[LayerStrategy, ...]
    model: Mapping[str, Any] | None = None
    estimate: Mapping[str, Any] | None = None
    # Anything else the planner wants to record (which partition won, search time, ...).
    search: Mapping[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        self.validate()

    # ---------------------------------------------------------------- derived
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def pp_size(self) -> int:
        return self.pipeline.size

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage."""
        return self.world_size // self.pipeline.size

    @property
    def microbatch_size(self) -> int:
        """Samples in one micro-batch across the whole stage (before any dp split)."""
        return self.global_batch_size // self.num_microbatches

    def stage_ranks(self, stage: int) -> list[int]:
        n = self.stage_size
        return list(range(stage * n, (stage + 1) * n))

    def stage_of_rank(self, rank: int) -> int:
        return rank // self.stage_size

    @property
    def virtual_size(self) -> int:
        return self.pipeline.virtual_size

    @property
    def num_chunks(self) -> int:
        """Model chunks: ``pp`` without interleaving, ``pp * virtual_size`` with it."""
        return self.pipeline.num_chunks

    def chunk_layer_range(self, chunk: int) -> range:
        """Global layer indices of model chunk ``chunk`` (chunk ``c`` runs on stage ``c % pp``)."""
        start = sum(self.pipeline.layers_per_stage[:chunk])
        return range(start, start + self.pipeline.layers_per_stage[chunk])

    def stage_chunks(self, stage: int) -> list[int]:
        """Model chunks of ``stage`` in model order (one unless interleaved)."""
        return list(range(stage, self.num_chunks, self.pp_size))

    def stage_layers(self, stage: int) -> list[int]:
        """Every layer ``stage`` holds, in model order (several chunks when interleaved)."""
        return [i for c in self.stage_chunks(stage) for i in self.chunk_layer_range(c)]

    def stage_layer_range(self, stage: int) -> range:
        """The contiguous layers of ``stage``; only without interleaving (else see stage_layers)."""
        if self.virtual_size != 1:
            # Callers that only know contiguous stages say so clearly.
            raise PlanError(f"plan field pipeline.virtual_size={self.virtual_size}: an "
                            f"interleaved stage holds several chunks (see stage_layers); use "
                            f"virtual_size 1 here")
        return self.chunk_layer_range(stage)

    def chunk_of_layer(self, layer: int) -> int:
        # one pass over the chunk sizes (the evaluator asks for every layer of every stage:
        # a range per chunk each time made pricing a 96-layer, 16-stage plan quadratic)
        start = 0
        for chunk, size in enumerate(self.pipeline.layers_per_stage):
            if start <= layer < start + size:
                return chunk
            start += size
        raise IndexError(f"layer {layer} out of range for a {self.num_layers}-layer plan")

    def stage_of_layer(self, layer: int) -> int:
        return self.chunk_of_layer(layer) % self.pp_size

    def dp_size(self, layer: int) -> int:
        """Ranks a parameter shard of ``layer`` is replicated on (its DP group: ``dp x cp``)."""
        return self.stage_size // self.layers[layer].tp

    @property
    def vocab_dp_size(self) -> int:
        return self.stage_size // self.vocab.tp

    @property
    def cp_size(self) -> int:
        """The plan's context-parallel degree (every layer's ``cp``; 1 without CP)."""
        return self.layers[0].cp if self.layers else 1

    def batch_slices(self, layer: int) -> int:
        """Batch slices of a micro-batch under ``layer``'s layout: ``stage_size/(tp*cp)``."""
        return self.stage_size // (self.layers[layer].tp * self.layers[layer].cp)

    def is_uniform(self) -> bool:
        return len(set(self.layers)) <= 1

    # ------------------------------------------------------------- validation
    def validate(self, model: ModelConfig | None = None) -> None:
        """Check internal consistency and, when ``model`` is given, the model's divisibility."""
        _need(isinstance(self.world_size, int) and self.world_size >= 1, "world_size",
              self.world_size, "must be a positive integer (the number of ranks)")
        _need(self.global_batch_size >= 1, "global_batch_size", self.global_batch_size,
              "must be a positive integer")
        _need(self.num_microbatches >= 1, "num_microbatches", self.num_microbatches,
              "must be a positive integer")
        _need(self.global_batch_size % self.num_microbatches == 0, "num_microbatches",
              self.num_microbatches,
              f"must divide global_batch_size={self.global_batch_size}")
        pp = self.pipeline
        _need(pp.size >= 1 and self.world_size % pp.size == 0, "pipeline.size", pp.size,
              f"must divide world_size={self.world_size}")
        _need(pp.schedule in SCHEDULES, "pipeline.schedule", pp.schedule,
              f"choose one of {', '.join(SCHEDULES)}")
        v = pp.virtual_size
        _need(isinstance(v, int) and v >= 1, "pipeline.virtual_size", v,
              "must be a positive integer (1 = no interleaving)")
        num_chunks = len(pp.layers_per_stage)
        if v > 1:
            self._validate_interleaving(num_chunks)
        _need(num_chunks == pp.size * v, "pipeline.layers_per_stage",
              list(pp.layers_per_stage), f"must have one entry per stage ({pp.size})")
        _need(all(n >= 1 for n in pp.layers_per_stage), "pipeline.layers_per_stage",
              list(pp.layers_per_stage), "every stage (model chunk) needs at least one layer")
        _need(sum(pp.layers_per_stage) == len(self.layers), "pipeline.layers_per_stage",
              list(pp.layers_per_stage),
              f"must sum to the number of entries in layers ({len(self.layers)})")
        _need(len(self.layers) >= 1, "layers", [], "needs one entry per transformer layer")
        n = self.stage_size
        mb = self.microbatch_size
        cp = self._validate_cp()
        for i, layer in enumerate(self.layers):
            where = f"layers[{i}]"
            _need(isinstance(layer, LayerStrategy), where, layer, "must be a LayerStrategy")
            # Any divisor: the runtime splits heads, FFN and vocabulary by any degree that divides
            # them (tests/test_any_world_size.py trains tp 3 and pp 3 plans like one process).
            _need(_is_positive_int(layer.tp) and n % layer.tp == 0, where + ".tp", layer.tp,
                  f"must be a positive divisor of the {n} ranks of a pipeline stage")
            _need(cp == 1 or (n // cp) % layer.tp == 0, where + ".tp", layer.tp,
                  f"tp x cp = {layer.tp} x {cp} must divide the {n} ranks of a pipeline stage; "
                  f"lower tp or cp")
            _need(cp == 1 or layer.tp_consecutive or layer.tp in (1, n // cp),
                  where + ".tp_consecutive", layer.tp_consecutive,
                  f"strided TP groups do not combine with cp={cp}; set tp_consecutive to true")
            _need(layer.dp_mode in ALL_DP_MODES, where + ".dp_mode", layer.dp_mode,
                  f"choose one of {', '.join(ALL_DP_MODES)}")
            _need(isinstance(layer.sequence_parallel, bool), where + ".sequence_parallel",
                  layer.sequence_parallel, "must be true or false")
            _need(not layer.sequence_parallel or layer.tp > 1, where + ".sequence_parallel",
                  layer.sequence_parallel,
                  f"needs tp > 1 (this layer has tp={layer.tp}); set tp to 2 or more, or "
                  f"sequence_parallel to false")
            dp = n // (layer.tp * cp)
            _need(mb % dp == 0, where + ".tp", layer.tp,
                  f"gives dp={dp} replicas, which must divide the micro-batch of {mb} samples "
                  f"(global_batch_size {self.global_batch_size} / num_microbatches "
                  f"{self.num_microbatches}); change tp, "
                  + ("cp, " if cp > 1 else "") + "num_microbatches or the batch size")
            message = expert_field_error(layer, where, dp) or offload_layer_problem(
                layer.offload, layer.full_recompute, layer.recompute_modules, where)
            if message is not None:
                raise PlanError(message)
        vocab = self.vocab
        _need(_is_positive_int(vocab.tp) and n % vocab.tp == 0, "vocab.tp", vocab.tp,
              f"must be a positive divisor of the {n} ranks of a pipeline stage")
        _need(vocab.dp_mode in ALL_DP_MODES, "vocab.dp_mode", vocab.dp_mode,
              f"choose one of {', '.join(ALL_DP_MODES)}")
        _need(cp == 1 or (n // cp) % vocab.tp == 0, "vocab.tp", vocab.tp,
              f"tp x cp = {vocab.tp} x {cp} must divide the {n} ranks of a pipeline stage")
        _need(mb % (n // (vocab.tp * cp)) == 0, "vocab.tp", vocab.tp,
              f"gives dp={n // (vocab.tp * cp)} replicas, which must divide the micro-batch of "
              f"{mb} samples")
        if (problem := fraction_problem(self)) is not None:
            raise PlanError(problem)
        if model is not None:
            self.check_model(model)

    def _validate_cp(self) -> int:
        """The per-layer ``cp`` and ``cp_mode`` fields: one CP degree for the whole plan (the
        embedding and head share it), a power of two dividing the stage; returns it."""
        if not self.layers:
            return 1
        cp = self.layers[0].cp
        n = self.stage_size
        for i, layer in enumerate(self.layers):
            where = f"layers[{i}]"
            _need(isinstance(layer.cp, int) and not isinstance(layer.cp, bool)
                  and _is_power_of_two(layer.cp) and n % layer.cp == 0, where + ".cp", layer.cp,
                  f"must be a power of two dividing the {n} ranks of a pipeline stage")
            _need(layer.cp == cp, where + ".cp", layer.cp,
                  f"every layer takes the plan's one context-parallel degree (layers[0].cp={cp}):"
                  f" set every layer's cp to the same value")
            _need(layer.cp_mode in CP_MODES, where + ".cp_mode", layer.cp_mode,
                  f"choose one of {', '.join(CP_MODES)}")
        return cp

    def _validate_interleaving(self, num_chunks: int) -> None:
        """The interleaved 1F1B schedule's own rules (``pipeline.virtual_size > 1``)."""
        pp = self.pipeline
        v = pp.virtual_size
        _need(num_chunks == pp.size * v, "pipeline.virtual_size", v,
              f"layers_per_stage lists {num_chunks} model chunks, which must be pipeline.size x "
              f"virtual_size = {pp.size} x {v} = {pp.size * v}; list {pp.size * v} chunk sizes"
              + (f" or use virtual_size={num_chunks // pp.size}"
                 if num_chunks % pp.size == 0 and num_chunks >= pp.size else ""))
        _need(pp.size > 1, "pipeline.virtual_size", v,
              "interleaving needs pipeline.size > 1; use virtual_size 1 with one stage")
        _need(pp.schedule == "1f1b", "pipeline.schedule", pp.schedule,
              f"virtual_size={v} runs the interleaved 1F1B schedule; use schedule 1f1b")
        _need(self.num_microbatches % pp.size == 0, "num_microbatches", self.num_microbatches,
              f"the interleaved schedule (pipeline.virtual_size={v}) runs micro-batches in groups "
              f"of pipeline.size={pp.size}; use a multiple of {pp.size}")

    def check_model(self, model: ModelConfig) -> None:
        """Raise ``PlanError`` unless every layer's tp can split ``model``; compare ``self.model``."""
        if model.num_layers != len(self.layers):
            raise PlanError(f"plan field layers has {len(self.layers)} entries but the model has "
                            f"--num-layers={model.num_layers}; give one entry per layer")
        # Models whose layers differ in shape (Swin stages) check each layer on its own.
        per_layer = getattr(model, "check_layer_tensor_parallel", None)
        for i, layer in enumerate(self.layers):
            what = f"plan field layers[{i}].tp"
            try:
                if per_layer is not None:
                    per_layer(i, layer.tp, what)
                else:
                    model.check_tensor_parallel(layer.tp, what=what)
            except ValueError as err:
                raise PlanError(str(err)) from None
            if layer.sequence_parallel and not getattr(model, "runs_sequence_parallel", True):
                raise PlanError(f"plan field layers[{i}].sequence_parallel=True: the "
                                f"{model.model_type} model does not run sequence parallelism "
                                f"yet; set it to false (or drop --sequence-parallel)")
            if (not isinstance(layer.recompute, bool)
                    and not getattr(model, "runs_module_recompute", True)):
                raise PlanError(f"plan field layers[{i}].recompute={layer.recompute!r}: the "
                                f"{model.model_type} model recomputes whole layers only; use "
                                f"true or false")
            message = model_expert_error(model, i, layer) or offload_model_problem(model, i, layer)
            if message is not None:
                raise PlanError(message)
            if layer.sequence_parallel and model.seq_length % (layer.tp * layer.cp):
                what = f"tp={layer.tp}" + (f" x cp={layer.cp}" if layer.cp > 1 else "")
                raise PlanError(f"plan field layers[{i}].sequence_parallel=True: --seq-length="
                                f"{model.seq_length} must be divisible by the layer's {what}; "
                                f"change tp or the sequence length, or turn SP off")
        if self.cp_size > 1:
            problem = cp_model_problem(self, model)
            if problem:
                raise PlanError(problem)
        try:
            model.check_vocab_parallel(self.vocab.tp, what="plan field vocab.tp")
        except ValueError as err:
            raise PlanError(str(err)) from None
        if self.model:
            mine = model.to_dict()
            for key, value in self.model.items():
                if key in mine and mine[key] != value:
                    raise PlanError(
                        f"plan field model.{key}={value!r} does not match the run's "
                        f"{key}={mine[key]!r}; use a plan made for this model or fix the flags")

    # ---------------------------------------------------------------- builders
    @classmethod
    def uniform(cls, world_size: int, num_layers: int, *, global_batch_size: int,
                num_microbatches: int = 1, tp: int = 1, pp: int = 1, dp_mode: str = "ddp",
                tp_consecutive: bool = True,
                recompute: RecomputeValue | Sequence[RecomputeValue] = False,
                schedule: str = "1f1b", vocab_tp: int | None = None,
                vocab_dp_mode: str | None = None,
                layers_per_stage: Sequence[int] | None = None,
                model: Mapping[str, Any] | None = None, sequence_parallel: bool = False,
                virtual_size: int = 1, cp: int = 1, cp_mode: str = "ring") -> "Plan":
        """The plan classic Megatron flags describe: one (tp, dp_mode) for every layer.

        ``virtual_size`` > 1 splits the layers evenly into ``pp * virtual_size`` chunks
        (``--num-layers-per-virtual-pipeline-stage``) unless ``layers_per_stage`` is given.
        """
        if isinstance(recompute, (bool, str)) or (
                isinstance(recompute, tuple) and all(isinstance(m, str) for m in recompute)):
            recompute = [recompute] * num_layers  # type: ignore[list-item]
        if len(recompute) != num_layers:
            raise PlanError(f"recompute flags: {len(recompute)} given for {num_layers} layers")
        if pp < 1 or num_layers < pp * virtual_size:
            raise PlanError(f"pipeline.size={pp}: must be between 1 and --num-layers={num_layers}"
                            + (f" / virtual_size {virtual_size}" if virtual_size > 1 else ""))
        layers = tuple(LayerStrategy(tp=tp, dp_mode=dp_mode, tp_consecutive=tp_consecutive,
                                     recompute=normalize_recompute(r, f"layers[{i}].recompute"),
                                     sequence_parallel=sequence_parallel, cp=cp, cp_mode=cp_mode)
                       for i, r in enumerate(recompute))
        return cls(world_size=world_size, global_batch_size=global_batch_size,
                   num_microbatches=num_microbatches,
                   pipeline=PipelineSpec(size=pp, schedule=schedule,
                                         layers_per_stage=tuple(layers_per_stage)
                                         if layers_per_stage
                                         else even_partition(num_layers, pp * virtual_size),
                                         virtual_size=virtual_size),
                   vocab=VocabStrategy(tp=tp if vocab_tp is None else vocab_tp,
                                       dp_mode=dp_mode if vocab_dp_mode is None else vocab_dp_mode),
                   layers=layers, model=model)

    def with_estimate(self, estimate: Mapping[str, Any]) -> "Plan":
        return replace(self, estimate=dict(estimate))

    # -------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": PLAN_FORMAT, "version": PLAN_VERSION,
            "world_size": self.world_size,
            "global_batch_size": self.global_batch_size,
            "num_microbatches": self.num_microbatches,
            "pipeline": self.pipeline.to_dict(),
            "vocab": self.vocab.to_dict(),
            "layers": [layer.to_dict() for layer in self.layers],
        }
        if self.model is not None:
            out["model"] = dict(self.model)
        if self.estimate is not None:
            out["estimate"] = dict(self.estimate)
        if self.search is not None:
            out["search"] = dict(self.search)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> "Plan":
        _need(isinstance(data, Mapping), "<root>", type(data).__name__, "a plan must be a JSON object")
        fmt = data.get("format")
        _need(fmt == PLAN_FORMAT, "format", fmt,
              f'must be "{PLAN_FORMAT}" (is this a Galvatron config? convert it with '
              f"`megatron-auto import-galvatron`)")
        version = data.get("version")
        _need(version == PLAN_VERSION, "version", version,
              f"this megatron_auto reads plan version {PLAN_VERSION}")
        known = {"format", "version", "world_size", "global_batch_size", "num_microbatches",
                 "pipeline", "vocab", "layers", "model", "estimate", "search"}
        unknown = sorted(set(data) - known)
        _need(not unknown, "<keys>", unknown, f"unknown key(s); allowed: {sorted(known)}")
        layers = data.get("layers")
        _need(isinstance(layers, list), "layers", layers, "must be a list with one object per layer")
        return cls(
            world_size=int_field(data, "world_size", ""),
            global_batch_size=int_field(data, "global_batch_size", ""),
            num_microbatches=int_field(data, "num_microbatches", ""),
            pipeline=PipelineSpec.from_dict(data.get("pipeline")),
            vocab=VocabStrategy.from_dict(data.get("vocab", {"tp": 1, "dp_mode": "ddp"})),
            layers=tuple(LayerStrategy.from_dict(x, f"layers[{i}].") for i, x in enumerate(layers)),
            model=data.get("model"), estimate=data.get("estimate"), search=data.get("search"))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        data = read_json(path, "--plan", PlanError, syntax_fix="fix the file or write it again "
                         "with `megatron-auto plan`")
        try:
            return cls.from_dict(data)
        except PlanError as err:
            raise PlanError(f"--plan {path}: {err}") from None
