"""The search: the best plan of a space under the cost model ``evaluate`` reports.

``search`` returns the plan with the highest estimated throughput that fits the memory budget,
with the estimate of every baseline space next to it, or raises :class:`InfeasibleError` with
the least memory any plan of the space needs. Steps (docs/planner.md §3-5):

1. Tasks: every global batch (one unless ``search_batch_size``), pipeline degree (a divisor of
   the world, at most the layer count, stages not straddling nodes: ``spaces.pipeline_degrees``), micro-batch count (divisor of the batch),
   schedule, vocabulary layout and virtual size (``tasks.Task``; interleaved tasks where
   ``pp > 1``, ``m`` is a multiple of ``pp`` and every chunk can hold a layer).
2. Tasks are visited in order of a cheap lower bound (the plain ones first, then the
   interleaved ones, seeded with the incumbent cut into chunks) and skipped once it, or the
   DP-based bound of the task, cannot beat the best plan found.
3. Each task's plans are searched exactly by branch and bound (``exact.TaskSearch``), every
   partition (every chunk split when interleaved) and per-layer strategy included; complete plans are priced by ``evaluate_plan``.
   The answer is the best plan of the full space: proven optimal unless ``time_limit_s`` cut the
   search short (``plan.search["proven_optimal"]``).
4. Baseline spaces are searched the same way and reported, never adopted; the winner's task is
   priced again under the even, memory-balanced, time-balanced and paper-BMW partitions.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from ...plan import Plan, even_partition
from ...utils.progress import RestartingProgress
from ..inputs.cluster_model import ClusterModel
from ..cost.estimate import Estimate, evaluate_plan
from .exact import TaskSearch
from .refine import walk_task
from .walk_state import MEMORY_SLACK, TIE, Incumbent
from .infeasible import InfeasibleError, infeasible_error, interleaved_least_peak
from ..cost.interleaving import interleaved_variant
from .least_memory import cheap_least_peak, task_least_peak
from ..inputs.model_spec import ModelSpec, TrainingSpec
from ..inputs.profiles import ModelProfile
from .polish import polish
from .partition_report import REPORT_TIME_LIMIT_S, partition_report, pinned_partition
from .named_spaces import spaces_of  # also this module's, for its callers
from .options import BASELINE_SPACES, NO_CP_BASELINE, Progress, SearchOptions
from .spaces import Space, baselines_inside, check_pins, plan_in_space
from .cp_space import check_cp_pin, cp_degrees
from .search_cache import SearchCache, SearchClock
from .mixed_offload import MixedOffloadTask
from .task_list import build_tasks, vocabs
from .tasks import Task
from .task_plans import only_plan


GB = 1e9
BOUND_CELLS = 2048  # the bound DP counts memory in about this many cells of the budget
# Without a time limit the search stops proving after this long and says so
# (plan.search["proven_optimal"] false); give time_limit_s to wait longer or less. Seconds of
# the search process's CPU time (search_cache.SearchClock), not of the wall clock.
DEFAULT_TIME_LIMIT_S = 10.0
# With baselines, the full space may use this share of the limit; the baseline spaces (a
# comparison) share what it leaves.
MAIN_SHARE = 0.7
# Seeds per (batch, pp, micro-batch count): its vocabulary layouts differ only in the first and
# last stage, so the first few cheapest are seeded and the others go to the exact search.
SEEDS_PER_TABLE = 2


@dataclass(frozen=True)
class SearchResult:
    plan: Plan
    estimate: Estimate
    baselines: Mapping[str, Estimate | None] = field(default_factory=dict)

    @property
    def search(self) -> Mapping[str, Any]:
        return self.plan.search or {}


def _partition_pin(task: Task, space: Space, options: SearchOptions) -> tuple[int, ...] | None:
    kind = "even" if space.even_split else options.partition
    if kind == "exact":
        return None
    if task.v > 1:  # only "even" reaches here (_interleaves)
        return tuple(even_partition(task.num_layers, task.chunks))
    return pinned_partition(task, kind)


def _stopped(deadline: float, best: Incumbent, clock: SearchClock) -> bool:
    """The deadline passed and there is an answer to return, or none is needed (a baseline
    space, a comparison); without one the answer's search goes on: a plain task whose
    least-memory plan fits has one within a few nodes, an interleaved one gets its seeds and
    then stops its walk at the deadline (``exact.TaskSearch._check_deadline``)."""
    return (best.plan is not None or best.comparison) and clock() > deadline


@dataclass
class _Counts:
    """What ``_run``'s passes count: the winner's task and the tasks settled each way."""

    winner: Task | None = None
    pruned: int = 0  # by a bound
    memory_pruned: int = 0  # no plan of the task fits
    done: int = 0  # tasks of the groups finished


def _run(spaces: list[Space], spec: ModelSpec, training: TrainingSpec, cache: SearchCache,
         budget: float, options: SearchOptions, world: int, step: int,
         deadline: float, progress: Progress | None,
         stats: dict[str, Any], comparison: bool = False, start: Incumbent | None = None,
         floor: float = 0.0
         ) -> tuple[Incumbent, list[tuple[Task, tuple[int, ...] | None]], Task | None]:
    """Search the union of ``spaces``; the incumbent, every (task, pinned partition), and the
    winner's task.

    The non-interleaved tasks first, then the interleaved ones (which start from the
    incumbent cut into chunks), each group in order of the tasks' cheap bounds. Pass 1, before
    any branching: a task whose cheap memory bound exceeds the budget is skipped; the others
    are seeded (``seed``); when no seed fits, the task's exact least peak (``least_memory``)
    decides: above the budget the task is skipped (no plan of it fits), else the plan reaching
    it is a first incumbent (interleaved tasks: their sibling's least peak, a lower bound, see
    ``infeasible.interleaved_least_peak``). Pass 2: the branch and bound of every task left. Every step
    stops at ``deadline`` once a plan exists. ``floor``: a lower bound on the seconds per sample
    of every plan of ``spaces`` known beforehand (a baseline space inside a proven full space:
    ``baseline_floor``), taken with each task's own bound. ``cache``: the search's (the
    cluster and profile searched, the clock of ``deadline``).
    """
    best = start or Incumbent(comparison=comparison)
    best.gap = options.optimality_gap
    tasks = []
    keys: dict[int, float] = {}
    for sp in spaces:
        for t in build_tasks(sp, spec, training, cache.cluster, cache.profile, budget,
                             options, world, step, cache):
            # Setup prices every layer table once (the bound below); a comparison stops here
            # too when the deadline passes (the answer's search needs every task).
            if comparison and cache.clock() > deadline:
                best.stopped = True
                return best, [], None
            keys[id(t)] = t.cheap_bound(False) / t.global_batch
            tasks.append((t, sp))
    # Sorted by the bound without the embedding (shared by a task's vocabulary layouts, so
    # the embedding of most tasks is never priced); the full cheap bound is checked on visit.
    tasks.sort(key=lambda x: (x[0].v > 1, keys[id(x[0])]))
    limit = budget * (1 + MEMORY_SLACK)
    counts = _Counts()
    pinned = [(task, _partition_pin(task, space, options)) for task, space in tasks]
    seeded: dict[int, int] = {}  # seeded tasks per layer table (batch, pp, micro-batches)

    def bound(task: Task, with_embedding: bool = True) -> float:
        return max(task.cheap_bound(with_embedding) / task.global_batch, floor)

    def left(rest: Sequence[Task]) -> float:  # the least bound known of tasks left, unpriced
        return min(max(bound(t, False), t.known_bound() / t.global_batch) for t in rest)

    def settled_by_lagrange(task: Task) -> bool:
        # memory priced by multipliers (lagrange_bound.py): no DP, no seed for such a task
        cut = best.cutoff() * task.global_batch
        if task.lagrange_bound(cut) < cut:
            return False
        best.prune(max(task.lagrange_bound(), floor * task.global_batch) / task.global_batch)
        return True

    def report(done: int) -> None:
        if progress:
            progress(done, len(pinned), 1 / best.value if math.isfinite(best.value) else None)

    def passes(group: list[tuple[Task, tuple[int, ...] | None]]) -> None:
        live: list[tuple[Task, tuple[int, ...] | None, bool]] = []  # bool: least peak to check
        base = counts.done
        # Pass 1: memory and seeds, cheapest bound first.
        for i, (task, pin) in enumerate(group):
            report(base + i - len(live))  # tasks settled without branching so far
            if bound(task, False) >= best.cutoff() or _stopped(deadline, best, cache.clock):
                best.stopped = best.stopped or bound(task, False) < best.cutoff()
                best.prune(left([t for t, _ in group[i:]]))
                counts.pruned += len(group) - i
                break
            if bound(task) >= best.cutoff():
                best.prune(bound(task))
                counts.pruned += 1
                continue
            only = only_plan(task, pin)
            if only is not None:  # priced as it is, no bound or walk can do better
                before = best.plan
                TaskSearch(task, training, best, deadline, pin).offer(only)
                if best.plan is not before:
                    counts.winner = task
                counts.pruned += 1
                continue
            if best.plan is not None and settled_by_lagrange(task):
                counts.pruned += 1
                continue
            if cheap_least_peak(task) > limit:
                counts.memory_pruned += 1
                continue
            if task.v > 1:  # seeded in pass 2, from the incumbent of the plain tasks
                # with an answer at hand, the least peak waits until the bounds let the task
                # be searched (most are cut by their tied bounds, which cost less)
                if best.plan is None and interleaved_least_peak(task) > limit:
                    counts.memory_pruned += 1
                    continue
                live.append((task, pin, best.plan is not None))
                continue
            before = best.plan
            search_task = TaskSearch(task, training, best, deadline, pin)
            table = id(task.tables)
            seeded[table] = seeded.get(table, 0) + 1
            fits = seeded[table] <= SEEDS_PER_TABLE and search_task.seed()
            if not fits and best.plan is not None:
                # The exact least peak decides whether any plan of the task can fit; with an
                # answer at hand it is needed only if the bounds let the task reach pass 2.
                live.append((task, pin, True))
                continue
            if not fits:
                # No seed fits: the exact least peak decides whether any plan of the task can.
                least = task_least_peak(task, pin)
                if least.bytes > limit:
                    counts.memory_pruned += 1
                    continue
                if least.plan is not None and best.plan is None:
                    search_task.offer(least.plan)  # a first answer, so the deadline can apply
            if best.plan is not before:
                counts.winner = task
            live.append((task, pin, False))
        # Pass 2: branch and bound over the tasks that can fit, cheapest bound first. The
        # interleaved tasks' Lagrangian stage-block bounds (lagrange_bound.TiedLagrangeRows)
        # are far above their compute bounds and need no DP table: all of them are computed
        # first and the tasks searched best-first by them (each task's tied bound, DP tables
        # and full root bound when it is searched), so that a deadline leaves the tasks of the
        # weakest bounds unsearched and the certified gap reads them. The per-stage offload
        # tasks, searched last, by their full root bounds. The plain tasks are sorted by
        # their Lagrangian bounds (lagrange_bound.py; most were computed in pass 1), so that
        # of a layer table's vocabulary layouts the most promising is searched first and its
        # answer cuts the others at their roots.
        settled = len(group) - len(live)
        deep = bool(live) and (live[0][0].v > 1 or isinstance(live[0][0], MixedOffloadTask))
        if live and (deep or best.plan is not None):
            for task, _, _ in live:
                if bound(task, False) >= best.cutoff() or _stopped(deadline, best, cache.clock):
                    break
                cut = best.cutoff() * task.global_batch
                if isinstance(task, MixedOffloadTask):
                    task.root_bound(cut)
                elif task.v > 1:  # DP tables, the tied bound's too, when a task is searched
                    task.tied_lagrange_bound(cut)
                else:
                    task.lagrange_bound(cut)
            live.sort(key=lambda x: left([x[0]]))
        if live and live[0][0].v > 1 and not isinstance(live[0][0], MixedOffloadTask):
            # every interleaved task's own seeds first (a few DP tables and plans each): the
            # walks that follow cut against the best of them, not only the first task's
            for task, pin, _ in live:
                if left([task]) >= best.cutoff() or _stopped(deadline, best, cache.clock):
                    break
                before = best.plan
                TaskSearch(task, training, best, deadline, pin).seed_interleaved()
                if best.plan is not before:
                    counts.winner = task
        key: Callable[[Task], float] = lambda t: left([t])  # what ``live`` is sorted by
        # Best-first on the strongest bound known: a task's key only rises, so one popped with
        # a key above the next is pushed back; an interleaved task popped for the first time
        # gets its tied bound first (tasks.Task.table_free_bound, DP tables of its stages'
        # blocks), and goes back if that lifts it past the next task.
        queue = [(key(task), i) for i, (task, _, _) in enumerate(live)]
        heapq.heapify(queue)
        refined: set[int] = set()
        visited = 0
        while queue:
            _, i = heapq.heappop(queue)
            task, pin, check = live[i]
            if queue and key(task) > queue[0][0]:
                heapq.heappush(queue, (key(task), i))
                continue
            report(base + settled + visited)
            if key(task) >= best.cutoff() or _stopped(deadline, best, cache.clock):
                # tasks left unsearched by the deadline: the answer is not proven
                best.stopped = best.stopped or key(task) < best.cutoff()
                best.prune(left([task] + [live[j][0] for _, j in queue]))
                counts.pruned += 1 + len(queue)
                break
            if task.v > 1 and i not in refined and not isinstance(task, MixedOffloadTask):
                refined.add(i)
                task.table_free_bound(best.cutoff() * task.global_batch)
                heapq.heappush(queue, (key(task), i))
                continue
            visited += 1
            if bound(task) >= best.cutoff():
                best.prune(bound(task))
                counts.pruned += 1
                continue
            if check and _least_peak(task, pin) > limit:
                counts.memory_pruned += 1
                continue
            before = best.plan
            walk_task(task, training, best, deadline, pin,
                      refine=options.memory_step_bytes is None)
            if best.plan is not before:
                counts.winner = task
        counts.done += len(group)

    # The per-stage offload tasks last (mixed_offload): they hold every plan of their uniform
    # variants and more, with weaker bounds, so the answer of the other tasks is found first
    # and a deadline never leaves it worse than a search without them.
    mixed = [isinstance(x[0], MixedOffloadTask) for x in pinned]
    passes([x for x, mix in zip(pinned, mixed) if x[0].v == 1 and not mix])
    passes([x for x in pinned if x[0].v > 1])
    passes([x for x, mix in zip(pinned, mixed) if mix])
    report(len(pinned))
    stats["tasks"] = stats.get("tasks", 0) + len(tasks)
    stats["pruned"] = stats.get("pruned", 0) + counts.pruned
    stats["memory_pruned"] = stats.get("memory_pruned", 0) + counts.memory_pruned
    stats["nodes"] = stats.get("nodes", 0) + best.nodes
    stats["plans_priced"] = stats.get("plans_priced", 0) + best.leaves
    return best, pinned, counts.winner


def _least_peak(task: Task, pin: tuple[int, ...] | None) -> float:
    """The exact least peak of a plain task's plans; for an interleaved task its plain
    sibling's, a lower bound (``infeasible.interleaved_least_peak``)."""
    return interleaved_least_peak(task) if task.v > 1 else task_least_peak(task, pin).bytes


