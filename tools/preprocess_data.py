#!/usr/bin/env python
"""Tokenize a JSON-lines corpus into Megatron-LM compatible ``.bin/.idx`` files.

Same flags and output naming as Megatron-LM's tools/preprocess_data.py: each key of
``--json-keys`` gives ``{output_prefix}_{key}_document.bin/.idx`` (``_sentence`` with
``--split-sentences``), usable as ``--data-path {output_prefix}_{key}_document``.

Examples::

    # GPT-2 BPE, end-of-document token after each document, 8 worker processes
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix my-gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 8

    # BERT: sentence-split documents with a WordPiece vocab
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix my-bert \\
        --tokenizer-type BertWordPieceLowerCase --vocab-file bert-vocab.txt --split-sentences

    # The embedded tokenizer (SentencePiece trained on stdlib docstrings)
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix out \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model embedded
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron_auto.data.embedded import embedded_tokenizer_model  # noqa: E402
from megatron_auto.data.preprocess import (  # noqa: E402
    TokenizerArgs, output_prefix_for, preprocess_jsonl)
from megatron_auto.data.tokenizers import TOKENIZER_TYPES, unread_tokenizer_flags  # noqa: E402
from megatron_auto.utils.flag_warnings import one_line_flag_warnings, warn_flag  # noqa: E402
from megatron_auto.utils.output_paths import check_output_file, refuse_existing  # noqa: E402


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSON-lines file (.jsonl, or .jsonl.gz)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (for BERT)")
    g.add_argument("--keep-newlines", action="store_true", help="accepted for compatibility (newlines are always kept)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", help="SentencePiece .model, HuggingFace name/dir, or 'embedded'")
    g.add_argument("--vocab-file", help="vocab.json (GPT-2) or vocab.txt (BERT)")
    g.add_argument("--merge-file", help="merges.txt (GPT-2)")
    g.add_argument("--vocab-size", type=int, help="for NullTokenizer: ids are below this")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="output files are PREFIX_{key}_{document|sentence}.bin/.idx")
    g.add_argument("--overwrite", action="store_true",
                   help="replace output files that already exist (without it they are refused "
                        "before any tokenizing)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    g.add_argument("--log-interval", type=int, default=1000, help="report progress every N documents")
    args = p.parse_args(argv)
    if args.tokenizer_model == "embedded":
        args.tokenizer_model = embedded_tokenizer_model()
    if args.workers < 1:
        p.error(f"--workers {args.workers}: must be >= 1")
    return args


def check_outputs(args: argparse.Namespace) -> None:
    """Every ``.bin/.idx`` this run writes: its directory writable, and not there yet unless
    ``--overwrite`` (refused before the tokenizer is even built)."""
    outputs = [output_prefix_for(args.output_prefix, key, args.split_sentences) + ext
               for key in args.json_keys for ext in (".bin", ".idx")]
    for path in outputs:
        check_output_file(path, "--output-prefix")
    refuse_existing(outputs, "--output-prefix", args.overwrite)


def main(argv: list[str] | None = None) -> int:
    args = get_args(argv)
    with one_line_flag_warnings():
        return _preprocess(args)


def _preprocess(args: argparse.Namespace) -> int:
    tok = TokenizerArgs(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file, args.vocab_size)
    unread = unread_tokenizer_flags(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                    vocab_file=args.vocab_file, merge_file=args.merge_file,
                                    vocab_size=args.vocab_size)
    if unread:
        warn_flag(f"{' '.join(unread)}: not read by --tokenizer-type {args.tokenizer_type}; drop "
                  f"{'it' if len(unread) == 1 else 'them'} or choose the tokenizer that reads "
                  f"{'it' if len(unread) == 1 else 'them'}")
    try:
        check_outputs(args)
        stats = preprocess_jsonl(
            args.input, args.output_prefix, tok, args.json_keys, args.append_eod, args.workers,
            args.split_sentences, args.log_interval, log=sys.stderr,
        )
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{stats.documents} documents, {stats.tokens} tokens in {stats.seconds:.2f} s: "
          f"{stats.docs_per_s:.1f} docs/s, {stats.tokens_per_s:.0f} tokens/s")
    for path in stats.outputs:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
