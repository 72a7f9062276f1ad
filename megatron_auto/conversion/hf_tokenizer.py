"""Tokenizers in conversion: ours -> a ``transformers`` tokenizer directory, and back.

Our checkpoints do not record the tokenizer their data was tokenized with, so an export takes
the data tools' tokenizer flags (``--tokenizer-type`` and its files, as for
``tools/preprocess_data.py``) and :func:`export_tokenizer` writes what ``AutoTokenizer``
loads next to the weights:

- ``GPT2BPETokenizer`` (``vocab.json`` + ``merges.txt``): ``GPT2Tokenizer`` over the same
  files, ``<|endoftext|>`` as eos, bos, unk and pad (GPT-2's own spellings);
- ``BertWordPieceLowerCase`` / ``BertWordPieceCase`` (``vocab.txt``): ``BertTokenizer`` with
  ``do_lower_case`` to match (lower-casing strips accents on both sides, as in BERT);
- ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer`` (a ``.model``): the model as
  ``tokenizer.model`` plus the ``tokenizer.json`` that transformers derives from it (its
  normalizer, dummy prefix and merges as SentencePiece applies them); the special tokens we
  append after a model's pieces (``<CLS>``... when the model lacks them) are added at the same
  ids;
- ``HuggingFaceTokenizer``: its directory (or ``tokenizer.json``) saved again.

Each is built by transformers from our files and written with ``save_pretrained`` (so the
files are transformers' own, ``tokenizer.json`` included), then read back with
``AutoTokenizer`` and checked to give our ids on a probe text before the export counts as done.

:func:`tokenizer_flags` goes the other way: an HF model directory's tokenizer -> the
``--tokenizer-type ...`` flags our data tools take. A GPT-2, BERT or SentencePiece tokenizer
maps onto our own implementation of it when that gives transformers' ids on the probe text;
any other (or one that differs) is ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model
DIR``, which tokenizes through transformers itself.

One difference is transformers' and stays: a special token's spelling inside the text
(``"</s>"``) is that special id for ``AutoTokenizer`` but plain characters for SentencePiece
and our BPE; ordinary text gets the same ids both ways.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

from ..data.embedded import embedded_tokenizer_model
from ..data.tokenizers import (TOKENIZER_INPUT_FLAGS, TOKENIZER_TYPES, SentencePieceTokenizer,
                               build_tokenizer)
from .hf_mapping import ConversionError

#: Text both tokenizers must agree on: spaces, tabs, newlines, punctuation, digits, accents,
#: CJK and an emoji (byte fallback / unknown pieces).
PROBE_TEXT = ("The quick brown fox, 12 jumps over 3456 lazy dogs!  Double  spaces,\ttabs\n"
              "and new lines. Café naïve résumé ÜBER 中文 😀 it's we'll x**2 (a=b) \"q\" end")


@dataclass(frozen=True)
class TokenizerSpec:
    """The data tools' tokenizer flags (argparse destinations of ``--tokenizer-type`` ...)."""

    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None

    def flags(self) -> list[str]:
        """The command-line flags that build this tokenizer."""
        out = ["--tokenizer-type", self.tokenizer_type]
        for dest in ("tokenizer_model", "vocab_file", "merge_file"):
            value = getattr(self, dest)
            if value is not None:
                out += [f"--{dest.replace('_', '-')}", value]
        return out


def _require_transformers() -> Any:
    from .hf import require_transformers  # noqa: PLC0415 - hf imports torch; keep it lazy

    return require_transformers()


def _build_ours(spec: TokenizerSpec) -> Any:
    """Our tokenizer of ``spec``; a missing or unreadable file is one ConversionError line."""
    try:
        return build_tokenizer(spec.tokenizer_type, tokenizer_model=spec.tokenizer_model,
                               vocab_file=spec.vocab_file, merge_file=spec.merge_file)
    except (OSError, ValueError, ImportError) as err:
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = "" if text.startswith("--") else f"--tokenizer-type={spec.tokenizer_type}: "
        raise ConversionError(where + text) from None


