"""BertStage: TP=2 (and a 2-stage mixed plan) equal the one-process model in fp32.

Uses the data-parallel stand-in and comparison helpers of test_gpt_model. Tolerance as there.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_distributed
from megatron_auto.config import ModelConfig
from megatron_auto.models.bert import BertStage
from megatron_auto.models.init import gather_full_state
from megatron_auto.parallel.context import ParallelContext
from test_gpt_model import BATCH, check_against_reference, finish_grad_sync, plan_of, run_stage

pytestmark = pytest.mark.multirank

CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                     seq_length=8, vocab_size=60, make_vocab_size_divisible_by=32,
                     hidden_dropout=0.0, attention_dropout=0.0, model_type="bert",
                     num_tokentypes=2, bert_binary_head=True)


def make_bert_batch(config: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    b, s = BATCH, config.seq_length
    lengths = torch.randint(3, s + 1, (b,), generator=gen)
    padding = (torch.arange(s)[None, :] < lengths[:, None]).long()
    loss_mask = ((torch.rand(b, s, generator=gen) < 0.4).long() * padding).float()
    loss_mask[:, 1] = 1.0  # at least one prediction per sample
    labels = torch.where(loss_mask > 0, torch.randint(0, config.vocab_size, (b, s), generator=gen),
                         torch.full((b, s), -1))
    return {"text": torch.randint(0, config.vocab_size, (b, s), generator=gen),
            "types": (torch.arange(s)[None, :] >= lengths[:, None] // 2).long() * padding,
            "padding_mask": padding, "labels": labels, "loss_mask": loss_mask,
            "is_random": torch.randint(0, 2, (b,), generator=gen)}


def _worker(rank: int, world_size: int, plan, config: ModelConfig) -> dict:
    ctx = ParallelContext(plan)
    stage = BertStage(config, ctx, seed=9)
    params = gather_full_state(stage, ctx)
    batch = make_bert_batch(config)
    total = batch["loss_mask"].sum().item()
    kwargs = {k: batch[k] for k in ("types", "padding_mask", "is_random")}
    loss = run_stage(stage, ctx, batch, total, first_input="text", kwargs=kwargs)
    finish_grad_sync(stage, ctx)
    return {"stage": ctx.stage, "loss": loss, "params": params,
            "grads": gather_full_state(stage, ctx, grads=True)}


_REF: dict = {}


def _reference() -> dict:
    if not _REF:
        plan = plan_of(1, [(1, True, False)] * CONFIG.num_layers, vocab_tp=1)
        _REF.update(run_distributed(_worker, 1, plan, CONFIG)[0])
    return _REF


def test_bert_reference_loss_by_hand() -> None:
    """The stage's loss equals MLM + SOP written out directly from the same weights."""

    def worker(rank: int, world_size: int) -> tuple[float, float]:
        plan = plan_of(1, [(1, True, False)] * CONFIG.num_layers, vocab_tp=1)
        stage = BertStage(CONFIG, ParallelContext(plan), seed=9).eval()
        b = make_bert_batch(CONFIG)
        loss_sum, tokens = stage(b["text"], labels=b["labels"], loss_mask=b["loss_mask"],
                                 types=b["types"], padding_mask=b["padding_mask"],
                                 is_random=b["is_random"], sop_weight=2.0)
        # by hand: the embedding sum, then the layers with a padding mask, then both heads
        emb = stage.embedding
        h = (emb.word_embeddings.weight[b["text"]] + emb.position_embeddings.weight[:CONFIG.seq_length]
             + emb.tokentype_embeddings.weight[b["types"]])
        mask = b["padding_mask"].bool()[:, None, None, :]
        for layer in stage.layers.values():
            h = layer(h, mask)
        h = stage.final_norm(h)
        head = stage.lm_head
        logits = F.linear(head.norm(F.gelu(head.dense(h))), emb.word_embeddings.weight) + head.bias
        ce = F.cross_entropy(logits.flatten(0, 1), b["labels"].clamp(min=0).flatten(),
                             reduction="none")
        mlm = (ce * b["loss_mask"].flatten()).sum()
        sop = F.cross_entropy(stage.binary_head(torch.tanh(stage.pooler(h[:, 0]))),
                              b["is_random"], reduction="sum")
        return loss_sum.item(), (mlm + 2.0 * sop).item()

    got, want = run_distributed(worker, 1)[0]
    assert got == pytest.approx(want, rel=1e-6)


def test_bert_tp2_matches_single_process() -> None:
    plan = plan_of(2, [(2, True, False)] * CONFIG.num_layers, vocab_tp=2)
    results = run_distributed(_worker, 2, plan, CONFIG)
    check_against_reference(results, _reference())


def test_bert_two_stages_mixed_layouts_match_single_process() -> None:
    plan = plan_of(4, [(2, False, True), (1, True, False)], vocab_tp=2, layers_per_stage=(1, 1))
    results = run_distributed(_worker, 4, plan, CONFIG)
    assert {r["stage"] for r in results} == {0, 1}
    check_against_reference(results, _reference())


def test_bert_binary_head_needs_is_random() -> None:
    def worker(rank: int, world_size: int) -> str:
        plan = plan_of(1, [(1, True, False)] * CONFIG.num_layers, vocab_tp=1)
        stage = BertStage(CONFIG, ParallelContext(plan))
        b = make_bert_batch(CONFIG)
        try:  # the dataset's field names work as keywords too (text=...)
            stage(text=b["text"], labels=b["labels"], loss_mask=b["loss_mask"],
                  padding_mask=b["padding_mask"])
        except ValueError as err:
            return str(err)
        return "no error"

    assert "needs is_random" in run_distributed(worker, 1)[0]
