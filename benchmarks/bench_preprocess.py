#!/usr/bin/env python
"""Throughput of tools/preprocess_data.py: docs/s and tokens/s on a ~50 MB JSON-lines file.

The input repeats the embedded corpus (stdlib docstrings) until it reaches ``--size-mb``; it is
tokenized with the embedded SentencePiece model, ``--append-eod``, ``--workers 2`` by default.

    python benchmarks/bench_preprocess.py [--size-mb 50] [--workers 2]
"""

from __future__ import annotations

import argparse
import gzip
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_auto.data.embedded import embedded_corpus_path  # noqa: E402
from megatron_auto.data.indexed_dataset import IndexedDataset  # noqa: E402


def make_input(path: str, size_mb: float) -> int:
    """Write ``size_mb`` of JSON lines; returns the number of documents."""
    with gzip.open(embedded_corpus_path(), "rt", encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    target, written, docs = size_mb * 1e6, 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            for line in lines:
                out.write(line)
                written += len(line.encode("utf-8"))
                docs += 1
                if written >= target:
                    break
    return docs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=50.0)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "input.jsonl")
        docs = make_input(src, args.size_mb)
        print(f"input: {src} {os.path.getsize(src) / 1e6:.1f} MB, {docs} documents")
        prefix = os.path.join(tmp, "bench")
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", src,
             "--output-prefix", prefix, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
             "embedded", "--append-eod", "--workers", str(args.workers), "--log-interval", "20000"],
            check=True,
        )
        wall = time.perf_counter() - start
        # CPU seconds of the tool and its workers: on a shared machine wall time mostly
        # measures the neighbours, tokens per CPU second measures us.
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = usage.ru_utime + usage.ru_stime
        ds = IndexedDataset(prefix + "_text_document")
        print(f"RESULT workers={args.workers} size_mb={args.size_mb:.0f} documents={ds.num_documents} "
              f"tokens={ds.num_tokens} wall_s={wall:.1f} docs_per_s={ds.num_documents / wall:.0f} "
              f"tokens_per_s={ds.num_tokens / wall:.0f} MB_per_s={args.size_mb / wall:.2f} "
              f"cpu_s={cpu:.1f} tokens_per_cpu_s={ds.num_tokens / cpu:.0f} load={os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
