"""The vocabulary-independent cost tables of a search task (``tasks.Task.tables``).

One :class:`LayerTables` per (global batch, pp, micro-batch count, schedule, space rules),
shared by the task's vocabulary layouts and virtual sizes: every layer type's candidate
strategies priced per micro-batches in flight (``stage_costs``, dominated ones pruned), the
classes (layout and sequence parallelism) the transitions depend on, the relayout, stage-boundary
and SP-leave costs between classes, and the transient buckets of the bound DP.
"""

from __future__ import annotations

import functools
from typing import Any, Hashable

import numpy as np

from ..inputs.cluster_model import ClusterModel
from ..cost.moves import sp_reduced_tensor_bytes
from ..cost.time_model import (relayout_cost, relayout_time, sequence_parallel_switch_time,
                               stage_boundary_cost)
from ..inputs.model_spec import ModelSpec
from ..inputs.profiles import ModelProfile, fill_attention_defaults
from .search_cache import SearchCache
from .spaces import SpaceRules, layer_strategies
from .stage_costs import StrategyCosts, prune_dominated, strategy_costs
from ...layout import Layout, dp_size, layout_of

# Transients are bucketed: a plan whose largest transient lies in (lo, hi] is inside the DP of
# strategies with transient <= hi that reserves only lo (a relaxation); few buckets, fast DPs.
MAX_LEVELS = 4


