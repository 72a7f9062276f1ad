"""Verification records of checkpoints and the choice of the checkpoint a run loads.

A save (``checkpoint.save_checkpoint``) writes into a hidden work directory
``DIR/.incomplete_iter_NNNNNNN`` (never named like a checkpoint), then:

1. every rank measures a share of the files there (:func:`describe_files`: size and CRC-32 of
   ``.metadata`` and the ``*.distcp`` shards; file ``k`` of the sorted list is read by rank
   ``k mod world``) and the ranks exchange their parts;
2. rank 0 writes ``checkpoint_info.json`` with that list under ``"files"`` (the verification
   record), atomically and last;
3. rank 0 renames the work directory to ``iter_NNNNNNN`` and only then replaces ``latest``.

So an ``iter_*`` directory exists only for a finished save, and a directory whose record is
missing or does not match its files is damaged (deleted, truncated or altered afterwards).

At load (:func:`choose_checkpoint`) the candidates are ``latest``'s iteration and then every
older ``iter_*`` directory, newest first. For each, every rank checks the record it reads
(format, every listed file present with the recorded size) and the checksums of its share of
the files; the ranks then exchange what they found (``all_gather_object``), so every rank takes
the same decision from the same list. A damaged candidate is named (file, expected against
found) and, unless ``fallback`` is off (``--no-load-fallback``), the next older one is tried
with a warning. Checkpoints live on a file system every rank sees (as DCP requires).
"""

from __future__ import annotations

import json
import os
import re
import zlib
from typing import Any

import torch.distributed as dist

from .logging import get_logger

