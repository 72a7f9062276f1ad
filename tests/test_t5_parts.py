"""T5's parts on their own: relative position buckets, span corruption, sentinel tokens,
the config's one-line errors and its parameter count."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_auto.config import ConfigError
from megatron_auto.data.t5_dataset import T5Dataset, span_corrupt, span_counts
from megatron_auto.data.errors import DataInputError
from megatron_auto.families.t5.config import T5Config

pytestmark = pytest.mark.single


def test_buckets_match_hand_computed_values():
    from megatron_auto.models.t5 import relative_position_buckets

    # bidirectional, 8 buckets: 4 per direction, offsets 0, 1 exact, then log up to distance 8
    b = relative_position_buckets(1, 10, bidirectional=True, num_buckets=8, max_distance=8)
    # key offsets 0..9 from query 0: positive side starts at bucket 4; |d| = 0, 1 exact (2 = n/2
    # per direction, halved: exact = 2), then 2 + floor(log(d/2)/log(4) * 2) capped at 3
    assert b[0].tolist() == [0, 5, 6, 6, 7, 7, 7, 7, 7, 7]
    causal = relative_position_buckets(8, 8, bidirectional=False, num_buckets=8, max_distance=8)
    # distances 7 .. 0 from query 7: exact below 4, then 4 + floor(log(d/4)/log(2) * 4)
    assert causal[7].tolist() == [7, 6, 5, 4, 3, 2, 1, 0]
    assert causal[0].tolist() == [0] * 8  # later keys share bucket 0


def test_buckets_match_transformers_t5():
    transformers_t5 = pytest.importorskip(
        "transformers.models.t5.modeling_t5",
        reason="transformers is not installed: the cross-check with its T5 needs it")
    from megatron_auto.models.t5 import relative_position_buckets

    for bidirectional in (True, False):
        for nb, md, s_q, s_k in ((32, 128, 40, 300), (8, 16, 12, 12), (16, 20, 7, 33)):
            ours = relative_position_buckets(s_q, s_k, bidirectional=bidirectional,
                                             num_buckets=nb, max_distance=md)
            rel = torch.arange(s_k)[None, :] - torch.arange(s_q)[:, None]
            theirs = transformers_t5.T5Attention._relative_position_bucket(
                rel, bidirectional=bidirectional, num_buckets=nb, max_distance=md)
            assert torch.equal(ours, theirs), (bidirectional, nb, md)


def test_span_corruption_reconstructs_the_sample():
    rng = np.random.default_rng(0)
    raw = np.arange(10, 41)  # 31 distinct tokens
    sentinels = [100, 101, 102, 103, 104, 105]
    item = span_corrupt(raw, rng, sentinels, encoder_length=32, decoder_length=16, eos=1, pad=0)
    enc = item["tokens"][item["encoder_mask"] == 1].tolist()
    labels = item["labels"][item["loss_mask"] == 1].tolist()
    assert enc[-1] == 1 and labels[-1] == 1  # end of sequence on both sides
    used = [t for t in enc if t in sentinels]
    assert used == sentinels[:len(used)] and len(used) >= 1
    # put each noise span back in place of its sentinel: the raw sample again
    spans, current = {}, None
    for t in labels[:-1]:
        if t in sentinels:
            current = t
            spans[t] = []
        else:
            spans[current].append(t)
    rebuilt = [x for t in enc[:-1] for x in (spans[t] if t in sentinels else [t])]
    assert rebuilt == raw.tolist()
    noise = sum(len(v) for v in spans.values())
    assert noise == round(31 * 0.15)
    # teacher forcing: the decoder reads the targets shifted right behind the start (pad) token
    n = len(labels)
    assert item["decoder_tokens"][0] == 0
    assert item["decoder_tokens"][1:n].tolist() == labels[:-1]
    assert item["tokens"].shape == (32,) and item["labels"].shape == (16,)


def test_span_counts_respect_decoder_length_and_sentinels():
    noise, spans = span_counts(511, 32, 100)
    assert noise + spans + 1 <= 32
    noise, spans = span_counts(127, 64, 2)
    assert spans == 2 and noise == round(127 * 0.15)


def test_dataset_without_sentinels_is_a_one_line_error():
    with pytest.raises(DataInputError, match=r"^--vocab-extra-ids=0: .*add --vocab-extra-ids 100$"):
        T5Dataset([], [], encoder_length=8, decoder_length=8, eos=1, pad=0, seed=1)


def test_tokenizer_gains_sentinels_from_vocab_extra_ids():
    from megatron_auto.data import build_tokenizer
    from megatron_auto.data.embedded import embedded_tokenizer_model

    plain = build_tokenizer("SentencePieceTokenizer", tokenizer_model=embedded_tokenizer_model())
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=embedded_tokenizer_model(),
                          vocab_extra_ids=5)
    assert tok.vocab_size == plain.vocab_size + 5
    assert tok.additional_special_tokens_ids == list(range(plain.vocab_size,
                                                           plain.vocab_size + 5))
    assert tok.eod == plain.eod and tok.pad == plain.pad
    ids = tok.tokenize("hello world") + [tok.additional_special_tokens_ids[2]]
    assert tok.detokenize(ids).endswith("<extra_id_2>")
    base = build_tokenizer("NullTokenizer", vocab_size=50).vocab_size
    null = build_tokenizer("NullTokenizer", vocab_size=50, vocab_extra_ids=3)
    assert null.vocab_size == base + 3
    assert null.additional_special_tokens_ids == [base, base + 1, base + 2]


@pytest.mark.parametrize("kwargs, message", [
    ({"position_embedding_type": "learned", "decoder_seq_length": 40,
      "max_position_embeddings": 32},
     "--decoder-seq-length=40: is longer than the learned position table "
     "(--max-position-embeddings=32)"),
    ({"encoder_num_layers": 0}, "--encoder-num-layers=0: must be a positive integer"),
    ({"relative_attention_num_buckets": 7}, "--relative-attention-num-buckets=7: must be an even"),
])
def test_config_mistakes_are_one_line_errors(kwargs, message):
    with pytest.raises(ConfigError) as err:
        T5Config(**{"seq_length": 32, **kwargs})
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_parameter_count_and_layer_split():
    from megatron_auto.models.t5 import T5Stage
    from megatron_auto.parallel.context import ParallelContext
    from megatron_auto.plan import Plan

    cfg = T5Config(encoder_num_layers=1, decoder_num_layers=2, hidden_size=16,
                   num_attention_heads=2, kv_channels=4, seq_length=8, decoder_seq_length=6,
                   vocab_size=40, make_vocab_size_divisible_by=8)
    assert cfg.num_layers == 3 and cfg.projection_size == 8
    stage = T5Stage(cfg, ParallelContext(Plan.uniform(1, 3, global_batch_size=1)))
    assert sum(p.numel() for p in stage.parameters()) == cfg.num_parameters()
    assert stage.layers["0"].self_attention.linear_qkv.weight.shape == (24, 16)  # 3 x 2 x 4
    assert stage.layers["1"].cross_attention.linear_kv.weight.shape == (16, 16)


def test_planner_moves_the_bytes_the_runtime_sends_across_a_boundary():
    """The cost model's bytes per sample at a stage boundary equal the runtime's wire tensor."""
    from megatron_auto.models.t5 import T5Stage
    from megatron_auto.parallel.context import ParallelContext
    from megatron_auto.plan import Plan
    from megatron_auto.planner import TrainingSpec, analytic_profile
    from megatron_auto.families.registry import model_spec
    from megatron_auto.planner.inputs.presets import get_cluster

    cfg = T5Config(encoder_num_layers=1, decoder_num_layers=1, hidden_size=16,
                   num_attention_heads=2, seq_length=10, decoder_seq_length=6, vocab_size=40,
                   make_vocab_size_divisible_by=8)
    stage = T5Stage(cfg, ParallelContext(Plan.uniform(1, 2, global_batch_size=3)))
    spec = model_spec(cfg)
    profile = analytic_profile(spec, TrainingSpec(3, precision="fp32"), get_cluster("a100-40g-1x8"))
    wire = stage._wire_shape(3, stage._layer_groups[0].layout)  # what a boundary would send
    for name in ("t5_encoder", "t5_decoder"):
        assert profile.layer_types[name].moved_bytes_per_sample * 3 == 4 * math.prod(wire)


def test_profile_model_measures_both_t5_layer_types(tmp_path, capsys):
    from megatron_auto.cli import main

    flags = ["profile-model", "--model-type", "t5", "--encoder-num-layers", "1",
             "--decoder-num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
             "--seq-length", "12", "--decoder-seq-length", "8", "--vocab-size", "64",
             "--batch-sizes", "2", "3", "--iters", "1", "--warmup-iters", "0",
             "--cache-dir", str(tmp_path), "--device", "cpu"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    for name in ("t5_encoder", "t5_decoder"):
        assert f"layer {name}: " in out