def check_tokenizer_spec(spec: TokenizerSpec) -> TokenizerSpec:
    """``spec`` with ``--tokenizer-model embedded`` resolved, or ConversionError naming the
    flag that is missing, unknown or not read by the type (checked before any work)."""
    kind = spec.tokenizer_type
    if kind not in TOKENIZER_TYPES:
        raise ConversionError(f"--tokenizer-type={kind}: unknown; choose one of "
                              f"{', '.join(TOKENIZER_TYPES)}")
    if kind == "NullTokenizer":
        raise ConversionError("--tokenizer-type=NullTokenizer: its ids are numbers written as "
                              "text, not a vocabulary transformers can load; export without "
                              "--tokenizer-type")
    reads = TOKENIZER_INPUT_FLAGS[kind]
    for dest in ("tokenizer_model", "vocab_file", "merge_file"):
        flag = f"--{dest.replace('_', '-')}"
        value = getattr(spec, dest)
        if value is not None and dest not in reads:
            raise ConversionError(f"{flag}={value}: --tokenizer-type {kind} does not read it; "
                                  f"drop it or choose the tokenizer type that does")
        if value is None and dest in reads:
            raise ConversionError(f"--tokenizer-type={kind}: needs {flag}; add it")
    if spec.tokenizer_model == "embedded" and kind != "HuggingFaceTokenizer":
        spec = TokenizerSpec(kind, embedded_tokenizer_model())
    return spec


def export_tokenizer(spec: TokenizerSpec, out_dir: str, model_vocab_size: int) -> str:
    """Write the tokenizer of ``spec`` into ``out_dir`` (which exists) as transformers' files;
    returns the transformers class name that loads it. ``model_vocab_size``: the model's
    (unpadded) vocabulary, which must hold every id of the tokenizer."""
    transformers = _require_transformers()
    spec = check_tokenizer_spec(spec)
    ours = _build_ours(spec)
    if ours.vocab_size > model_vocab_size:
        raise ConversionError(
            f"--tokenizer-type={spec.tokenizer_type}: the tokenizer has {ours.vocab_size} ids but "
            f"the model's vocabulary is {model_vocab_size}; give the tokenizer the model was "
            f"trained with")
    hf = _hf_tokenizer(transformers, spec, ours, out_dir)
    hf.save_pretrained(out_dir)
    back = transformers.AutoTokenizer.from_pretrained(out_dir)
    theirs = list(back.encode(PROBE_TEXT, add_special_tokens=False))
    if theirs != ours.tokenize(PROBE_TEXT):  # a tokenizer transformers reads differently
        raise ConversionError(
            f"--tokenizer-type={spec.tokenizer_type}: transformers' {type(back).__name__} "
            f"written to {out_dir} tokenizes differently from ours; export without "
            f"--tokenizer-type and tokenize with --tokenizer-type HuggingFaceTokenizer")
    return type(back).__name__


def _hf_tokenizer(transformers: Any, spec: TokenizerSpec, ours: Any, out_dir: str) -> Any:
    """transformers' tokenizer of ``spec``, built from our files copied into ``out_dir`` under
    the names its ``from_pretrained`` looks for (they stay there: the export ships them)."""
    kind = spec.tokenizer_type
    if kind == "GPT2BPETokenizer":
        _copy(spec.vocab_file, out_dir, "vocab.json")
        _copy(spec.merge_file, out_dir, "merges.txt")
        eod = "<|endoftext|>"
        return transformers.GPT2Tokenizer.from_pretrained(
            out_dir, eos_token=eod, bos_token=eod, unk_token=eod, pad_token=eod)
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        _copy(spec.vocab_file, out_dir, "vocab.txt")
        return transformers.BertTokenizer.from_pretrained(
            out_dir, do_lower_case=kind == "BertWordPieceLowerCase")
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        _copy(spec.tokenizer_model, out_dir, "tokenizer.model")
        hf = transformers.TokenizersBackend.from_pretrained(out_dir)
        _add_appended_specials(hf, ours)
        return hf
    try:  # HuggingFaceTokenizer: a directory, a hub name in the local cache, or tokenizer.json
        if spec.tokenizer_model.endswith(".json"):
            return transformers.PreTrainedTokenizerFast(tokenizer_file=spec.tokenizer_model)
        return transformers.AutoTokenizer.from_pretrained(spec.tokenizer_model)
    except (OSError, ValueError) as err:
        raise ConversionError(f"--tokenizer-model={spec.tokenizer_model}: transformers cannot "
                              f"load it ({str(err).strip().splitlines()[0]}); give a tokenizer "
                              f"directory or tokenizer.json") from None


