"""prune_coupled=True: the channel widths that residual adds couple, one segment per
width, masked at every producer's BN. The exported model equals the hard-masked one with
the kept counts asked for; widths that cannot be masked exactly are left whole."""

import pytest
import torch
import torchvision

from dtp_kernels import DTPPruner
from dtp_kernels.models import get_model
from dtp_kernels.pruning.cost import count_params


def with_random_bn(model):
    """BN statistics and affine parameters away from their defaults: a mask at the wrong
    place would then show in the outputs."""
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 1.5)
    return model


MODELS = {
    # name: (builder, coupled widths as (group name, width, producers))
    "resnet18": (
        lambda: torchvision.models.resnet18(num_classes=10),
        [
            ("conv1", 64, 3),
            ("layer2.0.conv2", 128, 3),
            ("layer3.0.conv2", 256, 3),
            ("layer4.0.conv2", 512, 3),
        ],
    ),
    "mobilenet_v2": (
        lambda: torchvision.models.mobilenet_v2(num_classes=10),
        [
            ("features.2.conv.2", 24, 2),
            ("features.4.conv.2", 32, 3),
            ("features.7.conv.2", 64, 4),
            ("features.11.conv.2", 96, 3),
            ("features.14.conv.2", 160, 3),
        ],
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_coupled_widths_export_exactly(name):
    build, widths = MODELS[name]
    model = with_random_bn(build())
    x = torch.randn(2, 3, 64, 64)
    pruner = DTPPruner(model, (x[:1],), {"coupled": 0.5, "channels": 0.25}, prune_coupled=True)
    coupled = [(g.name, g.size, len(g.producers)) for g in pruner.groups if g.producers]
    assert coupled == widths
    model.train()
    model(x).square().mean().backward()
    assert torch.all(pruner.scores.grad != 0)
    with torch.no_grad():  # rank the channels away from their initial order
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
    exported = pruner.export()  # raises unless equal to the hard-masked model
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    torch.testing.assert_close(exported.eval()(x), want, rtol=1e-5, atol=1e-5)
    assert count_params(exported) == pruner.report()["params_after"]
    modules = dict(exported.named_modules())
    for group_name, width, _ in widths:
        assert modules[group_name].out_channels == width // 2


def test_a_bottleneck_resnet_prunes_its_stage_widths():
    model = with_random_bn(torchvision.models.resnet50(num_classes=10))
    x = torch.randn(1, 3, 64, 64)
    pruner = DTPPruner(model, (x,), {"coupled": 0.25}, prune_coupled=True)
    assert [(g.size, len(g.producers)) for g in pruner.groups] == [
        (256, 4),
        (512, 5),
        (1024, 7),
        (2048, 4),  # each stage's blocks and its downsample
    ]
    exported = pruner.export()
    assert exported.layer1[0].downsample[0].out_channels == 192
    assert exported.fc.in_features == 1536


def test_widths_that_cannot_be_masked_exactly_are_left_whole():
    """CIFAR ResNet's option-A shortcuts pad one stage's width into the next, and a ViT's
    residual width meets LayerNorms and the position embedding: no coupled groups; the
    other groups still prune."""
    resnet = get_model("resnet56")
    pruner = DTPPruner(resnet, torch.randn(1, 3, 32, 32), 0.5, prune_coupled=True)
    assert not any(g.producers for g in pruner.groups) and len(pruner.groups) == 27
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
    )
    pruner = DTPPruner(vit, torch.randn(1, 3, 32, 32), 0.5, prune_coupled=True)
    assert [g.name for g in pruner.groups] == [
        f"encoder.layers.encoder_layer_{i}.{part}"
        for i in (0, 1)
        for part in ("self_attention", "mlp.0")
    ]
    with pytest.raises(TypeError, match=r"prune_coupled must be a bool, got str"):
        DTPPruner(resnet, torch.randn(1, 3, 32, 32), 0.5, prune_coupled="yes")


def test_a_model_of_coupled_widths_only_says_prune_coupled_prunes_it():
    """timm's RepVGG sums every block's 3x3, 1x1 and identity branches, so every channel
    meets a residual add: a float finds no group and says prune_coupled=True prunes
    them, which it does, exported equal to the hard-masked model: the identity branch's
    BN, a BN of the block's input, takes the mask too (else its bias comes back)."""
    pytest.importorskip("timm")
    from timm.models.byobnet import ByoBlockCfg, ByobNet, ByoModelCfg

    config = ByoModelCfg(
        blocks=(
            ByoBlockCfg(type="rep", d=1, c=8, s=1, gs=0, br=1.0),
            ByoBlockCfg(type="rep", d=2, c=16, s=2, gs=0, br=1.0),
        ),
        stem_type="rep",
        stem_chs=8,
        num_features=0,
    )
    model = with_random_bn(ByobNet(config, num_classes=5)).eval()
    x = torch.randn(2, 3, 16, 16)
    with pytest.raises(ValueError, match=r"prune nothing .*prune_coupled=True"):
        DTPPruner(model, x[:1], 0.5)
    pruner = DTPPruner(model, x[:1], 0.5, prune_coupled=True)
    assert [g.size for g in pruner.groups] == [8, 16]
    identity = model.stages[1][1].identity  # the second block's BN of its input
    assert any(target is identity for g in pruner.groups for _, target in g.producers)
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
        with pruner.hard_masked():
            want = model(x)
        torch.testing.assert_close(pruner.export().eval()(x), want, rtol=1e-5, atol=1e-5)
