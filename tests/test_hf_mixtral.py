"""Mixtral (mixture of experts) through tools/checkpoint/convert.py, both ways.

A tiny random ``MixtralForCausalLM`` (transformers' own config and model class, built here, no
download: 2 layers, 4 heads over 2 key/value heads, 4 SwiGLU experts of width 24, top-2
routing, untied head, every parameter drawn at random) is saved, imported with the tool and
loaded into our GPT with MoE layers in a forked one-rank world: our logits equal transformers'
(fp32, max |ours - theirs| / max |theirs| <= 1e-5; measured 3.8e-7). The import is exported
back (``--hf-architecture`` auto picks Mixtral for an MoE model): ``from_pretrained`` finds every
weight, each tensor is bit-identical to the original and the logits are the same. Swapping the
gate and up halves of the experts' mapping makes the comparison fail (checked when written:
relative difference 0.90).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from test_hf_convert import REL, SEQ, VOCAB, convert_main, ours, randomise, read_config, \
    rel_diff, tokens

pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers is not installed (the test extra has it)")]


def mixtral(seed: int = 3):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=SEQ, rms_norm_eps=1e-6,
                           tie_word_embeddings=False, attention_dropout=0.0)
    return randomise(MixtralForCausalLM(config), seed)


def test_mixtral_round_trip_gives_the_same_logits(tmp_path, capsys):
    from transformers import MixtralForCausalLM

    model = mixtral()
    hf_dir, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    model.save_pretrained(hf_dir)
    inputs = {"tokens": tokens(1)}
    with torch.no_grad():
        theirs = model(input_ids=inputs["tokens"]).logits
    main = convert_main()
    assert main(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron",
                 "--load-dir", hf_dir, "--save-dir", ckpt]) == 0
    out = capsys.readouterr().out
    assert "--num-experts 4" in out and "--moe-router-topk 2" in out, out
    config = read_config(ckpt)
    assert (config.moe.num_experts, config.moe.router_topk, config.ffn_hidden_size) == (4, 2, 24)
    logits = ours(ckpt, config, inputs)["logits"][..., :VOCAB]
    assert rel_diff(logits, theirs) <= REL

    assert main(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf",
                 "--load-dir", ckpt, "--save-dir", back]) == 0
    assert "as mixtral" in capsys.readouterr().out
    again, info = MixtralForCausalLM.from_pretrained(back, dtype=torch.float32,
                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    original = model.state_dict()
    for name, value in again.state_dict().items():
        torch.testing.assert_close(value, original[name], rtol=0, atol=0, msg=name)
    with torch.no_grad():
        assert rel_diff(again.eval()(input_ids=inputs["tokens"]).logits, theirs) == 0.0


def test_mixtral_fields_we_do_not_model_are_one_line(tmp_path, capsys):
    model = mixtral()
    model.config.router_jitter_noise = 0.1
    hf_dir = str(tmp_path / "hf")
    model.save_pretrained(hf_dir)
    main = convert_main()
    assert main(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron",
                 "--load-dir", hf_dir, "--save-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: the Hugging Face config has router_jitter_noise=0.1: our router adds "
                   "no input jitter"), err
    assert not os.path.exists(tmp_path / "c" / "latest_checkpointed_iteration.txt")
