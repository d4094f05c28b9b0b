"""window_attention.py: torchvision's shifted-window attention with the head size taken
from the projection. With every head kept it computes exactly what torchvision's does
(values and gradients, Swin and Swin V2, shifted or not, feature maps padded to whole
windows or not); with heads removed it is what the hard mask computes (test_vision_models.py,
test_saving.py)."""

import pytest
import torch
from torchvision.models.swin_transformer import ShiftedWindowAttention, ShiftedWindowAttentionV2

from dtp_kernels.pruning.window_attention import PRUNED_CLASSES, window_attention


@pytest.mark.parametrize("cls", [ShiftedWindowAttention, ShiftedWindowAttentionV2])
@pytest.mark.parametrize("shift", [[0, 0], [2, 2], [0, 2], [1, 3]])
@pytest.mark.parametrize("size", [(8, 8), (7, 9), (3, 5)])
@pytest.mark.parametrize("training", [False, True])
def test_every_head_kept_computes_what_torchvision_computes(cls, shift, size, training):
    """Bitwise the same outputs and parameter gradients as torchvision's layer (a map
    smaller than a window is not shifted along that side; 7 x 9 is padded)."""
    torch.manual_seed(0)
    layer = cls(16, [4, 4], shift, 4).train(training)
    x = torch.randn(2, *size, 16, requires_grad=True)
    want = layer(x)
    want_grads = torch.autograd.grad(want.square().sum(), [x, *layer.parameters()])
    layer.__class__ = PRUNED_CLASSES[cls]
    got = layer(x)
    got_grads = torch.autograd.grad(got.square().sum(), [x, *layer.parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_heads_of_another_size_than_the_width_over_their_count():
    """Three heads of 4 in a layer of width 16 (torchvision's code cannot run it) compute
    what the four-head layer computes with the fourth head's output columns zeroed."""
    torch.manual_seed(0)
    layer = ShiftedWindowAttention(16, [2, 2], [1, 1], 4).eval()
    x = torch.randn(2, 6, 6, 16)
    with torch.no_grad():
        layer.proj.weight[:, 12:] = 0
        want = layer(x)
        rows = torch.arange(48) % 16 < 12  # the first three heads of the query, key, value
        layer.qkv.weight = torch.nn.Parameter(layer.qkv.weight[rows])
        layer.qkv.bias = torch.nn.Parameter(layer.qkv.bias[rows])
        layer.proj.weight = torch.nn.Parameter(layer.proj.weight[:, :12])
        table = layer.relative_position_bias_table
        layer.relative_position_bias_table = torch.nn.Parameter(table[:, :3])
        layer.num_heads = 3
        with pytest.raises(RuntimeError):  # torchvision's: a head size of 16 // 3
            layer(x)
        torch.testing.assert_close(window_attention(x, layer), want, rtol=1e-6, atol=1e-6)
