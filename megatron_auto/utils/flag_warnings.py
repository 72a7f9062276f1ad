"""The one way a flag that cannot apply says so: a :class:`FlagWarning`, shown as one line.

A flag given for a model or a mode it does not apply to (``--log-memory-to-tensorboard``
without a TensorBoard directory, ``--swin-window-size`` with a ViT, ``--sequence-parallel``
at tp 1, ``--micro-batch-size`` next to ``--plan``, ...) changes nothing, and Megatron users
rely on flags doing what they say, so it is never silent: :func:`warn_flag` raises a
``FlagWarning`` (a ``UserWarning``: ``pytest.warns`` and the ``warnings`` filters see it)
naming the flag, its value and why it does nothing. A flag that would make the run wrong is an
error instead, never a warning.

The entry points show these warnings through :func:`one_line_flag_warnings`: each distinct
message once, as ``warning: <message>`` on stderr, on one process only (rank 0 under
torchrun), with no source line. Library callers outside that block get Python's usual display.
Pure standard library.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any, Iterator, TextIO

__all__ = ["FlagWarning", "one_line_flag_warnings", "warn_flag"]


class FlagWarning(UserWarning):
    """A flag that was given but cannot apply to the chosen model or mode (it changes nothing,
    or less than it says); the message names the flag, its value and what to do."""


def warn_flag(message: str, *, stacklevel: int = 2) -> None:
    """Warn that a flag cannot apply; ``message`` starts with the flag (``--flag=value: ...``).
    ``stacklevel`` counts from the caller, as for ``warnings.warn``."""
    warnings.warn(message, FlagWarning, stacklevel=stacklevel + 1)


@contextlib.contextmanager
def one_line_flag_warnings(show: bool = True, stream: TextIO | None = None) -> Iterator[None]:
    """Inside the block, every distinct ``FlagWarning`` prints once as ``warning: <message>``
    on ``stream`` (default: stderr at the time of printing) when ``show`` (false on the ranks
    other than 0), and not at all otherwise. Other warnings keep Python's handling."""
    seen: set[str] = set()
    with warnings.catch_warnings():
        # Every occurrence reaches the hook below, which keeps its own record: Python's "once"
        # registry is process-wide and would hide the warning of a second run in one process.
        warnings.simplefilter("always", FlagWarning)
        shown = warnings.showwarning

        def show_one_line(message: Any, category: type[Warning], filename: str, lineno: int,
                          file: TextIO | None = None, line: str | None = None) -> None:
            if not issubclass(category, FlagWarning):
                shown(message, category, filename, lineno, file, line)
                return
            text = str(message)
            if show and text not in seen:
                print(f"warning: {text}", file=stream or sys.stderr)
            seen.add(text)

        warnings.showwarning = show_one_line
        yield
