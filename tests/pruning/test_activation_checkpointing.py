"""Activation checkpointing: a layer recomputed in the backward reads the very masks its
forward read (they keep their autograd graph until the optimizer step), so training with
non-reentrant checkpoints equals training without them: weights, scores and transport
state. Reentrant checkpoints read the masks under no_grad, where the scores cannot
learn, and are refused with the way out."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtp_kernels import DTPPruner
from dtp_kernels.models import resnet20
from utils import tiny_llama, tiny_mixtral

transformers = pytest.importorskip("transformers")

STEPS = 3


def checkpoint_blocks(blocks: list[nn.Module], reentrant: bool = False) -> None:
    """Run each block's forward under torch.utils.checkpoint from now on."""
    for block in blocks:
        block.forward = lambda x, run=block.forward: checkpoint(run, x, use_reentrant=reentrant)


def cnn(mask_at: str, checkpointed: bool):
    torch.manual_seed(0)
    model = resnet20()
    pruner = DTPPruner(model, torch.randn(1, 3, 32, 32), 0.5, mask_at=mask_at)
    if checkpointed:
        checkpoint_blocks([*model.layer1, *model.layer2, *model.layer3])
    images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    return model, pruner, lambda: nn.functional.cross_entropy(model(images), labels)


def causal_lm(family: str, checkpointed: bool):
    torch.manual_seed(0)
    model = tiny_llama() if family == "llama" else tiny_mixtral()
    tokens = torch.randint(0, model.config.vocab_size, (4, 16))
    ratios = {"heads": 0.5, "mlp": 0.5} if family == "llama" else {"experts": 0.5}
    pruner = DTPPruner(model, (tokens[:1],), ratios)
    if checkpointed:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    return model, pruner, lambda: model(tokens, labels=tokens, use_cache=False).loss


def trained(build, *args) -> dict[str, torch.Tensor]:
    """Weights, scores, the scores' last gradient and the transport state after STEPS
    SGD steps with the pruner attached."""
    model, pruner, loss = build(*args)
    model.train()
    optimizer = torch.optim.SGD([*model.parameters(), *pruner.parameters()], lr=0.05)
    pruner.attach(optimizer)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss().backward()
        grad = pruner.scores.grad.clone()
        optimizer.step()
    state = {f"pruner.{k}": v for k, v in pruner.state_dict().items()}
    weights = {name: p.detach() for name, p in model.named_parameters()}
    return {**weights, **state, "scores.grad": grad}


CASES = [
    (cnn, "parameters"),  # the masks folded into the BN parameters
    (cnn, "activation"),  # the masks on the BN outputs
    (causal_lm, "llama"),  # heads and MLP neurons (Hugging Face's checkpointing)
    (causal_lm, "mixtral"),  # experts: a masked weight made once per forward
]


@pytest.mark.parametrize(("build", "kind"), CASES, ids=[kind for _, kind in CASES])
def test_checkpointed_training_equals_training_without_checkpoints(build, kind):
    want, got = trained(build, kind, False), trained(build, kind, True)
    assert want.keys() == got.keys()
    assert int(got["pruner.state.steps"]) == STEPS
    assert got["scores.grad"].abs().sum() > 0
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("kind", ["cnn", "llama"])
def test_reentrant_checkpoints_are_refused_with_the_way_out(kind):
    if kind == "cnn":
        model, pruner, loss = cnn("parameters", False)
        checkpoint_blocks([*model.layer1, *model.layer2, *model.layer3], reentrant=True)
    else:
        model, pruner, loss = causal_lm("llama", False)
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": True}
        )
    model.train()
    scores = pruner.scores.detach().clone()
    with pytest.raises(RuntimeError, match=r"use_reentrant=False"):
        loss().backward()
    assert torch.equal(pruner.scores, scores) and int(pruner.state.steps) == 0


def test_a_layer_called_on_its_own_after_a_training_forward_is_not_refused():
    """Outside the model's forward (inspecting a layer under no_grad before the step) the
    masks are read as values: nothing to refuse."""
    model, _, loss = cnn("parameters", False)  # the BN parameters' folded products
    model.train()
    loss().backward()
    with torch.no_grad():
        out = model.layer1(torch.randn(2, 16, 32, 32))
    assert out.shape == (2, 16, 32, 32)


def _accumulator(parameter: torch.Tensor):
    """The parameter's gradient accumulator: the live one if any node still holds it."""
    return parameter.view_as(parameter).grad_fn.next_functions[0][0]


def test_the_optimizer_step_lets_go_of_the_masks_graph():
    """Held into the next step, the masks' graph would keep the scores' gradient
    accumulator alive (it breaks a CUDA-graph capture of that step); the step drops it."""
    model, pruner, loss = cnn("parameters", False)
    model.train()
    optimizer = torch.optim.SGD([*model.parameters(), *pruner.parameters()], lr=0.05)
    pruner.attach(optimizer)
    loss().backward()
    _accumulator(pruner.scores).metadata["held"] = True
    assert _accumulator(pruner.scores).metadata.get("held")  # alive through the backward
    optimizer.step()
    assert not _accumulator(pruner.scores).metadata.get("held")
