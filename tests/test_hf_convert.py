"""tools/checkpoint/convert.py both ways against tiny, randomly initialised ``transformers`` models.

Each test builds a GPT-2, LLaMA (grouped-query attention, untied, no biases, RoPE base 5000)
or Megatron-BERT model from a config written here (no download), with every parameter drawn at
random (the HF init leaves biases at 0 and norms at 1, which would hide a swapped mapping).
It imports the model with the command-line tool, loads the checkpoint into our model in a
forked one-rank world through ``load_checkpoint`` and compares the logits in fp32: relative
difference (max |ours - theirs| / max |theirs|) at most 1e-5. It then exports our checkpoint
back and checks that ``from_pretrained`` finds every weight and reproduces the original
tensors and logits. The last test trains a step from the imported LLaMA under a 4-rank plan
(two stages, TP 2 splitting the key/value groups, ZeRO-3 and ZeRO-1 layers), saves, and exports
that checkpoint: the exported model's logits match ours computed from the same checkpoint.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from dist_utils import run_distributed
from megatron_auto.config import ModelConfig
from megatron_auto.plan import LayerStrategy, PipelineSpec, Plan, VocabStrategy

pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers is not installed (the test extra has it)")]

CONVERT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "tools", "checkpoint", "convert.py")
VOCAB, SEQ, BATCH = 60, 16, 4
REL = 1e-5


def convert_main():
    spec = importlib.util.spec_from_file_location("convert_tool", CONVERT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(1.0 + noise if "norm" in name.lower() or name.endswith("ln.weight")
                    or "ln_" in name and name.endswith("weight") else noise)
    return model.eval()


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def one_rank_plan(num_layers: int) -> dict:
    return Plan(world_size=1, global_batch_size=BATCH, num_microbatches=1,
                pipeline=PipelineSpec(1, "1f1b", (num_layers,)), vocab=VocabStrategy(),
                layers=(LayerStrategy(),) * num_layers).to_dict()


def _our_outputs(rank, world_size, ckpt, config_dict, plan_dict, inputs, train_and_save):
    """Load ``ckpt`` into our model under ``plan_dict``; optionally train a step and save to
    ``train_and_save``; on one rank return the logits (and BERT's binary-head logits)."""
    from megatron_auto.models.bert import BertStage
    from megatron_auto.models.gpt import GPTStage
    from megatron_auto.parallel.optimizer import OptimizerConfig
    from megatron_auto.training.checkpoint import load_checkpoint, save_checkpoint
    from megatron_auto.training.trainer import build_trainer, train_step

    config = ModelConfig.from_dict(config_dict)
    stage_cls = BertStage if config.model_type == "bert" else GPTStage
    trainer = build_trainer(config, Plan.from_dict(plan_dict),
                            lambda cfg, ctx, seed: stage_cls(cfg, ctx, seed=seed),
                            optimizer_config=OptimizerConfig(clip_grad=1.0), seed=7)
    load_checkpoint(trainer, ckpt)
    if train_and_save:
        ids = inputs["tokens"]
        batch = {"tokens": ids, "labels": ids.roll(-1, dims=1),
                 "loss_mask": torch.ones(ids.shape), "position_ids":
                 torch.arange(ids.shape[1]).expand(ids.shape[0], -1).contiguous()}
        train_step(trainer, batch)
        save_checkpoint(trainer, train_and_save)
        return None
    stage = trainer.stage.eval()
    with torch.no_grad():
        emb = stage.embedding
        hidden = emb.embed(inputs["tokens"], None, inputs.get("types"))
        hidden, _ = stage.run_layers(hidden, stage.vocab_groups, None, inputs.get("padding"))
        hidden = stage.final_norm(hidden)
        if config.model_type == "bert":
            logits = stage.lm_head(hidden, emb)
            sop = stage.binary_head(torch.tanh(stage.pooler(hidden[:, 0])))
            return {"logits": logits, "sop": sop}
        head = getattr(stage, "output_layer", None)
        return {"logits": head(hidden) if head is not None else emb.logits(hidden)}


def ours(ckpt: str, config: ModelConfig, inputs: dict) -> dict:
    return run_distributed(_our_outputs, 1, ckpt, config.to_dict(),
                           one_rank_plan(config.num_layers), inputs, None)[0]


def read_config(ckpt: str) -> ModelConfig:
    from megatron_auto.training.checkpoint import read_info
    return ModelConfig.from_dict(read_info(ckpt)[1]["model"])


def hf_logits(model, inputs: dict) -> dict:
    with torch.no_grad():
        if "types" in inputs:
            out = model(input_ids=inputs["tokens"], token_type_ids=inputs["types"],
                        attention_mask=inputs["padding"])
            return {"logits": out.prediction_logits, "sop": out.seq_relationship_logits}
        return {"logits": model(input_ids=inputs["tokens"]).logits}


def round_trip(tmp_path, model, inputs: dict, model_type: str, flags=()) -> tuple[dict, ModelConfig]:
    """HF -> ours -> HF; returns the relative differences and our config."""
    main = convert_main()
    hf_in, ckpt, hf_out = (str(tmp_path / n) for n in ("hf_in", "ckpt", "hf_out"))
    model.save_pretrained(hf_in)
    assert main(["--model-type", model_type, "--loader", "hf", "--saver", "megatron",
                 "--load-dir", hf_in, "--save-dir", ckpt, *flags]) == 0
    config = read_config(ckpt)
    theirs = hf_logits(model, inputs)
    mine = ours(ckpt, config, inputs)
    diffs = {k: rel_diff(mine[k][..., :VOCAB] if k == "logits" else mine[k], theirs[k])
             for k in theirs}
    assert main(["--model-type", model_type, "--loader", "megatron", "--saver", "hf",
                 "--load-dir", ckpt, "--save-dir", hf_out]) == 0
    back, info = type(model).from_pretrained(hf_out, dtype=torch.float32,
                                             output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    original = model.state_dict()
    for name, value in back.state_dict().items():
        torch.testing.assert_close(value, original[name], rtol=0, atol=0, msg=name)
    again = hf_logits(back.eval(), inputs)
    diffs.update({f"{k} after export": rel_diff(again[k], theirs[k]) for k in theirs})
    return diffs, config


def test_gpt2_round_trip(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = randomise(GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, n_inner=48,
        activation_function="gelu_new", bos_token_id=None, eos_token_id=None)), 1)
    diffs, config = round_trip(tmp_path, model, {"tokens": tokens()}, "GPT")
    assert config.openai_gelu and config.add_bias_linear and config.position_embedding_type == \
        "learned" and not config.untie_embeddings_and_output_weights
    assert max(diffs.values()) <= REL, diffs


def llama(seed: int = 1):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return randomise(LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)), seed)


