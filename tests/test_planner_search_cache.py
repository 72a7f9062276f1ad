"""A search keeps what it reuses in its own ``SearchCache``: nothing at module level.

Two searches in one process share no state: no planner module's dicts, lists, sets or
memoised functions change during a search (the priced strategies, NCCL counts, in-flight
vectors and the CPU clock's last reading used to live there), and a search on another cluster and profile in between leaves an answer, and
the work that found it, exactly as before.
"""

from __future__ import annotations

import sys

import pytest

from megatron_auto.planner import ModelSpec, SearchOptions, TrainingSpec, analytic_profile, search
from megatron_auto.planner.inputs.presets import get_cluster
from megatron_auto.planner.search.search_cache import SearchCache
from megatron_auto.planner.search.spaces import SpaceRules
from megatron_auto.planner.search.tasks import Task
from megatron_auto.plan import VocabStrategy

from planner_fakes import FakeCluster, round_profile

pytestmark = pytest.mark.pure

SPEC = ModelSpec.uniform(8, 2048, 16, 1024, 50304, name="gpt")
TRAINING = TrainingSpec(16)
OPTIONS = SearchOptions(show_progress=False, include_baselines=True, time_limit_s=60)


def _searched(cluster_name: str, budget_gb: float, training: TrainingSpec = TRAINING):
    cluster = get_cluster(cluster_name)  # GPU presets: NCCL communicators are priced
    result = search(SPEC, training, cluster, analytic_profile(SPEC, training, cluster),
                    int(budget_gb * 1e9), OPTIONS)
    info = {k: v for k, v in result.plan.search.items()
            if k not in ("search_time_s", "search_cpu_s")}
    return result.plan.to_dict() | {"search": info}


def _module_state() -> dict[str, object]:
    """Copies of every dict, list and set at module level in the planner's modules, and the
    size of every memoised function's cache (``functools.lru_cache``)."""
    out: dict[str, object] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron_auto.planner"):
            continue
        for attr, value in vars(module).items():
            if isinstance(value, (dict, list, set)) and not attr.startswith("__"):
                out[f"{name}.{attr}"] = value.copy()
            elif hasattr(value, "cache_info") and value.__module__.startswith(
                    "megatron_auto.planner"):  # layout.py's pure arithmetic is not the planner's
                out[f"{name}.{attr}()"] = value.cache_info().currsize
    return out


def test_a_search_leaves_no_module_state():
    _searched("a100-40g-1x8", 3)  # every planner module imported
    before = _module_state()
    _searched("a100-40g-1x8", 3, TrainingSpec(32))  # other micro-batch counts
    assert _module_state() == before


def test_a_search_on_another_cluster_in_between_changes_nothing():
    first = _searched("a100-40g-1x8", 3)
    _searched("h100-80g-2x8", 6)  # another cluster, profile and world size
    assert _searched("a100-40g-1x8", 3) == first  # plan, estimate, nodes, baselines


def test_a_cache_serves_its_own_profile_and_cluster():
    cluster, profile = FakeCluster(devices_per_node=2), round_profile()
    cache = SearchCache(profile, cluster)
    args = (ModelSpec.uniform(2, 64, 4, 16, 64, name="gpt"), profile, cluster, 2, 4, 1, 1,
            "1f1b", SpaceRules(), VocabStrategy(tp=1, dp_mode="ddp"), 10 ** 6, 1000)
    assert Task(*args, cache=cache).cache is cache
    with pytest.raises(ValueError, match="SearchCache serves"):
        Task(args[0], round_profile(), *args[2:], cache=cache)
