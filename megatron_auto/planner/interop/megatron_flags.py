"""Classic Megatron-LM parallel flags <-> ``Plan``.

Megatron describes one layout for the whole model: ``--tensor-model-parallel-size`` (TP groups of
consecutive ranks), ``--pipeline-model-parallel-size`` (stage ``k`` = ranks ``[k*N/pp,
(k+1)*N/pp)``, the same placement as ours since Megatron's default rank order puts pp outermost),
data parallelism over the rest, optionally ``--use-distributed-optimizer`` (Megatron's
distributed optimizer: optimizer state sharded over DP, our ``zero1``), ``--sequence-parallel``
(every layer ``sequence_parallel``; ignored at tp 1, as Megatron does),
``--num-layers-per-virtual-pipeline-stage N`` (interleaved 1F1B with chunks of N layers; block
recompute then counts per chunk), ``--pipeline-model-parallel-layout`` (Megatron-Core's string
of any partition, interleaved or not: ``megatron_layout.py``), Megatron-FSDP
(``--use-megatron-fsdp --data-parallel-sharding-strategy optim|optim_grads|optim_grads_params``:
our ``zero1``/``zero2``/``zero3`` on every layer), context parallelism
(``--context-parallel-size``, ``--cp-comm-type p2p`` = our ring attention, ``a2a`` = Ulysses;
Megatron's ``all_gather`` and ``a2a+p2p`` are not run here), and recompute flags. Degrees map
one to one; the rank placement under CP differs (Megatron orders ranks tp-cp-dp, our CP blocks
put data parallelism inside each block: ``layout.py``), which changes which ranks talk, not what
is trained.
:func:`plan_from_megatron_flags` turns such a flag set into a uniform :class:`Plan`;
:func:`to_megatron_flags` goes back, or says why a plan has no classic-flag equivalent.

Recompute mapping (a plan's per-layer ``recompute``: ``true`` the whole layer, ``"selective"`` or
a module list):

- ``--recompute-granularity full --recompute-method uniform``: every layer recomputes (Megatron
  checkpoints groups of ``--recompute-num-layers`` layers; all activations inside are recomputed).
- ``--recompute-granularity full --recompute-method block --recompute-num-layers k``: the first
  ``k`` layers of every pipeline stage recompute, the others keep their activations.
- ``--recompute-granularity selective [--recompute-modules M ...]``: every layer recomputes the
  modules (Megatron-Core's default ``core_attn`` = our ``"selective"``; ``layernorm`` is our
  ``norm``); Megatron takes no ``--recompute-method`` / ``--recompute-num-layers`` with it.
  Megatron's MoE and MLA modules have no counterpart yet and are refused.

Expert parallelism: one ``--expert-model-parallel-size`` and one
``--expert-tensor-parallel-size`` for every MoE layer (the plan's ``model.moe`` record says
which layers are MoE), the experts in the layers' DP flavour. Our expert TP defaults to 1 (the
experts replicated over TP), Megatron's to ``--tensor-model-parallel-size``: the export writes
the flag whenever the two differ.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

from ...plan import Plan, PlanError
from ...plan_recompute import normalize_recompute, recompute_parts
from .megatron_layout import LAYOUT_FLAG, LayoutError, chunks_from_layout, layout_string

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
#: ``--recompute-modules`` names (Megatron-Core's) -> the plan's module names.
RECOMPUTE_MODULE_FLAGS = {"core_attn": "core_attn", "mlp": "mlp", "layernorm": "norm"}
#: Megatron-FSDP's ``--data-parallel-sharding-strategy`` -> our dp_mode (``no_shard``: plain
#: data parallelism, or the distributed optimizer with ``--use-distributed-optimizer``).
SHARDING_STRATEGIES = {"no_shard": None, "optim": "zero1", "optim_grads": "zero2",
                       "optim_grads_params": "zero3"}
#: The flags Megatron-FSDP needs beside the strategy (its documentation's required set).
FSDP_FLAGS = ["--use-megatron-fsdp", "--use-distributed-optimizer",
              "--no-gradient-accumulation-fusion", "--ckpt-format", "fsdp_dtensor"]


#: Megatron's ``--cp-comm-type`` -> our ``cp_mode`` (the types we run).
CP_COMM_TYPES = {"p2p": "ring", "a2a": "ulysses"}


class MegatronFlagError(ValueError):
    """Inconsistent classic flags; the message names the flag, the value and the fix."""


def _stage_sizes(num_layers: int, pp: int, first: int | None, last: int | None) -> tuple[int, ...]:
    """Megatron's layer split: even, or ``first``/``last`` stages pinned and the middle even."""
    if first is None and last is None:
        if num_layers % pp:
            raise MegatronFlagError(
                f"--num-layers={num_layers}: Megatron needs it divisible by "
                f"--pipeline-model-parallel-size={pp}; change either, or pin the first/last stage "
                f"with --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")
        return (num_layers // pp,) * pp
    if pp < 2:
        raise MegatronFlagError("--decoder-first/last-pipeline-num-layers need "
                                "--pipeline-model-parallel-size >= 2")
    pinned = [x for x in (first, last) if x is not None]
    if any(x < 1 for x in pinned):
        raise MegatronFlagError(f"--decoder-first/last-pipeline-num-layers={pinned}: "
                                f"each stage needs at least one layer")
    middle_stages = pp - len(pinned)
    rest = num_layers - sum(pinned)
    if middle_stages == 0:
        if rest != 0:
            raise MegatronFlagError(
                f"--decoder-first/last-pipeline-num-layers={pinned}: must sum to --num-layers="
                f"{num_layers} when there are only two stages")
        return (first, last)  # type: ignore[return-value]
    if rest < middle_stages or rest % middle_stages:
        raise MegatronFlagError(
            f"--num-layers={num_layers}: after pinning {pinned} layers, the remaining {rest} must "
            f"split evenly over the {middle_stages} other stage(s); adjust the pinned counts")
    mid = rest // middle_stages
    sizes = [mid] * pp
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    return tuple(sizes)


def plan_from_megatron_flags(
        *, world_size: int, num_layers: int, global_batch_size: int, micro_batch_size: int,
        tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
        use_distributed_optimizer: bool = False,
        recompute_granularity: str | None = None, recompute_method: str | None = None,
        recompute_num_layers: int | None = None, recompute_modules: Sequence[str] | None = None,
        decoder_first_pipeline_num_layers: int | None = None,
        decoder_last_pipeline_num_layers: int | None = None,
        sequence_parallel: bool = False,
        num_layers_per_virtual_pipeline_stage: int | None = None,
        pipeline_model_parallel_layout: str | None = None,
        use_megatron_fsdp: bool = False, data_parallel_sharding_strategy: str | None = None,
        model: Mapping[str, Any] | None = None, context_parallel_size: int = 1,
        cp_comm_type: str = "p2p", expert_model_parallel_size: int = 1,
        moe_layers: Sequence[int] = (), expert_tensor_parallel_size: int = 1) -> Plan:
    """The uniform plan a classic Megatron flag set describes.

    ``num_microbatches = global_batch_size / (micro_batch_size * dp)`` with
    ``dp = world_size / (tp * pp * cp)``; every divisibility is checked with the flag named.
    ``expert_model_parallel_size``: the ``ep`` of every layer of ``moe_layers`` (the model's MoE
    layers), which must divide the data-parallel size; ``expert_tensor_parallel_size`` their
    ``expert_tp``, which must divide ``tp`` (default 1, the experts replicated over TP, where
    Megatron's default is ``tp``).
    """
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    if cp_comm_type not in CP_COMM_TYPES:
        raise MegatronFlagError(f"--cp-comm-type={cp_comm_type}: this runtime runs "
                                f"{' and '.join(CP_COMM_TYPES)} (ring attention, Ulysses); "
                                f"choose one of them")
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--context-parallel-size", cp),
                        ("--expert-model-parallel-size", expert_model_parallel_size),
                        ("--expert-tensor-parallel-size", expert_tensor_parallel_size),
                        ("--micro-batch-size", micro_batch_size),
                        ("--global-batch-size", global_batch_size)):
        if not isinstance(value, int) or value < 1:
            raise MegatronFlagError(f"{flag}={value!r}: must be a positive integer")
    if world_size % (tp * pp * cp):
        what = f" x --context-parallel-size={cp}" if cp > 1 else ""
        raise MegatronFlagError(
            f"--tensor-model-parallel-size={tp} x --pipeline-model-parallel-size={pp}{what} = "
            f"{tp * pp * cp} must divide the world size {world_size}; choose degrees whose "
            f"product divides it")
    dp = world_size // (tp * pp * cp)
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size
    _check_expert_degree("--expert-model-parallel-size", ep, dp, moe_layers,
                         f"the data-parallel size {dp} (world {world_size} / (tp {tp} x pp "
                         f"{pp} x cp {cp}))")
    _check_expert_degree("--expert-tensor-parallel-size", etp, tp, moe_layers,
                         f"--tensor-model-parallel-size={tp} (each expert is split over that "
                         f"many of a layer's TP ranks)")
    if global_batch_size % (micro_batch_size * dp):
        raise MegatronFlagError(
            f"--global-batch-size={global_batch_size}: must be a multiple of --micro-batch-size="
            f"{micro_batch_size} x data-parallel size {dp} = {micro_batch_size * dp}")
    num_microbatches = global_batch_size // (micro_batch_size * dp)
    virtual_size = 1
    per_chunk = num_layers_per_virtual_pipeline_stage
    if pipeline_model_parallel_layout is not None:
        others = [flag for flag, value in (
            ("--decoder-first-pipeline-num-layers", decoder_first_pipeline_num_layers),
            ("--decoder-last-pipeline-num-layers", decoder_last_pipeline_num_layers),
            ("--num-layers-per-virtual-pipeline-stage", per_chunk)) if value is not None]
        if others:
            raise MegatronFlagError(f"{LAYOUT_FLAG}={pipeline_model_parallel_layout!r}: sets the "
                                    f"whole partition; drop {' and '.join(others)}")
        try:
            sizes = chunks_from_layout(pipeline_model_parallel_layout, pp, num_layers)
        except LayoutError as err:
            raise MegatronFlagError(str(err)) from None
        virtual_size = len(sizes) // pp
        if virtual_size > 1 and pp < 2:
            raise MegatronFlagError(f"{LAYOUT_FLAG}={pipeline_model_parallel_layout!r}: "
                                    f"{len(sizes)} chunks on one pipeline rank (interleaving "
                                    f"needs --pipeline-model-parallel-size > 1)")
    else:
        sizes = _stage_sizes(num_layers, pp, decoder_first_pipeline_num_layers,
                             decoder_last_pipeline_num_layers)
    if per_chunk is not None and pipeline_model_parallel_layout is None:
        virtual_size = _virtual_size(num_layers, pp, per_chunk, decoder_first_pipeline_num_layers,
                                     decoder_last_pipeline_num_layers)
        sizes = (per_chunk,) * (pp * virtual_size)
    notes: list[str] = []
    recompute: list[Any] = [False] * num_layers
    if recompute_modules is not None and recompute_granularity != "selective":
        raise MegatronFlagError(f"--recompute-modules={' '.join(recompute_modules)}: needs "
                                f"--recompute-granularity selective; add it (full recomputes "
                                f"whole layers)")
    if recompute_granularity is not None:
        if recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise MegatronFlagError(f"--recompute-granularity={recompute_granularity!r}: choose one "
                                    f"of {', '.join(RECOMPUTE_GRANULARITIES)}")
        if recompute_granularity == "selective":
            recompute = [_selective_modules(recompute_modules, recompute_method,
                                            recompute_num_layers)] * num_layers
        else:
            method = recompute_method or "uniform"
            if method not in RECOMPUTE_METHODS:
                raise MegatronFlagError(f"--recompute-method={method!r}: choose one of "
                                        f"{', '.join(RECOMPUTE_METHODS)}")
            if method == "uniform":
                recompute = [True] * num_layers
            else:
                k = recompute_num_layers
                if k is None or k < 0:
                    raise MegatronFlagError(
                        f"--recompute-num-layers={k!r}: --recompute-method block needs the number "
                        f"of layers per stage to recompute (0..{min(sizes)})")
                start = 0
                for size in sizes:
                    for j in range(min(k, size)):
                        recompute[start + j] = True
                    start += size
    dp_mode = "zero1" if use_distributed_optimizer else "ddp"
    if data_parallel_sharding_strategy is not None or use_megatron_fsdp:
        strategy = data_parallel_sharding_strategy or "no_shard"
        if strategy not in SHARDING_STRATEGIES:
            raise MegatronFlagError(f"--data-parallel-sharding-strategy={strategy!r}: choose one "
                                    f"of {', '.join(SHARDING_STRATEGIES)}")
        if strategy != "no_shard" and not use_megatron_fsdp:
            raise MegatronFlagError(f"--data-parallel-sharding-strategy={strategy}: shards only "
                                    f"with --use-megatron-fsdp (Megatron-FSDP); add it")
        dp_mode = SHARDING_STRATEGIES[strategy] or dp_mode
        if dp_mode in ("zero2", "zero3"):
            notes.append(f"Megatron-FSDP --data-parallel-sharding-strategy {strategy} is "
                         f"{dp_mode} on every layer and the vocabulary")
    if use_distributed_optimizer and dp_mode == "zero1":
        notes.append("--use-distributed-optimizer is zero1 (Megatron's distributed optimizer: "
                     "optimizer state sharded over data parallelism)")
    if sequence_parallel and tp == 1:
        notes.append("--sequence-parallel is ignored with --tensor-model-parallel-size 1 (as in "
                     "Megatron-LM)")
        sequence_parallel = False
    try:
        plan = Plan.uniform(world_size, num_layers, global_batch_size=global_batch_size,
                            num_microbatches=num_microbatches, tp=tp, pp=pp, dp_mode=dp_mode,
                            tp_consecutive=True, recompute=recompute, schedule="1f1b",
                            layers_per_stage=sizes, model=model,
                            sequence_parallel=sequence_parallel, virtual_size=virtual_size,
                            cp=cp, cp_mode=CP_COMM_TYPES[cp_comm_type] if cp > 1 else "ring")
    except PlanError as err:
        raise MegatronFlagError(f"classic flags give an invalid plan: {err}") from None
    if ep > 1 or etp > 1:
        plan = replace(plan, layers=tuple(replace(layer, ep=ep, expert_tp=etp)
                                          if i in set(moe_layers) else layer
                                          for i, layer in enumerate(plan.layers)))
    return replace(plan, search={"source": "megatron-flags", "notes": notes})


