"""The pipeline schedules' rules: the order each stage computes in, and what it holds meanwhile.

The one source of these rules for the runtime (``parallel/pipeline.py``, ``parallel/interleaved.py``
run them) and the cost model (``planner/cost/estimate.py``, ``planner/cost/interleaving.py`` price
them); pure Python, no torch. A plan has ``pp`` stages, ``v`` model chunks per stage
(``pipeline.virtual_size``; chunk ``c`` runs on stage ``c % pp``) and ``m`` micro-batches.

- GPipe: every forward, then every backward, in micro-batch order; a stage holds all ``m``
  micro-batches' activations at its peak.
- 1F1B (PipeDream-flush, ``v == 1``): stage ``k`` runs ``min(pp - k - 1, m)`` warm-up
  forwards, so that the last stage can start its backward at once; then alternates one forward
  and one backward (steady state); then runs the remaining backwards (cool-down). At most
  ``min(pp - k, m)`` micro-batches are in flight.
- Interleaved 1F1B (Megatron's virtual pipeline, ``v > 1``): virtual micro-batch ``t``
  (0 .. ``m v - 1``) of a stage is micro-batch ``(t // (pp v)) pp + t % pp`` of its local chunk
  ``(t // pp) % v`` in forward and of local chunk ``v - 1 - (t // pp) % v`` in backward:
  micro-batches move in groups of ``pp`` through the chunks, which is why ``m`` must be a
  multiple of ``pp`` (Megatron's rule; plan validation says so). Stage ``k`` first runs
  ``W_k = 2 (pp - k - 1) + (v - 1) pp`` warm-up forwards (capped by the ``m v`` forwards of the
  iteration, and all of them when ``m == pp``, as in Megatron), then alternates forward
  ``W_k + i`` and backward ``i``, then runs the remaining backwards. At most
  ``min(W_k + 1, m v)`` (micro-batch, chunk) activations are in flight.

1F1B is the interleaved rule's ``v == 1`` case in everything but the warm-up count, so
:func:`interleaved_order` gives both orders.
"""

from __future__ import annotations

Op = tuple[bool, int, int]  # (is_forward, micro-batch, model chunk)


def virtual_microbatch(t: int, pp: int, v: int, stage: int, forward: bool) -> tuple[int, int]:
    """``(micro-batch, model chunk)`` of a stage's ``t``-th forward (or backward)."""
    group, within = divmod(t, pp * v)
    local = within // pp
    if not forward:
        local = v - 1 - local
    return group * pp + within % pp, local * pp + stage


def num_warmup(pp: int, v: int, num_microbatches: int, stage: int) -> int:
    """Forwards stage ``stage`` runs before its first backward under 1F1B (``v == 1``) or
    interleaved 1F1B (``v > 1``): Megatron's counts (module docstring)."""
    if v == 1:
        return min(pp - stage - 1, num_microbatches)
    total = num_microbatches * v
    if num_microbatches == pp:
        return total
    return min(2 * (pp - stage - 1) + (v - 1) * pp, total)


def max_in_flight(pp: int, v: int, num_microbatches: int, stage: int) -> int:
    """The most (micro-batch, chunk) activations stage ``stage`` holds at once under 1F1B
    (``v == 1``) or interleaved 1F1B: its warm-up and the steady state's first forward."""
    return min(num_warmup(pp, v, num_microbatches, stage) + 1, num_microbatches * v)


def in_flight(schedule: str, pp: int, stage: int, num_microbatches: int) -> int:
    """Micro-batches whose activations a non-interleaved stage holds at its peak: all of them
    under GPipe, ``min(pp - stage, m)`` under 1F1B."""
    if schedule == "gpipe":
        return num_microbatches
    return max_in_flight(pp, 1, num_microbatches, stage)


def interleaved_order(pp: int, v: int, num_microbatches: int, stage: int) -> list[Op]:
    """The compute order of one stage, ``(is_forward, micro-batch, model chunk)`` per op:
    warm-up forwards, the steady state's forward-backward pairs, the cool-down's backwards
    (interleaved with ``v > 1``; the 1F1B order with ``v == 1``). Raises ``ValueError`` when
    an interleaved schedule's ``num_microbatches`` is not a multiple of ``pp``."""
    if v > 1 and num_microbatches % pp:
        raise ValueError(f"num_microbatches={num_microbatches}: the interleaved schedule needs a "
                         f"multiple of the pipeline size {pp}")
    total = num_microbatches * v
    warmup = num_warmup(pp, v, num_microbatches, stage)
    fwd = [(True, *virtual_microbatch(t, pp, v, stage, True)) for t in range(total)]
    bwd = [(False, *virtual_microbatch(t, pp, v, stage, False)) for t in range(total)]
    order = fwd[:warmup]
    for i in range(total - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[total - warmup:]
