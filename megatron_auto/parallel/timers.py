"""Per-iteration phase timers (Megatron-LM's ``--timing-log-level 0|1|2``).

A :class:`Timers` object is handed to the pipeline schedule and the training step; each phase
is wrapped in ``with timers("forward-compute"):`` (a timer of level 1) or
``with timers("optimizer-inner-step", 2):`` (level 2). A timer whose level is above the run's
level is a shared no-op context, so level 0 (the default) costs one attribute lookup and one
comparison per phase and nothing else.

Levels (the names are Megatron's where the phase exists there):

- 0: no breakdown (the iteration line's elapsed time only);
- 1: ``forward-backward`` (the whole schedule), ``forward-compute``, ``backward-compute``, the
  pipeline waits ``forward-recv``, ``forward-send``, ``backward-recv``, ``backward-send``,
  ``forward-send-backward-recv``, ``backward-send-forward-recv`` (the steady 1F1B pairs),
  ``p2p-send-wait`` (interleaved 1F1B: its sends are posted asynchronously and waited for at
  the end of the schedule),
  ``all-grads-sync`` (waiting for the DDP / ZeRO-1 gradient buckets and the tied-embedding
  all-reduce after the last backward) and ``optimizer`` (unscale, gradient norm and clipping,
  the step, ZeRO-1's parameter all-gather);
- 2: in addition ``optimizer-clip-main-grad`` (norm and clip), ``optimizer-inner-step`` (AdamW,
  ZeRO-1's all-gather included) and ``loss-reduce`` (the loss all-reduce over the world); on
  CUDA every timer also synchronises the device at its start and its end.

ZeRO-2/3 (FSDP2) gathers parameters and reduce-scatters gradients inside its own forward and
backward hooks, overlapped with compute; that communication therefore counts in
``forward-compute`` / ``backward-compute`` (its exposed part is what those grow by against a
DDP layer), and only the buckets' wait after the last backward is ``all-grads-sync``.

How a phase is timed:

- CPU: ``time.perf_counter`` around the phase. Gloo's collectives and p2p waits block the
  calling thread, so host time *is* the phase's time and no synchronisation is needed.
- CUDA, level 1: a pair of ``torch.cuda.Event(enable_timing=True)`` recorded on the current
  stream around the phase. Kernels run asynchronously, so host time would charge a phase for
  the kernels of the one before (the host only waits when it syncs); events measure the stream
  instead and need no synchronisation inside the iteration: :meth:`Timers.end_iteration`, called
  after the loop's end-of-iteration ``torch.cuda.synchronize()``, reads them. NCCL's waits
  (``work.wait()``) make the current stream wait for the communication stream, so the events
  bracket the wait as the compute stream sees it.
- CUDA, level 2: ``torch.cuda.synchronize()`` at both ends of every timer, then host time:
  exact attribution of everything the device did inside the phase, at the price of losing the
  host/device overlap (a diagnosis level, like Megatron's barrier timers).

Timers never touch tensors that feed the computation, so they cannot change the numerics
(``tests/test_timers.py`` checks losses bit for bit with and without them).
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import torch
import torch.distributed as dist

from .comm import all_gather_into_tensor

TIMING_LEVELS = (0, 1, 2)
# Every timer name by level, in the order reports list them.
LEVEL_1 = ("forward-backward", "forward-compute", "backward-compute", "forward-recv",
           "forward-send", "backward-recv", "backward-send", "forward-send-backward-recv",
           "backward-send-forward-recv", "p2p-send-wait", "all-grads-sync", "optimizer")
LEVEL_2 = ("optimizer-clip-main-grad", "optimizer-inner-step", "loss-reduce")
TIMER_NAMES = LEVEL_1 + LEVEL_2
TIMER_LEVEL = {**{n: 1 for n in LEVEL_1}, **{n: 2 for n in LEVEL_2}}
# The pipeline's point-to-point waits (they include the bubble: time waiting for a neighbour).
P2P_TIMERS = ("forward-recv", "forward-send", "backward-recv", "backward-send",
              "forward-send-backward-recv", "backward-send-forward-recv", "p2p-send-wait")


class _Off:
    """The context of a timer above the run's level: does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_OFF = _Off()