def _check_expert_degree(flag: str, value: int, ranks: int, moe_layers: Sequence[int],
                         what: str) -> None:
    """An expert layout flag above 1: the model must have MoE layers and ``value`` be a power
    of two dividing ``ranks`` (``what`` names them in the message)."""
    if value <= 1:
        return
    if not moe_layers:
        raise MegatronFlagError(f"{flag}={value}: the model has no MoE layers (--num-experts); "
                                f"drop the flag or add --num-experts")
    if ranks % value or value & (value - 1):
        raise MegatronFlagError(f"{flag}={value}: must be a power of two dividing {what}; "
                                f"choose a divisor of {ranks}")


def _selective_modules(modules: Sequence[str] | None, method: str | None,
                       num_layers: int | None) -> Any:
    """The plan's per-layer ``recompute`` of ``--recompute-granularity selective``."""
    for flag, value in (("--recompute-method", method), ("--recompute-num-layers", num_layers)):
        if value is not None:
            raise MegatronFlagError(f"{flag}={value}: Megatron takes it with "
                                    f"--recompute-granularity full only; drop it (selective "
                                    f"recomputes its modules on every layer)")
    names = ["core_attn"] if modules is None else list(modules)
    unknown = [m for m in names if m not in RECOMPUTE_MODULE_FLAGS]
    if unknown or not names:
        raise MegatronFlagError(f"--recompute-modules={' '.join(names) or '(none)'}: "
                                f"{'unknown ' + ', '.join(unknown) if unknown else 'empty'}; "
                                f"choose from {', '.join(RECOMPUTE_MODULE_FLAGS)}")
    return normalize_recompute([RECOMPUTE_MODULE_FLAGS[m] for m in dict.fromkeys(names)],
                               "--recompute-modules")


