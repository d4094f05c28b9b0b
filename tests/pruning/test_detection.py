"""torchvision's detection and segmentation models, built as a user fine-tuning one
builds them (a ResNet FPN backbone with frozen batch norms, as pretrained weights come),
at small sizes: a float ratio prunes the backbone and the heads' convolutions and
linear layers, the exported model computes what the hard-masked one does (boxes, scores,
masks, keypoints), its parameters are the report's, and its FLOPs what the cost model
counts for the channels each layer lost.

What makes them prunable: the box regressors and classifiers, whose outputs are only
decoded into detections, keep their outputs without a search of Torch-Pruning's graph
(one that does not end on the decoding); a region pooling op reads only its features
(Keypoint R-CNN pools the boxes it predicts); frozen batch norms are per-channel norms
whose buffers export cuts; a linear layer after a flatten loses a feature map's area of
inputs per channel, a transposed convolution is counted, and a raw per-channel scale is
cut with its channels."""

import copy

import pytest
import torch
import torchvision
from torch import nn
from torchvision.models import detection, segmentation
from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
from torchvision.models.detection.faster_rcnn import FastRCNNConvFCHead
from torchvision.ops import FrozenBatchNorm2d
from torchvision.ops.feature_pyramid_network import LastLevelP6P7

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.channel_graph import output_tensors, traced_graph
from dtp_kernels.pruning.cost import count_flops, count_params, flops_after, trace_layers
from dtp_kernels.pruning.groups import output_layers
from utils import randomised

SIZES = {"min_size": 64, "max_size": 96}
# every box kept up to the counts (no score threshold, no suppression): the masked and
# the exported model return as many detections to compare
RCNN = {
    **SIZES,
    "rpn_nms_thresh": 1.0,
    "box_score_thresh": 0.0,
    "box_nms_thresh": 1.0,
    "box_detections_per_img": 30,
}


def frozen_backbone(**options) -> nn.Module:
    """A ResNet-18 FPN backbone with frozen batch norms (torchvision's default for one
    built from pretrained weights), their buffers drawn away from the identity: a norm
    whose bias export forgot to cut would show."""
    backbone = resnet_fpn_backbone(
        backbone_name="resnet18", weights=None, trainable_layers=5, **options
    )
    generator = torch.Generator().manual_seed(1)
    for module in backbone.modules():
        if isinstance(module, FrozenBatchNorm2d):
            for name, low, high in [
                ("weight", 0.5, 1.5),
                ("bias", -0.5, 0.5),
                ("running_mean", -0.2, 0.2),
                ("running_var", 0.5, 1.5),
            ]:
                buffer = getattr(module, name)
                buffer.copy_(torch.rand(buffer.shape, generator=generator) * (high - low) + low)
    return backbone


def detector(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "faster_rcnn":  # with the v2 box head: convolutions, BN, a flatten, a linear layer
        head = FastRCNNConvFCHead((256, 7, 7), [32, 32], [64], norm_layer=nn.BatchNorm2d)
        model = detection.FasterRCNN(
            frozen_backbone(), num_classes=5, box_head=head, representation_size=64, **RCNN
        )
        model.roi_heads.box_predictor = detection.faster_rcnn.FastRCNNPredictor(64, 5)
    elif kind == "mask_rcnn":
        model = detection.MaskRCNN(frozen_backbone(), num_classes=5, **RCNN)
    elif kind == "keypoint_rcnn":
        model = detection.KeypointRCNN(frozen_backbone(), num_classes=2, num_keypoints=5, **RCNN)
    else:  # retinanet, fcos
        backbone = frozen_backbone(returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(256, 256))
        net = detection.RetinaNet if kind == "retinanet" else detection.FCOS
        model = net(
            backbone,
            num_classes=5,
            score_thresh=0.0,
            nms_thresh=1.0,
            detections_per_img=30,
            **SIZES,
        )
    # heads drawn away from their initialisation, whose near-equal scores would let
    # rounding reorder the detections (at the scale of a layer's fan-in: larger box
    # deltas would amplify rounding through their exponential)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "head" in name or "predictor" in name:
                fan_in = param[0].numel() if param.dim() > 1 else 100
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)
    return model.eval()