def _bound_step(budget: float, cluster: ClusterModel, options: SearchOptions) -> int:
    if options.memory_step_bytes:
        return int(options.memory_step_bytes)
    return max(1, math.ceil((budget - cluster.memory_reserve_bytes) / BOUND_CELLS))


def search(spec: ModelSpec, training: TrainingSpec, cluster: ClusterModel,
           profile: ModelProfile, memory_budget_bytes: int,
           options: SearchOptions = SearchOptions(),
           world_size: int | None = None, incumbents: Sequence[Plan] = ()) -> SearchResult:
    """Best plan for ``spec`` on ``cluster`` within ``memory_budget_bytes`` per device.

    ``incumbents``: plans *of the searched space* (the caller's contract; e.g. the answers of
    its sub-spaces) to start from: the fastest that fits is the first incumbent, so the answer
    is never below it even when the time limit stops the search, and a proven answer is still
    the optimum of the space (``plan.search["from_incumbent"]``: no searched plan beat it).

    Raises ``InfeasibleError`` (with the least memory that would work) when nothing fits, and
    ``ValueError`` for bad options.
    """
    options.validate()
    profile.check_matches(spec, training.precision)
    world = world_size or cluster.world_size
    if world > cluster.world_size or world < 1:
        raise ValueError(f"world_size={world}: must be between 1 and the cluster's "
                         f"{cluster.world_size} devices")
    check_pins(options, world, cluster.devices_per_node)
    check_cp_pin(options, spec, world)
    cache = SearchCache(profile, cluster)  # this search's alone (search_cache)
    clock = cache.clock
    t0, wall0 = clock(), time.monotonic()
    budget = float(memory_budget_bytes)
    step = _bound_step(budget, cluster, options)
    limit_s = options.time_limit_s or DEFAULT_TIME_LIMIT_S
    end = t0 + limit_s  # everything (search, baselines, partition report) stops by then
    # The full space first; baselines get what it leaves, but at least a share of the limit.
    share = MAIN_SHARE if options.include_baselines else 1.0
    reporter = (RestartingProgress("megatron-auto search", "tasks", interval_s=0.5, delay_s=1.0)
                if options.progress is None and options.show_progress else None)
    progress = options.progress or reporter
    stats: dict[str, Any] = {}
    subspaces = spaces_of(options.space, options, world)
    best, tasks, winner = _run(subspaces, spec, training, cache, budget, options,
                               world, step, t0 + share * limit_s, progress, stats,
                               start=_given(incumbents, spec, training, cluster, profile, budget))
    if reporter is not None:
        reporter.close()
    if best.plan is None:
        if best.stopped:  # only an interleaved walk stops without a plan (exact.py)
            raise InfeasibleError(
                f"no plan was found in the {share * limit_s:g} CPU s the search had "
                f"(--time-limit {limit_s:g}): no seed of the interleaved tasks fits the budget "
                f"of {budget / GB:.3f} GB per device, and their search stopped before it found "
                f"a plan or proved that none fits; give a larger --time-limit or "
                f"--memory-budget-gb, or drop --num-layers-per-virtual-pipeline-stage", None)
        if min(options.virtual_sizes) > 1:  # interleaving pinned
            raise InfeasibleError(
                f"no interleaved plan with virtual size {options.virtual_sizes[0]} fits the "
                f"budget of {budget / GB:.3f} GB per device; choose another "
                f"--num-layers-per-virtual-pipeline-stage or drop it", None)
        # Interleaving never lowers the least peak (infeasible.interleaved_least_peak): the minimum
        # is the plain tasks'.
        err = infeasible_error(options.space, world, budget,
                               [(t, pin) for t, pin in tasks if t.v == 1], training)
        if (options.space == "full" and options.cp is None
                and spec.seq_length < options.cp_min_seq_length
                and len(cp_degrees(spec, world, replace(options, cp_min_seq_length=0))) > 1):
            # context parallelism was left out by the length threshold alone: say so
            err = InfeasibleError(
                f"{err}; context parallelism was not tried (the sequence of "
                f"{spec.seq_length} tokens is below --cp-min-seq-length="
                f"{options.cp_min_seq_length}): give --cp-min-seq-length {spec.seq_length} "
                f"to search it", err.min_memory_bytes)
        raise err
    assert best.estimate is not None and (winner is not None or incumbents)
    # An answer the gap or the limit stopped short of the proof: its neighbours (polish.py),
    # before the baselines compare with it and after one is adopted.
    out_of_time: Callable[[], bool] = lambda: clock() > end
    moves = _polish(best, spec, training, cluster, profile, budget, options, world, out_of_time)
    baselines: dict[str, Estimate | None] = {}
    baselines_cut: list[str] = []
    adopted = None
    if options.include_baselines:
        # The full space's lower bound bounds every plan of a baseline space inside it from
        # below: a baseline search that reaches it is done (0: no such bound). A proven
        # answer that is a plan of a baseline space is that space's optimum.
        inside = baselines_inside(options, world, cluster.devices_per_node)
        floor = min(best.lower, best.value * (1 - TIE)) if inside else 0.0
        exact = inside and not best.stopped and best.lower_bound() >= best.value
        names = [n for n in BASELINE_SPACES if n != options.space]
        # an answer with cp > 1 the search chose: the best plan without CP first, with half
        # of what is left (the other baselines are small spaces; this one is the full space)
        no_cp = (options.space == "full" and options.cp is None and best.plan is not None
                 and best.plan.cp_size > 1)
        if no_cp:
            names.insert(0, NO_CP_BASELINE)
        for j, name in enumerate(names):
            subspaces, now = spaces_of(name, options, world), clock()
            dpn, p = cluster.devices_per_node, best.plan
            assert p is not None  # the full space's answer, or an adopted baseline's plan
            if exact and any(plan_in_space(p, sp, spec, vocabs(
                    spec, sp, options, p.stage_size, p.microbatch_size, sp.rules, dpn), dpn)
                    for sp in subspaces):
                baselines[name] = best.estimate  # the optimum of a space it is a plan of
                continue
            share_j = 0.5 if (no_cp and j == 0) else 1 / (len(names) - j)
            found, _, _ = _run(subspaces, spec, training, cache, budget, options, world, step,
                               now + max(0.0, end - now) * share_j, None, {},
                               comparison=True, floor=floor)
            baselines[name] = found.estimate
            if found.stopped:
                baselines_cut.append(name)
            # A proven answer is the optimum of the whole space, which holds every baseline
            # space. One the time limit or the gap stopped may be beaten: a better plan of a
            # baseline space that is a plan of the searched one is the answer instead (the
            # lower bound still holds), so a deep model never gets less than a uniform plan.
            if found.plan is not None and found.value < best.value * (1 - TIE) \
                    and _keeps_pins(found.plan, options, spec, world, cluster.devices_per_node):
                found.stopped, found.lower = best.stopped, best.lower
                best, adopted = found, name
    if adopted is not None:
        moves += _polish(best, spec, training, cluster, profile, budget, options, world,
                        out_of_time)
    chosen_plan, chosen_estimate = best.plan, best.estimate
    assert chosen_plan is not None and chosen_estimate is not None  # checked above
    if options.host_memory_budget_bytes is not None:  # the second budget, for the record
        chosen_estimate = replace(chosen_estimate,
                                  host_memory_budget_bytes=options.host_memory_budget_bytes)
    tried = _virtual_size_report(chosen_plan, chosen_estimate, spec, training, cache, budget,
                                 options)
    report_s = min(REPORT_TIME_LIMIT_S, end - clock())
    if not options.report_partitions:
        partitions: Any = "not asked for"
    elif winner is None:
        partitions = "not priced: the answer is a given incumbent"
    elif report_s > 0 and adopted is None:
        partitions = partition_report(winner.sibling(), training, best, report_s)
    else:
        partitions = "not priced: the time limit was reached"
    lower = best.lower_bound()  # seconds per sample; the gap's bound
    info = {
        "space": options.space, "objective": "evaluate (iteration time), exact",
        "proven_optimal": not best.stopped and lower >= best.value,
        "time_limited": best.stopped, "time_limit_s": limit_s,
        "lower_bound_s": lower * chosen_plan.global_batch_size,
        "optimality_gap": best.value / lower - 1 if lower > 0 else math.inf,
        "optimality_gap_target": options.optimality_gap,
        "partitions": partitions,
        "from_incumbent": winner is None,
        "adopted_from_baseline": adopted,
        "polish_moves": moves,
        "search_time_s": time.monotonic() - wall0, "search_cpu_s": clock() - t0,
        "tasks": stats.get("tasks", 0),
        "tasks_pruned": stats.get("pruned", 0),
        "tasks_over_memory": stats.get("memory_pruned", 0), "nodes": stats.get("nodes", 0),
        "plans_priced": stats.get("plans_priced", 0), "bound_memory_step_bytes": step,
        "memory_budget_bytes": memory_budget_bytes,
        "schedules": [options.schedule] if options.schedule else
        ["1f1b (gpipe has the same time and never less memory, so it is not searched)"],
        "baselines": {k: (v.samples_per_s if v else None) for k, v in baselines.items()},
        "baselines_time_limited": baselines_cut,
    }
    if tried:
        info["partition"] = {"virtual_size_samples_per_s": tried}
    plan = replace(chosen_plan, estimate=chosen_estimate.to_dict(), search=info)
    return SearchResult(plan=plan, estimate=chosen_estimate, baselines=baselines)


