"""--auto-parallel front end: pinned flags, search on a preset cluster, clear errors."""

import pytest

from megatron_auto import arguments
from megatron_auto.auto import AutoParallelError, plan_for_run, search_options_for
from megatron_auto.config import ModelConfig

pytestmark = pytest.mark.single

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "512"]


def _pins(extra):
    """The search pins of ``--auto-parallel MODEL extra`` (the training scripts' parse)."""
    return arguments.parse_run_config(["--auto-parallel", *MODEL, *extra]).plan_source


def test_pinned_flags_become_search_options():
    pins = _pins(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                  "--micro-batch-size", "2", "--global-batch-size", "16",
                  "--use-distributed-optimizer"])
    opts = search_options_for(pins, world_size=8)
    # dp = 8 / (2*2) = 2; micro-batches = 16 / (2 * 2) = 4
    assert (opts.tp, opts.pp, opts.num_microbatches) == (2, 2, 4)
    # --use-distributed-optimizer is Megatron's distributed optimizer, zero1 (it meant zero2
    # before ZeRO-1 existed: a deliberate contract change)
    assert opts.dp_modes == ("zero1",)
    assert opts.sequence_parallel is None and opts.virtual_sizes == (1, 2, 4)
    free = search_options_for(_pins(["--global-batch-size", "16"]), world_size=8)
    assert (free.tp, free.pp, free.num_microbatches) == (None, None, None)
    assert free.dp_modes == ("ddp", "zero1", "zero2", "zero3")


def test_sequence_parallel_and_virtual_size_pins():
    pins = _pins(["--sequence-parallel", "--pipeline-model-parallel-size", "2",
                  "--num-layers-per-virtual-pipeline-stage", "1"])
    opts = search_options_for(pins, world_size=8, num_layers=4)
    assert opts.sequence_parallel is True and opts.virtual_sizes == (2,)
    with pytest.raises(AutoParallelError, match="needs --pipeline-model-parallel-size"):
        search_options_for(_pins(["--num-layers-per-virtual-pipeline-stage", "1"]),
                           world_size=8, num_layers=4)


def test_a_typed_default_still_pins():
    # --tensor-model-parallel-size 1 equals Megatron's default but was typed: it pins tp=1.
    opts = search_options_for(_pins(["--tensor-model-parallel-size", "1"]), world_size=8)
    assert (opts.tp, opts.pp) == (1, None)


def test_micro_batch_that_does_not_divide_is_rejected():
    pins = _pins(["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                  "--micro-batch-size", "3", "--global-batch-size", "16"])
    with pytest.raises(AutoParallelError, match="--micro-batch-size=3"):
        search_options_for(pins, world_size=2)


def test_plan_for_run_on_a_preset_cluster_respects_pins_and_budget():
    pins = _pins(["--cluster", "a100-40g-1x8", "--global-batch-size", "16",
                  "--pipeline-model-parallel-size", "2"])
    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                         max_position_embeddings=32, vocab_size=512)
    plan = plan_for_run(pins, config, world_size=8)
    assert plan.world_size == 8 and plan.pp_size == 2 and plan.global_batch_size == 16
    assert plan.estimate is not None
    assert plan.estimate["stages"][0]["peak_memory_bytes"] <= 40e9
    plan.validate(config)


def test_budget_below_the_reserve_is_rejected():
    pins = _pins(["--cluster", "a100-40g-1x8", "--memory-budget-gb", "0.5"])
    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                         max_position_embeddings=32, vocab_size=512)
    with pytest.raises(AutoParallelError, match="--memory-budget-gb=0.5: not above the framework reserve"):
        plan_for_run(pins, config, world_size=8)


def test_infeasible_budget_reports_the_minimum():
    # GPT-2-medium-like model, batch 512 on 8 A100s: 2 GB cannot hold it.
    pins = _pins(["--cluster", "a100-40g-1x8", "--memory-budget-gb", "2",
                  "--global-batch-size", "512"])
    config = ModelConfig(num_layers=24, hidden_size=1024, num_attention_heads=16,
                         seq_length=1024, vocab_size=50257)
    with pytest.raises(AutoParallelError, match="least memory any plan"):
        plan_for_run(pins, config, world_size=8)


def test_auto_parallel_with_plan_is_rejected(tmp_path):
    # Rejected where the flags are converted, before any rank profiles anything.
    with pytest.raises(arguments.ArgumentError,
                       match="--plan=.*cannot be combined with --auto-parallel"):
        _pins(["--plan", str(tmp_path / "p.json")])
