"""DTPPruner(scores="magnitude"): under weight and N:M granularity every forward scores
the weights by their current |w| (the paper's unstructured scores), so the pruner holds no
score parameter and the mask's gradient reaches the weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from dtp_kernels import DTPPruner, TransportState, transport_mask
from dtp_kernels.pipeline.train import make_optimizer
from dtp_kernels.pruning import nm as nm_rules
from dtp_kernels.pruning.prepare import prepare


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 16)
    )


X = torch.randn(3, 8, 4, 4, generator=torch.Generator().manual_seed(1))
LAYERS = ("0", "3")


def reference_step(dense: nn.Module, granularity: str, keep: list[float], state_sizes):
    """The masked model's loss and weight gradients computed independently: scores |w| in
    float64 through the literal reference transport, masks multiplied onto the weights."""
    params = {n: p.detach().double().requires_grad_() for n, p in dense.named_parameters()}
    weights = [params[f"{name}.weight"] for name in LAYERS]
    order = nm_rules.to_blocks if granularity == "n:m" else torch.flatten
    scores = torch.cat([order(w.abs()) for w in weights])
    state = TransportState(state_sizes, dtype=torch.float64)
    mask = transport_mask(scores, keep, state, backend="reference")
    masked = dict(params)
    for name, w, part in zip(
        LAYERS, weights, mask.split([w.numel() for w in weights]), strict=True
    ):
        shaped = nm_rules.to_weight(part, w) if granularity == "n:m" else part.view_as(w)
        masked[f"{name}.weight"] = w * shaped
    loss = functional_call(dense.double(), masked, (X.double(),)).square().mean()
    loss.backward()
    return mask.detach(), loss, {n: p.grad for n, p in params.items()}


@pytest.mark.parametrize("granularity", ["weight", "n:m"])
def test_masks_and_weight_gradients_equal_the_reference_on_the_weights_magnitudes(granularity):
    dense = net()
    model = net()
    pruner = DTPPruner(
        model, X[:1], 0.5, granularity=granularity, scores="magnitude", backend="cpu"
    )
    assert pruner.scores is None and list(pruner.parameters()) == []
    loss = model(X).square().mean()
    loss.backward()
    if granularity == "n:m":
        sizes, keep = [4] * (sum(pruner.sizes) // 4), [2.0] * (sum(pruner.sizes) // 4)
    else:
        sizes, keep = pruner.sizes, [n - -(-n // 2) for n in pruner.sizes]
    expected_mask, expected_loss, grads = reference_step(dense, granularity, keep, sizes)
    torch.testing.assert_close(pruner._source.flat.double(), expected_mask, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss.double(), expected_loss, rtol=1e-5, atol=1e-7)
    for name, layer in model.named_children():
        if name in LAYERS:
            got = layer.parametrizations.weight.original.grad
            torch.testing.assert_close(
                got.double(), grads[f"{name}.weight"], rtol=1e-4, atol=1e-6, msg=name
            )


def test_learned_scores_do_not_give_the_weights_the_masks_gradient():
    """The control of the test above: with learned scores the weights' gradient lacks the
    path through the mask, and so differs from the magnitude reference."""
    model = net()
    DTPPruner(model, X[:1], 0.5, granularity="weight", backend="cpu")
    model(X).square().mean().backward()
    sizes = [8 * 8 * 9, 16 * 128]
    _, _, grads = reference_step(net(), "weight", [n - -(-n // 2) for n in sizes], sizes)
    got = model[0].parametrizations.weight.original.grad.double()
    assert not torch.allclose(got, grads["0.weight"], rtol=1e-4, atol=1e-6)


def test_training_follows_the_weights_and_exports_the_exact_pattern():
    model = net()
    pruner = DTPPruner(model, X[:1], 0.5, granularity="n:m", scores="magnitude")
    optimizer = make_optimizer(model, {"lr": 0.1, "weight_decay": 0.0}, pruner)
    assert len(optimizer.param_groups) == 1  # no score group: the weights are the scores
    pruner.attach(optimizer)
    for _ in range(5):
        loss = model(X).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    weights = [model[int(n)].parametrizations.weight.original.detach() for n in LAYERS]
    magnitudes = torch.cat([nm_rules.to_blocks(w.abs()) for w in weights])
    torch.testing.assert_close(pruner._scores(), magnitudes)  # the scores moved with |w|
    exported = pruner.export()  # checks itself against the hard-masked model
    for name in LAYERS:
        blocks = nm_rules.to_blocks(exported[int(name)].weight.detach()).view(-1, 4)
        assert torch.equal((blocks != 0).sum(1).unique(), torch.tensor([2])), name
    assert pruner.state.steps.item() == 5


def test_filter_granularity_and_unknown_sources_are_refused():
    model = net()
    with pytest.raises(ValueError, match=r"scores = 'magnitude'.*granularity 'weight' or 'n:m'"):
        DTPPruner(model, X[:1], 0.5, scores="magnitude")
    with pytest.raises(ValueError, match=r"scores = 'norm'; allowed: \['learned', 'magnitude'\]"):
        DTPPruner(model, X[:1], 0.5, granularity="weight", scores="norm")
    assert not hasattr(model[0], "parametrizations")  # refused before any mask attached


def test_prepare_adds_no_score_group_and_refuses_a_score_lr():
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"score_lr = 0\.5 with scores = 'magnitude'"):
        prepare(
            model, optimizer, X[:1], 0.5, score_lr=0.5, granularity="weight", scores="magnitude"
        )
    assert not hasattr(model[0], "parametrizations") and len(optimizer.param_groups) == 1
    pruner = prepare(model, optimizer, X[:1], 0.5, granularity="weight", scores="magnitude")
    assert len(optimizer.param_groups) == 1
    model(X).square().mean().backward()
    optimizer.step()
    assert pruner.state.steps.item() == 1  # the commit hook is attached
