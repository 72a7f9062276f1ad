"""Rank-aware console logging in Megatron-LM's line format.

Only the ranks chosen at setup print (rank 0 by default), so a multi-rank run shows each line
once. Iteration statistics (loss included) are reduced over the world before they are logged,
so rank 0 can print the last stage's loss.
"""

from __future__ import annotations

import logging
import sys
from typing import Iterable, Mapping, Sequence

from ..run_config import LoggingConfig

__all__ = ["LOGGER_NAME", "LoggingConfig", "format_eval_line", "format_iteration_line",
           "get_logger", "setup_logging"]

LOGGER_NAME = "megatron_auto"


def get_logger(name: str = LOGGER_NAME) -> logging.Logger:
    return logging.getLogger(name)


def setup_logging(rank: int, log_ranks: Iterable[int] = (0,), level: int = logging.INFO) -> logging.Logger:
    """Send the package's log records to stdout on ``log_ranks`` only; silence other ranks.

    Idempotent: calling it again replaces the handler it installed before.
    """
    logger = get_logger()
    for handler in list(logger.handlers):
        if getattr(handler, "_megatron_auto", False):
            logger.removeHandler(handler)
    if rank in set(log_ranks):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._megatron_auto = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.setLevel(level)
    else:
        logger.setLevel(logging.WARNING)
    logger.propagate = False
    return logger


def format_iteration_line(*, iteration: int, train_iters: int, consumed_samples: int,
                          elapsed_ms: float, lr: float, global_batch_size: int,
                          lm_loss: float | None, loss_scale: float | None, grad_norm: float | None,
                          skipped_iterations: int, tokens_per_s: float,
                          tflops_per_device: float,
                          extra_losses: Mapping[str, float] | None = None,
                          extra_parts: Sequence[str] = ()) -> str:
    """One Megatron-style training line: ``iteration N/ M | consumed samples: ... | ...``."""
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
        f"learning rate: {lr:.6E}",
        f"global batch size: {global_batch_size:5d}",
    ]
    if lm_loss is not None:
        parts.append(f"lm loss: {lm_loss:.6E}")
    for name, value in (extra_losses or {}).items():  # e.g. BERT's "mlm loss", "sop loss"
        parts.append(f"{name.replace('_', ' ')}: {value:.6E}")
    parts.extend(extra_parts)  # e.g. MoE's "load_balancing_loss: ..." (training/moe_metrics.py)
    if loss_scale is not None:
        parts.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    parts.append(f"number of skipped iterations: {skipped_iterations:3d}")
    parts.append(f"tokens/s: {tokens_per_s:.1f}")
    parts.append(f"TFLOP/s/device: {tflops_per_device:.3f}")
    return " | ".join(parts) + " |"


def format_eval_line(iteration: int, lm_loss: float, perplexity: float) -> str:
    return (f" validation loss at iteration {iteration} | lm loss value: {lm_loss:.6E} | "
            f"lm loss PPL: {perplexity:.6E} |")