def _polish(best: Incumbent, spec: ModelSpec, training: TrainingSpec, cluster: ClusterModel,
            profile: ModelProfile, budget: float, options: SearchOptions, world: int,
            out_of_time: Callable[[], bool]) -> int:
    """Local moves (``polish.polish``) on an answer that is not proven optimal, in place; the
    number of moves taken."""
    plan, est = best.plan, best.estimate
    if plan is None or est is None or (not best.stopped and best.lower_bound() >= best.value):
        return 0
    dpn = cluster.devices_per_node
    candidates = list(dict.fromkeys(  # the vocabulary layouts of the spaces, at this stage shape
        v for sp in spaces_of(options.space, options, world)
        for v in vocabs(spec, sp, options, plan.stage_size, plan.microbatch_size,
                        replace(sp.rules, cp=plan.cp_size), dpn)))
    host = options.host_memory_budget_bytes
    spaces = spaces_of(options.space, options, world)  # built once for every neighbour
    plan, est, moves = polish(
        plan, replace(est, host_memory_budget_bytes=host), spec, training, cluster, profile,
        budget, candidates, options.dp_modes,
        lambda p: _keeps_pins(p, options, spec, world, dpn, spaces), out_of_time, host)
    if moves:
        best.plan, best.estimate = plan, replace(est, host_memory_budget_bytes=None)
        best.value = est.iteration_time_s / plan.global_batch_size
    return moves


