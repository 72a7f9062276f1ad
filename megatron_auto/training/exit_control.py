"""Ending a run early and cleanly: preemption signals, time limits, iteration limits.

Megatron-LM's three ways (same flag names), decided at the end of an iteration:

- ``--exit-signal-handler``: SIGTERM (how preemption arrives on clusters; torchrun forwards the
  signal it receives to its workers) only sets a flag. On by default when ``--save`` is given
  (``--no-exit-signal-handler`` turns it off), so a preempted run with checkpoints saves.
- ``--exit-duration-in-mins X``: stop once the run has been going X minutes.
- ``--exit-interval N``: stop at the first iteration divisible by N.

The signal and the clock are local to a rank, so their flags are combined by one MAX all-reduce
per iteration (only when either is active), as Megatron does: every rank sees the same answer
at the same iteration, saves the same checkpoint and returns normally (exit status 0). The
interval needs no collective (every rank counts the same iterations).
"""

from __future__ import annotations

import signal
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from .logging import get_logger

EXIT_SIGNAL = signal.SIGTERM


class ExitControl:
    """Per-run exit state. ``handle_signal``: catch SIGTERM from now until :meth:`close`.

    ``start_time`` (``time.monotonic()``) is when the run began, for ``duration_mins``.
    """

    def __init__(self, *, handle_signal: bool, duration_mins: float | None = None,
                 interval: int | None = None, start_time: float | None = None) -> None:
        self.duration_s = None if duration_mins is None else duration_mins * 60.0
        self.interval = interval
        self.start_time = time.monotonic() if start_time is None else start_time
        self.received: int | None = None
        self._previous: Any = None
        self._installed = False
        if handle_signal:
            try:
                self._previous = signal.signal(EXIT_SIGNAL, self._on_signal)
                self._installed = True
            except ValueError:  # not the main thread: signals cannot be caught here
                get_logger().warning("> warning: --exit-signal-handler: not on the main thread; "
                                     "SIGTERM keeps its default action")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the iteration in progress finishes, then every rank stops together.
        self.received = signum

    @property
    def collective(self) -> bool:
        """Whether :meth:`check` all-reduces (signal handler or time limit active)."""
        return self._installed or self.duration_s is not None

    def check(self, iteration: int, device: torch.device) -> str | None:
        """At the end of ``iteration``: why the run stops now (the same on every rank), or None.

        Collective over the world when :attr:`collective`.
        """
        if self.collective:
            elapsed = time.monotonic() - self.start_time
            flags = torch.tensor([1.0 if self.received is not None else 0.0,
                                  1.0 if self.duration_s is not None and elapsed > self.duration_s
                                  else 0.0], device=device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if flags[0].item() > 0:
                return f"{signal.Signals(EXIT_SIGNAL).name} received (--exit-signal-handler)"
            if flags[1].item() > 0:
                return (f"--exit-duration-in-mins={self.duration_s / 60.0:g} reached after "
                        f"{elapsed / 60.0:.2f} min")
        if self.interval is not None and iteration % self.interval == 0:
            return f"--exit-interval={self.interval} reached"
        return None

    def close(self) -> None:
        """Give the signal back its previous handler (idempotent)."""
        if self._installed:
            signal.signal(EXIT_SIGNAL, self._previous)
            self._installed = False
