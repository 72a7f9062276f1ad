"""A model family defined in this file, registered through the public registry, runs every path
that the built-in families run: ``megatron-auto plan`` and ``evaluate``, measuring, 2-rank
training that matches one process, and a checkpoint round trip across plans. No package file
knows it.

The family, ``toy``: a bidirectional transformer language model whose FFN width is a multiple
of the hidden size given by its own flag (``--toy-ffn-multiplier``). Its config is its own
class (a ``ModelConfig`` with one more field, as T5's is), its stage is built from the
project's layers (the GPT stage's embedding, layers and tied head, attending both ways), its
spec builder, flags, checkpoint fields and plan record are this file's; the profiler is the
GPT profiler, named by reference.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import pytest

from megatron_auto.cli import main
from megatron_auto.config import ConfigError, ModelConfig
from megatron_auto.families.family import Family
from megatron_auto.families.registry import (config_from_record, family_names, get_family,
                                             register_family, unregister_family)
from megatron_auto.plan import Plan
from megatron_auto.planner.inputs.model_spec import LayerType, ModelSpec

RTOL = 1e-5
GLOBAL_BATCH = 8  # the multi-rank harness's (tests/harness.py; imported where torch may load)
STEPS, SPLIT = 4, 2  # training steps, and the step after which the checkpoint is written


# ------------------------------------------------------------------------------ the family
@dataclass(frozen=True)
class ToyConfig(ModelConfig):
    """A bidirectional LM with ``ffn_hidden_size = toy_ffn_multiplier * hidden_size``."""

    model_types: ClassVar[tuple[str, ...]] = ("toy",)

    model_type: str = "toy"
    toy_ffn_multiplier: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.toy_ffn_multiplier, int) or self.toy_ffn_multiplier < 1:
            raise ConfigError(f"--toy-ffn-multiplier={self.toy_ffn_multiplier}: must be a "
                              f"positive integer")
        object.__setattr__(self, "ffn_hidden_size", self.toy_ffn_multiplier * self.hidden_size)
        super().__post_init__()


TOY_RECORD = ("model_type", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
              "vocab_size", "make_vocab_size_divisible_by", "toy_ffn_multiplier")


def toy_spec(cfg: ToyConfig) -> ModelSpec:
    lt = LayerType(name="toy", hidden_size=cfg.hidden_size,
                   num_attention_heads=cfg.num_attention_heads,
                   ffn_hidden_size=cfg.ffn_hidden_size, seq_length=cfg.seq_length,
                   count=cfg.num_layers, causal=False)
    return ModelSpec(layer_types=(lt,), layer_order=(0,) * cfg.num_layers,
                     vocab_size=cfg.padded_vocab_size, embedding_hidden_size=cfg.hidden_size,
                     seq_length=cfg.seq_length, name="toy",
                     num_position_embeddings=cfg.max_position_embeddings,
                     config={k: v for k, v in cfg.to_dict().items() if k in TOY_RECORD})


def add_toy_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument_group("toy").add_argument("--toy-ffn-multiplier", type=int, default=2,
                                                  help="FFN width in hidden sizes")


def toy_from_flags(args: argparse.Namespace, defaults: Mapping[str, Any]) -> ToyConfig:
    return ToyConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                     vocab_size=args.vocab_size or 64,
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     toy_ffn_multiplier=args.toy_ffn_multiplier, hidden_dropout=0.0,
                     attention_dropout=0.0)


@functools.cache
def _toy_stage_class() -> type:
    from megatron_auto.models.gpt import GPTStage  # torch: only where a stage is built

    class ToyStage(GPTStage):
        """The GPT stage's embedding, layers and tied head, attending both ways."""

        causal = False
    return ToyStage


def build_toy_stage(config: ToyConfig, ctx: Any, seed: int = 1234) -> Any:
    return _toy_stage_class()(config, ctx, seed=seed)