def _virtual_size(num_layers: int, pp: int, per_chunk: int, first: int | None,
                  last: int | None) -> int:
    """``--num-layers-per-virtual-pipeline-stage``: chunks of ``per_chunk`` layers, ``pp`` x v."""
    flag = "--num-layers-per-virtual-pipeline-stage"
    if not isinstance(per_chunk, int) or per_chunk < 1:
        raise MegatronFlagError(f"{flag}={per_chunk!r}: must be a positive integer")
    if pp < 2:
        raise MegatronFlagError(f"{flag}={per_chunk}: interleaving needs "
                                f"--pipeline-model-parallel-size > 1; drop the flag or add stages")
    if first is not None or last is not None:
        raise MegatronFlagError(f"{flag}={per_chunk}: cannot be combined with "
                                f"--decoder-first/last-pipeline-num-layers; use a --plan file for "
                                f"uneven interleaved chunks")
    if num_layers % (pp * per_chunk):
        raise MegatronFlagError(
            f"{flag}={per_chunk}: --num-layers={num_layers} must be a multiple of "
            f"--pipeline-model-parallel-size={pp} x {per_chunk} = {pp * per_chunk}")
    return num_layers // (pp * per_chunk)


def to_megatron_flags(plan: Plan) -> tuple[list[str] | None, list[str]]:
    """Classic Megatron flags equivalent to ``plan``, or ``(None, reasons it is not expressible)``.

    The returned flags cover parallelism, batch and recompute (model and precision flags are the
    run's own). Reasons name the offending layers or fields.
    """
    reasons: list[str] = []
    layers = plan.layers
    first = layers[0]
    tps = sorted({layer.tp for layer in layers})
    if len(tps) > 1:
        reasons.append(f"per-layer tensor-parallel degrees differ ({tps}); Megatron uses one "
                       f"--tensor-model-parallel-size for all layers")
    tp = first.tp
    modes = sorted({layer.dp_mode for layer in layers})
    if len(modes) > 1:
        reasons.append(f"per-layer data-parallel flavours differ ({modes}); Megatron uses one for "
                       f"the whole model")
    sp = [i for i, layer in enumerate(layers) if layer.sequence_parallel]
    if sp and len(sp) < len(layers):
        reasons.append(f"sequence_parallel on layers {_ranges(sp)} only; Megatron's "
                       f"--sequence-parallel applies to every layer")
    strided = [i for i, layer in enumerate(layers) if not layer.tp_consecutive
               and 1 < layer.tp < plan.stage_size]
    if strided:
        reasons.append(f"layers {_ranges(strided)} use strided TP groups; Megatron's TP groups are "
                       f"always consecutive ranks")
    if plan.vocab.tp != tp and len(tps) == 1:
        reasons.append(f"vocab.tp={plan.vocab.tp} differs from the layers' tp={tp}; Megatron "
                       f"splits embedding and head over the same TP group")
    if len(modes) == 1 and plan.vocab.dp_mode != modes[0] and plan.vocab_dp_size > 1:
        reasons.append(f"vocab.dp_mode={plan.vocab.dp_mode} differs from the layers' {modes[0]}")
    if plan.pipeline.schedule != "1f1b":
        reasons.append(f"pipeline.schedule={plan.pipeline.schedule}: Megatron's non-interleaved "
                       f"schedule is 1F1B only")
    cp = plan.cp_size
    cp_modes = sorted({layer.cp_mode for layer in layers})
    if cp > 1 and len(cp_modes) > 1:
        reasons.append(f"per-layer cp_mode differs ({cp_modes}); Megatron uses one "
                       f"--cp-comm-type for all layers")
    offloaded = [i for i, layer in enumerate(layers) if layer.offload is not False]
    if offloaded:  # Megatron-Core's fine-grained offload flags are not mapped (yet)
        reasons.append(f"layers {_ranges(offloaded)} offload activations; no classic "
                       f"Megatron-LM flag says that per layer")
    fraction = plan.pipeline.optimizer_offload_fraction
    if isinstance(fraction, tuple) and len(set(fraction)) > 1:
        reasons.append(f"pipeline.optimizer_offload_fraction differs per stage ({list(fraction)}); "
                       f"Megatron's --optimizer-offload-fraction is one for all stages")
    ep = _expert_degree(plan, reasons)
    etp = _expert_tp_degree(plan, reasons)
    pp = plan.pp_size
    stage_flags = _stage_flags(list(plan.pipeline.layers_per_stage), plan.virtual_size)
    recompute_flags = _recompute_flags(plan, reasons)
    if reasons:
        return None, reasons
    slices = plan.stage_size // (tp * cp)  # Megatron's data-parallel size
    micro = plan.microbatch_size // slices
    flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
             "--micro-batch-size", str(micro), "--global-batch-size", str(plan.global_batch_size)]
    if cp > 1:
        comm = next(k for k, m in CP_COMM_TYPES.items() if m == cp_modes[0])
        flags += ["--context-parallel-size", str(cp), "--cp-comm-type", comm]
    if ep > 1:
        flags += ["--expert-model-parallel-size", str(ep)]
    if etp is not None and etp != tp:  # Megatron's default expert TP is the layers' tp
        flags += ["--expert-tensor-parallel-size", str(etp)]
    flags += stage_flags
    if modes == ["zero1"]:
        flags.append("--use-distributed-optimizer")
    elif modes in (["zero2"], ["zero3"]):  # Megatron-FSDP shards gradients (and parameters)
        strategy = next(s for s, m in SHARDING_STRATEGIES.items() if m == modes[0])
        flags += FSDP_FLAGS[:1] + ["--data-parallel-sharding-strategy", strategy] + FSDP_FLAGS[1:]
    if sp:
        flags.append("--sequence-parallel")
    flags += recompute_flags
    share = fraction[0] if isinstance(fraction, tuple) else fraction
    if share:
        flags += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", repr(float(share))]
    return flags, []


