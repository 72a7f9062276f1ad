"""The embedded default corpus: Python standard-library docstrings and a SentencePiece model.

Both ship in ``megatron_auto/data/assets`` (built by ``tools/build_embedded_corpus.py``; the
text is the docstrings of the CPython standard library, PSF licence) so that training runs with
no data arguments at all. ``embedded_dataset()`` tokenizes the corpus into ``.bin/.idx`` once,
in a cache directory, and returns the data prefix and the tokenizer model path.
"""

from __future__ import annotations

import hashlib
import os

from megatron_auto.data.index_cache import default_cache_root
from megatron_auto.data.indexed_dataset import dataset_exists
from megatron_auto.data.preprocess import TokenizerArgs, output_prefix_for, preprocess_jsonl

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
CORPUS_FILE = "stdlib_docstrings.jsonl.gz"
TOKENIZER_FILE = "stdlib_docstrings_bpe.model"
# The tokenizer type to pair with the embedded model: its vocab holds <CLS>/<SEP>/<MASK> and
# a pad piece, so the same ids serve GPT and BERT ("GPTSentencePieceTokenizer" works too).
TOKENIZER_TYPE = "SentencePieceTokenizer"


def embedded_corpus_path() -> str:
    return _asset(CORPUS_FILE)


def embedded_tokenizer_model() -> str:
    return _asset(TOKENIZER_FILE)


def _asset(name: str) -> str:
    path = os.path.join(ASSETS_DIR, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path}: embedded asset missing; the package was installed without its data files "
            f"(setup.py package_data must include 'data/assets/*'), or rebuild it with "
            f"tools/build_embedded_corpus.py"
        )
    return path


def _digest(*paths: str) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


def embedded_dataset(cache_dir: str | None = None, split_sentences: bool = False) -> tuple[str, str]:
    """(data_prefix, tokenizer_model) of the embedded corpus, preprocessing it on first use.

    The files go to ``cache_dir`` (default ``$MEGATRON_AUTO_CACHE`` or ``~/.cache/megatron_auto``)
    under ``embedded/<hash of the assets>/``. Safe when several ranks call it at once: each
    writes private temporary files and renames them into place; the content is identical.
    ``split_sentences=True`` gives the sentence-level files (for BERT) instead.
    """
    corpus, model = embedded_corpus_path(), embedded_tokenizer_model()
    root = os.path.join(cache_dir or default_cache_root(), "embedded", _digest(corpus, model))
    base = os.path.join(root, "stdlib_docstrings")
    prefix = output_prefix_for(base, "text", split_sentences)
    if not dataset_exists(prefix):
        os.makedirs(root, exist_ok=True)
        preprocess_jsonl(
            corpus,
            base,
            TokenizerArgs(TOKENIZER_TYPE, tokenizer_model=model),
            json_keys=("text",),
            append_eod=True,
            workers=1,  # callers may hold threads or process groups: no fork here
            split_sentences=split_sentences,
            log=None,
        )
    return prefix, model
