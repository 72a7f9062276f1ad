"""The branch and bound's shared state: the incumbent across tasks and the named running sums
of one task's walk (``exact`` walks them; its module docstring gives the arguments).

- :class:`Incumbent`: the best plan so far, its nodes and leaves, and the certified gap's
  least bound of every set of plans left unsearched;
- :class:`Placed`: the stages placed so far, as the bounds and the stage dominance read them;
- :class:`StageState`: the running sums of the stage being built;
- :class:`StageMemory`: what an interleaved stage's earlier chunks placed;
- :class:`Candidates`: one layer's strategies, each extending the stage's sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ...plan import Plan
from ..cost.estimate import Estimate
from .dominance import StageDominance
from .spaces import SpaceRules
from .stage_costs import StrategyCosts

TIE = 1e-9
MEMORY_SLACK = 1e-9  # relative: our sums and evaluate_plan's may differ in the last bits


def host_fits(est: Estimate, rules: SpaceRules) -> bool:
    """Whether a priced plan's host memory (optimizer offload, activation offload) fits the
    task's host budget (``SpaceRules.host_memory_budget_bytes``; None: nothing offloads)."""
    budget = rules.host_memory_budget_bytes
    if budget is None:
        return not est.host_memory_bytes
    return est.host_memory_bytes <= budget * (1 + MEMORY_SLACK)


NcclLayouts = frozenset[tuple[int, ...]]  # (tp, consecutive[, cp]) of the layouts a stage groups


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
    # The certified gap: a set of plans is pruned once its bound times (1 + gap) reaches the
    # incumbent, and ``lower`` keeps the least bound (seconds per sample) of every set left
    # unsearched below the incumbent of its time, by the gap or by the deadline.
    gap: float = 0.0
    lower: float = math.inf

    def cutoff(self) -> float:
        """Seconds per sample a set of plans must be bounded below to be searched."""
        return self.value * (1 - TIE) / (1 + self.gap)

    def prune(self, bound: float) -> None:
        """Plans bounded below by ``bound`` (seconds per sample) are left unsearched; bounds
        within ``TIE`` of the incumbent or above are ties or worse (it only falls)."""
        if bound < self.value * (1 - TIE):
            self.lower = min(self.lower, bound)

    def lower_bound(self) -> float:
        """Seconds per sample no plan of the searched tasks is below (up to ``TIE``)."""
        return min(self.value, self.lower)


class Placed(NamedTuple):
    """The stages placed so far (their times per micro-batch ``C``, backward parts ``B``, sync
    tails and optimizer steps), as the bounds and the stage dominance read them."""

    sum_time: float = 0.0  # sum C (stage dominance)
    sum_time_tail: float = 0.0  # sum C + tail_0 (the bottleneck bound's sum)
    max_time: float = 0.0  # max C
    sum_backward: float = 0.0  # sum B
    exposed: float = -math.inf  # E = max_k (tail_k - sum_{j<k} B_j)
    max_step: float = 0.0  # the largest optimizer step

    def dominance_state(self) -> np.ndarray:
        """What ``dominance.StageDominance`` compares (its module docstring)."""
        return StageDominance.state(self.sum_time, self.max_time, self.sum_backward,
                                    self.exposed, self.max_step)


class StageMemory(NamedTuple):
    """What an interleaved stage's earlier chunks placed, carried into its next chunk."""

    persistent: float
    transient: float  # the largest so far
    step_peak: float
    layouts: NcclLayouts


class StageState(NamedTuple):
    """Exact running sums of the stage being built (``evaluate_plan``'s terms)."""

    microbatch: float  # seconds per micro-batch, moves included
    optimizer: float
    exposed: float  # exposed sync tail
    persistent: float  # bytes
    transient: float  # the largest transient so far
    step_peak: float  # the step peak's floor (bytes)
    last_class: int  # the last layer's class, type and strategy index (-1: none yet)
    last_type: int
    last_index: int
    layouts: NcclLayouts  # layouts the stage's NCCL groups come from so far
    backward: float = 0.0  # the stage's backward part (stage dominance only)
    host: float = 0.0  # host bytes of the stage's offloaded activations so far (v = 1 only)


class Candidates(NamedTuple):
    """One layer's candidate strategies: the stage's running sums extended by each (arrays
    over the candidates ``s``), and which of them the memory cut and the symmetry rule keep."""

    costs: StrategyCosts
    classes: np.ndarray
    layers_left: int  # layers of the chunk still to place after this one
    limit: np.ndarray | float  # the bytes the stage may hold, less its NCCL floor
    microbatch: np.ndarray
    backward: np.ndarray | None  # None without stage dominance
    optimizer: np.ndarray
    exposed: np.ndarray
    persistent: np.ndarray
    transient: np.ndarray
    step_peak: np.ndarray
    keep: np.ndarray  # bool: fits the memory cuts and passes the symmetry rule
    host: np.ndarray  # the stage's offloaded-activation host bytes with each candidate
