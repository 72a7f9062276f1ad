"""Progress of long work (profiling, the plan search, preprocessing, checkpoints).

One reporter for every long job: on a terminal a tqdm bar (the optional ``progress`` extra),
otherwise -- output redirected to a file, a job log, tqdm not installed -- plain lines at most
every ``interval_s`` seconds and one final line, so a log stays short and greppable::

    megatron-auto search: 12/40 tasks (30%), 1.5 s, 8.0 tasks/s, best: 105.2 samples/s
    megatron-auto search: done, 40/40 tasks, 4.1 s, 9.8 tasks/s, best: 120.4 samples/s

Only the rank that should speak reports: pass ``enabled=False`` elsewhere (rank-aware callers
pass ``rank == 0``); a disabled reporter does nothing at all. Pure standard library (the
planner's commands must not import torch); tqdm is imported only when a bar is drawn.
"""

from __future__ import annotations

import importlib
import sys
import time
from typing import Any, Callable, TextIO

__all__ = ["Progress", "RestartingProgress"]

DEFAULT_INTERVAL_S = 10.0


def _tqdm() -> Any | None:
    try:
        return importlib.import_module("tqdm").tqdm
    except ImportError:
        return None


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


class Progress:
    """Progress of one job of ``total`` steps (``None``: unknown) counted in ``unit``.

    ``update(n)`` adds ``n`` done steps, ``update_to(done)`` sets the count; keyword arguments of
    either are shown after the counts (``best="120.4 samples/s"``). ``close()`` (or leaving the
    ``with`` block) prints the final line. ``delay_s``: nothing is shown before the job has run
    this long (a job that ends sooner prints nothing at all); ``bar``: ``None`` draws a tqdm bar
    when ``stream`` is a terminal and tqdm imports, ``False`` always writes plain lines.
    ``clock`` (default ``time.monotonic``, looked up at each call) is injectable for tests.
    """

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", *,
                 enabled: bool = True, stream: TextIO | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S, delay_s: float = 0.0,
                 bar: bool | None = None, clock: Callable[[], float] | None = None) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.enabled = enabled
        self.done = 0
        self.info: dict[str, Any] = {}
        self._stream = stream if stream is not None else sys.stderr
        self._interval, self._delay = interval_s, delay_s
        self._clock = clock or (lambda: time.monotonic())
        self._t0 = self._clock()
        self._last_line: float | None = None
        self._closed = False
        self._bar = None
        if enabled and bar is not False and _is_tty(self._stream):
            tqdm = _tqdm()
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, unit=unit, file=self._stream,
                                 delay=delay_s, dynamic_ncols=True, leave=True)

    # ----------------------------------------------------------------------- counting
    def update(self, n: int = 1, **info: Any) -> None:
        self.update_to(self.done + n, **info)

    def update_to(self, done: int, **info: Any) -> None:
        if not self.enabled or self._closed:
            return
        step, self.done = done - self.done, done
        self.info.update(info)
        if self._bar is not None:
            if info:
                self._bar.set_postfix({k: _number(v) for k, v in info.items()}, refresh=False)
            self._bar.update(step)
            return
        now = self._clock() - self._t0
        if now < self._delay:
            return
        if self._last_line is None or now - self._last_line >= self._interval:
            self._last_line = now
            self._write(self.line(now))

    def close(self) -> None:
        """The final line (plain mode: only if the job ran past ``delay_s``)."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            return
        now = self._clock() - self._t0
        if now >= self._delay:
            self._write(self.line(now, final=True))

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------------------- lines
    def line(self, elapsed_s: float, final: bool = False) -> str:
        """The plain line for the current counts after ``elapsed_s`` seconds."""
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        parts = [f"{'done, ' if final else ''}{count} {self.unit}"]
        if self.total and not final:
            parts[0] += f" ({100 * self.done / self.total:.0f}%)"
        parts.append(f"{elapsed_s:.1f} s")
        if elapsed_s > 0 and self.done:
            parts.append(f"{_number(self.done / elapsed_s)} {self.unit}/s")
        parts += [f"{key.replace('_', ' ')}: {_number(value)}" for key, value in self.info.items()]
        return f"{self.desc}: " + ", ".join(parts)

    def _write(self, text: str) -> None:
        print(text, file=self._stream, flush=True)


class RestartingProgress:
    """A ``(done, total, best)`` callback over :class:`Progress` bars (the plan search's): a
    new bar starts whenever ``total`` changes or ``done`` goes back (a new group of work, e.g.
    a baseline space's tasks); ``best``, when given, is shown as ``samples/s``."""

    def __init__(self, label: str, unit: str, interval_s: float = DEFAULT_INTERVAL_S,
                 delay_s: float = 0.0) -> None:
        self.label, self.unit, self.interval_s, self.delay_s = label, unit, interval_s, delay_s
        self._shown: Progress | None = None

    def __call__(self, done: int, total: int, best: float | None) -> None:
        shown = self._shown
        if shown is None or shown.total != total or done < shown.done:
            self.close()
            shown = self._shown = Progress(self.label, total, self.unit,
                                           interval_s=self.interval_s, delay_s=self.delay_s)
        shown.update_to(done, best=f"{best:.2f} samples/s" if best else "none yet")

    def close(self) -> None:
        if self._shown is not None:
            self._shown.close()
            self._shown = None
