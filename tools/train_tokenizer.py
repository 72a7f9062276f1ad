#!/usr/bin/env python
"""Train a SentencePiece model (BPE or unigram) on a JSON-lines or plain-text corpus.

The model it writes works with ``--tokenizer-type SentencePieceTokenizer`` (GPT and BERT) and
``GPTSentencePieceTokenizer``: ids 0-3 are ``<unk> <s> </s> <pad>`` (``</s>`` is the end of
document), ``<CLS> <SEP> <MASK>`` are reserved control pieces, and byte fallback makes every
text encodable (unknown characters become byte pieces), so ``detokenize(tokenize(x)) == x``
for any text without leading/trailing/doubled spaces.

Example::

    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix tok --vocab-size 8192

Bad input (a missing or unreadable corpus, an output prefix that cannot be written, a model
that exists already without ``--overwrite``) prints one ``error: ...`` line and exits with
status 2, before training.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
from typing import Any, Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron_auto.utils.output_paths import (  # noqa: E402
    OutputPathError, check_output_file, refuse_existing)


class TokenizerInputError(ValueError):
    """A corpus or output this tool cannot use; printed as one line, exit status 2."""


def iter_texts(path: str, json_key: str | None) -> Iterator[str]:
    """Texts of ``path``: one per JSON line (``json_key``) or one per plain-text line."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if json_key is None:
                yield line.rstrip("\n")
                continue
            try:
                yield str(json.loads(line)[json_key])
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise TokenizerInputError(
                    f"{path}:{lineno}: cannot read key {json_key!r} ({err}); use --json-key or --plain-text"
                ) from None


def train(
    input_path: str,
    model_prefix: str,
    vocab_size: int = 8192,
    model_type: str = "bpe",
    json_key: str | None = "text",
    max_sentences: int = 2_000_000,
    num_threads: int = 2,
) -> str:
    """Train and write ``model_prefix.model`` (and ``.vocab``); returns the model path."""
    import sentencepiece as spm

    if not os.path.isfile(input_path):
        raise TokenizerInputError(f"--input {input_path}: file not found")
    with tempfile.TemporaryDirectory() as tmp:
        # SentencePiece learns from lines; documents are cut at newlines, keeping code lines intact.
        lines_path = os.path.join(tmp, "lines.txt")
        with open(lines_path, "w", encoding="utf-8") as out:
            for text in iter_texts(input_path, json_key):
                for line in text.split("\n"):
                    if line.strip():
                        out.write(line + "\n")
        try:
            _spm_train(spm, lines_path, model_prefix, vocab_size, model_type, max_sentences,
                       num_threads)
        except RuntimeError as err:  # sentencepiece reports bad settings as RuntimeError
            reason = (str(err).strip().splitlines() or ["?"])[-1]
            raise TokenizerInputError(f"--input {input_path}: SentencePiece cannot train a model "
                                      f"with these settings ({reason}); lower --vocab-size or "
                                      f"give more text") from None
    return model_prefix + ".model"


def _spm_train(spm, lines_path: str, model_prefix: str, vocab_size: int, model_type: str,
           max_sentences: int, num_threads: int) -> None:
    spm.SentencePieceTrainer.train(
        input=lines_path,
        model_prefix=model_prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=0.9995,
        byte_fallback=True,
        split_digits=True,
        # Keep spaces as written (indentation in examples) so detokenize inverts tokenize.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        control_symbols=["<CLS>", "<SEP>", "<MASK>"],
        input_sentence_size=max_sentences,
        shuffle_input_sentence=True,
        num_threads=num_threads,
        minloglevel=2,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="JSON lines (.jsonl[.gz]) or, with --plain-text, text lines")
    p.add_argument("--json-key", default="text", help="key holding the text in each JSON line")
    p.add_argument("--plain-text", action="store_true", help="treat --input as plain text, one line per sample")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--overwrite", action="store_true",
                   help="replace PREFIX.model and PREFIX.vocab when they exist (without it they "
                        "are refused before training)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    p.add_argument("--max-sentences", type=int, default=2_000_000, help="lines sampled for training")
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args(argv)
    outputs = [args.model_prefix + ext for ext in (".model", ".vocab")]
    try:
        for out in outputs:
            check_output_file(out, "--model-prefix")
        refuse_existing(outputs, "--model-prefix", args.overwrite)
        path = train(
            args.input, args.model_prefix, args.vocab_size, args.model_type,
            None if args.plain_text else args.json_key, args.max_sentences, args.num_threads,
        )
    except (TokenizerInputError, OutputPathError, OSError, UnicodeDecodeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({os.path.getsize(path) / 1e3:.0f} kB, vocab {args.vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
