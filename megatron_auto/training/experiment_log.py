"""Experiment logging to TensorBoard and Weights & Biases, with Megatron-LM's flag names.

Both receive exactly the records of the ``--metrics-file`` (docs/design.md §5.3): one per logged
training iteration and one per evaluation (``"split": "valid"``). Each numeric field becomes a
scalar tagged ``train/<field>`` or ``valid/<field>`` at the record's iteration, so a TensorBoard
chart and a metrics-file column carry the same name and the same numbers. Which fields go out:

- always: losses (``lm_loss`` and the model's other ``*_loss``), ``lr``, ``grad_norm``,
  throughput (``samples_per_s``, ``tokens_per_s``, ``tflops_per_device``, ``mfu``),
  ``iteration_time_s`` and ``predicted_iteration_time_s``, counters;
- ``--log-memory-to-tensorboard``: ``peak_memory_bytes`` and ``predicted_peak_memory_bytes``;
- ``--log-timers-to-tensorboard``: the per-phase timer fields (``timers_*``);
- ``--log-validation-ppl-to-tensorboard``: the validation ``ppl``.

``--tensorboard-log-interval N`` keeps the training records whose iteration is a multiple of N
(records exist every ``--log-interval`` iterations). Only rank 0 writes. Both packages are
optional extras: asking for one that is not installed is a one-line configuration error at
start-up, never a traceback in the middle of training.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Mapping, Protocol

from ..utils.output_paths import check_output_dir
from ..run_config import ExperimentLogConfig, ExperimentLogError

__all__ = ["ExperimentLog", "ExperimentLogConfig", "ExperimentLogError", "TensorBoardSink",
           "WandbSink", "record_scalars"]

MEMORY_FIELDS = ("peak_memory_bytes", "predicted_peak_memory_bytes")
TIMER_PREFIX = "timers_"


class Sink(Protocol):
    def scalars(self, step: int, values: Mapping[str, float]) -> None: ...
    def close(self) -> None: ...


def _import_optional(module: str, flag: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ExperimentLogError(
            f"{flag}: needs the '{extra}' package, which does not import here ({err}); install "
            f"it (pip install {extra}, or the package's 'logging' extra) or drop {flag}") from None


def _writable_dir(path: str, flag: str) -> str:
    """``path``, made and checked writable (the shared check of every output directory)."""
    return check_output_dir(path, flag, ExperimentLogError, create=True)


class TensorBoardSink:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` (the tensorboard package)."""

    def __init__(self, log_dir: str) -> None:
        _import_optional("tensorboard", "--tensorboard-dir", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional package

        self._writer = SummaryWriter(log_dir=_writable_dir(log_dir, "--tensorboard-dir"))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A W&B run; ``WANDB_MODE=offline`` (or no login) writes it locally under the save dir."""

    def __init__(self, project: str, name: str | None, save_dir: str | None,
                 run_config: Mapping[str, Any]) -> None:
        wandb = _import_optional("wandb", "--wandb-project", "wandb")
        directory = _writable_dir(save_dir, "--wandb-save-dir") if save_dir else None
        try:
            self._run = wandb.init(project=project, name=name, dir=directory,
                                   config=dict(run_config), reinit="finish_previous")
        except Exception as err:  # wandb raises its own UsageError/CommError types
            raise ExperimentLogError(
                f"--wandb-project={project}: W&B could not start a run ({err}); run "
                f"'wandb login', or set WANDB_MODE=offline to log locally without a network"
            ) from None

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


def record_scalars(record: Mapping[str, Any], config: ExperimentLogConfig) -> dict[str, float]:
    """The tagged scalars of one metrics record under ``config``'s field selection."""
    split = record.get("split", "train")
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("iteration", "split") or isinstance(value, bool):
            continue
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        if key in MEMORY_FIELDS and not config.log_memory_to_tensorboard:
            continue
        if key.startswith(TIMER_PREFIX) and not config.log_timers_to_tensorboard:
            continue
        if key == "ppl" and not config.log_validation_ppl_to_tensorboard:
            continue
        out[f"{split}/{key}"] = float(value)
    return out


class ExperimentLog:
    """Fans each metrics record out to the configured sinks (rank 0 only)."""

    def __init__(self, config: ExperimentLogConfig, enabled: bool,
                 run_config: Mapping[str, Any] | None = None) -> None:
        self.config = config
        self._sinks: list[Sink] = []
        if not enabled:
            return
        if config.tensorboard_dir:
            self._sinks.append(TensorBoardSink(config.tensorboard_dir))
        if config.wandb_project:
            self._sinks.append(WandbSink(config.wandb_project, config.wandb_exp_name,
                                         config.wandb_save_dir, run_config or {}))

    def write(self, record: Mapping[str, Any]) -> None:
        if not self._sinks:
            return
        step = int(record["iteration"])
        if record.get("split", "train") == "train" and step % self.config.tensorboard_log_interval:
            return
        values = record_scalars(record, self.config)
        for sink in self._sinks:
            sink.scalars(step, values)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks.clear()
