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
  (``evaluate_plan``'s two peaks), with the same per-layer terms.
- Symmetry: two adjacent layers of one type and one layout can swap strategies without changing
  any sum, maximum or transition, so within such a run strategy indices never decrease.
- Ties: a branch whose bound is within ``TIE`` of the best is cut (the answer is optimal to
  that relative precision, far below the cost model's).

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
- Seeds: the incumbent and, while there is none, the plain sibling task's seeds, each cut into
  ``v`` chunks per stage (``interleaving.interleaved_variant``); leaves are priced by
  ``evaluate_plan`` as for ``v = 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...plan import LayerStrategy, PipelineSpec, Plan
from ..cost.estimate import Estimate, evaluate_plan
from .dominance import StageDominance
from ..cost.gpu_terms import group_count
from ..cost.interleaving import interleaved_variant
from ..inputs.model_spec import TrainingSpec
from .seeds import seed_plans
from .tasks import Task, Weights

TIE = 1e-9
MEMORY_SLACK = 1e-9  # relative: our sums and evaluate_plan's may differ in the last bits


@dataclass
class Incumbent:
    """The best plan found so far across tasks; ``value`` is seconds per sample."""

    value: float = math.inf
    plan: Plan | None = None
    estimate: Estimate | None = None
    nodes: int = 0
    leaves: int = 0
    stopped: bool = False  # the deadline cut the search short: the answer is not proven
    # A comparison (a baseline space) stops at the deadline even without a plan; the answer's
    # search goes on until it has one (a task whose least-memory plan fits gives one at once).
    comparison: bool = False


class _Stopped(Exception):
    pass


@dataclass
class _StageState:
    """Exact running sums of the stage being built (evaluate_plan's terms)."""

    microbatch: float
    optimizer: float
    exposed: float
    persistent: float
    transient: float
    step_peak: float
    last_class: int
    last_type: int
    last_index: int
    layouts: frozenset = frozenset()  # layouts the stage's NCCL groups come from so far
    backward: float = 0.0  # the stage's backward part (stage dominance only)


class TaskSearch:
    """Branch and bound over the plans of one task (see the module docstring)."""

    def __init__(self, task: Task, training: TrainingSpec, incumbent: Incumbent,
                 deadline: float | None = None, partition: tuple[int, ...] | None = None
                 ) -> None:
        self.task, self.training, self.best = task, training, incumbent
        self.deadline = deadline  # on task.cache.clock (the search's CPU clock)
        self.clock = task.cache.clock
        self.partition = partition
        self.limit = task.budget * (1 + MEMORY_SLACK) - task.cluster.memory_reserve_bytes
        self.chosen: list[LayerStrategy] = []
        self.lengths: list[int] = []
        self.prev_last: tuple[int, int] | None = None  # (type, class) ending the last chunk
        # Interleaved: the memory a stage's earlier chunks placed (persistent, transient,
        # step peak, layouts), carried into its next chunk.
        self.stage_mem: list[tuple[float, float, float, frozenset] | None] = [None] * task.pp
        self._weights = [task.weight_arrays(k) for k in range(task.chunks)]
        self.joint = None
        self.dominance: StageDominance | None = None
        self.inner: StageDominance | None = None
        # Branches sharing the weights of position k (at most two kinds: bottleneck or not).
        self._pairs = []
        for k in range(task.chunks):
            alpha, beta, _ = self._weights[k]
            pairs = []
            for pair in sorted(set(zip(alpha.tolist(), beta.tolist()))):
                rows = (alpha == pair[0]) & (beta == pair[1])
                pairs.append((rows, task.weights(k, int(np.nonzero(rows)[0][0]))))
            self._pairs.append(pairs)

    @property
    def _least(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per stage position, prefix sums over layers of the least persistent and step-peak
        bytes: the memory cut needs them for the layers not yet placed (built on first use,
        shared by the task's searches)."""
        task = self.task
        if "_least_bytes" not in task.__dict__:
            order = np.asarray(task.spec.layer_order)
            out = {}
            for k in range(task.chunks):
                k_in = task.in_flight[k]
                types = range(len(task.spec.layer_types))
                per_p = np.array([task.tables.costs(t, k_in).persistent.min() for t in types])
                per_s = np.array([task.tables.costs(t, k_in).step_floor.min() for t in types])
                out[k] = (np.concatenate([[0.0], np.cumsum(per_p[order])]),
                          np.concatenate([[0.0], np.cumsum(per_s[order])]))
            task.__dict__["_least_bytes"] = out
        return task.__dict__["_least_bytes"]

    def threshold(self) -> float:
        """Iteration time a plan of this task must beat (inf before the first plan)."""
        return self.best.value * self.task.global_batch * (1 - TIE)

    def seed(self) -> bool:
        """Price the heuristic plans of ``seed.seed_plans`` (the pinned partition, if any):
        incumbents found fast, so that bounds prune from the start; the answer is still the
        search's. True if one of them fits the budget. Interleaved tasks take the incumbent
        and (while there is none) the seeds of their non-interleaved sibling, each cut into
        ``v`` chunks per stage (``interleaving.interleaved_variant``)."""
        self.task.on_new_table = self._check_deadline
        fits = False
        task = self.task
        try:
            if task.v == 1:
                plans = seed_plans(task, self.partition)
            else:
                plans = [self.best.plan] if self.best.plan is not None else []
                if self.best.plan is None:
                    plans += seed_plans(task.sibling(), None)
                plans = [interleaved_variant(p, task.v) for p in plans
                         if (p.pp_size, p.num_microbatches, p.vocab, p.global_batch_size)
                         == (task.pp, task.m, task.vocab, task.global_batch)]
                plans = [p for p in plans if p is not None and (
                    self.partition is None
                    or tuple(p.pipeline.layers_per_stage) == tuple(self.partition))]
            for plan in plans:
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
        fits = self._leaf()
        self.chosen, self.lengths = [], []
        return fits

    def _check_deadline(self) -> None:
        if self.deadline is not None and (self.best.plan is not None or self.best.comparison) \
                and self.clock() > self.deadline:
            raise _Stopped

    def run(self) -> None:
        """Search the task; the incumbent is updated in place (``stopped`` if cut short)."""
        self.known = (0.0, 0.0, 0.0)  # completed stages: sum C + tail_0, max C, max step
        # completed stages for the dominance rule: sum C, max C, sum B, E, max step
        self.prefix = (0.0, 0.0, 0.0, -math.inf, 0.0)
        self.dominance = StageDominance() if self.task.v == 1 and self.task.pp > 1 else None
        task = self.task
        if task.v == 1 and (self.partition is not None or task.pp == 1):
            if all(len(task.costs(k, i)) == 1 for k in range(task.pp)
                   for i in range(task.num_layers)):
                # One strategy per layer and one partition: the task has one plan.
                part = self.partition or (task.num_layers,)
                layers = []
                for k, length in enumerate(part):
                    start = sum(part[:k])
                    layers += [task.costs(k, i).strategies[0] for i in range(start,
                                                                              start + length)]
                self.chosen, self.lengths = layers, list(part)
                self._leaf()
                self.chosen, self.lengths = [], []
                return
        if self.best.plan is None or task.v > 1:
            self.seed()
        self.task.on_new_table = self._check_deadline  # DP tables are the slow part
        try:
            if self.task.root_bound() >= self.threshold():
                return
            self.futures = np.stack([self.task.future(b) for b in self.task.branches])
            # bound 2 (the Alpa form) is for v = 1; interleaved tasks prune with J_b alone
            self.joint = self.task.bottleneck() if self.task.pp > 1 and task.v == 1 else None
            self._stage(0, 0, np.zeros(len(self.task.branches)))
        except _Stopped:
            self.best.stopped = True
        finally:
            self.task.on_new_table = None

    # ------------------------------------------------------------------ stages
    def _stage(self, k: int, start: int, acc: np.ndarray) -> None:
        """Chunk position ``k`` (a stage unless interleaved) from layer ``start``."""
        task = self.task
        L, pp = task.num_layers, task.chunks
        left = L - start - (pp - 1 - k)  # the longest this chunk can be
        if self.partition is not None:
            lengths = [self.partition[k]] if self.partition[k] <= left else []
        else:
            lengths = list(range(1, min(left, task.max_len) + 1))
        if k == pp - 1:
            lengths = [L - start] if L - start in lengths else []
        if not lengths:
            return
        rows = np.stack([task.stage_bound(k, start, b) for b in task.branches])  # (br, len)
        lens = np.array(lengths)
        bounds = (acc[:, None] + rows[:, lens - 1]
                  + self.futures[:, k + 1, start + lens]).max(axis=0) + task.overhead
        if self.joint is not None:
            known_sum, known_max, known_step = self.known
            c_tail = task.time_row(k, start, k == 0)[lens - 1]
            c_only = task.time_row(k, start, False)[lens - 1]
            bounds = np.maximum(bounds, known_sum + c_tail + known_step + task.overhead
                                + self.joint.g(k + 1, start + lens,
                                               np.maximum(known_max, c_only)))
        outer = self.inner
        # partial stages of this call (same earlier stages, same start): dominance.py
        self.inner = StageDominance() if task.v == 1 else None
        for j in np.argsort(bounds, kind="stable"):
            if bounds[j] >= self.threshold() or not np.isfinite(bounds[j]):
                break
            length = int(lens[j])
            e = task.emb[k]
            stage = task.stage_of(k)
            prev = self.stage_mem[stage]
            if prev is None:  # the stage's first chunk
                layouts = {(task.vocab.tp, True)} if stage in (0, task.pp - 1) else set()
                prev = (0.0, 0.0, 0.0, frozenset(layouts))
            layouts = set(prev[3])
            if self.prev_last is not None:  # this chunk's input layout (gpu_terms)
                lay = task.tables.layouts[self.prev_last[1]][0]
                layouts.add((lay.tp, lay.consecutive))
            state = _StageState(e.microbatch, e.optimizer, e.exposed_sync,
                                prev[0] + e.persistent, max(prev[1], e.transient),
                                prev[2] + e.step_floor, -1, -1, -1, frozenset(layouts),
                                e.backward)
            self.lengths.append(length)
            self._layer(k, start, length, 0, state, acc)
            self.lengths.pop()
        self.inner = outer

    # ------------------------------------------------------------------ layers
    def _layer(self, k: int, start: int, length: int, j: int, st: _StageState,
               acc: np.ndarray) -> None:
        task = self.task
        self.best.nodes += 1
        self._check_deadline()
        i = start + j
        t = task.spec.layer_order[i]
        c = task.costs(k, i)
        cls = task.classes(k, i)
        # NCCL communicators grow with the set of layouts a stage uses (gpu_terms): the layouts
        # so far plus the candidate's give a floor for every plan below (0 where not modelled).
        limit = self.limit - self._nccl(task.stage_of(k), st.layouts, cls)
        r = length - j - 1  # layers of this chunk still to place
        if j > 0:
            trans = task.relayout[t][st.last_class, cls]
        elif self.prev_last is not None:
            trans = task.boundary[t][self.prev_last[1], cls]
        else:
            trans = task.vocab_moves(t)[0][cls]  # embedding -> first layer
        if r == 0 and k == task.chunks - 1:
            trans = trans + task.vocab_moves(t)[1][cls]  # last layer -> head
        elif r == 0:
            trans = trans + task.sp_leave[t][cls]  # a stage's SP run ends before the hop
        micro = st.microbatch + c.microbatch + trans
        bwd = st.backward + c.backward + self._backward_moves(k, j, r, t, st, cls) \
            if self.dominance is not None else None
        opt = st.optimizer + c.optimizer
        exp = st.exposed + c.exposed_sync
        pers = st.persistent + c.persistent
        trans_max = np.maximum(st.transient, c.transient)
        step = st.step_peak + c.step_floor
        least_p, least_s = self._least[k]
        ok = ((pers + trans_max + least_p[i + 1 + r] - least_p[i + 1] <= limit)
              & (step + least_s[i + 1 + r] - least_s[i + 1] <= limit))
        if j > 0 and st.last_type == t:
            ok &= (cls != st.last_class) | (np.arange(len(c)) >= st.last_index)
        alpha, beta, gamma = self._weights[k]
        share = (alpha[:, None] * micro[None, :] + beta[:, None] * opt[None, :]
                 + gamma * exp[None, :])  # (branch, s)
        if r > 0:
            backward = limit - pers - trans_max
            steps = limit - step
            for rows, w in self._pairs[k]:
                share[rows] += task.rest_bound(k, i + 1, w, r, backward, steps,
                                               trans_max)[None, :]
        future = self.futures[:, k + 1, start + length][:, None]
        bounds = (acc[:, None] + share + future).max(axis=0) + task.overhead
        if self.joint is not None:
            # Bound 2: sum of stage times + tail_0 + (m - 1) x the largest stage time + the
            # largest step; the sum and the maximum over the later stages' same partition
            # (bottleneck.Bottleneck), the step on its own.
            known_sum, known_max, known_step = self.known
            end = start + length
            c_tail, c_only = micro + gamma * exp, micro
            if r > 0:
                backward = limit - pers - trans_max
                steps = limit - step
                c_tail = c_tail + task.rest_bound(k, i + 1, Weights(1.0, 0.0, gamma), r,
                                                  backward, steps, trans_max)
                c_only = c_tail if not gamma else c_only + task.rest_bound(
                    k, i + 1, Weights(1.0, 0.0, 0.0), r, backward, steps, trans_max)
            bounds = np.maximum(bounds, known_sum + c_tail + np.maximum(known_step, opt)
                                + task.overhead
                                + self.joint.g(k + 1, end, np.maximum(known_max, c_only)))
        bounds = np.where(ok, bounds, math.inf)
        for s in np.argsort(bounds, kind="stable"):
            if not bounds[s] < self.threshold():
                break
            self.chosen.append(c.strategies[s])
            if r > 0:
                lay = task.tables.layouts[int(cls[s])][0]
                layouts = st.layouts | {(lay.tp, lay.consecutive)}
                if self.inner is not None and not self.inner.admit(
                        (length, j + 1, int(cls[s]), int(s), layouts),
                        np.array([micro[s], opt[s], exp[s],
                                  micro[s] - bwd[s] if bwd is not None else 0.0,
                                  pers[s], trans_max[s], step[s]])):
                    self.chosen.pop()
                    continue
                nxt = _StageState(float(micro[s]), float(opt[s]), float(exp[s]), float(pers[s]),
                                  float(trans_max[s]), float(step[s]), int(cls[s]), t, int(s),
                                  st.layouts | {(lay.tp, lay.consecutive)},
                                  float(bwd[s]) if bwd is not None else 0.0)
                self._layer(k, start, length, j + 1, nxt, acc)
            else:
                done = acc + alpha * micro[s] + beta * opt[s] + gamma * exp[s]
                if k == task.chunks - 1:
                    self._leaf()
                else:
                    prefix = self.prefix
                    if self.dominance is not None:
                        sum_c, max_c, sum_b, exposed, max_step = prefix
                        tail = float(exp[s])
                        self.prefix = (sum_c + float(micro[s]), max(max_c, float(micro[s])),
                                       sum_b + float(bwd[s]), max(exposed, tail - sum_b),
                                       max(max_step, float(opt[s])))
                        if not self.dominance.admit((k + 1, start + length, int(cls[s])),
                                                    StageDominance.state(*self.prefix)):
                            self.prefix = prefix
                            self.chosen.pop()
                            continue
                    saved, known = self.prev_last, self.known
                    stage = task.stage_of(k)
                    saved_mem = self.stage_mem[stage]
                    if task.v > 1:
                        lay = task.tables.layouts[int(cls[s])][0]
                        self.stage_mem[stage] = (float(pers[s]), float(trans_max[s]),
                                                 float(step[s]),
                                                 st.layouts | {(lay.tp, lay.consecutive)})
                    self.prev_last = (t, int(cls[s]))
                    self.known = (known[0] + float(micro[s] + gamma * exp[s]),
                                  max(known[1], float(micro[s])), max(known[2], float(opt[s])))
                    self._stage(k + 1, start + length, done)
                    self.prev_last, self.known, self.prefix = saved, known, prefix
                    self.stage_mem[stage] = saved_mem
            self.chosen.pop()

    def _backward_moves(self, k: int, j: int, r: int, t: int, st: _StageState,
                        cls: np.ndarray) -> np.ndarray:
        """The backward part of the moves ``_layer`` charges to the candidates (the same moves:
        into the layer, and after the stage's last layer into the head)."""
        task = self.task
        relayout, boundary = task.tables.backward_moves
        if j > 0:
            out = relayout[t][st.last_class, cls]
        elif self.prev_last is not None:
            out = boundary[t][self.prev_last[1], cls]
        else:
            out = task.vocab_moves_backward(t)[0][cls]
        if r == 0 and k == task.chunks - 1:
            out = out + task.vocab_moves_backward(t)[1][cls]
        return out

    def _nccl(self, k: int, layouts: frozenset, cls: np.ndarray) -> np.ndarray | float:
        """NCCL bytes of stage ``k`` holding ``layouts`` and each candidate's layout."""
        task = self.task
        per = float(getattr(task.cluster, "nccl_communicator_bytes", 0.0))
        if per <= 0:
            return 0.0
        cache = self.__dict__.setdefault("_nccl_cache", {})
        out = np.empty(len(cls))
        for c in set(cls.tolist()):  # not np.unique: it imports numpy.ma (start-up time)
            key = (k, layouts, int(c))
            if key not in cache:
                lay = task.tables.layouts[int(c)][0]
                cache[key] = per * group_count(task.n, task.pp, task.world_size, k, 0,
                                               layouts | {(lay.tp, lay.consecutive)})
            out[cls == c] = cache[key]
        return out

    def _leaf(self) -> bool:
        task = self.task
        self.best.leaves += 1
        plan = Plan(world_size=task.world_size, global_batch_size=task.global_batch,
                    num_microbatches=task.m,
                    pipeline=PipelineSpec(size=task.pp, schedule=task.schedule,
                                          layers_per_stage=tuple(self.lengths),
                                          virtual_size=task.v),
                    vocab=task.vocab, layers=tuple(self.chosen),
                    model=task.spec.plan_model_record())
        est = evaluate_plan(plan, task.spec, self.training, task.cluster, task.profile,
                            task.budget, in_flight_memo=task.cache.in_flight)
        value = est.iteration_time_s / task.global_batch
        if est.feasible and value < self.best.value * (1 - TIE):
            self.best.value, self.best.plan, self.best.estimate = value, plan, est
        return est.feasible