def _moe_layers(plan: Plan) -> list[int] | None:
    """The MoE layers by the plan's ``model.moe`` record (``layer_freq``: every N-th layer
    from 0, or a 0/1 list), or None when the record names none."""
    moe = (plan.model or {}).get("moe")
    if not isinstance(moe, Mapping):
        return None
    freq = moe.get("layer_freq", 1)
    if isinstance(freq, (list, tuple)):
        return [i for i, x in enumerate(freq) if x]
    return [i for i in range(plan.num_layers) if i % int(freq) == 0]


def _expert_degree(plan: Plan, reasons: list[str]) -> int:
    """Megatron's ``--expert-model-parallel-size``: one ep for every MoE layer, the experts in
    the layer's DP flavour (Megatron has no separate one); reasons where the plan differs."""
    layers = plan.layers
    with_ep = [i for i, layer in enumerate(layers) if layer.ep > 1]
    own = [i for i, layer in enumerate(layers)
           if layer.expert_dp_mode not in (None, layer.dp_mode)]
    if own:
        reasons.append(f"layers {_ranges(own)} give the experts their own expert_dp_mode; "
                       f"Megatron's experts take the model's data-parallel flavour")
    if not with_ep:
        return 1
    eps = sorted({layers[i].ep for i in with_ep})
    moe = _moe_layers(plan)
    if len(eps) > 1 or (moe is not None and with_ep != moe):
        reasons.append(f"expert parallelism differs between MoE layers (ep {eps} on layers "
                       f"{_ranges(with_ep)}); Megatron's --expert-model-parallel-size applies "
                       f"to every MoE layer")
    return eps[-1]


