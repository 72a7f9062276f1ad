#!/usr/bin/env python
"""Build the embedded default corpus from the Python standard library's docstrings.

Every CPython install carries its standard library's source, whose docstrings are real English
technical prose under the PSF licence (redistributable). This script parses each module with
``ast`` (nothing is imported or executed), gathers docstrings into documents (a module's own
docstring; each top-level function; each class together with its methods), and writes them
as gzip-compressed JSON lines ``{"text": ..., "source": "module.Qualname"}``. It then trains the
SentencePiece model that ships next to the corpus (``tools/train_tokenizer.py``).

Example (what produced megatron_auto/data/assets)::

    python tools/build_embedded_corpus.py --output-dir megatron_auto/data/assets --vocab-size 8192
"""

from __future__ import annotations

import argparse
import ast
import gzip
import inspect
import json
import os
import subprocess
import sys
import sysconfig

# Test suites, demos and vendored or generated code: little prose, much noise.
SKIP_PARTS = {
    "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3", "turtledemo",
    "ensurepip", "encodings",
}
MIN_CHARS = 80  # shorter docstrings ("Return self.") teach little


def stdlib_files(root: str) -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_PARTS and not d.startswith("."))
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return sorted(files)


def _doc(node: ast.AST) -> str:
    doc = ast.get_docstring(node, clean=True)
    return doc.strip() if doc else ""


def topic_documents(tree: ast.Module, module: str) -> list[dict[str, str]]:
    """pydoc_data/topics.py holds the language reference as a dict of strings (pydoc's help)."""
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and isinstance(value, ast.Constant) and isinstance(value.value, str):
                    text = value.value.strip()
                    if len(text) >= MIN_CHARS:
                        docs.append({"text": text, "source": f"{module}:{key.value}"})
    return docs


def module_documents(path: str, module: str) -> list[dict[str, str]]:
    """Documents of one source file (empty if it does not parse)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    if module == "pydoc_data.topics":
        return topic_documents(tree, module)
    docs = []
    top = _doc(tree)
    if len(top) >= MIN_CHARS:
        docs.append({"text": top, "source": module})
    # Every class (at any depth) is one document with its methods; every other function is one.
    methods = {id(sub) for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for sub in node.body}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(node) not in methods:
            text = _doc(node)
            if len(text) >= MIN_CHARS:
                docs.append({"text": text, "source": f"{module}.{node.name}"})
        elif isinstance(node, ast.ClassDef):
            parts = [_doc(node)]
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    parts.append(_doc(sub))
            text = "\n\n".join(p for p in parts if len(p) >= 20)
            if len(text) >= MIN_CHARS:
                docs.append({"text": inspect.cleandoc(text), "source": f"{module}.{node.name}"})
    return docs


def build_corpus(stdlib_root: str, output: str, max_bytes: int) -> tuple[int, int]:
    """Write the corpus; returns (documents, text bytes). Stops adding modules past ``max_bytes``."""
    n_docs = n_bytes = 0
    with gzip.open(output, "wt", encoding="utf-8", compresslevel=9) as out:
        # mtime=0 would be nicer for reproducibility; gzip.open has no such argument, and the
        # asset hash only matters for the cache key.
        for path in stdlib_files(stdlib_root):
            module = os.path.relpath(path, stdlib_root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            for doc in module_documents(path, module):
                line = json.dumps(doc, ensure_ascii=False)
                out.write(line + "\n")
                n_docs += 1
                n_bytes += len(doc["text"].encode("utf-8"))
            if n_bytes >= max_bytes:
                break
    return n_docs, n_bytes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", required=True, help="where to write the corpus and the tokenizer model")
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="standard library directory")
    p.add_argument("--max-mb", type=float, default=8.0, help="stop after this much docstring text")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--no-tokenizer", action="store_true", help="write only the corpus")
    args = p.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    corpus = os.path.join(args.output_dir, "stdlib_docstrings.jsonl.gz")
    n_docs, n_bytes = build_corpus(args.stdlib, corpus, int(args.max_mb * 1e6))
    print(f"{corpus}: {n_docs} documents, {n_bytes / 1e6:.2f} MB text, "
          f"{os.path.getsize(corpus) / 1e6:.2f} MB compressed (Python {sys.version.split()[0]} stdlib)")
    if not args.no_tokenizer:
        here = os.path.dirname(os.path.abspath(__file__))
        subprocess.run(
            [sys.executable, os.path.join(here, "train_tokenizer.py"), "--input", corpus,
             "--model-prefix", os.path.join(args.output_dir, "stdlib_docstrings_bpe"),
             "--vocab-size", str(args.vocab_size), "--model-type", "bpe",
             "--overwrite"],  # regenerating the shipped assets replaces them by design
            check=True,
        )


if __name__ == "__main__":
    main()
