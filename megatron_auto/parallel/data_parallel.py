"""Per-layer data parallelism: ``ddp``, ``zero1``, ``zero2`` and ``zero3`` side by side in one stage.

The stage says which of its modules follow which plan entry: ``stage.parallel_units()`` returns
``(name, module, layer)`` triples (:data:`ParallelUnit`), in the order forward first uses their
parameters. ``layer = i`` is transformer layer ``i``: its gradients are synchronised over
``ctx.layer_groups(i)``'s data-parallel group in the flavour ``plan.layers[i]`` names; ``layer =
None`` is a module on the vocab layout (embedding, final norm, heads), following ``plan.vocab``
on ``ctx.vocab_groups()``. ``name`` is the module's FQN in the stage (the prefix of its
parameters' FQNs); every parameter of the stage belongs to exactly one unit (one shared by two
units, like a tied weight, to the first). The models implement it
(``models.gpt.TransformerStage.parallel_units``); nothing here reads module names.

- ``ddp``: parameters, gradients and optimizer state replicated. Gradients accumulate locally
  over the micro-batches and are summed once per iteration by bucketed all-reduces launched
  during the last micro-batch's backward (:mod:`.ddp_buckets`).
- ``zero1`` (Megatron's distributed optimizer, :mod:`.distributed_optimizer`): parameters and
  gradients replicated like ``ddp``, but the buckets are reduce-scattered and the optimizer
  owns only this rank's ``1/dp`` slice of them (:meth:`DataParallel.parameters` yields those
  slices); the updated parameters are all-gathered after ``optimizer.step()``
  (:meth:`DataParallel.attach_optimizer`).
- ``zero2`` / ``zero3``: FSDP2 ``fully_shard`` on the layer's own DP mesh. Parameters are stored
  as DTensor shards (the optimizer owns only the shards), gradients are reduce-scattered after
  every micro-batch and accumulate as shards. ``zero3`` frees the gathered parameters after
  forward and after backward; ``zero2`` keeps them gathered from forward until the last
  micro-batch's backward (``reshard_after_forward=False``), so only gradients and optimizer
  state are sharded while the step runs.
- Sums, not means: the schedule already divides every micro-batch loss by the global token count,
  so gradients must be summed over replicas. FSDP2 averages by default; we set its divide factor
  to 1 and force plain SUM collectives (gloo has no PREMUL_SUM).
- A layer whose DP group has one rank needs no communication and is left alone in every mode.
- Mixed precision: master parameters stay fp32. With ``precision="bf16"``/``"fp16"`` sharded
  layers gather parameters in the compute dtype and reduce-scatter gradients in fp32
  (``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``); ``ddp`` gradients are those of the
  fp32 master parameters (autocast computes in low precision) and are reduced in fp32.
- Tied word embeddings with pp > 1: the last stage holds its own copy of
  ``embedding.word_embeddings.weight`` as LM head; after the DP sync its gradient is all-reduced
  with the first stage's over ``ctx.embedding_group`` (rank j of the first stage with rank j of
  the last: both use the vocab layout, so shards line up).
- Shared replicas (optional ``stage.shared_replicas()``: ``(fqn, group, counted_here)``): small
  parameters kept whole on every rank of several stages, whatever the plan (T5's relative
  position bias tables). Each rank's gradient is its own part of the sum; after backward it is
  all-reduced over ``group`` (every rank holding a replica) and counted once in the norm. They
  belong to no unit, so no dp_mode applies to them.

Tensor-parallel shards are recognised by their module's ``tp_shard_dims`` (``tensor_parallel.py``);
any other parameter is replicated over its TP group with identical gradients there (the model's
contract), which matters only for the gradient norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (FSDPModule, MixedPrecisionPolicy, fully_shard,
                                    register_fsdp_forward_method)
from torch.distributed.tensor import DTensor

from ..plan import ALL_DP_MODES
from .ddp_buckets import GradBuckets
from .distributed_optimizer import ZeroOneShards
from .grad_norm import NormEntry, clip_grads_, global_grad_norm

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
TIED_EMBEDDING_FQN = "embedding.word_embeddings.weight"
# Methods of the embedding module that run outside ``forward`` and need gathered parameters.
EMBEDDING_FORWARD_METHODS = ("embed", "logits")
# One entry of ``stage.parallel_units()``: (FQN of the module in the stage, the module, the
# global index of the transformer layer it is, or None for a module on the vocab layout).
ParallelUnit = tuple[str, nn.Module, int | None]


def tensor_parallel_fqns(stage: nn.Module) -> set[str]:
    """FQNs of the parameters that are TP shards (TP ranks hold different parts of them).

    A module marks its sharded parameters in ``tp_shard_dims`` (name -> split dimension, see
    ``tensor_parallel.py``); Megatron's ``param.tensor_model_parallel = True`` is honoured too.
    """
    fqns: set[str] = set()
    for mod_name, module in stage.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        dims = getattr(module, "tp_shard_dims", None) or {}
        for name, p in module.named_parameters(recurse=False):
            if name in dims or getattr(p, "tensor_model_parallel", False):
                fqns.add(prefix + name)
    return fqns


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a plain tensor or a DTensor shard."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _Unit:
    """A module whose parameters share one process-group layout and one dp flavour."""

    name: str
    module: nn.Module
    groups: Any  # LayerGroups
    dp_mode: str  # effective: "ddp" whenever dp_size == 1
    params: list[tuple[str, nn.Parameter]]
    position: int  # index in the stage's forward order (gradients finish in reverse)


class DataParallel:
    """Gradient synchronisation, sharding and clipping for one pipeline stage.

    Build it after the model and before the optimizer, and give the optimizer
    :meth:`parameters` (sharded layers hand out DTensor shards). Per iteration::

        dp.zero_grad()
        for each micro-batch m (in backward order):   # the schedule does this
            dp.set_microbatch(m, num_microbatches); backward(...)
        dp.finish_grad_sync()
        norm = dp.clip_grad_norm_(max_norm)
        optimizer.step()       # built on dp.parameters(), attached with dp.attach_optimizer

    ``set_microbatch`` may be skipped when there is a single micro-batch.
    """

    def __init__(self, stage: nn.Module, ctx: Any, *, precision: str = "fp32",
                 bucket_size_bytes: int = 25 * 2**20, overlap: bool = True) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"DataParallel precision={precision!r}: choose one of "
                             f"{', '.join(PRECISIONS)} (--bf16 / --fp16 select the low ones)")
        self.stage = stage
        self.ctx = ctx
        self.precision = precision
        named = dict(stage.named_parameters())
        shared = getattr(stage, "shared_replicas", None)
        self._shared = [(fqn, named[fqn], group, counted)
                        for fqn, group, counted in (shared() if callable(shared) else [])]
        self._units = self._find_units(stage, ctx, {id(p) for _, p, _, _ in self._shared})
        self._tied = self._has_tied_copy(stage, ctx)
        # Decide, before sharding replaces the parameters, which ones this rank counts in the
        # global gradient norm (by FQN: FSDP2 keeps the names).
        self._counted: dict[str, bool] = {}
        tp_fqns = tensor_parallel_fqns(stage)
        for unit in self._units:
            for fqn, p in unit.params:
                self._counted[fqn] = self._counts_in_norm(fqn, fqn in tp_fqns, unit)
        for fqn, _, _, counted in self._shared:
            self._counted[fqn] = counted
        self._sharded: list[_Unit] = [u for u in self._units if u.dp_mode in ("zero2", "zero3")]
        for unit in self._sharded:
            self._shard(unit)
        # Units on the same DP group share buckets (fewer, larger all-reduces), laid out in
        # forward order (GradBuckets reverses it into the order backward finishes gradients).
        self._buckets = GradBuckets(self._bucket_groups("ddp"),
                                    bucket_size_bytes=bucket_size_bytes, overlap=overlap)
        zero1_buckets = GradBuckets(self._bucket_groups("zero1"),
                                    bucket_size_bytes=bucket_size_bytes, overlap=overlap,
                                    shard=True)
        self._zero1 = ZeroOneShards(zero1_buckets, {id(p): f for f, p in stage.named_parameters()})

    # ----------------------------------------------------------------- setup
    def _bucket_groups(self, mode: str) -> list[tuple[Any, list[nn.Parameter]]]:
        """``(dp_group, params)`` of the ``mode`` units (``ddp`` or ``zero1``) with dp > 1.

        Units on the same DP group share buckets (fewer, larger collectives), laid out in
        forward order (GradBuckets reverses it into the order backward finishes gradients).
        Under ``zero1`` the tied word embedding gets buckets of its own, so that its shard is
        the same slice on the first and the last stage (its gradient is summed between them).
        """
        groups: dict[Any, tuple[Any, list[nn.Parameter]]] = {}
        for u in sorted(self._units, key=lambda unit: unit.position):
            if u.dp_mode != mode or u.groups.dp_size == 1:
                continue
            for fqn, p in u.params:
                alone = mode == "zero1" and self._tied and fqn == TIED_EMBEDDING_FQN
                key = (tuple(u.groups.dp_ranks), alone)
                groups.setdefault(key, (u.groups.dp_group, []))[1].append(p)
        return list(groups.values())

    @staticmethod
    def _find_units(stage: nn.Module, ctx: Any, shared_ids: set[int] | frozenset = frozenset()
                    ) -> list[_Unit]:
        """The stage's units from its own mapping (``stage.parallel_units()``); parameters in
        ``shared_ids`` (the shared replicas) belong to none."""
        plan = ctx.plan
        if not callable(getattr(stage, "parallel_units", None)):
            raise ValueError(f"DataParallel: {type(stage).__name__} has no parallel_units(); a "
                             f"stage lists its modules by layout there (see "
                             f"models.gpt.TransformerStage.parallel_units)")
        owner: dict[int, str] = {i: "shared replica" for i in shared_ids}
        units: list[_Unit] = []
        for position, (name, module, layer) in enumerate(stage.parallel_units()):
            try:
                named = stage.get_submodule(name)
            except AttributeError:
                named = None
            if named is not module:  # the FQNs below must be the stage's own
                raise ValueError(f"DataParallel: {type(stage).__name__}.parallel_units() names "
                                 f"{name!r}, which is not that module's FQN in the stage")
            if layer is None:
                groups, dp_mode = ctx.vocab_groups(), plan.vocab.dp_mode
            elif getattr(module, "expert_groups", None) is not None:
                # an MoE layer's experts: summed over the expert-DP group in their own mode
                groups = module.expert_groups.dp
                dp_mode = plan.layers[layer].experts_dp_mode
            else:
                groups, dp_mode = ctx.layer_groups(layer), plan.layers[layer].dp_mode
            params = []
            for sub, p in module.named_parameters():
                if id(p) in owner:  # shared with an earlier unit: that one owns it
                    continue
                owner[id(p)] = name
                params.append((f"{name}.{sub}", p))
            if params:
                mode = dp_mode if groups.dp_size > 1 else "ddp"
                units.append(_Unit(name, module, groups, mode, params, position))
        loose = [n for n, p in stage.named_parameters() if id(p) not in owner]
        if loose:
            raise ValueError(f"DataParallel: parameters {loose} belong to no unit of "
                             f"{type(stage).__name__}.parallel_units(); list the module that "
                             f"holds them (a layer or a vocab-layout module) so that they get a "
                             f"data-parallel group")
        for unit in units:
            if unit.dp_mode not in ALL_DP_MODES:
                raise ValueError(f"DataParallel: dp_mode={unit.dp_mode!r} for {unit.name}: "
                                 f"choose one of {', '.join(ALL_DP_MODES)}")
        return units

    @staticmethod
    def _has_tied_copy(stage: nn.Module, ctx: Any) -> bool:
        """Whether this rank holds one of the two word-embedding copies that must stay tied."""
        if getattr(ctx, "embedding_group", None) is None:
            return False
        config = getattr(stage, "config", None)
        if getattr(config, "untie_embeddings_and_output_weights", False):
            return False
        return TIED_EMBEDDING_FQN in dict(stage.named_parameters())

    def _counts_in_norm(self, fqn: str, tp_sharded: bool, unit: _Unit) -> bool:
        groups = unit.groups
        if self._tied and fqn == TIED_EMBEDDING_FQN and not self.ctx.is_first_stage:
            return False  # the last stage's copy: the first stage counts it
        experts = getattr(unit.module, "expert_groups", None)
        if experts is not None:
            # EP (and expert-TP) shards, replicated over the tp / expert_tp expert-TP groups
            # of the layer's TP group: replica 0 counts them (its expert_tp members each
            # count their own shard)
            if experts.expert_replica != 0:
                return False
            tp_sharded = True
        if groups.tp_size > 1 and not tp_sharded and groups.tp_rank != 0:
            return False  # TP-replicated (norm weights, row-parallel bias): once per TP group
        if unit.dp_mode == "ddp" and groups.dp_size > 1 and groups.dp_rank != 0:
            return False  # identical replica after the all-reduce
        return True  # TP shard, ZeRO shard (zero1: the optimizer's slice), or the only copy

    def _shard(self, unit: _Unit) -> None:
        dtype = PRECISIONS[self.precision]
        # FSDP2 (torch 2.13 docs, MixedPrecisionPolicy): param_dtype is the dtype of the
        # all-gathered parameters and so of the unsharded gradients; reduce_dtype=fp32 upcasts
        # them before the reduce-scatter, and the sharded fp32 master gets an fp32 gradient. On
        # CUDA autocast then computes in the same 16-bit dtype the gather produced (no second
        # cast); the ddp path keeps fp32 gradients throughout (cost_time.GATHER_BYTES).
        policy = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
                  if dtype is not None else MixedPrecisionPolicy())
        # parameters of the module that other, unsharded units own (an MoE layer's ddp or zero1
        # experts inside a zero2/3 layer) stay out of this unit's FSDP2 shards
        own = {id(p) for _, p in unit.params}
        sharded = {id(p) for u in self._units if u.dp_mode in ("zero2", "zero3")
                   for _, p in u.params}
        ignored = {p for p in unit.module.parameters() if id(p) not in own | sharded}
        fully_shard(unit.module, mesh=unit.groups.dp_mesh,
                    reshard_after_forward=unit.dp_mode == "zero3", mp_policy=policy,
                    ignored_params=ignored or None)
        module: Any = unit.module
        assert isinstance(module, FSDPModule)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
        for method in EMBEDDING_FORWARD_METHODS:
            if callable(getattr(module, method, None)):
                register_fsdp_forward_method(module, method)

    # ------------------------------------------------------------- iteration
    def parameters(self) -> Iterator[nn.Parameter]:
        """What the optimizer should own: full ``ddp`` parameters, ZeRO-2/3 DTensor shards and
        this rank's flat ``zero1`` slices (see :mod:`.distributed_optimizer`)."""
        for p in self.stage.parameters():
            if not self._zero1.owns(p):
                yield p
        yield from self._zero1.shards()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Call once with the optimizer built on :meth:`parameters`: after each of its steps
        the ``zero1`` parameters are all-gathered (collective; nothing without zero1 units)."""
        if self._zero1.buckets.num_buckets:
            self._zero1.attach(optimizer)

    @property
    def zero1(self) -> ZeroOneShards:
        """The ``zero1`` state of this rank (empty without zero1 layers): for checkpoints."""
        return self._zero1

    def set_microbatch(self, index: int, num_microbatches: int) -> None:
        """Call before micro-batch ``index``'s backward (0-based, ``num_microbatches`` in all)."""
        if not 0 <= index < num_microbatches:
            raise ValueError(f"set_microbatch(index={index}, num_microbatches="
                             f"{num_microbatches}): need 0 <= index < num_microbatches")
        last = index == num_microbatches - 1
        self._buckets.set_sync(last)
        self._zero1.buckets.set_sync(last)
        for unit in self._sharded:
            if unit.dp_mode == "zero2":
                # Keep the gathered parameters between micro-batches; free them after the last.
                unit.module.set_reshard_after_backward(last)  # type: ignore[operator]

    def finish_grad_sync(self) -> None:
        """After the last backward: wait for ``ddp`` buckets, then sum the tied embedding copies."""
        self._buckets.finish()
        self._buckets.set_sync(True)
        self._zero1.buckets.finish()
        self._zero1.buckets.set_sync(True)
        for _, param, group, _ in self._shared:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            if group is not None:
                dist.all_reduce(param.grad, group=group)
        if self._tied:
            param = dict(self.stage.named_parameters())[TIED_EMBEDDING_FQN]
            if self._zero1.owns(param):
                # Its own buckets on both stages: the same reduced slices, summed pairwise.
                for bucket in self._zero1.buckets.buckets():
                    if any(p is param for p in bucket.params):
                        dist.all_reduce(bucket.shard, group=self.ctx.embedding_group)
                return
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(local_tensor(param.grad), group=self.ctx.embedding_group)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global L2 gradient norm, each model element counted once; clips if ``max_norm > 0``.

        Collective over the world. Returns the norm before clipping; inf/nan propagate.
        """
        entries, grads = [], []
        for fqn, p in self.stage.named_parameters():
            if p.grad is None or self._zero1.owns(p):  # zero1: its reduced slices count
                continue
            grad = local_tensor(p.grad)
            grads.append(grad)
            entries.append(NormEntry(grad, self._counted.get(fqn, True)))
        for piece in self._zero1.pieces:
            grads.append(piece.shard.grad)
            entries.append(NormEntry(piece.shard.grad, self._counted.get(piece.fqn, True)))
        device = getattr(self.ctx, "device", None)
        norm = global_grad_norm(entries, device=device)
        clip_grads_(grads, max_norm, norm)
        return norm

    def zero_grad(self) -> None:
        """Zero ``ddp`` gradient buffers (kept allocated) and drop sharded gradients."""
        self._buckets.zero_grad()
        self._zero1.buckets.zero_grad()
        for unit in self._sharded:
            for _, p in unit.module.named_parameters():
                p.grad = None
        for unit in self._units:
            if unit.dp_mode == "ddp" and unit.groups.dp_size == 1:
                for _, p in unit.params:
                    p.grad = None
        for _, param, _, _ in self._shared:
            param.grad = None

    # ------------------------------------------------------------ reporting
    @property
    def num_buckets(self) -> int:
        """``ddp`` gradient buckets on this rank."""
        return self._buckets.num_buckets

    @property
    def last_num_overlapped(self) -> int:
        """Buckets of the last :meth:`finish_grad_sync` whose all-reduce started during backward."""
        return self._buckets.last_num_overlapped

    def describe(self) -> list[dict[str, Any]]:
        """One row per unit: name, effective dp mode, dp size, local parameter elements."""
        return [{"unit": u.name, "dp_mode": u.dp_mode, "dp_size": u.groups.dp_size,
                 "local_numel": sum(local_tensor(p).numel() for p in u.module.parameters())}
                for u in self._units]
