"""The moves of a micro-batch's activation between layouts on a stage, and their prices.

:func:`chunk_moves` lists every relayout, p2p hop and sequence-parallel boundary the runtime
makes for one model chunk (``models/gpt.py`` ``run_layers``); :func:`move_cost` prices one
with ``cost_time.relayout_cost`` / ``stage_boundary_cost`` and
``layout.sequence_parallel_boundary_collectives``. ``estimate.evaluate_plan`` adds them to each
stage's time per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...layout import (Collective, Layout, dp_size, layout_of,
                       sequence_parallel_boundary_collectives, vocab_layout)
from ...plan import Plan
from ..inputs.cluster_model import ClusterModel
from ..inputs.model_spec import ModelSpec
from ..inputs.profiles import ModelProfile
from .memory_model import GRAD_BYTES
from .time_model import MoveCost, collective_time, relayout_cost, stage_boundary_cost


@dataclass(frozen=True)
class Move:
    """One move of a micro-batch's activation on a stage, from layout ``old`` to ``new``
    (``bytes_per_sample`` each); ``hop``: it first crosses the p2p hop from the previous stage
    (``old`` is then the previous chunk's last layer layout). Sequence parallelism:
    ``leave_sp``: ``old`` is a run of SP layers that ends here (all-gather the sequence over its
    TP group first; with ``old == new`` that is all the move does, before a stage's send);
    ``enter_sp``: ``new`` starts a run of SP layers (keep this rank's positions; backward
    all-gathers the gradient). ``models/gpt.py`` ``run_layers`` makes exactly these moves."""

    old: Layout
    new: Layout
    bytes_per_sample: float
    hop: bool = False
    leave_sp: bool = False
    enter_sp: bool = False
    sp_bytes_per_sample: float = 0.0  # what the SP boundaries gather (0: bytes_per_sample)


def chunk_moves(plan: Plan, spec: ModelSpec, profile: ModelProfile, chunk: int) -> list[Move]:
    """Every move the runtime makes for model chunk ``chunk`` per micro-batch, in forward order:
    embedding -> first layer (chunk 0) or the hop from the previous chunk's stage, layer ->
    layer, then last layer -> final norm and head (last chunk, on the vocab layout) or, when
    the chunk ends on an SP layer, the all-gather of the sequence before the send.
    ``bytes_per_sample`` is the layer's ``moved_bytes_per_sample`` on the layer side (the
    receiving layer between two; its hidden state and, for T5, the carry beside it), into the
    head the last layer's hidden state; the SP boundaries move the hidden state alone."""
    n = plan.stage_size
    vocab = vocab_layout(plan.vocab.tp, n, plan.cp_size)
    ids = list(plan.chunk_layer_range(chunk))

    def bps(i: int) -> float:
        return profile.layer_types[spec.layer_type(i).name].moved_bytes_per_sample

    def lay(i: int) -> Layout:
        return layout_of(plan.layers[i], n)

    def sp(i: int) -> bool:
        return plan.layers[i].sequence_parallel and plan.layers[i].tp > 1

    def hidden(i: int) -> float:
        return profile.layer_types[spec.layer_type(i).name].hidden_bytes_per_sample

    if chunk == 0:
        out = [Move(vocab, lay(ids[0]), bps(ids[0]), enter_sp=sp(ids[0]),
                    sp_bytes_per_sample=hidden(ids[0]))]
    else:
        out = [Move(lay(ids[0] - 1), lay(ids[0]), bps(ids[0]), hop=True, enter_sp=sp(ids[0]),
                    sp_bytes_per_sample=hidden(ids[0]))]
    for i in ids[1:]:
        # consecutive SP layers of one layout pass their sequence chunks straight on
        same_run = sp(i - 1) and sp(i) and lay(i - 1) == lay(i)
        out.append(Move(lay(i - 1), lay(i), bps(i), leave_sp=sp(i - 1) and not same_run,
                        enter_sp=sp(i) and not same_run, sp_bytes_per_sample=hidden(i)))
    if chunk == plan.num_chunks - 1:  # only the hidden state goes on to the head
        out.append(Move(lay(ids[-1]), vocab, hidden(ids[-1]), leave_sp=sp(ids[-1])))
    elif sp(ids[-1]):
        out.append(Move(lay(ids[-1]), lay(ids[-1]), bps(ids[-1]), leave_sp=True,
                        sp_bytes_per_sample=hidden(ids[-1])))
    return out


def stage_moves(plan: Plan, spec: ModelSpec, profile: ModelProfile, stage: int) -> list[Move]:
    """:func:`chunk_moves` of every chunk of ``stage`` (one unless interleaved)."""
    return [m for c in plan.stage_chunks(stage) for m in chunk_moves(plan, spec, profile, c)]


def sp_boundary(move: Move, plan: Plan) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """``(forward, backward)`` SP boundary collectives of a move (``layout.py``'s description)."""
    n, b_m = plan.stage_size, plan.microbatch_size
    per_sample = move.sp_bytes_per_sample or move.bytes_per_sample
    forward: tuple[Collective, ...] = ()
    backward: tuple[Collective, ...] = ()
    if move.leave_sp:
        f, b = sequence_parallel_boundary_collectives(
            move.old, b_m / dp_size(move.old, n) * per_sample, entering=False)
        forward, backward = forward + f, backward + b
    if move.enter_sp:
        f, b = sequence_parallel_boundary_collectives(
            move.new, b_m / dp_size(move.new, n) * per_sample, entering=True)
        forward, backward = forward + f, backward + b
    return forward, backward


def move_cost(cluster: ClusterModel, move: Move, plan: Plan) -> MoveCost:
    """``cost_time.relayout_cost`` of a move, or ``stage_boundary_cost`` when it hops, plus its
    SP boundary all-gathers (the gathered sequence counts as transient)."""
    n, b_m = plan.stage_size, plan.microbatch_size
    if move.hop:
        cost = stage_boundary_cost(cluster, move.old, move.new, b_m, move.bytes_per_sample, n,
                                   plan.pp_size)
    else:
        cost = relayout_cost(cluster, move.old, move.new, b_m, move.bytes_per_sample, n)
    forward, backward = sp_boundary(move, plan)
    if not forward and not backward:
        return cost
    price = lambda cs: sum(collective_time(cluster, c, n) for c in cs)  # noqa: E731
    gathered = max(c.nbytes for c in forward + backward)
    return MoveCost(cost.forward + price(forward), cost.backward + price(backward),
                    max(cost.transient_bytes, gathered))


def sp_reduced_tensor_bytes(spec: ModelSpec, layer: int) -> tuple[float, ...]:
    """Gradient bytes of the tensors an SP layer all-reduces over its TP group in backward
    (``models/transformer.py``): the two norms' weights (and LayerNorm biases) and the two
    row-parallel biases, fp32 gradients of ``h`` elements each."""
    lt = spec.layer_type(layer)
    norms = 4 if lt.normalization == "layernorm" else 2
    biases = 2 if lt.add_bias_linear else 0
    return (float(GRAD_BYTES * lt.hidden_size),) * (norms + biases)
