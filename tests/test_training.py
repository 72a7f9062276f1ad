"""Training building blocks: LR schedules (hand values), loss scaling, optimizer groups, data
batching, throughput arithmetic and the Megatron console line."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from megatron_auto.config import ModelConfig
from megatron_auto.training.data import (DataConfig, DataError, load_global_batch,
                                         prepare_data_source, split_microbatches)
from megatron_auto.training.logging import format_iteration_line
from megatron_auto.training.lr_scheduler import LRConfig, lr_at, set_lr
from megatron_auto.training.metrics import MetricsWriter, model_flops_per_token
from megatron_auto.parallel.optimizer import OptimizerConfig, build_optimizer, param_groups
from megatron_auto.training.precision import LossScaler, PrecisionConfig, autocast_dtype, unscale_

pytestmark = pytest.mark.single


# ----------------------------------------------------------------------------- LR schedules
@pytest.mark.parametrize("style,iteration,expected", [
    # lr=1.0, min_lr=0.1, warm-up 10, decay until 110 (span 100).
    ("linear", 5, 0.5),                      # warm-up: 1.0 * 5 / 10
    ("linear", 10, 1.0),                     # end of warm-up
    ("linear", 60, 0.1 + 0.9 * 0.5),         # half-way: r = 50/100
    ("linear", 110, 0.1),
    ("linear", 500, 0.1),                    # after the horizon: min_lr
    ("cosine", 60, 0.1 + 0.9 * 0.5),         # cos(pi/2) = 0
    ("cosine", 35, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2),
    ("constant", 5, 0.5),
    ("constant", 1000, 1.0),
])
def test_lr_schedule_hand_values(style, iteration, expected):
    cfg = LRConfig(lr=1.0, min_lr=0.1, decay_style=style, warmup_iters=10, decay_iters=110)
    assert lr_at(cfg, iteration) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("wsd_style,iteration,expected", [
    # lr=1.0, min 0.0, warm-up 10, horizon 110, final decay of 20 iterations (starts after 90).
    ("linear", 50, 1.0), ("linear", 90, 1.0), ("linear", 100, 0.5), ("linear", 105, 0.25),
    ("cosine", 100, 0.5), ("exponential", 100, 2 * 0.5 ** 0.5 - 1), ("minus_sqrt", 95, 0.5),
    ("linear", 110, 0.0),
])
def test_wsd_schedule_hand_values(wsd_style, iteration, expected):
    cfg = LRConfig(lr=1.0, min_lr=0.0, decay_style="WSD", warmup_iters=10, decay_iters=110,
                   wsd_decay_iters=20, wsd_decay_style=wsd_style)
    assert lr_at(cfg, iteration) == pytest.approx(expected, abs=1e-12)


def test_lr_config_rejects_bad_values():
    with pytest.raises(ValueError, match="--lr-decay-style=step"):
        LRConfig(decay_style="step")
    with pytest.raises(ValueError, match="--lr-wsd-decay-iters=200"):
        LRConfig(decay_style="WSD", decay_iters=100, wsd_decay_iters=200)


def test_set_lr_updates_every_group():
    opt = torch.optim.SGD([{"params": [nn.Parameter(torch.ones(1))]},
                           {"params": [nn.Parameter(torch.ones(1))]}], lr=1.0)
    set_lr(opt, 0.25)
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.25]


# ----------------------------------------------------------------------------- loss scaling
def test_dynamic_loss_scale_backs_off_with_hysteresis_and_grows_after_window():
    scaler = LossScaler(PrecisionConfig(fp16=True, initial_loss_scale=1024.0, hysteresis=2,
                                        loss_scale_window=3, min_loss_scale=256.0))
    scaler.update(found_inf=True)
    assert scaler.scale == 1024.0  # first overflow absorbed by hysteresis
    scaler.update(found_inf=True)
    assert scaler.scale == 512.0
    scaler.update(found_inf=True)
    assert scaler.scale == 256.0
    scaler.update(found_inf=True)
    assert scaler.scale == 256.0  # floor
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 512.0


def test_static_and_non_fp16_scales_stay_fixed():
    static = LossScaler(PrecisionConfig(fp16=True, loss_scale=128.0))
    static.update(True)
    assert static.scale == 128.0 and not static.dynamic
    assert LossScaler(PrecisionConfig(bf16=True)).scale == 1.0
    assert autocast_dtype(PrecisionConfig(bf16=True)) == torch.bfloat16
    assert autocast_dtype(PrecisionConfig(fp16=True)) == torch.float16
    assert autocast_dtype(PrecisionConfig()) is None
    with pytest.raises(ValueError, match="--bf16=True: cannot be combined with --fp16"):
        PrecisionConfig(bf16=True, fp16=True)


def test_unscale_divides_gradients():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 8.0)
    unscale_([p], 4.0)
    torch.testing.assert_close(p.grad, torch.full((3,), 2.0))


# ----------------------------------------------------------------------------- optimizer
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


def test_weight_decay_skips_biases_and_norms():
    model = Tiny()
    groups = param_groups(model.parameters(), {id(p): n for n, p in model.named_parameters()}, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert decayed == {id(model.proj.weight)}
    assert len(groups[1]["params"]) == 3


def test_adamw_step_matches_hand_computation():
    # One AdamW step from zero state moves each weight by lr * (sign(g) + wd * w) when |g| >> eps.
    p = nn.Parameter(torch.tensor([[1.0, -2.0]]))
    opt = build_optimizer([p], OptimizerConfig(weight_decay=0.1, adam_eps=1e-12), lr=0.01)
    p.grad = torch.tensor([[0.5, -3.0]])
    opt.step()
    expected = torch.tensor([[1.0 * (1 - 0.01 * 0.1) - 0.01, -2.0 * (1 - 0.01 * 0.1) + 0.01]])
    torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)


def test_optimizer_without_parameters_is_an_error():
    with pytest.raises(ValueError, match="no trainable parameter on this rank"):
        build_optimizer([], OptimizerConfig(), lr=1.0)


# ----------------------------------------------------------------------------- data
class CountingDataset:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"tokens": np.full(3, i, dtype=np.int64), "loss_mask": np.ones(3, dtype=np.float32)}


def test_global_batch_reads_consecutive_samples_and_cycles():
    batch = load_global_batch(CountingDataset(10), consumed_samples=8, global_batch_size=4)
    assert batch["tokens"][:, 0].tolist() == [8, 9, 0, 1]
    micro = split_microbatches(batch, 2, torch.device("cpu"))
    assert [m["tokens"][:, 0].tolist() for m in micro] == [[8, 9], [0, 1]]
    with pytest.raises(DataError, match="num_microbatches=3"):
        split_microbatches(batch, 3, torch.device("cpu"))
    with pytest.raises(DataError, match="the dataset is empty"):
        load_global_batch(CountingDataset(0), 0, 4)


def test_data_source_needs_a_tokenizer_for_data_path():
    assert prepare_data_source(DataConfig(mock_data=True, vocab_size=99)).vocab_size == 99
    with pytest.raises(DataError, match="--tokenizer-type=None: --data-path needs"):
        prepare_data_source(DataConfig(data_path=("x",)))


# ----------------------------------------------------------------------------- metrics/logging
def test_model_flops_per_token_by_hand():
    cfg = ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4,
                      vocab_size=16, make_vocab_size_divisible_by=16)
    # per layer: 2*(4*64 + 2*8*32) + 4*4*8 = 2*(256+512) + 128 = 1664; head: 2*8*16 = 256.
    assert model_flops_per_token(cfg) == 3 * (2 * 1664 + 256)


def test_metrics_writer_appends_json_lines(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"
    writer = MetricsWriter(str(path), enabled=True)
    writer.write({"iteration": 1, "lm_loss": 2.5})
    writer.write({"iteration": 2, "lm_loss": 2.0})
    MetricsWriter(str(tmp_path / "other.jsonl"), enabled=False).write({"iteration": 1})
    lines = path.read_text().splitlines()
    assert [eval(line)["iteration"] for line in lines] == [1, 2]  # noqa: S307 - test data
    assert not (tmp_path / "other.jsonl").exists()


def test_console_line_has_megatron_fields():
    line = format_iteration_line(iteration=3, train_iters=10, consumed_samples=24, elapsed_ms=12.5,
                                 lr=1e-3, global_batch_size=8, lm_loss=2.25, loss_scale=None,
                                 grad_norm=0.5, skipped_iterations=0, tokens_per_s=100.0,
                                 tflops_per_device=0.01)
    assert line.startswith(" iteration        3/      10 | consumed samples:")
    for field in ("elapsed time per iteration (ms): 12.5", "learning rate: 1.000000E-03",
                  "global batch size:     8", "lm loss: 2.250000E+00", "grad norm: 0.500",
                  "number of skipped iterations:   0", "tokens/s: 100.0", "TFLOP/s/device: 0.010"):
        assert field in line
    assert "loss scale" not in line


def test_split_microbatches_passes_scalars_to_every_microbatch():
    batch = {"tokens": torch.arange(8).view(4, 2), "sop_weight": torch.tensor(3.0)}
    micro = split_microbatches(batch, 2, torch.device("cpu"))
    assert [m["tokens"].tolist() for m in micro] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert all(float(m["sop_weight"]) == 3.0 for m in micro)


def test_prediction_line_states_both_numbers_and_the_gap():
    from megatron_auto.training.metrics import format_prediction_line, predicted_metrics

    estimate = {"iteration_time_s": 0.12, "stages": [{"peak_memory_bytes": 3 * 2**20},
                                                     {"peak_memory_bytes": 4 * 2**20}]}
    pred = predicted_metrics(estimate)
    assert pred == {"predicted_iteration_time_s": 0.12,
                    "predicted_peak_memory_bytes": 4 * 2**20}
    line = format_prediction_line({**pred, "iteration_time_s": 0.1,
                                   "peak_memory_bytes": 5 * 2**20})
    # 120 ms vs 100 ms is +20%; 4 MiB vs 5 MiB is -20%.
    assert "120.0 predicted vs 100.0 measured (+20.0%) ms" in line
    assert "4.0 predicted vs 5.0 measured (-20.0%) MiB" in line
    assert "not measured" in format_prediction_line(pred)
