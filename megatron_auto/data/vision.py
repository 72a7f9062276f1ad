"""Image classification data: random images, an image-folder reader, an embedded pattern set.

Every dataset is a sequence of items ``{"images": float32 (C, H, W), "labels": int64 ()}``; the
entry script stacks them into the global batch. Items depend only on ``(seed, index)``, so every
rank that reads a batch sees the same images.

- :class:`MockImageDataset` (``--mock-data``): Gaussian noise images with uniform random labels.
- :class:`ImageFolderDataset` (``--data-path DIR``): one class per sub-folder of ``DIR`` (sorted
  names are the class ids), every file inside one image. ``.npy`` arrays are always read
  (``(H, W)``, ``(H, W, C)`` or ``(C, H, W)``; uint8 is scaled to [0, 1]); ``.png``, ``.jpg``,
  ``.jpeg``, ``.bmp``, ``.gif``, ``.webp`` need Pillow. Images of another size are resized
  (nearest neighbour) to ``img_h x img_w``; pixels are then mapped from [0, 1] to [-1, 1].
- :class:`PatternImageDataset` (no data flag): the embedded default, generated procedurally.
  Class ``k`` is pattern ``k mod 5`` (horizontal, vertical, diagonal or anti-diagonal stripes,
  or a checkerboard) in its own tint ``k``; frequency, phase and noise vary per image. The tint
  makes the set learnable by a small model within a few dozen steps (the first-order feature a
  freshly initialised ViT picks up at once), so a first run shows loss and accuracy improving;
  the patterns give attention something spatial to learn beyond it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .errors import DataInputError

NUM_PATTERNS = 5
PILLOW_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
IMAGE_SUFFIXES = (".npy",) + PILLOW_SUFFIXES


def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, index])


class MockImageDataset:
    """``num_samples`` noise images (C, H, W) with random labels in ``[0, num_classes)``."""

    def __init__(self, num_channels: int, img_h: int, img_w: int, num_classes: int,
                 num_samples: int, seed: int) -> None:
        self.shape = (num_channels, img_h, img_w)
        self.num_classes, self.num_samples, self.seed = num_classes, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = _rng(self.seed, index)
        return {"images": rng.standard_normal(self.shape, dtype=np.float32),
                "labels": np.int64(rng.integers(self.num_classes))}


def _tints(count: int, channels: int) -> np.ndarray:
    """``count`` distinct colour vectors (one weight per channel), fixed for every run."""
    angles = 2 * np.pi * (np.arange(count)[:, None] / max(count, 1)
                          + np.arange(channels)[None, :] / max(channels, 1))
    return (0.6 + 0.4 * np.cos(angles)).astype(np.float32)  # (count, C)


class PatternImageDataset:
    """The embedded learnable image set (see the module docstring)."""

    def __init__(self, num_channels: int, img_h: int, img_w: int, num_classes: int,
                 num_samples: int, seed: int, noise: float = 0.3) -> None:
        self.channels, self.img_h, self.img_w = num_channels, img_h, img_w
        self.num_classes, self.num_samples, self.seed, self.noise = (num_classes, num_samples,
                                                                     seed, noise)
        self.tints = _tints(num_classes, num_channels)
        self.rows = (np.arange(img_h, dtype=np.float32)[:, None] / img_h)  # (H, 1)
        self.cols = (np.arange(img_w, dtype=np.float32)[None, :] / img_w)  # (1, W)

    def __len__(self) -> int:
        return self.num_samples

    def pattern(self, kind: int, freq: float, phase: float) -> np.ndarray:
        """(H, W) pattern in [0, 1] of one of the five kinds."""
        r, c = self.rows, self.cols
        coord = [r + 0 * c, c + 0 * r, (r + c) / 2, (r - c) / 2][kind] if kind < 4 else None
        if coord is None:  # checkerboard
            wave = np.sign(np.sin(2 * np.pi * freq * r + phase)) * np.sign(
                np.sin(2 * np.pi * freq * c + phase))
        else:
            wave = np.sin(2 * np.pi * freq * coord + phase)
        return (0.5 + 0.5 * wave).astype(np.float32)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = _rng(self.seed, index)
        label = int(rng.integers(self.num_classes))
        kind, tint = label % NUM_PATTERNS, label
        freq = float(rng.uniform(1.5, 3.5))
        phase = float(rng.uniform(0, 2 * np.pi))
        image = self.tints[tint][:, None, None] * self.pattern(kind, freq, phase)[None]
        image = 2.0 * image - 1.0 + self.noise * rng.standard_normal(image.shape,
                                                                     dtype=np.float32)
        return {"images": image.astype(np.float32), "labels": np.int64(label)}


# ------------------------------------------------------------------------------ files
def _channels_last(shape: tuple[int, ...], channels: int) -> bool:
    """Whether a 3-d ``.npy`` array is (H, W, C) rather than (C, H, W).

    The side equal to ``--num-channels`` wins when only one side is; otherwise a side that is a
    usual channel count (1, 3, 4), the last one first (image tools store channels last).
    """
    first, last = shape[0] == channels, shape[-1] == channels
    if first != last:
        return last
    return shape[-1] in (1, 3, 4) or shape[0] not in (1, 3, 4)


def _to_chw(array: np.ndarray, channels: int, path: str) -> np.ndarray:
    if array.ndim == 2:
        array = array[None]
    elif array.ndim == 3 and _channels_last(array.shape, channels):
        array = np.moveaxis(array, -1, 0)  # (H, W, C) -> (C, H, W)
    if array.ndim != 3:
        raise DataInputError(f"{path}: an image array of shape {array.shape}; store (H, W), "
                             f"(H, W, C) or (C, H, W)")
    if array.shape[0] == 1 and channels > 1:
        array = np.repeat(array, channels, axis=0)
    if array.shape[0] != channels:
        raise DataInputError(f"{path}: {array.shape[0]} channels but --num-channels={channels}; "
                             f"set --num-channels to match the images or convert them")
    return array


def _resize(array: np.ndarray, img_h: int, img_w: int) -> np.ndarray:
    """Nearest-neighbour resize of (C, H, W) to (C, img_h, img_w)."""
    _, h, w = array.shape
    if (h, w) == (img_h, img_w):
        return array
    rows = (np.arange(img_h) * h) // img_h
    cols = (np.arange(img_w) * w) // img_w
    return array[:, rows][:, :, cols]


def load_image(path: str, channels: int) -> np.ndarray:
    """One image file as float (C, H, W) in [0, 1] (uint8 scaled; float arrays as stored)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise DataInputError(f"{path}: not a readable .npy array ({err}); re-save it with "
                                 f"numpy.save") from None
    else:
        try:
            from PIL import Image  # optional dependency: only for image formats other than .npy
        except ImportError:
            raise DataInputError(f"{path}: reading {suffix} images needs Pillow; install it "
                                 f"(pip install pillow) or convert the images to .npy "
                                 f"arrays") from None
        try:
            with Image.open(path) as img:
                img = img.convert("L" if channels == 1 else "RGB")
                array = np.asarray(img)
            if array.ndim == 3:
                array = np.moveaxis(array, -1, 0)  # Pillow gives (H, W, C)
        except OSError as err:
            raise DataInputError(f"{path}: not a readable image ({err}); replace or remove "
                                 f"the file") from None
    if array.dtype == np.uint8:
        array = array.astype(np.float32) / 255.0
    return _to_chw(np.asarray(array, dtype=np.float32), channels, path)


