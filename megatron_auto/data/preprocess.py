"""JSON lines -> tokenized ``.bin/.idx`` (the engine of ``tools/preprocess_data.py``).

Each input line is a JSON object; for every ``--json-keys`` key its text is tokenized (optionally
split into sentences first) and written as one document of ``{prefix}_{key}_{level}.bin/.idx``,
``level`` being ``document`` or ``sentence`` (Megatron-LM's naming). Lines are tokenized by a
``multiprocessing`` pool whose workers each build their own tokenizer, and written in input
order, so the output does not depend on ``--workers``.
"""

from __future__ import annotations

import functools
import gzip
import itertools
import json
import multiprocessing
import os
import re
import time
from dataclasses import dataclass, field
from typing import IO, Any, Iterator

import numpy as np

from megatron_auto.data.errors import DataInputError
from megatron_auto.data.indexed_dataset import IndexedDatasetBuilder, optimal_dtype
from megatron_auto.data.tokenizers import build_tokenizer

# A sentence ends after . ! ? and any closing quotes/brackets, when whitespace and an upper-case
# letter, digit or opening quote follow; a blank line also ends one. Abbreviations before a
# capital ("Mr. Smith") are cut; good enough for BERT sentence pairs without downloading models.
_SENTENCE_END_RE = re.compile(r"[.!?][\"')\]]*(?=\s+[\"'(\[]?[A-Z0-9])|\n\s*\n")


def _regex_split(text: str) -> list[str]:
    parts, start = [], 0
    for m in _SENTENCE_END_RE.finditer(text):
        parts.append(text[start : m.end()])
        start = m.end()
    parts.append(text[start:])
    return parts


@functools.lru_cache(maxsize=1)
def _punkt() -> Any:
    """NLTK's punkt splitter when nltk and its data are installed (never downloads)."""
    try:
        import nltk  # noqa: F401, PLC0415 - optional package, only for sentence splitting
    except ImportError:
        return None
    try:  # nltk >= 3.9 reads the "punkt_tab" data
        from nltk.tokenize import PunktTokenizer  # noqa: PLC0415 - optional package

        return PunktTokenizer()
    except Exception:  # older nltk, or the data is not installed (LookupError)
        pass
    try:  # older nltk: the pickled "punkt" model
        return nltk.data.load("tokenizers/punkt/english.pickle")
    except Exception:
        return None


def split_sentences(text: str, use_nltk: bool = True) -> list[str]:
    """Sentences of ``text``, whitespace-trimmed, empty ones dropped."""
    splitter = _punkt() if use_nltk else None
    parts = splitter.tokenize(text) if splitter is not None else _regex_split(text)
    return [p.strip() for p in parts if p and p.strip()]


@dataclass
class TokenizerArgs:
    """What a worker process needs to build its tokenizer (picklable)."""

    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None

    def build(self) -> Any:
        return build_tokenizer(
            self.tokenizer_type, self.tokenizer_model, self.vocab_file, self.merge_file, self.vocab_size
        )


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    bytes_in: int = 0
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)

    @property
    def docs_per_s(self) -> float:
        return self.documents / max(self.seconds, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class _Encoder:
    """Per-process tokenisation of one input line (the tokenizer is built once per worker)."""

    def __init__(
        self, tok_args: TokenizerArgs, json_keys: list[str], split: bool, append_eod: bool, source: str
    ) -> None:
        self.tok_args, self.json_keys, self.source = tok_args, json_keys, source
        self.split, self.append_eod = split, append_eod
        self.tokenizer: Any = None

    def initializer(self) -> None:
        self.tokenizer = self.tok_args.build()

    def encode(self, item: tuple[int, str]) -> tuple[dict[str, tuple[np.ndarray, list[int]]], int]:
        lineno, line = item
        if self.tokenizer is None:
            self.initializer()
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{self.source}:{lineno}: not valid JSON ({err}); --input must be JSON lines") from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{self.source}:{lineno}: a JSON {type(record).__name__}, not an object; "
                f"each line must be an object such as {{\"text\": ...}}"
            )
        out = {}
        for key in self.json_keys:
            if key not in record:
                raise ValueError(
                    f"{self.source}:{lineno}: no key {key!r} (has {sorted(record)[:8]}); set --json-keys"
                )
            text = str(record[key])
            pieces = split_sentences(text) if self.split else [text]
            seqs = [self.tokenizer.tokenize(p) for p in pieces]
            seqs = [s for s in seqs if s] if self.split else seqs
            if self.append_eod and any(seqs):
                seqs[-1] = list(seqs[-1]) + [self.tokenizer.eod]
            lengths = [len(s) for s in seqs]
            flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=sum(lengths))
            out[key] = (flat, lengths)
        return out, len(line.encode("utf-8"))


