"""DTP under FSDP2 on a GPU, one rank of NCCL in this process (the two-rank runs on the
CPU are tests/pruning/test_fsdp.py): a CIFAR ResNet-20 whose stem and stages FSDP
shards, with and without CPUOffloadPolicy (the shards kept on the CPU, each unit's
parameters gathered to the GPU for its forward), trains as the same model without FSDP
on that GPU, and export_sharded() (gathering the CPU-kept shards on the GPU) exports
what its export() does."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.cuda

IMAGES = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(2))
LABELS = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(3))


def train(sharding: str) -> tuple[dict, torch.Tensor]:
    """Three steps of a ResNet-20 on cuda:0 under `sharding` ("fsdp", "offload" or
    "none"): the pruner's state and its export's outputs."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from dtp_kernels import DTPPruner
    from dtp_kernels.models import get_model
    from dtp_kernels.pruning.prepare import join_optimizer

    def built() -> torch.nn.Module:
        torch.manual_seed(0)
        return get_model("resnet20").cuda()

    images, labels = IMAGES.cuda(), LABELS.cuda()
    model = built()
    pruner = DTPPruner(model, images[:1], 0.5)
    if sharding != "none":
        policy = CPUOffloadPolicy() if sharding == "offload" else None
        options = {} if policy is None else {"offload_policy": policy}
        # the stem a unit too: the model's first parameter is a shard when the pruner's
        # pre-hook runs (on the CPU under offload, not the pruner's device: not refused)
        for unit in (model.conv1, model.layer1, model.layer2, model.layer3):
            fully_shard(unit, **options)
        fully_shard(model, **options)
        if policy is not None:  # the shards are on the CPU between forwards
            assert next(model.layer1.parameters()).device.type == "cpu"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    join_optimizer(pruner, optimizer, score_lr=0.05)
    for step in range(3):
        optimizer.zero_grad()
        rows = slice(2 * step, 2 * step + 2)
        torch.nn.functional.cross_entropy(model(images[rows]), labels[rows]).backward()
        optimizer.step()
    small = pruner.export() if sharding == "none" else pruner.export_sharded(built())
    with torch.no_grad():
        outputs = small.eval()(images[6:])
    assert next(small.parameters()).is_cuda
    return {k: v.cpu() for k, v in pruner.state_dict().items()}, outputs.cpu()


@pytest.fixture
def one_rank(tmp_path):
    if not dist.is_nccl_available():
        pytest.skip("NCCL is not available")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["fsdp", "offload"])
def test_fsdp2_on_the_gpu_trains_and_exports_as_without_it(one_rank, sharding):
    state, outputs = train(sharding)
    plain_state, plain_outputs = train("none")
    assert int(state["state.steps"]) == 3
    for key, value in plain_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outputs, plain_outputs, rtol=1e-4, atol=1e-4)
