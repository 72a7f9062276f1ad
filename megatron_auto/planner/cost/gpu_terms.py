"""Cost-model terms that only matter on GPUs: the attention kernel that runs, matmuls on a
roofline, element-wise work by bytes, fused AdamW, NCCL communicators and allocator slack.

Pure arithmetic (no torch). Each function is one formula of docs/cost_model.md §9; the CPU
rules are the defaults of :class:`~megatron_auto.planner.inputs.hardware.ClusterSpec`, so a cluster
without GPU fields prices exactly as before.

- Attention. SDPA's ``flash``, ``efficient`` (memory-efficient) and ``cudnn`` kernels never
  materialise the ``s x s`` scores: forward keeps the output (already counted as the
  projection's input) and one fp32 log-sum-exp per query and head; dropout is regenerated from
  the RNG seed in backward, so no mask is kept. A causal mask lets them skip the blocks above
  the diagonal: the score and weighted-sum matmuls do ``s(s+1)/2`` of the ``s^2`` products.
  The ``math`` kernel computes (and keeps) everything.
- Matmuls on a roofline: a GEMM ``(m x k) @ (k x n)`` takes
  ``max(2mnk / sustained FLOP/s, beta (mk + kn + mn) / HBM bandwidth)``: its shape class is
  compute-bound or memory-bound by its arithmetic intensity. The class is decided at one
  sample per call (``m = s`` tokens): more samples only raise the intensity (conservative).
- Element-wise and normalisation work moves bytes over HBM: two norms (read + write
  ``beta s h`` each), two residual adds (two reads, one write), two hidden dropouts (read,
  write, a 1-byte mask), the activation (GELU: read and write ``beta s f``; SwiGLU: read
  ``2f``, write ``f``); under autocast every forward call also casts the fp32 weights to the
  compute dtype (read 4, write ``beta`` bytes per local parameter).
- Fused AdamW (CUDA, plain tensors) updates in place: no ``foreach`` temporaries.
- NCCL: every process group a rank belongs to (two ranks or more) holds one communicator on
  that device, and its buffers are outside the caching allocator.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from ...plan import Plan
from ...layout import Layout, all_layouts, plan_group_ranks, plan_stage_layouts
from ..inputs.cluster_model import ClusterModel

# SDPA kernels that do not store the score matrix.
NO_SCORES_BACKENDS = ("flash", "efficient", "cudnn")
LSE_BYTES = 4  # fp32 log-sum-exp per query row and head (flash / memory-efficient forward)
FP32_BYTES = 4
MASK_BYTES = 1


def default_attention_backend(device_type: str, precision: str) -> str:
    """The SDPA kernel torch picks for a causal/padding-free GPT layer on ``device_type``.

    CUDA: flash for bf16/fp16 (it needs a 16-bit dtype), memory-efficient for fp32; elsewhere
    the math kernel is assumed (conservative: a measured profile records what really ran).
    """
    if device_type == "cuda":
        return "flash" if precision in ("bf16", "fp16") else "efficient"
    return "math"


def attention_score_flops(s: int, k: int, h: int, causal: bool, backend: str) -> float:
    """FLOPs per sample of ``Q K^T`` and ``P V`` (``k`` keys per query, ``h = heads x d``)."""
    full = 4.0 * s * k * h
    if backend in NO_SCORES_BACKENDS and causal and k == s:
        return full * (s + 1) / (2 * s)  # the lower triangle with its diagonal
    return full


def attention_kept_bytes(beta: int, heads: int, s: int, k: int, backend: str,
                         mask_bytes: int = MASK_BYTES) -> float:
    """Bytes per sample attention keeps for backward beyond Q, K, V and its output (split
    over TP with the heads): ``math``: the softmax output, its dropout mask (``mask_bytes`` per
    element, see ``profiles.dropout_mask_bytes``) and the dropped-out probabilities,
    ``(2 beta + 1) a s k`` on CUDA; without stored scores: the log-sum-exp, ``4 a s``."""
    if backend in NO_SCORES_BACKENDS:
        return float(LSE_BYTES * heads * s)
    return float((2 * beta + mask_bytes) * heads * s * k)


def attention_scratch_bytes(beta: int, heads: int, s: int, k: int, h: int,
                            backend: str) -> float:
    """Backward scratch per sample of attention: ``math`` the score gradient ``beta a s k``;
    the fused kernels an fp32 ``dQ`` accumulator, ``4 s h``."""
    if backend in NO_SCORES_BACKENDS:
        return float(FP32_BYTES * s * h)
    return float(beta * heads * s * k)


def gemm_time(m: float, n: float, k: float, beta: int, flops_rate: float,
              hbm_bandwidth: float) -> float:
    """Seconds of one ``(m x k) @ (k x n)`` GEMM on the roofline (``hbm_bandwidth`` 0: compute
    only)."""
    compute = 2.0 * m * n * k / flops_rate
    if hbm_bandwidth <= 0:
        return compute
    return max(compute, beta * (m * k + k * n + m * n) / hbm_bandwidth)


def gemm_shape_class(m: float, n: float, k: float, beta: int, flops_rate: float,
                     hbm_bandwidth: float) -> str:
    """``"compute-bound"`` or ``"memory-bound"``: which roofline arm prices this shape."""
    compute = 2.0 * m * n * k / flops_rate
    memory = beta * (m * k + k * n + m * n) / hbm_bandwidth if hbm_bandwidth > 0 else 0.0
    return "memory-bound" if memory > compute else "compute-bound"


def layer_gemms(s: int, h: int, f: int, activation: str, tp: int,
                kv: int | None = None) -> list[tuple[int, int, int]]:
    """``(m, n, k)`` of a transformer layer's four weight GEMMs on one rank at TP ``tp``, for
    one sample (``m = s`` tokens): QKV (``h + 2 kv`` wide, ``kv`` the key/value width: ``h``
    unless grouped-query attention), output projection, fc1 (``2f`` wide for SwiGLU), fc2."""
    fc1 = 2 * f if activation == "swiglu" else f
    qkv = h + 2 * (h if kv is None else kv)
    gemms = [(s, qkv // tp, h), (s, h, h // tp), (s, fc1 // tp, h), (s, h, f // tp)]
    return gemms if f else gemms[:2]  # f = 0: an MoE layer without shared experts


def elementwise_bytes(s: int, h: int, f: int, beta: int, activation: str, tp: int) -> float:
    """HBM bytes per sample of a layer's forward element-wise and normalisation work on one rank
    (module docstring): ``(14 beta + 2) s h`` replicated plus the activation's
    ``2 beta s f / t`` (GELU) or ``3 beta s f / t`` (SwiGLU)."""
    norms = 2 * 2 * beta * s * h
    residuals = 2 * 3 * beta * s * h
    dropouts = 2 * (2 * beta + MASK_BYTES) * s * h
    act = (3 if activation == "swiglu" else 2) * beta * s * f / tp
    return float(norms + residuals + dropouts + act)


def weight_cast_bytes(local_parameters: float, beta: int, mixed: bool) -> float:
    """HBM bytes autocast moves per forward call to cast the fp32 weights (read 4, write beta)."""
    return (FP32_BYTES + beta) * local_parameters if mixed else 0.0


def layer_forward_time(s: int, h: int, f: int, heads: int, k: int, activation: str,
                       causal: bool, backend: str, beta: int, tp: int, flops_rate: float,
                       hbm_bandwidth: float, kv: int | None = None) -> float:
    """Forward seconds per sample of one layer at TP ``tp`` on one rank: the four GEMMs on the
    roofline, the attention matmuls at the sustained rate, the element-wise bytes over HBM."""
    gemms = sum(gemm_time(m, n, kk, beta, flops_rate, hbm_bandwidth)
                for m, n, kk in layer_gemms(s, h, f, activation, tp, kv))
    attention = attention_score_flops(s, k, h, causal, backend) / tp / flops_rate
    bytes_moved = elementwise_bytes(s, h, f, beta, activation, tp)
    return gemms + attention + (bytes_moved / hbm_bandwidth if hbm_bandwidth > 0 else 0.0)


def step_temporary_bytes(fused: bool, has_sharded_parameters: bool,
                         local_master_parameters: float) -> float:
    """Bytes the optimizer step allocates beside the model states: torch's ``foreach`` AdamW
    makes ``sqrt(v)`` for every local parameter at once (4 B each); the fused kernel (CUDA,
    used only when every parameter of the stage is a plain tensor) none."""
    if fused and not has_sharded_parameters:
        return 0.0
    return FP32_BYTES * local_master_parameters


def rank_process_groups(plan: Plan, rank: int) -> set[tuple]:
    """The process groups of two or more ranks that ``rank`` belongs to under ``plan``, as the
    runtime creates them (``layout.plan_group_ranks``, what ``parallel/context.py`` builds):
    its stage, the embedding pair of the first and last stage, and the TP and DP groups of
    every layout its stage uses (``layout.plan_stage_layouts``), with the world. Pipeline
    sends run on the world group, but NCCL gives each pair of peers of point-to-point traffic
    its own communicator: the pairs with the previous and next stage count too (conservative
    where a batched p2p reuses the group's communicator)."""
    n = plan.stage_size
    groups: set[tuple] = {tuple(range(plan.world_size))}
    for peer in (rank - n, rank + n):
        if 0 <= peer < plan.world_size:
            groups.add(("p2p",) + tuple(sorted((rank, peer))))
    groups.update(g for g in plan_group_ranks(plan) if rank in g)
    return {g for g in groups if len(g) > 1}  # a p2p pair has 3 entries: label and peers


def _local_group_keys(j: int, n: int, tp: int, consecutive: bool,
                      cp: int = 1) -> list[tuple[int, int, int]]:
    """The TP and DP groups (two ranks or more) of local index ``j`` in a stage of ``n`` under
    a layout, each as the arithmetic progression ``(start, step, count)`` of its local indices:
    every group of ``layout.tp_group_ranks``/``dp_group_ranks`` is one (with CP also
    ``slice_group_ranks`` and ``cp_group_ranks``), and two progressions of two or more terms
    are the same set exactly when the triples are equal."""
    dp = n // tp
    if cp > 1:  # consecutive TP inside blocks of m: TP block, slice group, DP group, CP group
        m = n // cp
        block = j - j % m
        groups = [(j - j % tp, 1, tp), (block + j % tp, tp, m // tp), (j % tp, tp, dp),
                  (j % m, m, cp)]
        return [g for g in groups if g[2] > 1]
    if consecutive:
        groups = [(j - j % tp, 1, tp), (j % tp, tp, dp)]          # TP block, DP every tp-th
    else:
        groups = [(j % dp, dp, tp), (j - j % dp, 1, dp)]          # TP every dp-th, DP block
    return [g for g in groups if g[2] > 1]


def _stage_layouts(plan: Plan, stage: int, layouts: Sequence[Any] | None = None
                   ) -> set[Layout]:
    """The layouts a rank of ``stage`` makes groups for (``layout.plan_stage_layouts``, the
    runtime's list, or ``layouts`` when the caller computed it once for every stage): the
    stage's layers, each received layout, the vocab on the end stages."""
    every = plan_stage_layouts(plan) if layouts is None else layouts
    return {lay.layout for lay in every if lay.stage == stage}


def group_count(n: int, pp: int, world: int, stage: int, j: int,
                layouts: Iterable[tuple[int, ...]]) -> int:
    """``len(rank_process_groups)`` of local index ``j`` of ``stage`` whose stage uses
    ``layouts``, without building the groups (O(layouts) instead of O(n) per group)."""
    keys: set[tuple] = set()
    if world > 1:
        keys.add(("local", 0, 1, n) if pp == 1 else ("world",))
    rank = stage * n + j
    for peer in (rank - n, rank + n):
        if 0 <= peer < world:
            keys.add(("p2p", min(rank, peer), max(rank, peer)))
    if n > 1:
        keys.add(("local", 0, 1, n))
    if pp > 1 and stage in (0, pp - 1) and world > 2:
        keys.add(("pair", j))  # (j, (pp - 1) n + j); with two ranks in all it is the world
    for tp, consecutive, *cp in layouts:
        for g in _local_group_keys(j, n, tp, bool(consecutive), *cp):
            keys.add(("local",) + g)
    return len(keys)


def nccl_bytes(plan: Plan, rank: int, communicator_bytes: float) -> float:
    """NCCL communicator memory on ``rank``: one communicator per group it belongs to."""
    if communicator_bytes <= 0:
        return 0.0
    n = plan.stage_size
    stage = rank // n
    return communicator_bytes * group_count(n, plan.pp_size, plan.world_size, stage,
                                            rank - stage * n, _stage_layouts(plan, stage))


def stage_nccl_bytes(plan: Plan, stage: int, communicator_bytes: float,
                     layouts: Sequence[Any] | None = None) -> float:
    """The most NCCL memory any rank of ``stage`` holds. Every rank of a stage holds the same
    number of groups: two progressions of :func:`_local_group_keys` coincide under a condition
    on the degrees alone (a TP block of ``a`` and a DP block of ``n / b`` when ``a = n / b``,
    likewise for the strided pair), never on the index, and the p2p peers and the embedding
    pair are one per stage neighbour; so local index 0 stands for all (the test compares every
    rank with ``rank_process_groups``). ``layouts``: ``layout.plan_stage_layouts(plan)`` when
    the caller prices every stage (it is the whole plan's list)."""
    if communicator_bytes <= 0:
        return 0.0
    return communicator_bytes * group_count(plan.stage_size, plan.pp_size, plan.world_size,
                                            stage, 0, _stage_layouts(plan, stage, layouts))


def fragmentation_bytes(fraction: float, dynamic_bytes: float) -> float:
    """The caching allocator's reserve beyond what is allocated: ``fraction`` of the bytes that
    are allocated and freed every iteration (activations and transients)."""
    return fraction * max(0.0, dynamic_bytes)


def divisors_up_to(values: Iterable[int], limit: int) -> Sequence[int]:
    """The degrees ``t <= limit`` dividing every value (the TP degrees a layer admits)."""
    vals = list(values)
    return [t for t in range(1, limit + 1) if all(v % t == 0 for v in vals)]


def search_nccl_bound(cluster: ClusterModel, stage_size: int, pp: int, cp: int = 1) -> float:
    """An upper bound on any plan's NCCL memory per rank with stages of ``stage_size`` ranks:
    the world, the stage, the embedding pair, and every distinct TP or DP group that any layout
    of a stage (``layout.all_layouts`` at CP degree ``cp``) gives the rank, the largest over
    the stage's ranks.
    O(stage size x layouts): the search keeps it per stage shape (``tasks.Task.nccl_bound``)."""
    per = float(getattr(cluster, "nccl_communicator_bytes", 0.0))
    if per <= 0:
        return 0.0
    most = 0
    layouts = [(lay.tp, lay.consecutive) for lay in all_layouts(stage_size, cp)]
    for j in range(stage_size):
        groups = {g for tp, c in layouts for g in _local_group_keys(j, stage_size, tp, c, cp)
                  if g[2] < stage_size}
        most = max(most, len(groups))
    # world, stage, embedding pair, the p2p pairs with the previous and next stage
    fixed = 1 + (stage_size > 1) + (pp > 1) + min(2, pp - 1)
    return per * (most + fixed)


def search_model_budget(cluster: ClusterModel, budget_bytes: float, stage_size: int, pp: int,
                        cp: int = 1) -> float:
    """The bytes a stage's components may use in the search's additive tables so that the plan
    also fits under :func:`evaluate_plan`'s GPU terms: the budget less the reserve and the NCCL
    bound, divided by ``1 + fragmentation_fraction`` (fragmentation is charged on part of the
    stage's bytes, so charging it on all of them is conservative)."""
    frag = float(getattr(cluster, "fragmentation_fraction", 0.0))
    return ((budget_bytes - cluster.memory_reserve_bytes
             - search_nccl_bound(cluster, stage_size, pp, cp)) / (1.0 + frag))


def search_total_bytes(cluster: ClusterModel, model_bytes: float, stage_size: int, pp: int,
                       cp: int = 1) -> float:
    """The inverse of :func:`search_model_budget`: the device bytes a stage using
    ``model_bytes`` in the search's tables needs at most."""
    frag = float(getattr(cluster, "fragmentation_fraction", 0.0))
    return (model_bytes * (1.0 + frag) + cluster.memory_reserve_bytes
            + search_nccl_bound(cluster, stage_size, pp, cp))
