"""``--hf-config``: a Hugging Face config.json as the model flags (families/hf_config.py).

Every config is written by ``transformers``' own config class (``save_pretrained``, nothing
downloaded) and must give exactly the model that typing the Megatron flags gives; typed flags
override the file; what our models do not have is one line naming the field.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest

from megatron_auto import arguments
from megatron_auto.cli import build_parser, main, model_config_from_flags
from megatron_auto.families.hf_config import HFConfigError, apply_hf_config, hf_flags
from megatron_auto.plan import Plan
from megatron_auto.utils.flag_warnings import FlagWarning

transformers = pytest.importorskip("transformers", reason="the configs are written by "
                                   "transformers' config classes (the test extra installs it)")

pytestmark = pytest.mark.pure

# LLaMA-3-8B's published sizes (Meta's model card / config.json).
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                 tie_word_embeddings=False)
SMALL_LLAMA = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
                   vocab_size=1000, rms_norm_eps=1e-6, rope_theta=5000.0)
SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=128, vocab_size=1000)


def _save(tmp_path, name: str, config) -> str:
    out = os.path.join(tmp_path, name)
    config.save_pretrained(out)
    return out


def _cli_config(*argv: str):
    """The model config ``megatron-auto plan ARGV`` would plan (the CLI's own parse)."""
    parser = build_parser("plan")
    args = parser.parse_args(["plan", *argv])
    from megatron_auto.cli_checks import command_given_flags
    given = command_given_flags(parser, ["plan", *argv])
    sub = next(a.choices["plan"] for a in parser._actions
               if isinstance(a, argparse._SubParsersAction))
    apply_hf_config(args, given, frozenset(a.dest for a in sub._actions),
                    family_dest="model_type")
    return model_config_from_flags(args)


def _flags_config(*argv: str):
    parser = build_parser("plan")
    return model_config_from_flags(parser.parse_args(["plan", *argv]))


def test_the_issue_command_plans_llama3_8b(tmp_path, capsys):
    path = os.path.join(_save(tmp_path, "llama3-8b", transformers.LlamaConfig(**LLAMA3_8B)),
                        "config.json")
    out = tmp_path / "plan.json"
    code = main(["plan", "--hf-config", path, "--cluster", "h100-80g-1x8",
                 "--global-batch-size", "64", "--plan-out", str(out), "--quiet"])
    text, err = capsys.readouterr()
    assert code == 0, err
    model = Plan.load(out).model
    assert {k: model[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
                                  "num_query_groups", "ffn_hidden_size", "vocab_size",
                                  "seq_length", "max_position_embeddings")} == {
        "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
        "ffn_hidden_size": 14336, "vocab_size": 128256, "seq_length": 8192,
        "max_position_embeddings": 8192}
    assert (model["position_embedding_type"], model["activation"], model["normalization"],
            model["untie_embeddings_and_output_weights"], model["add_bias_linear"]) == (
        "rope", "swiglu", "rmsnorm", True, False)
    assert "Searched plan: 8 ranks, 32 layers" in text
    # the eleven Megatron flags it replaces give the same model
    assert _cli_config("--hf-config", path) == _flags_config(
        "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
        "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "14336",
        "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--rotary-base",
        "500000", "--vocab-size", "128256", "--seq-length", "8192", "--max-position-embeddings",
        "8192", "--norm-epsilon", "1e-5", "--hidden-dropout", "0", "--attention-dropout", "0")


COMMON = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
          "--vocab-size", "1000")