def test_llama_round_trip_with_grouped_query_attention(tmp_path):
    flags = ["--seq-length", str(SEQ), "--group-query-attention", "--num-query-groups", "2",
             "--swiglu", "--disable-bias-linear"]  # flags that agree with the config pass
    diffs, config = round_trip(tmp_path, llama(), {"tokens": tokens()}, "GPT", flags)
    assert (config.query_groups, config.rotary_base, config.add_bias_linear) == (2, 5000.0, False)
    assert config.untie_embeddings_and_output_weights and config.normalization == "rmsnorm"
    assert max(diffs.values()) <= REL, diffs


def test_megatron_bert_round_trip(tmp_path):
    from transformers import MegatronBertConfig, MegatronBertForPreTraining
    torch.manual_seed(0)
    model = randomise(MegatronBertForPreTraining(MegatronBertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=SEQ, type_vocab_size=2)), 1)
    padding = torch.ones(BATCH, SEQ, dtype=torch.long)
    padding[1, 10:] = 0
    padding[3, 5:] = 0
    types = (torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, -1).contiguous()
    diffs, config = round_trip(tmp_path, model, {"tokens": tokens(), "types": types,
                                                 "padding": padding}, "BERT")
    assert config.model_type == "bert" and config.num_tokentypes == 2 and config.bert_binary_head
    assert max(diffs.values()) <= REL, diffs


def test_checkpoint_of_a_parallel_plan_exports(tmp_path):
    main = convert_main()
    hf_in, ckpt, trained, hf_out = (str(tmp_path / n) for n in ("in", "ckpt", "trained", "out"))
    llama().save_pretrained(hf_in)
    assert main(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron", "--load-dir",
                 hf_in, "--save-dir", ckpt]) == 0
    config = read_config(ckpt)
    layers = (LayerStrategy(tp=2, dp_mode="zero3"), LayerStrategy(tp=1, dp_mode="zero2"))
    plan = Plan(world_size=4, global_batch_size=BATCH, num_microbatches=2,
                pipeline=PipelineSpec(2, "1f1b", (1, 1)),
                vocab=VocabStrategy(tp=2, dp_mode="zero1"), layers=layers).to_dict()
    inputs = {"tokens": tokens(3)}
    run_distributed(_our_outputs, 4, ckpt, config.to_dict(), plan, inputs, trained)
    assert main(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir",
                 trained, "--save-dir", hf_out]) == 0
    from transformers import LlamaForCausalLM
    exported = LlamaForCausalLM.from_pretrained(hf_out, dtype=torch.float32).eval()
    mine = ours(trained, config, inputs)
    theirs = hf_logits(exported, inputs)
    assert rel_diff(mine["logits"][..., :VOCAB], theirs["logits"]) <= REL
    # the step changed the weights, so this is not the imported model coming back
    assert rel_diff(hf_logits(llama(), inputs)["logits"], theirs["logits"]) > 1e-4