def check_export(pruner: DTPPruner, model: nn.Module, inputs: tuple) -> nn.Module:
    """The export equals the hard-masked model on `inputs`, and has the report's counts."""
    with torch.no_grad(), pruner.hard_masked():
        want = output_tensors(model(*inputs))
    exported = pruner.export().eval()
    with torch.no_grad():
        got = output_tensors(exported(*inputs))
    assert [t.shape for t in got] == [t.shape for t in want]
    assert sum(t.numel() for t in want) > 0  # detections to compare
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-3)
    report = pruner.report()
    assert count_params(exported) == report["params_after"] < report["params_before"]
    # the report counts the dense model's forward; a detector's heads run on as many
    # boxes as its proposals, which the pruned backbone changes: the channels each layer
    # loses are checked on the hard-masked model's forward
    with pruner.hard_masked():
        layers = trace_layers(model, inputs)
    lost = pruner._kept_channels(pruner.hard_masks())
    assert count_flops(exported, inputs) == flops_after(layers, lost)
    return exported


DETECTORS = ["faster_rcnn", "mask_rcnn", "keypoint_rcnn", "retinanet", "fcos"]


@pytest.mark.parametrize("kind", DETECTORS)
def test_a_detector_prunes_with_a_float_and_exports_equal(kind):
    model, images = detector(kind), ([torch.rand(3, 64, 80)],)
    pruner = randomised(DTPPruner(model, images, 0.5))
    names = [g.name for g in pruner.groups]
    assert any(n.startswith("backbone.") for n in names)
    heads = {
        "faster_rcnn": "roi_heads.box_head.",
        "mask_rcnn": "roi_heads.mask_head.",
        "keypoint_rcnn": "roi_heads.keypoint_head.",
        "retinanet": "head.classification_head.conv.",
        "fcos": "head.regression_head.conv.",
    }
    assert any(n.startswith(heads[kind]) for n in names), names
    exported = check_export(pruner, model, images)
    kept = {g.name: int(m.sum()) for g, m in zip(pruner.groups, pruner.hard_masks(), strict=True)}
    layers = dict(exported.named_modules())
    for group in pruner.groups:  # FCOS's head convs: a unit is a GroupNorm group
        layer = layers[group.name]
        kept_channels = kept[group.name] * group.channels_per_unit
        assert getattr(layer, "out_channels", getattr(layer, "out_features", None)) == kept_channels


def test_output_layers_are_the_heads_outputs_and_take_no_search():
    model, images = detector("faster_rcnn"), ([torch.rand(3, 64, 80)],)
    with traced_graph(model, images) as graph:
        found = output_layers(graph, (nn.Conv2d, nn.Linear))
    names = {name for name, m in model.named_modules() if any(m is f for f in found)}
    # the region proposal head's outputs too: they are detached before they are decoded,
    # and traced as outputs the model drops
    assert names == {
        "roi_heads.box_predictor.cls_score",
        "roi_heads.box_predictor.bbox_pred",
        "rpn.head.cls_logits",
        "rpn.head.bbox_pred",
    }


def test_region_pooling_reads_only_the_features():
    # Keypoint R-CNN pools the boxes its box head predicted: traced as they are, the
    # boxes' coordinates would be coupled to the features' channels (on a ResNet-50
    # backbone the box regressor's search then does not end)
    model, images = detector("keypoint_rcnn"), ([torch.rand(3, 64, 80)],)
    with traced_graph(model, images) as graph:
        nodes = graph.module2node.values()
        pools = [n for n in nodes if "roi_align" in type(n.grad_fn).__name__.lower()]
        sources = [[type(i.module).__name__ for i in n.inputs] for n in pools]
        feeding = [sum(any(o is p for o in n.outputs) for n in nodes) for p in pools]
    assert len(pools) == 8  # four levels for the box head, four for the keypoint head
    assert sources == [["Conv2d"]] * len(pools)
    assert feeding == [1] * len(pools)  # the boxes' edges cut both ways