@pytest.mark.parametrize("name, make, flags", [
    ("gpt2", lambda: transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128,
                                             vocab_size=1000, bos_token_id=0, eos_token_id=0),
     COMMON + ("--ffn-hidden-size", "256", "--seq-length", "128", "--max-position-embeddings",
               "128", "--openai-gelu", "--norm-epsilon", "1e-5")),
    ("llama", lambda: transformers.LlamaConfig(**SMALL_LLAMA, tie_word_embeddings=True),
     COMMON + ("--ffn-hidden-size", "96", "--seq-length", "256", "--max-position-embeddings",
               "256", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
               "rope", "--rotary-base", "5000", "--disable-bias-linear", "--group-query-attention",
               "--num-query-groups", "2", "--norm-epsilon", "1e-6", "--hidden-dropout", "0",
               "--attention-dropout", "0")),
    ("mistral", lambda: transformers.MistralConfig(**SMALL_LLAMA, sliding_window=None),
     COMMON + ("--ffn-hidden-size", "96", "--seq-length", "256", "--max-position-embeddings",
               "256", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
               "rope", "--rotary-base", "5000", "--disable-bias-linear", "--group-query-attention",
               "--num-query-groups", "2", "--norm-epsilon", "1e-6", "--hidden-dropout", "0",
               "--attention-dropout", "0", "--untie-embeddings-and-output-weights")),
    ("qwen2", lambda: transformers.Qwen2Config(**SMALL_LLAMA, tie_word_embeddings=True),
     COMMON + ("--ffn-hidden-size", "96", "--seq-length", "256", "--max-position-embeddings",
               "256", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
               "rope", "--rotary-base", "5000", "--disable-bias-linear", "--add-qkv-bias",
               "--group-query-attention", "--num-query-groups", "2", "--norm-epsilon", "1e-6",
               "--hidden-dropout", "0", "--attention-dropout", "0")),
    ("megatron-bert", lambda: transformers.MegatronBertConfig(**SMALL),
     COMMON + ("--model-type", "bert", "--ffn-hidden-size", "128", "--seq-length", "128",
               "--max-position-embeddings", "128", "--norm-epsilon", "1e-12")),
    ("t5", lambda: transformers.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                         num_decoder_layers=3, num_heads=4, vocab_size=1000,
                                         feed_forward_proj="gated-silu"),
     ("--model-type", "t5", "--encoder-num-layers", "2", "--decoder-num-layers", "3",
      "--hidden-size", "64", "--num-attention-heads", "4", "--kv-channels", "16",
      "--ffn-hidden-size", "128", "--vocab-size", "1000", "--swiglu", "--normalization",
      "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "relative",
      "--norm-epsilon", "1e-6", "--hidden-dropout", "0.1", "--attention-dropout", "0.1")),
    ("vit", lambda: transformers.ViTConfig(**{k: v for k, v in SMALL.items()
                                              if k not in ("max_position_embeddings",
                                                           "vocab_size")},
                                           image_size=32, patch_size=4, num_labels=10),
     ("--model-type", "vit", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
      "4", "--ffn-hidden-size", "128", "--img-h", "32", "--img-w", "32", "--patch-dim", "4",
      "--num-classes", "10", "--norm-epsilon", "1e-12", "--hidden-dropout", "0",
      "--attention-dropout", "0")),
    ("swin", lambda: transformers.SwinConfig(image_size=32, patch_size=2, embed_dim=16,
                                             depths=[2, 2], num_heads=[2, 4], window_size=4,
                                             num_labels=10, drop_path_rate=0.0),
     ("--model-type", "swin", "--img-h", "32", "--img-w", "32", "--patch-dim", "2",
      "--num-classes", "10", "--swin-embed-dim", "16", "--swin-depths", "2,2",
      "--swin-num-heads", "2,4", "--swin-window-size", "4", "--norm-epsilon", "1e-5",
      "--hidden-dropout", "0", "--attention-dropout", "0")),
])
def test_each_architecture_is_its_megatron_flags(tmp_path, name, make, flags):
    path = _save(tmp_path, name, make())
    assert _cli_config("--hf-config", path) == _flags_config(*flags)


def test_typed_flags_override_the_file(tmp_path):
    path = _save(tmp_path, "llama", transformers.LlamaConfig(**SMALL_LLAMA))
    cfg = _cli_config("--hf-config", path, "--num-layers", "4", "--seq-length", "64")
    assert (cfg.num_layers, cfg.seq_length, cfg.max_position_embeddings, cfg.hidden_size) == (
        4, 64, 256, 64)


