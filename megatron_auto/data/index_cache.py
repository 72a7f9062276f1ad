"""Build-once, cache-on-disk numpy index arrays shared by the GPT, BERT and blended datasets.

Sample indices depend only on a few parameters (the data, the document range, the sample
count, the sequence length, the seed), so they are built once and stored as ``.npy`` files
named by a hash of those parameters. Several ranks may build the same arrays at the same time:
each writes a private temporary file and renames it into place (``atomicfile``), and
because the build is deterministic every rank ends up reading identical arrays.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, Callable

import numpy as np

from ..utils.atomicfile import atomic_open, atomic_write

logger = logging.getLogger(__name__)

INDEX_FORMAT_VERSION = 1  # bump when the index algorithm changes: old caches are then ignored


def default_cache_root() -> str:
    """``$MEGATRON_AUTO_CACHE`` or ``~/.cache/megatron_auto``."""
    return os.environ.get("MEGATRON_AUTO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megatron_auto")


def resolve_cache_dir(data_prefix: str | None, cache_dir: str | None, kind: str) -> str:
    """The directory for ``kind`` indices: ``cache_dir`` if given, else next to the data
    (``<data dir>/cache/<kind>``, as Megatron-LM does), else the user cache when that
    directory is not writable (read-only data mounts)."""
    if cache_dir:
        return os.path.join(cache_dir, kind)
    if data_prefix:
        data_dir = os.path.dirname(os.path.abspath(data_prefix))
        candidate = os.path.join(data_dir, "cache", kind)
        if os.access(data_dir, os.W_OK) or os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            return candidate
    return os.path.join(default_cache_root(), "indices", kind)


def params_hash(params: dict[str, Any]) -> str:
    """A short stable hash of JSON-serialisable parameters."""
    blob = json.dumps({"v": INDEX_FORMAT_VERSION, **params}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def array_digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()[:16]


def save_npy_atomic(path: str, arr: np.ndarray) -> None:
    with atomic_open(path, "wb") as f:
        np.save(f, arr, allow_pickle=False)


def cached_arrays(
    directory: str,
    key: str,
    names: tuple[str, ...],
    build: Callable[[], tuple[np.ndarray, ...]],
    description: str,
) -> tuple[np.ndarray, ...]:
    """Load ``names`` arrays cached under ``directory/key-<name>.npy`` or build and store them.

    Arrays are memory-mapped when loaded. A failure to write the cache (read-only disk) is
    logged and the freshly built arrays are used directly.
    """
    paths = [os.path.join(directory, f"{key}-{n}.npy") for n in names]
    if all(os.path.isfile(p) for p in paths):
        try:
            return tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)
        except (ValueError, OSError) as err:  # a damaged cache file: rebuild it
            logger.warning("rebuilding %s indices: cached file unreadable (%s)", description, err)
    arrays = build()
    try:
        os.makedirs(directory, exist_ok=True)
        # Write the first array last: it marks completeness for the isfile() check above.
        for p, a in list(zip(paths, arrays))[::-1]:
            save_npy_atomic(p, a)
        # Record what the hash stands for, to help people clean up caches.
        atomic_write(os.path.join(directory, f"{key}-description.txt"), description + "\n")
    except OSError as err:
        logger.warning("could not cache %s indices in %s (%s); using them uncached", description, directory, err)
    return arrays
