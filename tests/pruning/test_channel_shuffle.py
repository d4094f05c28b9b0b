"""Channel shuffles (torchvision's ShuffleNetV2) and other reshapes Torch-Pruning's graph
cannot map (SHViT's attention output): it fails on some of them and maps the others as
if they kept the channels' order (graph_workarounds.unmappable_reshapes_marked). The
channels that meet one are left whole; the rest prune with a float ratio, the export
equal to the hard-masked model."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torchvision.models import shufflenet_v2_x0_5

from dtp_kernels.pruning import DTPPruner, channel_graph, groups
from dtp_kernels.pruning.cost import count_flops, count_params
from dtp_kernels.pruning.graph_workarounds import UNMAPPED_RESHAPE
from utils import check_export, drawn_statistics, randomised


def stage_outputs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of ShuffleNetV2's three stages on `x`."""
    outputs: list[torch.Tensor] = []
    stages = (model.stage2, model.stage3, model.stage4)
    handles = [s.register_forward_hook(lambda m, a, out: outputs.append(out)) for s in stages]
    try:
        model(x)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def test_shufflenet_prunes_the_channels_no_shuffle_meets():
    """Every block's first 1x1 conv (its channels pass the depthwise conv into the
    second) and the last conv are groups; the export equals the hard-masked model. So
    is the stem, masked on its readers' input columns: the first block's second branch
    reads its output where only the first branch's BN, which would take a mask, is
    after it (masked_reads.py)."""
    torch.manual_seed(0)
    model = drawn_statistics(shufflenet_v2_x0_5(num_classes=5)).eval()
    x = torch.randn(2, 3, 64, 64)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    blocks = [f"stage{s}.{b}" for s, n in ((2, 4), (3, 8), (4, 4)) for b in range(n)]
    names = [g.name for g in pruner.groups]
    assert names == ["conv1.0", *[f"{b}.branch2.0" for b in blocks], "conv5.0"]
    stem = pruner.groups[0]
    assert stem.gated and {n for n, m in model.named_modules() if m in stem.kept_in} == {
        "stage2.0.branch1.2",
        "stage2.0.branch2.0",
    }
    with torch.no_grad():
        dense = model(x)
        with pruner.hard_masked():
            want, want_stages = model(x), stage_outputs(model, x)
    assert (want - dense).abs().max() > 0.1 * want.abs().max()
    exported = pruner.export().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
        # each stage's output too: the classifier's output of a deep random network can
        # agree where a stage's does not (the stem's group, masked at one branch's BN,
        # gave stage 2 outputs off by 0.18 and logits off by 1e-6)
        for got, stage in zip(stage_outputs(exported, x), want_stages, strict=True):
            torch.testing.assert_close(got, stage, rtol=1e-5, atol=1e-5)
    report = pruner.report()
    assert count_params(exported) == report["params_after"]
    assert count_flops(exported, (x[:1],)) == report["flops_after"]
    assert round(report["speedup"], 2) == 1.98


