"""Checkpoints with torch.distributed.checkpoint (DCP), resharded on load across plans.

Layout (Megatron's)::

    SAVE_DIR/latest_checkpointed_iteration.txt    # "100": the last COMPLETE checkpoint
    SAVE_DIR/iter_0000100/.metadata, __*_*.distcp # DCP files (every rank writes its pieces)
    SAVE_DIR/iter_0000100/checkpoint_info.json    # scalars, plan, model config and the
                                                  # verification record (rank 0, written last)

What DCP holds, keyed by plan-independent names (docs/design.md §4):

- ``model.<fqn>``: every parameter as its GLOBAL tensor. Each rank contributes the rectangular
  chunk it holds: a TP shard (``stage.shard_specs``: chunk ``tp_rank`` along ``dim``; an expert
  weight under EP and expert TP is cut along two dimensions), further cut
  by FSDP2 along dim 0 for ``zero2``/``zero3`` layers, or the whole tensor. Replicas (``ddp``
  ranks, the tied word-embedding copy of the last stage) offer the same chunk under the same
  key and DCP's save planner keeps one of them, so every element is written once.
- ``optimizer.<fqn>.<state>``: AdamW's ``exp_avg``/``exp_avg_sq`` chunked like the parameter,
  ``step`` as a replicated scalar. ``zero1`` layers hold flat slices of them; their states are
  gathered over the DP group into whole tensors for the checkpoint (so they look like ``ddp``
  states and reshard to any plan) and sliced back on load.
- ``rng.rank<r>.<stream>``: this rank's default generator and its dropout streams. They are
  restored only when the loading run has the same plan (same world, same layout): under another
  plan the streams belong to other ranks, so a resharded run keeps its fresh seed-derived ones.

``checkpoint_info.json`` holds iteration, consumed samples, skipped iterations, the loss-scaler
state (the LR schedule is a pure function of the iteration), the plan and the model config.

Resharding: on load every rank describes the chunks it now holds the same way and ``dcp.load``
fills them from whatever chunks were saved (DCP intersects the saved and requested chunks).
What is written here by hand, and why: the chunk description (offsets in the global tensor) of
each local tensor, handed to DCP's default planners (:class:`_ChunkSavePlanner`,
:class:`_ChunkLoadPlanner`). TP shards are plain tensors, not DTensors, and a TP shard further
cut by FSDP2 would need a 2-D strided DTensor on a sub-grid mesh per layer; a ``ShardedTensor``
insists that the shards it knows cover the whole tensor, which needs every rank's chunks (and
replicas would break its no-overlap rule). Offsets need none of that. The ``state_dict`` helpers
(``get_state_dict``) are not used: they would only map FQNs for us, and their optimizer-state
initialisation returns early when gradients exist (our ``ddp`` gradients are permanent views
into the all-reduce buckets) and resets gradients to ``None`` (detaching them from the buckets).

Atomicity and verification (``checkpoint_verify.py``): a save writes into a hidden
``.incomplete_iter_NNNNNNN`` directory; after ``dcp.save`` returned on every rank (DCP wrote its
``.metadata`` last) the ranks checksum the files, rank 0 writes ``checkpoint_info.json`` with that
record, renames the directory to ``iter_NNNNNNN`` and then replaces ``latest`` (``atomic_write``,
fsynced). A crash at any point leaves ``latest`` and every ``iter_*`` directory complete; a load
verifies the record and falls back to the newest intact older checkpoint. ``async_save``: the
same steps in a background thread over a gloo group of their own, after ``dcp.async_save``
copied the state.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import time
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner, DefaultSavePlanner,
                                                          create_default_local_load_plan)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from ..utils.atomicfile import atomic_write
from ..config import ModelConfig
from ..parallel.context import ParallelContext
from ..parallel.data_parallel import DataParallel
from ..families.registry import family_of, family_of_record
from ..plan import Plan
from .checkpoint_verify import (FORMAT, INFO_FILE, LATEST_FILE, RECORD_KEY, VERSION,  # noqa: F401 - re-exported
                                CheckpointError, INCOMPLETE_PREFIX, choose_checkpoint,
                                describe_files, incomplete_dir, iteration_dir, latest_iteration)
from .logging import get_logger
from .precision import LossScaler

class TrainingState(Protocol):
    """What a checkpoint saves and restores (``trainer.Trainer`` is one; this module needs no
    more than these attributes, so it does not import the trainer)."""

    ctx: ParallelContext
    plan: Plan
    model_config: ModelConfig
    stage: torch.nn.Module
    data_parallel: DataParallel
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    iteration: int
    consumed_samples: int
    skipped_iterations: int


def has_checkpoint(root: str | os.PathLike) -> bool:
    """Whether ``root`` records a finished save (its ``latest`` file). A missing or empty
    directory, or one holding only an interrupted save, has none: training starts from scratch
    there, as Megatron does, so one ``--save D --load D`` command serves every restart."""
    return os.path.isfile(os.path.join(os.fspath(root), LATEST_FILE))


# ------------------------------------------------------------------------ chunk description
def _chunk(value: torch.Tensor, spec: Any) -> tuple[torch.Tensor, list[int], list[int]]:
    """(local data, offsets in the global tensor, global shape) of a parameter-shaped value.

    ``value`` is a parameter or optimizer state: plain (the whole TP-local tensor) or an FSDP2
    DTensor (a dim-0 chunk of the TP-local tensor). ``spec`` is the parameter's TP
    :class:`~megatron_auto.models.init.ShardSpec` (None when not TP-sharded); a two-dimensional
    one (an expert weight under EP and expert TP) offsets both dimensions.
    """
    if isinstance(value, DTensor):
        chunk, = value.__create_chunk_list__()  # DCP's own description of the DTensor shard
        local, offsets = value.to_local(), list(chunk.offsets)
    else:
        local, offsets = value, [0] * value.dim()
    shape = list(value.shape)  # the TP-local global shape
    # outer split last: an inner chunk's offset is within the outer chunk (other dimension)
    for split in reversed(spec.splits() if spec is not None else []):
        offsets[split.dim] += split.tp_rank * shape[split.dim]
        shape[split.dim] *= split.tp_size
    return local.detach(), offsets, shape


class _ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, told which global chunk each local tensor is.

    ``chunks``: key -> (offsets, global shape) of the plain local tensor ``state_dict[key]``.
    Those keys are written as shards of the global tensor; identical chunks offered by replicas
    share a ``MetadataIndex`` and DCP's deduplication keeps one. Other keys (scalars, RNG
    states) go the default way.
    """

    def __init__(self, chunks: dict[str, tuple[list[int], list[int]]]) -> None:
        super().__init__()
        self.chunks = chunks

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [self._shard_item(i.index.fqn) if i.index.fqn in self.chunks else i
                 for i in plan.items]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def _shard_item(self, key: str) -> WriteItem:
        local = self.state_dict[key]
        offsets, shape = self.chunks[key]
        return WriteItem(index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                         tensor_data=TensorWriteData(
                             chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                        sizes=local.size()),
                             properties=TensorProperties.create_from_tensor(local),
                             size=torch.Size(shape)))

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.chunks:
            return self.state_dict[index.fqn]
        return super().lookup_object(index)


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, told which global chunk each local tensor is.

    DCP intersects every requested chunk with the saved ones (``create_read_items_for_chunk_list``)
    and copies the overlaps straight into the local tensors: the resharding itself is DCP's.
    """

    def __init__(self, chunks: dict[str, tuple[list[int], list[int]]]) -> None:
        super().__init__()
        self.chunks = chunks

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        plain = {k: v for k, v in self.state_dict.items() if k not in self.chunks}
        requests = list(create_default_local_load_plan(plain, self.metadata, True).items)
        for key, (offsets, shape) in self.chunks.items():
            md = saved.get(key)
            if md is None:
                raise CheckpointError(f"the checkpoint has no {key!r} (saved by another model "
                                      f"or optimizer?); load a checkpoint of this model")
            if list(md.size) != list(shape):
                raise CheckpointError(f"{key}: the checkpoint's global shape is {list(md.size)} "
                                      f"but this model's is {shape}; load a matching checkpoint")
            local = self.state_dict[key]
            requests += create_read_items_for_chunk_list(
                key, md, [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=local.size())])
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.chunks:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)


def _tensor_state(trainer: TrainingState) -> tuple[dict[str, Any], dict[str, tuple[list[int], list[int]]]]:
    """Model and optimizer entries of this rank (sharing storage with the live tensors), and
    the global chunk of each parameter-shaped one."""
    stage, optimizer = trainer.stage, trainer.optimizer
    specs = getattr(stage, "shard_specs", None) or {}
    state: dict[str, Any] = {}
    chunks: dict[str, tuple[list[int], list[int]]] = {}
    zero1 = trainer.data_parallel.zero1.full_state(optimizer)  # collective; {} without zero1
    for fqn, param in stage.named_parameters():
        spec = specs.get(fqn)
        local, offsets, shape = _chunk(param, spec)
        if local.numel() == 0:  # an uneven FSDP2 split left this rank nothing
            continue
        state[f"model.{fqn}"], chunks[f"model.{fqn}"] = local, (offsets, shape)
        for name, value in (zero1.get(fqn) or optimizer.state.get(param, {})).items():
            if not isinstance(value, torch.Tensor):
                continue
            key = f"optimizer.{fqn}.{name}"
            if value.dim() == 0:  # AdamW's step: a replicated scalar
                state[key] = value.detach()
            else:
                local, offsets, shape = _chunk(value, spec)
                state[key], chunks[key] = local, (offsets, shape)
    return state, chunks


def _world_mib(state: dict[str, Any], device: torch.device) -> float:
    """MiB of tensors all ranks write (or read) together: the progress lines' size and rate.
    Collective (one scalar all-reduce)."""
    local = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    total = torch.tensor([float(local)], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return float(total.item()) / 2**20


def _rng_state(trainer: TrainingState) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    out = {f"rng.rank{rank}.cpu": torch.get_rng_state()}
    if trainer.ctx.device.type == "cuda":
        out[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state(trainer.ctx.device)
    tracker = getattr(trainer.stage, "rng", None)
    if tracker is not None:
        for name, state in tracker.get_states().items():
            out[f"rng.rank{rank}.stream.{name}"] = state.clone()
    return out


def _set_rng_state(trainer: TrainingState, state: dict[str, torch.Tensor]) -> None:
    prefix = f"rng.rank{dist.get_rank()}."
    torch.set_rng_state(state[prefix + "cpu"])
    if prefix + "cuda" in state:
        torch.cuda.set_rng_state(state[prefix + "cuda"], trainer.ctx.device)
    tracker = getattr(trainer.stage, "rng", None)
    if tracker is not None:
        streams = {k[len(prefix + "stream."):]: v for k, v in state.items()
                   if k.startswith(prefix + "stream.")}
        tracker.set_states(streams)


# ----------------------------------------------------------------------------------- save
_SAVE_THREAD: concurrent.futures.ThreadPoolExecutor | None = None
_PENDING: concurrent.futures.Future | None = None  # the asynchronous save still being finished
_ASYNC_GROUP: Any = None


def _async_group() -> Any:
    """The gloo group asynchronous saves talk over (made once, collectively, at the first one):
    their collectives run in a background thread and must not interleave with training's."""
    global _ASYNC_GROUP
    if _ASYNC_GROUP is None:
        _ASYNC_GROUP = dist.new_group(backend="gloo")
    return _ASYNC_GROUP


