"""The training run shared by the entry scripts (``pretrain_gpt.py``, ``pretrain_bert.py``).

An entry script supplies three thin providers (docs/design.md §8) and calls :func:`launch`
with its argv, which converts the flags once (``arguments.parse_run_config``) and calls
:func:`pretrain` with the resulting :class:`~megatron_auto.run_config.RunConfig`:

- ``model_provider(model_config, ctx, seed) -> nn.Module``: this rank's pipeline stage;
- ``datasets_provider(data_config, source, model_config, seed, train_samples, valid_samples,
  test_samples) -> (train, valid, test)``: datasets of item dicts (``None`` when absent);
- ``batch_fn(items) -> dict[str, Tensor]``: stacks items into the global batch whose keys the
  stage takes (``tokens`` for the first stage, ``labels``/``loss_mask`` for the last).

:func:`pretrain` joins the world, resolves the data source (the tokenizer fixes the
vocabulary), makes the plan from the run's plan source (validated once, where it is made:
``plan_source.make_plan`` for a file or the classic flags, ``auto.plan_for_run`` for the
search), builds the trainer (``trainer.py``), restores a checkpoint, and loops: one
:func:`~megatron_auto.training.trainer.train_step` per iteration, Megatron's console lines, the
``--metrics-file`` records (also to TensorBoard / W&B when asked), evaluation and checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import socket
import sys
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .. import arguments
from ..config import ConfigError, ModelConfig
from ..families.hf_config import apply_hf_config
from ..parallel.device import resolve_device, select_local_cuda_device
from ..parallel.timers import gather_over_ranks
from ..plan import Plan, PlanError
from ..plan_source import make_plan
from ..run_config import CheckpointConfig, RunConfig, SearchPins
from ..utils.flag_warnings import one_line_flag_warnings
from . import checkpoint
from .data import DataError, DataSource, load_global_batch, prepare_data_source
from .exit_control import ExitControl
from .experiment_log import ExperimentLog, ExperimentLogError
from .logging import format_eval_line, format_iteration_line, get_logger, setup_logging
from .metrics import (MetricsWriter, device_peak_tflops, format_prediction_line,
                      model_flops_per_token, predicted_metrics)
from .precision import autocast_dtype
from .moe_metrics import console_parts as moe_console_parts, window_moe_metrics
from .timing_report import format_stage_comparison, format_timer_lines, timer_metrics
from .trainer import (GPT_TASK, ModelProvider, NonFiniteError, TaskSpec, Trainer, build_trainer,
                      evaluate, train_step)

DatasetsProvider = Callable[..., tuple[Any, Any, Any]]
BatchFn = Callable[[Sequence[dict]], dict[str, torch.Tensor]]


def _init_distributed(timeout_minutes: float) -> torch.device:
    """Join the torchrun world (or make a one-rank world for plain `python script.py`).

    ``timeout_minutes`` bounds every collective: a rank whose peer died stops with an error
    instead of hanging (torchrun then restarts the job when ``--max-restarts`` allows)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                               "MASTER_ADDR": "127.0.0.1"})
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # cuda:LOCAL_RANK first: NCCL binds each communicator to the current device when it
        # is made, and batch_isend_irecv on NCCL hangs unless torch.cuda.set_device was called
        # (torch.distributed docs). No device_id: communicators stay lazily created per group,
        # as the cost model's NCCL memory per process group assumes.
        select_local_cuda_device()
        timeout = datetime.timedelta(minutes=timeout_minutes)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is not None:
            # torchrun's restarted workers rendezvous in the agent's store, which still holds
            # the previous attempt's keys (gloo's peer addresses among them: a restarted rank
            # could read a dead peer's address and fail with "connection refused"). A key
            # prefix per attempt keeps each attempt to its own keys.
            store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
            store = dist.PrefixStore(f"megatron_auto/attempt_{attempt}", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    select_local_cuda_device()
    if torch.cuda.is_available():
        # fp32 matmuls stay IEEE fp32 (torch's default "highest", made explicit): TF32 would
        # change the numbers of every fp32 plan and the presets' fp32 peak assumes no TF32.
        torch.set_float32_matmul_precision("highest")
    return resolve_device()


def _free_port() -> int:
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
    from ..parallel.memory import PeakMemoryMeter  # noqa: PLC0415 - lazy: torch's MemTracker, only when memory is reported

    return PeakMemoryMeter(trainer.ctx.device, trainer.stage, trainer.optimizer)



def _plan_for_run(config: RunConfig, model_config: ModelConfig, world_size: int) -> Plan:
    """The plan of the run's source, made (and validated) once, collectively."""
    source = config.plan_source
    if isinstance(source, SearchPins):
        from .. import auto  # noqa: PLC0415 - lazy: the profilers and the planner, only --auto-parallel needs them

        return auto.plan_for_run(source, model_config, world_size,
                                 precision=config.precision.name)
    return make_plan(source, model_config, world_size)


def pretrain(config: RunConfig, model_provider: ModelProvider,
             datasets_provider: DatasetsProvider, batch_fn: BatchFn,
             task: TaskSpec = GPT_TASK) -> Trainer:
    """The run ``config`` describes: data, plan, model, loop, logging, metrics, checkpoints.

    Collective (joins the torchrun world, or makes a world of one). Raises the package's
    configuration errors (``ConfigError``, ``PlanError``, ``DataError``, ...) on bad input;
    :func:`launch` turns them into one line and exit status 2.
    """
    log = get_logger()
    started = time.monotonic()  # --exit-duration-in-mins counts from here
    device = _init_distributed(config.distributed_timeout_minutes)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    setup_logging(rank)
    train_config, ckpt = config.training, config.checkpoint
    model_config = config.model
    if task.text_data:
        source = prepare_data_source(config.data, build_first=_rank0_first,
                                     sentence_level=task.sentence_level_data)
        if source.vocab_size:  # the tokenizer's vocabulary rules
            model_config = dataclasses.replace(model_config, vocab_size=source.vocab_size)
    else:
        source = DataSource(kind=config.data.source, data_prefix=list(config.data.data_path))
    if task.model_overrides:
        model_config = dataclasses.replace(model_config, **task.model_overrides)
    _check_save_dir(ckpt)
    resume = bool(ckpt.load) and checkpoint.has_checkpoint(ckpt.load)
    if ckpt.load and not resume:
        log.info(f"> --load={ckpt.load}: no finished checkpoint there yet; starting from scratch")
    chosen = None
    if resume:  # fail before building anything when the checkpoint cannot serve this model
        # Collective: every rank verifies and all take the same (newest intact) checkpoint.
        chosen = checkpoint.read_info(ckpt.load, fallback=ckpt.load_fallback)
        checkpoint.check_model_matches(chosen[1]["model"], model_config, ckpt.load)
    plan = _plan_for_run(config, model_config, world_size)
    if config.plan_out and rank == 0:
        plan.save(config.plan_out)
    log.info(f"> {world_size} rank(s), plan: pp={plan.pp_size} schedule={plan.pipeline.schedule} "
             f"layers_per_stage={list(plan.pipeline.layers_per_stage)} global batch "
             f"{plan.global_batch_size} in {plan.num_microbatches} micro-batch(es); model "
             f"{model_config.num_parameters() / 1e6:.2f} M parameters; data: {source.kind}")
    trainer = build_trainer(model_config, plan, model_provider, optimizer_config=config.optimizer,
                            lr_config=config.lr, precision=config.precision,
                            seed=train_config.seed, device=device, task=task,
                            compile_backend=train_config.compile_backend,
                            check_for_nan=train_config.check_for_nan_in_loss_and_grad,
                            timing_log_level=config.logging.timing_log_level)
    if resume:
        checkpoint.load_checkpoint(trainer, ckpt.load, chosen=chosen)
    start_iteration = trainer.iteration
    if not resume and train_config.train_iters == 0:
        log.info(f"> --train-iters=0: nothing to train; the initial state (iteration 0) goes "
                 f"to --save={ckpt.save}")
    elif start_iteration >= train_config.train_iters:
        log.info(f"> --load={ckpt.load}: the checkpoint is at iteration {start_iteration}, "
                 f"--train-iters={train_config.train_iters}: nothing left to train; raise "
                 f"--train-iters to continue")
    handle_signal = (train_config.exit_signal_handler if train_config.exit_signal_handler
                     is not None else bool(ckpt.save))
    exit_control = ExitControl(handle_signal=handle_signal,
                               duration_mins=train_config.exit_duration_in_mins,
                               interval=train_config.exit_interval, start_time=started)
    gbs = plan.global_batch_size
    num_evals = train_config.train_iters // train_config.eval_interval
    train_ds, valid_ds, _ = datasets_provider(
        config.data, source, model_config, train_config.seed,
        train_config.train_iters * gbs, num_evals * train_config.eval_iters * gbs, 0)
    experiment_log = _experiment_log(config, rank)
    try:
        last_saved = _train_loop(trainer, config, train_ds, valid_ds, batch_fn, experiment_log,
                                 exit_control)
    finally:
        experiment_log.close()
        exit_control.close()
    # At the end (also of a run told to exit early), unless the last interval saved it or
    # nothing was trained (a resumed run that had already reached --train-iters must not
    # rewrite the checkpoint it loaded); a fresh run with --train-iters 0 saves its initial
    # state (iteration 0: the weights, optimizer and RNG streams a training run starts from).
    initial = train_config.train_iters == 0 and not resume
    if ckpt.save and (initial or trainer.iteration > start_iteration) \
            and last_saved != trainer.iteration:
        checkpoint.save_checkpoint(trainer, ckpt.save, async_save=ckpt.async_save)
    checkpoint.wait_for_pending_save()  # an asynchronous save finishes before the run ends
    return trainer


def _check_save_dir(ckpt: CheckpointConfig) -> None:
    """Refuse a ``--save`` directory that holds another run's checkpoint (one this run does not
    ``--load``): saving there would point its ``latest`` at this run and overwrite its
    iterations. ``--overwrite`` allows it (Megatron-LM's behaviour)."""
    if not ckpt.save or ckpt.overwrite or not checkpoint.has_checkpoint(ckpt.save):
        return
    if ckpt.load and os.path.realpath(ckpt.load) == os.path.realpath(ckpt.save):
        return  # the run continues that checkpoint
    with open(os.path.join(ckpt.save, checkpoint.LATEST_FILE), encoding="utf-8") as fh:
        latest = fh.read().strip()
    raise checkpoint.CheckpointError(
        f"--save={ckpt.save}: already holds a checkpoint (latest iteration {latest}) that this "
        f"run would replace; add --load {ckpt.save} to continue it, --overwrite to save over "
        f"it, or choose a new directory")


def _experiment_log(config: RunConfig, rank: int) -> ExperimentLog:
    """Rank 0's TensorBoard / W&B sinks; a sink that cannot start stops every rank alike (rank 0
    alone would otherwise leave the others waiting in the first collective). Collective when
    a sink is configured."""
    settings = config.experiment_log
    if not settings.enabled:
        return ExperimentLog(settings, enabled=False)
    log, error = ExperimentLog(settings, enabled=False), None
    if rank == 0:
        try:
            log = ExperimentLog(settings, enabled=True, run_config=dataclasses.asdict(config))
        except ExperimentLogError as err:
            error = str(err)
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ExperimentLogError(box[0])
    return log


def _train_loop(trainer: Trainer, config: RunConfig, train_ds: Any, valid_ds: Any,
                batch_fn: BatchFn, experiment_log: ExperimentLog,
                exit_control: ExitControl | None = None) -> int | None:
    """Iterate up to --train-iters, or until ``exit_control`` says stop (the caller then saves);
    returns the iteration of the last checkpoint it saved."""
    log = get_logger()
    ctx, plan, cfg = trainer.ctx, trainer.plan, trainer.model_config
    train_config, save = config.training, config.checkpoint
    writer = MetricsWriter(config.logging.metrics_file, enabled=ctx.rank == 0)
    estimate = plan.estimate or {}
    # Peak memory is measured when it is reported: in the metrics file, or next to a plan's
    # prediction. On CPU the tensor tracker slows an iteration several times over, so there it
    # runs on the first two iterations only (the second holds the optimizer state Adam creates in
    # the first step; later iterations repeat it) and their times stay out of the averages.
    meter = _peak_memory_meter(trainer) if (config.logging.metrics_file or estimate) else None
    measured_peak: int | None = None
    compared = False
    tokens_per_iter = plan.global_batch_size * cfg.seq_length
    flops_per_iter = model_flops_per_token(cfg) * tokens_per_iter
    peak = device_peak_tflops(ctx.device, autocast_dtype(trainer.precision) is not None)
    window: list[tuple[float, float, bool]] = []  # (loss, seconds, metered) since the last log
    window_extras: list[dict[str, float]] = []  # named extra losses (BERT) since then
    window_moe: list[dict[str, Any]] = []  # MoE router statistics (training/moe_metrics.py)
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
            # CUDA: what the device holds (reserved peak + context and NCCL, which the plan's
            # estimate also counts), not only the allocated peak (parallel/memory.py)
            measured_peak = _max_over_ranks(int(meter.device_peak_bytes), ctx.device) \
                if ctx.device.type == "cuda" else max(peak_bytes, measured_peak or 0)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        # Timers file the iteration like the mean time below: slowed or skipped ones count
        # only when the window has no other (and after the synchronize above on CUDA).
        trainer.timers.end_iteration(
            representative=not result.skipped and not (metered and ctx.device.type != "cuda"))
        if not result.skipped:
            window.append((result.lm_loss, seconds, metered and ctx.device.type != "cuda"))
            window_extras.append(result.extra_losses)
            window_moe.append(result.moe_metrics)
        it = trainer.iteration
        record = {"iteration": it, "lm_loss": result.lm_loss, "grad_norm": result.grad_norm,
                  "lr": result.lr, "iteration_time_s": seconds}
        trainer.history.append(record)
        if it % config.logging.log_interval == 0 or it == train_config.train_iters:
            mean_loss = sum(l for l, _, _ in window) / len(window) if window else float("nan")
            timed = [s for _, s, slowed in window if not slowed] or [s for _, s, _ in window]
            mean_s = sum(timed) / len(timed) if timed else seconds
            extras = {k: sum(e[k] for e in window_extras) / len(window_extras)
                      for k in (window_extras[0] if window_extras else {})}
            moe_window = window_moe_metrics(window_moe)
            tflops = flops_per_iter / mean_s / ctx.world_size / 1e12
            log.info(format_iteration_line(
                iteration=it, train_iters=train_config.train_iters,
                consumed_samples=trainer.consumed_samples, elapsed_ms=mean_s * 1e3, lr=result.lr,
                global_batch_size=plan.global_batch_size,
                lm_loss=mean_loss if window else None, extra_losses=extras,
                loss_scale=result.loss_scale if trainer.precision.fp16 else None,
                grad_norm=result.grad_norm, skipped_iterations=trainer.skipped_iterations,
                tokens_per_s=tokens_per_iter / mean_s, tflops_per_device=tflops,
                extra_parts=moe_console_parts(moe_window)))
            timer_rows = (gather_over_ranks(trainer.timers.take(), ctx.device)
                          if trainer.timers.enabled else [])  # collective: every rank logs here
            for line in format_timer_lines(timer_rows, config.logging.timing_log_option):
                log.info(line)
            metrics = {"iteration": it, "lm_loss": mean_loss, "lr": result.lr,
                       "grad_norm": result.grad_norm, "iteration_time_s": mean_s,
                       "samples_per_s": plan.global_batch_size / mean_s,
                       "tokens_per_s": tokens_per_iter / mean_s, "tflops_per_device": tflops,
                       "consumed_samples": trainer.consumed_samples,
                       "skipped_iterations": trainer.skipped_iterations,
                       "loss_scale": result.loss_scale}
            metrics.update(extras)
            metrics.update(moe_window)
            metrics.update(timer_metrics(timer_rows))
            if peak:
                metrics["mfu"] = tflops / peak
            if measured_peak is not None:
                metrics["peak_memory_bytes"] = measured_peak
            metrics.update(predicted_metrics(estimate))
            if not compared and "predicted_iteration_time_s" in metrics and \
                    any(not slowed for _, _, slowed in window):
                log.info(format_prediction_line(metrics))
                for line in format_stage_comparison(timer_rows, estimate, plan.num_microbatches):
                    log.info(line)
                compared = True
            writer.write(metrics)
            experiment_log.write(metrics)
            window.clear()
            window_extras.clear()
            window_moe.clear()
        if valid_ds is not None and train_config.eval_iters > 0 and it % train_config.eval_interval == 0:
            batches = []
            for _ in range(train_config.eval_iters):
                batches.append(load_global_batch(valid_ds, valid_consumed, plan.global_batch_size,
                                                 batch_fn) if trainer.reads_data else None)
                valid_consumed += plan.global_batch_size
            loss = evaluate(trainer, batches)
            ppl = math.exp(min(loss, 20.0))
            log.info(format_eval_line(it, loss, ppl))
            record = {"iteration": it, "split": "valid", "lm_loss": loss, "ppl": ppl}
            writer.write(record)
            experiment_log.write(record)
        if save.save and save.save_interval and it % save.save_interval == 0:
            checkpoint.save_checkpoint(trainer, save.save, async_save=save.async_save)
            last_saved = it
        reason = exit_control.check(it, ctx.device) if exit_control is not None else None
        if reason is not None and it < train_config.train_iters:
            saving = "; saving a checkpoint" if save.save else " (no --save: nothing is saved)"
            log.info(f"> exiting at iteration {it}: {reason}{saving}")
            break
    return last_saved


def _max_over_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _user_errors() -> tuple[type[BaseException], ...]:
    from ..auto import AutoParallelError  # noqa: PLC0415 - lazy: the profilers and the planner
    from ..data import DataInputError  # noqa: PLC0415 - lazy: the data package (tokenizers)

    return (ConfigError, PlanError, DataError, DataInputError, AutoParallelError,
            checkpoint.CheckpointError, NonFiniteError)


def launch(model_provider: ModelProvider, datasets_provider: DatasetsProvider,
           batch_fn: BatchFn, *, argv: Sequence[str] | None = None,
           parser: argparse.ArgumentParser | None = None,
           model_config_from_args: Callable[[argparse.Namespace], Any] | None = None,
           task: TaskSpec = GPT_TASK) -> int:
    """Entry point of the pretrain scripts: convert ``argv`` (default ``sys.argv[1:]``) into a
    ``RunConfig``, :func:`pretrain`, return the exit code.

    ``parser`` and ``model_config_from_args`` let a script with flags of its own (the vision
    classifiers) extend ``arguments.build_parser()`` and convert its model flags; both go to
    ``arguments.parse_run_config``, the one conversion.

    Configuration mistakes (bad flags, bad ``--plan`` files, bad data flags) print one
    ``error: ...`` line on stderr, without a traceback, and return 2.
    """
    # Warnings and errors once, from rank 0 (torchrun's RANK before the world is joined: flags
    # are checked first); a flag that cannot apply is one ``warning: ...`` line.
    first_rank = int(os.environ.get("RANK", "0")) == 0
    try:
        with one_line_flag_warnings(show=first_rank):
            def read_model_file(args: argparse.Namespace, given: frozenset,
                                dests: frozenset) -> None:  # --hf-config, for this script
                apply_hf_config(args, given, dests, training=True,
                                families_taken=task.model_families)

            config = arguments.parse_run_config(argv, parser,
                                                model_config_from_args=model_config_from_args,
                                                read_model_file=read_model_file)
            pretrain(config, model_provider, datasets_provider, batch_fn, task)
        code = 0
    except _user_errors() as err:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        code = 2
    if dist.is_initialized():
        if code == 0 and dist.get_world_size() > 1:
            # Every rank leaves together: a rank that destroys its groups while a peer's last
            # collectives (FSDP2's final reshard, say) still run on them can make gloo's worker
            # threads end in std::terminate (SIGABRT after a finished run, seen under ZeRO-3).
            dist.barrier()
        dist.destroy_process_group()
    return code
