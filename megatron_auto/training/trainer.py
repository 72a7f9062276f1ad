"""One training iteration of a plan: the trainer state and the step (docs/design.md §8).

:func:`build_trainer` (collective) builds, for one rank and one plan, the parallel context, the
rank's pipeline stage (from the entry script's ``model_provider``), data parallelism and the
optimizer. :func:`train_step` runs one iteration: zero gradients, set the learning rate, split
the global batch into the plan's micro-batches, run the pipeline schedule (forward, backward,
data-parallel gradient sync), unscale fp16 gradients, compute/clip the global gradient norm,
skip the step when it is inf/nan on any rank (fp16) or, with
``--check-for-nan-in-loss-and-grad``, stop the run on a non-finite loss or gradient, optimizer step, and reduce the loss over
the world. :func:`evaluate` is the forward-only twin.

Tests drive :func:`build_trainer` + :func:`train_step` directly, so they exercise exactly the
code the command line runs (``pretrain.py`` is the loop around them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..config import ModelConfig
from ..models.compile import compile_layers
from ..models.moe import moe_layers, set_aux_loss_scale
from ..parallel.context import ParallelContext
from ..parallel.data_parallel import DataParallel
from ..parallel.optimizer import build_optimizer
from ..plan_optimizer_offload import stage_fraction
from ..parallel.pipeline import forward_backward
from ..parallel.timers import Timers
from ..plan import Plan
from ..run_config import LRConfig, OptimizerConfig, PrecisionConfig
from .data import split_microbatches
from .lr_scheduler import lr_at, set_lr
from .moe_metrics import moe_step_metrics
from .precision import LossScaler, autocast_dtype, unscale_

ModelProvider = Callable[[ModelConfig, ParallelContext, int], nn.Module]


@dataclass(frozen=True)
class TaskSpec:
    """What differs between model families beyond the three providers (GPT: the defaults).

    ``model_overrides`` replace ``ModelConfig`` fields after flag parsing (BERT: model_type,
    token types); ``sentence_level_data`` asks for sentence-split embedded data;
    ``every_stage_reads_batch`` gives the batch to middle stages too (BERT's padding mask is
    needed by every layer); ``loss_part_keys`` are the entries of the last stage's
    ``last_losses`` that are summed over micro-batches and ranks, and ``named_losses`` turns
    those sums into the extra losses to log (BERT: ``mlm_loss``, ``sop_loss``).
    """

    model_overrides: Mapping[str, Any] = field(default_factory=dict)
    sentence_level_data: bool = False
    every_stage_reads_batch: bool = False
    loss_part_keys: tuple[str, ...] = ()
    named_losses: Callable[[dict[str, float]], dict[str, float]] | None = None
    # False for a task with its own model config and data (the vision classifiers: the entry
    # script converts its model flags itself): the text data source (tokenizer, embedded
    # corpus) is then not prepared, and the datasets provider gets a DataSource naming only the
    # kind and the paths.
    text_data: bool = True
    # The model families the script trains (a --hf-config of another is refused naming the
    # family's script).
    model_families: tuple[str, ...] = ("gpt",)


GPT_TASK = TaskSpec()


class NonFiniteError(ValueError):
    """``--check-for-nan-in-loss-and-grad``: the loss or the gradient norm of an iteration was
    inf/nan. Raised on every rank alike (the decision is all-reduced), before the optimizer
    step, so the run stops instead of training on garbage; the entry point prints it as one
    ``error:`` line and exits 2."""



@dataclass
class Trainer:
    """Everything one rank needs to run iterations of a plan."""

    ctx: ParallelContext
    plan: Plan
    model_config: ModelConfig
    stage: nn.Module
    data_parallel: DataParallel
    optimizer: torch.optim.Optimizer
    optimizer_config: OptimizerConfig
    lr_config: LRConfig
    precision: PrecisionConfig
    scaler: LossScaler
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    history: list[dict] = field(default_factory=list)
    task: TaskSpec = GPT_TASK
    check_for_nan: bool = False  # --check-for-nan-in-loss-and-grad
    # --timing-log-level: the phase timers (level 0: all no-ops); the loop reads them.
    timers: Timers = field(default_factory=Timers)

    @property
    def reads_data(self) -> bool:
        """First- and last-stage ranks read the global batch; middle stages only if the task says."""
        return (self.ctx.is_first_stage or self.ctx.is_last_stage
                or self.task.every_stage_reads_batch)


@dataclass
class StepResult:
    lm_loss: float  # global mean over the batch's masked tokens (same on every rank)
    num_tokens: float
    grad_norm: float
    skipped: bool
    lr: float
    loss_scale: float
    extra_losses: dict[str, float] = field(default_factory=dict)
    # MoE models: the router's statistics of the step (training/moe_metrics.py), else empty
    moe_metrics: dict[str, Any] = field(default_factory=dict)


def build_trainer(model_config: ModelConfig, plan: Plan, model_provider: ModelProvider, *,
                  optimizer_config: OptimizerConfig = OptimizerConfig(),
                  lr_config: LRConfig = LRConfig(),
                  precision: PrecisionConfig = PrecisionConfig(), seed: int = 1234,
                  device: torch.device | None = None, task: TaskSpec = GPT_TASK,
                  compile_backend: str | None = None,
                  check_for_nan: bool = False, timing_log_level: int = 0) -> Trainer:
    """Collective: build context, stage, data parallelism and optimizer for ``plan``.

    ``plan`` must be valid for ``model_config``: every maker of plans (``plan_source.make_plan``,
    ``auto.plan_for_run``, the CLI) validates it when it makes it. ``timing_log_level`` (0, 1,
    2: ``--timing-log-level``) sets ``trainer.timers`` (``parallel/timers.py``).
    """
    ctx = ParallelContext(plan, device=device)
    torch.manual_seed(seed)
    stage = model_provider(model_config, ctx, seed)
    if compile_backend is not None:  # before data parallelism: FSDP2's hooks get traced too
        compile_layers(stage.layers.values(), compile_backend, ctx.device)
    data_parallel = DataParallel(stage, ctx, precision=precision.name)
    optimizer = build_optimizer(data_parallel.parameters(), optimizer_config, lr=lr_config.lr,
                                named_parameters=stage.named_parameters(),
                                offload_fraction=stage_fraction(
                                    plan.pipeline.optimizer_offload_fraction, ctx.stage))
    data_parallel.attach_optimizer(optimizer)  # zero1: all-gather parameters after each step
    # A world-wide collective before the first pipeline transfer: NCCL requires every rank of a
    # group to take part in its first batched p2p call otherwise, which a pipeline never does.
    dist.barrier()
    return Trainer(ctx=ctx, plan=plan, model_config=model_config, stage=stage,
                   data_parallel=data_parallel, optimizer=optimizer,
                   optimizer_config=optimizer_config, lr_config=lr_config, precision=precision,
                   scaler=LossScaler(precision), task=task, check_for_nan=check_for_nan,
                   timers=Timers(timing_log_level, ctx.device))


def _microbatches(trainer: Trainer, batch: dict[str, torch.Tensor] | None) -> tuple[list[dict], float]:
    num_mb = trainer.plan.num_microbatches
    if not trainer.reads_data:
        return [{} for _ in range(num_mb)], 1.0
    if batch is None:
        raise ValueError("train_step: ranks of the first and last stage need the global batch")
    total_tokens = float(batch["loss_mask"].sum()) if "loss_mask" in batch else 1.0
    return split_microbatches(batch, num_mb, trainer.ctx.device), total_tokens


def _reduce_loss(trainer: Trainer, losses: list[tuple[float, float]]) -> tuple[float, float]:
    """Global mean loss: sums of (loss, tokens) over last-stage ranks, divided.

    Every TP rank of a last-stage replica reports the same slice, so both sums carry the same
    multiplicity and their quotient is exact.
    """
    totals = torch.tensor([sum(l for l, _ in losses), sum(t for _, t in losses)],
                          dtype=torch.float64, device=trainer.ctx.device)
    dist.all_reduce(totals)
    loss_sum, tokens = totals.tolist()
    return (loss_sum / tokens if tokens > 0 else float("nan")), tokens


def train_step(trainer: Trainer, batch: dict[str, torch.Tensor] | None) -> StepResult:
    """One training iteration on the global ``batch`` (``None`` on middle-stage ranks)."""
    iteration = trainer.iteration + 1
    lr = lr_at(trainer.lr_config, iteration)
    set_lr(trainer.optimizer, lr)
    trainer.data_parallel.zero_grad()
    microbatches, total_tokens = _microbatches(trainer, batch)
    scale = trainer.scaler.scale
    # MoE: the auxiliary losses' mean over the global batch's sequences, like the LM loss's
    set_aux_loss_scale(trainer.stage, scale / trainer.plan.global_batch_size)
    for moe in moe_layers(trainer.stage):
        moe.reset_stats()
    parts: list[dict] = []
    timers = trainer.timers
    losses = forward_backward(trainer.stage, trainer.data_parallel, trainer.ctx, microbatches,
                              schedule=trainer.plan.pipeline.schedule, total_tokens=total_tokens,
                              loss_scale=scale, autocast_dtype=autocast_dtype(trainer.precision),
                              loss_parts=parts, timers=timers)
    moe_metrics = moe_step_metrics(trainer.stage, trainer.ctx, trainer.model_config)
    with timers("optimizer"):
        params = list(trainer.data_parallel.parameters())
        unscale_(params, scale)
        if trainer.check_for_nan:  # before clipping: a nan norm would spread nan to every rank
            _check_finite(trainer, iteration, losses, params)
        with timers("optimizer-clip-main-grad", 2):
            grad_norm = float(trainer.data_parallel.clip_grad_norm_(
                trainer.optimizer_config.clip_grad))
        # The norm is already global; the flag all-reduce makes the skip decision identical on
        # every rank even if a future norm implementation were only group-local.
        found_inf = torch.tensor([0.0 if math.isfinite(grad_norm) else 1.0],
                                 device=trainer.ctx.device)
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        skipped = bool(found_inf.item())
        if skipped:
            trainer.skipped_iterations += 1
        else:
            with timers("optimizer-inner-step", 2):
                trainer.optimizer.step()
        trainer.scaler.update(skipped)
    with timers("loss-reduce", 2):
        lm_loss, tokens = _reduce_loss(trainer, losses)
    trainer.iteration = iteration
    trainer.consumed_samples += trainer.plan.global_batch_size
    return StepResult(lm_loss=lm_loss, num_tokens=tokens, grad_norm=grad_norm, skipped=skipped,
                      lr=lr, loss_scale=scale, extra_losses=_named_losses(trainer, parts),
                      moe_metrics=moe_metrics)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (FSDP2's are sharded DTensors)."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _check_finite(trainer: Trainer, iteration: int, losses: list[tuple[float, float]],
                  params: list[nn.Parameter]) -> None:
    """Collective: raise :class:`NonFiniteError` naming the iteration, the ranks and what was
    not finite (the loss of this rank's micro-batches, or its gradients).

    Under fp16 a non-finite gradient is the loss scaler's business (the step is skipped and the
    scale backs off, as Megatron), so only the loss is checked there.
    """
    world, rank, device = trainer.ctx.world_size, trainer.ctx.rank, trainer.ctx.device
    flags = torch.zeros(2 * world, dtype=torch.float32, device=device)
    if not all(math.isfinite(loss) for loss, _ in losses):
        flags[rank] = 1.0
    if not trainer.precision.fp16:
        grads = [_local(p.grad) for p in params if p.grad is not None]
        if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
            flags[world + rank] = 1.0
    dist.all_reduce(flags)
    bad = flags.tolist()
    for what, offset in (("loss", 0), ("grad norm", world)):
        ranks = [r for r in range(world) if bad[offset + r]]
        if ranks:
            raise NonFiniteError(
                f"--check-for-nan-in-loss-and-grad: iteration {iteration}: {what} is not finite "
                f"(inf/nan) on rank{'s' if len(ranks) > 1 else ''} "
                f"{', '.join(map(str, ranks))}; lower --lr, or check the data and the model")


def _named_losses(trainer: Trainer, parts: list[dict]) -> dict[str, float]:
    """Sum the task's loss parts over micro-batches and ranks, then name them (BERT: mlm/sop)."""
    keys = trainer.task.loss_part_keys
    if not keys or trainer.task.named_losses is None:
        return {}
    totals = torch.tensor([sum(p.get(k, 0.0) for p in parts) for k in keys],
                          dtype=torch.float64, device=trainer.ctx.device)
    dist.all_reduce(totals)
    return trainer.task.named_losses(dict(zip(keys, totals.tolist())))


def evaluate(trainer: Trainer, batches: Sequence[dict[str, torch.Tensor] | None]) -> float:
    """Mean validation loss over ``batches`` (forward only, no gradient, no state change)."""
    trainer.stage.eval()
    losses: list[tuple[float, float]] = []
    try:
        for batch in batches:
            microbatches, total_tokens = _microbatches(trainer, batch)
            losses += forward_backward(trainer.stage, None, trainer.ctx, microbatches,
                                       schedule=trainer.plan.pipeline.schedule,
                                       total_tokens=total_tokens, forward_only=True,
                                       autocast_dtype=autocast_dtype(trainer.precision))
    finally:
        trainer.stage.train()
    return _reduce_loss(trainer, losses)[0]
