"""Every plan of the planner's full space, written out independently of the search.

The space (docs/planner.md §2): pipeline degree ``pp`` (any divisor of the world, at most the
layer count, its stages of ``n`` ranks inside a node or whole nodes: ``n`` divides or is a
multiple of the devices per node), every partition of the layers into ``pp`` non-empty stages,
every micro-batch count ``m`` dividing the global batch, and per layer every TP degree (dividing
the stage, the heads and the FFN size, within a node and dividing it), every TP layout where it
changes the groups (``1 < tp < stage``), every DP flavour (ddp, zero1, zero2, zero3) where there
is more than one replica, Megatron sequence parallelism on or off where ``tp > 1`` divides the
sequence (never on an MoE layer), recompute on or off, and on MoE layers (``LayerType.moe``)
every expert-parallel degree (a power of two dividing the DP ranks and the experts) with the
experts' DP flavour the layer's or, where several ranks share the experts, any other; the
vocabulary every TP degree dividing the stage and the
vocabulary with every DP flavour. A data-parallel degree must divide the micro-batch. Schedule
1F1B, plain and interleaved: with ``pp > 1`` and ``m`` a multiple of ``pp`` (the interleaved
schedule's rule) every virtual size ``v`` of ``VIRTUAL_SIZES`` (the search's default) that
leaves at least one layer per chunk, and every split of the layers into the ``pp v`` chunks
(uneven included; chunk ``c`` on stage ``c mod pp``).

This module deliberately does not import the planner's strategy code: it is the reference the
search is compared with.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator

from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy

DP_MODES = ("ddp", "zero1", "zero2", "zero3")
VIRTUAL_SIZES = (2, 4)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_in_node(tp: int, devices_per_node: int) -> bool:
    """Consecutive TP groups of ``tp`` ranks inside one node, never across a node boundary."""
    return tp <= devices_per_node and devices_per_node % tp == 0


def compositions(n: int, k: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + cuts + (n,)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def split_plans(spec, world: int, batch: int, m: int, pp: int, vocab: VocabStrategy,
                choices: list[LayerStrategy]) -> Iterator[Plan]:
    """Every plain 1F1B plan of ``pp`` stages and ``m`` micro-batches: each split of the
    layers, each layer any of ``choices``, the vocabulary at ``vocab``."""
    for part in compositions(spec.num_layers, pp):
        pipe = PipelineSpec(size=pp, schedule="1f1b", layers_per_stage=part)
        for combo in itertools.product(choices, repeat=spec.num_layers):
            yield Plan(world_size=world, global_batch_size=batch, num_microbatches=m,
                       pipeline=pipe, vocab=vocab, layers=combo, model=spec.plan_model_record())


def layer_choices(spec, n: int, b_m: int, devices_per_node: int, layer_type,
                  dp_modes: tuple[str, ...] = DP_MODES,
                  recompute: tuple[bool, ...] = (False, True)) -> list[LayerStrategy]:
    out = []
    for tp in _divisors(n):
        if not _tp_in_node(tp, devices_per_node) or layer_type.num_attention_heads % tp \
                or layer_type.ffn_hidden_size % tp:
            continue
        dp = n // tp
        if b_m % dp:
            continue
        for consec in ((True, False) if 1 < tp < n else (True,)):
            for mode in (dp_modes if dp > 1 else ("ddp",)):
                moe = getattr(layer_type, "moe", None)
                for sp in ((False, True) if tp > 1 and layer_type.seq_length % tp == 0
                           and moe is None else (False,)):
                    for rc in recompute:
                        for ep, etp, expert_mode in _expert_choices(moe, tp, dp, mode,
                                                                    dp_modes):
                            out.append(LayerStrategy(
                                tp=tp, dp_mode=mode, tp_consecutive=consec, recompute=rc,
                                sequence_parallel=sp, ep=ep, expert_tp=etp,
                                expert_dp_mode=expert_mode))
    return out


def _expert_choices(moe, tp: int, dp: int, mode: str, dp_modes: tuple[str, ...]
                    ) -> list[tuple]:
    """MoE layers: every ep that is a power of two dividing the DP ranks and the experts,
    times every expert TP that is a power of two dividing the layer's tp and the expert
    width, each with the experts in the layer's DP flavour (None) or, where ``dp / ep > 1``
    ranks share them, in any other flavour; dense layers: (1, 1, None) only."""
    if moe is None:
        return [(1, 1, None)]
    out = []
    for ep in (2 ** j for j in range(dp.bit_length())):
        if dp % ep or moe.num_experts % ep:
            continue
        for etp in (2 ** j for j in range(tp.bit_length())):
            if tp % etp or moe.ffn_hidden_size % etp:
                continue
            out.append((ep, etp, None))
            if dp // ep > 1:
                out += [(ep, etp, other) for other in dp_modes if other != mode]
    return out


def vocab_choices(spec, n: int, b_m: int, devices_per_node: int,
                  dp_modes: tuple[str, ...] = DP_MODES) -> list[VocabStrategy]:
    out = []
    for tp in _divisors(n):
        if not _tp_in_node(tp, devices_per_node) or spec.vocab_size % tp or b_m % (n // tp):
            continue
        for mode in (dp_modes if n // tp > 1 else ("ddp",)):
            out.append(VocabStrategy(tp=tp, dp_mode=mode))
    return out


def virtual_sizes(layers: int, pp: int, m: int) -> list[int]:
    """1 and every interleaved virtual size a (pp, m) admits (module docstring)."""
    if pp == 1 or m % pp:
        return [1]
    return [1] + [v for v in VIRTUAL_SIZES if pp * v <= layers]


def _settings(spec, global_batch: int, world: int, devices_per_node: int, restrict: dict
              ) -> Iterator[tuple[int, int, list, list]]:
    """Each (pp, m) of the space with its per-layer strategy choices and vocabulary layouts;
    settings where some layer or the vocabulary has no choice are left out."""
    layers = spec.num_layers
    dp_modes = restrict.get("dp_modes", DP_MODES)
    recompute = restrict.get("recompute", (False, True))
    for pp in _divisors(world):
        if pp > layers or restrict.get("pp", pp) != pp:
            continue
        n = world // pp
        if n % devices_per_node and devices_per_node % n:
            continue  # a stage would straddle a node boundary
        for m in range(1, global_batch + 1):
            if global_batch % m:
                continue
            b_m = global_batch // m
            per_type = [layer_choices(spec, n, b_m, devices_per_node, lt, dp_modes, recompute)
                        for lt in spec.layer_types]
            vocabs = vocab_choices(spec, n, b_m, devices_per_node, dp_modes)
            choices = [per_type[spec.layer_order[i]] for i in range(layers)]
            if vocabs and all(choices):
                yield pp, m, choices, vocabs


def all_plans(spec, global_batch: int, world: int, devices_per_node: int,
              **restrict) -> Iterator[Plan]:
    """Every plan of the full space (see the module docstring), or of the sub-space that
    ``restrict`` names as the search options do: ``pp`` (one degree), ``dp_modes`` (layers and
    vocabulary), ``recompute`` (the values allowed)."""
    layers = spec.num_layers
    for pp, m, choices, vocabs in _settings(spec, global_batch, world, devices_per_node,
                                            restrict):
        for v in virtual_sizes(layers, pp, m):
            for part in compositions(layers, pp * v):
                pipe = PipelineSpec(size=pp, schedule="1f1b", layers_per_stage=part,
                                    virtual_size=v)
                for combo in itertools.product(*choices):
                    for vocab in vocabs:
                        yield Plan(world_size=world, global_batch_size=global_batch,
                                   num_microbatches=m, pipeline=pipe, vocab=vocab,
                                   layers=tuple(combo), model=spec.plan_model_record())


def count_plans(spec, global_batch: int, world: int, devices_per_node: int,
                **restrict) -> int:
    """How many plans :func:`all_plans` yields (without building them)."""
    layers = spec.num_layers
    total = 0
    for pp, m, choices, vocabs in _settings(spec, global_batch, world, devices_per_node,
                                            restrict):
        partitions = sum(1 for v in virtual_sizes(layers, pp, m)
                         for _ in compositions(layers, pp * v))
        total += math.prod(len(c) for c in choices) * len(vocabs) * partitions
    return total
