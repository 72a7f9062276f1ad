"""GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt`` (our implementation of the algorithm).

Byte-level BPE works on UTF-8 bytes, each byte shown as a printable unicode character (the
``bytes_to_unicode`` table) so that vocab and merges files are plain text. Text is first cut
into pre-tokens (words with their leading space, numbers, punctuation runs, whitespace), then
each pre-token's characters are merged pairwise, always applying the lowest-ranked merge
present, until no listed merge applies. Every byte has a token, so any text round-trips.
"""

from __future__ import annotations

import functools
import json
import os

try:  # The reference pattern needs unicode classes (\p{L}); plain `re` gets an approximation.
    import regex as _re

    _PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
except ImportError:  # pragma: no cover - exercised only where `regex` is absent
    import re as _re

    # [^\W\d_] = letters; \d = digits; the rest of \w (underscore) counts as punctuation.
    _PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""

EOD_TOKEN = "<|endoftext|>"


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """Map every byte 0..255 to a printable unicode character.

    Printable latin bytes map to themselves; the other 68 (controls, space, soft hyphen...) are
    moved to code points 256, 257, ... in byte order, so the table is a bijection.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    table: dict[int, str] = {b: chr(b) for b in keep}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


class GPT2BPETokenizer:
    """Byte-level BPE; ``eod`` (and ``pad``) is ``<|endoftext|>``."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{flag}={path!r}: file not found; GPT2BPETokenizer needs the GPT-2 "
                    f"vocab.json (--vocab-file) and merges.txt (--merge-file)"
                )
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: dict[str, int] = json.load(f)
        self.decoder = {v: k for k, v in self.encoder.items()}
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
        pairs = []
        for line in lines:
            # The first line of GPT-2's file is a "#version" comment; blank lines end it.
            if not line.strip() or line.startswith("#version"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{merge_file}: bad merge line {line!r}; expected two symbols")
            pairs.append((parts[0], parts[1]))
        self.ranks = {pair: i for i, pair in enumerate(pairs)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.pattern = _re.compile(_PATTERN)
        self._cache: dict[str, list[str]] = {}
        if EOD_TOKEN not in self.encoder:
            raise ValueError(f"{vocab_file}: has no {EOD_TOKEN!r} entry, which GPT-2 uses as end of document")
        self._eod = self.encoder[EOD_TOKEN]

    # ------------------------------------------------------------------ interface
    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self.pattern.findall(text):
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            for sym in self._bpe(mapped):
                if sym not in self.encoder:
                    raise ValueError(
                        f"BPE symbol {sym!r} is not in the vocab; vocab.json and merges.txt "
                        f"do not belong together (every merge result must be a vocab entry)"
                    )
                ids.append(self.encoder[sym])
        return ids

    def detokenize(self, ids: list[int]) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ merges
    def _bpe(self, word: str) -> list[str]:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        symbols = list(word)
        while len(symbols) > 1:
            # The lowest-ranked adjacent pair wins; all its occurrences merge in one pass.
            best_rank, best = None, None
            for pair in zip(symbols, symbols[1:]):
                r = self.ranks.get(pair)
                if r is not None and (best_rank is None or r < best_rank):
                    best_rank, best = r, pair
            if best is None:
                break
            merged: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        if len(self._cache) < 100_000:
            self._cache[word] = symbols
        return symbols
