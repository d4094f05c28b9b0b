"""The pipeline's data: CIFAR through torchvision with the paper's augmentation, the
ImageFolder transforms, and batches that are a function of (seed, epoch, position) only:
the same with any number of workers and when an epoch resumes mid-way."""

from __future__ import annotations

import pytest
import torch

from dtp_kernels.pipeline import data, synthetic


def batches(loader, epoch: int, start: int = 0) -> list[torch.Tensor]:
    loader.sampler.set_epoch(epoch, start=start)
    return [torch.cat([x.flatten(1), y[:, None].float()], 1) for x, y in loader]


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory):
    return synthetic.write_cifar(tmp_path_factory.mktemp("cifar"), "cifar10", train=40, test=8)


def test_cifar_training_augmentation_is_the_papers(cifar_dir):
    train, test = data.cifar(cifar_dir, "cifar10")
    names = [type(t).__name__ for t in train.transform.transforms]
    assert names == ["RandomCrop", "RandomHorizontalFlip", "ToTensor", "Normalize"]
    crop = train.transform.transforms[0]
    assert crop.size == (32, 32) and crop.padding == 4
    assert [type(t).__name__ for t in test.transform.transforms] == ["ToTensor", "Normalize"]
    plain, _ = data.cifar(cifar_dir, "cifar10", augment=False)
    assert [type(t).__name__ for t in plain.transform.transforms] == ["ToTensor", "Normalize"]
    seeded = data.SeededSamples(train)
    assert not torch.equal(seeded[(0, 1)][0], seeded[(0, 2)][0])  # augmentation draws
    assert torch.equal(seeded[(0, 1)][0], seeded[(0, 1)][0])  # from the sample's seed


def test_cifar100_is_read(tmp_path):
    synthetic.write_cifar(tmp_path, "cifar100", train=10, test=5)
    train, test = data.cifar(tmp_path, "cifar100")
    assert len(train) == 10 and len(test) == 5 and len(train.classes) == 100


def test_image_folder_transforms(tmp_path):
    synthetic.write_image_folder(tmp_path, classes=2, per_class=2, size=40)
    train, val = data.image_folder(tmp_path, size=32)
    assert train[0][0].shape == val[0][0].shape == (3, 32, 32)
    names = [type(t).__name__ for t in train.transform.transforms]
    assert names[:2] == ["RandomResizedCrop", "RandomHorizontalFlip"]
    resize, center = val.transform.transforms[:2]
    assert resize.size == round(32 * 8 / 7) and center.size == (32, 32)
    _, val = data.image_folder(tmp_path)
    resize, center = val.transform.transforms[:2]
    assert resize.size == 256 and center.size == (224, 224)  # the paper's evaluation


def test_batches_do_not_depend_on_workers_and_resume_mid_epoch(cifar_dir):
    train, test = data.cifar(cifar_dir, "cifar10")
    inline, _ = data.loaders(train, test, batch_size=8, seed=3, num_workers=0)
    workers, _ = data.loaders(train, test, batch_size=8, seed=3, num_workers=2)
    for epoch in (0, 1):
        want = batches(inline, epoch)
        got = batches(workers, epoch)
        assert len(want) == 5 and all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        tail = batches(workers, epoch, start=16)  # resumed after two batches
        assert all(torch.equal(a, b) for a, b in zip(want[2:], tail, strict=True))
        assert len(tail) == 3
    assert not torch.equal(batches(inline, 0)[0], batches(inline, 1)[0])  # reshuffled


def test_global_rng_is_untouched_by_loading(cifar_dir):
    train, test = data.cifar(cifar_dir, "cifar10")
    loader, _ = data.loaders(train, test, batch_size=8, num_workers=0)
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    batches(loader, 0)
    assert torch.equal(torch.rand(3), want)


def test_ranks_split_the_epoch():
    samplers = [data.EpochSampler(10, seed=1, rank=r, world=3) for r in range(3)]
    drawn = [list(s) for s in samplers]
    assert [len(d) for d in drawn] == [4, 4, 4] and all(len(s) == 4 for s in samplers)
    indices = [i for d in drawn for i, _ in d]
    assert set(indices) == set(range(10))  # padded by wrapping, as DistributedSampler
    whole = list(data.EpochSampler(10, seed=1))
    assert {p for d in drawn for p in d} == set(whole)  # the same (index, seed) pairs
    with pytest.raises(ValueError, match="rank = 3"):
        data.EpochSampler(10, rank=3, world=3)


def test_default_workers():
    digits, _ = data.digits()
    assert data.default_workers(digits) == 0  # in memory: nothing to decode
    assert 1 <= data.default_workers(torch.utils.data.Dataset()) <= data.MAX_DEFAULT_WORKERS


def test_missing_or_malformed_directories_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing \['data_batch_1'.*data_batch_1 \.\.\."):
        data.cifar(tmp_path, "cifar10")
    with pytest.raises(FileNotFoundError, match=r"train/<class>/<image> folders"):
        data.image_folder(tmp_path)


def test_a_stage_refuses_a_loader_it_cannot_resume_before_any_step():
    from torch.utils.data import DataLoader, TensorDataset

    from dtp_kernels.pipeline.errors import UsageError
    from dtp_kernels.pipeline.train import MetricsLog, train

    model = torch.nn.Linear(4, 2)
    before = model.weight.detach().clone()
    plain = DataLoader(TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long)), 4)
    with pytest.raises(UsageError, match=r"draws with SequentialSampler.*EpochSampler"):
        train(model, plain, plain, {"epochs": 1, "lr": 0.1}, MetricsLog(), "finetune")
    assert torch.equal(model.weight, before)
