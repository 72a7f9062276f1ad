"""Vision data: random images, the embedded pattern set, the image-folder reader and its errors."""

from __future__ import annotations

import builtins

import numpy as np
import pytest

from megatron_auto.data import DataInputError
from megatron_auto.data.vision import (ImageFolderDataset, MockImageDataset, PatternImageDataset,
                                       load_image)


@pytest.mark.pure
def test_mock_images_are_deterministic_per_index():
    a, b = MockImageDataset(3, 8, 6, 4, 10, seed=1), MockImageDataset(3, 8, 6, 4, 10, seed=1)
    assert len(a) == 10
    item = a[7]
    assert item["images"].shape == (3, 8, 6) and item["images"].dtype == np.float32
    np.testing.assert_array_equal(item["images"], b[7]["images"])
    assert not np.array_equal(a[7]["images"], a[8]["images"])
    assert {int(a[i]["labels"]) for i in range(10)} <= set(range(4))


@pytest.mark.pure
def test_pattern_set_is_deterministic_and_covers_every_class():
    ds = PatternImageDataset(3, 16, 16, 10, 500, seed=3)
    labels = [int(ds[i]["labels"]) for i in range(200)]
    assert set(labels) == set(range(10))
    np.testing.assert_array_equal(ds[5]["images"], PatternImageDataset(3, 16, 16, 10, 500, 3)[5]["images"])
    assert not np.array_equal(ds[5]["images"], PatternImageDataset(3, 16, 16, 10, 500, 4)[5]["images"])


@pytest.mark.pure
def test_pattern_classes_are_separable_by_their_mean_colour():
    # What makes the embedded set learnable in a few dozen steps: nearest class-mean colour
    # (estimated on 300 images) classifies 200 fresh ones almost perfectly.
    train = PatternImageDataset(3, 16, 16, 10, 10_000, seed=1)
    test = PatternImageDataset(3, 16, 16, 10, 10_000, seed=2)
    feats = lambda ds, idx: np.stack([ds[i]["images"].mean(axis=(1, 2)) for i in idx])
    ys = lambda ds, idx: np.array([int(ds[i]["labels"]) for i in idx])
    x, y = feats(train, range(300)), ys(train, range(300))
    centres = np.stack([x[y == k].mean(0) for k in range(10)])
    xt, yt = feats(test, range(200)), ys(test, range(200))
    pred = np.argmin(((xt[:, None] - centres[None]) ** 2).sum(-1), axis=1)
    assert (pred == yt).mean() > 0.9


@pytest.mark.pure
def test_pattern_kinds_differ_in_orientation():
    ds = PatternImageDataset(1, 16, 16, 5, 10, seed=0)
    horizontal, vertical = ds.pattern(0, 2.0, 0.3), ds.pattern(1, 2.0, 0.3)
    assert np.allclose(horizontal, horizontal[:, :1])  # constant along each row
    assert np.allclose(vertical, vertical[:1, :])  # constant along each column
    np.testing.assert_allclose(horizontal.T, vertical, atol=1e-6)


def _folder(tmp_path, classes=("cat", "dog"), per_class=2):
    root = tmp_path / "train"
    for k, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for j in range(per_class):
            np.save(root / name / f"{j}.npy", np.full((4, 6, 3), 60 * k + j, dtype=np.uint8))
    return root


@pytest.mark.pure
def test_image_folder_reads_npy_with_class_per_subfolder_and_resizes(tmp_path):
    root = _folder(tmp_path)
    (root / "dog" / "notes.txt").write_text("not an image")
    ds = ImageFolderDataset(str(root), num_channels=3, img_h=8, img_w=12)
    assert ds.classes == ["cat", "dog"] and len(ds) == 4
    item = ds[3]  # dog/1.npy: (H, W, C) uint8 of value 61, scaled to [0, 1] then [-1, 1]
    assert int(item["labels"]) == 1 and item["images"].shape == (3, 8, 12)
    np.testing.assert_allclose(item["images"], 2 * 61 / 255 - 1, rtol=1e-6)


@pytest.mark.pure
def test_image_folder_keeps_float_chw_arrays(tmp_path):
    root = tmp_path / "d"
    (root / "a").mkdir(parents=True)
    array = np.random.default_rng(0).random((1, 5, 5)).astype(np.float32)
    np.save(root / "a" / "x.npy", array)
    item = ImageFolderDataset(str(root), num_channels=1, img_h=5, img_w=5)[0]
    np.testing.assert_allclose(item["images"], 2 * array - 1, rtol=1e-6)


@pytest.mark.pure
def test_image_folder_reads_png_with_pillow(tmp_path):
    Image = pytest.importorskip("PIL.Image", reason="Pillow is optional; .npy is always read")
    root = tmp_path / "d"
    (root / "red").mkdir(parents=True)
    Image.new("RGB", (6, 4), (255, 0, 0)).save(root / "red" / "a.png")
    item = ImageFolderDataset(str(root), num_channels=3, img_h=4, img_w=6)[0]
    np.testing.assert_allclose(item["images"][0], 1.0)
    np.testing.assert_allclose(item["images"][1:], -1.0)


@pytest.mark.pure
def test_png_without_pillow_names_the_file_and_the_fix(tmp_path, monkeypatch):
    path = tmp_path / "a.png"
    path.write_bytes(b"\x89PNG")
    real_import = builtins.__import__

    def no_pil(name, *args, **kwargs):
        if name == "PIL" or name.startswith("PIL."):
            raise ImportError("no Pillow here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pil)
    with pytest.raises(DataInputError, match=r"a.png: reading .png images needs Pillow; install "
                                             r"it \(pip install pillow\) or convert"):
        load_image(str(path), 3)


@pytest.mark.single
@pytest.mark.parametrize("case, message", [
    ("missing", r"--data-path=.*nope: no such directory"),
    ("no-classes", r"no class sub-folders; put each class's images in its own sub-folder"),
    ("no-images", r"no images in the class folders"),
    ("too-many-classes", r"--num-classes=1: .* has 2 class folders; set --num-classes to at "
                         r"least 2"),
    ("channels", r"3 channels but --num-channels=2; set --num-channels"),
])
def test_image_folder_errors_name_the_flag_and_the_fix(tmp_path, case, message):
    num_classes, channels = None, 3
    if case == "missing":
        root = tmp_path / "nope"
    elif case == "no-classes":
        root = tmp_path / "flat"
        root.mkdir()
        np.save(root / "x.npy", np.zeros((2, 2)))
    elif case == "no-images":
        root = tmp_path / "empty"
        (root / "a").mkdir(parents=True)
    else:
        root = _folder(tmp_path)
        num_classes = 1 if case == "too-many-classes" else None
        channels = 2 if case == "channels" else 3
    with pytest.raises(DataInputError, match=message) as err:
        ds = ImageFolderDataset(str(root), channels, 4, 6, num_classes)
        ds[0]
    assert "\n" not in str(err.value)
