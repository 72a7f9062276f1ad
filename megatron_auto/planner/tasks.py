"""One search task: a fixed (global batch, pp, micro-batch count, schedule) and its cost tables.

A task turns the cost model into the DP's inputs (per layer type: memory cells, objective, class
of every strategy), runs the per-stage DP lazily (one run per layer-type window, micro-batches in
flight and transient level), and answers "what does stage ``k`` cost if it holds ``L`` layers
from ``start``?" as arrays over ``L`` for the partition code.

Objective of a layer in the DP: ``m * (forward + backward) + exposed_sync + optimizer`` seconds
per iteration; of a transition between classes (a layout and whether the layer runs
sequence parallelism): ``m * (relayout + SP boundaries)``. The DP also carries the
exposed sync, the backward time and the optimizer step along its optimum so the partition can be scored with the pipeline model.

Transient memory (only the running layer's) enters as a *level* ``tau``: the DP for level ``tau``
allows strategies whose transient is at most ``tau`` and reserves ``max(tau, head transient)``
cells; the stage's answer is the best level. Levels are the distinct transient sizes, merged
upward (conservatively) when there are more than ``max_levels``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..plan import LayerStrategy
from .cost_memory import MemoryCost, embedding_memory, layer_memory
from .cost_model import in_flight, sp_reduced_tensor_bytes, step_overhead
from .cost_time import (TimeCost, embedding_time, layer_time, pipeline_time, relayout_time,
                        sequence_parallel_switch_time)
from .dp import LayerOptions, StageTables, solve_stage
from .gpu_terms import search_model_budget
from .model_spec import ModelSpec
from .profiles import ModelProfile
from .strategies import Layout, SpaceRules, layer_strategies, layout_of

INF = math.inf
EXACT_IN_FLIGHT = 8
IN_FLIGHT_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192,
                  256, 320, 384, 512, 640, 768, 1024, 1 << 62)


def _envelope(x: np.ndarray, y: np.ndarray, cap: float) -> float:
    """Least ``y`` a convex combination of the points ``(x, y)`` reaches with ``x <= cap``."""
    best = INF
    fit = x <= cap
    if fit.any():
        best = float(y[fit].min())
    for i in np.nonzero(fit)[0]:
        for j in np.nonzero(~fit)[0]:  # mix a fitting point with a bigger, faster one
            if y[j] < y[i]:
                w = (cap - x[i]) / (x[j] - x[i])
                best = min(best, float(y[i] + w * (y[j] - y[i])))
    return best


def cells_up(nbytes: float, step: int) -> int:
    """Memory cells needed for ``nbytes`` (rounded UP so plans never exceed the budget)."""
    return int(math.ceil(nbytes / step - 1e-12)) if nbytes > 0 else 0


@dataclass(frozen=True)
class VocabOption:
    tp: int
    dp_mode: str


@dataclass
class StageRow:
    """Per stage length ``L = 1..len``: the objective (seconds per iteration) and the transient
    level that won (-1 when infeasible)."""

    value: np.ndarray
    level: np.ndarray


class Task:
    """Cost tables of one (B, pp, m, schedule) for one search space."""

    def __init__(self, spec: ModelSpec, profile: ModelProfile, cluster: Any, world_size: int,
                 global_batch: int, pp: int, m: int, schedule: str, rules: SpaceRules,
                 budget_bytes: float, step: int, max_levels: int, max_len: int) -> None:
        self.spec, self.profile, self.cluster = spec, profile, cluster
        self.rules, self.budget_bytes, self.max_levels = rules, budget_bytes, max_levels
        self.world_size = world_size
        self.pp, self.m, self.schedule, self.global_batch = pp, m, schedule, global_batch
        self.n = world_size // pp
        self.b_m = global_batch // m
        self.step = step
        self.max_len = min(max_len, spec.num_layers)
        self._in_flight = self._in_flight_counts()
        # reserve, NCCL and fragmentation (GPU terms; 0 on CPU clusters) come off the budget
        self.cells = int(search_model_budget(cluster, budget_bytes, self.n, pp) // step)
        n = self.n
        self.strategies: list[list[LayerStrategy]] = []
        self.mem: list[list[MemoryCost]] = []
        self.time: list[list[TimeCost]] = []
        for t, lt in enumerate(spec.layer_types):
            lp = profile.layer_types[lt.name]
            strategies = layer_strategies(lt, n, self.b_m, rules, cluster.devices_per_node)
            self.strategies.append(strategies)
            # any layer of this type stands for its norm/bias sizes
            norms = sp_reduced_tensor_bytes(spec, spec.layer_order.index(t)) \
                if t in spec.layer_order else ()
            self.mem.append([layer_memory(lp, s.tp, n // s.tp, s.dp_mode, s.recompute,
                                          self.b_m / (n // s.tp),
                                          first_backward_peak=schedule == "gpipe",
                                          sequence_parallel=s.sequence_parallel)
                             for s in strategies])
            self.time.append([layer_time(lp, cluster, layout_of(s, n), s.dp_mode, s.recompute,
                                         self.b_m / (n // s.tp), n, profile.precision,
                                         sequence_parallel=s.sequence_parallel,
                                         norm_grad_bytes=norms if s.sequence_parallel else ())
                              for s in strategies])
        self.ok = all(self.strategies)
        # DP classes: a layout and whether the layer runs SP (transitions depend on both)
        self.layouts: list[tuple[Layout, bool]] = sorted({self.class_of(s) for group in
                                                          self.strategies for s in group})
        self.cls = [np.array([self.layouts.index(self.class_of(s)) for s in group],
                             dtype=np.int64) for group in self.strategies]
        hidden = max(profile.layer_types[t.name].moved_bytes_per_sample for t in spec.layer_types)
        # what an SP boundary gathers: the hidden state alone
        sp_hidden = max(profile.layer_types[t.name].hidden_bytes_per_sample
                        for t in spec.layer_types)
        c = len(self.layouts)
        self.transition = np.zeros((c, c))
        for i, (a, a_sp) in enumerate(self.layouts):
            for j, (b, b_sp) in enumerate(self.layouts):
                if i != j:
                    self.transition[i, j] = m * (
                        relayout_time(cluster, a, b, self.b_m, hidden, n)
                        + sequence_parallel_switch_time(cluster, a, a_sp, b, b_sp, self.b_m,
                                                        sp_hidden, n))
        # penalty[a, b]: most a layer of class a can pay in transitions beyond one of class b
        # (into it from any predecessor, out of it to any successor; never negative).
        tr = self.transition
        self.penalty = np.zeros((c, c))
        for a in range(c):
            for b in range(c):
                self.penalty[a, b] = max(0.0, (tr[:, a] - tr[:, b]).max()) + \
                    max(0.0, (tr[a, :] - tr[b, :]).max())
        self.cost = [np.array([m * t.microbatch + t.exposed_sync + t.optimizer for t in group])
                     for group in self.time]
        self.aux = [np.array([[t.exposed_sync, t.backward, t.optimizer] for t in group])
                    .reshape(-1, 3) for group in self.time]
        self.trans_cells = [np.array([cells_up(x.transient, step) for x in group], dtype=np.int64)
                            for group in self.mem]
        levels = self._candidate_levels()
        if len(levels) > max_levels:
            # Too many: keep evenly spaced ones (always the largest); a strategy then counts at
            # the next level up, a conservative rounding.
            picks = np.unique(np.round(np.linspace(0, len(levels) - 1, max_levels)).astype(int))
            levels = [levels[i] for i in picks]
        self.levels = levels
        self._tables: dict[tuple, tuple[StageTables, list[np.ndarray]] | None] = {}
        self._rows: dict[tuple, Any] = {}
        self._opts: dict[tuple, tuple[LayerOptions, np.ndarray]] = {}
        self._least: dict[tuple, float] = {}
        self._details: dict[tuple, tuple[float, float, float] | None] = {}
        self._vocab: dict[tuple, tuple[MemoryCost, TimeCost]] = {}
        # Lower bound on the iteration time of any plan of this task (memory ignored).
        self.lower_bound = self._lower_bound()

    def class_of(self, strategy: LayerStrategy) -> tuple[Layout, bool]:
        """The DP class of a strategy: its layout and whether it runs sequence parallelism."""
        return layout_of(strategy, self.n), strategy.sequence_parallel and strategy.tp > 1

    def _candidate_levels(self) -> list[int]:
        """Transient levels that can matter: the transient of every strategy that no strategy
        with a smaller-or-equal transient dominates (memory at 1 and at the most micro-batches
        in flight, time with the transition penalty). Other strategies never need their own
        level, so dropping those levels is exact."""
        out: set[int] = set()
        k_max = self.in_flight(0)
        for t, group in enumerate(self.mem):
            lo = np.array([cells_up(x.persistent_bound(1), self.step) for x in group])
            hi = np.array([cells_up(x.persistent_bound(k_max), self.step) for x in group])
            trans, cost, cls = self.trans_cells[t], self.cost[t], self.cls[t]
            for i in range(len(group)):
                dominated = any(
                    trans[j] <= trans[i] and lo[j] <= lo[i] and hi[j] <= hi[i]
                    and cost[j] + self.penalty[cls[j], cls[i]] <= cost[i]
                    and (trans[j] < trans[i] or lo[j] < lo[i] or hi[j] < hi[i]
                         or cost[j] + self.penalty[cls[j], cls[i]] < cost[i] or j < i)
                    for j in range(len(group)) if j != i)
                if not dominated:
                    out.add(int(trans[i]))
        return sorted(out)

    def release(self) -> None:
        """Drop the cached DP tables (they are rebuilt on demand)."""
        self._tables.clear()

    # ------------------------------------------------------------------ helpers
    def in_flight(self, k: int) -> int:
        """Micro-batches stage ``k`` is costed for. With more than ``EXACT_IN_FLIGHT`` stages the
        count is rounded UP to the next value of ``IN_FLIGHT_GRID`` (conservative: more memory
        reserved, never less) so that deep pipelines need a few DP runs instead of one per
        stage; the first stage (usually the binding one) keeps its exact count."""
        return self._in_flight[k]

    def _in_flight_counts(self) -> list[int]:
        first = in_flight(self.schedule, self.pp, 0, self.m)
        out = []
        for k in range(self.pp):
            k_in = in_flight(self.schedule, self.pp, k, self.m)
            if self.pp > EXACT_IN_FLIGHT and k > 0:
                k_in = min(next(g for g in IN_FLIGHT_GRID if g >= k_in), first)
            out.append(k_in)
        return out

    def _lower_bound(self) -> float:
        """A lower bound on the iteration time of every plan of this task (memory included).

        Per layer the points (persistent memory at one micro-batch in flight, time per
        micro-batch) of its strategies; ``g(x)`` = the lower convex envelope at memory ``x``
        (an LP relaxation of choosing strategies). A stage of ``L_k`` layers within ``cap``
        cells takes at least ``L_k * g(cap / L_k)``; that is convex in ``L_k``, so the stages
        together take at least ``L * g(pp * cap / L)``; the pipeline at least
        ``(m + pp - 1) / pp`` times that. With one stage the iteration is exactly
        ``m C + tail``, so each point's time also carries its exposed sync divided by ``m``.
        Transitions, the embedding and (with several stages) tails only add.
        """
        total = 0.0
        per_layer_cap = self.pp * (self.cells - min(
            (int(t.min()) for t in self.trans_cells if len(t)), default=0)) / self.spec.num_layers
        for t, group in enumerate(self.mem):
            if not group:
                return INF
            x = np.array([cells_up(g.persistent_bound(1), self.step) for g in group], dtype=float)
            y = np.array([tc.microbatch + ((tc.exposed_sync + tc.optimizer) / self.m
                                           if self.pp == 1 else 0.0) for tc in self.time[t]])
            count = sum(1 for o in self.spec.layer_order if o == t)
            total += count * _envelope(x, y, per_layer_cap)
        return (self.m + self.pp - 1) / self.pp * (total + self._least_vocab_time())

    def _least_vocab_time(self) -> float:
        """Least embedding + head time per micro-batch over every vocab layout (a bound)."""
        best = INF
        tp = 1
        while tp <= self.n:
            if self.spec.vocab_size % tp == 0 and self.b_m % (self.n // tp) == 0:
                option = VocabOption(tp, "ddp")
                if self.pp == 1:
                    t = self.vocab(0, option)[1].microbatch
                else:
                    t = (self.vocab(0, option)[1].microbatch
                         + self.vocab(self.pp - 1, option)[1].microbatch)
                best = min(best, t)
            tp *= 2
        return 0.0 if best == INF else best

    def vocab(self, k: int, option: VocabOption) -> tuple[MemoryCost, TimeCost] | None:
        first, last = k == 0, k == self.pp - 1
        if not (first or last):
            return None
        key = (first, last, option)
        if key not in self._vocab:
            dp = self.n // option.tp
            samples = self.b_m / dp
            self._vocab[key] = (
                embedding_memory(self.profile.embedding, option.tp, dp, option.dp_mode, samples,
                                 first, last, self.pp,
                                 first_backward_peak=self.schedule == "gpipe"),
                embedding_time(self.profile.embedding, self.cluster, option.tp, option.dp_mode,
                               samples, self.n, first, last, self.pp, self.spec.seq_length,
                               self.profile.precision))
        return self._vocab[key]

    def _window(self, start: int) -> tuple[int, ...]:
        order = self.spec.layer_order
        if len(self.spec.layer_types) == 1:
            return tuple(order[:self.max_len])
        return tuple(order[start:start + self.max_len])

    def _options(self, t: int, k_in: int, level: int) -> tuple[LayerOptions, np.ndarray]:
        """DP options of type ``t`` at ``k_in`` micro-batches in flight and transient level."""
        key = (t, k_in, level)
        if key in self._opts:
            return self._opts[key]
        persist = np.array([cells_up(x.persistent_bound(k_in), self.step) for x in self.mem[t]],
                           dtype=np.int64)
        allowed = np.nonzero(self.trans_cells[t] <= level)[0]
        cost, cls = self.cost[t], self.cls[t]
        keep = []
        for i in allowed:
            # j dominates i when it needs no more memory and is no slower even after paying the
            # worst transition difference into and out of its class (exact: rule 5).
            dominated = any(
                persist[j] <= persist[i]
                and cost[j] + self.penalty[cls[j], cls[i]] <= cost[i]
                and (persist[j] < persist[i] or cost[j] + self.penalty[cls[j], cls[i]] < cost[i]
                     or j < i)
                for j in allowed if j != i)
            if not dominated:
                keep.append(i)
        ids = np.array(keep, dtype=np.int64)
        if len(ids) == 0:  # nothing fits this level: one impossible option keeps shapes valid
            out = (LayerOptions(mem=np.array([self.cells + 1]), cost=np.array([INF]),
                                aux=np.zeros((1, 0)), cls=np.array([0])), np.array([-1]))
        else:
            out = (LayerOptions(mem=persist[ids], cost=cost[ids], aux=np.zeros((len(ids), 0)),
                                cls=cls[ids]), ids)
        self._opts[key] = out
        return out

    def useful_levels(self, window: tuple[int, ...], k_in: int) -> list[int]:
        """Indices of the transient levels worth a DP: a level whose surviving options equal the
        previous level's only reserves more memory for the same plans, so it is skipped."""
        out, previous = [], None
        for j, level in enumerate(self.levels):
            current = tuple(tuple(self._options(t, k_in, level)[1]) for t in sorted(set(window)))
            if current != previous:
                out.append(j)
            previous = current
        return out

    def tables(self, start: int, k_in: int,
               level: int) -> tuple[StageTables, list[np.ndarray]] | None:
        """DP tables of the window at ``start``, cut after the last length whose least memory
        still fits the largest cap of any stage at this level (longer prefixes are infeasible
        whatever the strategies); None when not even one layer fits."""
        window = self._window(start)
        key = (window, k_in, level)
        if key not in self._tables:
            least = np.cumsum([self._least_cells(t, k_in, level) for t in window]) + level
            fits = int(np.searchsorted(least, self.cells, side="right"))
            if fits == 0:
                self._tables[key] = None
            else:
                window = window[:fits]
                opts = {t: self._options(t, k_in, level) for t in set(window)}
                layers = [opts[t][0] for t in window]
                ids = [opts[t][1] for t in window]
                self._tables[key] = (solve_stage(layers, self.transition, max(self.cells, 0)),
                                     ids)
        return self._tables[key]

    # ------------------------------------------------------------------ rows
    def row(self, k: int, start: int, option: VocabOption) -> StageRow:
        """Stage ``k`` starting at ``start``: DP objective for every length (vectorised), plus
        the embedding/head and incoming p2p terms; ``level`` says which transient level won."""
        k_in = self.in_flight(k)
        first, last = k == 0, k == self.pp - 1
        single = len(self.spec.layer_types) == 1
        key = (k_in, first, last, option if (first or last) else None, None if single else start)
        if key in self._rows:
            return self._rows[key]
        n_len = len(self._window(start)) if single else min(len(self._window(start)),
                                                            self.spec.num_layers - start)
        value = np.full(n_len, INF)
        level_won = np.full(n_len, -1)
        voc = self.vocab(k, option)
        other, head = self._vocab_cells(k, option)
        for j in self.useful_levels(self._window(start), k_in):
            level = self.levels[j]
            cap = self.cells - other - max(level, head)
            if cap < 0:
                continue
            found = self.tables(start, k_in, level)
            if found is None:
                continue
            tab = found[0]
            vals = np.full(n_len, INF)
            got = tab.best[:n_len, min(cap, tab.max_cells)]
            vals[:len(got)] = got
            better = vals < value
            value = np.where(better, vals, value)
            level_won = np.where(better, j, level_won)
        if voc:
            value = value + self.m * voc[1].microbatch + voc[1].exposed_sync + voc[1].optimizer
        result = StageRow(value, level_won)
        self._rows[key] = result
        return result

    def _vocab_cells(self, k: int, option: VocabOption) -> tuple[int, int]:
        """(persistent, transient) cells of the embedding/head on stage ``k`` (0 in between)."""
        voc = self.vocab(k, option)
        if not voc:
            return 0, 0
        return (cells_up(voc[0].persistent_bound(self.in_flight(k)), self.step),
                cells_up(voc[0].transient, self.step))

    def detail(self, k: int, start: int, length: int,
               option: VocabOption) -> tuple[float, float, float, float, LayerStrategy,
                                             LayerStrategy] | None:
        """``(objective, sync tail, backward per micro-batch, optimizer step, first strategy,
        last strategy)`` of
        a stage's optimum, summed along its back-tracked strategies (the DP carries only the
        objective, for speed)."""
        key = (k, start, length, option)
        if key in self._details:
            return self._details[key]
        picks = self._picks(k, start, length, option)
        out = None
        if picks is not None:
            window = self._window(start)
            tail = sum(self.aux[window[i]][s, 0] for i, s in enumerate(picks))
            bwd = sum(self.aux[window[i]][s, 1] for i, s in enumerate(picks))
            opt = sum(self.aux[window[i]][s, 2] for i, s in enumerate(picks))
            voc = self.vocab(k, option)
            if voc:
                tail += voc[1].exposed_sync
                bwd += voc[1].backward
                opt += voc[1].optimizer
            out = (float(self.row(k, start, option).value[length - 1]), tail, bwd, opt,
                   self.strategies[window[0]][picks[0]],
                   self.strategies[window[len(picks) - 1]][picks[-1]])
        self._details[key] = out
        return out

    def boundary_time(self, sender: LayerStrategy, receiver: LayerStrategy) -> float:
        """Forward + backward seconds of one micro-batch crossing a stage boundary: the p2p hop
        of each rank's slice both ways, then the relayout into the receiver's layout."""
        hidden = max(self.profile.layer_types[t.name].moved_bytes_per_sample
                     for t in self.spec.layer_types)
        slice_bytes = self.b_m / (self.n // sender.tp) * hidden
        sp_hidden = max(self.profile.layer_types[t.name].hidden_bytes_per_sample
                        for t in self.spec.layer_types)
        (old, old_sp), (new, new_sp) = self.class_of(sender), self.class_of(receiver)
        # SP: the sender gathers the sequence before it sends, the receiver enters its run
        return (2 * self.cluster.p2p_time(slice_bytes, self.pp)
                + relayout_time(self.cluster, old, new, self.b_m, hidden, self.n)
                + sequence_parallel_switch_time(self.cluster, old, old_sp, old, False, self.b_m,
                                                sp_hidden, self.n)
                + sequence_parallel_switch_time(self.cluster, new, False, new, new_sp, self.b_m,
                                                sp_hidden, self.n))

    def _picks(self, k: int, start: int, length: int, option: VocabOption) -> list[int] | None:
        """Indices into each layer type's strategy list of the stage optimum."""
        r = self.row(k, start, option)
        if length > len(r.value):
            return None
        j = int(r.level[length - 1])
        if j < 0:
            return None
        level = self.levels[j]
        other, head = self._vocab_cells(k, option)
        found = self.tables(start, self.in_flight(k), level)
        if found is None or length > found[0].best.shape[0]:
            return None
        tab, ids = found
        picks = tab.choices(length, self.cells - other - max(level, head))
        if picks is None:
            return None
        return [int(ids[i][p]) for i, p in enumerate(picks)]

    def memory_row(self, k: int, start: int, option: VocabOption) -> np.ndarray:
        """Least memory cells stage ``k`` from ``start`` can have, per length (inf: never fits)."""
        k_in = self.in_flight(k)
        first, last = k == 0, k == self.pp - 1
        single = len(self.spec.layer_types) == 1
        key = ("mem", k_in, first, last, option if (first or last) else None,
               None if single else start)
        if key in self._rows:
            return self._rows[key]
        window = self._window(start)[:self.spec.num_layers - start]
        other, head = self._vocab_cells(k, option)
        best = np.full(len(window), INF)
        for level in self.levels:
            per_layer = np.array([self._least_cells(t, k_in, level) for t in window])
            best = np.minimum(best, np.cumsum(per_layer) + other + max(level, head))
        self._rows[key] = best
        return best

    def _least_cells(self, t: int, k_in: int, level: int) -> float:
        key = (t, k_in, level)
        if key not in self._least:
            persist = [cells_up(x.persistent_bound(k_in), self.step)
                       for x, tc in zip(self.mem[t], self.trans_cells[t]) if tc <= level]
            self._least[key] = min(persist) if persist else INF
        return self._least[key]

    def score(self, partition: tuple[int, ...], option: VocabOption) -> float:
        """Pipeline iteration time of ``partition`` under the DP optima (inf when infeasible),
        with the stage-boundary hops and relayouts of the back-tracked strategies."""
        micro, backward, tails, steps = [], [], [], []
        start = 0
        previous_last = None
        for k, length in enumerate(partition):
            d = self.detail(k, start, length, option)
            if d is None:
                return INF
            f, tail, bwd, opt, first, last = d
            c_k = (f - tail - opt) / self.m
            if previous_last is not None:
                hop = self.boundary_time(previous_last, first)
                c_k += hop
                bwd += hop / 2
            micro.append(c_k)
            backward.append(bwd)
            tails.append(tail)
            steps.append(opt)
            previous_last = last
            start += length
        return pipeline_time(micro, backward, tails, self.m, steps,
                             step_overhead(self.cluster, self.n * self.pp)).iteration

    def stage_strategies(self, k: int, start: int, length: int,
                         option: VocabOption) -> list[LayerStrategy] | None:
        """The DP optimum of one stage as strategies."""
        picks = self._picks(k, start, length, option)
        if picks is None:
            return None
        window = self._window(start)
        return [self.strategies[window[i]][p] for i, p in enumerate(picks)]
