"""TensorBoard and W&B logging: the scalars written are read back from the files themselves."""

from __future__ import annotations

import glob
import json
import os
import time

import pytest

from megatron_auto.training.experiment_log import (ExperimentLog, ExperimentLogConfig,
                                                   ExperimentLogError, record_scalars)

RECORDS = [
    {"iteration": 1, "lm_loss": 6.5, "lr": 1e-4, "grad_norm": 2.0, "iteration_time_s": 0.5,
     "samples_per_s": 16.0, "peak_memory_bytes": 1.5e9, "predicted_peak_memory_bytes": 1.4e9,
     "predicted_iteration_time_s": 0.45, "timers_forward_s": 0.2, "loss_scale": None},
    {"iteration": 2, "lm_loss": 6.0, "lr": 2e-4, "grad_norm": 1.5, "iteration_time_s": 0.4,
     "samples_per_s": 20.0, "peak_memory_bytes": 1.5e9, "predicted_peak_memory_bytes": 1.4e9,
     "predicted_iteration_time_s": 0.45, "timers_forward_s": 0.18, "loss_scale": None},
    {"iteration": 2, "split": "valid", "lm_loss": 5.9, "ppl": 365.0},
    {"iteration": 3, "lm_loss": 5.5, "lr": 3e-4, "grad_norm": 1.2, "iteration_time_s": 0.4,
     "samples_per_s": 20.0, "peak_memory_bytes": 1.5e9, "predicted_peak_memory_bytes": 1.4e9,
     "predicted_iteration_time_s": 0.45, "timers_forward_s": 0.17, "loss_scale": None},
]


@pytest.mark.pure
def test_field_selection_follows_the_flags():
    plain = record_scalars(RECORDS[0], ExperimentLogConfig(tensorboard_dir="x"))
    assert plain["train/lm_loss"] == 6.5 and plain["train/predicted_iteration_time_s"] == 0.45
    assert "train/peak_memory_bytes" not in plain and "train/timers_forward_s" not in plain
    assert "train/loss_scale" not in plain  # None is not a scalar
    full = record_scalars(RECORDS[0], ExperimentLogConfig(
        tensorboard_dir="x", log_memory_to_tensorboard=True, log_timers_to_tensorboard=True))
    assert full["train/peak_memory_bytes"] == 1.5e9
    assert full["train/predicted_peak_memory_bytes"] == 1.4e9
    assert full["train/timers_forward_s"] == 0.2
    assert "valid/ppl" not in record_scalars(RECORDS[2], ExperimentLogConfig(tensorboard_dir="x"))
    assert record_scalars(RECORDS[2], ExperimentLogConfig(
        tensorboard_dir="x", log_validation_ppl_to_tensorboard=True))["valid/ppl"] == 365.0


def _tensorboard_scalars(log_dir):
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="the tensorboard package is the 'test' extra's; install it to run this test")
    acc = accumulator.EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.single
def test_tensorboard_event_files_hold_the_metrics(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is the 'test' extra's")
    config = ExperimentLogConfig(tensorboard_dir=str(tmp_path / "tb"), tensorboard_log_interval=2,
                                 log_memory_to_tensorboard=True,
                                 log_validation_ppl_to_tensorboard=True)
    log = ExperimentLog(config, enabled=True)
    for record in RECORDS:
        log.write(record)
    log.close()
    scalars = _tensorboard_scalars(tmp_path / "tb")
    # Interval 2 keeps training iteration 2 only; the evaluation record always goes out.
    assert scalars["train/lm_loss"] == [(2, pytest.approx(6.0))]
    assert scalars["train/lr"] == [(2, pytest.approx(2e-4))]
    assert scalars["train/peak_memory_bytes"] == [(2, pytest.approx(1.5e9))]
    assert scalars["valid/lm_loss"] == [(2, pytest.approx(5.9))]
    assert scalars["valid/ppl"] == [(2, pytest.approx(365.0))]
    assert "train/timers_forward_s" not in scalars


@pytest.mark.pure
def test_disabled_rank_writes_nothing(tmp_path):
    log = ExperimentLog(ExperimentLogConfig(tensorboard_dir=str(tmp_path / "tb")), enabled=False)
    log.write(RECORDS[0])
    log.close()
    assert not (tmp_path / "tb").exists()


def _wandb_history(run_file):
    """History rows of an offline ``.wandb`` file: W&B's 7-byte header, then LevelDB-style
    records (32 KiB blocks; 4-byte crc, 2-byte length, 1-byte type: full/first/middle/last)
    holding ``wandb_internal_pb2.Record`` protobufs."""
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")
    data = open(run_file, "rb").read()
    pos, block, pending, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending + chunk if kind == 4 else chunk)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
    return rows


@pytest.mark.pure
def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb package is the 'test' extra's")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = ExperimentLogConfig(wandb_project="megatron-auto-test", wandb_exp_name="tiny",
                                 wandb_save_dir=str(tmp_path / "wb"))
    log = ExperimentLog(config, enabled=True, run_config={"num_layers": 2})
    for record in RECORDS:
        log.write(record)
    log.close()
    [run_file] = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    # wandb's service process writes the file; on a loaded machine its last records can land
    # just after finish() returns, so give it a few seconds before reading the history.
    deadline = time.monotonic() + 30
    rows = _wandb_history(run_file)
    while len(rows) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
        rows = _wandb_history(run_file)
    losses = [(r["_step"], r["train/lm_loss"]) for r in rows if "train/lm_loss" in r]
    assert losses == [(1, 6.5), (2, 6.0), (3, 5.5)], (rows, os.path.getsize(run_file))
    assert [r["valid/lm_loss"] for r in rows if "valid/lm_loss" in r] == [5.9]


@pytest.mark.pure
def test_bad_flags_are_named():
    with pytest.raises(ExperimentLogError, match="--tensorboard-log-interval=0"):
        ExperimentLogConfig(tensorboard_dir="x", tensorboard_log_interval=0)


@pytest.mark.single
def test_unwritable_tensorboard_dir_is_named(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is the 'test' extra's")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ExperimentLogError, match=r"--tensorboard-dir=.*file/tb: cannot create"):
        ExperimentLog(ExperimentLogConfig(tensorboard_dir=str(blocker / "tb")), enabled=True)


@pytest.mark.pure
def test_missing_package_is_named(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # what an absent package looks like
    with pytest.raises(ExperimentLogError, match="--wandb-project: needs the 'wandb' package"):
        ExperimentLog(ExperimentLogConfig(wandb_project="p"), enabled=True)