def _expert_tp_degree(plan: Plan, reasons: list[str]) -> int | None:
    """Megatron's ``--expert-tensor-parallel-size``: one expert_tp for every MoE layer (None:
    the plan names no MoE layer, nor any expert_tp above 1); reasons where the plan differs."""
    moe = _moe_layers(plan)
    layers = plan.layers
    with_etp = [i for i, layer in enumerate(layers) if layer.expert_tp > 1]
    where = moe if moe else with_etp
    if not where:
        return None
    etps = sorted({layers[i].expert_tp for i in where})
    if len(etps) > 1 or (moe and any(i not in moe for i in with_etp)):
        reasons.append(f"expert tensor parallelism differs between MoE layers (expert_tp {etps} "
                       f"on layers {_ranges(where)}); Megatron's --expert-tensor-parallel-size "
                       f"applies to every MoE layer")
    return etps[-1]


def _stage_flags(sizes: list[int], virtual_size: int) -> list[str]:
    """The partition's flags: none when even; Megatron's pinned first/last stage around an
    even middle, or equal interleaved chunks, where those say it; else the layout string,
    which holds any partition (Megatron-Core 0.12+)."""
    if len(set(sizes)) == 1:
        if virtual_size > 1:
            return ["--num-layers-per-virtual-pipeline-stage", str(sizes[0])]
        return []
    if virtual_size == 1:
        middle = sizes[1:-1]
        if not middle:  # two stages: pin both
            return ["--decoder-first-pipeline-num-layers", str(sizes[0]),
                    "--decoder-last-pipeline-num-layers", str(sizes[-1])]
        if len(set(middle)) == 1:
            out = []
            if sizes[0] != middle[0]:
                out += ["--decoder-first-pipeline-num-layers", str(sizes[0])]
            if sizes[-1] != middle[0]:
                out += ["--decoder-last-pipeline-num-layers", str(sizes[-1])]
            return out
    return [LAYOUT_FLAG, layout_string(sizes)]