def test_mixtral_config_becomes_the_moe_flags(tmp_path):
    """Mixtral's expert fields on Megatron's MoE flags (every layer MoE, no biases)."""
    path = _save(tmp_path, "mixtral", transformers.MixtralConfig(
        **SMALL_LLAMA, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02))
    config = _cli_config("--hf-config", path)
    assert config.moe is not None and not config.add_bias_linear
    assert (config.moe.num_experts, config.moe.router_topk, config.moe.aux_loss_coeff) == (4, 2,
                                                                                            0.02)
    assert config.moe_layers == tuple(range(config.num_layers))
    assert config.expert_ffn_hidden_size == SMALL_LLAMA["intermediate_size"]


@pytest.mark.parametrize("make, message", [
    (lambda: transformers.LlamaConfig(**SMALL_LLAMA | {"max_position_embeddings": 16384},
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                    "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192}),
     "rope_parameters.rope_type='llama3': rope scaling is not implemented"),
    (lambda: transformers.LlamaConfig(**SMALL_LLAMA, hidden_act="gelu"),
     "hidden_act='gelu': our SwiGLU gates with SiLU"),
    (lambda: transformers.LlamaConfig(**SMALL_LLAMA, head_dim=32),
     "head_dim=32: our heads are hidden_size / num_attention_heads = 16 wide"),
    (lambda: transformers.LlamaConfig(**SMALL_LLAMA, attention_bias=True),
     "mlp_bias=False: --disable-bias-linear drops the biases of all four projections together"),
    (lambda: transformers.MistralConfig(**SMALL_LLAMA, sliding_window=128),
     "sliding_window=128: sliding-window attention is not modelled (our layers attend every "
     "earlier token), which is the same model only up to 128 tokens; give --seq-length 128 or "
     "less (now 256)"),
    (lambda: transformers.Qwen2Config(**SMALL_LLAMA, use_sliding_window=True, sliding_window=64,
                                      max_window_layers=0),
     "sliding_window=64: sliding-window attention is not modelled"),
    (lambda: transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, add_cross_attention=True),
     "add_cross_attention=True: a decoder with cross-attention is not a GPT"),
    (lambda: _untied(transformers.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                           num_heads=4)),
     "tie_word_embeddings=False: our T5 ties its LM head"),
    (lambda: transformers.SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2],
                                     num_heads=[2, 4], window_size=4, mlp_ratio=2.0),
     "mlp_ratio=2.0: our Swin MLP is 4x its width"),
    (lambda: transformers.GemmaConfig(num_hidden_layers=2, hidden_size=64,
                                      num_attention_heads=4, intermediate_size=96),
     "model_type='gemma' is not a model megatron_auto reads; known: bert, gpt2, llama"),
])
def test_what_we_do_not_model_is_one_line_naming_the_field(tmp_path, capsys, make, message):
    path = _save(tmp_path, "m", make())
    code = main(["evaluate", "--hf-config", path, "--cluster", "a100-40g-1x8",
                 "--global-batch-size", "8"])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and f"--hf-config={path}" in err, err
    assert err.count("\n") == 1


def _untied(config):
    config.tie_word_embeddings = False  # T5Config's constructor keeps it tied (T5 v1.1 files set it)
    return config


