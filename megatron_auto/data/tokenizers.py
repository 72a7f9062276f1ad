"""Tokenizers behind one interface, selected by Megatron-LM's ``--tokenizer-type`` names.

Every tokenizer offers ``vocab_size``, ``tokenize(text) -> list[int]``, ``detokenize(ids) ->
str``, ``eod`` and ``pad``; those usable for BERT also ``cls``, ``sep`` and ``mask``.
``build_tokenizer`` is the single entry point; the model's embedding size is
``config.pad_vocab_size(tokenizer.vocab_size, ...)``. ``vocab_extra_ids=N`` (Megatron's
``--vocab-extra-ids``) gives any of them the sentinel tokens ``<extra_id_0> .. <extra_id_N-1>``
of T5's span corruption (:class:`ExtraIdsTokenizer`).
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

from megatron_auto.data.errors import DataInputError
from megatron_auto.data.gpt2_bpe import GPT2BPETokenizer
from megatron_auto.data.wordpiece import BertWordPieceTokenizer

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)


@runtime_checkable
class Tokenizer(Protocol):
    """What datasets and tools rely on."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    @property
    def pad(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str: ...


class _SpecialTokens:
    """``eod pad cls sep mask`` ids looked up by the subclass's ``_special(name)``."""

    def _special(self, key: str) -> int:  # pragma: no cover - every subclass overrides it
        raise AttributeError(f"{type(self).__name__} has no {key} token")

    eod = property(lambda self: self._special("eod"))
    pad = property(lambda self: self._special("pad"))
    cls = property(lambda self: self._special("cls"))
    sep = property(lambda self: self._special("sep"))
    mask = property(lambda self: self._special("mask"))


class NullTokenizer:
    """Text is space-separated integer ids (for tests and pre-tokenised data).

    As in Megatron-LM, ``eod`` is the id ``vocab_size`` passed in, so the reported
    ``vocab_size`` is one larger. ``pad`` is ``eod``.
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError(f"--vocab-size={vocab_size}: NullTokenizer needs a positive --vocab-size")
        self._n = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    @property
    def eod(self) -> int:
        return self._n

    @property
    def pad(self) -> int:
        return self._n

    def tokenize(self, text: str) -> list[int]:
        ids = [int(x) for x in text.split()]
        bad = [i for i in ids if not 0 <= i < self._n]
        if bad:
            raise ValueError(f"NullTokenizer: ids {bad[:5]} outside [0, {self._n}); raise --vocab-size")
        return ids

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class SentencePieceTokenizer(_SpecialTokens):
    """A SentencePiece model, with the special tokens the model lacks appended after its vocab.

    ``eod`` is the model's ``</s>`` (eos) piece when it has one; ``pad`` its pad piece.
    ``<CLS> <SEP> <MASK>`` (or ``[CLS]``-style spellings) are taken from the model when present
    and otherwise given the next free ids, so ``vocab_size`` may exceed the model's piece count.
    ``bert_specials=False`` (GPTSentencePieceTokenizer) adds only what GPT needs (eod, pad).
    """

    def __init__(self, model_file: str, bert_specials: bool = True) -> None:
        if not model_file or not os.path.isfile(model_file):
            raise FileNotFoundError(
                f"--tokenizer-model={model_file!r}: SentencePiece model file not found; "
                f"pass a .model file (tools/train_tokenizer.py trains one)"
            )
        import sentencepiece as spm  # noqa: PLC0415 - optional package, only this tokenizer

        self.model_file = model_file
        try:
            self.sp = spm.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as err:  # sentencepiece: "could not parse ModelProto"
            raise DataInputError(
                f"--tokenizer-model={model_file!r}: not a SentencePiece model ({err}); pass the "
                f".model file written by spm_train or tools/train_tokenizer.py") from None
        self._num_pieces = self.sp.get_piece_size()
        self._extra: dict[int, str] = {}
        self._specials: dict[str, int] = {}

        def lookup(*names: str) -> int | None:
            for name in names:
                pid = self.sp.piece_to_id(name)
                if pid != self.sp.unk_id() or name == self.sp.id_to_piece(self.sp.unk_id()):
                    return pid
            return None

        def special(key: str, model_id: int, *names: str) -> None:
            pid = model_id if model_id >= 0 else lookup(*names)
            if pid is None:
                pid = self._num_pieces + len(self._extra)
                self._extra[pid] = names[0]
            self._specials[key] = pid

        special("eod", self.sp.eos_id(), "<EOD>", "</s>")
        special("pad", self.sp.pad_id(), "<PAD>", "<pad>")
        if bert_specials:
            special("cls", -1, "<CLS>", "[CLS]")
            special("sep", -1, "<SEP>", "[SEP]")
            special("mask", -1, "<MASK>", "[MASK]")

    @property
    def vocab_size(self) -> int:
        return self._num_pieces + len(self._extra)

    @property
    def appended_specials(self) -> dict[int, str]:
        """id -> spelling of the special tokens appended after the model's pieces, by id."""
        return dict(sorted(self._extra.items()))

    def piece_id(self, piece: str) -> int | None:
        """The model's id of ``piece``, or None when the model lacks it."""
        pid = self.sp.piece_to_id(piece)
        return None if pid == self.sp.unk_id() else int(pid)

    def _special(self, key: str) -> int:
        if key not in self._specials:
            raise AttributeError(
                f"this SentencePiece tokenizer has no {key} token; use --tokenizer-type "
                f"SentencePieceTokenizer (not GPTSentencePieceTokenizer) for BERT"
            )
        return self._specials[key]


    def tokenize(self, text: str) -> list[int]:
        return list(self.sp.encode(text))

    def detokenize(self, ids: list[int]) -> str:
        # Appended specials are unknown to the model; decode the runs between them.
        out, run = [], []
        for i in ids:
            i = int(i)
            if i in self._extra:
                if run:
                    out.append(self.sp.decode(run))
                    run = []
                out.append(self._extra[i])
            else:
                run.append(i)
        if run:
            out.append(self.sp.decode(run))
        return "".join(out)


class HuggingFaceTokenizer(_SpecialTokens):
    """A HuggingFace tokenizer: a ``tokenizer.json`` file (needs ``tokenizers``) or a model name
    or directory (needs ``transformers``' AutoTokenizer)."""

    # Spellings of the special tokens across common HuggingFace vocabularies.
    _NAMES = {
        "eod": ("<|endoftext|>", "</s>", "<eos>", "[SEP]"),
        "pad": ("<pad>", "[PAD]", "<|padding|>"),
        "cls": ("[CLS]", "<s>", "<cls>"),
        "sep": ("[SEP]", "</s>", "<sep>"),
        "mask": ("[MASK]", "<mask>"),
    }

    def __init__(self, model_name_or_path: str) -> None:
        self._specials: dict[str, int] = {}
        if model_name_or_path.endswith(".json") and os.path.isfile(model_name_or_path):
            try:
                from tokenizers import Tokenizer as _HFTokenizer  # noqa: PLC0415 - optional package
            except ImportError as err:
                raise ImportError(
                    f"--tokenizer-model {model_name_or_path}: a tokenizer.json needs the `tokenizers` "
                    f"package: pip install tokenizers"
                ) from err
            self.fast = _HFTokenizer.from_file(model_name_or_path)
            self.hf = None
            self._vocab_size = self.fast.get_vocab_size(with_added_tokens=True)
            lookup = self.fast.token_to_id
        else:
            try:
                from transformers import AutoTokenizer  # noqa: PLC0415 - optional, heavy package
            except ImportError as err:
                raise ImportError(
                    "--tokenizer-type HuggingFaceTokenizer needs the `transformers` package "
                    "(or a tokenizer.json file and the `tokenizers` package): pip install transformers"
                ) from err
            self.hf = AutoTokenizer.from_pretrained(model_name_or_path)
            self.fast = None
            self._vocab_size = len(self.hf)
            vocab = self.hf.get_vocab()
            lookup = vocab.get
            for key, attr in (("eod", "eos_token_id"), ("pad", "pad_token_id"), ("cls", "cls_token_id"),
                              ("sep", "sep_token_id"), ("mask", "mask_token_id")):
                if getattr(self.hf, attr, None) is not None:
                    self._specials[key] = int(getattr(self.hf, attr))
        for key, names in self._NAMES.items():
            if key not in self._specials:
                found = [lookup(n) for n in names if lookup(n) is not None]
                if found:
                    self._specials[key] = int(found[0])
        if "eod" not in self._specials:
            raise ValueError(f"{model_name_or_path}: tokenizer has no end-of-document token ({self._NAMES['eod']})")
        self._specials.setdefault("pad", self._specials["eod"])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def piece_id(self, piece: str) -> int | None:
        """The vocabulary's id of ``piece`` (T5 tokenizers hold ``<extra_id_i>``), or None."""
        if self.fast is not None:
            found = self.fast.token_to_id(piece)
        else:
            found = self.hf.get_vocab().get(piece)
        return None if found is None else int(found)

    def _special(self, key: str) -> int:
        if key not in self._specials:
            raise AttributeError(f"this HuggingFace tokenizer has no {key} token ({self._NAMES[key]})")
        return self._specials[key]


    def tokenize(self, text: str) -> list[int]:
        if self.fast is not None:
            return list(self.fast.encode(text, add_special_tokens=False).ids)
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def detokenize(self, ids: list[int]) -> str:
        ids = [int(i) for i in ids]
        if self.fast is not None:
            return self.fast.decode(ids, skip_special_tokens=False)
        return self.hf.decode(ids)


class ExtraIdsTokenizer:
    """``base`` with ``num_extra_ids`` sentinel tokens ``<extra_id_i>`` (T5's span corruption).

    A sentinel the base vocabulary already holds (T5's SentencePiece and HuggingFace
    vocabularies do) keeps its id; the others are appended after ``base.vocab_size`` in order.
    ``additional_special_tokens_ids`` lists the sentinels (Megatron's name); everything else is
    the base tokenizer's.
    """

    def __init__(self, base: Tokenizer, num_extra_ids: int) -> None:
        self.base = base
        find = getattr(base, "piece_id", None)
        self._appended: dict[int, str] = {}
        ids = []
        for i in range(num_extra_ids):
            name = f"<extra_id_{i}>"
            pid = find(name) if callable(find) else None
            if pid is None:
                pid = base.vocab_size + len(self._appended)
                self._appended[pid] = name
            ids.append(pid)
        self.additional_special_tokens_ids = ids

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size + len(self._appended)

    def tokenize(self, text: str) -> list[int]:
        return self.base.tokenize(text)

    def detokenize(self, ids: list[int]) -> str:
        out, run = [], []
        for i in ids:
            if int(i) in self._appended:
                if run:
                    out.append(self.base.detokenize(run))
                    run = []
                out.append(self._appended[int(i)])
            else:
                run.append(int(i))
        if run:
            out.append(self.base.detokenize(run))
        return "".join(out)

    def __getattr__(self, name: str):  # eod, pad, cls, ... of the base tokenizer
        return getattr(self.__dict__["base"], name)


#: The input flags (argparse destinations) each ``--tokenizer-type`` reads; the others of
#: ``tokenizer_model vocab_file merge_file vocab_size`` it ignores.
TOKENIZER_INPUT_FLAGS: dict[str, tuple[str, ...]] = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "BertWordPieceLowerCase": ("vocab_file",), "BertWordPieceCase": ("vocab_file",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "HuggingFaceTokenizer": ("tokenizer_model",), "NullTokenizer": ("vocab_size",),
}


def unread_tokenizer_flags(tokenizer_type: str, **flags: object) -> list[str]:
    """``--flag=value`` of each given (not None) input flag of ``flags`` (destinations) that
    ``tokenizer_type`` does not read, in the order given."""
    reads = TOKENIZER_INPUT_FLAGS.get(tokenizer_type, tuple(flags))
    return [f"--{dest.replace('_', '-')}={value}" for dest, value in flags.items()
            if value is not None and dest not in reads]


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_size: int | None = None,
    vocab_extra_ids: int = 0,
) -> Tokenizer:
    """Build a tokenizer from Megatron-style arguments (``--tokenizer-type`` and its files);
    ``vocab_extra_ids > 0`` wraps it in :class:`ExtraIdsTokenizer`."""
    base = _build_base_tokenizer(tokenizer_type, tokenizer_model, vocab_file, merge_file,
                                 vocab_size)
    if vocab_extra_ids < 0:
        raise ValueError(f"--vocab-extra-ids={vocab_extra_ids}: must be >= 0")
    return ExtraIdsTokenizer(base, vocab_extra_ids) if vocab_extra_ids else base


def _build_base_tokenizer(tokenizer_type: str, tokenizer_model: str | None,
                          vocab_file: str | None, merge_file: str | None,
                          vocab_size: int | None) -> Tokenizer:

    def need(value: object, flag: str) -> None:
        if value is None:
            raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}")

    if tokenizer_type == "GPT2BPETokenizer":
        need(vocab_file, "--vocab-file (vocab.json)")
        need(merge_file, "--merge-file (merges.txt)")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        need(vocab_file, "--vocab-file (vocab.txt)")
        return BertWordPieceTokenizer(vocab_file, lower_case=tokenizer_type == "BertWordPieceLowerCase")
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        need(tokenizer_model, "--tokenizer-model (a SentencePiece .model file)")
        return SentencePieceTokenizer(tokenizer_model, bert_specials=tokenizer_type == "SentencePieceTokenizer")
    if tokenizer_type == "HuggingFaceTokenizer":
        need(tokenizer_model, "--tokenizer-model (a HuggingFace name or directory)")
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        need(vocab_size, "--vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type={tokenizer_type!r}: unknown; choose one of {', '.join(TOKENIZER_TYPES)}")
