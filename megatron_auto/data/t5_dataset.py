"""T5 span corruption over any token-sample dataset (the indexed GPT samples, or mock ids).

T5's pretraining objective (Raffel et al. 2020, §3.1.4): about ``noise_density`` of a sample's
tokens, in spans of mean length ``mean_span_length``, are dropped from the encoder input, each
span replaced by one sentinel; the decoder predicts every sentinel followed by the tokens it
replaced, then end-of-sequence. Sentinels are the tokenizer's extra ids
(``--vocab-extra-ids``, ``<extra_id_0>`` first), as in Megatron-LM.

Item (numpy, fixed shapes so batches stack):

- ``tokens`` (s_e,) encoder input: kept tokens with sentinels, end-of-sequence, then pad;
- ``encoder_mask`` (s_e,) float, 1 on the real encoder tokens;
- ``decoder_tokens`` (s_d,) the targets shifted right behind a start token (the pad id, as T5);
- ``labels`` (s_d,) the targets, ``loss_mask`` (s_d,) 1 on them.

A sample has ``s_e - 1`` raw tokens (so the encoder input always fits); the number of noise
tokens is lowered when the targets would not fit ``s_d`` or the sentinels would run out.
Every item is a pure function of ``(seed, index)``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from megatron_auto.data.errors import DataInputError

NOISE_DENSITY = 0.15
MEAN_SPAN_LENGTH = 3.0


def _composition(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """``parts`` positive integers summing to ``total`` (uniform over compositions)."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=parts - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]]))


def span_counts(num_tokens: int, decoder_length: int, num_sentinels: int,
                noise_density: float = NOISE_DENSITY,
                mean_span_length: float = MEAN_SPAN_LENGTH) -> tuple[int, int]:
    """(noise tokens, noise spans) for a sample of ``num_tokens``: the targets
    (``noise + spans + 1``) fit ``decoder_length``, at most ``num_sentinels`` spans, at least one
    kept token between spans."""
    noise = max(1, round(num_tokens * noise_density))
    noise = min(noise, num_tokens - 1, decoder_length - 2)
    spans = max(1, min(round(noise / mean_span_length), num_sentinels, num_tokens - noise))
    while noise + spans + 1 > decoder_length and noise > 1:
        noise -= 1
        spans = max(1, min(spans, noise))
    return noise, spans


def span_corrupt(raw: np.ndarray, rng: np.random.Generator, sentinels: Sequence[int], *,
                 encoder_length: int, decoder_length: int, eos: int, pad: int,
                 noise_density: float = NOISE_DENSITY,
                 mean_span_length: float = MEAN_SPAN_LENGTH) -> dict[str, np.ndarray]:
    """One T5 item (module docstring) from ``raw`` token ids (at most ``encoder_length - 1``)."""
    raw = np.asarray(raw, dtype=np.int64)[:encoder_length - 1]
    n = raw.size
    noise, spans = span_counts(n, decoder_length, len(sentinels), noise_density,
                               mean_span_length)
    noise_lengths = _composition(noise, spans, rng)
    keep_lengths = _composition(n - noise, spans, rng)
    enc: list[np.ndarray] = []
    target: list[np.ndarray] = []
    start = 0
    for k in range(spans):  # a kept run, then a noise span (T5's order)
        enc.append(raw[start:start + keep_lengths[k]])
        start += keep_lengths[k]
        enc.append(np.array([sentinels[k]], dtype=np.int64))
        target.append(np.array([sentinels[k]], dtype=np.int64))
        target.append(raw[start:start + noise_lengths[k]])
        start += noise_lengths[k]
    enc.append(np.array([eos], dtype=np.int64))
    target.append(np.array([eos], dtype=np.int64))
    enc_ids, labels = np.concatenate(enc), np.concatenate(target)
    tokens = np.full(encoder_length, pad, dtype=np.int64)
    tokens[:enc_ids.size] = enc_ids
    encoder_mask = np.zeros(encoder_length, dtype=np.float32)
    encoder_mask[:enc_ids.size] = 1.0
    out_labels = np.full(decoder_length, pad, dtype=np.int64)
    out_labels[:labels.size] = labels
    decoder_tokens = np.full(decoder_length, pad, dtype=np.int64)
    decoder_tokens[1:labels.size] = labels[:-1]  # position 0: the start token (pad)
    loss_mask = np.zeros(decoder_length, dtype=np.float32)
    loss_mask[:labels.size] = 1.0
    return {"tokens": tokens, "encoder_mask": encoder_mask, "decoder_tokens": decoder_tokens,
            "labels": out_labels, "loss_mask": loss_mask}


class T5Dataset:
    """Span-corrupted items over ``base`` (any dataset whose items have ``tokens``, e.g. a
    ``GPTDataset`` built with ``seq_length = encoder_length - 1``)."""

    def __init__(self, base: Any, sentinels: Sequence[int], *, encoder_length: int,
                 decoder_length: int, eos: int, pad: int, seed: int) -> None:
        if not sentinels:
            raise DataInputError("--vocab-extra-ids=0: T5 span corruption needs sentinel tokens "
                                 "from the tokenizer's extra ids; add --vocab-extra-ids 100")
        if decoder_length < 3:
            raise DataInputError(f"--decoder-seq-length={decoder_length}: span corruption needs "
                                 f"at least 3 decoder positions (a sentinel, a token, the end)")
        self.base, self.sentinels = base, list(sentinels)
        self.encoder_length, self.decoder_length = encoder_length, decoder_length
        self.eos, self.pad, self.seed = eos, pad, seed

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        raw = self.base[idx]["tokens"]
        rng = np.random.default_rng([self.seed, 5, int(idx)])
        return span_corrupt(raw, rng, self.sentinels, encoder_length=self.encoder_length,
                            decoder_length=self.decoder_length, eos=self.eos, pad=self.pad)


def sentinel_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's extra ids (``additional_special_tokens_ids``), empty when it has none."""
    return list(getattr(tokenizer, "additional_special_tokens_ids", None) or [])
