"""T5 under every kind of plan: the equivalence invariant against one process (docs/design.md §4).

Tiny T5: 2 encoder + 2 decoder layers of width 32 with 4 heads, 12 encoder and 8 decoder
tokens, relative position bias (8 buckets); fp32, dropout off, 3 AdamW steps; losses relative
1e-5, gradient norms 1e-4, parameters rtol 1e-5 / atol 1e-6 (tests/harness.py).
"""

from __future__ import annotations

import pytest

from harness import Equivalence, FamilyEquivalenceTests, layer, one_process_plan, plan_of
from megatron_auto.families.t5.config import T5Config
from t5_utils import SEARCHED, t5_recipe

CONFIG = T5Config(encoder_num_layers=2, decoder_num_layers=2, hidden_size=32,
                  num_attention_heads=4, ffn_hidden_size=64, seq_length=12, decoder_seq_length=8,
                  vocab_size=96, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                  attention_dropout=0.0, relative_attention_num_buckets=8,
                  relative_attention_max_distance=16)
LEARNED = T5Config(**{**CONFIG.to_dict(), "position_embedding_type": "learned"})


T5 = Equivalence(t5_recipe(CONFIG), "t5")
T5_LEARNED = Equivalence(t5_recipe(LEARNED), "t5 learned positions")


FOUR_RANK_PLANS = {
    # per-layer TP degrees, ZeRO-2/3 and a strided TP layout side by side in one stage
    "zero-tp-mix": plan_of(4, [layer(tp=2), layer(tp=1, dp_mode="zero3"), layer(tp=4),
                               layer(tp=2, dp_mode="zero2", consecutive=False)],
                           vocab_tp=2, vocab_dp_mode="zero3"),
    # the boundary inside the encoder: the decoder's embedded input is carried to stage 1,
    # and the encoder's bias table lives on both stages; ZeRO-1 on some layers and the vocab
    "pp2-inside-encoder-zero1": plan_of(4, [layer(tp=2), layer(tp=1, dp_mode="zero1"),
                                            layer(tp=2), layer(tp=1, dp_mode="zero1")],
                                        layers_per_stage=(1, 3), vocab_dp_mode="zero1"),
    # exactly at the encoder/decoder boundary, with different layouts on either side
    "pp2-at-enc-dec": plan_of(4, [layer(tp=1), layer(tp=2, consecutive=True),
                                  layer(tp=2, consecutive=False, dp_mode="zero2"),
                                  layer(tp=1, dp_mode="zero3")],
                              layers_per_stage=(2, 2), vocab_dp_mode="zero2"),
    # inside the decoder, recompute on some layers, GPipe
    "pp2-inside-decoder-recompute": plan_of(
        4, [layer(tp=2, recompute=True), layer(tp=2), layer(tp=1, recompute=True,
                                                            dp_mode="zero3"), layer(tp=2)],
        layers_per_stage=(3, 1), num_microbatches=4, schedule="gpipe"),
    # one layer per stage: middle stages hold no embedding, both tables span two stages
    "pp4": plan_of(4, [layer()] * 4, layers_per_stage=(1, 1, 1, 1), num_microbatches=4),
}


class TestT5Equivalence(FamilyEquivalenceTests):
    equivalence = T5
    searched = SEARCHED
    searched_model = {"model_type": "t5", "encoder_num_layers": 2}
    four_rank_plans = FOUR_RANK_PLANS


@pytest.mark.multirank
def test_learned_positions_pipeline_at_enc_dec_boundary_matches_one_process():
    (result,) = T5_LEARNED.run(2, [plan_of(2, [layer()] * 4, layers_per_stage=(2, 2))])
    ref = T5_LEARNED.reference()
    assert "embedding.position_embeddings.weight" in ref.state
    assert not any("relative_bias" in name for name in ref.state)
    T5_LEARNED.check(result, "pp2")


@pytest.mark.multirank
def test_reference_trains_and_names_parameters_plan_independently():
    state = T5.reference_trains().state
    assert state["encoder_relative_bias.weight"].shape == (8, 4)
    assert state["decoder_relative_bias.weight"].shape == (8, 4)
    assert state["layers.1.final_layernorm.weight"].shape == (32,)  # the encoder's final norm
    assert state["layers.2.cross_attention.linear_kv.weight"].shape == (64, 32)
    assert "layers.0.cross_attention.linear_q.weight" not in state


def _plain_check(config):
    import os
    import sys

    import torch

    from megatron_auto.models.t5 import T5Stage
    from megatron_auto.parallel.context import ParallelContext
    from megatron_auto.plan import Plan
    from t5_utils import make_batch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    from plain_t5 import PlainT5

    ours = T5Stage(config, ParallelContext(Plan.from_dict(one_process_plan(4))))
    plain = PlainT5(config)
    plain.load_state_dict(ours.state_dict(), strict=True)
    batch = make_batch(config, 0)
    loss, tokens = ours(batch["tokens"], decoder_tokens=batch["decoder_tokens"],
                        encoder_mask=batch["encoder_mask"], labels=batch["labels"],
                        loss_mask=batch["loss_mask"])
    loss.backward()
    plain_loss, plain_tokens = plain(batch)
    plain_loss.backward()
    assert float(tokens) == float(plain_tokens)
    assert abs(loss.item() - plain_loss.item()) <= 1e-5 * abs(plain_loss.item())
    grads = {n: p.grad for n, p in plain.named_parameters()}
    assert set(grads) == {n for n, _ in ours.named_parameters()}
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.single
@pytest.mark.parametrize("learned", [False, True], ids=["relative", "learned"])
def test_same_loss_and_gradients_as_a_plain_pytorch_t5(learned):
    _plain_check(LEARNED if learned else CONFIG)
