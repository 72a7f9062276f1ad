"""The results file: one JSON record per cell x method, appended as each finishes.

The first line is a header naming the format and :data:`grid.GRID_VERSION`; a file of another
format or version is refused (its numbers would not be comparable). Records are appended and
flushed one by one, so an interrupted grid keeps everything finished and a rerun skips it:
``done()`` answers which (cell, method) pairs are already there (for ``--run``: measured).
When a pair appears twice (an estimate, later its measurement), the last record wins.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from .grid import GRID_VERSION

FORMAT = "megatron_auto.reproduce.results"


class ResultsError(ValueError):
    """A results file that cannot be resumed (other format or grid version, corrupt line)."""


def record_key(record: Mapping[str, Any]) -> tuple[str, str]:
    cell = record["cell"]
    return (f"{cell['model']}@{cell['cluster']}@{float(cell['budget_gb']):g}GB", record["method"])


class ResultsFile:
    """Append-only JSONL of grid records (see the module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.records: dict[tuple[str, str], dict[str, Any]] = {}
        if self.path.exists() and self.path.stat().st_size > 0:
            self._read()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w", encoding="utf-8") as f:
                f.write(json.dumps({"format": FORMAT, "grid_version": GRID_VERSION}) + "\n")

    def _read(self) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines()
        try:
            header = json.loads(lines[0])
        except (json.JSONDecodeError, IndexError):
            header = None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ResultsError(f"{self.path}: not a reproduce results file (its first line is no "
                               f"{FORMAT} header); give another --results path")
        if header.get("grid_version") != GRID_VERSION:
            raise ResultsError(f"{self.path}: written by grid version "
                               f"{header.get('grid_version')}, this is version {GRID_VERSION}; "
                               f"its cells are not comparable, give a new --results path")
        for number, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                key = record_key(record)
            except (json.JSONDecodeError, KeyError, TypeError):
                if number == len(lines):  # a line cut short by a kill: drop it, redo that pair
                    break
                raise ResultsError(f"{self.path}:{number}: not a grid record; remove the line "
                                   f"or give a new --results path") from None
            self.records[key] = record
        # Rewrite without a torn last line, so that appends start on a fresh line.
        if not self.path.read_text(encoding="utf-8").endswith("\n"):
            self._rewrite()

    def _rewrite(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"format": FORMAT, "grid_version": GRID_VERSION}) + "\n")
            for record in self.records.values():
                f.write(json.dumps(record) + "\n")
        os.replace(tmp, self.path)

    def done(self, cell_key: str, method: str, measured: bool = False) -> bool:
        record = self.records.get((cell_key, method))
        if record is None:
            return False
        return "measured" in record if measured else True

    def get(self, cell_key: str, method: str) -> dict[str, Any] | None:
        return self.records.get((cell_key, method))

    def append(self, record: dict[str, Any]) -> None:
        record = {"grid_version": GRID_VERSION, **record}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records[record_key(record)] = record

    def all(self) -> Iterable[dict[str, Any]]:
        return list(self.records.values())