def _keeps_pins(plan: Plan, options: SearchOptions, spec: ModelSpec, world: int,
                dpn: int, spaces: Sequence[Space] | None = None) -> bool:
    """Whether a baseline space's plan is a plan of the searched space: its pinned pipeline
    degree, virtual size, micro-batch count and schedule (the baseline spaces keep their own
    pp and never interleave), and its layers and vocabulary among the space's (a pinned tp,
    dp modes, sequence parallelism, recompute). ``spaces``: ``spaces_of(options.space)``,
    when the caller has them."""
    return ((options.pp is None or plan.pp_size == options.pp)
            and plan.virtual_size in options.virtual_sizes
            and options.num_microbatches in (None, plan.num_microbatches)
            and options.schedule in (None, plan.pipeline.schedule)
            and any(plan_in_space(plan, sp, spec, vocabs(
                spec, sp, options, plan.stage_size, plan.microbatch_size, sp.rules, dpn), dpn)
                for sp in (spaces if spaces is not None
                           else spaces_of(options.space, options, world))))


def _given(plans: Sequence[Plan], spec: ModelSpec, training: TrainingSpec,
           cluster: ClusterModel, profile: ModelProfile, budget: float) -> Incumbent | None:
    """The fastest of ``plans`` that fits ``budget`` (priced by ``evaluate_plan``), as a
    first incumbent; None without one."""
    best = None
    for plan in plans:
        est = evaluate_plan(plan, spec, replace(training, global_batch_size=plan.global_batch_size),
                            cluster, profile, budget)
        value = est.iteration_time_s / plan.global_batch_size
        if est.feasible and (best is None or value < best.value * (1 - TIE)):
            best = Incumbent(value=value, plan=replace(plan, estimate=None, search=None),
                             estimate=est)
    return best


