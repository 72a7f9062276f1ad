"""The search: the best plan of a space under the cost model ``evaluate`` reports.

``search`` returns the plan with the highest estimated throughput that fits the memory budget,
with the estimate of every baseline space next to it, or raises :class:`InfeasibleError` with
the least memory any plan of the space needs. Steps (docs/planner.md §3-5):

1. Tasks: every global batch (one unless ``search_batch_size``), pipeline degree (power of two
   dividing the world, at most the layer count), micro-batch count (divisor of the batch),
   schedule and vocabulary layout (``tasks.Task``).
2. Tasks are visited in order of a cheap lower bound and skipped once it, or the DP-based bound
   of the task, cannot beat the best plan found.
3. Each task's plans are searched exactly by branch and bound (``exact.TaskSearch``), every
   partition and per-layer strategy included; complete plans are priced by ``evaluate_plan``.
   The answer is the best plan of the full space: proven optimal unless ``time_limit_s`` cut the
   search short (``plan.search["proven_optimal"]``).
4. Baseline spaces are searched the same way and reported, never adopted; the winner's task is
   priced again under the even, memory-balanced, time-balanced and paper-BMW partitions.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from ..plan import ALL_DP_MODES, DP_MODES, SCHEDULES, PipelineSpec, Plan, PlanError, VocabStrategy
from ..progress import Progress as Reporter
from .cluster_model import ClusterModel
from .cost_model import Estimate, evaluate_plan
from .exact import MEMORY_SLACK, TIE, Incumbent, TaskSearch
from .least_memory import cheap_least_peak, task_least_peak
from .model_spec import ModelSpec, TrainingSpec
from .profiles import ModelProfile
from .partition_report import REPORT_TIME_LIMIT_S, partition_report, pinned_partition
from .spaces import BASELINE_SPACES, SPACES, Space, SpaceRules, powers_of_two_upto, vocab_tps
from .tasks import Task

logger = logging.getLogger(__name__)

GB = 1e9
BOUND_CELLS = 2048  # the bound DP counts memory in about this many cells of the budget
# Without a time limit the search stops proving after this long and says so
# (plan.search["proven_optimal"] false); give time_limit_s to wait longer or less.
DEFAULT_TIME_LIMIT_S = 10.0
# With baselines, the full space may use this share of the limit; the baseline spaces (a
# comparison) share what it leaves.
MAIN_SHARE = 0.7
# Seeds per (batch, pp, micro-batch count): its vocabulary layouts differ only in the first and
# last stage, so the first few cheapest are seeded and the others go to the exact search.
SEEDS_PER_TABLE = 2
PARTITIONS = ("exact", "even", "memory", "time", "bmw-paper")

Progress = Callable[[int, int, float | None], None]


class InfeasibleError(ValueError):
    """No plan of the space fits the budget; ``min_memory_bytes`` would (None if none ever can)."""

    def __init__(self, message: str, min_memory_bytes: float | None) -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes


@dataclass(frozen=True)
class SearchOptions:
    """Pins and knobs. ``None`` means "search it".

    ``partition``: ``exact`` searches every partition; the others pin the partition kind.
    ``memory_step_bytes``: cell size of the bound DP (default: the budget in ``BOUND_CELLS``
    cells); it changes only how fast the search prunes, never the answer (memory is checked in
    bytes). ``progress``: called as ``progress(tasks_done, tasks, best_samples_per_s)``; with
    ``show_progress`` and no callback, progress goes to ``megatron_auto.progress.Progress``
    (stderr, rank-agnostic: callers on other ranks pass ``show_progress=False``).
    """

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
    partition: str = "exact"
    include_baselines: bool = True
    progress: Progress | None = field(default=None, compare=False)
    # Megatron sequence parallelism of tp > 1 layers: None searches it per layer, True pins it
    # on (``--sequence-parallel``), False leaves it out.
    sequence_parallel: bool | None = None
    # Interleaved 1F1B: the virtual sizes tried on the answer (pp > 1, m a multiple of pp); a
    # single value > 1 pins it (``--num-layers-per-virtual-pipeline-stage``), (1,) turns it off.
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


@dataclass(frozen=True)
class SearchResult:
    plan: Plan
    estimate: Estimate
    baselines: Mapping[str, Estimate | None] = field(default_factory=dict)

    @property
    def search(self) -> Mapping[str, Any]:
        return self.plan.search or {}


def spaces_of(name: str, options: SearchOptions, world: int) -> list[Space]:
    """The sub-spaces a named space is the union of (several only for megatron3d)."""
    sp = {None: (False, True), True: (True,), False: (False,)}[options.sequence_parallel]
    base = SpaceRules(dp_modes=tuple(options.dp_modes), allow_recompute=options.allow_recompute,
                      max_tp=options.max_tp,
                      tps=(options.tp,) if options.tp is not None else None,
                      sequence_parallel=sp)
    single = dict(vocab_modes=("ddp",), even_split=True)
    if name == "full":
        return [Space("full", base)]
    if name == "dp":
        return [Space(name, SpaceRules(tps=(1,), dp_modes=("ddp",), allow_recompute=False),
                      pps=(1,), vocab_tp=1, **single)]
    if name == "zero3":
        return [Space(name, SpaceRules(tps=(1,), dp_modes=("zero3",), allow_recompute=False),
                      pps=(1,), vocab_tp=1, vocab_modes=("zero3",), even_split=True)]
    if name == "tp":
        return [Space(name, SpaceRules(tps=(world,), dp_modes=("ddp",), allow_recompute=False),
                      pps=(1,), vocab_tp=world, **single)]
    if name == "pp":
        return [Space(name, SpaceRules(tps=(1,), dp_modes=("ddp",), allow_recompute=False),
                      pps=(world,), vocab_tp=1, **single)]
    if name == "galvatron-base":  # Galvatron's base space: no recompute, no Megatron-SP
        return [Space(name, replace(base, allow_recompute=False, sequence_parallel=(False,)),
                      even_split=True)]
    if name == "megatron3d":
        out = []
        for tp in powers_of_two_upto(world):
            for recompute in (False, True):
                rules = SpaceRules(tps=(tp,), dp_modes=("ddp",), allow_recompute=recompute,
                                   allow_strided=False, force_recompute=recompute,
                                   max_tp=options.max_tp)
                out.append(Space(f"megatron3d[tp={tp},recompute={recompute}]", rules,
                                 vocab_tp="layer", **single))
        return out
    raise ValueError(f"search option space={name!r}: choose one of {', '.join(SPACES)}")


def _batches(training: TrainingSpec, options: SearchOptions) -> list[int]:
    b = training.global_batch_size
    if not options.search_batch_size:
        return [b]
    return sorted({b * 2 ** j // 8 for j in range(0, 7) if (b * 2 ** j) % 8 == 0})


def _vocabs(spec: ModelSpec, space: Space, options: SearchOptions, n: int, b_m: int,
            rules: SpaceRules, devices_per_node: int) -> list[VocabStrategy]:
    modes = space.vocab_modes or tuple(options.dp_modes)
    if space.vocab_tp == "layer":
        tps = list(rules.tps or ())
    elif isinstance(space.vocab_tp, int):
        tps = [space.vocab_tp]
    elif options.vocab_tp is not None:
        tps = [options.vocab_tp]
    else:
        # A pinned layer tp does not pin the vocabulary (that is ``vocab_tp``).
        tps = vocab_tps(spec.vocab_size, n, b_m, replace(rules, tps=None), devices_per_node)
    out = []
    for tp in tps:
        if tp > n or spec.vocab_size % tp or b_m % (n // tp):
            continue
        for mode in (("ddp",) if n // tp == 1 else modes):
            out.append(VocabStrategy(tp=tp, dp_mode=mode))
    return out


def _tasks(space: Space, spec: ModelSpec, training: TrainingSpec, cluster: ClusterModel,
           profile: ModelProfile, budget: float, options: SearchOptions, world: int,
           step: int) -> list[Task]:
    schedules = [options.schedule] if options.schedule else ["1f1b"]
    pps = space.pps or tuple(p for p in powers_of_two_upto(world) if p <= spec.num_layers)
    if options.pp is not None and space.pps is None:
        pps = tuple(p for p in pps if p == options.pp)
    out = []
    shared: dict = {}
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
                    for vocab in _vocabs(spec, space, options, world // pp, batch // m,
                                         space.rules, cluster.devices_per_node):
                        task = Task(spec, profile, cluster, world, batch, pp, m, sched,
                                    space.rules, vocab, budget, step, shared)
                        if task.ok:
                            out.append(task)
    return out


def _partition_pin(task: Task, space: Space, options: SearchOptions) -> tuple[int, ...] | None:
    kind = "even" if space.even_split else options.partition
    return None if kind == "exact" else pinned_partition(task, kind)


def _stopped(deadline: float, best: Incumbent) -> bool:
    """The deadline passed and there is an answer to return, or none is needed (a baseline
    space, a comparison); without one the answer's search goes on: a task whose least-memory
    plan fits has one within a few nodes."""
    return (best.plan is not None or best.comparison) and time.monotonic() > deadline


def _run(spaces: list[Space], spec: ModelSpec, training: TrainingSpec, cluster: ClusterModel,
         profile: ModelProfile, budget: float, options: SearchOptions, world: int, step: int,
         deadline: float, progress: Progress | None,
         stats: dict[str, Any], comparison: bool = False
         ) -> tuple[Incumbent, list[tuple[Task, tuple[int, ...] | None]], Task | None]:
    """Search the union of ``spaces``; the incumbent, every (task, pinned partition), and the
    winner's task.

    Tasks are visited in order of their cheap bound. Pass 1, before any branching: a task whose
    cheap memory bound exceeds the budget is skipped; the others are seeded (``seed``); when no
    seed fits, the task's exact least peak (``least_memory``) decides: above the budget the task
    is skipped (no plan of it fits), else the plan reaching it is a first incumbent. Pass 2: the
    branch and bound of every task left. Every step stops at ``deadline`` once a plan exists.
    """
    best = Incumbent(comparison=comparison)
    tasks = []
    keys: dict[int, float] = {}
    for sp in spaces:
        for t in _tasks(sp, spec, training, cluster, profile, budget, options, world, step):
            # Setup prices every layer table once (the bound below); a comparison stops here
            # too when the deadline passes (the answer's search needs every task).
            if comparison and time.monotonic() > deadline:
                best.stopped = True
                return best, [], None
            keys[id(t)] = t.cheap_bound(False) / t.global_batch
            tasks.append((t, sp))
    # Sorted by the bound without the embedding (shared by a task's vocabulary layouts, so
    # the embedding of most tasks is never priced); the full cheap bound is checked on visit.
    tasks.sort(key=lambda x: keys[id(x[0])])
    limit = budget * (1 + MEMORY_SLACK)
    winner = None
    pruned = memory_pruned = 0
    pinned: list[tuple[Task, tuple[int, ...] | None]] = []
    seeded: dict[int, int] = {}  # seeded tasks per layer table (batch, pp, micro-batches)
    live: list[tuple[Task, tuple[int, ...] | None]] = []
    for task, space in tasks:
        pin = _partition_pin(task, space, options)
        pinned.append((task, pin))
    # Pass 1: memory and seeds, cheapest bound first. A task whose least peak exceeds the
    # budget has no plan that fits; the others get the least-memory plan and the seed plans.
    def report(done: int) -> None:
        if progress:
            progress(done, len(pinned), 1 / best.value if math.isfinite(best.value) else None)

    for i, (task, pin) in enumerate(pinned):
        report(i - len(live))  # tasks settled without branching so far
        if task.cheap_bound(False) / task.global_batch >= best.value * (1 - TIE):
            pruned += len(pinned) - i
            break
        if _stopped(deadline, best):
            best.stopped = True
            pruned += len(pinned) - i
            break
        if task.cheap_bound() / task.global_batch >= best.value * (1 - TIE):
            pruned += 1
            continue
        if cheap_least_peak(task) > limit:
            memory_pruned += 1
            continue
        before = best.plan
        search_task = TaskSearch(task, training, best, deadline, pin)
        table = id(task.tables)
        seeded[table] = seeded.get(table, 0) + 1
        fits = seeded[table] <= SEEDS_PER_TABLE and search_task.seed()
        if not fits:
            # No seed fits: the exact least peak decides whether any plan of the task can.
            least = task_least_peak(task, pin)
            if least.bytes > limit:
                memory_pruned += 1
                continue
            if least.plan is not None and best.plan is None:
                search_task.offer(least.plan)  # a first answer, so the deadline can apply
        if best.plan is not before:
            winner = task
        live.append((task, pin))
    # Pass 2: branch and bound over the tasks that can fit, cheapest bound first.
    for i, (task, pin) in enumerate(live):
        report(len(pinned) - len(live) + i)
        if task.cheap_bound(False) / task.global_batch >= best.value * (1 - TIE):
            pruned += len(live) - i
            break
        if _stopped(deadline, best):
            best.stopped = True  # tasks left unsearched: the answer is not proven
            pruned += len(live) - i
            break
        if task.cheap_bound() / task.global_batch >= best.value * (1 - TIE):
            pruned += 1
            continue
        before = best.plan
        TaskSearch(task, training, best, deadline, pin).run()
        if best.plan is not before:
            winner = task
    report(len(pinned))
    stats["tasks"] = stats.get("tasks", 0) + len(tasks)
    stats["pruned"] = stats.get("pruned", 0) + pruned
    stats["memory_pruned"] = stats.get("memory_pruned", 0) + memory_pruned
    stats["nodes"] = stats.get("nodes", 0) + best.nodes
    stats["plans_priced"] = stats.get("plans_priced", 0) + best.leaves
    return best, pinned, winner


def _bound_step(budget: float, cluster: ClusterModel, options: SearchOptions) -> int:
    if options.memory_step_bytes:
        return int(options.memory_step_bytes)
    return max(1, math.ceil((budget - cluster.memory_reserve_bytes) / BOUND_CELLS))


def search(spec: ModelSpec, training: TrainingSpec, cluster: ClusterModel,
           profile: ModelProfile, memory_budget_bytes: int,
           options: SearchOptions = SearchOptions(),
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
    budget = float(memory_budget_bytes)
    step = _bound_step(budget, cluster, options)
    limit_s = options.time_limit_s or DEFAULT_TIME_LIMIT_S
    end = t0 + limit_s  # everything (search, baselines, partition report) stops by then
    # The full space first; baselines get what it leaves, but at least a share of the limit.
    share = MAIN_SHARE if options.include_baselines else 1.0
    reporter = _Reporter() if options.progress is None and options.show_progress else None
    progress = options.progress or reporter
    stats: dict[str, Any] = {}
    subspaces = spaces_of(options.space, options, world)
    best, tasks, winner = _run(subspaces, spec, training, cluster, profile, budget, options,
                               world, step, t0 + share * limit_s, progress, stats)
    if reporter is not None:
        reporter.close()
    if best.plan is None:
        raise _infeasible(options.space, world, budget, tasks, training)
    assert best.estimate is not None and winner is not None
    baselines: dict[str, Estimate | None] = {}
    baselines_cut: list[str] = []
    adopted = None
    if options.include_baselines:
        names = [n for n in BASELINE_SPACES if n != options.space]
        for j, name in enumerate(names):
            now = time.monotonic()
            found, _, _ = _run(spaces_of(name, options, world), spec, training, cluster,
                               profile, budget, options, world, step,
                               now + max(0.0, end - now) / (len(names) - j), None, {},
                               comparison=True)
            baselines[name] = found.estimate
            if found.stopped:
                baselines_cut.append(name)
            # A proven answer is the optimum of the whole space, which holds every baseline
            # space, so nothing is adopted then. A search the time limit stopped is not
            # proven: a baseline space's plan (a plan of the same space) that is better is
            # the answer instead, so a deep model never gets less than a uniform plan.
            if best.stopped and found.plan is not None and found.value < best.value:
                best, adopted = found, name
                best.stopped = True
    # Interleaving on the answer: each stage keeps its layers and strategies, split into v
    # chunks (a choice per plan, priced by evaluate_plan; the exact search is over v = 1).
    tried: dict[str, Any] | None = None
    chosen = (best.plan, best.estimate)
    if options.virtual_sizes != (1,):
        interleaved = _interleave(best.plan, best.estimate, spec, training, cluster, profile,
                                  budget, options)
        if interleaved is None and _interleaving_pinned(options):
            raise InfeasibleError(
                f"no interleaved plan with virtual size {options.virtual_sizes[0]} fits: the "
                f"best plan's stages cannot be split into that many chunks within the budget; "
                f"choose another --num-layers-per-virtual-pipeline-stage or drop it", None)
        if interleaved is not None:
            plan_v, est_v, tried = interleaved
            if est_v.samples_per_s > best.estimate.samples_per_s or _interleaving_pinned(options):
                chosen = (plan_v, est_v)
    report_s = min(REPORT_TIME_LIMIT_S, end - time.monotonic())
    info = {
        "space": options.space, "objective": "evaluate (iteration time), exact",
        "proven_optimal": not best.stopped, "time_limited": best.stopped,
        "time_limit_s": limit_s,
        "partitions": (partition_report(winner, training, best, report_s)
                       if report_s > 0 and adopted is None else
                       "not priced: the time limit was reached"),
        "adopted_from_baseline": adopted,
        "search_time_s": time.monotonic() - t0, "tasks": stats.get("tasks", 0),
        "tasks_pruned": stats.get("pruned", 0),
        "tasks_over_memory": stats.get("memory_pruned", 0), "nodes": stats.get("nodes", 0),
        "plans_priced": stats.get("plans_priced", 0), "bound_memory_step_bytes": step,
        "memory_budget_bytes": memory_budget_bytes,
        "schedules": [options.schedule] if options.schedule else
        ["1f1b (gpipe has the same time and never less memory, so it is not searched)"],
        "baselines": {k: (v.samples_per_s if v else None) for k, v in baselines.items()},
        "baselines_time_limited": baselines_cut,
    }
    if tried is not None:
        info["partition"] = {"virtual_size_samples_per_s": tried}
    plan = replace(chosen[0], estimate=chosen[1].to_dict(), search=info)
    return SearchResult(plan=plan, estimate=chosen[1], baselines=baselines)


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


def _report_step(least: float) -> float:
    """The step the least memory is reported at: a power of ten of bytes at most 0.5 % of it
    and at most 1 MB (so gigabytes show three decimals), never below one byte."""
    return float(10 ** max(0, min(6, math.floor(math.log10(max(least * 0.005, 1.0))))))


def _infeasible(space: str, world: int, budget: float,
                tasks: list[tuple[Task, tuple[int, ...] | None]],
                training: TrainingSpec) -> InfeasibleError:
    """The error for a budget no plan fits: the least peak over the tasks, as ``evaluate``
    prices the plan reaching it, rounded up to the report step (so searching at it succeeds)."""
    least = math.inf
    for task, pin in sorted(tasks, key=lambda x: cheap_least_peak(x[0])):
        if cheap_least_peak(task) >= least:
            break
        lp = task_least_peak(task, pin)
        if lp.plan is None or lp.bytes >= least:
            continue
        peak = evaluate_plan(lp.plan, task.spec,
                             replace(training, global_batch_size=task.global_batch),
                             task.cluster, task.profile).peak_memory_bytes
        least = min(least, max(peak, lp.bytes))
    if not math.isfinite(least):
        return InfeasibleError(
            f"no plan of space {space!r} exists for this model on {world} devices (check "
            f"divisibility of batch, heads and layers, or widen the space)", None)
    unit = _report_step(least)
    shown = math.ceil(least / unit) * unit
    digits = max(3, 9 - int(round(math.log10(unit))))
    text = f"{shown / GB:.{digits}f}"
    return InfeasibleError(
        f"memory budget {budget / GB:.3f} GB per device is too small: the least memory any plan "
        f"of space {space!r} needs is {text} GB (framework reserve included); raise "
        f"--memory-budget-gb to at least {text}, lower the global batch, or widen the "
        f"search space", shown)


class _Reporter:
    """The default progress callback: ``megatron_auto.progress.Progress`` (a bar on a terminal,
    plain stderr lines every 0.5 s otherwise; nothing for a search under a second)."""

    def __init__(self) -> None:
        self._shown: Reporter | None = None

    def __call__(self, done: int, total: int, best: float | None) -> None:
        shown = self._shown
        if shown is None or shown.total != total or done < shown.done:  # a new space's tasks
            self.close()
            shown = self._shown = Reporter("megatron-auto search", total, "tasks",
                                           interval_s=0.5, delay_s=1.0)
        shown.update_to(done, best=f"{best:.2f} samples/s" if best else "none yet")

    def close(self) -> None:
        if self._shown is not None:
            self._shown.close()
            self._shown = None


def evaluate(plan: Plan, spec: ModelSpec, training: TrainingSpec, cluster: ClusterModel,
             profile: ModelProfile, memory_budget_bytes: int | None = None) -> Estimate:
    """Cost-model estimate of any plan; ``.feasible`` against ``memory_budget_bytes`` if given."""
    return evaluate_plan(plan, spec, training, cluster, profile, memory_budget_bytes)