def test_frozen_batch_norms_are_cut_with_their_channels_and_masked_at_their_output():
    model, images = detector("faster_rcnn"), ([torch.rand(3, 64, 80)],)
    pruner = randomised(DTPPruner(model, images, {"backbone.body.layer1.0.conv1": 0.5}))
    (group,) = pruner.groups
    assert isinstance(group.bn, FrozenBatchNorm2d)
    assert not hasattr(group.bn, "parametrizations")  # its buffers stay; its output is masked
    exported = check_export(pruner, model, images)
    norm = exported.backbone.body.layer1[0].bn1
    assert {tuple(b.shape) for b in norm.buffers()} == {(32,)}


@pytest.mark.parametrize(
    "name", ["deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large", "fcn_resnet50"]
)
def test_a_segmentation_model_prunes_with_a_float_and_exports_equal(name):
    torch.manual_seed(0)
    model = getattr(segmentation, name)(weights=None, weights_backbone=None, num_classes=5)
    x = torch.rand(1, 3, 64, 64)
    pruner = randomised(DTPPruner(model.eval(), (x,), 0.5))
    assert any(g.name.startswith("classifier.") for g in pruner.groups) or name.startswith("lraspp")
    exported = check_export(pruner, model, (x,))
    assert count_flops(exported, (x,)) == pruner.report()["flops_after"]


class Scaled(nn.Module):
    """conv -> relu -> times a raw per-channel parameter -> conv -> pool -> flatten ->
    linear: the linear layer reads each channel at 3 x 3 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 6, 3, padding=1)
        self.scale = nn.Parameter(torch.rand(8) + 0.5)
        self.pool, self.head = nn.AdaptiveAvgPool2d(3), nn.Linear(6 * 9, 4)
        self.up = nn.ConvTranspose2d(6, 5, 2, stride=2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.relu(self.first(x)) * self.scale.view(1, -1, 1, 1)
        hidden = torch.relu(self.second(hidden))
        return self.head(self.pool(hidden).flatten(1)), self.up(hidden)


def test_a_raw_scale_a_flatten_and_a_transposed_conv_are_counted_as_export_cuts_them():
    torch.manual_seed(0)
    model, x = Scaled().eval(), torch.randn(1, 3, 8, 8)
    pruner = randomised(DTPPruner(model, (x,), 0.5))
    assert [g.name for g in pruner.groups] == ["first", "second"]
    exported = check_export(pruner, model, (x,))
    assert exported.scale.shape == (4,)
    assert exported.head.in_features == 3 * 9  # 3 channels kept, 9 inputs each
    assert exported.up.in_channels == 3
    assert count_flops(exported, (x,)) == pruner.report()["flops_after"]


def test_alexnet_counts_its_classifier_after_the_flatten():
    # its last conv's channels reach the classifier through a 6 x 6 flatten
    torch.manual_seed(0)
    model, x = torchvision.models.alexnet(num_classes=10).eval(), torch.rand(1, 3, 64, 64)
    pruner = randomised(DTPPruner(model, (x,), 0.5))
    exported = check_export(pruner, model, (x,))
    assert exported.classifier[1].in_features == exported.features[10].out_channels * 36
    assert count_flops(exported, (x,)) == pruner.report()["flops_after"]


def test_a_transposed_conv_costs_its_kernel_over_its_input_positions():
    layer, x = nn.ConvTranspose2d(4, 6, 3, stride=2), torch.randn(1, 4, 5, 5)
    assert count_flops(layer, (x,)) == (9 * 4 + 1) * 6 * 25
    grouped = nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2)
    assert count_flops(grouped, (x,)) == (4 * 4 // 2 + 1) * 6 * 25
    unbatched = nn.ConvTranspose1d(4, 6, 2)
    assert count_flops(unbatched, (torch.randn(4, 7),)) == (2 * 4 + 1) * 6 * 7


def test_frozen_norms_are_left_to_the_model_when_a_copy_is_exported():
    # the model keeps its frozen norms' full buffers (export cut a copy), and once the
    # pruner is removed, no mask on their outputs: it computes what it did before
    model, images = detector("faster_rcnn"), ([torch.rand(3, 64, 80)],)
    before = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        want = output_tensors(model(*images))
    pruner = randomised(DTPPruner(model, images, 0.5))
    pruner.export()
    pruner.remove()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        got = output_tensors(model(*images))
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