LATEST_FILE = "latest_checkpointed_iteration.txt"
INFO_FILE = "checkpoint_info.json"
FORMAT = "megatron_auto.checkpoint"
#: 2: checkpoint_info.json carries the verification record ("files"). 1: no record (read, with a
#: warning that nothing can be verified).
VERSION = 2
READABLE_VERSIONS = (1, 2)
RECORD_KEY = "files"
INCOMPLETE_PREFIX = ".incomplete_"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
_READ_CHUNK = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint flag or directory that cannot be used (message names what and the fix)."""


def iteration_dir(root: str | os.PathLike, iteration: int) -> str:
    return os.path.join(os.fspath(root), f"iter_{iteration:07d}")


def incomplete_dir(root: str | os.PathLike, iteration: int) -> str:
    """Where a save of ``iteration`` is written before it is complete (then renamed)."""
    return os.path.join(os.fspath(root), f"{INCOMPLETE_PREFIX}iter_{iteration:07d}")


def file_crc32(path: str) -> int:
    """CRC-32 of a file's bytes (zlib's; cheap next to writing them)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _rank_world(group: Any = None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _exchange(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` (collective over ``group`` when distributed)."""
    rank, world = _rank_world(group)
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def describe_files(directory: str, group: Any = None) -> dict[str, dict[str, int]]:
    """Collective over ``group``: ``{name: {"size": bytes, "crc32": crc}}`` of every file in
    ``directory`` except the info file, each file read by one rank."""
    rank, world = _rank_world(group)
    names = sorted(n for n in os.listdir(directory)
                   if n != INFO_FILE and os.path.isfile(os.path.join(directory, n)))
    mine = {n: {"size": os.path.getsize(os.path.join(directory, n)),
                "crc32": file_crc32(os.path.join(directory, n))}
            for n in names[rank::world]}
    record: dict[str, dict[str, int]] = {}
    for part in _exchange(mine, group):
        record.update(part)
    return dict(sorted(record.items()))


def latest_iteration(root: str | os.PathLike) -> int:
    """The iteration ``latest`` names under ``root``; CheckpointError if none."""
    root = os.fspath(root)
    path = os.path.join(root, LATEST_FILE)
    if not os.path.isdir(root):
        raise CheckpointError(f"--load={root}: no such directory; give the --save directory of "
                              f"an earlier run")
    if not os.path.isfile(path):
        raise CheckpointError(f"--load={root}: holds no checkpoint ({LATEST_FILE} is missing); "
                              f"give the --save directory of an earlier run, or drop --load")
    text = open(path, encoding="utf-8").read().strip()
    if not text.isdigit():
        raise CheckpointError(f"--load={root}: {LATEST_FILE} holds {text!r}, not an iteration "
                              f"number; rewrite it with the number of a complete iter_* directory")
    return int(text)


def candidates(root: str | os.PathLike, latest: int) -> list[int]:
    """``latest`` first, then every older ``iter_*`` directory under ``root``, newest first."""
    older = set()
    for name in os.listdir(os.fspath(root)):
        match = _ITER_DIR.match(name)
        if match and int(match.group(1)) < latest:
            older.add(int(match.group(1)))
    return [latest] + sorted(older, reverse=True)


def _read_record(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """(info, None) or (None, what is wrong with ``path``'s info file)."""
    info_path = os.path.join(path, INFO_FILE)
    if not os.path.isdir(path):
        return None, f"{path} is incomplete: the directory is missing"
    if not os.path.isfile(info_path):
        return None, (f"{path} is incomplete: {INFO_FILE} (the verification record, written "
                      f"last) is missing")
    try:
        with open(info_path, encoding="utf-8") as f:
            info = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        return None, f"{info_path} is corrupt: not valid JSON ({err})"
    if not isinstance(info, dict):
        return None, f"{info_path} is corrupt: not a JSON object"
    if info.get("format") != FORMAT or info.get("version") not in READABLE_VERSIONS:
        return None, (f"{info_path} has format {info.get('format')!r} version "
                      f"{info.get('version')!r}; this release reads {FORMAT!r} version "
                      f"{'/'.join(map(str, READABLE_VERSIONS))}")
    if info["version"] >= 2 and not isinstance(info.get(RECORD_KEY), dict):
        return None, f"{info_path} is corrupt: it has no verification record ({RECORD_KEY!r})"
    return info, None


def check_directory(path: str, group: Any = None, *, checksums: bool = True) -> tuple[dict | None, str | None]:
    """This rank's findings on checkpoint directory ``path`` (not collective).

    Every rank checks the record and the presence and size of every file; the CRC-32 of its
    share of the files (the same split as :func:`describe_files`) when ``checksums``.
    """
    info, problem = _read_record(path)
    if problem is not None or info is None:
        return None, problem
    record = info.get(RECORD_KEY)
    if record is None:  # version 1: nothing to compare with
        return info, None
    if ".metadata" not in record:
        return None, f"{os.path.join(path, INFO_FILE)} is corrupt: its record lists no .metadata"
    rank, world = _rank_world(group)
    names = sorted(record)
    for name in names:
        expected = record[name]
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return None, f"{file} is missing (expected {expected.get('size')} bytes)"
        size = os.path.getsize(file)
        if size != expected.get("size"):
            return None, f"{file} has {size} bytes, expected {expected.get('size')} (truncated?)"
    if checksums:
        for name in names[rank::world]:
            file, expected = os.path.join(path, name), record[name].get("crc32")
            found = file_crc32(file)
            if found != expected:
                return None, (f"{file} has checksum {found:08x}, expected "
                              f"{int(expected or 0):08x} (altered after the save)")
    return info, None


def choose_checkpoint(root: str | os.PathLike, *, fallback: bool = True,
                      group: Any = None) -> tuple[str, dict[str, Any]]:
    """Collective: (directory, checkpoint_info) of the newest intact checkpoint under ``root``.

    Starts at ``latest``'s iteration; every rank verifies (:func:`check_directory`) and the ranks
    agree on the first problem any of them found. With ``fallback``, a damaged checkpoint is
    skipped with a warning naming it and the next older one is tried; without, the first damage
    is a :class:`CheckpointError`. No intact checkpoint at all is a CheckpointError naming each.
    """
    log = get_logger()
    where = os.fspath(root)
    latest = latest_iteration(root)
    problems: list[str] = []
    for iteration in candidates(root, latest):
        path = iteration_dir(root, iteration)
        info, problem = check_directory(path, group)
        found = [p for p in _exchange(problem, group) if p is not None]
        if not found:
            assert info is not None
            if info.get(RECORD_KEY) is None:
                log.warning(f"> warning: --load={where}: {path} was saved without a verification "
                            f"record (format version 1); loading it unverified")
            if problems:
                log.warning(f"> warning: --load={where}: loading the intact checkpoint of "
                            f"iteration {iteration} instead of iteration {latest}")
            return path, info
        if not fallback:
            raise CheckpointError(f"--load={where}: damaged checkpoint: {found[0]}; drop "
                                  f"--no-load-fallback to load the newest intact older "
                                  f"checkpoint, or point {LATEST_FILE} at one")
        problems.append(found[0])
        log.warning(f"> warning: --load={where}: damaged checkpoint: {found[0]}; trying the "
                    f"previous one")
    raise CheckpointError(f"--load={where}: no intact checkpoint ({'; '.join(problems)}); "
                          f"give the --save directory of a run that finished a save, or drop "
                          f"--load to start from scratch")
