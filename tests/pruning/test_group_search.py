"""The search for a layer's coupled channels (group_search.py) and the graph's slices of
the channels (graph_workarounds.py): the groups Torch-Pruning's own search finds, on
every model where that search ends; and an end, with the model pruned and exported equal,
where it did not (timm's ReXNet, FocalNet, EfficientViT, EfficientViM, EfficientFormerV2,
iFormer and CoAtNet, tiny configurations built here)."""

import ast
import time

import pytest
import torch
from torch import nn
from torch_pruning.dependency import index_mapping

from dtp_kernels.models import get_model
from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.channel_graph import traced_graph
from dtp_kernels.pruning.group_search import (
    LARGEST_TENSOR,
    UNFOLLOWED,
    LargestTensor,
    coupled_group,
)
from dtp_kernels.pruning.groups import out_channel_handler, out_width
from utils import check_export, drawn_statistics, randomised

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")


def items(group) -> list[tuple]:
    """A group as (node, pruning function, indices, root indices) per item, in order."""
    return [(i.dep.target, i.dep.handler, list(i.idxs), list(i.root_idxs)) for i in group]


@pytest.mark.parametrize(
    "make",
    [
        lambda: get_model("mobilenet_v2"),
        lambda: get_model("vgg19_bn"),
        lambda: torchvision.models.resnet18(num_classes=10),
        lambda: torchvision.models.mobilenet_v3_small(num_classes=10),
        lambda: torchvision.models.regnet_y_400mf(num_classes=10),
        # concatenations: indices that differ from the root channels they map from
        lambda: torchvision.models.googlenet(num_classes=10, aux_logits=False, init_weights=False),
    ],
    ids=[
        "mobilenet_v2",
        "vgg19_bn",
        "resnet18",
        "mobilenet_v3_small",
        "regnet_y_400mf",
        "googlenet",
    ],
)
def test_the_groups_are_torch_prunings_where_its_search_ends(make):
    """From every layer, all of its channels and one: the same items in the same order,
    the same indices mapped from the same root channels, as Torch-Pruning's search."""
    model = make().eval()
    with traced_graph(model, (torch.randn(1, 3, 32, 32),)) as graph:
        for layer in model.modules():
            if not isinstance(layer, (nn.Conv2d, nn.Linear)):
                continue
            handler, channels = out_channel_handler(layer), list(range(out_width(layer)))
            for idxs in (channels, channels[:1]):
                ours = coupled_group(graph, layer, handler, idxs)
                theirs = type(graph).get_pruning_group(graph, layer, handler, idxs)
                assert items(ours) == items(theirs)
                assert not getattr(ours, UNFOLLOWED)


def test_a_residual_added_into_a_slice_of_the_channels_is_followed():
    """ReXNet adds its residual into the first channels of a block's output and
    concatenates the rest (`cat([x[:, :c] + shortcut, x[:, c:]])`): with each slice as
    wide as what it keeps, the concatenation's offsets are right, and the search from the
    last block's projection ends within the channels that exist, all of the layer's
    reached, each (node, pruning function) once."""
    from timm.models.rexnet import RexNet

    model = RexNet(num_classes=5, width_mult=0.25).eval()
    layer = model.features[15].conv_pwl.conv
    with traced_graph(model, (torch.randn(1, 3, 32, 32),)) as graph:
        start = time.monotonic()
        group = coupled_group(graph, layer, out_channel_handler(layer), range(out_width(layer)))
        assert time.monotonic() - start < 5
    reached = {i.dep.target.module: sorted(i.idxs) for i in group}
    assert not getattr(group, UNFOLLOWED)
    assert reached[layer] == list(range(out_width(layer)))
    assert len({(i.dep.target, i.dep.handler) for i in group}) == len(group)


def test_a_search_the_graph_maps_past_a_layers_width_ends_unfollowed():
    """EfficientViT's cascaded heads: the graph maps the channels through its attention's
    reshapes to indices past the width of the layers they reach. The search ends there,
    marked unfollowed; a search from one channel ends too."""
    model = tiny_efficientvit().eval()
    layer = model.stages[1].blocks[0].ffn1.m.pw2.conv
    with traced_graph(model, (torch.randn(1, 3, 64, 64),)) as graph:
        for idxs in ([0], list(range(out_width(layer)))):
            start = time.monotonic()
            group = coupled_group(graph, layer, out_channel_handler(layer), idxs)
            assert time.monotonic() - start < 5
            assert getattr(group, UNFOLLOWED)


def test_the_largest_tensor_counts_every_torch_function_result():
    x = torch.ones(2, 3)
    with LargestTensor() as largest:
        y = (x @ torch.ones(3, 7)).expand(5, 2, 7)  # 70 elements, from a tensor method
        torch.split(y, 1)
        torch.histogramdd(torch.rand(3, 1), bins=[100])  # (hist, [edges]): 100, [101]
    assert largest.numel == 101


