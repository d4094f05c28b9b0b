"""Generated data in the real on-disk formats, for trying a recipe, its tests and the
pipeline benchmark without a download: a CIFAR-10/100 python-format directory and an
ImageFolder tree of JPEG files. The images are noise with a class-dependent mean, so a
network can learn something from them; they are not CIFAR or ImageNet."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from .data import CIFAR_LAYOUT


def _images(labels: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """(N, 3, size, size) uint8 noise around a mean colour of each label."""
    palette = np.random.default_rng(1234).uniform(40, 215, (int(labels.max()) + 1, 3))
    tint = palette[labels][:, :, None, None]
    return rng.normal(tint, 40, (len(labels), 3, size, size)).clip(0, 255).astype(np.uint8)


def write_cifar(
    root: str | Path, name: str = "cifar10", train: int = 64, test: int = 32, seed: int = 0
) -> Path:
    """Write a `name` ("cifar10" or "cifar100") directory of `train` + `test` images in
    the python format under `root`; returns the directory (cifar-10-batches-py/...)."""
    folder, _, train_files, test_file = CIFAR_LAYOUT[name]
    where = Path(root) / folder
    where.mkdir(parents=True, exist_ok=True)
    classes = 10 if name == "cifar10" else 100
    key = "labels" if name == "cifar10" else "fine_labels"
    rng = np.random.default_rng(seed)
    shares = np.array_split(np.arange(train), len(train_files))
    for file, share in [*zip(train_files, shares, strict=True), (test_file, range(test))]:
        labels = rng.integers(0, classes, len(share))
        images = _images(labels, 32, rng)
        batch = {"data": images.reshape(len(share), -1), key: labels.tolist()}
        (where / file).write_bytes(pickle.dumps(batch))
    meta_file, meta_key = "batches.meta", "label_names"
    if classes == 100:
        meta_file, meta_key = "meta", "fine_label_names"
    names = [f"class{i}" for i in range(classes)]
    (where / meta_file).write_bytes(pickle.dumps({meta_key: names}))
    return where


def write_image_folder(
    root: str | Path,
    classes: int = 4,
    per_class: int = 4,
    size: int = 64,
    val_per_class: int = 2,
    seed: int = 0,
) -> Path:
    """Write root/train/<class>/<i>.jpg and root/val/<class>/<i>.jpg; returns root."""
    from PIL import Image

    root = Path(root)
    rng = np.random.default_rng(seed)
    for split, count in (("train", per_class), ("val", val_per_class)):
        for label in range(classes):
            folder = root / split / f"class{label:04d}"
            folder.mkdir(parents=True, exist_ok=True)
            images = _images(np.full(count, label), size, rng)
            for i, image in enumerate(images):
                Image.fromarray(image.transpose(1, 2, 0)).save(folder / f"{i}.jpg", quality=90)
    return root