class LayerTables:
    """The vocabulary-independent part of a task: strategy costs per (layer type, micro-batches
    in flight) computed on first use, layouts, transition and hop costs, transient buckets."""

    def __init__(self, spec: ModelSpec, profile: ModelProfile, cluster: ClusterModel,
                 rules: SpaceRules, n: int, b_m: int, pp: int, schedule: str,
                 cache: SearchCache) -> None:
        self.cp = rules.cp
        self.optimizer_offload = rules.optimizer_offload
        if rules.cp > 1:  # CP prices attention by length (as evaluate_plan fills it)
            profile = fill_attention_defaults(profile, spec)
        self.spec, self.profile, self.cluster = spec, profile, cluster
        self.cache = cache  # the search's: priced strategies per layer type
        self.n, self.b_m, self.pp, self.schedule = n, b_m, pp, schedule
        self.strategies = [layer_strategies(lt, n, b_m, rules, cluster.devices_per_node)
                           for lt in spec.layer_types]
        self.ok = all(self.strategies)
        # The bound DP's tables (tasks.Task.rest: per window, in-flight count and weights) and
        # their per-bucket stacks; other modules' tables of these layers (least_memory's
        # fronts, seeds' stage DPs), each keyed by its module's tag first.
        self.rest: dict[tuple[Hashable, ...], np.ndarray] = {}
        self.rest_stacks: dict[tuple[Hashable, ...], tuple[np.ndarray, set[int]]] = {}
        self.memo: dict[tuple[Hashable, ...], Any] = {}
        self._costs: dict[tuple[int, int], StrategyCosts] = {}
        self._cls: dict[tuple[int, int], np.ndarray] = {}

    # Built on first use (most tasks are pruned by their cheap bound, which needs only ``one``).
    @functools.cached_property
    def layouts(self) -> list[tuple[Layout, bool]]:
        """The classes: a layout and whether the layer runs sequence parallelism (the
        transitions depend on both, ``moves.chunk_moves``), sorted."""
        return sorted({(layout_of(s, self.n), s.sequence_parallel and s.tp > 1)
                       for group in self.strategies for s in group})

    @functools.cached_property
    def nccl_layouts(self) -> list[tuple[int, bool]]:
        """Per class, the ``(tp, consecutive)`` its NCCL groups come from (``gpu_terms``)."""
        if self.cp == 1:
            return [(lay.tp, lay.consecutive) for lay, _ in self.layouts]
        return [(lay.tp, lay.consecutive, lay.cp) for lay, _ in self.layouts]  # type: ignore

    @functools.cached_property
    def moved(self) -> list[float]:
        """Per layer type, the bytes per sample a relayout or stage hop moves into it (its
        hidden state and, for T5, the carry beside it)."""
        return [self.profile.layer_types[lt.name].moved_bytes_per_sample
                for lt in self.spec.layer_types]

    def hop_bytes(self, cls: int, layer_type: int) -> float:
        """Bytes an interleaved chunk keeps per micro-batch in flight of the input it received
        from a previous chunk ending in class ``cls``, its first layer of type ``layer_type``:
        ``evaluate_plan`` holds the p2p buffer until the chunk's backward, ``b_m / dp`` samples
        of the receiving layer's moved bytes, ``dp`` the sender's."""
        return self.b_m / dp_size(self.layouts[cls][0], self.n) * self.moved[layer_type]

    @functools.cached_property
    def most_hop_bytes(self) -> float:
        """The largest ``hop_bytes`` of any class and layer type (what a seed reserves)."""
        return max(self.hop_bytes(c, t) for c in range(len(self.layouts))
                   for t in range(len(self.moved)))

    @functools.cached_property
    def least_hop_bytes(self) -> float:
        """The least ``hop_bytes`` of any class and layer type: what every received input of
        an interleaved chunk keeps at least, per micro-batch in flight."""
        return min(self.hop_bytes(c, t) for c in range(len(self.layouts))
                   for t in range(len(self.moved)))

    @functools.cached_property
    def hidden(self) -> list[float]:
        """Per layer type, the bytes per sample an SP boundary gathers (the hidden state)."""
        return [self.profile.layer_types[lt.name].hidden_bytes_per_sample
                for lt in self.spec.layer_types]

    def _switch(self, a: tuple[Layout, bool], b: tuple[Layout, bool], h: float) -> float:
        return sequence_parallel_switch_time(self.cluster, a[0], a[1], b[0], b[1], self.b_m, h,
                                             self.n)

    @functools.cached_property
    def relayout(self) -> list[np.ndarray]:
        """``relayout[t][a, b]``: forward + backward seconds per micro-batch from class ``a``
        into a layer of type ``t`` with class ``b`` (evaluate_plan prices it with the
        receiver's width), the SP boundaries between them included."""
        cluster, n, b_m = self.cluster, self.n, self.b_m
        return [np.array([[relayout_time(cluster, a[0], b[0], b_m, mv, n) + self._switch(a, b, h)
                           for b in self.layouts] for a in self.layouts])
                for mv, h in zip(self.moved, self.hidden)]

    @functools.cached_property
    def sp_leave(self) -> list[np.ndarray]:
        """``sp_leave[t][a]``: a stage's last layer of type ``t`` and class ``a`` leaving its SP
        run before the hop (charged to that stage, as ``chunk_moves`` does)."""
        return [np.array([self._switch(a, (a[0], False), h) for a in self.layouts])
                for h in self.hidden]

    @functools.cached_property
    def boundary(self) -> list[np.ndarray]:
        """``boundary[t][a, b]``: a micro-batch crossing into a stage whose first layer has type
        ``t`` and class ``b`` from a previous stage ending in class ``a`` (p2p hop, relayout,
        entering the receiver's SP run)."""
        cluster, n, b_m = self.cluster, self.n, self.b_m
        return [np.array([[stage_boundary_cost(cluster, a[0], b[0], b_m, mv, n, self.pp).total
                           + self._switch((b[0], False), b, h)
                           for b in self.layouts] for a in self.layouts])
                for mv, h in zip(self.moved, self.hidden)]

    @functools.cached_property
    def min_boundary(self) -> float:
        """The cheapest stage boundary of any class pair (0 with one stage)."""
        return 0.0 if self.pp == 1 else min(float(x.min()) for x in self.boundary)

    @functools.cached_property
    def buckets(self) -> list[tuple[float, float]]:
        """The transient buckets ``(lo, hi]`` of the bound DP (``MAX_LEVELS`` at most)."""
        transients = sorted({float(x) for c in self.one for x in c.transient})
        picks = sorted({int(round(x)) for x in np.linspace(0, len(transients) - 1, MAX_LEVELS)})
        tops = [transients[i] for i in picks]
        return [(tops[j - 1] if j else 0.0, top) for j, top in enumerate(tops)]

    @functools.cached_property
    def bucket_edges(self) -> tuple[np.ndarray, np.ndarray]:
        """``buckets`` as two arrays: the floors ``lo`` and the tops ``hi``."""
        return (np.array([lo for lo, _ in self.buckets]),
                np.array([hi for _, hi in self.buckets]))

    @functools.cached_property
    def backward_moves(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """``(relayout, boundary)``: the backward part of ``relayout`` and ``boundary`` (the
        same moves; ``sp_leave`` has none: leaving an SP run gathers in forward only, entering
        one gathers the gradient in backward, ``layout.sequence_parallel_boundary_collectives``).
        The exact search's stage dominance needs each stage's backward time (its sync-tail
        hiding, ``cost_time.pipeline_time``); built on first use."""
        cluster, n, b_m = self.cluster, self.n, self.b_m

        def enter(b: tuple[Layout, bool], h: float) -> float:  # gradient gather only
            return sequence_parallel_switch_time(cluster, b[0], False, b[0], b[1], b_m, h, n)

        def same_run(a: tuple[Layout, bool], b: tuple[Layout, bool]) -> bool:
            return a[1] and b[1] and a[0].tp > 1 and a[0] == b[0]

        relayout = [np.array([[relayout_cost(cluster, a[0], b[0], b_m, mv, n).backward
                               + (0.0 if same_run(a, b) else enter(b, h))
                               for b in self.layouts] for a in self.layouts])
                    for mv, h in zip(self.moved, self.hidden)]
        boundary = [np.array([[stage_boundary_cost(cluster, a[0], b[0], b_m, mv, n,
                                                   self.pp).backward + enter(b, h)
                               for b in self.layouts] for a in self.layouts])
                    for mv, h in zip(self.moved, self.hidden)]
        return relayout, boundary

    @functools.cached_property
    def one(self) -> list[StrategyCosts]:
        """Costs at one micro-batch in flight (times do not depend on the count)."""
        return [self.costs(t, 1) for t in range(len(self.strategies))]

    def costs(self, t: int, k_in: int) -> StrategyCosts:
        key = (t, k_in)
        if key not in self._costs:
            name = self.spec.layer_types[t].name
            lp = self.profile.layer_types[name]
            # any layer of this type stands for its norm/bias sizes
            order = self.spec.layer_order
            norms = sp_reduced_tensor_bytes(self.spec, order.index(t)) if t in order else ()
            full = strategy_costs(lp, self.cluster, self.strategies[t], self.n, self.b_m, k_in,
                                  self.schedule, self.profile.precision, norm_grad_bytes=norms,
                                  memo=self.cache.priced_strategies(name),
                                  layer_type=self.spec.layer_types[t],
                                  optimizer_offload=self.optimizer_offload)
            self._costs[key] = full.take(prune_dominated(full))
        return self._costs[key]

    def classes(self, t: int, k_in: int) -> np.ndarray:
        key = (t, k_in)
        if key not in self._cls:
            self._cls[key] = np.array([self.layouts.index(cl)
                                       for cl in self.costs(t, k_in).layouts], dtype=np.int64)
        return self._cls[key]
