"""Data sets and loaders of the pipeline.

- digits: scikit-learn's 8x8 digits (embedded, offline), held in memory;
- cifar10 / cifar100: torchvision.datasets.CIFAR10/100 from a local directory (the
  extracted python version), with the paper's training augmentation (random crop 32 with
  padding 4, horizontal flip) unless `augment` is off;
- imagefolder: torchvision ImageFolder train/ and val/ trees (ImageNet), RandomResizedCrop
  and flip for training, Resize + CenterCrop for evaluation.

A missing or malformed directory is an error naming the path and the expected layout.

The order of an epoch and the random augmentation of every sample are functions of
(seed, epoch, position), drawn by `EpochSampler`: a run resumed at any step, with any
number of loader workers, sees the same batches as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from collections.abc import Callable, Iterator, Sized
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset
from torchvision import datasets

from .errors import UsageError
from .safe_pickle import load_data_pickle
from .text_data import TokenBlocks

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# name: (folder torchvision expects, expected files in words, training files, test file)
CIFAR_LAYOUT = {
    "cifar10": (
        "cifar-10-batches-py",
        "data_batch_1 ... data_batch_5, test_batch and batches.meta",
        [f"data_batch_{i}" for i in range(1, 6)],
        "test_batch",
    ),
    "cifar100": ("cifar-100-python", "train, test and meta", ["train"], "test"),
}
MAX_DEFAULT_WORKERS = 8


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


def cifar_transforms(augment: bool) -> tuple[Callable, Callable]:
    """Training and evaluation transforms of CIFAR images (PIL in, normalized tensor out):
    random crop 32 with padding 4 and horizontal flip for training when `augment`."""
    from torchvision import transforms

    finish = [transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)]
    random = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
    return transforms.Compose((random if augment else []) + finish), transforms.Compose(finish)


class _PresenceChecked:
    """torchvision's CIFAR data set on the folder given, its batch files read with the
    restricted unpickler (safe_pickle) instead of pickle, and torchvision's md5 check of
    its own archive replaced by the presence check of `cifar` (done before construction)."""

    # torchvision's CIFAR10/CIFAR100 class attributes: the batch files and the names' file
    train_list: list[list[str]]
    test_list: list[list[str]]
    meta: dict[str, str]

    def __init__(self, folder: Path, train: bool = True, transform=None) -> None:
        datasets.VisionDataset.__init__(self, str(folder.parent), transform=transform)
        self.base_folder = folder.name
        self.train = train
        images, self.targets = [], []
        for file_name, _md5 in self.train_list if train else self.test_list:
            entry = load_data_pickle(folder / file_name)
            images.append(entry["data"])
            self.targets.extend(entry["labels"] if "labels" in entry else entry["fine_labels"])
        self.data = np.vstack(images).reshape(-1, 3, 32, 32).transpose((0, 2, 3, 1))
        meta = load_data_pickle(folder / self.meta["filename"])
        self.classes = meta[self.meta["key"]]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}


class LocalCIFAR10(_PresenceChecked, datasets.CIFAR10):
    """CIFAR-10 from a local cifar-10-batches-py folder (any name)."""


class LocalCIFAR100(_PresenceChecked, datasets.CIFAR100):
    """CIFAR-100 from a local cifar-100-python folder (any name)."""


def _cifar_folder(root: Path, name: str) -> Path:
    """The directory holding the batch files: `root` itself or root/<torchvision folder>."""
    folder = CIFAR_LAYOUT[name][0]
    return root / folder if (root / folder).is_dir() else root


def cifar(root: str | Path, name: str = "cifar10", augment: bool = True) -> tuple[Dataset, Dataset]:
    """CIFAR-10/100 through torchvision.datasets from `root`: the extracted python
    version (cifar-10-batches-py/ or cifar-100-python/) or the folder that holds it.

    torchvision's md5 check of the files is replaced by a check that every file is
    present and unpickles as a batch, so a copy re-packed by the user (or generated by
    the tests) is read too."""
    root = Path(root)
    folder, expected, train_files, test_file = CIFAR_LAYOUT[name]
    where = _cifar_folder(root, name)
    meta = "batches.meta" if name == "cifar10" else "meta"
    missing = [f for f in [*train_files, test_file, meta] if not (where / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{root} is not a {name} directory in the python format: missing {missing}; "
            f"expected the files {expected} in {root} or in {root / folder} "
            "(the extracted cifar-*-python archive)"
        )
    cls = LocalCIFAR10 if name == "cifar10" else LocalCIFAR100
    train_transform, test_transform = cifar_transforms(augment)
    sets = []
    for train, transform in ((True, train_transform), (False, test_transform)):
        try:
            sets.append(cls(where, train=train, transform=transform))
        except UsageError:  # refused by the restricted unpickler: its own message
            raise
        except (KeyError, ValueError, EOFError, TypeError, AttributeError) as error:
            raise UsageError(
                f"{where} is not a {name} directory: a batch file does not hold the "
                f"python-format arrays ({type(error).__name__}: {error})"
            ) from error
    for dataset in sets:
        if dataset.data.shape[1:] != (32, 32, 3) or len(dataset.data) != len(dataset.targets):
            raise UsageError(f"{where} is not a {name} batch set: images of {dataset.data.shape}")
    return sets[0], sets[1]


class CheckedImageFolder(datasets.ImageFolder):
    """torchvision's ImageFolder whose unreadable image (truncated, not an image) is an
    error naming the file, or with `skip_bad_files` is replaced by the next readable
    sample of the folder and recorded: `bad_files()` lists them, from every loader
    worker (they append to a file, since workers are separate processes)."""

    def __init__(self, root: Path, transform, skip_bad_files: bool = False) -> None:
        super().__init__(str(root), transform)
        self.skip_bad_files = skip_bad_files
        self.record: str | None = None
        if skip_bad_files:
            handle, self.record = tempfile.mkstemp(prefix="dtp-bad-files-", suffix=".txt")
            os.close(handle)
            # removed with this data set, by the process that made it (forked loader
            # workers share the object, not the ownership)
            weakref.finalize(self, _remove, self.record, os.getpid())

    def __getitem__(self, index: int):
        for offset in range(len(self.samples)):
            where = (index + offset) % len(self.samples)
            try:
                return super().__getitem__(where)
            except OSError as error:  # PIL: truncated file, or not an image at all
                path = self.samples[where][0]
                if self.record is None:  # not skip_bad_files
                    raise UsageError(
                        f"{path}: the image cannot be read ({error}); fix or remove it, or set "
                        "data.skip_bad_files=true to leave unreadable files out"
                    ) from None
                with open(self.record, "a") as f:
                    f.write(path + "\n")
        raise UsageError(f"{self.root}: no image in it can be read")

    def bad_files(self) -> list[str]:
        """The unreadable files met so far (each once), in the order first met."""
        if self.record is None or not os.path.exists(self.record):
            return []
        with open(self.record) as f:
            return list(dict.fromkeys(line.rstrip("\n") for line in f if line.strip()))


def _remove(path: str, owner: int) -> None:
    if os.getpid() == owner:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def skipped_files(*loaders: DataLoader) -> list[str]:
    """The unreadable image files the loaders' data sets left out (skip_bad_files)."""
    found: list[str] = []
    for loader in loaders:
        dataset = loader.dataset
        dataset = dataset.dataset if isinstance(dataset, SeededSamples) else dataset
        if isinstance(dataset, CheckedImageFolder):
            found += dataset.bad_files()
    return list(dict.fromkeys(found))


