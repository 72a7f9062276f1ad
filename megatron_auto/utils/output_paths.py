"""Output paths checked before any work starts: writable, creatable, of the right kind, new.

Every entry point that writes a file or a directory (a checkpoint ``--save`` directory, a
``--metrics-file``, a plan, a profile, a converted model, a dataset, a figure) checks its
output paths with this module while it parses its flags, so that a path that cannot be written
stops the command with one line before it trains, searches, tokenizes or converts anything,
and an output the user already has is replaced only when the command's contract says so
(``--overwrite``, or a documented rewrite such as ``megatron-auto plan --plan-out``).

Writability is probed by creating (and removing) a temporary file in the directory, not by
``os.access``: the permission bits do not tell about read-only mounts, ``/proc``, root-squashed
network file systems, or a process running as root. Nothing else is created: a directory that
does not exist yet is checked through its nearest existing ancestor, and made by the writer
(except with ``create=True``, for writers that need it to exist first).

Each check raises the caller's error class (``error=``) so that each layer keeps its own
exception (the TensorBoard sink raises ``ExperimentLogError``, which rank 0 broadcasts); the
default, :class:`OutputPathError`, is a ``ConfigError``, which every entry point prints as one
``error: ...`` line with exit status 2. Pure standard library (plus the base ``config``).
"""

from __future__ import annotations

import os
import tempfile
from typing import Iterable

from ..config import ConfigError

__all__ = ["OutputPathError", "check_output_dir", "check_output_file", "refuse_existing",
           "refuse_non_empty_dir"]


class OutputPathError(ConfigError):
    """An output path that cannot be written, or an existing output not to be replaced."""


def _probe(directory: str) -> str | None:
    """None when a file can be created in ``directory``, else the reason (``strerror``)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=directory)
    except OSError as err:
        return err.strerror or str(err)
    os.close(fd)
    os.remove(probe)
    return None


def _nearest_existing(path: str) -> str:
    """``path`` itself or its nearest ancestor that exists (``/`` at worst)."""
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def check_output_dir(path: str | os.PathLike, flag: str,
                     error: type[Exception] = OutputPathError, *, create: bool = False) -> str:
    """``path`` (as a string) when a directory there exists and is writable, or can be created.

    ``create``: make the directory now (with its parents). Raises ``error`` naming ``flag``,
    the path and the fix: a file in the way, a directory that cannot be created, or one that
    is not writable.
    """
    path = os.fspath(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise error(f"{flag}={path}: is a file, not a directory; choose a directory path")
    if create:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as err:
            raise error(f"{flag}={path}: cannot create the directory ({err.strerror}); choose a "
                        f"writable path") from None
    if os.path.isdir(path):
        if _probe(path) is not None:
            raise error(f"{flag}={path}: the directory is not writable; choose a writable path")
        return path
    base = _nearest_existing(path)
    if not os.path.isdir(base):
        raise error(f"{flag}={path}: cannot create the directory ({base} is a file); choose a "
                    f"writable path")
    reason = _probe(base)
    if reason is not None:
        raise error(f"{flag}={path}: cannot create the directory ({base}: {reason}); choose a "
                    f"writable path")
    return path


def check_output_file(path: str | os.PathLike, flag: str,
                      error: type[Exception] = OutputPathError, *, append: bool = False) -> str:
    """``path`` when the file can be written there (atomically: a new file in its directory).

    Its directory must exist (the writers do not create it). ``append``: the file, when it
    exists, is extended rather than replaced, so it must itself be writable. Raises ``error``
    naming ``flag``, the path and the fix.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise error(f"{flag}={path}: is a directory; give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is a file" if os.path.lexists(parent) else "does not exist"
        raise error(f"{flag}={path}: the directory {parent} {what}; create it or choose "
                    f"another path")
    reason = _probe(parent)
    if reason is not None:
        raise error(f"{flag}={path}: cannot write in {parent} ({reason}); choose a writable "
                    f"path")
    if append and os.path.exists(path):
        try:
            with open(path, "a", encoding="utf-8"):
                pass  # opening for append changes nothing; it proves the file takes writes
        except OSError as err:
            raise error(f"{flag}={path}: cannot append to the file ({err.strerror}); choose a "
                        f"writable path") from None
    return path


def refuse_existing(paths: Iterable[str | os.PathLike], flag: str, overwrite: bool,
                    error: type[Exception] = OutputPathError, *,
                    overwrite_flag: str = "--overwrite") -> None:
    """Raise ``error`` when one of ``paths`` exists and ``overwrite`` is false: an output the
    user already has is replaced only when asked."""
    if overwrite:
        return
    for path in paths:
        path = os.fspath(path)
        if os.path.lexists(path):
            raise error(f"{flag}: {path} already exists; add {overwrite_flag} to replace it, or "
                        f"choose another path")


def refuse_non_empty_dir(path: str | os.PathLike, flag: str, overwrite: bool,
                         error: type[Exception] = OutputPathError, *,
                         overwrite_flag: str = "--overwrite") -> None:
    """Raise ``error`` when the directory ``path`` exists with something in it and
    ``overwrite`` is false (what would be written may replace what is there)."""
    path = os.fspath(path)
    if overwrite or not os.path.isdir(path):
        return
    entries = sorted(os.listdir(path))
    if entries:
        more = f" and {len(entries) - 1} more" if len(entries) > 1 else ""
        raise error(f"{flag}={path}: the directory is not empty ({entries[0]}{more}); add "
                    f"{overwrite_flag} to write into it, or choose a new directory")
