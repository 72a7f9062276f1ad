"""Per-stage optimizer offload: one search task whose stages each choose their own fraction.

A uniform task (``tasks.Task``) prices every stage at one ``pipeline.optimizer_offload_fraction``
(``SpaceRules.optimizer_offload``); the driver builds one per fraction searched. Stages differ,
though: under 1F1B stage 0 holds ``pp`` micro-batches of activations and the last stage one,
and the stages holding the embedding and head own more parameters, so the stage the device
budget binds on is often the only one worth offloading, while offloading the others lengthens
their optimizer steps (copies and the host's step). A :class:`MixedOffloadTask` holds the
uniform tasks of one (batch, pp, micro-batches, schedule, vocabulary) as its *variants*, and the
exact search (``exact.TaskSearch``) picks a variant at every stage start: the stage's layers are
then priced by that variant's tables, and the plan's field becomes the list of the chosen
fractions.

Why the bounds stay lower bounds: every quantity the walk adds up for a stage (time per
micro-batch, step, sync tail; persistent, transient and step-peak bytes; host bytes) depends
only on that stage's own fraction and strategies (``cost_model.evaluate_plan`` prices each stage
with ``stage_fraction``), so a plan with mixed fractions is, stage by stage, a stage of one of
the variants. The bound rows of a stage (``stage_bound``, ``time_row``) are therefore the
elementwise least over the variants the stage may take, and the future and bottleneck bounds
built from them (``Task.future``, ``Task.bottleneck``) bound every mix. The variants must share
the layer classes (layouts, SP) so that a class index means the same at a stage boundary
between two variants; with the DP modes alone restricted (the offloading variants keep ddp and
zero1) they do, and the driver checks it.

A stage that holds the embedding or the head offloads only where the vocabulary's DP flavour is
one the host optimizer steps (``plan_optimizer_offload``). Interleaved tasks keep one fraction
(a stage's chunks are spread over the walk). The mixed task has no seeds and no least-memory
check of its own: the driver searches it after its variants, whose answers are incumbents
inside its space.
"""

from __future__ import annotations

import numpy as np

from ...plan_optimizer_offload import OFFLOADABLE_DP_MODES, FractionValue
from .tasks import Task


class MixedOffloadTask(Task):
    """A task whose stage ``k`` is priced by any of ``variants`` allowed there (module doc);
    ``variants[0]`` offloads nothing. Its own tables and rules are ``variants[0]``'s."""

    def __init__(self, variants: list[Task]) -> None:
        base = variants[0]
        assert base.v == 1 and base.pp > 1 and not base.rules.optimizer_offload
        assert all(same_classes(base, v) for v in variants), "variants must share classes"
        key = (base.global_batch, base.pp, base.m, base.schedule, base.rules)
        super().__init__(base.spec, base.profile, base.cluster, base.world_size,
                         base.global_batch, base.pp, base.m, base.schedule, base.rules,
                         base.vocab, base.budget, base.step, {key: base.tables},
                         cache=base.cache)
        self.variants = variants
        self.fractions = [float(v.rules.optimizer_offload) for v in variants]
        ends = base.vocab.dp_mode in OFFLOADABLE_DP_MODES
        # per stage, the variant indices it may take
        self.allowed = [[j for j in range(len(variants))
                         if j == 0 or ends or k not in (0, base.pp - 1)]
                        for k in range(base.pp)]

    @property
    def lagrange_applies(self) -> bool:
        """No: its stages' costs are the variants' (lagrange_bound reads one task's tables)."""
        return False

    def stage_variants(self, k: int) -> list[tuple[int, Task]]:
        return [(j, self.variants[j]) for j in self.allowed[k]]

    def field(self, picks: list[int]) -> FractionValue:
        """``pipeline.optimizer_offload_fraction`` of a plan whose stages took ``picks``: one
        number when every stage took the same."""
        values = tuple(self.fractions[j] for j in picks)
        return values[0] if len(set(values)) == 1 else values

    def _least(self, name: str, k: int, *args) -> np.ndarray:
        key = (name, k) + args
        if key not in self._future:
            self._future[key] = np.minimum.reduce(
                [getattr(v, name)(k, *args) for _, v in self.stage_variants(k)])
        return self._future[key]

    def stage_bound(self, k: int, start: int, b: int) -> np.ndarray:
        return self._least("stage_bound", k, start, b)

    def time_row(self, k: int, start: int, tail: bool) -> np.ndarray:
        return self._least("time_row", k, start, tail)

    def cheap_bound(self, with_embedding: bool = True) -> float:
        """``Task.cheap_bound`` with each layer type's fastest strategy and each end's
        embedding/head time the least over the variants (pp > 1: the balanced-stages form)."""
        if with_embedding in self._cheap:
            return self._cheap[with_embedding]
        if not with_embedding:  # the layers' compute: the same in every variant
            out = min(v.cheap_bound(False) for v in self.variants)
        else:
            counts = np.bincount(np.asarray(self.spec.layer_order),
                                 minlength=len(self.spec.layer_types))
            fastest = np.min([[float(c.microbatch.min()) for c in v.tables.one]
                              for v in self.variants], axis=0)
            ends = sum(min(v.emb[k].microbatch for _, v in self.stage_variants(k))
                       for k in {0, self.pp - 1})
            least = float(counts @ fastest) + ends
            out = least * (1 + (self.m - 1) / self.pp) + self.overhead
        self._cheap[with_embedding] = out
        return out


def same_classes(a: Task, b: Task) -> bool:
    """Whether two tasks' layer tables number the classes alike (module docstring)."""
    return a.tables.layouts == b.tables.layouts


def stage_variants(task: Task, k: int) -> list[tuple[int, Task]]:
    """The variants stage ``k`` of ``task`` may take: a uniform task has one, itself."""
    if isinstance(task, MixedOffloadTask):
        return task.stage_variants(k)
    return [(0, task)]
