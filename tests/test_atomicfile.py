"""The atomic-write helper: the target is complete or untouched, and no temporary file stays."""

from __future__ import annotations

import os
import stat

import pytest

from megatron_auto.utils.atomicfile import AtomicFile, atomic_open, atomic_write
from megatron_auto.utils.jsonfile import read_json, write_json

pytestmark = pytest.mark.pure


def test_atomic_write_replaces_the_whole_file_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "latest.txt"
    path.write_text("old content that is longer\n")
    atomic_write(path, "7\n", durable=True)
    assert path.read_text() == "7\n"
    atomic_write(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert os.listdir(tmp_path) == ["latest.txt"]


def test_a_failure_inside_the_block_leaves_the_old_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("old\n")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_open(path) as fh:
            fh.write("half of the new")
            raise RuntimeError("disk full")
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["plan.json"]


def test_the_target_appears_only_on_commit(tmp_path):
    path = tmp_path / "data.bin"
    f = AtomicFile(path, "wb")
    f.file.write(b"abc")
    assert not path.exists()  # a reader sees no half-written file
    f.commit()
    f.commit()  # idempotent
    assert path.read_bytes() == b"abc"
    g = AtomicFile(tmp_path / "other.bin", "wb")
    g.file.write(b"x")
    g.abort()
    assert sorted(os.listdir(tmp_path)) == ["data.bin"]


def test_written_files_get_the_permissions_of_a_plain_open(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    atomic_write(tmp_path / "atomic.txt", "x")
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(tmp_path / "atomic.txt") == mode(plain)


def test_write_json_is_atomic_and_round_trips(tmp_path):
    path = tmp_path / "cluster.json"
    write_json(path, {"a": [1, 2]})
    assert read_json(path, "--cluster", ValueError) == {"a": [1, 2]}
    assert path.read_text().endswith("\n")
    with pytest.raises(TypeError):
        write_json(path, {"not json": object()})
    assert read_json(path, "--cluster", ValueError) == {"a": [1, 2]}  # the old file survives
    assert os.listdir(tmp_path) == ["cluster.json"]


def test_bad_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="mode='a'"):
        AtomicFile(tmp_path / "x", "a")
