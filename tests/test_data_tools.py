"""tools/build_embedded_corpus.py and tools/train_tokenizer.py on tiny inputs."""

import pytest

import gzip
import importlib.util
import json
import os

from megatron_auto.data import build_tokenizer

pytestmark = pytest.mark.pure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MODULE_SRC = '''"""A module docstring that is long enough to be kept as a document of the corpus, surely."""


def helper():
    """Short."""


def long_function():
    """Return something useful. This docstring is long enough to become its own document."""


class Widget:
    """A widget. The class docstring and the method docstrings form one document."""

    def spin(self):
        """Spin the widget around its axis, fast."""
'''


def test_build_embedded_corpus_from_fake_stdlib(tmp_path):
    tool = load_tool("build_embedded_corpus")
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    (lib / "test").mkdir()
    (lib / "pkg" / "__init__.py").write_text(MODULE_SRC)
    (lib / "test" / "test_x.py").write_text(MODULE_SRC)  # test suites are skipped
    (lib / "broken.py").write_text("def (:\n")  # unparsable files are skipped
    tool.main(["--output-dir", str(tmp_path / "out"), "--stdlib", str(lib), "--no-tokenizer"])
    with gzip.open(tmp_path / "out" / "stdlib_docstrings.jsonl.gz", "rt") as f:
        docs = [json.loads(line) for line in f]
    assert [d["source"] for d in docs] == ["pkg", "pkg.long_function", "pkg.Widget"]
    assert docs[2]["text"] == (
        "A widget. The class docstring and the method docstrings form one document.\n\n"
        "Spin the widget around its axis, fast."
    )


def test_train_tokenizer_reserves_specials(tmp_path):
    tool = load_tool("train_tokenizer")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Sample text number {i}.\n  Indented line {i}."}) + "\n"
                              for i in range(300)))
    model = tool.train(str(corpus), str(tmp_path / "tok"), vocab_size=320)  # 256 byte pieces + specials + a few merges
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    assert (tok.eod, tok.pad, tok.cls, tok.sep, tok.mask, tok.vocab_size) == (2, 3, 4, 5, 6, 320)
    text = "Sample  text\n   number 7. ünïcode"
    assert tok.detokenize(tok.tokenize(text)) == text  # identity normalisation + byte fallback
