"""The search: outer loops over batch, pp, micro-batches and vocab layout around per-stage DPs.

``search`` returns the plan with the highest estimated throughput that fits the memory budget,
with the estimate of every baseline space next to it, or raises :class:`InfeasibleError` stating
the least memory any plan of the space would need. ``evaluate`` prices any given plan with the
same cost model. Steps (docs/planner.md):

1. Tasks: every global batch (one unless ``search_batch_size``), pipeline degree (power of two
   dividing the world, at most the layer count), micro-batch count (divisor of the batch) and
   schedule. Tasks run in order of a lower bound on their iteration time (compute alone, perfect
   balance, bubble included) and are skipped once that bound cannot beat the best plan found:
   exact pruning, the answer is the same as visiting all of them.
2. Per task and vocab layout: the per-stage DP tables (``tasks.Task``) and the partition kinds
   (even, memory-balanced, BMW; ``partition.choose_partition``).
3. The leading candidates get the BMW local moves and are re-priced by ``evaluate``; the best
   feasible one is the answer. Deterministic: ties resolve by enumeration order.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ..plan import (ALL_DP_MODES, DP_MODES, SCHEDULES, LayerStrategy, PipelineSpec, Plan,
                    PlanError, VocabStrategy)
from ..progress import Progress
from .cost_model import Estimate, evaluate_plan
from .gpu_terms import search_total_bytes
from .model_spec import ModelSpec, TrainingSpec
from .partition import choose_partition, improve, memory_balanced
from .profiles import ModelProfile
from .strategies import BASELINE_SPACES, SPACES, SpaceRules, powers_of_two_upto, vocab_tps
from .tasks import Task, VocabOption

GB = 1e9
AUTO_MEMORY_CELLS = 1024  # default resolution: the device memory in about this many cells
PARTITIONS = ("bmw", "even", "memory")
MIN_AUTO_STEP = 2 ** 16  # the automatic memory step is a multiple of 64 KiB
MIN_STEP = 2 ** 12  # ... and, halved for small budgets, never below 4 KiB
BUDGET_SCALE_CAP = 8  # halved while the cells still cover more than this many budgets


def _auto_step(scale: float) -> int:
    """``scale`` in about ``AUTO_MEMORY_CELLS`` cells, rounded up to a multiple of 64 KiB."""
    return max(MIN_AUTO_STEP, math.ceil(scale / AUTO_MEMORY_CELLS / MIN_AUTO_STEP) * MIN_AUTO_STEP)


REFINE_FACTOR = 4  # the winning task is searched again with a step this many times finer


class InfeasibleError(ValueError):
    """No plan of the space fits the budget; ``min_memory_bytes`` would (None if none ever can)."""

    def __init__(self, message: str, min_memory_bytes: float | None) -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes


@dataclass(frozen=True)
class SearchOptions:
    """Pins and knobs. ``None`` means "search it". ``memory_step_bytes=None`` picks the device
    memory (or the budget, if larger) over ``AUTO_MEMORY_CELLS``, rounded up to a multiple of
    64 KiB, then halved while the cells cover more than 8 budgets (small budgets)."""

    pp: int | None = None
    tp: int | None = None
    num_microbatches: int | None = None
    schedule: str | None = None
    dp_modes: tuple[str, ...] = DP_MODES
    allow_recompute: bool = True
    vocab_tp: int | None = None
    search_batch_size: bool = False
    space: str = "full"
    time_limit_s: float | None = None
    memory_step_bytes: int | None = None
    show_progress: bool = True
    max_tp: int | None = None
    partition: str = "bmw"
    include_baselines: bool = True
    max_transient_levels: int = 4
    # Megatron sequence parallelism of tp > 1 layers: None searches it per layer, True pins it
    # on (``--sequence-parallel``), False leaves it out.
    sequence_parallel: bool | None = None
    # Interleaved 1F1B: the virtual sizes tried on the finalists (pp > 1, m a multiple of pp);
    # a single value > 1 pins it (``--num-layers-per-virtual-pipeline-stage``), (1,) turns it off.
    virtual_sizes: tuple[int, ...] = (1, 2, 4)

    def validate(self) -> None:
        def need(cond: bool, name: str, value: Any, fix: str) -> None:
            if not cond:
                raise ValueError(f"search option {name}={value!r}: {fix}")
        need(self.space in SPACES, "space", self.space, f"choose one of {', '.join(SPACES)}")
        need(self.schedule is None or self.schedule in SCHEDULES, "schedule", self.schedule,
             f"choose one of {', '.join(SCHEDULES)} or leave it unset")
        need(bool(self.dp_modes) and all(d in ALL_DP_MODES for d in self.dp_modes), "dp_modes",
             self.dp_modes, f"give a non-empty subset of {ALL_DP_MODES}")
        need(bool(self.virtual_sizes) and all(isinstance(v, int) and v >= 1
                                              for v in self.virtual_sizes),
             "virtual_sizes", self.virtual_sizes, "give positive integers, e.g. (1, 2, 4)")
        need(self.partition in PARTITIONS, "partition", self.partition,
             f"choose one of {', '.join(PARTITIONS)}")
        for name in ("pp", "tp", "vocab_tp", "max_tp"):
            value = getattr(self, name)
            need(value is None or (value >= 1 and value & (value - 1) == 0), name, value,
                 "must be a power of two")
        need(self.num_microbatches is None or self.num_microbatches >= 1, "num_microbatches",
             self.num_microbatches, "must be a positive integer")
        need(self.memory_step_bytes is None or self.memory_step_bytes >= 1, "memory_step_bytes",
             self.memory_step_bytes, "must be a positive number of bytes (e.g. 1048576)")
        need(self.time_limit_s is None or self.time_limit_s > 0, "time_limit_s",
             self.time_limit_s, "must be positive seconds")
        need(self.max_transient_levels >= 1, "max_transient_levels", self.max_transient_levels,
             "must be >= 1")


@dataclass(frozen=True)
class SearchResult:
    plan: Plan
    estimate: Estimate
    baselines: Mapping[str, Estimate | None] = field(default_factory=dict)

    @property
    def search(self) -> Mapping[str, Any]:
        return self.plan.search or {}


@dataclass(frozen=True)
class _Space:
    """A (restricted) space: layer rules, allowed pp degrees, vocab layout and partitions."""

    name: str
    rules: SpaceRules
    pps: tuple[int, ...] | None = None
    vocab_tp: str | int | None = None  # None search, "layer" = the layers' only tp, or an int
    vocab_modes: tuple[str, ...] | None = None
    partitions: tuple[str, ...] = ("even", "memory", "bmw")


def _spaces(name: str, options: SearchOptions, world: int) -> list[_Space]:
    """The sub-spaces a named space is the union of (several only for megatron3d)."""
    sp = {None: (False, True), True: (True,), False: (False,)}[options.sequence_parallel]
    base = SpaceRules(dp_modes=tuple(options.dp_modes), allow_recompute=options.allow_recompute,
                      max_tp=options.max_tp,
                      tps=(options.tp,) if options.tp is not None else None,
                      sequence_parallel=sp)
    if name == "full":
        parts = ("even", "memory", "bmw") if options.partition == "bmw" else (options.partition,)
        return [_Space("full", base, partitions=parts)]
    if name == "dp":
        return [_Space(name, SpaceRules(tps=(1,), dp_modes=("ddp",), allow_recompute=False),
                       pps=(1,), vocab_tp=1, vocab_modes=("ddp",), partitions=("even",))]
    if name == "zero3":
        return [_Space(name, SpaceRules(tps=(1,), dp_modes=("zero3",), allow_recompute=False),
                       pps=(1,), vocab_tp=1, vocab_modes=("zero3",), partitions=("even",))]
    if name == "tp":
        return [_Space(name, SpaceRules(tps=(world,), dp_modes=("ddp",), allow_recompute=False),
                       pps=(1,), vocab_tp=world, vocab_modes=("ddp",), partitions=("even",))]
    if name == "pp":
        return [_Space(name, SpaceRules(tps=(1,), dp_modes=("ddp",), allow_recompute=False),
                       pps=(world,), vocab_tp=1, vocab_modes=("ddp",), partitions=("even",))]
    if name == "galvatron-base":  # Galvatron's base space: no recompute, no Megatron-SP
        return [_Space(name, replace(base, allow_recompute=False, sequence_parallel=(False,)),
                       partitions=("even",))]
    if name == "megatron3d":
        out = []
        for tp in powers_of_two_upto(world):
            # The grid with full recompute is part of the space unless recompute is off.
            for recompute in ((False, True) if options.allow_recompute else (False,)):
                rules = SpaceRules(tps=(tp,), dp_modes=("ddp",), allow_recompute=recompute,
                                   allow_strided=False, force_recompute=recompute,
                                   max_tp=options.max_tp)
                out.append(_Space(f"megatron3d[tp={tp},recompute={recompute}]", rules,
                                  vocab_tp="layer", vocab_modes=("ddp",), partitions=("even",)))
        return out
    raise ValueError(f"search option space={name!r}: choose one of {', '.join(SPACES)}")


@dataclass
class _Candidate:
    score: float  # seconds per sample (throughput objective)
    task: Task
    option: VocabOption
    partitions: dict[str, tuple[tuple[int, ...] | None, float]]
    space: str


class _Progress:
    """The search's progress callback ``(tasks done, tasks in the space, best seconds per sample
    so far)``, shown through :class:`megatron_auto.progress.Progress` (a bar on a terminal,
    plain stderr lines every 0.5 s otherwise); nothing for a search under a second."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._shown: Progress | None = None

    def __call__(self, done: int, total: int, best: float | None) -> None:
        if not self.enabled:
            return
        shown = self._shown
        if shown is None or shown.total != total or done < shown.done:  # a new space's tasks
            self.close()
            shown = self._shown = Progress("megatron-auto search", total, "tasks",
                                           interval_s=0.5, delay_s=1.0)
        shown.update_to(done, best=f"{1 / best:.2f} samples/s" if best else "none yet")

    def close(self) -> None:
        if self._shown is not None:
            self._shown.close()
            self._shown = None


