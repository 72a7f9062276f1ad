"""What the grid has found so far for one model on one cluster, reused by its later searches.

Two facts make earlier answers useful to later searches, and both are exact:

- A plan is a plan of a space whatever the budget; it fits every budget at least its peak.
  So each search starts from the fastest plans found so far for the same model and cluster, in
  the same cell or at another budget, that lie in its space (``methods.in_space``) and fit its
  budget (``search``'s ``incumbents``; the search prices them again). Its answer is then at
  least each of them, proven or stopped by the time limit: ``ours`` >= every method of its
  cell, each ablation >= every baseline inside it, and a method at a larger budget >= itself
  at a smaller one.
- The least memory any plan of a space needs (``InfeasibleError.min_memory_bytes``, rounded up
  by at most 1 MB) does not depend on the budget, and a space without any plan for the shape has
  none at any budget. So a method found infeasible once is infeasible, with the same least
  memory, at every budget below it, and is recorded so without a second search.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..plan import Plan
from ..planner.inputs.model_spec import ModelSpec
from .methods import Method, in_space

GB = 1e9
SEEDS = 3  # incumbents handed to a search: the fastest few (the best one decides)
REPORT_STEP = 1e6  # the planner rounds the least memory up by at most this many bytes


@dataclass
class _Plan:
    method: str
    budget_gb: float
    plan: Plan
    samples_per_s: float
    peak_bytes: float


@dataclass
class Found:
    """Plans and least memories of one (model, cluster), over every budget searched so far."""

    spec: ModelSpec
    devices_per_node: int
    plans: list[_Plan] = field(default_factory=list)
    least: dict[str, tuple[float | None, float]] = field(default_factory=dict)
    _in: dict[tuple[int, str], bool] = field(default_factory=dict)

    def add(self, record: dict[str, Any], plan: Plan | None) -> None:
        """Remember a record (its plan when it has one)."""
        budget = float(record["cell"]["budget_gb"])
        status = record.get("status")
        if status == "ok" and plan is not None:
            self.plans.append(_Plan(record["method"], budget, plan,
                                    float(record["samples_per_s"]),
                                    float(record["peak_memory_bytes"])))
        elif record.get("from_budget_gb") is not None:
            return  # itself known from an earlier search, which is remembered
        elif status == "infeasible" and record.get("min_memory_bytes") is not None:
            self.least[record["method"]] = (float(record["min_memory_bytes"]), budget)
        elif status == "no_plan" and "min_memory_bytes" in record:
            # the search found no plan at all (not an error of its options)
            self.least[record["method"]] = (None, budget)

    def seeds(self, method: Method, budget_gb: float, budget_bytes: float
              ) -> dict[str, tuple[Plan, float]]:
        """The fastest plans found so far in ``method``'s space that fit ``budget_bytes`` and
        their samples/s, by label (the method's name; ``name@BGB`` when found at another
        budget)."""
        best: dict[float, tuple[str, Plan]] = {}  # by samples/s: identical plans once
        for p in self.plans:
            if p.peak_bytes > budget_bytes or p.samples_per_s in best:
                continue
            key = (id(p.plan), method.name)
            if key not in self._in:
                self._in[key] = in_space(p.plan, self.spec, method, self.devices_per_node)
            if self._in[key]:
                label = p.method if p.budget_gb == budget_gb else f"{p.method}@{p.budget_gb:g}GB"
                best[p.samples_per_s] = (label, p.plan)
        top = sorted(best, reverse=True)[:SEEDS]
        return {best[s][0]: (best[s][1], s) for s in top}

    def known_infeasible(self, method: Method, budget_bytes: float
                         ) -> dict[str, Any] | None:
        """The record fields of ``method`` at a budget it is already known not to fit (or to
        have no plan at any budget), None when it must be searched."""
        if method.name not in self.least:
            return None
        least, at = self.least[method.name]
        if least is None:
            return {"status": "no_plan", "from_budget_gb": at,
                    "message": f"the space has no plan for this model on this cluster (found "
                               f"by its search at {at:g} GB; it does not depend on the budget)"}
        if budget_bytes >= least - REPORT_STEP:
            return None
        return {"status": "infeasible", "min_memory_bytes": least, "from_budget_gb": at,
                "message": f"memory budget {budget_bytes / GB:.3f} GB per device is too small: "
                           f"the least memory any plan of this space needs is "
                           f"{least / GB:.3f} GB (found by its search at {at:g} GB)"}
