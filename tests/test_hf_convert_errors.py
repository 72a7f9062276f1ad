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
    # issue 30 case 10: the position table comes from the checkpoint, not from a flag
    (["--seq-length", "32"], "--seq-length=32: the Hugging Face checkpoint {d} has "
                             "n_positions=16 (its position table, which the model cannot "
                             "exceed); give --seq-length 16 or less"),
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
    assert "nothing to convert; one of them must be megatron" in run(same, capsys)  # case 8
    same[same.index("hf", same.index("--loader"))] = "megatron"
    same[same.index("hf", same.index("--saver"))] = "megatron"
    assert "--loader=megatron --saver=megatron: nothing to convert; one of them must be hf" in \
        run(same, capsys)
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


# ----------------------------------------------------------------- issue 30, cases 2-9
def export_args(ckpt, out, *flags):
    return ["--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir",
            str(ckpt), "--save-dir", str(out), *flags]


def convert(argv, capsys):
    """(exit status, stderr lines) of one convert.py run."""
    spec = importlib.util.spec_from_file_location("convert_tool", CONVERT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = module.main(argv)
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _damaged_copy(gpt2_dir, path, **files):
    """A copy of the GPT-2 directory with some files replaced (bytes) or removed (None)."""
    import shutil
    shutil.copytree(gpt2_dir, path)
    for name, data in files.items():
        name = name.replace("__", ".")
        if data is None:
            os.remove(path / name)
        else:
            (path / name).write_bytes(data)
    return path


@needs_transformers
def test_damaged_hf_directories_are_one_line(gpt2_dir, tmp_path, capsys):
    """Cases 3-6: a truncated safetensors or pickle file, an empty config.json, a directory
    without weights: one line naming the file and the fix, nothing written."""
    weights = (gpt2_dir / "model.safetensors").read_bytes()
    cases = {
        "truncated safetensors": (dict(model__safetensors=weights[:100]),
                                  "cannot read the weights model.safetensors (SafetensorError"),
        "empty config": (dict(config__json=b""), "config.json: not valid JSON (line 1, "
                                                 "column 1"),
        "config, no weights": (dict(model__safetensors=None),
                               "config.json but no weights there (none of model.safetensors"),
    }
    from transformers import GPT2LMHeadModel
    state = GPT2LMHeadModel.from_pretrained(gpt2_dir).state_dict()
    pickled = tmp_path / "full.bin"
    torch.save(state, pickled)
    data = pickled.read_bytes()
    cases["truncated pytorch_model.bin"] = (
        dict(model__safetensors=None, pytorch_model__bin=data[:len(data) // 2]),
        "cannot read the weights pytorch_model.bin (")
    for name, (files, message) in cases.items():
        bad = _damaged_copy(gpt2_dir, tmp_path / name.replace(" ", "_"), **files)
        err = run(import_args(bad, tmp_path), capsys)
        assert f"error: --load-dir={bad}: " in err and message in err, (name, err)
        assert not (tmp_path / "ckpt").exists(), name


@needs_transformers
def test_unwritable_save_dir_is_refused_before_reading(gpt2_dir, tmp_path, capsys):
    """Case 7: import and export to a --save-dir that is a file or cannot be created."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    bad_dirs = {str(a_file): "is a file, not a directory",
                str(a_file / "sub"): "cannot create the directory"}
    if os.path.isdir("/proc"):
        bad_dirs["/proc/megatron_auto_test"] = "cannot create the directory (/proc:"
    ckpt = tmp_path / "ckpt"
    assert convert(import_args(gpt2_dir, tmp_path), capsys)[0] == 0
    for path, message in bad_dirs.items():
        args = import_args(gpt2_dir, tmp_path)
        args[args.index(str(ckpt))] = path
        assert f"error: --save-dir={path}: {message}" in run(args, capsys)
        assert f"error: --save-dir={path}: {message}" in run(export_args(ckpt, path), capsys)
    assert a_file.read_text() == "x"


@needs_transformers
def test_export_never_replaces_a_model_without_overwrite(gpt2_dir, tmp_path, capsys):
    """Case 2: an export into a directory that already holds an HF model is refused and
    leaves every file as it was; --overwrite writes it."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    assert convert(import_args(gpt2_dir, tmp_path), capsys)[0] == 0
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    (out / "model.safetensors").write_bytes(b"my weights")
    (out / "tokenizer.json").write_text("{}")
    err = run(export_args(ckpt, out), capsys)
    assert f"--save-dir={out}: the directory is not empty (config.json and 2 more); add " \
           f"--overwrite to write into it, or choose a new directory" in err
    assert (out / "config.json").read_text() == '{"mine": true}'
    assert (out / "model.safetensors").read_bytes() == b"my weights"
    code, lines = convert(export_args(ckpt, out, "--overwrite"), capsys)
    assert code == 0, lines
    from transformers import GPT2LMHeadModel
    GPT2LMHeadModel.from_pretrained(out)  # our model now, the other file kept
    assert (out / "tokenizer.json").read_text() == "{}"


@needs_transformers
def test_import_overwrite_replaces_a_conversion_only(gpt2_dir, tmp_path, capsys):
    """An import into a directory with a checkpoint: refused; with --overwrite an earlier
    conversion is replaced, a training run's checkpoint never is."""
    import json

    ckpt = tmp_path / "ckpt"
    assert convert(import_args(gpt2_dir, tmp_path), capsys)[0] == 0
    assert "add --overwrite to replace an earlier conversion" in run(
        import_args(gpt2_dir, tmp_path), capsys)
    code, lines = convert(import_args(gpt2_dir, tmp_path, "--overwrite"), capsys)
    assert code == 0, lines
    info_path = ckpt / "iter_0000000" / "checkpoint_info.json"
    info = json.loads(info_path.read_text())
    info.update(weights_only=False)  # as a training run's would be
    info_path.write_text(json.dumps(info))
    before = sorted(p.name for p in (ckpt / "iter_0000000").iterdir())
    err = run(import_args(gpt2_dir, tmp_path, "--overwrite"), capsys)
    assert "holds a training run's checkpoint (iteration 0), which --overwrite never replaces" \
        in err
    assert sorted(p.name for p in (ckpt / "iter_0000000").iterdir()) == before


@needs_transformers
def test_export_with_no_architecture_for_the_combination(tmp_path, capsys):
    """Case 9: GQA with learned positions fits neither GPT-2 nor LLaMA: each architecture's
    message names both blocking fields instead of pointing at the other."""
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                         vocab_size=60, num_query_groups=2)
    ckpt = tmp_path / "ckpt"
    write_weights_checkpoint(ckpt, config, {"final_norm.weight": torch.ones(32)})
    for arch, first, second in (
            ("auto", "num_query_groups=2: GPT-2 has one key/value head per head",
             "LLaMA cannot hold it either (position_embedding_type=learned"),
            ("llama", "position_embedding_type=learned: LLaMA uses rotary embeddings",
             "GPT-2 cannot hold it either (num_query_groups=2")):
        err = run(export_args(ckpt, tmp_path / "out", "--hf-architecture", arch), capsys)
        assert first in err and second in err, err
        assert "no Hugging Face architecture here holds this combination" in err
        assert "use --hf-architecture" not in err
    assert not (tmp_path / "out").exists()


@needs_transformers
def test_export_only_flag_on_an_import_warns(gpt2_dir, tmp_path, capsys):
    code, lines = convert(import_args(gpt2_dir, tmp_path, "--hf-architecture", "llama"), capsys)
    assert code == 0
    assert lines == ["warning: --hf-architecture=llama: applies to an export (--loader "
                     "megatron); an import takes the architecture from the Hugging Face "
                     "config.json"]