def _recompute_flags(plan: Plan, reasons: list[str]) -> list[str]:
    values = [layer.recompute for layer in plan.layers]
    partial = [i for i, v in enumerate(values) if not isinstance(v, bool)]
    if partial:
        if len(set(values)) == 1:  # the same modules on every layer: selective
            modules = recompute_parts(values[0])[1]
            names = [flag for flag, ours in RECOMPUTE_MODULE_FLAGS.items() if ours in modules]
            return ["--recompute-granularity", "selective", "--recompute-modules", *names]
        reasons.append(f"module recompute on layers {_ranges(partial)} is not the same modules "
                       f"on every layer (Megatron's --recompute-granularity selective)")
        return []
    flags = [v is True for v in values]
    if not any(flags):
        return []
    if all(flags):
        return ["--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"]
    # Block method: the same number k of leading layers recomputes in every model chunk.
    per_stage = [[flags[i] for i in plan.chunk_layer_range(c)] for c in range(plan.num_chunks)]
    leading: list[int] = []  # per chunk, its leading recomputed layers
    for stage_flags in per_stage:
        k = 0
        while k < len(stage_flags) and stage_flags[k]:
            k += 1
        if any(stage_flags[k:]):
            break  # a recomputed layer after a plain one: not the block method
        leading.append(k)
    if len(leading) == len(per_stage):
        ks = set(leading)
        # A stage shorter than k recomputes all its layers under Megatron's block method.
        k = max(ks)
        if all(n == k or n == len(per_stage[s]) for s, n in enumerate(leading)):
            return ["--recompute-granularity", "full", "--recompute-method", "block",
                    "--recompute-num-layers", str(k)]
    recomputed = [i for i, f in enumerate(flags) if f]
    reasons.append(f"recompute on layers {_ranges(recomputed)} is not 'all layers' nor 'the first k "
                   f"layers of every stage' (Megatron's uniform / block methods)")
    return []


def _ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'`` for readable reasons."""
    out: list[str] = []
    start = prev = indices[0]
    for i in list(indices[1:]) + [None]:  # type: ignore[list-item]
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out)
