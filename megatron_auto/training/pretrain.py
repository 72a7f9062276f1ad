"""The training loop shared by the entry scripts (``pretrain_gpt.py``, ``pretrain_bert.py``).

An entry script supplies three thin providers (STYLE principle 8) and calls :func:`pretrain`:

- ``model_provider(model_config, ctx, seed) -> nn.Module``: this rank's pipeline stage;
- ``datasets_provider(data_config, source, model_config, seed, train_samples, valid_samples,
  test_samples) -> (train, valid, test)``: datasets of item dicts (``None`` when absent);
- ``batch_fn(items) -> dict[str, Tensor]``: stacks items into the global batch whose keys the
  stage takes (``tokens`` for the first stage, ``labels``/``loss_mask`` for the last).

One iteration (:func:`train_step`): zero gradients, set the learning rate, split the global
batch into the plan's micro-batches, run the pipeline schedule (forward, backward, data-parallel
gradient sync), unscale fp16 gradients, compute/clip the global gradient norm, skip the step
when it is inf/nan on any rank (fp16), optimizer step, and reduce the loss over the world.
Tests drive :func:`build_trainer` + :func:`train_step` directly, so they exercise exactly the
code the command line runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import arguments
from ..config import ConfigError, ModelConfig
from ..plan import Plan, PlanError
from ..parallel.context import ParallelContext
from ..parallel.data_parallel import DataParallel
from ..parallel.device import resolve_device, select_local_cuda_device
from ..parallel.optimizer import OptimizerConfig, build_optimizer
from ..parallel.pipeline import forward_backward
from . import checkpoint
from .data import (DataError, DataSource, load_global_batch, prepare_data_source,
                   split_microbatches)
from .logging import format_eval_line, format_iteration_line, get_logger, setup_logging
from .lr_scheduler import LRConfig, lr_at, set_lr
from .metrics import (MetricsWriter, device_peak_tflops, format_prediction_line,
                      model_flops_per_token, predicted_metrics)
from .precision import LossScaler, PrecisionConfig, unscale_

ModelProvider = Callable[[ModelConfig, ParallelContext, int], nn.Module]
DatasetsProvider = Callable[..., tuple[Any, Any, Any]]
BatchFn = Callable[[Sequence[dict]], dict[str, torch.Tensor]]


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
    # A task with its own model config and data (the vision classifiers): builds the config from
    # the parsed flags; the text data source (tokenizer, embedded corpus) is then not prepared
    # and the datasets provider gets a DataSource naming only the kind and the paths.
    config_from_args: Callable[[argparse.Namespace], Any] | None = None


GPT_TASK = TaskSpec()


@dataclass(frozen=True)
class TrainingConfig:
    train_iters: int = 100
    eval_interval: int = 50
    eval_iters: int = 5
    seed: int = 1234


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


def build_trainer(model_config: ModelConfig, plan: Plan, model_provider: ModelProvider, *,
                  optimizer_config: OptimizerConfig = OptimizerConfig(),
                  lr_config: LRConfig = LRConfig(),
                  precision: PrecisionConfig = PrecisionConfig(), seed: int = 1234,
                  device: torch.device | None = None, task: TaskSpec = GPT_TASK) -> Trainer:
    """Collective: build context, stage, data parallelism and optimizer for ``plan``."""
    plan.validate(model_config)
    ctx = ParallelContext(plan, device=device)
    torch.manual_seed(seed)
    stage = model_provider(model_config, ctx, seed)
    data_parallel = DataParallel(stage, ctx, precision=precision.name)
    optimizer = build_optimizer(data_parallel.parameters(), optimizer_config, lr=lr_config.lr,
                                named_parameters=stage.named_parameters())
    data_parallel.attach_optimizer(optimizer)  # zero1: all-gather parameters after each step
    # A world-wide collective before the first pipeline transfer: NCCL requires every rank of a
    # group to take part in its first batched p2p call otherwise, which a pipeline never does.
    dist.barrier()
    return Trainer(ctx=ctx, plan=plan, model_config=model_config, stage=stage,
                   data_parallel=data_parallel, optimizer=optimizer,
                   optimizer_config=optimizer_config, lr_config=lr_config, precision=precision,
                   scaler=LossScaler(precision), task=task)


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
    parts: list[dict] = []
    losses = forward_backward(trainer.stage, trainer.data_parallel, trainer.ctx, microbatches,
                              schedule=trainer.plan.pipeline.schedule, total_tokens=total_tokens,
                              loss_scale=scale, autocast_dtype=trainer.precision.autocast_dtype,
                              loss_parts=parts)
    params = list(trainer.data_parallel.parameters())
    unscale_(params, scale)
    grad_norm = float(trainer.data_parallel.clip_grad_norm_(trainer.optimizer_config.clip_grad))
    # The norm is already global; the flag all-reduce makes the skip decision identical on every
    # rank even if a future norm implementation were only group-local.
    found_inf = torch.tensor([0.0 if math.isfinite(grad_norm) else 1.0], device=trainer.ctx.device)
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    skipped = bool(found_inf.item())
    if skipped:
        trainer.skipped_iterations += 1
    else:
        trainer.optimizer.step()
    trainer.scaler.update(skipped)
    lm_loss, tokens = _reduce_loss(trainer, losses)
    trainer.iteration = iteration
    trainer.consumed_samples += trainer.plan.global_batch_size
    return StepResult(lm_loss=lm_loss, num_tokens=tokens, grad_norm=grad_norm, skipped=skipped,
                      lr=lr, loss_scale=scale, extra_losses=_named_losses(trainer, parts))


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
                                       autocast_dtype=trainer.precision.autocast_dtype)
    finally:
        trainer.stage.train()
    return _reduce_loss(trainer, losses)[0]


# ----------------------------------------------------------------------------- the run
def _init_distributed() -> torch.device:
    """Join the torchrun world (or make a one-rank world for plain `python script.py`)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                               "MASTER_ADDR": "127.0.0.1"})
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    select_local_cuda_device()
    return resolve_device()


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank0_first(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0, then on the others (it fills a shared cache rank 0 made)."""
    if dist.get_rank() == 0:
        result = fn()
        dist.barrier()
        return result
    dist.barrier()
    return fn()


def _peak_memory_meter(trainer: Trainer) -> Any:
    """The per-iteration memory meter (CUDA allocator statistics, or tensor lifetimes on CPU)."""
    from ..parallel.memory import PeakMemoryMeter  # noqa: PLC0415 - heavy optional machinery

    return PeakMemoryMeter(trainer.ctx.device, trainer.stage, trainer.optimizer)


def run_training(args: argparse.Namespace, model_provider: ModelProvider,
                 datasets_provider: DatasetsProvider, batch_fn: BatchFn,
                 task: TaskSpec = GPT_TASK) -> Trainer:
    """Everything after argument parsing: data, plan, model, loop, logging, metrics."""
    log = get_logger()
    device = _init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    setup_logging(rank)
    data_config = arguments.data_config_from_args(args)
    train_config = arguments.training_config_from_args(args)
    if task.config_from_args is not None:
        source = DataSource(kind=data_config.source, data_prefix=list(data_config.data_path))
        model_config = task.config_from_args(args)
    else:
        source = prepare_data_source(data_config, build_first=_rank0_first,
                                     sentence_level=task.sentence_level_data)
        model_config = arguments.model_config_from_args(args, vocab_size=source.vocab_size)
    if task.model_overrides:
        model_config = dataclasses.replace(model_config, **task.model_overrides)
    if args.load:  # fail before building anything when the checkpoint cannot serve this model
        _, info = checkpoint.read_info(args.load)
        checkpoint.check_model_matches(info["model"], model_config, args.load)
    plan = arguments.resolve_plan(args, model_config, world_size)
    if args.plan_out and rank == 0:
        plan.save(args.plan_out)
    log.info(f"> {world_size} rank(s), plan: pp={plan.pp_size} schedule={plan.pipeline.schedule} "
             f"layers_per_stage={list(plan.pipeline.layers_per_stage)} global batch "
             f"{plan.global_batch_size} in {plan.num_microbatches} micro-batch(es); model "
             f"{model_config.num_parameters() / 1e6:.2f} M parameters; data: {source.kind}")
    trainer = build_trainer(model_config, plan, model_provider,
                            optimizer_config=arguments.optimizer_config_from_args(args),
                            lr_config=arguments.lr_config_from_args(args),
                            precision=arguments.precision_config_from_args(args),
                            seed=train_config.seed, device=device, task=task)
    if args.load:
        checkpoint.load_checkpoint(trainer, args.load)
    start_iteration = trainer.iteration
    gbs = plan.global_batch_size
    num_evals = train_config.train_iters // train_config.eval_interval
    train_ds, valid_ds, _ = datasets_provider(
        data_config, source, model_config, train_config.seed,
        train_config.train_iters * gbs, num_evals * train_config.eval_iters * gbs, 0)
    last_saved = _train_loop(trainer, args, train_config, train_ds, valid_ds, batch_fn)
    # At the end, unless the last interval saved it or nothing was trained (a resumed run that
    # had already reached --train-iters must not rewrite the checkpoint it loaded).
    if args.save and trainer.iteration > start_iteration and last_saved != trainer.iteration:
        checkpoint.save_checkpoint(trainer, args.save)
    return trainer


def _train_loop(trainer: Trainer, args: argparse.Namespace, train_config: TrainingConfig,
                train_ds: Any, valid_ds: Any, batch_fn: BatchFn) -> int | None:
    """Iterate up to --train-iters; returns the iteration of the last checkpoint it saved."""
    log = get_logger()
    ctx, plan, cfg = trainer.ctx, trainer.plan, trainer.model_config
    writer = MetricsWriter(args.metrics_file, enabled=ctx.rank == 0)
    estimate = plan.estimate or {}
    # Peak memory is measured when it is reported: in the metrics file, or next to a plan's
    # prediction. On CPU the tensor tracker slows an iteration several times over, so there it
    # runs on the first two iterations only (the second holds the optimizer state Adam creates in
    # the first step; later iterations repeat it) and their times stay out of the averages.
    meter = _peak_memory_meter(trainer) if (args.metrics_file or estimate) else None
    measured_peak: int | None = None
    compared = False
    tokens_per_iter = plan.global_batch_size * cfg.seq_length
    flops_per_iter = model_flops_per_token(cfg) * tokens_per_iter
    peak = device_peak_tflops(ctx.device, trainer.precision.autocast_dtype is not None)
    window: list[tuple[float, float, bool]] = []  # (loss, seconds, metered) since the last log
    window_extras: list[dict[str, float]] = []  # named extra losses (BERT) since then
    valid_consumed = 0
    last_saved: int | None = None
    done = 0  # iterations run by this process (a resumed run starts past 0)
    # --train-iters counts from the start of training, so a resumed run does the rest only.
    while trainer.iteration < train_config.train_iters:
        batch = (load_global_batch(train_ds, trainer.consumed_samples, plan.global_batch_size,
                                   batch_fn) if trainer.reads_data else None)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        metered = meter is not None and (ctx.device.type == "cuda" or done < 2)
        start = time.perf_counter()
        if metered:
            meter.start()
        result = train_step(trainer, batch)
        done += 1
        if metered:
            peak_bytes = _max_over_ranks(int(meter.stop()), ctx.device)
            measured_peak = peak_bytes if ctx.device.type == "cuda" else \
                max(peak_bytes, measured_peak or 0)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if not result.skipped:
            window.append((result.lm_loss, seconds, metered and ctx.device.type != "cuda"))
            window_extras.append(result.extra_losses)
        it = trainer.iteration
        record = {"iteration": it, "lm_loss": result.lm_loss, "grad_norm": result.grad_norm,
                  "lr": result.lr, "iteration_time_s": seconds}
        trainer.history.append(record)
        if it % args.log_interval == 0 or it == train_config.train_iters:
            mean_loss = sum(l for l, _, _ in window) / len(window) if window else float("nan")
            timed = [s for _, s, slowed in window if not slowed] or [s for _, s, _ in window]
            mean_s = sum(timed) / len(timed) if timed else seconds
            extras = {k: sum(e[k] for e in window_extras) / len(window_extras)
                      for k in (window_extras[0] if window_extras else {})}
            tflops = flops_per_iter / mean_s / ctx.world_size / 1e12
            log.info(format_iteration_line(
                iteration=it, train_iters=train_config.train_iters,
                consumed_samples=trainer.consumed_samples, elapsed_ms=mean_s * 1e3, lr=result.lr,
                global_batch_size=plan.global_batch_size,
                lm_loss=mean_loss if window else None, extra_losses=extras,
                loss_scale=result.loss_scale if trainer.precision.fp16 else None,
                grad_norm=result.grad_norm, skipped_iterations=trainer.skipped_iterations,
                tokens_per_s=tokens_per_iter / mean_s, tflops_per_device=tflops))
            metrics = {"iteration": it, "lm_loss": mean_loss, "lr": result.lr,
                       "grad_norm": result.grad_norm, "iteration_time_s": mean_s,
                       "samples_per_s": plan.global_batch_size / mean_s,
                       "tokens_per_s": tokens_per_iter / mean_s, "tflops_per_device": tflops,
                       "consumed_samples": trainer.consumed_samples,
                       "skipped_iterations": trainer.skipped_iterations,
                       "loss_scale": result.loss_scale}
            metrics.update(extras)
            if peak:
                metrics["mfu"] = tflops / peak
            if measured_peak is not None:
                metrics["peak_memory_bytes"] = measured_peak
            metrics.update(predicted_metrics(estimate))
            if not compared and "predicted_iteration_time_s" in metrics and \
                    any(not slowed for _, _, slowed in window):
                log.info(format_prediction_line(metrics))
                compared = True
            writer.write(metrics)
            window.clear()
            window_extras.clear()
        if valid_ds is not None and train_config.eval_iters > 0 and it % train_config.eval_interval == 0:
            batches = []
            for _ in range(train_config.eval_iters):
                batches.append(load_global_batch(valid_ds, valid_consumed, plan.global_batch_size,
                                                 batch_fn) if trainer.reads_data else None)
                valid_consumed += plan.global_batch_size
            loss = evaluate(trainer, batches)
            ppl = math.exp(min(loss, 20.0))
            log.info(format_eval_line(it, loss, ppl))
            writer.write({"iteration": it, "split": "valid", "lm_loss": loss, "ppl": ppl})
        if args.save and args.save_interval and it % args.save_interval == 0:
            checkpoint.save_checkpoint(trainer, args.save)
            last_saved = it
    return last_saved


def _max_over_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _user_errors() -> tuple[type[BaseException], ...]:
    from ..auto import AutoParallelError  # noqa: PLC0415 - heavy: profiler and planner
    from ..data import DataInputError  # noqa: PLC0415 - data is imported lazily

    return (ConfigError, PlanError, DataError, DataInputError, AutoParallelError,
            checkpoint.CheckpointError)


def pretrain(model_provider: ModelProvider, datasets_provider: DatasetsProvider,
             batch_fn: BatchFn, *, argv: Sequence[str] | None = None,
             parser: argparse.ArgumentParser | None = None, task: TaskSpec = GPT_TASK) -> int:
    """Entry point of the pretrain scripts: parse ``argv``, train, return the exit code.

    Configuration mistakes (bad flags, bad ``--plan`` files, bad data flags) print one
    ``error: ...`` line on stderr, without a traceback, and return 2.
    """
    try:
        args = arguments.parse_args(argv, parser)
        # What the user typed, so that --auto-parallel can tell pinned flags from defaults.
        args.argv_ = list(sys.argv[1:] if argv is None else argv)
        run_training(args, model_provider, datasets_provider, batch_fn, task)
        code = 0
    except _user_errors() as err:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {err}", file=sys.stderr)
        code = 2
    if dist.is_initialized():
        dist.destroy_process_group()
    return code
