"""Data sets: scikit-learn's digits (embedded, offline), CIFAR-10/100 from a local
directory in the standard python format, and an ImageFolder tree from a local directory.
A missing or malformed directory is an error naming the path and the expected layout."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

# name: (expected files in words, training files, test file, label key)
CIFAR_LAYOUT = {
    "cifar10": (
        "data_batch_1 ... data_batch_5 and test_batch",
        [f"data_batch_{i}" for i in range(1, 6)],
        "test_batch",
        b"labels",
    ),
    "cifar100": ("train and test", ["train"], "test", b"fine_labels"),
}


def digits(seed: int = 0, test_fraction: float = 0.25) -> tuple[TensorDataset, TensorDataset]:
    """1,797 real 8x8 handwritten digits (ships inside scikit-learn), split with `seed`."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = (images - 0.3) / 0.4
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(len(labels) * (1 - test_fraction))
    train, test = order[:cut], order[cut:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def cifar(root: str | Path, name: str = "cifar10") -> tuple[TensorDataset, TensorDataset]:
    """CIFAR-10/100 from `root`, the extracted python version (cifar-10-batches-py/)."""
    root = Path(root)
    expected, train_files, test_file, label_key = CIFAR_LAYOUT[name]
    missing = [f for f in [*train_files, test_file] if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{root} is not a {name} directory in the python format: missing {missing}; "
            f"expected the files {expected} (the extracted cifar-*-python archive)"
        )

    def load(files: list[str]) -> TensorDataset:
        images, labels = [], []
        for file in files:
            try:
                with open(root / file, "rb") as f:
                    batch = pickle.load(f, encoding="bytes")
                images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
                labels.extend(batch[label_key])
            except (KeyError, ValueError, pickle.UnpicklingError, EOFError) as error:
                raise ValueError(f"{root / file} is not a {name} batch: {error}") from error
        x = torch.tensor(np.concatenate(images), dtype=torch.float32) / 255.0
        mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
        std = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)
        return TensorDataset((x - mean) / std, torch.tensor(labels, dtype=torch.long))

    return load(train_files), load([test_file])


def image_folder(root: str | Path, size: int = 224):
    """ImageNet-style train/ and val/ class folders under `root` (torchvision ImageFolder)."""
    from torchvision import datasets, transforms

    root = Path(root)
    for split in ("train", "val"):
        if not (root / split).is_dir() or not any((root / split).iterdir()):
            raise FileNotFoundError(
                f"{root} needs {split}/<class>/<image> folders (ImageFolder layout); "
                f"{root / split} is missing or empty"
            )
    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train = transforms.Compose(
        [transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
         transforms.ToTensor(), normalize]
    )  # fmt: skip
    val = transforms.Compose(
        [transforms.Resize(int(size * 8 / 7)), transforms.CenterCrop(size),
         transforms.ToTensor(), normalize]
    )  # fmt: skip
    return datasets.ImageFolder(root / "train", train), datasets.ImageFolder(root / "val", val)


def loaders(train, test, batch_size: int, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """Shuffled training batches (each rank its shard under torch.distributed, reshuffled
    per epoch with `sampler.set_epoch`) and the whole test set in order."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        sampler = torch.utils.data.DistributedSampler(train, shuffle=True, seed=seed)
        training = DataLoader(train, batch_size=batch_size, sampler=sampler)
    else:
        generator = torch.Generator().manual_seed(seed)
        training = DataLoader(train, batch_size=batch_size, shuffle=True, generator=generator)
    return training, DataLoader(test, batch_size=512)
