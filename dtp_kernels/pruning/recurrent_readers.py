"""Recurrent layers (nn.RNN, nn.GRU, nn.LSTM) and cells (nn.RNNCell, nn.GRUCell,
nn.LSTMCell) and nn.Bilinear as readers of a group's channels.

A recurrent layer reads its sequence input only through the input columns of its first
layer's weights (`weight_ih_l0`, and `weight_ih_l0_reverse` when bidirectional; a
cell's `weight_ih`, step by step). Masked
channels are zeros there, so cutting those columns at export computes what the masked
model does: the layers that feed a recurrent layer are pruned like those that feed a
linear one. Its hidden units are never cut (no group has them as its channels).

Torch-Pruning follows a module as one node only where its forward is one autograd op:
LSTM on the CPU is, GRU, RNN and the cells on the CPU run as many small ops that it
would follow into the recurrence (and fail on), and under cuDNN the layers are one op. So that the
channel graph is the same on every device, each of these layers runs as one op of its
inputs while the graph is traced (`run_as_one_op`). An initial hidden state the model
passes is no input of that op (Torch-Pruning cuts all of a node's inputs alike): the op
reads it as a constant, and the trace follows it on through a marked op to the model's
outputs (`StateReads`), so that a layer computing it is left whole with that reason
(its channels are hidden units, which are not cut).

nn.Bilinear reads two inputs through one weight; the pruner does not cut it, and the
layers feeding it are left whole with that reason (`UNCUT_READERS`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch_pruning.pruner.function import BasePruningFunc

from .cuts import cut_inputs

# exactly these classes: a subclass may compute with its weights otherwise
RECURRENT = (nn.RNN, nn.GRU, nn.LSTM, nn.RNNCell, nn.GRUCell, nn.LSTMCell)
# the graph's attribute holding StateReads.readers
STATE_READERS = "dtp_state_readers"


def _is_recurrent(module: nn.Module) -> bool:
    return type(module) in RECURRENT


class _OneOp(torch.autograd.Function):
    """`run(*inputs)` as one autograd op of its `n` input tensors and of the module's
    parameters after them (which `run` reads from the module); the backward recomputes
    the forward and differentiates it."""

    @staticmethod
    def forward(ctx, run, box, n, *tensors):
        ctx.run, ctx.params = run, tensors[n:]
        ctx.save_for_backward(*tensors[:n])
        leaves, box["spec"] = pytree.tree_flatten(run(*tensors[:n]))
        box["leaves"] = leaves  # the outputs that are no tensors (None) stay as they are
        outputs = [t for t in leaves if isinstance(t, torch.Tensor)]
        ctx.floating = [t.is_floating_point() for t in outputs]
        ctx.mark_non_differentiable(*(t for t in outputs if not t.is_floating_point()))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            leaves = pytree.tree_flatten(ctx.run(*inputs))[0]
        outputs = [t for t in leaves if isinstance(t, torch.Tensor)]
        every = [*inputs, *ctx.params]
        wanted = [t for t in every if t.requires_grad]
        pairs = [
            (out, grad)
            for out, grad, floating in zip(outputs, grads, ctx.floating, strict=True)
            if floating and grad is not None and out.requires_grad
        ]
        found = (
            torch.autograd.grad(
                [out for out, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
            )
            if pairs and wanted
            else [None] * len(wanted)
        )
        by_tensor = dict(zip(map(id, wanted), found, strict=True))
        return (None, None, None, *(by_tensor.get(id(t)) for t in every))


class _StateRead(torch.autograd.Function):
    """The identity: the marked op an initial hidden state passes through in the trace."""

    @staticmethod
    def forward(ctx, state: torch.Tensor) -> torch.Tensor:
        return state.view_as(state)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class StateReads:
    """The initial hidden states the recurrent layers read in a traced forward, each
    passed through _StateRead (`tensors`, which the trace follows as outputs of the
    model), and the layer reading each (`readers`, by the marked op's grad_fn)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.readers: dict[object, nn.Module] = {}

    def read(self, layer: nn.Module, state: Any) -> Any:
        """`state` (a tensor, or LSTM's pair) recorded as read by `layer`; what `layer`
        is given instead: the state detached, so that the graph does not take it for
        the sequence input's channels (Torch-Pruning cuts all of a node's inputs alike)."""

        def marked(tensor: Any) -> Any:
            if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad:
                return tensor  # a constant (zeros): no edge of the graph
            read = _StateRead.apply(tensor)
            self.tensors.append(read)
            self.readers[read.grad_fn] = layer
            return tensor.detach()

        return pytree.tree_map(marked, state)


def _one_op_forward(module: nn.Module, states: StateReads) -> Callable[..., Any]:
    """`module`'s forward, run as one _OneOp; a recurrent layer's initial state read
    through `states`."""
    forward = module.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        if _is_recurrent(module):
            if len(args) > 1:
                args = (args[0], states.read(module, args[1]), *args[2:])
            if "hx" in kwargs:
                kwargs = {**kwargs, "hx": states.read(module, kwargs["hx"])}
        leaves, spec = pytree.tree_flatten((args, kwargs))
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

        def call(*tensors: torch.Tensor) -> Any:
            filled = list(leaves)
            for i, tensor in zip(where, tensors, strict=True):
                filled[i] = tensor
            inner_args, inner_kwargs = pytree.tree_unflatten(filled, spec)
            return forward(*inner_args, **inner_kwargs)

        box: dict = {}
        inputs = [leaves[i] for i in where]
        outputs = iter(_OneOp.apply(call, box, len(inputs), *inputs, *module.parameters()))
        rebuilt = [next(outputs) if isinstance(t, torch.Tensor) else t for t in box["leaves"]]
        return pytree.tree_unflatten(rebuilt, box["spec"])

    return run


@contextlib.contextmanager
def run_as_one_op(model: nn.Module) -> Iterator[StateReads]:
    """Within the block, each recurrent layer and nn.Bilinear of `model` runs as one
    autograd op of its inputs (and its parameters); the initial hidden states the
    recurrent layers read are recorded in the StateReads yielded, and read as
    constants."""
    layers = [m for m in model.modules() if _is_recurrent(m) or type(m) is nn.Bilinear]
    own = {layer: vars(layer).get("forward") for layer in layers}  # an instance's own
    states = StateReads()
    for layer in layers:
        layer.forward = _one_op_forward(layer, states)
    try:
        yield states
    finally:
        for layer, forward in own.items():
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


class RecurrentInputPruner(BasePruningFunc):
    """Cuts a recurrent layer's input features: the columns of its first layer's input
    weights, in each direction. Its hidden units are not cut (see the module docstring)."""

    def prune_in_channels(self, layer: nn.Module, idxs: list[int]) -> nn.Module:
        assert isinstance(layer, (nn.RNNBase, nn.RNNCellBase))
        gone = set(idxs)
        cut_inputs(layer, torch.tensor([i for i in range(layer.input_size) if i not in gone]))
        return layer

    def prune_out_channels(self, layer: nn.Module, idxs: list[int]) -> nn.Module:
        raise ValueError(
            f"the pruner does not cut the hidden units of a {type(layer).__name__}: a group "
            "whose channels are its outputs is left whole"
        )

    def get_in_channels(self, layer: nn.Module) -> int:
        assert isinstance(layer, (nn.RNNBase, nn.RNNCellBase))
        return layer.input_size

    def get_out_channels(self, layer: nn.Module) -> int:
        if isinstance(layer, nn.RNNCellBase):
            return layer.hidden_size
        assert isinstance(layer, nn.RNNBase)
        return (layer.proj_size or layer.hidden_size) * (2 if layer.bidirectional else 1)


class BilinearPruner(BasePruningFunc):
    """nn.Bilinear as one node of the graph, which the pruner never cuts: the groups
    reaching it are left whole (`UNCUT_READERS`)."""

    def prune_in_channels(self, layer: nn.Module, idxs: list[int]) -> nn.Module:
        raise ValueError("the pruner does not cut the inputs of an nn.Bilinear")

    def prune_out_channels(self, layer: nn.Module, idxs: list[int]) -> nn.Module:
        raise ValueError("the pruner does not cut the outputs of an nn.Bilinear")

    def get_in_channels(self, layer: nn.Module) -> int | None:
        assert isinstance(layer, nn.Bilinear)  # two inputs: one width only when equal
        return layer.in1_features if layer.in1_features == layer.in2_features else None

    def get_out_channels(self, layer: nn.Module) -> int:
        assert isinstance(layer, nn.Bilinear)
        return layer.out_features


RECURRENT_INPUTS = RecurrentInputPruner()
BILINEAR = BilinearPruner()
# the handlers of readers whose inputs the pruner does not cut
UNCUT_READERS = (BILINEAR.prune_in_channels,)
# the handlers of a recurrent layer's or a bilinear layer's outputs, never cut
UNCUT_OUTPUTS = (RECURRENT_INPUTS.prune_out_channels, BILINEAR.prune_out_channels)


def reader_pruners(model: nn.Module) -> dict[type, BasePruningFunc]:
    """Torch-Pruning's `customized_pruners` for the recurrent and bilinear layers in
    `model`."""
    pruners: dict[type, BasePruningFunc] = {}
    for module in model.modules():
        if _is_recurrent(module):
            pruners[type(module)] = RECURRENT_INPUTS
        elif type(module) is nn.Bilinear:
            pruners[nn.Bilinear] = BILINEAR
    return pruners
