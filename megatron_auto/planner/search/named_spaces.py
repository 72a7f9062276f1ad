"""The named search spaces (``--search-space``) as the sub-spaces the search builds tasks from:
the full space, the baselines (``options.BASELINE_SPACES``), the full space without context
parallelism, and Galvatron 2.4's space (``options.GALVATRON_SPACE``). Pure, no torch."""

from __future__ import annotations

from dataclasses import replace

from .options import GALVATRON_SPACE, NO_CP_BASELINE, SPACES, SearchOptions
from .spaces import Space, SpaceRules, divisors


def spaces_of(name: str, options: SearchOptions, world: int) -> list[Space]:
    """The sub-spaces a named space is the union of (several only for megatron3d)."""
    sp = {None: (False, True), True: (True,), False: (False,)}[options.sequence_parallel]
    base = SpaceRules(dp_modes=tuple(options.dp_modes), allow_recompute=options.allow_recompute,
                      max_tp=options.max_tp, allow_strided=options.allow_strided_tp,
                      tps=(options.tp,) if options.tp is not None else None,
                      sequence_parallel=sp, module_recompute=tuple(options.module_recompute),
                      eps=(options.expert_parallel,) if options.expert_parallel else None,
                      expert_tps=((options.expert_tensor_parallel,)
                                  if options.expert_tensor_parallel else None),
                      cp_modes=tuple(options.cp_modes),
                      host_memory_budget_bytes=options.host_memory_budget_bytes,
                      activation_offload=(options.host_memory_budget_bytes is not None
                                          and options.activation_offload))
    if name == "full":  # its CP degrees: cp_space.cp_degrees per stage size
        return [Space("full", base, cps=None)]
    if name == NO_CP_BASELINE:  # the full space's plans without context parallelism
        return [Space(name, base)]
    if name == "dp":
        return [Space(name, SpaceRules(tps=(1,), dp_modes=("ddp",), allow_recompute=False),
                      pps=(1,), vocab_tp=1, vocab_modes=("ddp",), even_split=True)]
    if name == "zero3":
        return [Space(name, SpaceRules(tps=(1,), dp_modes=("zero3",), allow_recompute=False),
                      pps=(1,), vocab_tp=1, vocab_modes=("zero3",), even_split=True)]
    if name == "tp":
        return [Space(name, SpaceRules(tps=(world,), dp_modes=("ddp",), allow_recompute=False),
                      pps=(1,), vocab_tp=world, vocab_modes=("ddp",), even_split=True)]
    if name == "pp":
        return [Space(name, SpaceRules(tps=(1,), dp_modes=("ddp",), allow_recompute=False),
                      pps=(world,), vocab_tp=1, vocab_modes=("ddp",), even_split=True)]
    if name == "galvatron-base":  # Galvatron's base space: no recompute, no Megatron-SP
        return [Space(name, replace(base, allow_recompute=False, sequence_parallel=(False,)),
                      even_split=True)]
    if name == GALVATRON_SPACE:
        # Galvatron 2.4's decision tree (its search engine's generate_strategies, with the
        # --default_dp_type zero2 its shipped scripts use): per layer tp (consecutive or
        # strided groups), DP as ZeRO-2 or SDP (ZeRO-3) and full checkpointing or none; any pp
        # with its own partition; the embedding and head at any tp, under ZeRO-2 or ZeRO-3
        # (its embed_sdp). Megatron-SP is its global --sequence_parallel: on every tp > 1
        # layer with our --sequence-parallel, else off. No interleaving, context or expert
        # parallelism, module recompute or offload: it has none of them. A superset of
        # Galvatron's plans: it ties the vocabulary's tp to the least layer tp and cuts
        # partitions by heuristics, where this space leaves both free.
        modes = tuple(m for m in ("zero2", "zero3") if m in options.dp_modes)
        rules = replace(base, dp_modes=modes, sequence_parallel=(True,) if sp == (True,)
                        else (False,), module_recompute=(), eps=(1,), expert_tps=(1,),
                        cp_modes=("ring",), host_memory_budget_bytes=None,
                        activation_offload=False)
        return [Space(name, rules, vocab_modes=modes, interleave=False)]
    if name == "megatron3d":
        out = []
        for tp in divisors(world):
            # full recompute on every layer or none; none only without allow_recompute
            for recompute in (False, True) if options.allow_recompute else (False,):
                rules = SpaceRules(tps=(tp,), dp_modes=("ddp",), allow_recompute=recompute,
                                   allow_strided=False, force_recompute=recompute,
                                   max_tp=options.max_tp)
                out.append(Space(f"megatron3d[tp={tp},recompute={recompute}]", rules,
                                 vocab_tp="layer", vocab_modes=("ddp",), even_split=True))
        return out
    raise ValueError(f"search option space={name!r}: choose one of {', '.join(SPACES)}")
