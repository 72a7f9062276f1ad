"""One search task and the lower-bound tables the exact search prunes with.

A :class:`Task` fixes (global batch, pp, micro-batch count, schedule, vocabulary layout). It
holds the named cost arrays of every candidate strategy at every stage position
(``stage_costs``), the transition costs between layouts, and lower bounds:

- ``rest(k, start, weights)``: the per-stage DP (``dp.solve_stage``) over the layers from
  ``start``, with each strategy's memory rounded DOWN to cells of ``step`` bytes and the cap
  rounded down too, so every plan that truly fits is inside the DP (a relaxation, never a
  restriction; the search checks memory in bytes itself). Entry ``[l, v]``: the least weighted
  cost of ``l + 1`` layers within ``v`` cells.
- ``future(b)[k, a]``: the least weighted cost of stages ``k..pp-1`` over layers ``[a, L)``,
  every partition considered (a small DP over stages).

Weights: the iteration time of ``cost_time.pipeline_time`` is at least, for every stage ``b``,
``J_b = sum_k C_k + (m - 1) C_b + step_b + tail_0 + overhead`` (``C``: a stage's time per
micro-batch; ``C_b <= max C``, ``step_b <= max step``, stage 0's sync tail is never hidden).
``J_b`` is additive over stages and layers: stage ``k`` weighs its per-micro-batch time by
``alpha = m`` if ``k == b`` else 1, its optimizer step by ``beta = [k == b]`` and its sync tail
by ``gamma = [k == 0]``. With one stage ``J_0`` is the iteration time exactly.

Interleaved tasks (``virtual_size`` v > 1; positions are the ``pp v`` model chunks, chunk ``c``
on stage ``c mod pp``): ``cost_time.pipeline_time`` is ``T_pipe = sum_k max_j c_{k,j} +
(m - 1/v) max_k C_k`` before the tails and the step, with ``C_k = sum_j c_{k,j}`` over the
stage's chunks. Since ``max_j c_{k,j} >= C_k / v`` and ``m - 1/v >= 0``, for every stage ``b``
``J_b = sum_k C_k / v + (m - 1/v) C_b + step_b + tail_0 + overhead`` is at most the iteration
time (stage 0's tail is never hidden: ``T >= T_pipe + tail_0``): chunk ``c`` weighs its time by
``alpha = m`` if its stage is ``b`` else ``1/v``, and ``beta``, ``gamma`` by its stage as above;
with ``v = 1`` these are the weights above. Each ``J_b`` lets the stage ``b`` be the smallest
one; their mean over ``b``, ``sum_k C_k (1/v + (m - 1/v) / pp) + mean_b step_b + tail_0 +
overhead``, is at most the iteration time too and cannot: interleaved tasks bound with it as
one more branch (``b = pp``: every chunk weighs its time by ``1/v + (m - 1/v) / pp`` and its
step by ``1/pp``). Memory per chunk position uses
``interleaving.chunk_in_flight``: one count vector the schedule passes through, so each
position's bytes are at most what the stage's peak holds of that chunk.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Hashable

import numpy as np

from ...plan import VocabStrategy
from ..inputs.cluster_model import ClusterModel
from ..cost.estimate import in_flight, step_overhead
from .bottleneck import Bottleneck
from . import partition_bound as partition_bounds
from .lagrange_bound import lagrange_root, tied_lagrange_root
from .stage_dp import LayerOptions, solve_stage
from .task_ends import TaskEnds
from .tied import TiedRows, tied_rest
from ..cost.interleaving import chunk_in_flight
from .layer_tables import LayerTables
from ..inputs.model_spec import ModelSpec
from ..inputs.profiles import ModelProfile
from .search_cache import SearchCache
from .spaces import SpaceRules
from .stage_costs import EmbeddingCosts, StrategyCosts

INF = math.inf


@dataclass(frozen=True)
class Weights:
    """How one stage's time per micro-batch, optimizer step and sync tail enter a bound."""

    alpha: float
    beta: float
    gamma: float
    mix: float = 1.0  # memory axis: mix * persistent + (1 - mix) * step peak
    level: int = -1  # transient bucket (strategies whose transient is at most its top); -1 all
    moves: bool = True  # price relayouts between consecutive layers (False: the tied bound)