class ImageFolderDataset:
    """Images under ``root/<class name>/<file>``; classes are the sorted sub-folder names."""

    def __init__(self, root: str, num_channels: int, img_h: int, img_w: int,
                 num_classes: int | None = None, flag: str = "--data-path") -> None:
        if not os.path.isdir(root):
            raise DataInputError(f"{flag}={root}: no such directory; give a folder with one "
                                 f"sub-folder of images per class")
        self.classes = sorted(d for d in os.listdir(root)
                              if os.path.isdir(os.path.join(root, d)))
        if not self.classes:
            raise DataInputError(f"{flag}={root}: no class sub-folders; put each class's "
                                 f"images in its own sub-folder (root/<class>/<image>)")
        if num_classes is not None and len(self.classes) > num_classes:
            raise DataInputError(f"--num-classes={num_classes}: {root} has {len(self.classes)} "
                                 f"class folders; set --num-classes to at least "
                                 f"{len(self.classes)}")
        self.samples: list[tuple[str, int]] = []
        for label, name in enumerate(self.classes):
            folder = os.path.join(root, name)
            for file in sorted(os.listdir(folder)):
                if file.lower().endswith(IMAGE_SUFFIXES):
                    self.samples.append((os.path.join(folder, file), label))
        if not self.samples:
            raise DataInputError(f"{flag}={root}: no images in the class folders (looked for "
                                 f"{', '.join(IMAGE_SUFFIXES)})")
        self.channels, self.img_h, self.img_w = num_channels, img_h, img_w

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        path, label = self.samples[index]
        image = _resize(load_image(path, self.channels), self.img_h, self.img_w)
        return {"images": (2.0 * image - 1.0).astype(np.float32), "labels": np.int64(label)}