def image_folder(
    root: str | Path, size: int = 224, augment: bool = True, skip_bad_files: bool = False
) -> tuple[Dataset, Dataset]:
    """ImageNet-style train/ and val/ class folders under `root` (torchvision ImageFolder):
    RandomResizedCrop(size) + horizontal flip for training (a center crop without
    `augment`), Resize(size * 8 / 7) + CenterCrop(size) for evaluation (256 / 224). An
    unreadable image stops the run naming the file, or with `skip_bad_files` is left out
    and counted (CheckedImageFolder)."""
    from torchvision import transforms

    root = Path(root)
    for split in ("train", "val"):
        if not (root / split).is_dir() or not any((root / split).iterdir()):
            raise FileNotFoundError(
                f"{root} needs {split}/<class>/<image> folders (ImageFolder layout); "
                f"{root / split} is missing or empty"
            )
    normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    center = [transforms.Resize(round(size * 8 / 7)), transforms.CenterCrop(size)]
    random = [transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip()]
    finish = [transforms.ToTensor(), normalize]
    train = transforms.Compose((random if augment else center) + finish)
    val = transforms.Compose(center + finish)
    return (
        CheckedImageFolder(root / "train", train, skip_bad_files),
        CheckedImageFolder(root / "val", val, skip_bad_files),
    )