# What a task's layer tables are shared by: (global batch, pp, micro-batches, schedule, rules).
TablesKey = tuple[int, int, int, str, SpaceRules]

# A stage's peak is max(backward peak, step peak) >= mix * backward + (1 - mix) * step for any
# mix in [0, 1]: each mix gives a valid relaxation, and the bounds take the best of these.
MIXES = (1.0,)


class Task(TaskEnds):
    """Cost tables of one (B, pp, m, schedule, vocabulary layout) for one search space."""

    def __init__(self, spec: ModelSpec, profile: ModelProfile, cluster: ClusterModel,
                 world_size: int, global_batch: int, pp: int, m: int, schedule: str,
                 rules: SpaceRules, vocab: VocabStrategy, budget_bytes: float,
                 step: int, shared: dict[TablesKey, LayerTables] | None = None,
                 virtual_size: int = 1, cache: SearchCache | None = None,
                 sibling: Task | None = None) -> None:
        self.spec, self.profile, self.cluster = spec, profile, cluster
        # The search's reusable results (its own when the task is built alone).
        if cache is None:
            cache = SearchCache(profile, cluster)
        cache.check(profile, cluster)
        self.cache = cache
        # Interleaved 1F1B (v > 1): the search walks the pp * v model chunks in model order,
        # chunk c on stage c % pp; every per-position array below is per chunk (per stage
        # when v == 1, where chunks and stages are the same).
        self.v = virtual_size
        self.chunks = pp * virtual_size
        self.world_size, self.global_batch = world_size, global_batch
        self.pp, self.m, self.schedule, self.rules, self.vocab = pp, m, schedule, rules, vocab
        self.n = world_size // pp
        self.b_m = global_batch // m
        self.budget = float(budget_bytes)
        self.room = self.budget - cluster.memory_reserve_bytes  # bytes for the stage's terms
        self.step = step
        self.cells = max(int(self.room // step), 0)
        self.num_layers = spec.num_layers
        self.max_len = spec.num_layers - self.chunks + 1
        self.overhead = step_overhead(cluster, world_size, spec)
        # Everything but the embedding/head is the same for every vocabulary layout of a
        # (batch, pp, m, schedule): computed once, on first use, and shared through ``shared``.
        key: TablesKey = (global_batch, pp, m, schedule, rules)
        shared = {} if shared is None else shared
        if key not in shared:
            shared[key] = LayerTables(spec, profile, cluster, rules, self.n, self.b_m, pp,
                                       schedule, cache)
        self.tables = shared[key]
        self.ok = self.tables.ok
        self._emb: list[EmbeddingCosts] | None = None
        self._future: dict[Hashable, Any] = {}  # bound rows and tables, by what they bound
        self._cheap: dict[bool, float] = {}
        self._sibling = sibling  # the same task with v = 1 (v > 1 only; built on first use)
        # Other modules' results for this task, kept with it: least_memory's LeastPeak per
        # partition (that module imports this one) and seeds' stage rows.
        self.least_peaks: dict[tuple[int, ...] | None, Any] = {}
        self.seed_rows: dict[Hashable, Any] = {}
        # J_b for every stage b; interleaved tasks add their mean over b (branch ``pp``).
        self.branches = list(range(pp)) + ([pp] if self.v > 1 else [])
        self.on_new_table: Callable[[], None] | None = None  # e.g. a deadline check
        # The tasks of this layer table and virtual size, for bounds shared across their
        # vocabulary layouts (family_bound.Family; None: this task's own bounds only).
        self.family: Any = None

    @functools.cached_property
    def in_flight(self) -> list[int]:
        """Micro-batches in flight per chunk position, on first use (most tasks are cut by
        their compute bound first; the interleaved counts walk the whole schedule)."""
        if self.v == 1:
            return [in_flight(self.schedule, self.pp, k, self.m) for k in range(self.pp)]
        return chunk_in_flight(self.pp, self.v, self.m, self.cache.in_flight)

    def sibling(self) -> Task:
        """The same task without interleaving (v = 1), sharing the layer tables (the one given
        to the constructor, else built on first use)."""
        if self.v == 1:
            return self
        if self._sibling is None:
            key = (self.global_batch, self.pp, self.m, self.schedule, self.rules)
            self._sibling = Task(
                self.spec, self.profile, self.cluster, self.world_size, self.global_batch,
                self.pp, self.m, self.schedule, self.rules, self.vocab, self.budget, self.step,
                {key: self.tables}, cache=self.cache)
        return self._sibling

    @property
    def emb(self) -> list[EmbeddingCosts]:
        """Embedding/head costs per chunk position (the embedding on the first, the head on the
        last, zeros in between), on first use."""
        if self._emb is None:
            last = self.chunks - 1
            self._emb = [self.cache.embedding_costs(
                self.vocab, self.n, self.b_m, self.in_flight[k], self.schedule, k == 0,
                k == last, self.pp, self.spec.seq_length, self.profile.precision,
                self.rules.optimizer_offload) if k in (0, last) else EmbeddingCosts()
                for k in range(self.chunks)]
        return self._emb

    @functools.cached_property
    def hop_floor(self) -> list[float]:
        """Per chunk position, the least bytes of its received inputs (interleaved chunks but
        the model's first keep each in-flight micro-batch's p2p input until its backward,
        ``LayerTables.hop_bytes``): in every plan at least this much of the backward peak;
        0 without interleaving (``evaluate_plan`` does not model it there)."""
        if self.v == 1:
            return [0.0] * self.chunks
        least = self.tables.least_hop_bytes
        return [0.0] + [self.in_flight[k] * least for k in range(1, self.chunks)]

    @functools.cached_property
    def least_prefix_bytes(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per chunk position, prefix sums over the layers of the least persistent and
        step-peak bytes of any strategy: the exact search's memory cut adds them for the layers
        not yet placed (``exact.TaskSearch``; built on first use, shared by its searches)."""
        order = np.asarray(self.spec.layer_order)
        types = range(len(self.spec.layer_types))
        out = []
        for k in range(self.chunks):
            k_in = self.in_flight[k]
            per_p = np.array([self.tables.costs(t, k_in).persistent.min() for t in types])
            per_s = np.array([self.tables.costs(t, k_in).step_floor.min() for t in types])
            out.append((np.concatenate([[0.0], np.cumsum(per_p[order])]),
                        np.concatenate([[0.0], np.cumsum(per_s[order])])))
        return out

    @property
    def min_transient(self) -> list[float]:
        return [min(float(self.tables.costs(t, self.in_flight[k]).transient.min())
                    for t in set(self.spec.layer_order)) for k in range(len(self.in_flight))]

    # ------------------------------------------------------------------ costs
    def costs(self, k: int, layer: int) -> StrategyCosts:
        """Candidate strategies of ``layer`` when it sits on stage ``k``."""
        return self.tables.costs(self.spec.layer_order[layer], self.in_flight[k])

    def classes(self, k: int, layer: int) -> np.ndarray:
        return self.tables.classes(self.spec.layer_order[layer], self.in_flight[k])

    def bound_in_flight(self, k: int) -> int:
        """Micro-batches in flight the bound tables of position ``k`` assume: the exact count.
        (Rounding it down to a power of two, fewer tables, left stage 1 of a 4-stage LLaMA-7B
        pipeline a whole micro-batch of activations short: bounds up to 13 % low.)"""
        return self.in_flight[k]

    def stage_of(self, k: int) -> int:
        """The stage chunk position ``k`` runs on."""
        return k % self.pp

    def weights(self, k: int, b: int) -> Weights:
        """Chunk position ``k``'s weights in the bound ``J_b`` (module docstring); ``b == pp``
        (interleaved only): the mean of the ``J_b`` over the stages."""
        if b == self.pp:
            return Weights(alpha=1.0 / self.v + (self.m - 1.0 / self.v) / self.pp,
                           beta=1.0 / self.pp, gamma=1.0 if self.stage_of(k) == 0 else 0.0)
        own = self.stage_of(k) == b
        return Weights(alpha=float(self.m) if own else 1.0 / self.v, beta=1.0 if own else 0.0,
                       gamma=1.0 if self.stage_of(k) == 0 else 0.0)

    def weight_arrays(self, k: int) -> tuple[np.ndarray, np.ndarray, float]:
        """``(alpha, beta)`` over the branches ``b`` and ``gamma`` of chunk position ``k``
        (kept: every search of the task reads them, GPT-3's 64 stages each 65 branches)."""
        key = ("weight_arrays", k)
        if key not in self._future:
            ws = [self.weights(k, b) for b in self.branches]
            self._future[key] = (np.array([w.alpha for w in ws]), np.array([w.beta for w in ws]),
                                 1.0 if self.stage_of(k) == 0 else 0.0)
        return self._future[key]

    def cheap_bound(self, with_embedding: bool = True) -> float:
        """A lower bound on every plan's iteration time that needs no DP (memory ignored): each
        layer at its fastest, stages perfectly balanced, the embedding/head at its own cost.

        ``with_embedding=False``: a weaker bound that prices nothing, shared by every
        vocabulary layout of the task's batch, pp and micro-batch count: each layer's compute
        alone (``compute_bound``). Tasks are sorted and cut by it, so the strategy tables of
        a task are priced only when its compute can beat the best plan found."""
        if with_embedding in self._cheap:
            return self._cheap[with_embedding]
        if not with_embedding:
            self._cheap[False] = self.compute_bound()
            return self._cheap[False]
        order = self.spec.layer_order
        one = self.tables.one
        counts = np.bincount(np.asarray(order), minlength=len(one))
        fastest = np.array([float(c.microbatch.min()) for c in one])
        emb = self.emb if with_embedding else [EmbeddingCosts()] * self.pp
        least = float(counts @ fastest) + sum(e.microbatch for e in emb)
        if self.pp == 1:
            per = np.array([float((self.m * c.microbatch + c.exposed_sync + c.optimizer).min())
                            for c in one])
            e = emb[0]
            out = (float(counts @ per) + self.m * e.microbatch + e.exposed_sync + e.optimizer
                   + self.overhead)
        else:
            # fill >= sum C / v and max C >= sum C / pp (module docstring)
            out = least * (1 / self.v + (self.m - 1 / self.v) / self.pp) + self.overhead
        self._cheap[True] = out
        return out

    def known_bound(self) -> float:
        """The strongest of ``cheap_bound`` and ``root_bound`` computed so far (0 before
        any), pricing nothing."""
        return max(max(self._cheap.values(), default=0.0), self._future.get("root", 0.0),
                   self._future.get("tied", 0.0), self._future.get("lagrange", 0.0),
                   self._future.get("tied_partition", 0.0),
                   self._future.get("tied_lagrange", 0.0))

    def compute_bound(self) -> float:
        """Lower bound on every plan's iteration time from the layers' compute alone.

        A layer's time per micro-batch is at least its forward plus backward compute
        (``cost_time.layer_time``: ``forward >= F`` and ``backward >= r F``, communication
        only adds, recompute adds ``F``), ``F`` the profile's forward time at the strategy's
        samples per rank and tp; the fastest over the task's tp degrees stands for the layer.
        With one stage the iteration is at least ``m`` times their sum; with more, at least the
        sum times ``1 + (m - 1) / pp`` (the largest stage is at least the mean), interleaved
        ``1/v + (m - 1/v) / pp``. Everything else
        (communication, sync tails, optimizer steps, embedding/head) is ``>= 0`` and left out;
        the fixed step overhead is kept. Needs no strategy table."""
        fastest = []
        cp = self.rules.cp
        for t, lt in enumerate(self.spec.layer_types):
            p = self.tables.profile.layer_types[lt.name]
            fastest.append(min((1.0 + p.backward_forward_ratio)
                               * (p.forward_time(self.b_m / (self.n // tp), tp)
                                  + _ring_saving(p, self.b_m / (self.n // tp), tp, cp))
                               for tp in {s.tp for s in self.tables.strategies[t]}))
        least = sum(fastest[t] for t in self.spec.layer_order)
        if self.pp == 1:
            return self.m * least + self.overhead
        # interleaved: the fill is at least sum C / v (module docstring); v = 1 as above
        return least * (1 / self.v + (self.m - 1 / self.v) / self.pp) + self.overhead

    # ------------------------------------------------------------------ bounds
    def cells_of(self, room: float) -> int:
        """Cells a stage may still fill given ``room`` bytes (rounded down; -1: none)."""
        if room < 0:
            return -1
        return min(int(room // self.step), self.cells)

    def _window(self, start: int, span: int | None) -> tuple[int, ...]:
        """Layer types of the ``span`` (default ``max_len``) layers from ``start``."""
        span = self.max_len if span is None else span
        order = self.spec.layer_order
        return tuple(order[start:start + span]) if len(self.spec.layer_types) > 1 \
            else (order[0],) * span

    def rest(self, k: int, start: int, w: Weights, span: int | None = None,
             lead: tuple[int, ...] = ()) -> np.ndarray:
        """DP table over the layers from ``start`` at stage position ``k`` (module doc);
        ``span`` layers at most (default ``max_len``); the first ``len(lead)`` layers charged
        at the in-flight counts ``lead`` instead of position ``k``'s (``tied_rest``)."""
        window = self._window(start, span)
        k_in = self.bound_in_flight(k)
        key = (window, k_in, w, lead, self.step)  # the cells: refine.finer's twin has its own
        if key not in self.tables.rest:
            if self.on_new_table is not None:
                self.on_new_table()
            opts = {}
            top = self.tables.buckets[w.level][1] if w.level >= 0 else INF
            flights = [lead[i] if i < len(lead) else k_in for i in range(len(window))]
            for t, f in set(zip(window, flights)):
                c = self.tables.costs(t, f)
                keep = c.transient <= top
                mixed = (w.mix * c.persistent + (1 - w.mix) * c.step_floor)[keep]
                cost = (w.alpha * c.microbatch + w.beta * c.optimizer
                        + w.gamma * c.exposed_sync)[keep]
                if not keep.any():  # nothing this small: one impossible option
                    mixed, cost = np.array([INF]), np.array([INF])
                    cls = np.zeros(1, dtype=np.int64)
                else:
                    cls = self.tables.classes(t, f)[keep]
                mem = np.minimum(np.floor(mixed / self.step), self.cells + 1).astype(np.int64)
                if not w.moves:  # no transitions: one class, the (cells, cost) front alone
                    mem, cost = _front(mem, cost)
                    cls = np.zeros(len(mem), dtype=np.int64)
                opts[t, f] = LayerOptions(mem=mem, cost=cost, aux=np.zeros((len(cost), 0)),
                                          cls=cls)
            if w.moves:
                trans = w.alpha * np.minimum.reduce([self.tables.relayout[t]
                                                     for t in set(window)])
            else:
                trans = np.zeros((1, 1))
            self.tables.rest[key] = solve_stage([opts[tf] for tf in zip(window, flights)], trans,
                                                self.cells).best
        return self.tables.rest[key]

    def rest_bound(self, k: int, start: int, w: Weights, count: int | np.ndarray,
                   backward: np.ndarray | float, step: np.ndarray | float,
                   transient: np.ndarray | float, span: int | None = None,
                   lead: tuple[int, ...] = ()) -> np.ndarray:
        """Least weighted cost of the ``count`` layers from ``start`` (a relaxation), given
        the bytes left for the backward peak and the step peak and the largest transient so
        far (arrays over the candidates of the previous layer); inf where nothing fits.

        Every transient bucket ``j`` is looked up at once (its DP tables stacked): a bucket
        below the largest transient so far cannot hold the rest's largest, except the top one
        (all strategies) when the stage's own transient beats them; bucket ``j`` reserves its
        floor ``lo_j`` beyond the transient so far."""
        backward = np.asarray(backward, dtype=float)
        shape = backward.shape
        flat = backward.reshape(-1)

        def like(x) -> np.ndarray:  # the other inputs, flat over the same candidates
            x = np.asarray(x)
            return x.reshape(-1) if x.shape == shape else np.broadcast_to(x, shape).reshape(-1)

        transient, steps, count_a = like(transient), like(step)[None, :], like(count)
        lo, hi = self.tables.bucket_edges
        levels = len(lo)
        valid = (hi[:, None] >= transient[None, :]) | (np.arange(levels) == levels - 1)[:, None]
        room = flat[None, :] - np.maximum(0.0, lo[:, None] - transient[None, :])   # (j, x)
        value = np.full(room.shape, -INF)
        needed = valid.any(axis=1)
        for mix in MIXES:
            stacked = self._rest_stack(k, start, replace(w, mix=mix, level=-1),
                                       needed, span, lead)  # (j, l, v)
            rows = np.minimum(count_a, stacked.shape[1]) - 1  # past the model's end: inf
            cells = np.floor((mix * room + (1 - mix) * steps) / self.step)
            got = stacked[np.arange(levels)[:, None], rows[None, :],
                          np.clip(cells, 0, self.cells).astype(np.int64)]
            value = np.maximum(value, np.where((cells >= 0) & (count_a <= stacked.shape[1])[
                None, :], got, INF))
        value = np.where((room >= 0) & (steps >= 0) & valid, value, INF)
        return value.min(axis=0).reshape(shape)

    def _rest_stack(self, k: int, start: int, w: Weights, needed: np.ndarray,
                    span: int | None = None, lead: tuple[int, ...] = ()) -> np.ndarray:
        """The ``rest`` tables of the transient buckets, stacked ``(bucket, layers, cells)``;
        a bucket's DP runs when first ``needed`` (until then its rows are inf, never read)."""
        window = self._window(start, span)
        key = (window, self.bound_in_flight(k), w, lead, self.step)
        cache = self.tables.rest_stacks
        if key not in cache:
            cache[key] = (np.full((len(self.tables.buckets), len(window), self.cells + 1),
                                  INF), set())
        stacked, done = cache[key]
        for j in np.nonzero(needed)[0].tolist():
            if j not in done:
                stacked[j] = self.rest(k, start, replace(w, level=j), span, lead)
                done.add(j)
        return stacked

    def stage_bound(self, k: int, start: int, b: int) -> np.ndarray:
        """Lower bound on stage ``k``'s weighted cost in ``J_b`` per length ``1..max_len``
        (cached: the search asks for it at every node that starts a stage or chunk)."""
        key = ("stage_bound", k, start, b)
        if key not in self._future:
            self._future[key] = self._stage_bound(k, start, b)
        return self._future[key]

    def _stage_bound(self, k: int, start: int, b: int) -> np.ndarray:
        w = self.weights(k, b)
        e = self.emb[k]
        fixed = (w.alpha * (e.microbatch + (self.tables.min_boundary if k > 0 else 0.0))
                 + w.beta * e.optimizer + w.gamma * e.exposed_sync)
        lengths = np.arange(1, self.max_len + 1)
        full = np.ones(self.max_len)
        # the stage's largest transient is at least the embedding/head's: reserved here,
        # rest_bound reserves only a bucket's excess over it
        room = self.room - self.nccl_floor[self.stage_of(k)]  # in both peaks
        kept = e.persistent + e.transient + self.hop_floor[k]  # the received input: backward
        out = self.rest_bound(k, start, w, lengths, full * (room - kept),
                              full * (room - e.step_floor), full * e.transient)
        return out + fixed

    def future(self, b: int) -> np.ndarray:
        """``F[k, a]``: least ``J_b`` share of chunk positions ``k..`` over layers ``[a, L)``."""
        if b not in self._future:
            self._future[b] = partition_bounds.futures(self, b)
        return self._future[b]

    def time_row(self, k: int, start: int, tail: bool) -> np.ndarray:
        """Least time per micro-batch of stage ``k`` per length (plus its sync tail if
        ``tail``), embedding/head and cheapest incoming boundary included."""
        key = ("row", k, start if len(self.spec.layer_types) > 1 else 0, tail)
        if key not in self._future:
            w = Weights(1.0, 0.0, 1.0 if tail else 0.0)
            e = self.emb[k]
            full = np.ones(self.max_len)
            room = self.room - self.nccl_floor[self.stage_of(k)]  # in both peaks
            rest = self.rest_bound(k, start, w, np.arange(1, self.max_len + 1),
                                   full * (room - e.persistent - e.transient),
                                   full * (room - e.step_floor), full * e.transient)
            self._future[key] = rest + e.microbatch + (self.tables.min_boundary if k else 0.0) + (
                e.exposed_sync if tail else 0.0)
        return self._future[key]

    def bottleneck(self) -> Bottleneck:
        """The joint sum-and-maximum bound of the stages ``1..pp-1`` over every suffix
        (``bottleneck.Bottleneck`` on the time rows; v = 1, pp > 1)."""
        if "bottleneck" not in self._future:
            self._future["bottleneck"] = Bottleneck(
                lambda k, a: self.time_row(k, a, False), self.pp, self.num_layers,
                self.max_len, len(self.spec.layer_types) == 1, max(self.m - 1, 0))
        return self._future["bottleneck"]

    def root_bound(self, cutoff: float = INF) -> float:
        """Lower bound on the iteration time of every plan of this task: the best of the
        ``J_b``, for a plain pipeline the bottleneck bound (stage 0's row with its tail in the
        sum, without it in the maximum, then ``G`` of the rest), and for an interleaved one
        the tied bound (``tied_bound``, first: it is the cheap one, and where it reaches
        ``cutoff`` it is returned alone). Kept: ``known_bound`` returns it once computed."""
        if "root" in self._future:
            return self._future["root"]
        lagrange, tied = self.table_free_bound(cutoff)
        if max(lagrange, tied) >= cutoff:
            return max(tied, lagrange)
        best = max(float(self.future(b)[0, 0]) for b in self.branches)
        if self.pp > 1 and self.v == 1:
            lens = np.arange(1, self.max_len + 1)
            joint = (self.time_row(0, 0, True)
                     + self.bottleneck().g(1, lens, self.time_row(0, 0, False)))
            best = max(best, float(joint.min()))
        if self.chunks > 1 and partition_bounds.ENABLED:  # every J_b of one partition at once
            best = max(best, partition_bounds.partition_bound(self, cutoff - self.overhead))
        out = max(best + self.overhead, tied, lagrange)
        self._future["root"] = out
        return out

    @property
    def lagrange_applies(self) -> bool:
        """Whether ``lagrange_bound`` is tried before the DP bounds: plain tasks. Interleaved
        chunks would each get their stage's whole room, a bound too weak to pay for its
        partition search over ``pp v`` chunks (measured: 38 ms a task, none settled on
        LLaMA-7B at 24 GB)."""
        return self.v == 1

    def lagrange_bound(self, cutoff: float = INF) -> float:
        """``lagrange_bound.lagrange_root`` of this task, kept (``known_bound`` reads it): a
        cheap lower bound on every plan's iteration time (``cutoff`` where every partition
        reaches ``cutoff``; the incumbent only falls, so a kept value that reached an earlier
        cutoff still reaches a later one)."""
        if "lagrange" not in self._future:
            self._future["lagrange"] = self._shared_or_own("lagrange", lagrange_root, cutoff)
        return self._future["lagrange"]

    def _shared_or_own(self, kind: str, compute: Callable[[Any, float], float],
                       cutoff: float) -> float:
        """``compute(self, cutoff)``, unless the family's bound of that kind (at most this
        task's, ``family_bound``) already reaches ``cutoff``."""
        if self.family is not None:
            shared = self.family.bound(kind, compute, cutoff)
            if shared >= cutoff:
                return shared
        return compute(self, cutoff)

    def tied_bound(self) -> float:
        """Interleaved tasks of one layer type: ``J_b`` with each stage's ``v`` chunks sharing
        the stage's memory (``tied_rest`` of the whole task; 0 where it does not apply)."""
        if not self.tied_applies():
            return 0.0
        if "tied" not in self._future:
            none = [(0.0, 0.0, 0.0)] * self.pp
            self._future["tied"] = float(self.tied_rest(0, 0, none,
                                                        np.zeros(len(self.branches))))
        return self._future["tied"]

    def table_free_bound(self, cutoff: float = INF) -> tuple[float, float]:
        """``(lagrange, tied)``: the root bounds that need no chunk-level DP tables, tried in
        that order until one reaches ``cutoff``: the Lagrangian bound (plain tasks), and the
        tied bound with its partition form (interleaved tasks of one layer type). Kept, so
        ``known_bound`` reads them; the driver orders interleaved tasks by them before
        building any task's DP tables."""
        lagrange = self.lagrange_bound(cutoff)
        if lagrange >= cutoff:
            return lagrange, 0.0
        if self.tied_applies():
            lagrange = max(lagrange, self.tied_lagrange_bound(cutoff))
            if lagrange >= cutoff:
                return lagrange, 0.0
        tied = self.tied_bound()
        if tied < cutoff and self.tied_applies() and partition_bounds.ENABLED:
            tied = max(tied, self.tied_partition_bound(cutoff))
        return lagrange, tied

    def tied_lagrange_bound(self, cutoff: float = INF) -> float:
        """``lagrange_bound.tied_lagrange_root`` of this task (interleaved, one layer type;
        else 0), kept: the cheapest bound that sees a stage's chunks share its memory."""
        if not self.tied_applies():
            return 0.0
        if "tied_lagrange" not in self._future:
            self._future["tied_lagrange"] = self._shared_or_own("tied_lagrange",
                                                                tied_lagrange_root, cutoff)
        return self._future["tied_lagrange"]

    def tied_partition_bound(self, cutoff: float = INF) -> float:
        """The partition bound over the stages' blocks (``tied.TiedRows``): every ``J_b`` of
        one choice of block sizes at once, where ``tied_bound`` lets each choose its own
        (kept; ``cutoff`` where every choice reaches it, 0 where the node limit stopped it)."""
        if "tied_partition" not in self._future:
            self._future["tied_partition"] = partition_bounds.partition_bound(
                TiedRows(self), cutoff - self.overhead) + self.overhead
        return self._future["tied_partition"]

    def tied_applies(self) -> bool:
        return self.v > 1 and len(self.spec.layer_types) == 1

    def tied_rest(self, k: int, start: int, placed: list[tuple[Any, Any, Any]],
                  acc: np.ndarray) -> np.ndarray:
        """``tied.tied_rest`` of this task: the bound of every plan whose chunk positions
        before ``k`` are placed, each stage's chunks left sharing what is left of its memory."""
        return tied_rest(self, k, start, placed, acc)


def _front(mem: np.ndarray, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The options no other beats in both cells and cost (ties: one kept)."""
    order = np.lexsort((cost, mem))
    mem, cost = mem[order], cost[order]
    keep = cost < np.minimum.accumulate(np.concatenate(([INF], cost[:-1])))
    return mem[keep], cost[keep]


def _ring_saving(p, samples: float, tp: int, cp: int) -> float:
    """The most ring CP can take off a layer's forward compute (``context_parallel.
    cp_layer_time``: its chunked attention in place of the whole sequence's), <= 0; 0 without
    CP. Keeps ``compute_bound`` a lower bound for CP tasks (Ulysses changes no compute)."""
    if cp == 1:
        return 0.0
    s = p.attention_seq_length
    return min(0.0, cp * p.attention_time(s / cp, samples * cp, tp)
               - p.attention_time(s, samples, tp))