def test_a_search_flattened_past_its_tensor_ends_unfollowed(monkeypatch):
    """GCNet's attention pooling: the graph takes its views of the channels for two
    flattens in a row, a list of each channel times the square of its area (56 million
    indices at 64 x 64, a minute's search; at 128 x 128 the first flatten's list is still
    smaller than the largest tensor). The search ends at the first index past the
    view's tensor, marked unfollowed."""
    model = timm.create_model("gcresnet33ts", num_classes=5).eval()
    attention, x = model.stages[2][0].attn, torch.randn(1, 3, 128, 128)
    seen = []
    attention.register_forward_pre_hook(lambda _, args: seen.append(args[0].numel()))
    longest = [0]  # the longest list of indices a flatten made

    def flatten(self, idxs, call=index_mapping._FlattenIndexMapping.__call__):
        longest[0] = max(longest[0], len(out := call(self, idxs)))
        return out

    monkeypatch.setattr(index_mapping._FlattenIndexMapping, "__call__", flatten)
    layer = attention.mlp_add.fc2
    with traced_graph(model, (x,)) as graph:
        largest = getattr(graph, LARGEST_TENSOR)
        assert largest == 64 * 64 * 64  # the stem: 64 channels, 64 x 64
        start = time.monotonic()
        group = coupled_group(graph, layer, out_channel_handler(layer), range(384))
        assert time.monotonic() - start < 5
        assert getattr(group, UNFOLLOWED)
    # ended at the first view past its own tensor (the pooled block's input)
    assert longest[0] <= seen[0] < largest