class _HostTimer:
    """Host wall time (CPU, or CUDA with ``sync`` at both ends)."""

    __slots__ = ("name", "now", "_start", "_sync")

    def __init__(self, name: str, sync: bool) -> None:
        self.name, self.now, self._start, self._sync = name, 0.0, 0.0, sync

    def __enter__(self) -> None:
        if self._sync:
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        if self._sync:
            torch.cuda.synchronize()
        self.now += time.perf_counter() - self._start

    def resolve(self) -> float:
        """This iteration's seconds so far; resets them."""
        now, self.now = self.now, 0.0
        return now


class _EventTimer:
    """CUDA stream time from event pairs, read once per iteration (see the module docstring)."""

    __slots__ = ("name", "_pool", "_used")

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool: list[tuple[Any, Any]] = []  # reused across iterations: no allocation
        self._used = 0

    def __enter__(self) -> None:
        if self._used == len(self._pool):
            self._pool.append((torch.cuda.Event(enable_timing=True),
                               torch.cuda.Event(enable_timing=True)))
        self._pool[self._used][0].record()

    def __exit__(self, *exc: Any) -> None:
        self._pool[self._used][1].record()
        self._used += 1

    def resolve(self) -> float:
        """This iteration's seconds (the device must have finished it); resets them."""
        seconds = sum(start.elapsed_time(end) for start, end in self._pool[:self._used]) / 1e3
        self._used = 0
        return seconds


class Timers:
    """The timers of one rank at ``level`` (0 = off); see the module docstring.

    ``timers(name, level=1)`` is the context manager of phase ``name``. :meth:`end_iteration`
    closes an iteration and files it in the current window; :meth:`take` returns the window's
    seconds per iteration of every timer that ran and starts a new window. Iterations filed as
    ``representative=False`` (slowed by a memory tracker, or a skipped step) count only when the
    window has no other, as the iteration line's mean time does.
    """

    def __init__(self, level: int = 0, device: torch.device | None = None) -> None:
        if level not in TIMING_LEVELS:
            raise ValueError(f"--timing-log-level={level}: choose one of "
                             f"{', '.join(map(str, TIMING_LEVELS))}")
        self.level = level
        cuda = device is not None and device.type == "cuda"
        self._events = cuda and level == 1
        self._sync = cuda and level >= 2
        self._timers: dict[str, Any] = {}
        # window[representative] = (iterations, {name: seconds})
        self._window: dict[bool, tuple[int, dict[str, float]]] = {}

    @property
    def enabled(self) -> bool:
        return self.level > 0

    def __call__(self, name: str, level: int = 1) -> Any:
        if level > self.level:
            return _OFF
        timer = self._timers.get(name)
        if timer is None:
            timer = _EventTimer(name) if self._events else _HostTimer(name, self._sync)
            self._timers[name] = timer
        return timer

    def end_iteration(self, representative: bool = True) -> None:
        """Close one iteration (on CUDA after the device finished it: the loop synchronises)."""
        if not self.enabled:
            return
        count, totals = self._window.get(representative, (0, {}))
        for name, timer in self._timers.items():
            totals[name] = totals.get(name, 0.0) + timer.resolve()
        self._window[representative] = (count + 1, totals)

    def take(self) -> dict[str, float]:
        """Seconds per iteration of every timer that ran in the window; starts a new window."""
        count, totals = self._window.get(True) or self._window.get(False) or (0, {})
        self._window = {}
        return {name: seconds / count for name, seconds in totals.items()} if count else {}


def gather_over_ranks(means: dict[str, float], device: torch.device,
                      names: Iterable[str] = TIMER_NAMES) -> list[dict[str, float]]:
    """Collective over the world: every rank's ``means`` (from :meth:`Timers.take`), by rank.

    A timer a rank did not run (a first stage never receives activations) is absent from that
    rank's dict. One all-gather of a small float64 vector (NaN = absent).
    """
    names = tuple(names)
    local = torch.tensor([means.get(n, float("nan")) for n in names], dtype=torch.float64,
                         device=device)
    world = dist.get_world_size()
    rows = torch.empty(world * len(names), dtype=torch.float64, device=device)
    all_gather_into_tensor(rows, local)
    values = rows.view(world, len(names)).tolist()
    return [{n: v for n, v in zip(names, row) if v == v} for row in values]
