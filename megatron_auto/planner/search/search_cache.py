"""What one search computes once and reuses, in one object the search owns and passes down.

``driver.search`` makes a :class:`SearchCache` for the model profile and cluster it searches
and hands it to every task it builds (a task built alone makes its own); nothing lives at
module level, so two searches in one process share nothing (a search on another cluster or
profile in between cannot change an answer) and everything is freed with the search. It holds:

- ``clock``: the CPU clock every deadline of the search reads (:class:`SearchClock`);
- ``priced``: each layer type's priced strategies (``stage_costs.strategy_costs``): the tasks
  of one search and its baseline spaces price the same strategy at the same stage size and
  micro-batch size many times;
- ``nccl_floors`` and ``nccl_bounds``: NCCL communicator counts by stage shape
  (``Task.nccl_floor``, ``Task.nccl_bound``; pure arithmetic, O(stage size) each);
- ``in_flight``: the interleaved schedules' in-flight count vectors
  (``interleaving.in_flight_vectors``, a walk of the whole schedule): every task and every
  interleaved plan the search prices reads them;
- ``embeddings``: the embedding/head costs of a stage (``stage_costs.embedding_costs``) by
  every argument but the profile and cluster: the tasks of the spaces' rule variants price the
  same vocabulary layout at the same stage shape again (GPT-1.5B on 16 GPUs: 1,134 calls, 433
  distinct).

The priced strategies depend on the profile and the cluster, so a cache serves one pair
(:meth:`SearchCache.check`).
"""

from __future__ import annotations

import time
from typing import Any

from ..cost.interleaving import InFlightMemo
from ..inputs.cluster_model import ClusterModel
from ..inputs.profiles import ModelProfile
from .stage_costs import EmbeddingCosts, PricedStrategies, embedding_costs


class SearchClock:
    """The clock every search deadline reads: this process's CPU seconds. On a shared machine
    the wall clock runs many times faster than the search's own progress (load 20 gave it a
    tenth of a core), so a wall-clock limit made the answer depend on the load; CPU seconds
    give the same search the same work whatever else runs (docs/planner.md §3).

    Reading the CPU clock costs microseconds (a system call), the search reads it at every
    node: it is read again only once 10 ms of wall time have passed, and CPU time never runs
    ahead of the wall clock, so the value is at most 10 ms behind."""

    def __init__(self) -> None:
        self._wall = -1.0  # wall time of the last CPU-clock read
        self._cpu = 0.0

    def __call__(self) -> float:
        wall = time.monotonic()
        if wall - self._wall >= 0.01:
            self._wall, self._cpu = wall, time.process_time()
        return self._cpu


class SearchCache:
    """The reusable results of one search over one (model profile, cluster) pair."""

    def __init__(self, profile: ModelProfile, cluster: ClusterModel) -> None:
        self.profile, self.cluster = profile, cluster
        self.clock = SearchClock()
        # layer type name -> its priced strategies (stage_costs)
        self.priced: dict[str, PricedStrategies] = {}
        # (stage size, pp, world, first, last, vocabulary tp) -> the fewest communicators
        self.nccl_floors: dict[tuple[int, ...], int] = {}
        # (stage size, pp) -> the NCCL bytes bound of gpu_terms.search_nccl_bound
        self.nccl_bounds: dict[tuple[int, ...], float] = {}
        self.in_flight: InFlightMemo = {}
        self.embeddings: dict[tuple[Any, ...], EmbeddingCosts] = {}

    def check(self, profile: ModelProfile, cluster: ClusterModel) -> None:
        """Raise ``ValueError`` unless this cache serves ``profile`` and ``cluster`` (the same
        objects: a cache is made by the search that uses it)."""
        if profile is not self.profile or cluster is not self.cluster:
            raise ValueError("a SearchCache serves the model profile and cluster it was made "
                             "for; make one per search")

    def embedding_costs(self, *args: Any) -> EmbeddingCosts:
        """``stage_costs.embedding_costs`` of this cache's profile and cluster with ``args``
        (every other argument), kept."""
        if args not in self.embeddings:
            self.embeddings[args] = embedding_costs(self.profile.embedding, self.cluster, *args)
        return self.embeddings[args]

    def priced_strategies(self, layer_type: str) -> PricedStrategies:
        """The priced-strategy memo of ``layer_type`` (created empty on first use)."""
        memo = self.priced.get(layer_type)
        if memo is None:
            memo = self.priced[layer_type] = PricedStrategies()
        return memo