def _open_text(path: str) -> IO[str]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--input {path}: file not found; give a JSON-lines file (.jsonl or .jsonl.gz)")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _numbered_lines(f: IO[str]) -> Iterator[tuple[int, str]]:
    for i, line in enumerate(f, start=1):
        if line.strip():
            yield i, line


def output_prefix_for(output_prefix: str, key: str, split_sentences: bool) -> str:
    return f"{output_prefix}_{key}_{'sentence' if split_sentences else 'document'}"


def preprocess_jsonl(
    input_path: str,
    output_prefix: str,
    tok_args: TokenizerArgs,
    json_keys: tuple[str, ...] | list[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    split_sentences: bool = False,
    log_interval: int = 1000,
    log: IO[str] | None = None,
) -> PreprocessStats:
    """Tokenize ``input_path`` into one indexed dataset per key; returns counts and timing.

    Progress lines go to ``log`` (e.g. ``sys.stderr``) every ``log_interval`` documents; none
    when ``log`` is None.
    """
    if workers < 1:
        raise ValueError(f"--workers {workers}: must be >= 1")
    tokenizer = tok_args.build()  # fail early, in the parent, on bad tokenizer flags
    dtype = optimal_dtype(tokenizer.vocab_size)
    keys = list(json_keys)
    prefixes = {k: output_prefix_for(output_prefix, k, split_sentences) for k in keys}
    encoder = _Encoder(tok_args, keys, split_sentences, append_eod, input_path)
    stats = PreprocessStats(outputs=[p + ext for p in prefixes.values() for ext in (".bin", ".idx")])
    start = time.perf_counter()
    pool = None
    # Open the input before the builders create their temporary files, so that a missing
    # input leaves nothing behind.
    with _open_text(input_path) as f:
        builders = {k: IndexedDatasetBuilder(prefixes[k], dtype) for k in keys}
        if workers > 1:
            pool = multiprocessing.Pool(workers, initializer=encoder.initializer)
            results = pool.imap(encoder.encode, _numbered_lines(f), chunksize=32)
        else:
            encoder.tokenizer = tokenizer
            results = map(encoder.encode, _numbered_lines(f))
        try:
            for docs, nbytes in results:
                for key, (flat, lengths) in docs.items():
                    builders[key].add_document(flat, lengths)
                    stats.tokens += int(flat.size)
                stats.documents += 1
                stats.bytes_in += nbytes
                if log is not None and log_interval > 0 and stats.documents % log_interval == 0:
                    _progress(log, stats, time.perf_counter() - start, final=False)
        except BaseException:
            for b in builders.values():
                b.abort()
            raise
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
    empty = [k for k in keys if builders[k].num_tokens == 0]
    if empty:
        for b in builders.values():
            b.abort()
        what = "no non-blank lines" if stats.documents == 0 else \
            f"{stats.documents} documents but no tokens under --json-keys {' '.join(empty)}"
        raise DataInputError(f"--input {input_path}: {what}; nothing to train on. Give a JSON-lines "
                             f'file with one {{"{keys[0]}": "..."}} object per line')
    for b in builders.values():
        b.finalize()
    stats.seconds = time.perf_counter() - start
    if log is not None:
        _progress(log, stats, stats.seconds, final=True)
    return stats


def _progress(log: IO[str], stats: PreprocessStats, elapsed: float, final: bool) -> None:
    rate = stats.documents / max(elapsed, 1e-9)
    mb = stats.bytes_in / 1e6
    line = (
        f"{'done' if final else 'processed'} {stats.documents} documents, {stats.tokens} tokens, "
        f"{mb:.1f} MB in {elapsed:.1f} s ({rate:.1f} docs/s, {stats.tokens / max(elapsed, 1e-9):.0f} tokens/s, "
        f"{mb / max(elapsed, 1e-9):.2f} MB/s)"
    )
    # On a terminal the progress line rewrites itself; in a log file each report is a line.
    tty = log.isatty()
    if tty and not final:
        log.write("\r" + line)
    elif tty:
        log.write("\n" + line + "\n")
    else:
        log.write(line + "\n")
    log.flush()
