"""--auto-parallel front end: pinned flags, search on a preset cluster, clear errors."""

import pytest

from megatron_auto import arguments
from megatron_auto.auto import AutoParallelError, explicit_flags, plan_for_run, search_options_for
from megatron_auto.config import ModelConfig

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "512"]


def _args(extra):
    argv = ["--auto-parallel", *MODEL, *extra]
    args = arguments.build_parser().parse_args(argv)
    args.argv_ = argv
    return args


def test_explicit_flags_sees_only_what_was_typed():
    parser = arguments.build_parser()
    typed = explicit_flags(["--tensor-model-parallel-size", "1", "--bf16", "--num-layers", "2"],
                           parser)
    # The TP flag equals its default (1) but was typed, so it pins; --pipeline... was not typed.
    assert {"tensor_model_parallel_size", "bf16", "num_layers"} <= typed
    assert "pipeline_model_parallel_size" not in typed
    assert "seed" not in typed


def test_pinned_flags_become_search_options():
    args = _args(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                  "--micro-batch-size", "2", "--global-batch-size", "16",
                  "--use-distributed-optimizer"])
    explicit = explicit_flags(args.argv_, arguments.build_parser())
    opts = search_options_for(args, explicit, world_size=8, global_batch_size=16)
    # dp = 8 / (2*2) = 2; micro-batches = 16 / (2 * 2) = 4
    assert (opts.tp, opts.pp, opts.num_microbatches) == (2, 2, 4)
    assert opts.dp_modes == ("zero2",)
    free = search_options_for(_args([]), set(), world_size=8, global_batch_size=16)
    assert (free.tp, free.pp, free.num_microbatches) == (None, None, None)


def test_micro_batch_that_does_not_divide_is_rejected():
    args = _args(["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                  "--micro-batch-size", "3", "--global-batch-size", "16"])
    explicit = explicit_flags(args.argv_, arguments.build_parser())
    with pytest.raises(AutoParallelError, match="--micro-batch-size=3"):
        search_options_for(args, explicit, world_size=2, global_batch_size=16)


def test_plan_for_run_on_a_preset_cluster_respects_pins_and_budget():
    args = _args(["--cluster", "a100-40g-1x8", "--global-batch-size", "16",
                  "--pipeline-model-parallel-size", "2"])
    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                         max_position_embeddings=32, vocab_size=512)
    plan = plan_for_run(args, config, world_size=8)
    assert plan.world_size == 8 and plan.pp_size == 2 and plan.global_batch_size == 16
    assert plan.estimate is not None
    assert plan.estimate["stages"][0]["peak_memory_bytes"] <= 40e9
    plan.validate(config)


def test_budget_below_the_reserve_is_rejected():
    args = _args(["--cluster", "a100-40g-1x8", "--memory-budget-gb", "0.5"])
    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                         max_position_embeddings=32, vocab_size=512)
    with pytest.raises(AutoParallelError, match="--memory-budget-gb=0.5: not above the framework reserve"):
        plan_for_run(args, config, world_size=8)


def test_infeasible_budget_reports_the_minimum():
    # GPT-2-medium-like model, batch 512 on 8 A100s: 2 GB cannot hold it.
    args = _args(["--cluster", "a100-40g-1x8", "--memory-budget-gb", "2",
                  "--global-batch-size", "512"])
    config = ModelConfig(num_layers=24, hidden_size=1024, num_attention_heads=16,
                         seq_length=1024, vocab_size=50257)
    with pytest.raises(AutoParallelError, match="least memory any plan"):
        plan_for_run(args, config, world_size=8)


def test_auto_parallel_with_plan_is_rejected(tmp_path):
    args = _args(["--plan", str(tmp_path / "p.json")])
    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                         max_position_embeddings=32, vocab_size=512)
    with pytest.raises(AutoParallelError, match="--plan"):
        plan_for_run(args, config, world_size=8)
