"""Damaged, partial and asynchronous checkpoints: detected, named, fallen back from, exact.

Every fault here is made by hand on a real checkpoint of the tiny GPT (2 ranks, TP 2, saved at
iterations 2 and 4): a truncated or deleted ``*.distcp`` shard, a corrupt or deleted
``checkpoint_info.json``, a record without its file list, a byte altered in place (same size:
only the checksum sees it). Each load must name the damaged file (expected against found), fall
back on every rank to the intact checkpoint of iteration 2 with a warning, or stop with a
CheckpointError under ``fallback=False``. Continuing after the fallback (and after an
asynchronous save) must equal the uninterrupted one-process run (test_checkpoint.reference).
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from dist_utils import run_distributed
from test_checkpoint import SPLIT, STEPS, TP2, _phase, _trainer, assert_matches_reference
from test_equivalence import make_batch

pytestmark = pytest.mark.multirank

SAVES = (2, 4)


def _save_worker(rank, world_size, plan_dict, root, async_save):
    from megatron_auto.models.init import gather_full_state
    from megatron_auto.training.checkpoint import save_checkpoint, wait_for_pending_save
    from megatron_auto.training.trainer import train_step

    trainer = _trainer(plan_dict)
    losses = []
    for step in range(STEPS):
        losses.append(train_step(trainer, make_batch(step)).lm_loss)
        if trainer.iteration in SAVES:
            save_checkpoint(trainer, root, async_save=async_save)
    wait_for_pending_save()
    return {"losses": losses, "listing": sorted(os.listdir(root)),
            "state": gather_full_state(trainer.stage)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-rank TP 2 run of STEPS steps that saved at iterations 2 and 4."""
    root = tmp_path_factory.mktemp("saved")
    outs = run_distributed(_save_worker, 2, TP2, str(root), False)
    return root, outs


def test_save_writes_a_verification_record_and_no_debris(saved):
    from megatron_auto.training.checkpoint_verify import file_crc32

    root, outs = saved
    assert outs[0]["listing"] == ["iter_0000002", "iter_0000004",
                                  "latest_checkpointed_iteration.txt"]
    path = root / "iter_0000004"
    record = json.loads((path / "checkpoint_info.json").read_text())["files"]
    on_disk = sorted(n for n in os.listdir(path) if n != "checkpoint_info.json")
    assert sorted(record) == on_disk and ".metadata" in record
    assert sum(n.endswith(".distcp") for n in record) == 2  # one shard file per rank
    for name, entry in record.items():
        assert entry == {"size": os.path.getsize(path / name), "crc32": file_crc32(path / name)}


def _shards(path):
    return sorted(n for n in os.listdir(path) if n.endswith(".distcp"))


