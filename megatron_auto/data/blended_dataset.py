"""Weighted interleaving of several datasets (``--data-path 0.3 A 0.7 B``).

Dataset ``d`` with normalised weight ``w_d`` should have served about ``w_d * n`` of the first
``n`` samples for every ``n``. We schedule its ``k``-th sample at the ideal "time"
``(k + 0.5) / w_d`` and serve samples in order of those times (ties broken by dataset order):
after ``n`` samples every dataset's count is within one of ``w_d * n``. The schedule is a sort,
so it is vectorised (no per-sample Python loop) and deterministic; it is cached like the other
indices.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_auto.data.index_cache import cached_arrays, params_hash, resolve_cache_dir


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"blend weights {list(weights)}: need non-negative numbers with a positive sum")
    return w / w.sum()


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index), each (size,): item ``i`` is sample
    ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``."""
    w = normalize_weights(weights)
    keys, owners, ranks = [], [], []
    for d, wd in enumerate(w):
        if wd == 0:
            continue
        count = int(np.ceil(wd * size)) + 1  # enough candidates: at most ceil(w*size)+1 are used
        k = np.arange(count, dtype=np.int64)
        keys.append((k + 0.5) / wd)
        owners.append(np.full(count, d, dtype=np.int16))
        ranks.append(k)
    order = np.argsort(np.concatenate(keys), kind="stable")[:size]
    return np.concatenate(owners)[order].astype(np.int16), np.concatenate(ranks)[order].astype(np.int64)


def samples_per_dataset(weights: Sequence[float], size: int) -> list[int]:
    """How many samples each dataset must provide for a blend of ``size`` items."""
    dataset_index, _ = build_blending_indices(weights, size)
    return np.bincount(dataset_index, minlength=len(weights)).tolist()


class BlendedDataset:
    """``size`` items drawn from ``datasets`` in proportion to ``weights``.

    Each dataset must have at least ``samples_per_dataset(weights, size)[d]`` items.
    """

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[float],
        size: int,
        cache_dir: str | None = None,
        cache_key_parts: Sequence[str] = (),
    ) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"BlendedDataset: {len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = int(size)
        key = params_hash(
            {"kind": "blend", "weights": self.weights.tolist(), "size": self.size, "parts": list(cache_key_parts)}
        )
        if cache_dir is not None:
            self.dataset_index, self.dataset_sample_index = cached_arrays(
                resolve_cache_dir(None, cache_dir, "BlendedDataset_indices"),
                key,
                ("dataset_index", "dataset_sample_index"),
                lambda: build_blending_indices(self.weights, self.size),
                f"BlendedDataset weights={self.weights.tolist()} size={self.size}",
            )
        else:  # a sort of `size` keys: cheap enough to redo on every start
            self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, self.size)
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (ds, need) in enumerate(zip(self.datasets, counts)):
            if need and len(ds) < need:
                raise ValueError(
                    f"BlendedDataset: dataset {d} has {len(ds)} samples but the blend needs {need}; "
                    f"build it with samples_per_dataset(weights, size)"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.size:
            raise IndexError(f"BlendedDataset: index {idx} out of range [0, {self.size})")
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]
