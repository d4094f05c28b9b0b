"""Exported 2:4 models as semi-structured sparse tensors: which layers qualify, the
refusals (named, before anything changes) on CPU, and equal outputs on a GPU."""

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner, to_semi_structured
from dtp_kernels.pruning.semi_structured import is_two_four


def mlp(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))


def exported_two_four(model: nn.Module) -> nn.Module:
    example = torch.randn(2, model[0].in_features)
    return DTPPruner(model, example, 0.5, granularity="n:m", nm=(2, 4)).export()


def test_is_two_four_reads_blocks_along_the_inputs():
    weight = torch.ones(3, 8)
    weight[:, [0, 1, 4, 6]] = 0
    assert is_two_four(weight)
    weight[1, 0] = 1.0  # three non-zeros in the first block of row 1
    assert not is_two_four(weight)
    assert not is_two_four(torch.zeros(2, 6))  # inputs not a multiple of 4
    assert not is_two_four(torch.zeros(4))


def test_exported_two_four_layers_qualify_and_dense_ones_do_not():
    small = exported_two_four(mlp())
    assert is_two_four(small[0].weight) and is_two_four(small[2].weight)
    assert not is_two_four(mlp()[0].weight)


def test_cpu_layers_are_refused_by_name_and_left_dense():
    small = exported_two_four(mlp())
    before = [p.clone() for p in small.parameters()]
    with pytest.raises(ValueError, match=r"'0' is on cpu.*need CUDA.*'2' is on cpu"):
        to_semi_structured(small)
    assert all(torch.equal(a, b) for a, b in zip(before, small.parameters(), strict=True))
    assert to_semi_structured(mlp()) == []  # nothing in the pattern: nothing to do


@pytest.mark.cuda
def test_semi_structured_outputs_equal_the_dense_masked_layers():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("sparse tensor cores need compute capability 8.0")
    small = exported_two_four(mlp(128)).half().cuda().eval()
    x = torch.randn(256, 128, dtype=torch.half, device="cuda")
    with torch.no_grad():
        dense = small(x)
        assert to_semi_structured(small) == ["0", "2"]
        sparse = small(x)
    assert type(small[0].weight).__name__.startswith("SparseSemiStructured")
    torch.testing.assert_close(sparse, dense, rtol=2e-3, atol=2e-3)


@pytest.mark.cuda
def test_float32_and_odd_shapes_are_refused_on_gpu():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("sparse tensor cores need compute capability 8.0")
    small = exported_two_four(mlp()).cuda()
    with pytest.raises(ValueError, match=r"has dtype torch\.float32"):
        to_semi_structured(small)
    odd = exported_two_four(nn.Sequential(nn.Linear(20, 8))).half().cuda()
    with pytest.raises(ValueError, match=r"weight shape \(8, 20\); both dimensions"):
        to_semi_structured(odd)