TOY = Family(
    name="toy", config_class=ToyConfig, model_spec=toy_spec, from_flags=toy_from_flags,
    stage=build_toy_stage, profiler="megatron_auto.profiler.model_profiler:GPT_PROFILER",
    add_flags=add_toy_flags, help="toy (this test's family)", noun="toy model",
    checkpoint_fields={"toy_ffn_multiplier": "--toy-ffn-multiplier",
                       "num_layers": "--num-layers", "hidden_size": "--hidden-size",
                       "num_attention_heads": "--num-attention-heads",
                       "padded_vocab_size": "--vocab-size"})

CONFIG = ToyConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                   vocab_size=60, make_vocab_size_divisible_by=16, toy_ffn_multiplier=3,
                   hidden_dropout=0.0, attention_dropout=0.0)
FLAGS = ["--model-type", "toy", "--num-layers", "4", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "60",
         "--make-vocab-size-divisible-by", "16", "--toy-ffn-multiplier", "3",
         "--global-batch-size", str(GLOBAL_BATCH)]


@pytest.fixture(autouse=True)
def toy_family():
    """The family is registered for each test (forked ranks inherit it) and removed after."""
    register_family(TOY)
    yield TOY
    unregister_family("toy")


# ------------------------------------------------------------------------------ planning
@pytest.mark.pure
def test_the_registry_knows_the_family_only_while_registered(toy_family):
    assert family_names()[-1] == "toy" and get_family("toy") is toy_family
    assert config_from_record(CONFIG.to_dict()) == CONFIG
    unregister_family("toy")
    with pytest.raises(ValueError, match="model_type='toy': no such model family"):
        get_family("toy")
    register_family(TOY)
    with pytest.raises(ValueError, match="'toy' is registered already"):
        register_family(TOY)


