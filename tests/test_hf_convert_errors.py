"""tools/checkpoint/convert.py on bad input: one line naming what is wrong and the fix, exit 2.

An HF config that disagrees with the model flags, HF models our models cannot represent, an
export to an architecture that cannot hold the model, a missing ``transformers``, and flag
mistakes. Everything runs in this process (no process group: DCP's single-process mode).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from megatron_auto.config import ModelConfig
from megatron_auto.conversion.checkpoint_files import write_weights_checkpoint

pytestmark = pytest.mark.single

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS,
                                        reason="transformers is not installed (the test extra "
                                               "has it)")
CONVERT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "tools", "checkpoint", "convert.py")


def run(argv, capsys) -> str:
    spec = importlib.util.spec_from_file_location("convert_tool", CONVERT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def import_args(hf_dir, tmp_path, *flags):
    return ["--model-type", "GPT", "--loader", "hf", "--saver", "megatron", "--load-dir",
            str(hf_dir), "--save-dir", str(tmp_path / "ckpt"), *flags]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    if not HAS_TRANSFORMERS:
        pytest.skip("transformers is not installed")
    from transformers import GPT2Config, GPT2LMHeadModel
    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(GPT2Config(vocab_size=60, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                               bos_token_id=None, eos_token_id=None)).save_pretrained(path)
    return path


def llama_dir(tmp_path, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM
    kwargs = dict(vocab_size=60, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    kwargs.update(overrides)
    LlamaForCausalLM(LlamaConfig(**kwargs)).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


@needs_transformers
@pytest.mark.parametrize("flags, message", [
    (["--num-layers", "3"], "--num-layers=3: the Hugging Face checkpoint {d} has n_layer=2; "
                            "drop the flag or set it to match the checkpoint"),
    (["--hidden-size", "64"], "--hidden-size=64: the Hugging Face checkpoint {d} has n_embd=32"),
    (["--swiglu"], "--swiglu=True: the Hugging Face checkpoint {d} has "
                   "activation_function='gelu_new'"),
    (["--disable-bias-linear"], "--disable-bias-linear=True: the Hugging Face checkpoint {d} "
                                "has add_bias_linear=True"),
    (["--position-embedding-type", "rope"], "--position-embedding-type=rope: the Hugging Face "
                                            "checkpoint {d} has position_embedding_type='learned'"),
    (["--vocab-size", "50"], "--vocab-size=50: the Hugging Face checkpoint {d} has "
                             "vocab_size=60"),
    (["--group-query-attention"], "--num-query-groups=1: the Hugging Face checkpoint {d} has "
                                  "n_head=4"),
    (["--num-query-groups", "2"], "--num-query-groups=2: needs --group-query-attention"),
    (["--seq-length", "32"], "--max-position-embeddings=16: must be at least --seq-length=32"),
])
def test_flags_that_disagree_with_the_hf_config(gpt2_dir, tmp_path, capsys, flags, message):
    err = run(import_args(gpt2_dir, tmp_path, *flags), capsys)
    assert message.format(d=gpt2_dir) in err
    assert not (tmp_path / "ckpt").exists()  # nothing written


@needs_transformers
def test_llama_flags_and_unsupported_configs(tmp_path, capsys):
    path = llama_dir(tmp_path)
    err = run(import_args(path, tmp_path, "--group-query-attention", "--num-query-groups", "4"),
              capsys)
    assert "--num-query-groups=4: the Hugging Face checkpoint" in err
    assert "has num_key_value_heads=2" in err
    tied = llama_dir(tmp_path / "t", tie_word_embeddings=True)
    err = run(import_args(tied, tmp_path, "--untie-embeddings-and-output-weights"), capsys)
    assert "--untie-embeddings-and-output-weights=True: the Hugging Face checkpoint" in err
    assert "has tie_word_embeddings=True" in err
    gelu = llama_dir(tmp_path / "g", hidden_act="gelu")
    assert "has hidden_act='gelu': our SwiGLU gates with SiLU" in run(
        import_args(gelu, tmp_path), capsys)
    scaled = llama_dir(tmp_path / "r", rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert "has rope_type='linear': only unscaled rotary embeddings convert" in run(
        import_args(scaled, tmp_path), capsys)
    biased = llama_dir(tmp_path / "b", attention_bias=True, mlp_bias=False)
    assert "has mlp_bias=False: --disable-bias-linear drops all four projections' biases" in run(
        import_args(biased, tmp_path), capsys)


@needs_transformers
def test_wrong_model_type_and_direction(gpt2_dir, tmp_path, capsys):
    args = import_args(gpt2_dir, tmp_path)
    args[1] = "BERT"
    assert "--model-type=BERT:" in run(args, capsys) and "pass --model-type GPT" in run(
        args, capsys)
    same = ["--model-type", "GPT", "--loader", "hf", "--saver", "hf", "--load-dir",
            str(gpt2_dir), "--save-dir", str(tmp_path / "x")]
    assert "nothing to convert" in run(same, capsys)
    assert "no config.json there" in run(import_args(tmp_path, tmp_path), capsys)
    write_weights_checkpoint(tmp_path / "ckpt", ModelConfig(), {})
    assert f"--save-dir={tmp_path / 'ckpt'}: already holds a checkpoint" in run(
        import_args(gpt2_dir, tmp_path), capsys)


@needs_transformers
def test_export_to_an_architecture_that_cannot_hold_the_model(tmp_path, capsys):
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                         vocab_size=60, position_embedding_type="rope", activation="swiglu",
                         normalization="rmsnorm", num_query_groups=2)
    ckpt = tmp_path / "ckpt"
    write_weights_checkpoint(ckpt, config, {"final_norm.weight": torch.ones(32)})
    export = ["--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir",
              str(ckpt), "--save-dir", str(tmp_path / "out")]
    err = run(export + ["--hf-architecture", "gpt2"], capsys)
    assert "--hf-architecture=gpt2: the checkpoint's model has position_embedding_type=rope: " \
           "GPT-2 learns positions; use --hf-architecture llama" in err
    err = run(export + ["--hf-architecture", "megatron-bert"], capsys)
    assert "model_type=gpt: Megatron-BERT is an encoder" in err
    # the model config asks for weights the checkpoint does not have
    assert "the checkpoint lacks parameter 'embedding.word_embeddings.weight'" in run(
        export, capsys)
    assert "model flags apply to an import" in run(export + ["--num-layers", "2"], capsys)
    empty = export.copy()
    empty[empty.index(str(ckpt))] = str(tmp_path / "none")
    assert f"--load-dir={tmp_path / 'none'}: holds no checkpoint" in run(empty, capsys)
    assert not (tmp_path / "out").exists()


def test_missing_transformers_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    err = run(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron", "--load-dir",
               str(tmp_path), "--save-dir", str(tmp_path / "ckpt")], capsys)
    assert "Hugging Face conversion needs the `transformers` package, which is not installed; " \
           "pip install 'transformers>=5.0,<6'" in err


def test_loading_a_converted_model_with_other_flags_names_the_flag(tmp_path):
    """``--load`` of an imported LLaMA under flags that forget an option stops naming it."""
    import dataclasses

    from megatron_auto.training.checkpoint import CheckpointError, check_model_matches, read_info

    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                         vocab_size=60, num_query_groups=2, add_bias_linear=False,
                         openai_gelu=True)
    write_weights_checkpoint(tmp_path, config, {"final_norm.weight": torch.ones(32)})
    saved = read_info(tmp_path)[1]["model"]
    check_model_matches(saved, config, str(tmp_path))  # the same flags load
    for change, flag in ((dict(num_query_groups=None), "--group-query-attention "
                          "--num-query-groups"), (dict(add_bias_linear=True),
                                                  "--disable-bias-linear"),
                         (dict(openai_gelu=False), "--openai-gelu")):
        with pytest.raises(CheckpointError, match=f"set {flag} to match the checkpoint"):
            check_model_matches(saved, dataclasses.replace(config, **change), str(tmp_path))
