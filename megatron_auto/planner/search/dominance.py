"""Stage-level dominance of the exact search's partial plans (non-interleaved tasks).

When the branch and bound has placed stages ``0..K-1`` ending at layer ``a`` with the last
layer in class ``c``, every completion (stages ``K..pp-1``) is the same set of plans, feasible
or not alike: a stage's memory depends only on its own layers, its incoming layout (class
``c``) and the task (``cost_model.evaluate_plan``). What a completion's iteration time takes
from the placed stages (``cost_time.pipeline_time``, ``T = t_pipe + max(0, max_k(tail_k -
sum_{j<k} B_j)) + max_k step_k + overhead`` with ``t_pipe = sum C + (m - 1) max C``) is:

- ``sum C`` and ``max C`` of the placed stages (``t_pipe`` grows with both),
- ``E = max_{k<K}(tail_k - sum_{j<k} B_j)`` (their own exposed tails),
- ``sum C - sum B`` (a completion stage's tail is hidden behind the placed stages' backward:
  ``t_pipe - sum_{j<K} B_j`` contains the placed stages as ``sum C - sum B``),
- ``max step``.

``T`` does not decrease in any of the five, so a partial plan ``Y`` whose five values are each
at least those of a partial plan ``X`` already searched under the same key ``(K, a, c)`` has no
completion better than ``X`` with the same completion: every plan below ``X`` was priced or cut
by a bound at least the incumbent of that moment, which only falls. ``Y`` is cut. (Our sums
and ``evaluate_plan``'s may differ in the last bits, far below the search's ``TIE``.)

Inside a stage (any pp, v = 1), the same argument over the partial stage: two partial stages
below the same placed stages and the same stage start and length, ending at the same layer on
the same strategy (its class, and its index, which the symmetry rule reads) with the same set
of NCCL layouts, are completed by the same layers alike. The stage's time, forward part
(``C - B``), exposed tail and step are the partial sums plus the rest's, and its peaks are
sums and maxima of the partial ones with the rest's; so a partial stage at least another in
time per micro-batch, optimizer step, exposed sync, forward part, persistent bytes, largest
transient, step-peak bytes and offloaded host bytes is cut (the host bytes: a completion that
fits the host budget after the one may not after the other). Both rules are checked by the exhaustive tests (the
search with them equals the enumerated optimum) and the first on ``pipeline_time`` directly
(tests/test_planner_exact_bottleneck.py).
"""

from __future__ import annotations

import numpy as np


class StageDominance:
    """The non-dominated prefix states met so far, per key (one search of one task)."""

    def __init__(self) -> None:
        self._store: dict[tuple, np.ndarray] = {}
        self.cut = 0

    @staticmethod
    def state(sum_c: float, max_c: float, sum_b: float, exposed: float,
              max_step: float) -> np.ndarray:
        """The compared values of a prefix (module docstring), each to be minimised."""
        return np.array([sum_c, max_c, sum_c - sum_b, exposed, max_step])

    def admit(self, key: tuple, y: np.ndarray) -> bool:
        """False when a stored state under ``key`` is at most ``y`` everywhere (``y`` is cut);
        else ``y`` is stored (and the states it dominates dropped) and True."""
        arr = self._store.get(key)
        if arr is None:
            self._store[key] = y[None, :]
            return True
        if (arr <= y[None, :]).all(axis=1).any():
            self.cut += 1
            return False
        keep = ~(y[None, :] <= arr).all(axis=1)
        self._store[key] = np.concatenate([arr[keep], y[None, :]])
        return True
