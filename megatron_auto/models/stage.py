"""What every model family's pipeline stage starts from (GPT/BERT, T5, ViT/Swin).

A stage checks the plan against its config before it builds anything, owns this rank's dropout
streams (``parallel/random.py``: seeded by the run seed, the stage and, for the TP stream, the
rank's local index, so the masks never depend on the plan), and knows where it sits in the
pipeline and the groups of the vocabulary layout (embedding and heads, first and last stage).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..parallel.context import ParallelContext
from ..parallel.random import RNGTracker
from ..plan import Plan, PlanError


class PipelineStage(nn.Module):
    """The common part of a stage: ``config``, ``ctx``, ``seed``, ``rng`` (the rank's
    :class:`RNGTracker`), ``is_first_stage``/``is_last_stage`` and ``vocab_groups`` (None on a
    stage that holds neither the embedding nor a head). Raises the plan's ``PlanError`` when
    ``ctx.plan`` does not fit ``config``."""

    def __init__(self, config: Any, ctx: ParallelContext, seed: int) -> None:
        super().__init__()
        ctx.plan.validate(config)
        self.config, self.ctx, self.seed = config, ctx, seed
        self.rng = RNGTracker(seed, stage=ctx.stage, local_index=ctx.local_index,
                              device=ctx.device)
        self.is_first_stage, self.is_last_stage = ctx.is_first_stage, ctx.is_last_stage
        self.vocab_groups = (ctx.vocab_groups()
                             if self.is_first_stage or self.is_last_stage else None)


def refuse_interleaving_and_sequence_parallel(plan: Plan, runs_only: str,
                                              does_not_run: str) -> None:
    """For a family whose stages run neither the interleaved schedule nor sequence
    parallelism yet: the ``PlanError`` naming the field, e.g. ``runs_only="T5 runs only"``,
    ``does_not_run="T5 does not run"``."""
    if plan.virtual_size != 1:
        raise PlanError(f"plan field pipeline.virtual_size={plan.virtual_size}: {runs_only} "
                        f"non-interleaved schedules; use virtual_size 1")
    for i, layer in enumerate(plan.layers):
        if layer.sequence_parallel:
            raise PlanError(f"plan field layers[{i}].sequence_parallel=True: {does_not_run} "
                            f"sequence parallelism yet; set it to false")
