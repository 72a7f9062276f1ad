"""Flags → RunConfig → plan: the mapping, and a clear message for every invalid combination."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest

from megatron_auto import arguments
from megatron_auto.config import ConfigError
from megatron_auto.plan import Plan, PlanError
from megatron_auto.plan_source import make_plan
from megatron_auto.run_config import ClassicLayout, PlanFile, SearchPins


def resolve(argv, world_size):
    run = arguments.parse_run_config(argv)
    return make_plan(run.plan_source, run.model, world_size)


# ------------------------------------------------------------------------------ mapping
@pytest.mark.pure
def test_defaults_are_the_embedded_small_gpt():
    run = arguments.parse_run_config([])
    cfg = dataclasses.replace(run.model, vocab_size=8000)  # what the embedded tokenizer sets
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.seq_length) == (4, 256, 4, 128)
    assert cfg.vocab_size == 8000 and cfg.padded_vocab_size == 8064
    assert isinstance(run.plan_source, ClassicLayout)
    plan = make_plan(run.plan_source, cfg, 2)
    # 8 samples over dp=2 replicas with micro-batches of 4: 1 micro-batch.
    assert (plan.global_batch_size, plan.num_microbatches, plan.pp_size) == (8, 1, 1)
    assert run.lr.warmup_iters == 10  # 10% of the 100 default iterations
    assert run.data.source == "embedded" and run.checkpoint.save is None


@pytest.mark.pure
def test_model_flags_map_onto_model_config():
    cfg = arguments.parse_run_config(["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads",
                                 "8", "--ffn-hidden-size", "96", "--seq-length", "32",
                                 "--max-position-embeddings", "64", "--vocab-size", "1000",
                                 "--swiglu", "--normalization", "RMSNorm",
                                 "--position-embedding-type", "rope",
                                 "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
                                 "--attention-dropout", "0.05"]).model
    assert cfg.activation == "swiglu" and cfg.normalization == "rmsnorm"
    assert cfg.position_embedding_type == "rope" and cfg.untie_embeddings_and_output_weights
    assert (cfg.ffn_hidden_size, cfg.max_position_embeddings, cfg.vocab_size) == (96, 64, 1000)
    assert (cfg.hidden_dropout, cfg.attention_dropout) == (0.0, 0.05)


@pytest.mark.pure
def test_classic_flags_build_the_uniform_plan():
    plan = resolve(["--num-layers", "4", "--tensor-model-parallel-size", "2",
                    "--pipeline-model-parallel-size", "2", "--global-batch-size", "16",
                    "--micro-batch-size", "2", "--use-distributed-optimizer"], 8)
    # world 8 = tp 2 x pp 2 x dp 2; 16 / (2 x 2) = 4 micro-batches.
    assert plan.num_microbatches == 4 and plan.pipeline.layers_per_stage == (2, 2)
    # zero1 = Megatron's distributed optimizer (was zero2 before zero1 existed; issue 13)
    assert all(l.tp == 2 and l.dp_mode == "zero1" and not l.recompute for l in plan.layers)
    assert plan.vocab.tp == 2 and plan.pipeline.schedule == "1f1b"


@pytest.mark.pure
@pytest.mark.parametrize("flags,expected", [
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], [True] * 4),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "1"], [True, False, True, False]),
    ([], [False] * 4),
    # selective recomputes core attention on every layer (trained without recompute before)
    (["--recompute-granularity", "selective"], ["selective"] * 4),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp", "layernorm"],
     [("mlp", "norm")] * 4),
])
def test_recompute_flags_become_per_layer_flags(flags, expected):
    plan = resolve(["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                    "--global-batch-size", "4", "--micro-batch-size", "1"] + flags, 2)
    assert [l.recompute for l in plan.layers] == expected


def write_plan(tmp_path, world_size=2, gbs=8, mb=2, name="plan.json", **overrides):
    plan = Plan.uniform(world_size, 4, global_batch_size=gbs, num_microbatches=mb, pp=2,
                        layers_per_stage=(3, 1), schedule="gpipe")
    data = plan.to_dict()
    data.update(overrides)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.pure
def test_plan_file_rules_the_batch(tmp_path):
    path = write_plan(tmp_path)
    plan = resolve(["--plan", path], 2)
    assert (plan.global_batch_size, plan.num_microbatches) == (8, 2)
    assert plan.pipeline.layers_per_stage == (3, 1) and plan.pipeline.schedule == "gpipe"
    assert resolve(["--plan", path, "--global-batch-size", "8"], 2).global_batch_size == 8


@pytest.mark.pure
def test_plan_file_warns_that_micro_batch_size_is_ignored(tmp_path):
    path = write_plan(tmp_path)
    with pytest.warns(UserWarning, match="--micro-batch-size=3 is ignored with --plan"):
        resolve(["--plan", path, "--micro-batch-size", "3"], 2)


# ------------------------------------------------------------------------------ errors
ERROR_CASES = [
    # (argv, world size, error type, message fragment)
    (["--hidden-size", "30", "--num-attention-heads", "4"], 2, ConfigError,
     "--hidden-size=30: must be divisible by --num-attention-heads=4"),
    (["--tensor-model-parallel-size", "8"], 8, ConfigError,
     "--tensor-model-parallel-size=8: must divide --num-attention-heads=4"),
    (["--ffn-hidden-size", "1026", "--tensor-model-parallel-size", "4"], 4, ConfigError,
     "--tensor-model-parallel-size=4: must divide --ffn-hidden-size=1026"),
    (["--vocab-size", "102", "--make-vocab-size-divisible-by", "1", "--tensor-model-parallel-size",
      "4"], 4, ConfigError, "must divide the padded vocabulary size 102"),
    (["--global-batch-size", "12", "--micro-batch-size", "2"], 4, ConfigError,
     "--global-batch-size=12: must be a multiple of --micro-batch-size=2 x data-parallel size 4"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "3"], 4, ConfigError,
     "must divide the world size 4"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 4, ConfigError,
     "--num-layers=3: Megatron needs it divisible by --pipeline-model-parallel-size=2"),
    (["--num-layers", "2", "--pipeline-model-parallel-size", "4"], 4, ConfigError,
     "--pipeline-model-parallel-size=4: exceeds --num-layers=2"),
    (["--recompute-granularity", "full", "--recompute-method", "block"], 2, ConfigError,
     "--recompute-num-layers=None: --recompute-method block needs"),
    (["--seq-length", "256", "--max-position-embeddings", "128"], 2, ConfigError,
     "--max-position-embeddings=128: must be at least --seq-length=256"),
]


@pytest.mark.single
@pytest.mark.parametrize("argv,world_size,error,message", ERROR_CASES)
def test_invalid_model_or_parallel_flags_fail_with_the_flag_named(argv, world_size, error, message):
    with pytest.raises(error) as info:
        resolve(argv, world_size)
    assert message in str(info.value)


PARSE_ERRORS = [
    (["--bf16", "--fp16"], "--bf16=True: cannot be combined with --fp16"),
    (["--mock-data", "--data-path", "a"], "--data-path=a: cannot be combined with --mock-data"),
    (["--plan", "p.json", "--auto-parallel"], "--plan=p.json: cannot be combined with --auto-parallel"),
    (["--train-iters", "0"], "--train-iters=0: trains nothing; it only writes the initial "
                             "checkpoint with --save DIR"),
    (["--train-iters", "-1"], "--train-iters=-1: must be >= 0"),
    (["--global-batch-size", "0"], "--global-batch-size=0: must be a positive integer"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr=0.01: must be between 0 and --lr=0.001"),
    (["--train-iters", "5", "--lr-warmup-iters", "10"], "--lr-warmup-iters=10: must not exceed"),
    (["--loss-scale", "128"], "--loss-scale=128.0: only applies to --fp16"),
    (["--clip-grad", "-1"], "--clip-grad=-1.0: must be >= 0"),
    (["--normalization", "BatchNorm"], "--normalization=BatchNorm: choose LayerNorm or RMSNorm"),
    (["--save-interval", "2"], "--save-interval=2: needs --save DIR"),
    (["--save", "ckpt", "--save-interval", "0"], "--save-interval=0: must be a positive integer"),
    # A missing --load directory starts from scratch (test_checkpoint); a file cannot serve.
    (["--load", __file__], f"--load={__file__}: is a file, not a directory"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes=0.0: must be a "
                                             "positive number of minutes"),
    (["--tokenizer-type", "NullTokenizer"], "--tokenizer-type=NullTokenizer: needs --data-path"),
    (["--eval-iters", "-1"], "--eval-iters=-1: must be >= 0"),
    # Non-finite values: nan passes no comparison, so each is named by its own flag.
    (["--lr", "nan"], "--lr=nan: must be a finite number"),
    (["--lr", "inf"], "--lr=inf: must be a finite number"),
    (["--min-lr", "nan"], "--min-lr=nan: must be a finite number"),
    (["--clip-grad", "inf"], "--clip-grad=inf: must be a finite number"),
    (["--weight-decay", "nan"], "--weight-decay=nan: must be a finite number"),
    (["--auto-parallel", "--memory-budget-gb", "inf"],
     "--memory-budget-gb=inf: must be a finite number"),
    (["--auto-parallel", "--cp-min-seq-length", "0"],
     "--cp-min-seq-length=0: must be a positive number of tokens"),
]


@pytest.mark.single
@pytest.mark.parametrize("argv,message", PARSE_ERRORS)
def test_contradictory_flags_fail_at_parse_time(argv, message):
    with pytest.raises(arguments.ArgumentError) as info:
        arguments.parse_run_config(argv)
    assert message in str(info.value)


@pytest.mark.pure
def test_plan_file_errors_name_the_problem(tmp_path):
    path = write_plan(tmp_path)
    with pytest.raises(PlanError, match="world_size=2 but this run has 4 ranks"):
        resolve(["--plan", path], 4)
    with pytest.raises(arguments.ArgumentError,
                       match="--global-batch-size=16: differs from the plan's global_batch_size=8"):
        resolve(["--plan", path, "--global-batch-size", "16"], 2)
    with pytest.raises(arguments.ArgumentError,
                       match="--tensor-model-parallel-size=2: conflicts with --plan"):
        resolve(["--plan", path, "--tensor-model-parallel-size", "2"], 2)
    for flags in (["--use-distributed-optimizer"], ["--recompute-granularity", "full"]):
        with pytest.raises(arguments.ArgumentError, match=f"{flags[0]}=.*: conflicts with --plan"):
            resolve(["--plan", path, *flags], 2)
    bad = write_plan(tmp_path, name="bad.json", num_microbatches=3)
    with pytest.raises(PlanError, match="num_microbatches=3"):
        resolve(["--plan", bad], 2)
    with pytest.raises(PlanError, match="layers has 4 entries but the model has --num-layers=2"):
        resolve(["--plan", path, "--num-layers", "2"], 2)
    with pytest.raises(PlanError, match="cannot read the file"):
        resolve(["--plan", str(tmp_path / "missing.json")], 2)


@pytest.mark.pure
def test_run_config_carries_the_flags():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = arguments.parse_run_config(["--fp16", "--loss-scale", "64", "--lr-decay-style", "WSD",
                                 "--lr-wsd-decay-iters", "20", "--train-iters", "200",
                                 "--clip-grad", "0", "--adam-beta2", "0.95", "--mock-data",
                                          "--vocab-size", "512", "--metrics-file", "m.jsonl",
                                          "--save", "ckpt", "--save-interval", "7",
                                          "--plan-out", "p.json"])
    prec, lr = run.precision, run.lr
    assert prec.fp16 and prec.loss_scale == 64 and prec.name == "fp16"
    assert (lr.decay_style, lr.decay_iters, lr.wsd_decay_iters) == ("WSD", 200, 20)
    opt = run.optimizer
    assert opt.clip_grad == 0 and opt.adam_beta2 == 0.95
    data = run.data
    assert data.source == "mock" and data.vocab_size == 512
    assert run.model.vocab_size == 512
    assert run.logging.metrics_file == "m.jsonl"
    assert run.training.train_iters == 200
    assert (run.checkpoint.save, run.checkpoint.save_interval) == ("ckpt", 7)
    assert run.plan_out == "p.json"


@pytest.mark.pure
def test_nan_check_is_opt_in_and_megatrons_off_switch_is_accepted():
    def check(*argv):
        return arguments.parse_run_config(list(argv)).training.check_for_nan_in_loss_and_grad

    assert check("--check-for-nan-in-loss-and-grad") is True
    assert check() is False and check("--no-check-for-nan-in-loss-and-grad") is False


@pytest.mark.pure
def test_planner_only_flags_warn_without_auto_parallel():
    with pytest.warns(UserWarning, match="--memory-budget-gb=40.0 only guides --auto-parallel"):
        arguments.parse_run_config(["--memory-budget-gb", "40"])


@pytest.mark.pure
def test_tokenizer_flags_warn_once_with_mock_data():
    with pytest.warns(UserWarning) as record:
        run = arguments.parse_run_config(["--mock-data", "--tokenizer-type", "GPT2BPETokenizer",
                                          "--vocab-file", "v.json", "--merge-file", "m.txt"])
    messages = [str(w.message) for w in record]
    assert messages == ["--tokenizer-type=GPT2BPETokenizer --vocab-file=v.json "
                        "--merge-file=m.txt: ignored with --mock-data (random token ids; the "
                        "vocabulary is --vocab-size)"]
    assert run.data.source == "mock"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        arguments.parse_run_config(["--mock-data", "--vocab-size", "512"])


# ------------------------------------------------------------------------------ Megatron flags
IGNORED_ARGV = ["--use-mcore-models", "--use-flash-attn", "--no-masked-softmax-fusion",
                "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                "--no-gradient-accumulation-fusion", "--overlap-grad-reduce",
                "--overlap-param-gather", "--distributed-backend", "nccl", "--num-workers", "2",
                "--dataloader-type", "cyclic", "--no-async-tensor-model-parallel-allreduce"]


@pytest.mark.pure
def test_megatron_flags_without_effect_are_accepted_with_one_warning():
    base = ["--num-layers", "2", "--tensor-model-parallel-size", "2"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = arguments.parse_run_config(base)
    with pytest.warns(UserWarning) as record:
        run = arguments.parse_run_config(base + IGNORED_ARGV)
    assert [str(w.message) for w in record] == [
        "Megatron-LM flags ignored (no effect in megatron_auto; see docs/training.md): "
        "--use-mcore-models --use-flash-attn --no-masked-softmax-fusion --no-bias-gelu-fusion "
        "--no-bias-dropout-fusion --no-gradient-accumulation-fusion "
        "--no-async-tensor-model-parallel-allreduce --overlap-grad-reduce "
        "--overlap-param-gather --distributed-backend=nccl --num-workers=2 "
        "--dataloader-type=cyclic"]
    assert run == plain  # they change nothing


@pytest.mark.parametrize("argv", [["--no-such-megatron-flag"],
                                  ["--transformer-impl", "apex"],
                                  ["--distributed-backend", "mpi"]])
@pytest.mark.pure
def test_unknown_flags_and_values_still_fail(argv, capsys):
    with pytest.raises(SystemExit) as info:
        arguments.parse_run_config(argv)
    assert info.value.code == 2 and "error:" in capsys.readouterr().err


# Flags this project implements or that open issues will: ignoring one would train another model.
IMPLEMENTED_OR_PLANNED = ("--sequence-parallel", "--num-layers-per-virtual-pipeline-stage",
                          "--fp8-format", "--transformer-impl", "--disable-bias-linear",
                          "--openai-gelu", "--group-query-attention", "--num-query-groups", "--swiglu",
                          "--use-distributed-optimizer", "--recompute-granularity", "--bf16",
                          "--fp16", "--untie-embeddings-and-output-weights",
                          "--timing-log-level")


@pytest.mark.pure
def test_implemented_or_planned_flags_are_never_ignored():
    assert not set(IMPLEMENTED_OR_PLANNED) & set(arguments.IGNORED_MEGATRON_FLAGS)
    # --transformer-impl is a real flag now (local or transformer_engine), never ignored
    assert "--transformer-impl" not in arguments.IGNORED_MEGATRON_FLAGS


@pytest.mark.pure
def test_docs_list_exactly_the_ignored_flags():
    import pathlib
    import re

    docs = (pathlib.Path(__file__).parents[1] / "docs" / "training.md").read_text()
    section = docs.split("### Megatron-LM flags accepted and ignored", 1)[1].split("\n#", 1)[0]
    listed = re.findall(r"^\| `(--[a-z0-9-]+)`", section, flags=re.M)
    assert listed == list(arguments.IGNORED_MEGATRON_FLAGS)


# ------------------------------------------------------------------------------ plan source
@pytest.mark.pure
def test_plan_source_is_decided_in_the_same_parse(tmp_path):
    path = write_plan(tmp_path)
    source = arguments.parse_run_config(["--plan", path, "--global-batch-size", "8"]).plan_source
    assert source == PlanFile(path, global_batch_size=8)
    classic = arguments.parse_run_config(["--tensor-model-parallel-size", "2"]).plan_source
    assert isinstance(classic, ClassicLayout) and classic.tensor_model_parallel_size == 2
    assert classic.pipeline_model_parallel_size is None  # not typed: counts as 1


@pytest.mark.pure
def test_typed_layout_flags_become_search_pins_even_at_megatron_defaults():
    pins = arguments.parse_run_config(
        ["--auto-parallel", "--tensor-model-parallel-size", "1", "--bf16", "--num-layers", "2",
         "--cluster", "a100-40g-1x8", "--memory-budget-gb", "20"]).plan_source
    # TP 1 equals Megatron's default but was typed, so it pins; PP was not typed: searched.
    assert pins == SearchPins(tensor_model_parallel_size=1, cluster="a100-40g-1x8",
                              memory_budget_gb=20.0)
    free = arguments.parse_run_config(["--auto-parallel"]).plan_source
    assert free == SearchPins()



@pytest.mark.pure
def test_sequence_parallel_and_virtual_pipeline_flags_build_the_plan():
    plan = resolve(["--num-layers", "8", "--tensor-model-parallel-size", "2",
                    "--pipeline-model-parallel-size", "2", "--global-batch-size", "16",
                    "--micro-batch-size", "2", "--sequence-parallel",
                    "--num-layers-per-virtual-pipeline-stage", "2"], 8)
    assert all(l.sequence_parallel and l.tp == 2 for l in plan.layers)
    assert plan.pipeline.virtual_size == 2 and plan.pipeline.layers_per_stage == (2, 2, 2, 2)
    assert plan.num_microbatches == 4


@pytest.mark.single
@pytest.mark.parametrize("flags,match", [
    (["--num-layers-per-virtual-pipeline-stage", "3", "--pipeline-model-parallel-size", "2"],
     r"--num-layers-per-virtual-pipeline-stage=3: --num-layers=4 must be a multiple of"),
    (["--num-layers-per-virtual-pipeline-stage", "1"],
     r"--num-layers-per-virtual-pipeline-stage=1: interleaving needs "
     r"--pipeline-model-parallel-size > 1"),
])
def test_bad_virtual_pipeline_flags_name_the_flag(flags, match):
    with pytest.raises(ValueError, match=match):
        resolve(["--num-layers", "4", "--global-batch-size", "8", *flags], 2)


@pytest.mark.pure
def test_sp_and_interleaving_flags_pin_the_search():
    from megatron_auto.arguments import parse_run_config

    pins = parse_run_config(["--auto-parallel", "--sequence-parallel",
                             "--num-layers-per-virtual-pipeline-stage", "2"]).plan_source
    assert pins.sequence_parallel and pins.num_layers_per_virtual_pipeline_stage == 2
