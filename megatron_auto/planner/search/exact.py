"""Exact search of one task: branch and bound over partitions and per-layer strategies.

The search walks the plans of a :class:`tasks.Task` stage by stage (the stage's length first,
then its layers in order, each over its candidate strategies) and prunes a branch when a lower
bound on every plan below it cannot beat the best plan found. Plans that reach the bottom are
priced by ``cost_model.evaluate_plan`` itself, so the answer is the best plan of the task under
the cost model ``evaluate`` reports, not under a stand-in objective.

Why nothing better is pruned (each argument is tested by enumeration, tests/test_planner_exact*):

- Bounds: for every stage ``b``, ``J_b`` (tasks module) is at most the iteration time of any
  plan. A branch's bound is ``max_b`` of: the exact ``J_b`` share of the stages already chosen,
  plus the exact share of the current stage's chosen layers, plus the DP's least share of its
  remaining layers within the bytes left (a relaxation: memory rounded down, the remaining
  layers' transients, step peak and incoming relayout ignored), plus the least share of the
  later stages over every partition (``Task.future``).
- Memory: a branch is cut only when the bytes already placed plus the least bytes the remaining
  layers can add exceed the budget, for the backward peak and the optimizer-step peak alike
  (``evaluate_plan``'s two peaks), with the same per-layer terms. With a host budget
  (``SpaceRules.host_memory_budget_bytes``) a plain task's branch is also cut once its stage's
  offloaded activations pass it: they only grow with the stage's later layers, and
  ``evaluate_plan`` adds the optimizer's offloaded share on top (interleaved tasks charge the
  chunks at the schedule's peak mix, so only their leaves are checked).
- Symmetry: two adjacent layers of one type and one layout can swap strategies without changing
  any sum, maximum or transition, so within such a run strategy indices never decrease.
- Ties: a branch whose bound is within ``TIE`` of the best is cut (the answer is optimal to
  that relative precision, far below the cost model's).
- The gap: with ``Incumbent.gap`` a branch is cut once its bound times ``1 + gap`` reaches the
  best, and the least bound of every branch so cut (or left open by the deadline: the picks
  after the one being searched at each level, which the sort puts at or above the next one's
  bound) is kept, so ``answer / Incumbent.lower_bound() - 1`` is a certified gap.

Interleaved tasks (``task.v > 1``): the walk is over the ``pp v`` model chunks in model order
(chunk ``c`` on stage ``c mod pp``, lengths from 1, every split), with the same arguments:

- Bounds: ``J_b`` with the interleaved weights (tasks module: ``sum_k C_k / v + (m - 1/v)
  C_b + step_b + tail_0 + overhead`` is at most ``cost_time.pipeline_time``'s iteration time
  because the fill ``sum_k max_j c_{k,j}`` is at least ``sum_k C_k / v``); additive over
  chunks, so the chunk-level DP and ``Task.future`` over chunk positions bound it as above.
  The Alpa-form bound is not used (a weaker bound, still correct).
- Memory: a stage's persistent bytes, largest transient, step peak and NCCL layouts carry
  from its earlier chunks into its later ones; each chunk's activations are charged at
  ``interleaving.chunk_in_flight`` (one count vector the schedule passes through, at most the
  peak mix ``evaluate_plan`` charges). A cut adds only the least bytes of the current chunk's
  remaining layers (the stage's later chunks add at least nothing).
- Symmetry only inside a chunk (chunks of one stage hold different in-flight counts).
- Memory also holds each chunk's received input but the model's first (``evaluate_plan`` keeps
  the p2p buffer until the chunk's backward): exact from the previous chunk's last class at a
  chunk's start (``LayerTables.hop_bytes``), its least in the bounds (``Task.hop_floor``).
- Seeds: the task's own (``interleaved_seeds``: each stage's layers by a DP at its chunks'
  in-flight counts, which the driver prices for every interleaved task before it walks any),
  the incumbent and, while there is none, the plain sibling task's seeds, each cut into ``v``
  chunks per stage (``interleaving.interleaved_variant``); leaves are priced by
  ``evaluate_plan`` as for ``v = 1``.

Per-stage optimizer offload (``mixed_offload.MixedOffloadTask``): a stage start picks a variant
(a uniform task at one fraction) with its length, both sorted by one bound; the stage's layers
are priced by that variant (``cur``) and the leaf's field lists the picks. The partial-stage
dominance keys on the variant (its layers' candidates differ); the placed-stage dominance does
not need to (later stages do not depend on earlier fractions).

The walk's state is named (module ``walk_state``, with the incumbent): :class:`Placed` (the
stages placed so far, as the bounds and the stage dominance read them), :class:`StageState`
(the running sums of the stage being built), :class:`StageMemory` (what an interleaved stage's
earlier chunks placed) and, per layer, :class:`Candidates` (the stage's sums extended by each
strategy of the layer).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ...plan import LayerStrategy, Plan
from ...plan_optimizer_offload import FractionValue
from ..cost.estimate import evaluate_plan
from ..inputs.model_spec import TrainingSpec
from .bottleneck import Bottleneck
from . import partition_bound as partition_bounds
from .dominance import StageDominance
from .mixed_offload import MixedOffloadTask, stage_variants
from .seeds import seed_plans
from .interleaved_seeds import cut_seeds, own_seeds
from .tasks import Task, Weights
from .task_plans import only_plan, table_time, task_plan

from .walk_state import (MEMORY_SLACK, TIE, Candidates, Incumbent, Placed, StageMemory,
                         StageState, host_fits)

TIED_DEPTH = 3  # chunk positions from which the walk stops checking the tied bound
# Cut a branch as soon as its stage's offloaded activations pass the host budget (False: only
# the leaf checks, as before; benchmarks/bench_host_cut.py measures both in one run).
EARLY_HOST_CUT = True
# At every stage start of a plain task, cut the node when the partition bound of the stages
# left reaches the incumbent (partition_bound.py), visiting at most STAGE_NODE_LIMIT partitions.
STAGE_PARTITION_BOUND = True
STAGE_NODE_LIMIT = 200


class _Stopped(Exception):
    pass


class _Restart(Exception):
    """The walk passed its node limit (``TaskSearch.node_limit``): ``run`` returns True."""


class TaskSearch:
    """Branch and bound over the plans of one task (see the module docstring)."""

    def __init__(self, task: Task, training: TrainingSpec, incumbent: Incumbent,
                 deadline: float | None = None, partition: tuple[int, ...] | None = None,
                 node_limit: int | None = None) -> None:
        self.task, self.training, self.best = task, training, incumbent
        self.node_limit = node_limit  # of the incumbent's node count, for the walk (refine.py)
        self.deadline = deadline  # on task.cache.clock (the search's CPU clock)
        self.clock = task.cache.clock
        self.partition = partition
        self._entered = True  # the node being searched has begun its picks (``_open``)
        self.limit = task.budget * (1 + MEMORY_SLACK) - task.cluster.memory_reserve_bytes
        # The host cut (module docstring): plain tasks only, where a stage's offloaded bytes are
        # its layers' rows at the stage's own in-flight count, as evaluate_plan sums them.
        host = task.rules.host_memory_budget_bytes
        self.host_limit = host * (1 + MEMORY_SLACK) if host is not None and task.v == 1 \
            and EARLY_HOST_CUT else math.inf
        self.chosen: list[LayerStrategy] = []
        self.lengths: list[int] = []
        # Per-stage optimizer offload (mixed_offload): the task pricing the stage being built,
        # and the variant each placed stage took (a uniform task is its only variant).
        self.cur: Task = task
        self.picks: list[int] = []
        self.incoming: int | None = None  # class of the layer ending the previous chunk
        self.placed = Placed()
        # Interleaved: the memory a stage's earlier chunks placed, carried into its next chunk.
        self.stage_memory: list[StageMemory | None] = [None] * task.pp
        self._weights = [task.weight_arrays(k) for k in range(task.chunks)]
        self.futures = np.zeros((len(task.branches), task.chunks + 1, task.num_layers + 1))
        self.joint: Bottleneck | None = None
        self.dominance: StageDominance | None = None
        self.inner: StageDominance | None = None
        # Branches sharing the weights of position k (at most two kinds: bottleneck or not).
        self._pairs: list[list[tuple[np.ndarray, Weights]]] = []
        for k in range(task.chunks):
            alpha, beta, _ = self._weights[k]
            pairs = []
            for pair in sorted(set(zip(alpha.tolist(), beta.tolist()))):
                rows = (alpha == pair[0]) & (beta == pair[1])
                pairs.append((rows, task.weights(k, int(np.nonzero(rows)[0][0]))))
            self._pairs.append(pairs)

    def threshold(self) -> float:
        """Iteration time a branch's bound must be below to be searched (inf before the first
        plan): the incumbent's, less ``TIE`` and the optimality gap."""
        return self.best.cutoff() * self.task.global_batch

    def _prune(self, bound: float) -> None:
        """A branch left unsearched with its bound (an iteration time); the task's cheap bound
        holds for it too (stronger than the walk's ``J_b`` on interleaved tasks)."""
        self.best.prune(max(bound, self.task.known_bound()) / self.task.global_batch)

    def _open(self, bounds: np.ndarray, order: np.ndarray, i: int) -> None:
        """The deadline stopped the search below pick ``order[i]`` of a node: what is left of
        the node is the picks after it (sorted by bound: the next one's is the least) and, if
        the child never began its own picks (``_entered``), the whole of pick ``i``."""
        if i + 1 < len(order):
            self._prune(float(bounds[order[i + 1]]))
        if not self._entered:
            self._prune(float(bounds[order[i]]))
        self._entered = True

    def seed(self) -> bool:
        """Price the heuristic plans of ``seed.seed_plans`` (the pinned partition, if any):
        incumbents found fast, so that bounds prune from the start; the answer is still the
        search's. True if one of them fits the budget. Interleaved tasks take the incumbent
        (while there is none, their plain sibling's seeds) cut into chunks and their own
        seeds (``interleaved_seeds``)."""
        task = self.task
        if isinstance(task, MixedOffloadTask):
            return False  # its variants are seeded as tasks of their own (mixed_offload)
        if task.v == 1:
            return self._offer_all(lambda: seed_plans(task, self.partition))
        return self._offer_all(lambda: cut_seeds(task, self.best.plan, self.partition)
                               + own_seeds(task, self.partition))

    def seed_interleaved(self) -> None:
        """Price an interleaved task's own seeds, once (the driver seeds every interleaved
        task so before it walks any: the first walks cut against the best of them)."""
        if self.task.v > 1:
            self._offer_all(lambda: own_seeds(self.task, self.partition))

    def _offer_all(self, plans: Callable[[], list[Plan]]) -> bool:
        """Offer the plans ``plans()`` builds (DP tables under the deadline check); True if
        one fits."""
        fits = False
        self.task.on_new_table = self._check_deadline
        try:
            for plan in plans():
                if self.task.v == 1 and table_time(self.task, plan) \
                        >= self.best.value * self.task.global_batch:
                    continue  # its tables show it slower than the incumbent
                fits = self.offer(plan) or fits
        except _Stopped:
            self.best.stopped = True
        finally:
            self.task.on_new_table = None
        return fits

    def offer(self, plan: Plan) -> bool:
        """Price a complete plan of this task (e.g. the least-memory one) as a candidate;
        True if it fits the budget."""
        self.chosen, self.lengths = list(plan.layers), list(plan.pipeline.layers_per_stage)
        fits = self._leaf(plan.pipeline.optimizer_offload_fraction)
        self.chosen, self.lengths = [], []
        return fits

    def _check_deadline(self) -> None:
        # Without an answer a plain task's walk goes on: where its least-memory plan fits,
        # that plan is its incumbent a few nodes in. An interleaved task has no such plan
        # (its sibling's least peak only bounds its own) and stops at the deadline anyway.
        if self.deadline is not None and (self.best.plan is not None or self.best.comparison
                                          or self.task.v > 1) \
                and self.clock() > self.deadline:
            raise _Stopped
        if self.node_limit is not None and self.best.nodes > self.node_limit:
            raise _Restart

    def run(self) -> bool:
        """Search the task; the incumbent is updated in place (``stopped`` if cut short). True
        where the walk stopped at its node limit instead (the task is not searched)."""
        self.placed = Placed()
        self.dominance = StageDominance() if self.task.v == 1 and self.task.pp > 1 else None
        task = self.task
        only = only_plan(task, self.partition)
        if only is not None:  # one strategy per layer and one partition: the task's one plan
            self.offer(only)
            return False
        if self.best.plan is None or task.v > 1:
            self.seed()
        self.task.on_new_table = self._check_deadline  # DP tables are the slow part
        self._entered = False
        try:
            root = self.task.root_bound(self.threshold())
            if root >= self.threshold():
                self._prune(root)
                return False
            self.futures = np.stack([self.task.future(b) for b in self.task.branches])
            # bound 2 (the Alpa form) is for v = 1; interleaved tasks prune with J_b alone
            self.joint = self.task.bottleneck() if self.task.pp > 1 and task.v == 1 else None
            self._stage(0, 0, np.zeros(len(self.task.branches)))
        except _Restart:
            return True
        except _Stopped:
            self.best.stopped = True
            if not self._entered:  # stopped before the first stage's picks: all of the task
                self.task.on_new_table = None
                self._prune(task.cheap_bound())
        finally:
            self.task.on_new_table = None
        return False

    # ------------------------------------------------------------------ stages
    def _stage(self, k: int, start: int, acc: np.ndarray) -> None:
        """Chunk position ``k`` (a stage unless interleaved) from layer ``start``; ``acc``: the
        placed chunks' exact share of each bound ``J_b``."""
        task = self.task
        num_layers, chunks = task.num_layers, task.chunks
        longest = num_layers - start - (chunks - 1 - k)  # later chunks need a layer each
        if self.partition is not None:
            lengths = [self.partition[k]] if self.partition[k] <= longest else []
        else:
            lengths = list(range(1, min(longest, task.max_len) + 1))
        if k == chunks - 1:
            lengths = [num_layers - start] if num_layers - start in lengths else []
        if not lengths:
            return
        if k > 0 and self.partition is None and task.v == 1 and partition_bounds.ENABLED \
                and STAGE_PARTITION_BOUND:
            # the partition bound of the stages left below this node (partition_bound.py)
            cut = self.threshold() - task.overhead
            rest = partition_bounds.partition_bound(task, cut, k, start, acc, STAGE_NODE_LIMIT)
            if rest >= cut:
                self._prune(rest + task.overhead)
                return
        lens = np.array(lengths)
        # Per variant (mixed_offload; one for a uniform task), the bound of each length.
        variants = stage_variants(task, k)
        bounds = np.concatenate([self._length_bounds(k, start, lens, var, acc)
                                 for _, var in variants])
        which = np.repeat(np.arange(len(variants)), len(lens))
        lens = np.tile(lens, len(variants))
        outer, cur = self.inner, self.cur
        # partial stages of this call (same earlier stages, same start): dominance.py
        self.inner = StageDominance() if task.v == 1 else None
        order = np.argsort(bounds, kind="stable")
        self._entered = True
        for i, pick in enumerate(order):
            if bounds[pick] >= self.threshold() or not np.isfinite(bounds[pick]):
                self._prune(float(bounds[pick]))
                break
            j, self.cur = variants[which[pick]]
            self.lengths.append(int(lens[pick]))
            self.picks.append(j)
            self._entered = False
            try:
                self._layer(k, start, int(lens[pick]), 0, self._first_state(k, start), acc)
            except _Stopped:
                self._open(bounds, order, i)
                raise
            finally:
                self.cur = cur
            self.lengths.pop()
            self.picks.pop()
        self.inner = outer

    def _length_bounds(self, k: int, start: int, lens: np.ndarray, var: Task,
                       acc: np.ndarray) -> np.ndarray:
        """The bound of chunk position ``k`` from ``start`` at each length of ``lens``, its
        layers priced by ``var`` (the task itself, or a per-stage offload variant)."""
        task = self.task
        rows = np.stack([var.stage_bound(k, start, b) for b in task.branches])  # (br, len)
        bounds = (acc[:, None] + rows[:, lens - 1]
                  + self.futures[:, k + 1, start + lens]).max(axis=0) + task.overhead
        if self.joint is not None:
            placed = self.placed
            with_tail = var.time_row(k, start, k == 0)[lens - 1]
            alone = var.time_row(k, start, False)[lens - 1]
            bounds = np.maximum(bounds, placed.sum_time_tail + with_tail + placed.max_step
                                + task.overhead
                                + self.joint.g(k + 1, start + lens,
                                               np.maximum(placed.max_time, alone)))
        return bounds

    def _first_state(self, k: int, start: int) -> StageState:
        """The running sums of chunk position ``k`` (first layer ``start``) before its first
        layer: its embedding/head, and (interleaved) what its stage's earlier chunks placed and
        the input it received (``LayerTables.hop_bytes``, kept per micro-batch in flight)."""
        task = self.task
        emb = self.cur.emb[k]
        stage = task.stage_of(k)
        before = self.stage_memory[stage]
        if before is None:  # the stage's first chunk
            ends = {task.vocab_nccl} if stage in (0, task.pp - 1) else set()
            before = StageMemory(persistent=0.0, transient=0.0, step_peak=0.0,
                                 layouts=frozenset(ends))
        layouts = set(before.layouts)
        received = 0.0
        if self.incoming is not None:  # this chunk's input layout (gpu_terms)
            layouts.add(task.tables.nccl_layouts[self.incoming])
            if task.v > 1:
                received = task.in_flight[k] * task.tables.hop_bytes(
                    self.incoming, task.spec.layer_order[start])
        return StageState(microbatch=emb.microbatch, optimizer=emb.optimizer,
                          exposed=emb.exposed_sync,
                          persistent=before.persistent + emb.persistent + received,
                          transient=max(before.transient, emb.transient),
                          step_peak=before.step_peak + emb.step_floor, last_class=-1,
                          last_type=-1, last_index=-1, layouts=frozenset(layouts),
                          backward=emb.backward)

    # ------------------------------------------------------------------ layers
    def _layer(self, k: int, start: int, length: int, offset: int, state: StageState,
               acc: np.ndarray) -> None:
        """Layer ``start + offset`` of chunk position ``k`` (the chunk holds ``length`` layers
        from ``start``): bound each candidate strategy, then search below those that can still
        beat the incumbent (in order of their bounds)."""
        self.best.nodes += 1
        self._check_deadline()
        cands = self._candidates(k, start, length, offset, state)
        alpha, beta, gamma = self._weights[k]
        bounds = np.where(cands.keep, self._bounds(k, start, length, offset, cands, acc),
                          math.inf)
        if cands.layers_left == 0 and k + 1 < min(self.task.chunks, TIED_DEPTH) \
                and self.task.tied_applies():
            self._tied(k, start + length, cands, acc, bounds)
        order = np.argsort(bounds, kind="stable")
        self._entered = True
        for i, pick in enumerate(order):
            if not bounds[pick] < self.threshold():
                self._prune(float(bounds[pick]))
                break
            self.chosen.append(cands.costs.strategies[pick])
            self._entered = False
            try:
                if cands.layers_left > 0:
                    self._next_layer(k, start, length, offset, state, cands, int(pick), acc)
                else:
                    done = acc + alpha * cands.microbatch[pick] + beta * cands.optimizer[pick] \
                        + gamma * cands.exposed[pick]
                    if k == self.task.chunks - 1:
                        self._leaf()
                    else:
                        self._next_chunk(k, start, length, state, cands, int(pick), done)
            except _Stopped:
                self._open(bounds, order, i)
                raise
            self.chosen.pop()

    def _candidates(self, k: int, start: int, length: int, offset: int,
                    state: StageState) -> Candidates:
        """The stage's sums with each candidate of layer ``start + offset``: its own costs, the
        moves into it (from the previous layer, the previous chunk or the embedding) and, after a
        chunk's last layer, out of it (into the head, or leaving its SP run before the hop)."""
        task, cur = self.task, self.cur  # cur: the stage's costs (mixed_offload)
        layer = start + offset
        layer_type = task.spec.layer_order[layer]
        costs = cur.costs(k, layer)
        classes = cur.classes(k, layer)
        # NCCL communicators grow with the set of layouts a stage uses (gpu_terms): the layouts
        # so far plus the candidate's give a floor for every plan below (0 where not modelled).
        limit = self.limit - task.nccl_with(task.stage_of(k), state.layouts, classes)
        left = length - offset - 1
        tables = cur.tables
        if offset > 0:
            moves = tables.relayout[layer_type][state.last_class, classes]
        elif self.incoming is not None:
            moves = tables.boundary[layer_type][self.incoming, classes]
        else:
            moves = cur.vocab_moves(layer_type)[0][classes]  # embedding -> first layer
        if left == 0 and k == task.chunks - 1:
            moves = moves + cur.vocab_moves(layer_type)[1][classes]  # last layer -> head
        elif left == 0:
            moves = moves + tables.sp_leave[layer_type][classes]  # SP run ends before the hop
        microbatch = state.microbatch + costs.microbatch + moves
        backward = state.backward + costs.backward + self._backward_moves(
            k, offset, left, layer_type, state, classes) if self.dominance is not None else None
        persistent = state.persistent + costs.persistent
        transient = np.maximum(state.transient, costs.transient)
        step_peak = state.step_peak + costs.step_floor
        # the memory cut: the bytes placed and the least the chunk's later layers add
        least_persistent, least_step = cur.least_prefix_bytes[k]
        after, end = layer + 1, layer + 1 + left  # the chunk's later layers: [after, end)
        keep = ((persistent + transient + least_persistent[end] - least_persistent[after]
                 <= limit)
                & (step_peak + least_step[end] - least_step[after] <= limit))
        host = state.host + costs.host
        if self.host_limit < math.inf:  # the host cut: offloaded bytes only grow
            keep &= host <= self.host_limit
        if offset > 0 and state.last_type == layer_type:  # symmetry: indices never decrease
            keep &= (classes != state.last_class) | (np.arange(len(costs)) >= state.last_index)
        return Candidates(costs=costs, classes=classes, layers_left=left, limit=limit,
                          microbatch=microbatch, backward=backward,
                          optimizer=state.optimizer + costs.optimizer,
                          exposed=state.exposed + costs.exposed_sync, persistent=persistent,
                          transient=transient, step_peak=step_peak, keep=keep, host=host)

    def _bounds(self, k: int, start: int, length: int, offset: int, cands: Candidates,
                acc: np.ndarray) -> np.ndarray:
        """A lower bound on every plan below each candidate (module docstring): the largest
        ``J_b`` and, for a plain pipeline, the bottleneck bound."""
        task = self.task
        layer = start + offset
        left = cands.layers_left
        alpha, beta, gamma = self._weights[k]
        share = (alpha[:, None] * cands.microbatch[None, :]
                 + beta[:, None] * cands.optimizer[None, :]
                 + gamma * cands.exposed[None, :])  # (branch, candidate)
        backward_room = cands.limit - cands.persistent - cands.transient
        step_room = cands.limit - cands.step_peak
        if left > 0:
            for rows, w in self._pairs[k]:
                share[rows] += self.cur.rest_bound(k, layer + 1, w, left, backward_room,
                                                   step_room, cands.transient)[None, :]
        future = self.futures[:, k + 1, start + length][:, None]
        bounds = (acc[:, None] + share + future).max(axis=0) + task.overhead
        if self.joint is None:
            return bounds
        # Bound 2: sum of stage times + tail_0 + (m - 1) x the largest stage time + the
        # largest step; the sum and the maximum over the later stages' same partition
        # (bottleneck.Bottleneck), the step on its own.
        placed = self.placed
        with_tail, alone = cands.microbatch + gamma * cands.exposed, cands.microbatch
        if left > 0:
            with_tail = with_tail + self.cur.rest_bound(
                k, layer + 1, Weights(1.0, 0.0, gamma), left, backward_room, step_room,
                cands.transient)
            alone = with_tail if not gamma else alone + self.cur.rest_bound(
                k, layer + 1, Weights(1.0, 0.0, 0.0), left, backward_room, step_room,
                cands.transient)
        return np.maximum(bounds, placed.sum_time_tail + with_tail
                          + np.maximum(placed.max_step, cands.optimizer) + task.overhead
                          + self.joint.g(k + 1, start + length,
                                         np.maximum(placed.max_time, alone)))

    def _tied(self, k: int, end: int, cands: Candidates, acc: np.ndarray,
              bounds: np.ndarray) -> None:
        """Raise ``bounds`` (in place) of the candidates closing chunk position ``k`` at layer
        ``end`` to the tied bound of the chunks after it (``tasks.Task.tied_rest``: each
        stage's chunks left share what is left of its memory)."""
        live = np.nonzero(bounds < self.threshold())[0]
        if not len(live):
            return
        stage = self.task.stage_of(k)
        placed: list[tuple] = [(m.persistent, m.transient, m.step_peak) if m is not None
                               else (0.0, 0.0, 0.0) for m in self.stage_memory]
        placed[stage] = (cands.persistent[live], cands.transient[live], cands.step_peak[live])
        alpha, beta, gamma = self._weights[k]
        done = (acc[:, None] + alpha[:, None] * cands.microbatch[live][None, :]
                + beta[:, None] * cands.optimizer[live][None, :]
                + gamma * cands.exposed[live][None, :])
        bounds[live] = np.maximum(bounds[live], self.task.tied_rest(k + 1, end, placed, done))

    def _next_layer(self, k: int, start: int, length: int, offset: int, state: StageState,
                    cands: Candidates, pick: int, acc: np.ndarray) -> None:
        """Place candidate ``pick`` and go on to the chunk's next layer, unless a partial stage
        already searched dominates it (dominance.py)."""
        cls = int(cands.classes[pick])
        layouts = state.layouts | {self.task.tables.nccl_layouts[cls]}
        backward = cands.backward
        if self.inner is not None and not self.inner.admit(
                (self.picks[-1] if self.picks else 0, length, offset + 1, cls, pick, layouts),
                np.array([cands.microbatch[pick], cands.optimizer[pick], cands.exposed[pick],
                          cands.microbatch[pick] - backward[pick] if backward is not None
                          else 0.0, cands.persistent[pick], cands.transient[pick],
                          cands.step_peak[pick], cands.host[pick]])):
            return
        self._layer(k, start, length, offset + 1, StageState(
            microbatch=float(cands.microbatch[pick]), optimizer=float(cands.optimizer[pick]),
            exposed=float(cands.exposed[pick]), persistent=float(cands.persistent[pick]),
            transient=float(cands.transient[pick]), step_peak=float(cands.step_peak[pick]),
            last_class=cls, last_type=self.task.spec.layer_order[start + offset],
            last_index=pick, layouts=layouts,
            backward=float(backward[pick]) if backward is not None else 0.0,
            host=float(cands.host[pick])), acc)

    def _next_chunk(self, k: int, start: int, length: int, state: StageState,
                    cands: Candidates, pick: int, done: np.ndarray) -> None:
        """Close chunk position ``k`` on candidate ``pick`` (its last layer) and search the next
        chunk, unless placed stages already searched dominate these (dominance.py)."""
        task = self.task
        placed = self.placed
        time = float(cands.microbatch[pick])
        step = float(cands.optimizer[pick])
        backward = cands.backward
        now = Placed(
            sum_time=placed.sum_time + time,
            sum_time_tail=placed.sum_time_tail + float(
                cands.microbatch[pick] + self._weights[k][2] * cands.exposed[pick]),
            max_time=max(placed.max_time, time),
            sum_backward=placed.sum_backward + (float(backward[pick]) if backward is not None
                                                else 0.0),
            exposed=max(placed.exposed, float(cands.exposed[pick]) - placed.sum_backward),
            max_step=max(placed.max_step, step))
        cls = int(cands.classes[pick])
        if self.dominance is not None and not self.dominance.admit(
                (k + 1, start + length, cls), now.dominance_state()):
            return
        stage = task.stage_of(k)
        saved_memory, saved_incoming = self.stage_memory[stage], self.incoming
        if task.v > 1:
            self.stage_memory[stage] = StageMemory(
                persistent=float(cands.persistent[pick]),
                transient=float(cands.transient[pick]), step_peak=float(cands.step_peak[pick]),
                layouts=state.layouts | {task.tables.nccl_layouts[cls]})
        self.incoming, self.placed = cls, now
        self._stage(k + 1, start + length, done)
        self.incoming, self.placed = saved_incoming, placed
        self.stage_memory[stage] = saved_memory

    def _backward_moves(self, k: int, offset: int, left: int, layer_type: int,
                        state: StageState, classes: np.ndarray) -> np.ndarray:
        """The backward part of the moves ``_candidates`` charges (the same moves: into the
        layer, and after the chunk's last layer into the head)."""
        task, cur = self.task, self.cur
        relayout, boundary = cur.tables.backward_moves
        if offset > 0:
            out = relayout[layer_type][state.last_class, classes]
        elif self.incoming is not None:
            out = boundary[layer_type][self.incoming, classes]
        else:
            out = cur.vocab_moves_backward(layer_type)[0][classes]
        if left == 0 and k == task.chunks - 1:
            out = out + cur.vocab_moves_backward(layer_type)[1][classes]
        return out

    def _leaf(self, fraction: FractionValue | None = None) -> bool:
        """Price the plan ``chosen``/``lengths`` (and ``picks``, or the ``fraction`` given:
        its optimizer offload) and keep it if it is the best that fits."""
        task = self.task
        if fraction is None:
            fraction = task.field(self.picks) if isinstance(task, MixedOffloadTask) \
                else task.rules.optimizer_offload
        self.best.leaves += 1
        plan = task_plan(task, self.lengths, self.chosen, fraction)
        est = evaluate_plan(plan, task.spec, self.training, task.cluster, task.profile,
                            task.budget, in_flight_memo=task.cache.in_flight)
        value = est.iteration_time_s / task.global_batch
        feasible = est.feasible and host_fits(est, task.rules)
        if feasible and value < self.best.value * (1 - TIE):
            self.best.value, self.best.plan, self.best.estimate = value, plan, est
        return feasible