def _batches(training: TrainingSpec, options: SearchOptions) -> list[int]:
    b = training.global_batch_size
    if not options.search_batch_size:
        return [b]
    return sorted({b * 2 ** j // 8 for j in range(0, 7) if (b * 2 ** j) % 8 == 0})


def _run_space(space: _Space, spec: ModelSpec, training: TrainingSpec, cluster: Any,
               profile: ModelProfile, budget: float, options: SearchOptions, world: int,
               step: int, deadline: float | None, progress: _Progress | None,
               stats: dict[str, Any]) -> list[_Candidate]:
    """All candidates of one space, best first (at most a few kept per task)."""
    schedules = [options.schedule] if options.schedule else ["1f1b"]
    pps = space.pps or tuple(p for p in powers_of_two_upto(world)
                             if world % p == 0 and p <= spec.num_layers)
    if options.pp is not None and space.pps is None:
        pps = tuple(p for p in pps if p == options.pp)
    raw = []
    for batch in _batches(training, options):
        for pp in pps:
            if pp > spec.num_layers or world % pp:
                continue
            ms = [options.num_microbatches] if options.num_microbatches else \
                [d for d in range(1, batch + 1) if batch % d == 0]
            for m in ms:
                if batch % m:
                    continue
                if _interleaving_pinned(options) and (pp == 1 or m % pp):
                    continue  # a pinned virtual size needs pp > 1 and m a multiple of pp
                for sched in schedules:
                    raw.append((batch, pp, m, sched))
    max_len_of = {pp: spec.num_layers if pp == 1 else
                  min(spec.num_layers - pp + 1, math.ceil(1.5 * spec.num_layers / pp) + 1)
                  for pp in pps}
    tasks = []
    for batch, pp, m, sched in raw:
        task = Task(spec, profile, cluster, world, batch, pp, m, sched, space.rules, budget, step,
                    options.max_transient_levels, max_len_of[pp])
        if task.ok:
            tasks.append(task)
    tasks.sort(key=lambda t: t.lower_bound / t.global_batch)
    stats["tasks"] = stats.get("tasks", 0) + len(tasks)
    found: list[_Candidate] = []
    best = math.inf
    for i, task in enumerate(tasks):
        if progress:
            progress(i, len(tasks), best if math.isfinite(best) else None)
        if math.isfinite(best) and task.lower_bound / task.global_batch >= best:
            stats["pruned"] = stats.get("pruned", 0) + len(tasks) - i
            break
        if deadline is not None and time.monotonic() > deadline and found:
            # Past the limit with a plan in hand (the search never stops empty-handed).
            stats["time_limited"] = True
            break
        for option in _vocab_options(task, spec, space, options):
            stats["candidates"] = stats.get("candidates", 0) + 1
            l, p = spec.num_layers, task.pp
            mem_row = lambda k, a, o=option: task.memory_row(k, a, o)  # noqa: E731
            mem_part, least = _least_memory(task, mem_row)
            if least is not None:
                stats["min_memory"] = min(stats.get("min_memory", math.inf), least)
            if least is None or least > budget:
                continue
            parts = choose_partition(
                l, p, lambda k, a, o=option: task.row(k, a, o).value / task.m, mem_row,
                lambda part, o=option: task.score(part, o), task.max_len, space.partitions,
                polish=False, memory_seed=mem_part,
                row_depends_on_start=len(spec.layer_types) > 1)
            kind = min(parts, key=lambda x: parts[x][1])
            score = parts[kind][1] / task.global_batch
            if math.isfinite(score):
                found.append(_Candidate(score, task, option, parts, space.name))
                best = min(best, score)
        found.sort(key=lambda c: c.score)
        del found[3:]
        if all(c.task is not task for c in found):
            task.release()  # DP tables are large; a finalist rebuilds its own on demand
    return found


def _least_memory(task: Task, mem_row) -> tuple[tuple[int, ...] | None, float | None]:
    """The memory-balanced partition and the least peak memory (bytes) any plan of the task can
    have with this vocab layout (None when no partition exists)."""
    part = memory_balanced(task.spec.num_layers, task.pp, mem_row, task.max_len,
                           len(task.spec.layer_types) > 1)
    if part is None:
        return None, None
    start, worst = 0, 0.0
    for k, length in enumerate(part):
        worst = max(worst, float(mem_row(k, start)[length - 1]))
        start += length
    return part, search_total_bytes(task.cluster, worst * task.step, task.n, task.pp)


def _vocab_options(task: Task, spec: ModelSpec, space: _Space,
                   options: SearchOptions) -> list[VocabOption]:
    modes = space.vocab_modes or tuple(options.dp_modes)
    if space.vocab_tp == "layer":
        tps = sorted({s.tp for group in task.strategies for s in group})
    elif isinstance(space.vocab_tp, int):
        tps = [space.vocab_tp]
    elif options.vocab_tp is not None:
        tps = [options.vocab_tp]
    else:
        # A pinned layer tp does not pin the vocabulary (that is ``vocab_tp``).
        tps = vocab_tps(spec.vocab_size, task.n, task.b_m, replace(space.rules, tps=None),
                        task.cluster.devices_per_node)
    out = []
    for tp in tps:
        if spec.vocab_size % tp or task.b_m % (task.n // tp):
            continue
        for mode in (("ddp",) if task.n // tp == 1 else modes):
            out.append(VocabOption(tp, mode))
    return out


def _build_plan(cand: _Candidate, partition: tuple[int, ...], spec: ModelSpec) -> Plan | None:
    task = cand.task
    layers: list[LayerStrategy] = []
    start = 0
    for k, length in enumerate(partition):
        chosen = task.stage_strategies(k, start, length, cand.option)
        if chosen is None:
            return None
        layers.extend(chosen)
        start += length
    return Plan(world_size=task.n * task.pp, global_batch_size=task.global_batch,
                num_microbatches=task.m,
                pipeline=PipelineSpec(size=task.pp, schedule=task.schedule,
                                      layers_per_stage=tuple(partition)),
                vocab=VocabStrategy(tp=cand.option.tp, dp_mode=cand.option.dp_mode),
                layers=tuple(layers), model=spec.plan_model_record())


def pinned_virtual_sizes(per_chunk: int | None, pp: int | None,
                         num_layers: int | None) -> tuple[int, ...]:
    """``SearchOptions.virtual_sizes`` for Megatron's ``--num-layers-per-virtual-pipeline-stage``
    (``per_chunk``, None: search ``(1, 2, 4)``): the virtual size ``L / (pp N)``, which needs
    the pinned ``pp``. Raises ``ValueError`` naming the flag, the value and the fix."""
    if per_chunk is None:
        return (1, 2, 4)
    flag = "--num-layers-per-virtual-pipeline-stage"
    if pp is None or num_layers is None:
        raise ValueError(f"{flag}={per_chunk}: when searching it pins the virtual size, which "
                         f"needs --pipeline-model-parallel-size too; give it, or drop {flag} "
                         f"to let the planner choose")
    if per_chunk < 1 or num_layers % (pp * per_chunk) or num_layers // (pp * per_chunk) < 2:
        raise ValueError(f"{flag}={per_chunk}: --num-layers={num_layers} must be a multiple of "
                         f"pp x {per_chunk} = {pp * per_chunk} with at least 2 chunks per "
                         f"stage; choose a divisor of {num_layers // pp} below {num_layers // pp}")
    return (num_layers // (pp * per_chunk),)


def _interleaving_pinned(options: SearchOptions) -> bool:
    return min(options.virtual_sizes) > 1


def interleaved_variant(plan: Plan, v: int) -> Plan | None:
    """``plan`` on the interleaved schedule with ``v`` chunks per stage: stage ``k`` keeps its
    layer count and its layers' strategies, in order, split into ``v`` near-equal chunks
    (chunk ``j * pp + k`` holds part ``j``), which the runtime runs as the virtual pipeline.
    None when the plan cannot interleave (one stage, a stage with fewer than ``v`` layers,
    ``m`` not a multiple of pp, or a strategy the layer now in its place cannot take)."""
    pp = plan.pp_size
    if v == 1:
        return plan
    if pp == 1 or plan.num_microbatches % pp or plan.pipeline.schedule != "1f1b":
        return None
    per_stage = [plan.layers[r.start:r.stop] for r in
                 (plan.chunk_layer_range(k) for k in range(pp))]
    if any(len(s) < v for s in per_stage):
        return None
    parts = [[list(s[j * len(s) // v:(j + 1) * len(s) // v]) for j in range(v)]
             for s in per_stage]
    sizes = tuple(len(parts[k][j]) for j in range(v) for k in range(pp))
    layers = tuple(x for j in range(v) for k in range(pp) for x in parts[k][j])
    try:
        return replace(plan, layers=layers, estimate=None,
                       pipeline=PipelineSpec(size=pp, schedule="1f1b", layers_per_stage=sizes,
                                             virtual_size=v))
    except PlanError:
        return None


def _interleave(plan: Plan, est: Estimate, spec: ModelSpec, training: TrainingSpec,
                cluster: Any, profile: ModelProfile, budget: float,
                options: SearchOptions) -> tuple[Plan, Estimate, dict[str, Any]] | None:
    """The best of ``plan``'s interleaved variants (``options.virtual_sizes``) that fits, and
    each one's samples/s (None: not possible or over budget)."""
    tried: dict[str, Any] = {}
    best: tuple[Plan, Estimate] | None = None
    for v in options.virtual_sizes:
        variant = interleaved_variant(plan, v)
        if variant is None:
            tried[str(v)] = None
            continue
        try:
            e = est if v == 1 else evaluate_plan(variant, spec, training, cluster, profile,
                                                 budget)
        except ValueError:  # a layer type the moved strategy does not fit
            tried[str(v)] = None
            continue
        tried[str(v)] = e.samples_per_s if e.feasible else None
        if e.feasible and (best is None or e.samples_per_s > best[1].samples_per_s):
            best = (variant, e)
    if best is None:
        return None
    return best[0], best[1], tried


def _finish(cands: list[_Candidate], spec: ModelSpec, training: TrainingSpec, cluster: Any,
            profile: ModelProfile, budget: float, polish: bool,
            options: SearchOptions = SearchOptions(virtual_sizes=(1,))):
    """Polish, build and evaluate the leading candidates; best feasible (plan, estimate, info).
    Each candidate's best plan is also tried interleaved (``options.virtual_sizes``)."""
    best = None
    for cand in cands:
        if polish and "bmw" in cand.partitions:
            part, _ = cand.partitions["bmw"]
            if part is not None:
                part, score = improve(part, lambda p: cand.task.score(p, cand.option))
                cand.partitions["bmw"] = (part, score)
        evaluated = {}
        for kind, (part, _) in cand.partitions.items():
            if part is None:
                continue
            plan = _build_plan(cand, part, spec)
            if plan is None:
                continue
            est = evaluate_plan(plan, spec, training, cluster, profile, budget)
            if est.feasible:
                evaluated[kind] = (plan, est)
        if not evaluated:
            continue
        kind = min(evaluated, key=lambda k: (-evaluated[k][1].samples_per_s,
                                             PARTITIONS.index(k)))
        plan, est = evaluated[kind]
        scores = {k: v[1].samples_per_s for k, v in evaluated.items()}
        info = {"winner": kind, "samples_per_s": scores}
        for other in ("even", "memory"):
            if other in scores and other != kind:
                info[f"gain_vs_{other}"] = est.samples_per_s / scores[other] - 1.0
        if options.virtual_sizes != (1,):
            interleaved = _interleave(plan, est, spec, training, cluster, profile, budget,
                                      options)
            if interleaved is None:
                continue
            plan, est, info["virtual_size_samples_per_s"] = interleaved
        if best is None or est.samples_per_s > best[1].samples_per_s:
            best = (plan, est, info, cand)
    return best


def _refine(cand: _Candidate, spec: ModelSpec, training: TrainingSpec, cluster: Any,
            profile: ModelProfile, budget: float, step: int,
            options: SearchOptions = SearchOptions(virtual_sizes=(1,))):
    """The winning task again with a finer memory step. Every plan feasible at the coarse step
    stays feasible at a step that divides it, so this can only find more room (the answer is
    the better of the two)."""
    old = cand.task
    task = Task(spec, profile, cluster, old.world_size, old.global_batch, old.pp, old.m,
                old.schedule, old.rules, budget, step, old.max_levels, old.max_len)
    option = cand.option
    mem_row = lambda k, a: task.memory_row(k, a, option)  # noqa: E731
    mem_part, least = _least_memory(task, mem_row)
    if least is None or least > budget:
        return None
    parts = choose_partition(
        spec.num_layers, task.pp, lambda k, a: task.row(k, a, option).value / task.m, mem_row,
        lambda part: task.score(part, option), task.max_len, tuple(cand.partitions),
        polish=False, memory_seed=mem_part, row_depends_on_start=len(spec.layer_types) > 1)
    fine = _Candidate(cand.score, task, option, parts, cand.space)
    return _finish([fine], spec, training, cluster, profile, budget, polish=True,
                   options=options)


def _respects(plan: Plan, options: SearchOptions) -> bool:
    """Whether ``plan`` keeps every choice the user pinned (a baseline may not, e.g. pure DP
    when pp is pinned to 2; such a plan is reported but never adopted)."""
    layers = plan.layers
    return ((options.pp is None or plan.pp_size == options.pp)
            and (options.tp is None or all(layer.tp == options.tp for layer in layers))
            and (options.num_microbatches is None
                 or plan.num_microbatches == options.num_microbatches)
            and (options.schedule is None or plan.pipeline.schedule == options.schedule)
            and (options.vocab_tp is None or plan.vocab.tp == options.vocab_tp)
            and (options.max_tp is None or all(layer.tp <= options.max_tp for layer in layers))
            and all(layer.dp_mode in options.dp_modes or plan.dp_size(i) == 1
                    for i, layer in enumerate(layers))
            and (options.sequence_parallel is None
                 or all(layer.sequence_parallel == options.sequence_parallel
                        for layer in layers if layer.tp > 1))
            and plan.virtual_size in options.virtual_sizes
            and (options.allow_recompute or not any(layer.recompute for layer in layers)))


def search(spec: ModelSpec, training: TrainingSpec, cluster: Any, profile: ModelProfile,
           memory_budget_bytes: int, options: SearchOptions = SearchOptions(),
           world_size: int | None = None) -> SearchResult:
    """Best plan for ``spec`` on ``cluster`` within ``memory_budget_bytes`` per device.

    Raises ``InfeasibleError`` (with the least memory that would work) when nothing fits, and
    ``ValueError`` for bad options.
    """
    options.validate()
    profile.check_matches(spec, training.precision)
    world = world_size or cluster.world_size
    if world > cluster.world_size or world < 1:
        raise ValueError(f"world_size={world}: must be between 1 and the cluster's "
                         f"{cluster.world_size} devices")
    t0 = time.monotonic()
    # The automatic step follows the device (not the budget), so that budgets on one cluster
    # are discretised alike and more memory does not give a slower plan; but a budget far
    # below the device (a small model, or a CPU "device" holding the machine's RAM) would get
    # a step coarser than its layers, so the scale is capped at BUDGET_SCALE_CAP budgets.
    # Halving keeps every coarser step a multiple of the finer one, so a plan (or a reported
    # minimum) feasible at one budget's step stays feasible at a smaller budget's finer step.
    step = options.memory_step_bytes or _auto_step(
        max(memory_budget_bytes, getattr(cluster, "device_memory_bytes", 0)))
    if options.memory_step_bytes is None:
        while step % 2 == 0 and step // 2 >= max(
                MIN_STEP, BUDGET_SCALE_CAP * memory_budget_bytes / AUTO_MEMORY_CELLS):
            step //= 2
    deadline = t0 + options.time_limit_s if options.time_limit_s else None
    progress = _Progress(options.show_progress)
    stats: dict[str, Any] = {}

    def run(name: str, deadline_: float | None, progress_: _Progress | None,
            refine: bool = False, step: int = step):
        cands: list[_Candidate] = []
        for sub in _spaces(name, options, world):
            cands.extend(_run_space(sub, spec, training, cluster, profile, memory_budget_bytes,
                                    options, world, step, deadline_, progress_, stats))
        cands.sort(key=lambda c: c.score)
        # baseline spaces keep the plain 1F1B schedule (unless interleaving is pinned)
        opts = options if name == "full" or _interleaving_pinned(options) else \
            replace(options, virtual_sizes=(1,))
        found = _finish(cands[:3], spec, training, cluster, profile, memory_budget_bytes,
                        polish=True, options=opts)
        # Refine: when the budget is well below the device memory the device-based step is
        # coarse for it; the finalists' tasks run again at most REFINE_FACTOR times finer and
        # never finer than the budget in AUTO_MEMORY_CELLS cells (bounds the extra DP work).
        target = max(MIN_STEP, memory_budget_bytes / AUTO_MEMORY_CELLS)
        factor = max([1] + [q for q in (2, REFINE_FACTOR) if step / q >= target and step % q == 0])
        fine_step = step // factor  # divides the coarse step: coarse-feasible stays feasible
        if (refine and found is not None and options.memory_step_bytes is None
                and fine_step < step):
            for cand in cands[:3]:
                finer = _refine(cand, spec, training, cluster, profile, memory_budget_bytes,
                                fine_step, opts)
                if finer is not None and finer[1].samples_per_s > found[1].samples_per_s:
                    found = finer
        return found

    best = run(options.space, deadline, progress, refine=True)
    progress.close()
    if best is None:
        least = stats.get("min_memory")
        if least is None or not math.isfinite(least):
            raise InfeasibleError(
                f"no plan of space {options.space!r} exists for this model on {world} devices "
                f"(check divisibility of batch, heads and layers, or widen the space)", None)
        raise InfeasibleError(
            f"memory budget {memory_budget_bytes / GB:.3f} GB per device is too small: the "
            f"least memory any plan of space {options.space!r} needs is "
            f"{math.ceil(least / GB * 1000) / 1000:.3f} GB (framework reserve included); raise "
            f"--memory-budget-gb, lower the global batch, or widen the search space", least)
    plan, est, partition_info, cand = best
    main_stats = dict(stats)
    baselines: dict[str, Estimate | None] = {}
    adopted = None
    if options.include_baselines:
        # Baselines are small spaces: search them at a step relative to the budget (fine even
        # for small budgets on big devices), so the comparison is fair to them.
        fine = options.memory_step_bytes or _auto_step(memory_budget_bytes)
        for name in BASELINE_SPACES:
            if name == options.space:
                continue
            found = run(name, None, None, refine=True, step=min(step, fine))
            baselines[name] = found[1] if found else None
            if (options.space == "full" and found is not None and _respects(found[0], options)
                    and found[1].samples_per_s > est.samples_per_s * (1 + 1e-12)):
                # A restricted space is part of the full one: its plan is ours when better
                # (it can be, found at a finer memory step).
                plan, est, partition_info, adopted = found[0], found[1], found[2], name
    info = {
        "space": options.space, "partition": partition_info,
        "search_time_s": time.monotonic() - t0, "tasks": main_stats.get("tasks", 0),
        "tasks_pruned": main_stats.get("pruned", 0),
        "candidates": main_stats.get("candidates", 0),
        "memory_step_bytes": step, "time_limited": bool(main_stats.get("time_limited")),
        "memory_budget_bytes": memory_budget_bytes,
        "schedules": [options.schedule] if options.schedule else
        ["1f1b (gpipe has the same time and never less memory, so it is not searched)"],
        "baselines": {k: (v.samples_per_s if v else None) for k, v in baselines.items()},
        "adopted_from_baseline": adopted,
    }
    plan = replace(plan, estimate=est.to_dict(), search=info)
    return SearchResult(plan=plan, estimate=est, baselines=baselines)


def evaluate(plan: Plan, spec: ModelSpec, training: TrainingSpec, cluster: Any,
             profile: ModelProfile, memory_budget_bytes: int | None = None) -> Estimate:
    """Cost-model estimate of any plan; ``.feasible`` against ``memory_budget_bytes`` if given."""
    return evaluate_plan(plan, spec, training, cluster, profile, memory_budget_bytes)
