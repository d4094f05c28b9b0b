"""What a model returns and what it drops bound its groups: channels the model returns
(a detector's feature maps among its outputs) stay whole, since the exported model would
return fewer; a layer the model runs and whose output it drops (MobileNetV2's last conv
under a segmentation head) still reads the channels a group cuts, so export cuts its
columns too, or the exported model would not run. Both are found when the pruner is
made, not by export's check after training."""

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.cost import count_flops, count_params
from utils import drawn_statistics, randomised

transformers = pytest.importorskip("transformers")


class Features(nn.Module):
    """Two conv blocks and a classifier; the model returns the first block's features
    beside the logits (`returns_features`), and runs a conv on them whose output it
    drops (`drops`)."""

    def __init__(self, returns_features: bool = False, drops: bool = False) -> None:
        super().__init__()
        self.returns_features, self.drops = returns_features, drops
        self.block1 = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block2 = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.unused = nn.Conv2d(16, 8, 1)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor):
        features = self.block1(x)
        if self.drops:
            self.unused(features)  # computed and dropped, as a backbone's last conv can be
        logits = self.head(self.block2(features).mean((2, 3)))
        return (logits, features) if self.returns_features else logits


def test_channels_the_model_returns_stay_whole_and_the_rest_prunes():
    """block1's channels are returned: its group is not formed, with a float too, and
    block2's prunes; the export returns what the hard-masked model returns."""
    torch.manual_seed(0)
    model, x = drawn_statistics(Features(returns_features=True)).eval(), torch.randn(2, 3, 8, 8)
    for ratios in (0.5, {"channels": 0.5}):
        pruner = randomised(DTPPruner(model, (x,), ratios))
        assert [g.name for g in pruner.groups] == ["block2.0"]
        with torch.no_grad(), pruner.hard_masked():
            want = model(x)
        exported = pruner.export().eval()
        with torch.no_grad():
            got = exported(x)
        assert got[1].shape == (2, 16, 8, 8)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        pruner.remove()


def test_a_layer_whose_output_the_model_drops_is_cut_with_the_channels_it_reads():
    """`unused` reads block1's channels and its output is dropped: it is a reader of
    block1's group, cut with it, so the export runs and equals the hard-masked model,
    with the report's parameters and FLOPs."""
    torch.manual_seed(0)
    model, x = drawn_statistics(Features(drops=True)).eval(), torch.randn(2, 3, 8, 8)
    pruner = randomised(DTPPruner(model, (x,), {"channels": 0.5}))
    (first,) = [g for g in pruner.groups if g.name == "block1.0"]
    assert model.unused in first.kept_in
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    assert exported.unused.in_channels == 8
    report = pruner.report()
    assert count_params(exported) == report["params_after"]
    assert count_flops(exported, (x,)) == report["flops_after"]


def test_mobilenet_v2_segmentation_prunes_through_its_backbones_dropped_last_conv():
    """transformers' MobileNetV2 under a DeepLabV3 head runs the backbone's last 1x1
    conv and takes the last block's output instead: a float prunes the backbone and the
    head, and the export (that conv's columns cut) equals the hard-masked model."""
    config = transformers.MobileNetV2Config(
        image_size=32, depth_multiplier=0.35, num_labels=3, semantic_loss_ignore_index=255
    )
    torch.manual_seed(0)
    model = transformers.MobileNetV2ForSemanticSegmentation(config).eval()
    x = torch.randn(1, 3, 32, 32)
    pruner = randomised(DTPPruner(model, (x,), 0.5))
    last = model.mobilenet_v2.conv_1x1.convolution
    assert any(last in g.kept_in for g in pruner.groups)
    with torch.no_grad(), pruner.hard_masked():
        want = model(x).logits
    exported = pruner.export().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(x).logits, want, rtol=1e-5, atol=1e-5)