def wait_for_pending_save() -> None:
    """Block until the previous asynchronous save is complete (record and ``latest`` written);
    re-raises its error. Every rank calls it before the next save, a load, and exit."""
    global _PENDING
    pending, _PENDING = _PENDING, None
    if pending is not None:
        start = time.perf_counter()
        pending.result()
        waited = time.perf_counter() - start
        if waited > 0.01:
            get_logger().info(f"> waited {waited:.2f} s for the previous asynchronous save")


def _info(trainer: TrainingState) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "iteration": trainer.iteration,
            "consumed_samples": trainer.consumed_samples,
            "skipped_iterations": trainer.skipped_iterations,
            "loss_scaler": trainer.scaler.state_dict(),
            "world_size": trainer.ctx.world_size,
            # False before the first optimizer step (--train-iters 0): AdamW creates its state
            # lazily, so such a checkpoint holds none and a load must not ask for it
            "optimizer_state": bool(trainer.optimizer.state),
            "plan": trainer.plan.to_dict(), "model": trainer.model_config.to_dict()}


def _publish(info: dict[str, Any], work: str, save_dir: str, group: Any = None) -> str:
    """Collective over ``group``, after DCP finished writing ``work`` on every rank: the
    verification record (written last), the rename to ``iter_*``, then ``latest``."""
    info = dict(info, **{RECORD_KEY: describe_files(work, group)})
    final = iteration_dir(save_dir, info["iteration"])
    if dist.get_rank(group) == 0:
        atomic_write(os.path.join(work, INFO_FILE), json.dumps(info, indent=1) + "\n",
                     durable=True)
        if os.path.lexists(final):  # an older save of this iteration (e.g. a damaged one)
            stale = os.path.join(save_dir, f"{INCOMPLETE_PREFIX}replaced_{os.path.basename(final)}")
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
            os.replace(work, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(work, final)
        _fsync_dir(save_dir)
        atomic_write(os.path.join(save_dir, LATEST_FILE), f"{info['iteration']}\n", durable=True)
    dist.barrier(group)  # nobody moves on (or loads) before ``latest`` names the new checkpoint
    return final


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(trainer: TrainingState, save_dir: str | os.PathLike, *,
                    async_save: bool = False) -> str:
    """Collective: write ``save_dir/iter_<iteration>`` and then point ``latest`` at it.

    Call between iterations (gradients are not saved). Returns the iteration directory (which
    exists once the save is complete). The files go to ``incomplete_dir`` first and are renamed
    after the verification record is written, so no ``iter_*`` directory is ever partial.
    ``async_save``: ``dcp.async_save`` copies the state (the only stall) and a background
    thread writes it, then the record and ``latest`` (:func:`wait_for_pending_save` waits).
    A save always waits for the previous one first.
    """
    global _PENDING, _SAVE_THREAD
    log = get_logger()
    wait_for_pending_save()
    start = time.perf_counter()
    save_dir = os.fspath(save_dir)
    work = incomplete_dir(save_dir, trainer.iteration)
    if dist.get_rank() == 0:
        os.makedirs(save_dir, exist_ok=True)
        for name in os.listdir(save_dir):  # debris of interrupted saves
            if name.startswith(INCOMPLETE_PREFIX):
                shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
        os.makedirs(work)
    dist.barrier()
    state, chunks = _tensor_state(trainer)
    state.update(_rng_state(trainer))
    info = _info(trainer)
    final = iteration_dir(save_dir, trainer.iteration)
    mib = _world_mib(state, trainer.ctx.device)  # collective
    log.info(f"> saving checkpoint at iteration {trainer.iteration} to {final} "
             f"({mib:.1f} MiB from {dist.get_world_size()} rank(s)"
             f"{', asynchronously' if async_save else ''}) ...")
    if not async_save:
        dcp.save(state, checkpoint_id=work, planner=_ChunkSavePlanner(chunks))
        _publish(info, work, save_dir)
        seconds = time.perf_counter() - start
        log.info(f"> saved checkpoint at iteration {trainer.iteration} to {final} "
                 f"in {seconds:.2f} s ({mib / max(seconds, 1e-9):.1f} MiB/s)")
        return final
    group = _async_group()
    response = dcp.async_save(state, checkpoint_id=work, planner=_ChunkSavePlanner(chunks),
                              process_group=group)
    upload = getattr(response, "upload_completion", response)  # a Future in either API shape
    iteration = trainer.iteration

    def finish() -> None:
        upload.result()
        _publish(info, work, save_dir, group)
        seconds = time.perf_counter() - start
        log.info(f"> asynchronous checkpoint of iteration {iteration} complete: {final} "
                 f"({seconds:.2f} s after it started, {mib / max(seconds, 1e-9):.1f} MiB/s)")

    if _SAVE_THREAD is None:
        _SAVE_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt")
    _PENDING = _SAVE_THREAD.submit(finish)
    log.info(f"> training continues while iteration {iteration}'s checkpoint is written "
             f"(stalled {time.perf_counter() - start:.2f} s)")
    return final


# ----------------------------------------------------------------------------------- load
def read_info(load_dir: str | os.PathLike, *, fallback: bool = True) -> tuple[str, dict[str, Any]]:
    """(iteration directory, its checkpoint_info.json) of the checkpoint to load under
    ``load_dir``: the latest intact one (collective when distributed; see
    :func:`~megatron_auto.training.checkpoint_verify.choose_checkpoint`)."""
    wait_for_pending_save()
    return choose_checkpoint(load_dir, fallback=fallback)


def check_model_matches(saved: dict[str, Any], config: Any, where: str) -> None:
    """Raise CheckpointError unless ``saved`` (a checkpoint's model record) describes a model of
    ``config``'s kind (a family of the same config class: GPT and BERT, ViT and Swin) that
    agrees on every checkpoint field of ``config``'s family; the message names the first field
    that differs and the flag that sets it."""
    family = family_of(config)
    try:
        saved_family = family_of_record(saved)
    except ValueError:
        saved_family = None
    if saved_family is None or saved_family.config_class is not family.config_class:
        raise CheckpointError(f"--load={where}: the checkpoint holds a {saved.get('model_type')} "
                              f"model, this run trains a {family.label}; "
                              f"load a checkpoint of this model")
    saved_config = family.config_from_dict(saved)
    for name, flag in family.checkpoint_fields.items():
        old, new = getattr(saved_config, name), getattr(config, name)
        if old != new:
            raise CheckpointError(
                f"--load={where}: the checkpoint's model has {name}={old} but this run has "
                f"{name}={new}; set {flag} to match the checkpoint, or load a checkpoint of "
                f"this model")


@torch.no_grad()
def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (to be overwritten) with one step at lr 0.

    At lr 0 AdamW changes no parameter (decay factor 1, update 0); the current gradients (the
    ``ddp`` bucket views) are put back afterwards.
    """
    if optimizer.state:
        return
    saved_grads, saved_lrs = [], []
    for group in optimizer.param_groups:
        saved_lrs.append(group["lr"])
        group["lr"] = 0.0
        for p in group["params"]:
            saved_grads.append(p.grad)
            p.grad = torch.zeros_like(p)
    optimizer.step()
    grads = iter(saved_grads)
    for group, lr in zip(optimizer.param_groups, saved_lrs):
        group["lr"] = lr
        for p in group["params"]:
            p.grad = next(grads)


def _sync_host_masters(trainer: TrainingState) -> None:
    """An offloaded optimizer's host master weights take the parameters just loaded."""
    sync = getattr(trainer.optimizer, "sync_masters_from_params", None)
    if sync is not None:
        sync()


def load_checkpoint(trainer: TrainingState, load_dir: str | os.PathLike, *,
                    fallback: bool = True,
                    chosen: tuple[str, dict[str, Any]] | None = None) -> int:
    """Collective: restore the latest intact checkpoint under ``load_dir`` into ``trainer``
    (``chosen``: the ``(directory, info)`` a :func:`read_info` of every rank already picked).

    Works under any plan for the same model (see the module docstring). Returns the iteration.
    """
    log = get_logger()
    start = time.perf_counter()
    where = os.fspath(load_dir)
    path, info = chosen if chosen is not None else read_info(load_dir, fallback=fallback)
    check_model_matches(info["model"], trainer.model_config, where)
    if info.get("weights_only"):  # a converted model (tools/checkpoint/convert.py)
        return _load_weights_only(trainer, path)
    if info.get("optimizer_state", True):  # absent in older records: they all have it
        _init_optimizer_state(trainer.optimizer)
    state, chunks = _tensor_state(trainer)
    same_plan = _layout(info["plan"]) == _layout(trainer.plan.to_dict())
    rng = _rng_state(trainer) if same_plan else {}
    state.update(rng)
    mib = _world_mib(state, trainer.ctx.device)
    log.info(f"> loading checkpoint {path} ({mib:.1f} MiB into {dist.get_world_size()} "
             f"rank(s)) ...")
    with torch.no_grad():
        dcp.load(state, checkpoint_id=path, planner=_ChunkLoadPlanner(chunks))
        zero1 = trainer.data_parallel.zero1
        loaded = {piece.fqn: {k.rsplit(".", 1)[1]: v for k, v in state.items()
                              if k.startswith(f"optimizer.{piece.fqn}.")}
                  for piece in zero1.pieces}
        zero1.load_full_state(trainer.optimizer, loaded)  # the slices of the whole states
        _sync_host_masters(trainer)
    if same_plan:
        _set_rng_state(trainer, {k: state[k] for k in rng})
    trainer.iteration = int(info["iteration"])
    trainer.consumed_samples = int(info["consumed_samples"])
    trainer.skipped_iterations = int(info.get("skipped_iterations", 0))
    trainer.scaler.load_state_dict(info["loss_scaler"])
    how = "same plan" if same_plan else (
        f"resharded: saved under {_plan_summary(info['plan'])}, now "
        f"{_plan_summary(trainer.plan.to_dict())}; dropout streams start afresh")
    seconds = time.perf_counter() - start
    log.info(f"> loaded checkpoint {path} (iteration {trainer.iteration}, consumed samples "
             f"{trainer.consumed_samples}, {how}) in {seconds:.2f} s "
             f"({mib / max(seconds, 1e-9):.1f} MiB/s)")
    return trainer.iteration


def _load_weights_only(trainer: TrainingState, path: str) -> int:
    """Load the parameters of a weights-only checkpoint (no optimizer state, data position or
    RNG streams: those start fresh, as with Megatron's ``--finetune``) under this run's plan."""
    start = time.perf_counter()
    state, chunks = _tensor_state(trainer)  # the optimizer has no state yet: parameters only
    state = {k: v for k, v in state.items() if k.startswith("model.")}
    chunks = {k: v for k, v in chunks.items() if k in state}
    with torch.no_grad():
        dcp.load(state, checkpoint_id=path, planner=_ChunkLoadPlanner(chunks))
    _sync_host_masters(trainer)
    get_logger().info(f"> loaded the weights of {path} (a converted model: optimizer and data "
                      f"start fresh) in {time.perf_counter() - start:.2f} s")
    return trainer.iteration


def _recompute_tag(value: Any) -> str:
    """``/rc`` for a whole-layer recompute, ``/rc:selective`` or ``/rc:mlp+norm`` for modules."""
    if isinstance(value, bool) or not value:
        return "/rc" if value else ""
    return "/rc:" + (value if isinstance(value, str) else "+".join(value))


def _plan_summary(plan: dict[str, Any]) -> str:
    """A plan dict in one phrase for the log (world, stages, per-layer tp/dp mode runs)."""
    runs: list[list[Any]] = []
    for layer in plan.get("layers", []):
        key = f"tp{layer.get('tp', 1)}/{layer.get('dp_mode', 'ddp')}" + \
            _recompute_tag(layer.get("recompute"))
        if runs and runs[-1][0] == key:
            runs[-1][1] += 1
        else:
            runs.append([key, 1])
    pipeline = plan.get("pipeline", {})
    layers = " ".join(f"{n}x{key}" for key, n in runs)
    return (f"a {plan.get('world_size')}-rank plan (pp={pipeline.get('size', 1)} "
            f"{list(pipeline.get('layers_per_stage', []))}, layers {layers}, "
            f"{plan.get('num_microbatches')} micro-batches)")


def _layout(plan: dict[str, Any]) -> dict[str, Any]:
    """The parts of a plan dict that decide which rank holds what (not the estimate)."""
    return {k: plan.get(k) for k in ("world_size", "pipeline", "vocab", "layers")}