@pytest.mark.pure
def test_plan_and_evaluate_a_toy_model(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    assert main(["plan", *FLAGS, "--cluster", "a100-40g-1x8", "--plan-out", str(plan_path),
                 "--quiet"]) == 0
    plan = Plan.load(plan_path)
    # the family's record, not the planner's idea of a model
    assert plan.model == {k: v for k, v in CONFIG.to_dict().items() if k in TOY_RECORD}
    assert len(plan.layers) == CONFIG.num_layers
    capsys.readouterr()
    # the plan file alone names the model: its family reads the record back
    assert main(["evaluate", "--plan", str(plan_path), "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert estimate["iteration_time_s"] > 0 and estimate["samples_per_s"] > 0
    # the family's own flag reaches its config: another multiplier is another model
    assert main(["evaluate", "--plan", str(plan_path), *FLAGS[:-4],
                 "--toy-ffn-multiplier", "2"]) == 2
    assert "model.toy_ffn_multiplier=3 does not match" in capsys.readouterr().err
    # and the family's config checks its own flag's value
    assert main(["plan", *FLAGS[:-4], "--toy-ffn-multiplier", "0", "--quiet",
                 "--plan-out", str(tmp_path / "bad.json")]) == 2
    assert "--toy-ffn-multiplier=0: must be a positive integer" in capsys.readouterr().err


@pytest.mark.single
def test_the_toy_model_is_measured_by_the_profiler_it_names(tmp_path, capsys):
    from megatron_auto.profiler.lookup import lookup_or_measure
    from megatron_auto.profiler.measure import ModelProfilerConfig

    quick = ModelProfilerConfig(batch_sizes=(2, 3), warmup_iters=0, iters=1)
    found = lookup_or_measure(CONFIG, "fp32", "cpu", str(tmp_path / "cache"), config=quick)
    assert found.measured
    profile = found.profile
    profile.check_matches(toy_spec(CONFIG), "fp32")  # one entry per layer type of its spec
    assert profile.layer_types["toy"].parameter_count == toy_spec(CONFIG).layer_types[0] \
        .num_parameters  # the spec counts what the stage's layers hold
    again = lookup_or_measure(CONFIG, "fp32", "cpu", str(tmp_path / "cache"), config=quick)
    assert not again.measured  # the family's cache key finds it
    path = tmp_path / "toy.profile.json"
    profile.save(path)
    assert main(["plan", *FLAGS, "--cluster", "a100-40g-1x2", "--model-profile", str(path),
                 "--quiet", "--plan-out", str(tmp_path / "plan.json")]) == 0


# ------------------------------------------------------------------------------ training
def make_batch(step: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(500 + step)
    s = CONFIG.seq_length
    tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, s + 1), generator=gen)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": (torch.rand(GLOBAL_BATCH, s, generator=gen) > 0.1).float(),
            "position_ids": torch.arange(s).expand(GLOBAL_BATCH, -1).contiguous()}


def toy_recipe() -> Any:
    """The harness's recipe for the toy model, its stage built through its family (looked up
    in the registry on each rank), with a cosine schedule that a resumed run must restore."""
    from harness import Recipe
    from megatron_auto.families.registry import family_of
    from megatron_auto.training.lr_scheduler import LRConfig

    return Recipe(CONFIG, lambda cfg, ctx, seed: family_of(cfg).build_stage(cfg, ctx, seed),
                  make_batch, lr=LRConfig(lr=1e-3, min_lr=1e-4, decay_style="cosine",
                                          warmup_iters=1, decay_iters=STEPS))


@pytest.mark.multirank
def test_two_ranks_train_the_toy_model_like_one_process_across_a_checkpoint(tmp_path):
    # The plan megatron-auto searched for two devices; then a checkpoint, loaded under a
    # two-stage plan: the losses and the parameters are those of one uninterrupted process.
    searched = tmp_path / "plan.json"
    assert main(["plan", *FLAGS, "--cluster", "a100-40g-1x2", "--plan-out", str(searched),
                 "--quiet"]) == 0
    searched_plan = Plan.load(searched).to_dict()
    two_stages = Plan.uniform(2, CONFIG.num_layers, global_batch_size=GLOBAL_BATCH,
                              num_microbatches=2, pp=2).to_dict()
    one = Plan.uniform(1, CONFIG.num_layers, global_batch_size=GLOBAL_BATCH).to_dict()

    from harness import assert_same_training, run_phase

    recipe = toy_recipe()
    ref = run_phase(recipe, 1, one, 0, STEPS)
    first = run_phase(recipe, 2, searched_plan, 0, SPLIT, save_dir=tmp_path / "ckpt")
    second = run_phase(recipe, 2, two_stages, SPLIT, STEPS, load_dir=tmp_path / "ckpt")
    assert first.losses + second.losses == pytest.approx(ref.losses, rel=RTOL)
    # the resumed steps' losses and gradient norms, every parameter (rtol 1e-5, atol 1e-6)
    assert_same_training(ref, second, "toy: searched plan -> checkpoint -> two stages")
    # the training moved the model: the comparison is not one of untouched initialisations
    assert ref.losses[-1] < ref.losses[0]


@pytest.mark.single
def test_a_checkpoint_loads_only_into_the_toy_model_it_holds(tmp_path):
    import dataclasses

    from megatron_auto.training.checkpoint import CheckpointError, check_model_matches

    saved = CONFIG.to_dict()
    check_model_matches(saved, CONFIG, "d")  # the same model: fine
    check_model_matches(saved, dataclasses.replace(CONFIG, seq_length=8), "d")  # not a field
    with pytest.raises(CheckpointError, match="toy_ffn_multiplier=3 but this run has "
                                              "toy_ffn_multiplier=2; set --toy-ffn-multiplier"):
        check_model_matches(saved, dataclasses.replace(CONFIG, toy_ffn_multiplier=2), "d")
    gpt = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4).to_dict()
    with pytest.raises(CheckpointError, match="holds a gpt model, this run trains a toy model"):
        check_model_matches(gpt, CONFIG, "d")
