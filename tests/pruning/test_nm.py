"""N:M sparsity learned with DTP (granularity="n:m"): every block of M consecutive
weights along a layer's input dimension keeps exactly N, in the masks, in the hard-masked
model and in the export; the transport segments are the blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtp_kernels import DTPPruner
from dtp_kernels.pruning import nm as nm_rules


def cnn_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, groups=2),  # grouped: blocks of its 8 inputs
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 32),
        nn.ReLU(),
        nn.Linear(32, 16),
    )


X = torch.randn(4, 8, 5, 5, generator=torch.Generator().manual_seed(1))


def trained(nm: tuple[int, int], steps: int = 4) -> tuple[nn.Module, DTPPruner]:
    model = cnn_mlp()
    pruner = DTPPruner(model, X[:1], 1 - nm[0] / nm[1], granularity="n:m", nm=nm, backend="cpu")
    optimizer = torch.optim.SGD([*model.parameters(), *pruner.parameters()], lr=0.05)
    pruner.attach(optimizer)
    for _ in range(steps):
        loss = model(X).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, pruner


def nonzeros_per_block(weight: torch.Tensor, m: int) -> torch.Tensor:
    return (weight.detach().movedim(1, -1).reshape(-1, m) != 0).sum(1)


@pytest.mark.parametrize("nm", [(2, 4), (1, 4), (3, 8), (5, 8)])
def test_every_block_of_every_layer_keeps_exactly_n(nm):
    n, m = nm
    model, pruner = trained(nm)
    assert [g.name for g in pruner.groups] == ["0", "2", "5", "7"]
    soft = pruner._transport(update=False).detach()
    torch.testing.assert_close(soft.view(-1, m).sum(1), torch.full((soft.numel() // m,), float(n)))
    for mask in pruner.hard_masks():
        assert torch.equal(mask.view(-1, m).sum(1), torch.full((mask.numel() // m,), float(n)))
    exported = pruner.export()  # checks itself against the hard-masked model
    for name, layer in exported.named_modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            assert torch.equal(
                nonzeros_per_block(layer.weight, m),
                torch.full_like(nonzeros_per_block(layer.weight, m), n),
            ), name
    with pruner.hard_masked():
        model.eval()
        torch.testing.assert_close(exported.eval()(X), model(X), rtol=1e-5, atol=1e-6)
    report = pruner.report()
    assert all(row["k"] * m == row["n"] * n for row in report["groups"])


def test_blocks_of_16_on_linear_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))
    pruner = DTPPruner(model, torch.randn(1, 32), 0.75, granularity="n:m", nm=(4, 16))
    exported = pruner.export()
    for layer in (exported[0], exported[2]):
        assert torch.equal(nonzeros_per_block(layer.weight, 16).unique(), torch.tensor([4]))


def test_blocks_run_along_the_input_dimension():
    weight = torch.arange(2 * 8 * 3 * 3, dtype=torch.float32).view(2, 8, 3, 3)
    flat = nm_rules.to_blocks(weight)
    assert torch.equal(flat[:8], weight[0, :, 0, 0])  # one filter tap, all 8 inputs
    assert torch.equal(nm_rules.to_weight(flat, weight), weight)
    mask = nm_rules.hard_mask(flat, 2, 4)
    assert torch.equal(mask[:8], torch.tensor([0, 0, 1, 1, 0, 0, 1, 1.0]))


def test_scores_start_at_the_weights_magnitude_so_step_zero_is_magnitude_n_m():
    model = cnn_mlp()
    pruner = DTPPruner(model, X[:1], 0.5, granularity="n:m", backend="cpu")
    for group, mask in zip(pruner.groups, pruner.hard_masks(), strict=True):
        weight = group.layer.parametrizations.weight.original.detach().abs()
        if weight.dim() == 4:  # blocks of 4 inputs of one filter tap: [out, kh, kw, in]
            weight = weight.permute(0, 2, 3, 1)
        blocks = weight.reshape(-1, 4)
        top_two = blocks >= blocks.sort(dim=1).values[:, 2:3]
        assert torch.equal(mask.view(-1, 4).bool(), top_two), group.name


BAD = [
    (dict(nm=(2, 3)), r"nm = \(2, 3\); allowed: 1 <= N < M with M in \[4, 8, 16\]"),
    (dict(nm=(4, 4)), r"nm = \(4, 4\)"),
    (dict(nm="2:4"), r"nm = '2:4'; it must be a pair"),
    (dict(budget="global"), r"budget must be 'layer', got 'global'"),
    (dict(ratios=0.6), r"prunes 0.5 of every layer; these layers have other ratios"),
]


@pytest.mark.parametrize("kwargs,pattern", BAD, ids=[p for _, p in BAD])
def test_bad_settings_are_refused_before_any_mask(kwargs, pattern):
    model = cnn_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = {"ratios": 0.5, "granularity": "n:m", **kwargs}
    ratios = args.pop("ratios")
    with pytest.raises(ValueError, match=pattern):
        DTPPruner(model, X[:1], ratios, **args)
    assert model.state_dict().keys() == before.keys()  # no parametrization attached


def test_a_layer_whose_inputs_are_not_blocks_of_m_is_named():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 9, 6))
    with pytest.raises(ValueError, match=r"'0' \(3 inputs\).*ignored_layers"):
        DTPPruner(model, torch.randn(1, 3, 5, 5), 0.5, granularity="n:m")
    pruner = DTPPruner(
        model, torch.randn(1, 3, 5, 5), 0.5, granularity="n:m", ignored_layers=[model[0]]
    )
    assert [g.name for g in pruner.groups] == ["3"]


def test_conv1d_layers_keep_n_of_every_block_and_export_exactly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(8, 12, 3, padding=1), nn.ReLU(), nn.Conv1d(12, 4, 1))
    x = torch.randn(2, 8, 7)
    pruner = DTPPruner(model, x[:1], 0.5, granularity="n:m", nm=(2, 4))
    exported = pruner.export()  # raises ExportMismatchError unless it equals the hard masks
    for layer in (exported[0], exported[2]):
        assert torch.equal(nonzeros_per_block(layer.weight, 4).unique(), torch.tensor([2]))
    with pruner.hard_masked():
        torch.testing.assert_close(exported.eval()(x), model.eval()(x))