class Shuffled(nn.Module):
    """conv, BN, conv, BN, a channel shuffle with no concatenation, a 1x1 conv."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn_a = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.b, self.bn_b = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn_a(self.a(x)))
        y = torch.relu(self.bn_b(self.b(x)))
        n, c, h, w = y.shape
        y = y.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)
        return self.head(y).mean((2, 3))


def test_channels_through_a_shuffle_are_left_whole():
    """Where no concatenation meets the shuffle, the graph's own mappings would couple
    the shuffled channels with the head's inputs in the wrong order (the export differs
    from the hard-masked model): that group is left whole, the one before it prunes."""
    torch.manual_seed(0)
    model, x = drawn_statistics(Shuffled()).eval(), torch.randn(2, 3, 8, 8)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    assert [g.name for g in pruner.groups] == ["a"]
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    torch.testing.assert_close(pruner.export().eval()(x), want, rtol=1e-5, atol=1e-5)


def test_the_shuffles_reshapes_are_marked_and_their_layers_searched_for_no_group():
    """Each shuffle's view back (of five dimensions, where the graph's width inference
    divided by zero) is marked; the layers whose channels meet one are left out of the
    search."""
    model = shufflenet_v2_x0_5(num_classes=5).eval()
    roots = (nn.Conv2d, nn.Linear)
    with channel_graph.traced_graph(model, (torch.randn(1, 3, 32, 32),)) as graph:
        marked = [n for n in graph.module2node.values() if getattr(n.module, UNMAPPED_RESHAPE, 0)]
        names = {m: n for n, m in model.named_modules()}
        shuffled = {names[m] for m in groups.shuffled_layers(graph, roots)}
    assert len(marked) == 16  # one per block
    blocks = [f"stage{s}.{b}" for s, n in ((2, 4), (3, 8), (4, 4)) for b in range(n)]
    assert {f"{b}.branch2.5" for b in blocks} <= shuffled
    assert not any(name.endswith("branch2.0") or name.startswith("conv") for name in shuffled)


def test_without_the_workaround_the_graph_fails_and_the_model_is_refused_by_name(monkeypatch):
    """Torch-Pruning's own graph fails on ShuffleNetV2 (a division by zero): a ValueError
    naming the model and pointing to the supported ones, not Torch-Pruning's own error,
    and the model is left as it was (training mode, no masks, the same weights)."""
    monkeypatch.setattr(channel_graph, "unmappable_reshapes_marked", contextlib.nullcontext)
    model = shufflenet_v2_x0_5(num_classes=5).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"prunable groups of ShuffleNetV2: Torch-Pruning"):
        DTPPruner(model, (torch.randn(1, 3, 32, 32),), 0.5)
    assert model.training
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_swins_layers_whose_residual_stream_meets_its_window_merge_are_not_searched():
    """torchvision's Swin merges its windows back with a reshape of six dimensions: the
    layers writing into the residual stream that carries them (each block's second MLP
    layer; the attention's projection runs in functional code the graph does not see)
    are found by following the stream backwards as well as forwards, and left out of
    the search (which ran for a minute through the merge); each MLP's first layer is
    not."""
    from torchvision.models.swin_transformer import SwinTransformer

    model = SwinTransformer([4, 4], 16, [1, 1], [2, 2], [2, 2], num_classes=5).eval()
    names = {m: n for n, m in model.named_modules()}
    with channel_graph.traced_graph(model, (torch.randn(1, 3, 32, 32),)) as graph:
        shuffled = {names[m] for m in groups.shuffled_layers(graph, (nn.Conv2d, nn.Linear))}
    for block in ("features.1.0", "features.3.0"):
        assert f"{block}.mlp.3" in shuffled
        assert f"{block}.mlp.0" not in shuffled


def shvit() -> nn.Module:
    """timm's SHViT: single-head attention over part of the channels, its output a view of
    (batch, channels, tokens) back to an image."""
    from dtp_kernels.pruning import built_model

    kwargs = dict(
        embed_dim=(16, 32, 48),
        partial_dim=(8, 16, 16),
        qk_dim=(8, 8, 8),
        depth=(1, 1, 1),
        types=("i", "s", "s"),
        num_classes=5,
    )
    return built_model.build("timm.models.shvit:SHViT", kwargs)


def test_a_reshape_whose_widths_the_graph_infers_as_zero_is_marked_and_the_rest_prunes():
    """SHViT's attention views its output from (batch, channels, tokens) back to an image,
    where Torch-Pruning's width inference divides by zero: the reshape is marked, the
    channels reaching it are left whole (the attention's projections are in no group),
    and a float ratio prunes the rest, the export equal to the hard-masked model."""
    pytest.importorskip("timm")
    torch.manual_seed(0)
    model = drawn_statistics(shvit()).eval()
    x = torch.randn(2, 3, 64, 64)
    with channel_graph.traced_graph(model, (x[:1],)) as graph:
        marked = [n for n in graph.module2node.values() if getattr(n.module, UNMAPPED_RESHAPE, 0)]
    assert len(marked) == 2  # one per single-head attention
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    assert len(pruner.groups) >= 6
    attention = {m for n, m in model.named_modules() if n.endswith((".m.qkv.c", ".m.proj.1.c"))}
    assert attention and not attention & {
        m for g in pruner.groups for m in (g.layer, *g.kept_out, *g.kept_in)
    }
    check_export(pruner, model, x)