def _truncate(path):
    shard = path / _shards(path)[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    return shard.name, "bytes, expected"


def _delete_shard(path):
    shard = path / _shards(path)[-1]
    shard.unlink()
    return shard.name, "is missing (expected"


def _corrupt_info(path):
    (path / "checkpoint_info.json").write_text('{"format": "megatron_auto.checkpoint", "itera')
    return "checkpoint_info.json", "is corrupt: not valid JSON"


def _delete_info(path):
    (path / "checkpoint_info.json").unlink()
    return "checkpoint_info.json", "is missing"


def _drop_record(path):
    info = json.loads((path / "checkpoint_info.json").read_text())
    del info["files"]
    (path / "checkpoint_info.json").write_text(json.dumps(info))
    return "checkpoint_info.json", "has no verification record"


def _flip_byte(path):
    # Same size, one byte changed in the file rank 1 checksums (index 1 of the sorted record):
    # rank 0 alone sees nothing, so the ranks must agree through their exchange.
    names = sorted(json.loads((path / "checkpoint_info.json").read_text())["files"])
    target = path / names[1]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    return names[1], "has checksum"


DAMAGE = {"truncated shard": _truncate, "deleted shard": _delete_shard,
          "corrupt info": _corrupt_info, "deleted info": _delete_info,
          "record dropped": _drop_record, "altered byte": _flip_byte}


def _choose_worker(rank, world_size, root):
    from megatron_auto.training.checkpoint import CheckpointError, read_info

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("megatron_auto")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        path, info = read_info(root)
        try:
            read_info(root, fallback=False)
            strict = None
        except CheckpointError as err:
            strict = str(err)
    finally:
        logger.removeHandler(handler)
    return {"path": os.path.basename(path), "iteration": info["iteration"], "strict": strict,
            "warnings": records}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_checkpoint_is_named_and_every_rank_falls_back(saved, tmp_path, kind):
    root = tmp_path / "ckpt"
    shutil.copytree(saved[0], root)
    name, what = DAMAGE[kind](root / "iter_0000004")
    outs = run_distributed(_choose_worker, 2, str(root))
    for out in outs:  # the same decision on every rank
        assert (out["path"], out["iteration"]) == ("iter_0000002", 2), kind
        assert out["strict"] is not None and "\n" not in out["strict"]
        assert out["strict"].startswith(f"--load={root}: damaged checkpoint: ")
        assert name in out["strict"] and what in out["strict"], out["strict"]
        assert "--no-load-fallback" in out["strict"]
    warned = outs[0]["warnings"]
    assert any("damaged checkpoint" in w and name in w and "trying the previous one" in w
               for w in warned), warned
    assert any("loading the intact checkpoint of iteration 2 instead of iteration 4" in w
               for w in warned), warned


def test_no_intact_checkpoint_names_every_damage(saved, tmp_path):
    from megatron_auto.training.checkpoint import CheckpointError, read_info

    root = tmp_path / "ckpt"
    shutil.copytree(saved[0], root)
    _truncate(root / "iter_0000004")
    _delete_info(root / "iter_0000002")
    with pytest.raises(CheckpointError, match=r"no intact checkpoint \(.*iter_0000004.*bytes, "
                       r"expected.*; .*iter_0000002 is incomplete: checkpoint_info.json"):
        read_info(root)


def test_truncated_shard_falls_back_and_continues_exactly(saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved[0], root)
    _truncate(root / "iter_0000004")
    # _phase asserts that the load returned iteration SPLIT (= 2): the fallback.
    assert_matches_reference(_phase(2, TP2, SPLIT, STEPS, load_dir=root),
                             "after falling back from a truncated shard")


def _interrupted_worker(rank, world_size, plan_dict, root):
    from megatron_auto.training import checkpoint
    from megatron_auto.training.trainer import train_step

    trainer = _trainer(plan_dict)
    for step in range(STEPS):
        train_step(trainer, make_batch(step))
        if trainer.iteration == 2:
            checkpoint.save_checkpoint(trainer, root)
    real = checkpoint.describe_files

    def crash(*args, **kwargs):  # the process "dies" after DCP wrote, before the record
        raise KeyboardInterrupt("simulated kill during the save")

    checkpoint.describe_files = crash
    try:
        checkpoint.save_checkpoint(trainer, root)
    except KeyboardInterrupt:
        pass
    finally:
        checkpoint.describe_files = real
    after_crash = sorted(os.listdir(root))
    chosen = checkpoint.read_info(root)[0]
    checkpoint.save_checkpoint(trainer, root)  # the restart saves iteration 4 properly
    trainer.iteration = 2  # and a second save of an existing iteration replaces it whole
    checkpoint.save_checkpoint(trainer, root)
    return {"after_crash": after_crash, "chosen": os.path.basename(chosen),
            "final": sorted(os.listdir(root))}


def test_interrupted_save_leaves_no_iter_directory_and_is_cleaned_up(tmp_path):
    from test_checkpoint import ONE

    out, = run_distributed(_interrupted_worker, 1, ONE, str(tmp_path))
    assert out["after_crash"] == [".incomplete_iter_0000004", "iter_0000002",
                                  "latest_checkpointed_iteration.txt"]
    assert out["chosen"] == "iter_0000002"
    assert out["final"] == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert json.loads((tmp_path / "iter_0000002" / "checkpoint_info.json").read_text())["files"]


def test_async_save_matches_sync_save_and_resumes_exactly(saved, tmp_path):
    import torch

    root = tmp_path / "async"
    outs = run_distributed(_save_worker, 2, TP2, str(root), True)
    sync_outs = saved[1]
    # Training went on while the checkpoint was written: the same losses and parameters.
    assert outs[0]["losses"] == sync_outs[0]["losses"]
    for name, value in sync_outs[0]["state"].items():
        torch.testing.assert_close(outs[0]["state"][name], value, rtol=0, atol=0)
    assert outs[0]["listing"] == ["iter_0000002", "iter_0000004",
                                  "latest_checkpointed_iteration.txt"]
    (root / "latest_checkpointed_iteration.txt").write_text("2\n")  # resume from the first save
    assert_matches_reference(_phase(2, TP2, SPLIT, STEPS, load_dir=root),
                             "resumed from an asynchronous save")
