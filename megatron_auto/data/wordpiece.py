"""BERT WordPiece tokenisation from a ``vocab.txt`` (one token per line, id = line number).

Two stages, as in the original BERT release: a *basic* tokenizer (clean control characters,
put spaces around CJK ideographs, optionally lower-case and strip accents, split on whitespace
and punctuation) and a greedy longest-match-first *wordpiece* split of each word, where
word-internal pieces carry a ``##`` prefix and a word with no valid split becomes ``[UNK]``.
"""

from __future__ import annotations

import os
import unicodedata

_MAX_WORD_CHARS = 100  # longer "words" (URLs, base64) become [UNK] instead of O(n^2) matching


def load_vocab(vocab_file: str) -> dict[str, int]:
    if not vocab_file or not os.path.isfile(vocab_file):
        raise FileNotFoundError(
            f"--vocab-file={vocab_file!r}: file not found; BERT WordPiece needs a vocab.txt "
            f"with one token per line"
        )
    vocab: dict[str, int] = {}
    with open(vocab_file, encoding="utf-8") as f:
        for line in f:
            tok = line.rstrip("\n")
            if tok and tok not in vocab:
                vocab[tok] = len(vocab)
    return vocab


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    # All non-alphanumeric ASCII counts as punctuation ("$", "^", "`"...), as BERT does.
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def basic_tokenize(text: str, lower_case: bool) -> list[str]:
    """Whitespace/punctuation/CJK split with optional lower-casing and accent stripping."""
    out = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD:
            continue
        cat = unicodedata.category(ch)
        if ch in "\t\n\r" or cat == "Zs":
            out.append(" ")
        elif cat.startswith("C"):
            continue  # control / format characters carry no text
        elif _is_cjk(cp):
            out.append(f" {ch} ")
        else:
            out.append(ch)
    words = []
    for word in "".join(out).split():
        if lower_case:
            word = unicodedata.normalize("NFD", word.lower())
            word = "".join(c for c in word if unicodedata.category(c) != "Mn")
        current = ""
        for ch in word:
            if _is_punctuation(ch):
                if current:
                    words.append(current)
                    current = ""
                words.append(ch)
            else:
                current += ch
        if current:
            words.append(current)
    return words


class BertWordPieceTokenizer:
    """WordPiece over a BERT vocab. Special tokens: ``cls sep mask pad``; ``eod`` is ``[SEP]``."""

    def __init__(self, vocab_file: str, lower_case: bool = True) -> None:
        self.vocab = load_vocab(vocab_file)
        self.inv_vocab = {v: k for k, v in self.vocab.items()}
        self.lower_case = lower_case
        missing = [t for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]") if t not in self.vocab]
        if missing:
            raise ValueError(f"{vocab_file}: BERT vocab lacks special tokens {missing}; add them to the file")

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def cls(self) -> int:
        return self.vocab["[CLS]"]

    @property
    def sep(self) -> int:
        return self.vocab["[SEP]"]

    @property
    def mask(self) -> int:
        return self.vocab["[MASK]"]

    @property
    def pad(self) -> int:
        return self.vocab["[PAD]"]

    @property
    def unk(self) -> int:
        return self.vocab["[UNK]"]

    @property
    def eod(self) -> int:
        return self.sep

    def wordpiece(self, word: str) -> list[str]:
        """Greedy longest-match split of one word; ``["[UNK]"]`` when it cannot be covered."""
        if len(word) > _MAX_WORD_CHARS:
            return ["[UNK]"]
        pieces = []
        start = 0
        while start < len(word):
            end = len(word)
            found = None
            while start < end:
                cand = word[start:end] if start == 0 else "##" + word[start:end]
                if cand in self.vocab:
                    found = cand
                    break
                end -= 1
            if found is None:
                return ["[UNK]"]
            pieces.append(found)
            start = end
        return pieces

    def tokenize_to_strings(self, text: str) -> list[str]:
        return [p for w in basic_tokenize(text, self.lower_case) for p in self.wordpiece(w)]

    def tokenize(self, text: str) -> list[int]:
        return [self.vocab[p] for p in self.tokenize_to_strings(text)]

    def detokenize(self, ids: list[int]) -> str:
        text = " ".join(self.inv_vocab[int(i)] for i in ids)
        return text.replace(" ##", "").replace("##", "")