def test_gcnet_is_refused_for_its_norms_and_prunes_the_rest_exactly():
    """A float ratio was refused after a minute's search; now for its MLPs' LayerNorms,
    by name, and the ratios the error gives prune the rest and export equal."""
    torch.manual_seed(0)
    model = drawn_statistics(timm.create_model("gcresnet33ts", num_classes=5)).eval()
    nn.init.normal_(model.head.fc.weight, std=0.1)
    x = torch.randn(2, 3, 64, 64)
    with pytest.raises(
        ValueError, match=r"feeds LayerNorm2d 'stages\.0\.0\.attn\.mlp_add\.norm'"
    ) as e:
        DTPPruner(model, (x[:1],), 0.5)
    ratios = ast.literal_eval(str(e.value).rpartition("ratios=")[2])
    pruner = randomised(DTPPruner(model, (x[:1],), ratios))
    assert len(pruner.groups) == 14 and pruner.kept == [n // 2 for n in pruner.sizes]
    check_export(pruner, model, x)


@pytest.mark.parametrize("channels", ["all", "one"])
def test_an_unfollowed_group_is_left_whole(monkeypatch, channels):
    """A group whose search ended at an index past a layer's width is no group: its
    layer is left whole, the others prune. So too when only the search from one of its
    channels ends so (the one that measures how its channels go together)."""
    from dtp_kernels.pruning import channel_graph

    search = channel_graph.coupled_group

    def unfollowed_from_one_layer(graph, module, handler, idxs):
        group = search(graph, module, handler, idxs)
        searched = "one" if len(idxs) == 1 else "all"
        setattr(group, UNFOLLOWED, module is model.layer2[0].conv1 and searched == channels)
        return group

    model = get_model("resnet20")
    x = torch.randn(1, 3, 32, 32)
    pruner = DTPPruner(model, (x,), 0.5)
    names = [g.name for g in pruner.groups]
    pruner.remove()
    monkeypatch.setattr(channel_graph, "coupled_group", unfollowed_from_one_layer)
    left = [g.name for g in DTPPruner(model, (x,), 0.5).groups]
    assert "layer2.0.conv1" in names
    assert left == [n for n in names if n != "layer2.0.conv1"]


def test_an_export_whose_search_ends_unfollowed_is_refused_by_name(monkeypatch):
    """Were a group's search at export to end unfollowed (the graph of the copy being cut
    mapping its channels past a width), the export stops naming the group, rather than
    cut a part of what the group couples."""
    from dtp_kernels.pruning import channel_graph
    from dtp_kernels.pruning.base import ExportMismatchError

    model = get_model("resnet20")
    pruner = randomised(DTPPruner(model, (torch.randn(1, 3, 32, 32),), 0.5))
    search = channel_graph.coupled_group

    def unfollowed_at_export(graph, module, handler, idxs):
        group = search(graph, module, handler, idxs)
        setattr(group, UNFOLLOWED, module is graph.model.layer2[0].conv1)
        return group

    monkeypatch.setattr(channel_graph, "coupled_group", unfollowed_at_export)
    with pytest.raises(ExportMismatchError, match=r"coupled to group 'layer2.0.conv1' cannot"):
        pruner.export()


def test_the_index_mappings_are_updated_once_for_all_searches(monkeypatch):
    """Torch-Pruning updates every index mapping of the graph before each search, for
    the widths its pruning changes (0.2 s a search on EfficientViT): finding the groups
    prunes nothing, and updates them once for all roots."""
    from torch_pruning.dependency import index_mapping

    update, calls = index_mapping.update_index_mapping, []

    def counted(graph):
        calls.append(graph)
        return update(graph)

    monkeypatch.setattr(index_mapping, "update_index_mapping", counted)
    pruner = DTPPruner(get_model("resnet20"), (torch.randn(1, 3, 32, 32),), 0.5)
    assert len(pruner.groups) == 9
    assert len(calls) <= 2  # building the graph, finding the groups


def tiny_rexnet():
    from timm.models.rexnet import RexNet

    return RexNet(num_classes=5, width_mult=0.25)


def tiny_focalnet():
    from timm.models.focalnet import FocalNet

    return FocalNet(num_classes=5, embed_dim=16, depths=(1, 1, 1, 1), drop_path_rate=0.0)


def tiny_efficientvit():
    from timm.models.efficientvit_msra import EfficientVitMsra

    return EfficientVitMsra(
        img_size=64,
        num_classes=5,
        embed_dim=(16, 32, 48),
        key_dim=(4, 4, 4),
        depth=(1, 1, 1),
        num_heads=(2, 2, 2),
        window_size=(2, 2, 2),
    )


def tiny_efficientvim():
    return timm.create_model(
        "efficientvim_m1", num_classes=5, embed_dim=(16, 24, 32), depths=(1, 1, 1)
    )


def tiny_efficientformer_v2():
    return timm.create_model(
        "efficientformerv2_s0",
        num_classes=5,
        depths=(1, 1, 2, 2),
        embed_dims=(16, 24, 32, 48),
        num_vit=1,
        mlp_ratios=2,
        img_size=64,
    )


def tiny_iformer():  # each attention group takes three blocks
    return timm.create_model(
        "iformer_t",
        num_classes=5,
        dims=(8, 16, 32, 64),
        depths=(1, 1, 3, 3),
        attn_groups=(0, 0, 1, 1),
    )


def tiny_coatnet():  # its relative positions are for 160 x 160 images
    return timm.create_model("test_coatnet", num_classes=5)


@pytest.mark.parametrize(
    "make, size, pruned",
    [
        # the expansion convs of the blocks: the slice-added residuals stay whole
        (tiny_rexnet, 32, ["features.3.conv_exp.conv", "features.15.conv_exp.conv"]),
        # the MLPs, beside the focal modulation's gates
        (tiny_focalnet, 64, ["layers.0.blocks.0.mlp.fc1", "layers.3.blocks.0.mlp.fc1"]),
        # the FFNs around the cascaded heads
        (
            tiny_efficientvit,
            64,
            ["stages.0.blocks.0.ffn0.m.pw1.conv", "stages.2.blocks.0.ffn1.m.pw1.conv"],
        ),
        (
            tiny_efficientvim,
            64,
            ["stages.0.blocks.0.ffn.fc1.conv", "stages.2.blocks.0.ffn.fc1.conv"],
        ),
        (tiny_efficientformer_v2, 64, ["stages.3.blocks.1.mlp.fc1.conv"]),
        (tiny_iformer, 64, ["stem.conv2.c", "stages.3.blocks.2.mixer.module.0.c"]),
        (tiny_coatnet, 160, ["stages.0.blocks.0.conv1_1x1", "stages.3.blocks.0.mlp.fc1"]),
    ],
    ids=[
        "rexnet",
        "focalnet",
        "efficientvit_msra",
        "efficientvim",
        "efficientformer_v2",
        "iformer",
        "coatnet",
    ],
)
def test_models_whose_search_did_not_end_prune_and_export_equal(make, size, pruned):
    """Refused after a minute of search before: a float ratio prunes them within
    seconds, every group at its count, and the export computes what the hard-masked
    model does."""
    torch.manual_seed(0)
    model = drawn_statistics(make()).eval()
    for head in model.modules():  # an output away from zero, so every channel shows
        if isinstance(head, nn.Linear) and head.out_features == 5:
            nn.init.normal_(head.weight, std=0.1)
    x = torch.randn(2, 3, size, size)
    start = time.monotonic()
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    assert time.monotonic() - start < 30
    names = [g.name for g in pruner.groups]
    assert set(pruned) <= set(names)
    assert pruner.kept == [n // 2 for n in pruner.sizes]
    check_export(pruner, model, x)