class EpochSampler(Sampler):
    """Yields (index, sample seed) pairs: the shuffled order of an epoch and a seed per
    sample, both drawn from a generator seeded with (seed, epoch), so an epoch is the same
    whichever step it resumes at and however many workers load it. With `world` > 1 each
    rank takes every world-th position of the padded order (as DistributedSampler)."""

    def __init__(
        self, length: int, seed: int = 0, shuffle: bool = True, rank: int = 0, world: int = 1
    ) -> None:
        if not 0 <= rank < world:
            raise UsageError(f"rank = {rank}; it must be in [0, {world})")
        self.length, self.seed, self.shuffle = length, seed, shuffle
        self.rank, self.world = rank, world
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Draw epoch `epoch`'s order; skip its first `start` samples of this rank."""
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        """Samples of a whole epoch on this rank (whatever `start` skips)."""
        return -(-self.length // self.world)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = (
            torch.randperm(self.length, generator=generator)
            if self.shuffle
            else torch.arange(self.length)
        )
        seeds = torch.randint(1 << 62, (self.length,), generator=generator)
        total = -(-self.length // self.world) * self.world
        positions = torch.arange(total) % self.length  # pad by wrapping, as DistributedSampler
        mine = positions[self.rank :: self.world][self.start :]
        yield from zip(order[mine].tolist(), seeds[mine].tolist(), strict=True)


class SeededSamples(Dataset):
    """`dataset[index]` with its transform's random draws made from the sample's seed;
    the caller's CPU RNG state (dropout, initialisation) is put back afterwards."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))

    def __getitem__(self, item: tuple[int, int]):
        index, seed = item
        # The CPU generator alone: torch.manual_seed also seeds every accelerator, which
        # costs ~80 us a sample; torchvision's transforms draw from the CPU generator.
        generator = torch.default_generator
        state = generator.get_state()
        generator.manual_seed(seed)
        try:
            return self.dataset[index]
        finally:
            generator.set_state(state)


def epoch_sampler(loader: DataLoader) -> tuple[EpochSampler, int]:
    """The EpochSampler `loaders` gave `loader`, and the loader's batch size: what a stage
    resumes mid-epoch with. UsageError for another loader."""
    sampler, batch = loader.sampler, loader.batch_size
    if not isinstance(sampler, EpochSampler) or batch is None:
        raise UsageError(
            f"the training loader draws with {type(sampler).__name__} and batch size {batch}; "
            "a stage trains from the loaders data.loaders makes (an EpochSampler, a batch size)"
        )
    return sampler, batch


def default_workers(dataset: Dataset) -> int:
    """Loader workers when data.num_workers is null: none for a data set held in memory
    as tensors or token ids (nothing to decode), else this process's share of the cores,
    at most 8."""
    if isinstance(dataset, TensorDataset | TokenBlocks):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = (cores or 1) // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    return max(1, min(share, MAX_DEFAULT_WORKERS))


def loaders(
    train: Dataset,
    test: Dataset,
    batch_size: int,
    seed: int = 0,
    *,
    eval_batch_size: int = 512,
    num_workers: int | None = None,
    pin_memory: bool = False,
    persistent_workers: bool = True,
    prefetch_factor: int | None = None,
) -> tuple[DataLoader, DataLoader]:
    """Shuffled training batches drawn by an EpochSampler (each rank its shard under
    torch.distributed; call `loader.sampler.set_epoch(epoch)` every epoch) and the whole
    test set in order. `num_workers=None` picks `default_workers(train)`."""
    import torch.distributed as dist

    rank, world = 0, 1
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    workers = default_workers(train) if num_workers is None else num_workers
    extra: dict = {"num_workers": workers, "pin_memory": pin_memory}
    if workers > 0:
        extra["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            extra["prefetch_factor"] = prefetch_factor
    sampler = EpochSampler(len(cast(Sized, train)), seed, shuffle=True, rank=rank, world=world)
    # Own generators: creating an iterator draws the workers' base seed from the global
    # RNG otherwise, and a resumed run would then draw it once more than the original.
    training = DataLoader(
        SeededSamples(train),
        batch_size=batch_size,
        sampler=sampler,
        generator=torch.Generator().manual_seed(seed),
        **extra,
    )
    evaluation = DataLoader(
        test, batch_size=eval_batch_size, generator=torch.Generator().manual_seed(seed), **extra
    )
    return training, evaluation
