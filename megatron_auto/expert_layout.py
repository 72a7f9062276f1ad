"""Expert-parallel rank arithmetic shared by the runtime (parallel/expert_parallel.py) and the
cost model: an MoE layer's EP, expert-TP and expert-DP groups inside its stage layout. Pure, no
torch (a sibling of layout.py, whose layouts it extends)."""

from __future__ import annotations

from typing import NamedTuple, Sequence

from .layout import StageLayout, dp_group_ranks, make_layout, tp_dp_rank, tp_group_ranks
from .plan import Plan


class ExpertLayout(NamedTuple):
    """The expert grid of an MoE layer on its stage: the layer's layout (``tp``, TP order) with
    ``ep`` and ``expert_tp``. Build it with :func:`expert_layout`.

    Rank arithmetic (a rank's local index ``j``; ``t, d`` its TP and DP rank under the layer's
    layout; ``D_t`` its DP group and ``T_d`` its TP group, both ordered by rank):

    - EP group: ``ep`` members of ``D_t`` at consecutive DP ranks, ``{D_t[e*ep + r]}`` for
      ``e = d // ep``; ``ep_rank = d % ep``. EP rank ``r`` holds experts
      ``[r*E/ep, (r+1)*E/ep)``. Consecutive DP ranks are the closest ranks a DP group has, and
      the all-to-all is the expert layer's heaviest collective.
    - expert-TP group: ``expert_tp`` consecutive members of ``T_d``, ``{T_d[k*etp + i]}`` for
      ``k = t // etp``; ``expert_tp_rank = t % etp``. The ``tp / etp`` such groups of one TP
      group hold the same tokens and the same expert shards: they compute the same thing
      (``expert_replica = k``), so only replica 0 counts a gradient in the norm.
    - expert-DP group: the ``dp / ep`` members of ``D_t`` with the same EP rank,
      ``{D_t[e*ep + r]}`` over ``e``; ``expert_dp_rank = e``. They hold the same expert shard
      and see different tokens: their gradients are summed.
    """

    stage: int
    tp: int
    consecutive: bool
    ep: int
    expert_tp: int

    @property
    def stage_layout(self) -> StageLayout:
        return StageLayout(self.stage, self.tp, self.consecutive)


def expert_layout(stage: int, tp: int, consecutive: bool, ep: int, expert_tp: int,
                  stage_size: int) -> ExpertLayout:
    """The normalised :class:`ExpertLayout` (its TP order as :func:`make_layout`'s)."""
    local = make_layout(tp, consecutive, stage_size)
    dp = stage_size // local.tp
    if ep < 1 or dp % ep:
        raise ValueError(f"ep={ep}: must divide the layer's {dp} data-parallel ranks")
    if expert_tp < 1 or local.tp % expert_tp:
        raise ValueError(f"expert_tp={expert_tp}: must divide the layer's tp={local.tp}")
    return ExpertLayout(stage, local.tp, local.consecutive, ep, expert_tp)


class ExpertRanks(NamedTuple):
    """One rank's three expert groups (global ranks, each in group-rank order) and its
    positions in them (see :class:`ExpertLayout`)."""

    ep_ranks: tuple[int, ...]
    ep_rank: int
    expert_tp_ranks: tuple[int, ...]
    expert_tp_rank: int
    expert_dp_ranks: tuple[int, ...]
    expert_dp_rank: int
    expert_replica: int


def expert_ranks(stage_ranks: Sequence[int], lay: ExpertLayout, local_index: int) -> ExpertRanks:
    """The expert groups of the rank at ``local_index`` of a stage (``stage_ranks``)."""
    n = len(stage_ranks)
    t, d = tp_dp_rank(local_index, n, lay.tp, lay.consecutive)
    dp_group = dp_group_ranks(stage_ranks, lay.tp, lay.consecutive)[t]
    tp_group = tp_group_ranks(stage_ranks, lay.tp, lay.consecutive)[d]
    ep, etp = lay.ep, lay.expert_tp
    e, r = divmod(d, ep)
    k, i = divmod(t, etp)
    return ExpertRanks(
        ep_ranks=tuple(dp_group[e * ep:(e + 1) * ep]), ep_rank=r,
        expert_tp_ranks=tuple(tp_group[k * etp:(k + 1) * etp]), expert_tp_rank=i,
        expert_dp_ranks=tuple(dp_group[r::ep]), expert_dp_rank=e, expert_replica=k)


def plan_expert_layouts(plan: Plan) -> list[ExpertLayout]:
    """The expert grids of a plan's layers with ``ep`` or ``expert_tp`` above 1 or an
    ``expert_dp_mode``, sorted."""
    n = plan.stage_size
    return sorted({expert_layout(plan.stage_of_layer(i), s.tp, s.tp_consecutive, s.ep,
                                 s.expert_tp, n)
                   for i, s in enumerate(plan.layers)
                   if s.ep > 1 or s.expert_tp > 1 or s.expert_dp_mode is not None})


def expert_group_ranks(plan: Plan, lay: ExpertLayout) -> list[tuple[int, ...]]:
    """Every EP, expert-TP and expert-DP group of ``lay`` (each once, in a fixed order)."""
    ranks = plan.stage_ranks(lay.stage)
    out: dict[tuple[int, ...], None] = {}
    for kind in ("ep_ranks", "expert_tp_ranks", "expert_dp_ranks"):
        for j in range(len(ranks)):
            out[getattr(expert_ranks(ranks, lay, j), kind)] = None
    return list(out)


def plan_expert_group_ranks(plan: Plan) -> list[tuple[int, ...]]:
    """The expert groups of every expert grid of a plan, each once, in a fixed order (created
    by ``ParallelContext`` after ``layout.plan_group_ranks``)."""
    out: dict[tuple[int, ...], None] = {}
    for lay in plan_expert_layouts(plan):
        for group in expert_group_ranks(plan, lay):
            out[group] = None
    return list(out)
