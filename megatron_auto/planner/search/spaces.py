"""The strategy space: the paper's decision tree, its pruning rules, and the restricted spaces.

Galvatron-BMW decomposes the choice of a plan as a decision tree (paper, §3; Galvatron 2.4's
``generate_strategies``): the pipeline degree ``pp`` is chosen first (outermost: one per plan),
then per layer inside a stage of ``n = world/pp`` ranks the TP degree ``tp`` (a divisor of ``n``)
with ``dp = n/tp`` replicas, the data-parallel flavour (``ddp``, ``zero1``, ``zero2``, ``zero3``:
the paper has DP and sharded DP), the TP layout (consecutive or strided ranks), Megatron sequence
parallelism (``tp > 1`` dividing the sequence) and recompute as binary choices; interleaving of
the pipeline is tried on the finalists (``search``). A layer's strategy is a ``plan.LayerStrategy``.

Rules that prune the tree (each keeps the optimum, or is a runtime rule):

1. ``tp`` divides the layer's heads and FFN size and ``n``; ``dp`` divides the micro-batch.
   Runtime rules (Megatron splits heads and FFN; each replica takes an equal slice).
2. ``dp == 1``: one DP flavour only; the four are the same computation with the same memory.
3. The layout flag only where it changes the groups, ``1 < tp < n``.
4. ``tp`` at most the devices of one node unless ``max_tp`` (or a pinned ``tp``) asks for more:
   this one *defines* the default space (a TP group across nodes pays inter-node all-reduces
   four times per layer and micro-batch); it is not claimed to keep the optimum of a wider one.
   4b. TP groups and pipeline stages never straddle a node boundary (``node_aligned``: the
   block divides a node or is whole nodes). A placement rule: the cluster model prices a group
   by the nodes it would span aligned, so a straddling one would be mispriced. Only bites on
   worlds that are not powers of two (2 nodes of 6: no tp 4).
5. Dominance (``stage_costs.prune_dominated``, once costs are known): a strategy of the same
   class (layout and sequence parallelism) that is no worse in every priced quantity makes
   another redundant. Exact.
6. MoE layers only (``LayerType.moe``): ``ep`` a power of two dividing ``dp`` and the expert
   count, and, where the expert-DP group ``dp / ep`` has more than one rank, the experts' DP
   flavour (``expert_dp_mode``: absent = the layer's, or another of the allowed flavours);
   no sequence parallelism (runtime rules, ``plan_experts.py``). EP never changes a layer's
   class (its input and output layout), so dominance (5) prunes among its variants.
7. Context parallelism (``cp_space``): one degree ``cp`` per task (``SpaceRules.cp``); a
   layer's ``tp`` divides ``n / cp`` with ``dp = n / (tp cp)`` replicas, consecutive TP only
   (strided groups do not combine with CP), SP where ``tp x cp`` divides the sequence, and its
   CP mode among those ``cp_space.cp_modes`` allows. Runtime rules (``Plan.validate``).

:func:`decision_tree_counts` counts the candidates per world size and what each rule removes
(docs/planner.md §2 prints the table; a test checks it against a brute-force count).
Restricted spaces (``options.BASELINE_SPACES``) are searched and reported next to the answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...plan import DP_MODES, LayerStrategy, Plan, VocabStrategy, even_partition
from ...plan_offload import OffloadValue, offload_layer_problem
from ..inputs.model_spec import LayerType, ModelSpec
from .cp_space import cp_modes
from .options import SearchOptions


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending: the degrees that can split ``n`` ranks (any
    world size, not only powers of two: a 6-GPU node has tp 1, 2, 3 and 6)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True)
class SpaceRules:
    """Which strategies a search space allows (after the structural rules of the module doc)."""

    tps: tuple[int, ...] | None = None  # allowed TP degrees (None: every divisor)
    dp_modes: tuple[str, ...] = DP_MODES
    allow_recompute: bool = True
    allow_strided: bool = True
    max_tp: int | None = None
    force_recompute: bool = False  # every layer recomputes (uniform Megatron grids)
    # Megatron-SP choices of a tp > 1 layer: (False, True) searches it, (True,) pins it on
    # (``--sequence-parallel``), (False,) leaves it out.
    sequence_parallel: tuple[bool, ...] = (False,)
    # Module recompute values offered beside none and full (e.g. ("selective",)); empty by
    # default, so the default space is unchanged (cost/recompute.py prices them).
    module_recompute: tuple = ()
    # Expert parallelism of MoE layers (rule 6): the ep degrees allowed (None: every power of
    # two dividing the DP ranks and the experts; (1,) keeps the experts whole) and whether
    # the experts' DP flavour is searched apart from the layer's.
    eps: tuple[int, ...] | None = None
    expert_dp_modes: bool = True
    # Expert TP of MoE layers: the degrees allowed (None: every power of two dividing the
    # layer's tp and the expert width; (1,) keeps the experts whole on each TP rank).
    expert_tps: tuple[int, ...] | None = None
    # Context parallelism (rule 7, ``cp_space``): the task's one CP degree (every layer's and
    # the vocabulary's) and the CP modes a layer may run under it.
    cp: int = 1
    cp_modes: tuple[str, ...] = ("ring",)
    # Optimizer offload: the task's one ``pipeline.optimizer_offload_fraction`` (every stage's;
    # 0 = none). A task with a fraction keeps to the DP flavours the host optimizer steps.
    optimizer_offload: float = 0.0
    # The host memory a rank may use (``SearchOptions.host_memory_budget_bytes``): a plan whose
    # offload needs more is infeasible. None: no offload.
    host_memory_budget_bytes: float | None = None
    # ``layers[i].offload = true`` offered beside each strategy that recomputes nothing.
    activation_offload: bool = False


@dataclass(frozen=True)
class Space:
    """A (restricted) space: layer rules, allowed pp degrees and the vocabulary's layouts.

    ``vocab_tp``: ``None`` searches it, ``"layer"`` ties it to the layers' only TP degree, an int
    pins it. ``uniform``: every layer takes the same strategy and the split is even (Megatron's
    and Galvatron's non-fine-grained grids). ``interleave``: False keeps its tasks at virtual
    size 1 (a space without interleaved 1F1B, as spaces with ``pps`` or ``even_split``)."""

    name: str
    rules: SpaceRules
    pps: tuple[int, ...] | None = None
    vocab_tp: str | int | None = None
    vocab_modes: tuple[str, ...] | None = None
    even_split: bool = False
    # The CP degrees of its tasks: (1,) without CP, None the ones ``cp_space.cp_degrees``
    # allows per stage size (the full space).
    cps: tuple[int, ...] | None = (1,)
    interleave: bool = True


def _allowed_tp(tp: int, rules: SpaceRules, devices_per_node: int) -> bool:
    if not node_aligned(tp, devices_per_node):
        return False
    if rules.tps is not None:
        return tp in rules.tps
    cap = rules.max_tp if rules.max_tp is not None else devices_per_node
    return tp <= cap


def node_aligned(group: int, devices_per_node: int) -> bool:
    """Whether consecutive blocks of ``group`` ranks never straddle a node boundary: the block
    divides a node or is whole nodes (rule 4b). The cluster model prices a consecutive group by
    ``ceil(group / devices_per_node)`` nodes, which is its placement only then (on 2 nodes of 6,
    tp 4 divides a 12-rank stage but its second group takes ranks 4-7 of two nodes)."""
    return devices_per_node % group == 0 or group % devices_per_node == 0


def pipeline_degrees(world: int, devices_per_node: int, num_layers: int) -> list[int]:
    """The pipeline degrees searched on ``world`` devices: every divisor of the world (any GPU
    count: 6 GPUs have pp 1, 2, 3 and 6) with at most ``num_layers`` stages whose stages do not
    straddle a node boundary (``node_aligned``), so that every stage's groups are placed the way
    the cluster model prices them (3 nodes of 8 leave out pp 2, 4 and 8)."""
    return [pp for pp in divisors(world)
            if pp <= num_layers and node_aligned(world // pp, devices_per_node)]


def layer_strategies(layer_type: LayerType, stage_size: int, microbatch_size: int,
                     rules: SpaceRules, devices_per_node: int) -> list[LayerStrategy]:
    """All strategies of ``layer_type`` in a stage of ``stage_size`` ranks (rules 1-4).

    Deterministic order: tp ascending, then layout (consecutive first), DP flavour in
    ``rules.dp_modes`` order, sequence parallelism off before on, recompute off before on.
    SP is offered where ``tp > 1`` divides the sequence (the runtime's rule).
    """
    out: list[LayerStrategy] = []
    cp = rules.cp
    for tp in divisors(stage_size // cp):
        if not _allowed_tp(tp, rules, devices_per_node) or not layer_type.tp_divides(tp):
            continue
        dp = stage_size // (tp * cp)
        if microbatch_size % dp:
            continue
        # rule 2 on the DP group, dp x cp ranks (the parameters' replicas)
        modes = rules.dp_modes if dp * cp > 1 else (rules.dp_modes[:1] if "ddp" not in
                                                     rules.dp_modes else ("ddp",))
        layouts = [True, False] if (1 < tp < stage_size and rules.allow_strided
                                    and cp == 1) else [True]
        recomputes = (True,) if rules.force_recompute else \
            ((False, True) + tuple(rules.module_recompute) if rules.allow_recompute
             else (False,))
        sps: tuple[bool, ...] = (False,)
        if tp > 1 and layer_type.seq_length % (tp * cp) == 0 and layer_type.moe is None:
            sps = rules.sequence_parallel
        cp_modes_here = cp_modes(layer_type, tp, cp, rules.cp_modes)
        for consec in layouts:
            for mode in modes:
                for sp in sps:
                    for recompute in recomputes:
                        base = LayerStrategy(tp=tp, dp_mode=mode, tp_consecutive=consec,
                                             recompute=recompute, sequence_parallel=sp)
                        for offload in offload_choices(base, layer_type, rules):
                            b = replace(base, offload=offload) if offload else base
                            if cp == 1:
                                out.extend(expert_variants(b, layer_type, dp, rules))
                            else:  # no MoE under CP (cp_space rule 2)
                                out.extend(replace(b, cp=cp, cp_mode=m) for m in cp_modes_here)
    return out


# The module lists offered beside ``offload: true`` (docs/planner.md §11): the two modules that
# save most in cost/offload.py's terms, each alone: ``mlp`` (beta s (h + 2 f), 9 beta s h at
# f = 4h) and ``core_attn`` (q, k, v, the output and the kernel's kept bytes, >= 4 beta s h);
# ``norm`` (2 beta s h) frees least and is not offered.
OFFLOAD_MODULE_CHOICES: tuple[tuple[str, ...], ...] = (("core_attn",), ("mlp",))


def offload_choices(base: LayerStrategy, layer_type: LayerType,
                    rules: SpaceRules) -> list[OffloadValue]:
    """The ``offload`` values offered with ``base`` (its recompute fixed): false; with a host
    budget (``rules.activation_offload``) true where nothing is recomputed, and each of
    :data:`OFFLOAD_MODULE_CHOICES` that ``plan_offload.offload_layer_problem`` allows (none
    under full recompute, no module also recomputed, no ``mlp`` on an MoE layer)."""
    out: list[OffloadValue] = [False]
    if not rules.activation_offload:
        return out
    if base.recompute is False:
        out.append(True)
    for modules in OFFLOAD_MODULE_CHOICES:
        if layer_type.moe is not None and "mlp" in modules:
            continue
        if offload_layer_problem(modules, base.full_recompute, base.recompute_modules,
                                 "layers[?]") is None:
            out.append(modules)
    return out


def expert_variants(base: LayerStrategy, layer_type: LayerType, dp: int,
                    rules: SpaceRules) -> list[LayerStrategy]:
    """``base`` with every expert layout rule 6 allows (``base`` alone for a dense layer):
    ``ep`` ascending, then ``expert_tp`` ascending (powers of two dividing the layer's tp and
    the expert width), the layer's own expert DP flavour first."""
    if layer_type.moe is None:
        return [base]
    experts, width = layer_type.moe.num_experts, layer_type.moe.ffn_hidden_size
    etps = [t for t in _powers_of_two(base.tp) if base.tp % t == 0 and width % t == 0
            and (rules.expert_tps is None or t in rules.expert_tps)]
    out: list[LayerStrategy] = []
    for ep in _powers_of_two(dp):
        if dp % ep == 0 and experts % ep == 0 and (rules.eps is None or ep in rules.eps):
            modes: tuple[str | None, ...] = (None,)
            if dp // ep > 1 and rules.expert_dp_modes:
                modes += tuple(m for m in rules.dp_modes if m != base.dp_mode)
            out.extend(replace(base, ep=ep, expert_tp=t, expert_dp_mode=m)
                       for t in etps for m in modes)
    return out


def _powers_of_two(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``."""
    return [2 ** j for j in range(n.bit_length())]


def baselines_inside(options: SearchOptions, world: int, devices_per_node: int) -> bool:
    """Whether every plan of every baseline space (``search.spaces_of``) is a plan of the full
    space ``options`` (a ``search.SearchOptions``) searches on ``world`` devices, so that the
    full space's optimum bounds the baselines' from below.

    The baselines keep their own rules, so this holds only when nothing the user pinned
    excludes them from the full space: the full space itself is searched, every partition,
    no pinned pp, tp, vocabulary tp or Megatron-SP, ``ddp`` and ``zero3`` allowed (the dp, tp,
    pp, megatron3d and zero3 spaces use them), the plain schedule (v = 1) among the virtual
    sizes, and the baselines' TP degrees (up to ``world``, tp's and megatron3d's) within the
    full space's TP cap (rule 4: ``max_tp``, else one node), no pinned ep or expert TP (the
    baselines search them on MoE layers)."""
    cap = options.max_tp if options.max_tp is not None else devices_per_node
    return (options.space == "full" and options.partition == "exact"
            and options.pp is None and options.tp is None and options.vocab_tp is None
            and not options.sequence_parallel and {"ddp", "zero3"} <= set(options.dp_modes)
            and 1 in options.virtual_sizes and world <= cap
            and options.expert_parallel is None and options.expert_tensor_parallel is None
            and options.cp in (None, 1))


def plan_in_space(plan: Plan, space: Space, spec: ModelSpec, vocabs: list[VocabStrategy],
                  devices_per_node: int) -> bool:
    """Whether ``plan`` (a ``plan.Plan`` of ``spec``) is one of ``space``'s plans, by the rules
    the search builds the space's tasks from: its pp, the even split and no interleaving where
    the space asks for them, its vocabulary layout among ``vocabs`` (those the space allows at
    the plan's stage size and micro-batch, ``task_list.vocabs``) and every layer's strategy among
    ``layer_strategies``. Batch, micro-batch count and schedule are the caller's to match."""
    pp = plan.pp_size
    if space.pps is not None and pp not in space.pps:
        return False
    if (space.even_split or space.pps is not None or not space.interleave) \
            and plan.virtual_size != 1:
        return False
    if space.even_split and tuple(plan.pipeline.layers_per_stage) != even_partition(
            spec.num_layers, pp):
        return False
    n, b_m, cp = plan.stage_size, plan.microbatch_size, plan.cp_size
    if cp != 1 and (space.cps is not None and cp not in space.cps):
        return False
    rules = space.rules if cp == space.rules.cp else replace(space.rules, cp=cp)
    if plan.vocab not in vocabs:
        return False
    allowed: dict[str, list[LayerStrategy]] = {}  # per layer type: its strategies, once
    for i, s in enumerate(plan.layers):
        lt = spec.layer_type(i)
        if lt.name not in allowed:
            allowed[lt.name] = layer_strategies(lt, n, b_m, rules, devices_per_node)
        if s not in allowed[lt.name]:
            return False
    return True


def vocab_tps(vocab_size: int, stage_size: int, microbatch_size: int,
              rules: SpaceRules, devices_per_node: int) -> list[int]:
    """TP degrees the embedding and head may use (rules 1 and 4, on the vocabulary)."""
    cp = rules.cp
    return [tp for tp in divisors(stage_size // cp)
            if _allowed_tp(tp, rules, devices_per_node) and vocab_size % tp == 0
            and microbatch_size % (stage_size // (tp * cp)) == 0]


def decision_tree_counts(world: int, devices_per_node: int | None = None) -> dict[str, int]:
    """Candidate (pp, layer strategy) pairs of the decision tree for ``world`` devices, after
    each pruning rule in turn (rule 1's divisibility by heads and batch is model-specific and
    left out: every degree divides them here).

    ``branches``: every pp dividing ``world``, every tp dividing ``world/pp``, 4 DP flavours,
    2 layouts, recompute on/off. ``rule 2``: one flavour when dp == 1. ``rule 3``: the layout
    only for 1 < tp < n. ``rule 4``: tp within a node of ``devices_per_node`` (default: all of
    ``world``), TP groups and stages not straddling a node (4b)."""
    node = devices_per_node or world
    f = len(DP_MODES)
    counts = {"branches": 0, "rule 2": 0, "rule 3": 0, "rule 4": 0}
    for pp in divisors(world):
        n = world // pp
        for tp in divisors(n):
            dp = n // tp
            counts["branches"] += f * 2 * 2
            after2 = (f if dp > 1 else 1) * 2 * 2
            counts["rule 2"] += after2
            after3 = (f if dp > 1 else 1) * (2 if 1 < tp < n else 1) * 2
            counts["rule 3"] += after3
            inside = tp <= node and node_aligned(tp, node) and node_aligned(n, node)
            counts["rule 4"] += after3 if inside else 0
    return counts



def check_pins(options: SearchOptions, world: int, devices_per_node: int) -> None:
    """Pinned degrees (``options.pp``, ``tp``, ``vocab_tp``: a ``search.SearchOptions``) that no
    plan on ``world`` devices can take raise ``ValueError`` naming the option and the degrees
    that work, instead of an empty space."""
    pps = [p for p in divisors(world) if node_aligned(world // p, devices_per_node)]
    if options.pp is not None and options.pp not in pps:
        raise ValueError(f"search option pp={options.pp}: must divide the {world} devices into "
                         f"stages inside a node or of whole nodes of {devices_per_node}; "
                         f"choose one of {', '.join(map(str, pps))}")
    for name in ("tp", "vocab_tp"):
        tp = getattr(options, name)
        if tp is not None and (world % tp or not node_aligned(tp, devices_per_node)):
            fits = [t for t in divisors(world) if node_aligned(t, devices_per_node)]
            raise ValueError(f"search option {name}={tp}: must divide the {world} devices and "
                             f"a node of {devices_per_node} (or be whole nodes); choose one of "
                             f"{', '.join(map(str, fits))}")