def _virtual_size_report(plan: Plan, est: Estimate, spec: ModelSpec, training: TrainingSpec,
                         cache: SearchCache, budget: float,
                         options: SearchOptions) -> dict[str, float | None]:
    """For the record (``plan.search.partition.virtual_size_samples_per_s``): the answer's
    samples/s and, for each other virtual size searched, that of the answer's stages cut into
    that many chunks (``interleaving.interleaved_variant``; None where it cannot be cut or
    does not fit). The answer is the optimum over every virtual size; these show what the
    interleaving of its stages is worth. Empty for a one-stage answer."""
    if plan.pp_size == 1 or options.virtual_sizes == (1,):
        return {}
    out: dict[str, float | None] = {}
    for v in sorted(set(options.virtual_sizes) | {plan.virtual_size}):
        variant = interleaved_variant(plan, v)
        if variant is None:
            out[str(v)] = None
            continue
        try:
            e = est if v == plan.virtual_size else evaluate_plan(
                variant, spec, training, cache.cluster, cache.profile, budget,
                in_flight_memo=cache.in_flight)
        except ValueError:  # a layer type the moved strategy does not fit
            out[str(v)] = None
            continue
        out[str(v)] = e.samples_per_s if e.feasible else None
    return out


def evaluate(plan: Plan, spec: ModelSpec, training: TrainingSpec, cluster: ClusterModel,
             profile: ModelProfile, memory_budget_bytes: int | None = None) -> Estimate:
    """Cost-model estimate of any plan; ``.feasible`` against ``memory_budget_bytes`` if given."""
    return evaluate_plan(plan, spec, training, cluster, profile, memory_budget_bytes)