def test_a_shorter_sequence_makes_a_sliding_window_config_plannable(tmp_path, capsys):
    path = _save(tmp_path, "mistral", transformers.MistralConfig(**SMALL_LLAMA,
                                                                 sliding_window=128))
    assert main(["evaluate", "--hf-config", path, "--seq-length", "128", "--cluster",
                 "a100-40g-1x8", "--global-batch-size", "8"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("setup, message", [
    (lambda d: d, "(the directory has no config.json)"),
    (lambda d: os.path.join(d, "missing.json"), ": no such file"),
    (lambda d: _write(d, "bad.json", "{\"model_type\": "), "not valid JSON"),
    (lambda d: _write(d, "nokind.json", json.dumps({"hidden_size": 4})),
     "not a Hugging Face model config (no 'model_type' key)"),
])
def test_files_that_cannot_be_read(tmp_path, capsys, setup, message):
    path = setup(str(tmp_path))
    assert main(["evaluate", "--hf-config", path, "--cluster", "a100-40g-1x8"]) == 2
    assert message in capsys.readouterr().err


def _write(d: str, name: str, text: str) -> str:
    path = os.path.join(d, name)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


def test_model_type_must_agree_with_the_file(tmp_path, capsys):
    path = _save(tmp_path, "llama", transformers.LlamaConfig(**SMALL_LLAMA))
    assert main(["evaluate", "--hf-config", path, "--model-type", "bert", "--cluster",
                 "a100-40g-1x8"]) == 2
    assert ("--model-type=bert: --hf-config=" in (err := capsys.readouterr().err)
            and "is a llama model (model type gpt); drop --model-type" in err)


def test_cost_only_substitutions_plan_with_a_warning_and_do_not_train(tmp_path):
    """BERT's post-LayerNorm, T5's ReLU: priced as ours by the planning commands (a warning),
    refused by the training scripts (they would train another model)."""
    path = _save(tmp_path, "bert", transformers.BertConfig(**SMALL))
    with pytest.warns(FlagWarning, match=r"model_type='bert': priced as Megatron's "
                                         r"pre-LayerNorm BERT"):
        assert _cli_config("--hf-config", path) == _flags_config(
            *COMMON, "--model-type", "bert", "--ffn-hidden-size", "128", "--seq-length", "128",
            "--max-position-embeddings", "128", "--norm-epsilon", "1e-12")
    with pytest.raises(HFConfigError, match=r"model_type='bert': not in our models \(Megatron's "
                                            r"pre-LayerNorm BERT \(megatron-bert\) is the "
                                            r"closest"):
        hf_flags(path, training=True)
    t5 = _save(tmp_path, "t5", transformers.T5Config(d_model=64, d_kv=16, d_ff=128,
                                                     num_layers=2, num_heads=4))
    with pytest.warns(FlagWarning, match="feed_forward_proj='relu': priced as a GeLU MLP"):
        assert not _cli_config("--hf-config", t5).activation == "swiglu"


def _read(args, given, dests):
    apply_hf_config(args, given, dests, training=True)


def test_the_training_scripts_read_it_and_typed_flags_win(tmp_path):
    path = _save(tmp_path, "llama", transformers.LlamaConfig(**SMALL_LLAMA))
    run = arguments.parse_run_config(["--hf-config", path, "--mock-data", "--seq-length", "32"],
                                     read_model_file=_read)
    assert run.model == arguments.parse_run_config(
        [*COMMON, "--ffn-hidden-size", "96", "--seq-length", "32", "--max-position-embeddings",
         "256", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--rotary-base", "5000", "--disable-bias-linear", "--group-query-attention",
         "--num-query-groups", "2", "--norm-epsilon", "1e-6", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--untie-embeddings-and-output-weights",
         "--mock-data"]).model
    with pytest.raises(arguments.ArgumentError, match="--hf-config=.*: this entry point cannot"):
        arguments.parse_run_config(["--hf-config", path])


def test_pretrain_gpt_trains_from_a_config_file(tmp_path, capsys):
    import pretrain_gpt

    path = _save(tmp_path, "llama", transformers.LlamaConfig(**SMALL_LLAMA))
    argv = ["--hf-config", path, "--mock-data", "--seq-length", "32", "--train-iters", "2",
            "--global-batch-size", "2", "--micro-batch-size", "1", "--log-interval", "1",
            "--eval-iters", "0"]
    assert pretrain_gpt.main(argv) == 0, capsys.readouterr().err
    assert "lm loss:" in capsys.readouterr().out
    # a config of another family names the script that trains it
    t5 = _save(tmp_path, "t5", transformers.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                     num_heads=4, feed_forward_proj="gated-silu"))
    assert pretrain_gpt.main(["--hf-config", t5, "--mock-data"]) == 2
    assert "a t5 model (t5); this script trains gpt: use pretrain_t5.py" in \
        capsys.readouterr().err