def _add_appended_specials(hf: Any, ours: SentencePieceTokenizer) -> None:
    """Give ``hf`` the special tokens ours appends after the model's pieces (at the same ids,
    in id order) and our eod / pad as its eos / pad."""
    from tokenizers import AddedToken  # noqa: PLC0415 - a dependency of transformers

    appended = ours.appended_specials
    for pid, name in appended.items():
        hf.add_tokens([AddedToken(name, special=True, normalized=False)], special_tokens=True)
        if hf.convert_tokens_to_ids(name) != pid:  # ids follow the pieces in order on both sides
            raise ConversionError(f"--tokenizer-model={ours.model_file}: transformers gave "
                                  f"{name} id {hf.convert_tokens_to_ids(name)}, ours is {pid}; "
                                  f"export without --tokenizer-type")
    hf.eos_token = appended.get(ours.eod) or hf.convert_ids_to_tokens(ours.eod)
    hf.pad_token = appended.get(ours.pad) or hf.convert_ids_to_tokens(ours.pad)


def _copy(src: str | None, out_dir: str, name: str) -> None:
    assert src is not None  # check_tokenizer_spec required it
    dst = os.path.join(out_dir, name)
    if not os.path.exists(dst) or not os.path.samefile(src, dst):
        shutil.copyfile(src, dst)


# ------------------------------------------------------------------------- import
def tokenizer_flags(hf_dir: str, model_type: str) -> TokenizerSpec | None:
    """The data tools' tokenizer of the HF model directory ``hf_dir`` (None when it holds no
    tokenizer files). ``model_type`` (``gpt`` / ``bert``) picks between our two SentencePiece
    types. Our own implementation is named when it gives transformers' ids on the probe text;
    otherwise ``HuggingFaceTokenizer`` over the directory."""
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
    if not any(os.path.isfile(os.path.join(hf_dir, n)) for n in names):
        return None
    transformers = _require_transformers()
    try:
        hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    except (OSError, ValueError) as err:
        raise ConversionError(f"--load-dir={hf_dir}: transformers cannot load its tokenizer "
                              f"({str(err).strip().splitlines()[0]}); fix or remove the "
                              f"tokenizer files") from None
    expected = list(hf.encode(PROBE_TEXT, add_special_tokens=False))
    for spec in _native_candidates(hf, hf_dir, model_type):
        try:
            ours = _build_ours(spec)
        except ConversionError:
            continue
        if ours.tokenize(PROBE_TEXT) == expected and ours.vocab_size == len(hf):
            return spec
    return TokenizerSpec("HuggingFaceTokenizer", hf_dir)


def _native_candidates(hf: Any, hf_dir: str, model_type: str) -> list[TokenizerSpec]:
    """Our tokenizers that may match ``hf``, from the files its directory has."""
    def path(name: str) -> str | None:
        full = os.path.join(hf_dir, name)
        return full if os.path.isfile(full) else None

    out = []
    kind = type(hf).__name__
    if kind.startswith("GPT2") and path("vocab.json") and path("merges.txt"):
        out.append(TokenizerSpec("GPT2BPETokenizer", vocab_file=path("vocab.json"),
                                 merge_file=path("merges.txt")))
    if kind.startswith("Bert") and path("vocab.txt"):
        lower = bool(getattr(hf, "do_lower_case", True))
        out.append(TokenizerSpec("BertWordPieceLowerCase" if lower else "BertWordPieceCase",
                                 vocab_file=path("vocab.txt")))
    if path("tokenizer.model"):
        sp = "GPTSentencePieceTokenizer" if model_type == "gpt" else "SentencePieceTokenizer"
        out.append(TokenizerSpec(sp, tokenizer_model=path("tokenizer.model")))
    return out
