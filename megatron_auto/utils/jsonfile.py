"""Reading and writing the project's JSON files (plans, cluster and model profiles, imports).

One place for the error wording every file type shares: which flag named the file, the path,
what went wrong (unreadable, or the line and column of the syntax error) and the fix, raised as
the caller's own error type so that each layer keeps its exception.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from .atomicfile import atomic_open


def read_json(path: str | os.PathLike, label: str, error: type[Exception], *,
              read_fix: str = "check the path", syntax_fix: str = "fix the file") -> Any:
    """The JSON value in ``path``; ``label`` (e.g. ``--cluster``) starts every message."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as err:
        raise error(f"{label} {path}: cannot read the file ({err.strerror}); {read_fix}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{label} {path}: not valid JSON (line {err.lineno}, column {err.colno}: "
                    f"{err.msg}); {syntax_fix}") from None


def write_json(path: str | os.PathLike, data: Any) -> None:
    """``data`` as indented JSON with a final newline, written atomically (a reader sharing the
    file, e.g. another rank reading a profile cache, never sees half of it)."""
    with atomic_open(path) as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")


def unknown_fields(cls: type, data: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """``(the keys of record data that name no field of dataclass cls, cls's field names)``,
    both sorted: what a ``from_dict`` refuses, and what its message lists as known."""
    known = sorted(f.name for f in dataclasses.fields(cls))
    return sorted(set(data) - set(known)), known
