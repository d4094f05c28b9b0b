"""The proof that one mask covers a group: every layer that reads the group's channels
reads zero wherever the mask is zero.

The mask zeroes a channel at one module's output (the group's last BN, or the rows of
its depthwise conv or root). Removing the channel computes what masking it does only if
every reader of the channel sees that zero: from the mask a channel stays zero through
ops of one input that keep zero (activations, pooling, resampling, padding, reshapes),
through a product with anything (a squeeze-and-excitation's scale, a tanh GELU's
x * (1 + tanh(...))), and through a concatenation where the parts holding the group's
channels are zero. A reader that reads the channel before the mask (ShuffleNetV2's and
MaxViT's first blocks read the stem's output where only one branch's BN masks it), or
after an op that maps zero elsewhere (a sigmoid, an added bias or channel mean), is
not proven; its group takes the mask on its readers' input columns where they can
(groups.py), else it is left whole. Each reader's inputs are walked back through
Torch-Pruning's traced graph.
"""

from __future__ import annotations

import torch_pruning as tp
from torch import nn

from .fixed_filters import is_fixed_filter

# ops of one input that map zero elsewhere, by their autograd names (an excitation's
# sigmoid gate is reached only through its product; adding a constant is an Add of one
# input). Any other op of one input is taken to keep zero: the activations, pooling,
# resampling, padding, reshapes and casts do, and so do the custom autograd functions
# models write for them (BLOOM's GELU); one that does not is caught by export's check.
NOT_ZERO_PRESERVING = (
    "SigmoidBackward",
    "HardsigmoidBackward",
    "LogSigmoidBackward",
    "SoftplusBackward",
    "ExpBackward",
    "Exp2Backward",
    "CosBackward",
    "CoshBackward",
    "LogBackward",
    "Log2Backward",
    "Log10Backward",
    "ReciprocalBackward",
    "RsqrtBackward",
    "ErfcBackward",
    "AddBackward",
    "SubBackward",
    "RsubBackward",
    "ClampBackward",
    "ClampMinBackward",
    "ClampMaxBackward",
    "FillBackward",
    "OnesLikeBackward",
    # a matmul with a constant (a buffer: its one differentiable input) mixes the
    # channels it contracts; a linear layer's own matmul is its reader's, not one of these
    "MmBackward",
    "BmmBackward",
    "AddmmBackward",
    "BaddbmmBackward",
    "MvBackward",
)
# Torch-Pruning's own nodes for ops that move elements without computing on them
MOVING_OPS = (
    tp.ops._ReshapeOp,
    tp.ops._SplitOp,
    tp.ops._SliceOp,
    tp.ops._ExpandOp,
    tp.ops._UnbindOp,
)


# a linear layer's own matmul, which Torch-Pruning records as an op between the layer's
# node and its input when the input has more than two dimensions
OWN_MATMULS = ("AddmmBackward", "MmBackward")


def keeps_zero_per_channel(module: nn.Module) -> bool:
    """A module that computes each channel from that channel alone and maps zero to zero:
    a depthwise convolution with no bias (Xception's, between the group's BN and the next
    pointwise conv), a fixed per-channel filter."""
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return (
            module.bias is None
            and module.groups > 1
            and module.groups == module.in_channels == module.out_channels
        )
    return is_fixed_filter(module)


def op_name(node) -> str:
    """The autograd name of an elementwise op's node, or ""."""
    module = node.module
    return str(getattr(module, "_grad_fn", "")) if isinstance(module, tp.ops._ElementWiseOp) else ""


class _Proof:
    """Which nodes hold a group's channels, and which hold them zero under the mask."""

    def __init__(self, mask_at: nn.Module, group: set[nn.Module]) -> None:
        self.mask_at, self.group = mask_at, group
        self.zero: dict[int, bool] = {}
        self.held: dict[int, bool] = {}

    def holds(self, node) -> bool:
        """Whether `node`'s output holds the group's channels: it is one of the group's
        modules, or an op of an output that does (a layer outside the group makes other
        channels)."""
        key = id(node)
        if key not in self.held:
            self.held[key] = False  # a cycle (none in a forward's graph) holds nothing
            module = node.module
            if module in self.group:
                held = True
            elif isinstance(
                module, (tp.ops._ElementWiseOp, *MOVING_OPS, tp.ops._ConcatOp, nn.PReLU)
            ) or keeps_zero_per_channel(module):
                held = any(self.holds(i) for i in node.inputs)
            else:
                held = False
            self.held[key] = held
        return self.held[key]

    def is_zero(self, node) -> bool:
        """Whether `node`'s output is zero in a channel whose mask is zero."""
        key = id(node)
        if key not in self.zero:
            self.zero[key] = False  # a cycle proves nothing
            module, op, inputs = node.module, op_name(node), node.inputs
            if module is self.mask_at:
                zero = True
            elif op.startswith("MulBackward"):
                zero = any(self.is_zero(i) for i in inputs)
            elif isinstance(module, (tp.ops._ConcatOp, nn.PReLU)):
                # the channel is in the parts holding it (a PReLU's other input: its weight)
                holding = [i for i in inputs if self.holds(i)]
                zero = bool(holding) and all(self.is_zero(i) for i in holding)
            elif len(inputs) == 1 and (
                (op and not op.startswith(NOT_ZERO_PRESERVING))
                or isinstance(module, MOVING_OPS)
                or keeps_zero_per_channel(module)
            ):
                zero = self.is_zero(inputs[0])
            else:
                zero = False
            self.zero[key] = zero
        return self.zero[key]


def _reads_weight(node, linear: nn.Module) -> bool:
    """Whether `node` is an op on `linear`'s own weight (its transpose in a matmul)."""
    functions = getattr(node.grad_fn, "next_functions", ())
    return any(getattr(f, "variable", None) is linear.weight for f, _ in functions)


def _own_matmul(node, source):
    """The matmul node behind `source`, an input of the reader `node`, when it is the
    reader's own (a linear layer's matmul, directly or through the view back to the
    input's leading dims, where torch adds the bias after it when the input is not
    contiguous: PVTv2's MLP; through the view only when it reads the layer's own
    weight); else None."""
    if not isinstance(node.module, nn.Linear):
        return None
    matmul = source
    if isinstance(source.module, tp.ops._ReshapeOp) and len(source.inputs) == 1:
        matmul = source.inputs[0]
    if op_name(matmul).startswith(OWN_MATMULS) and (
        matmul is source or any(_reads_weight(i, node.module) for i in matmul.inputs)
    ):
        return matmul
    return None


def _read_inputs(node) -> list:
    """The nodes a reader reads its input from, through a linear layer's own matmul."""
    inputs: list = []
    for source in node.inputs:
        matmul = _own_matmul(node, source)
        # the matmul's inputs: the reader's input, and its transposed weight
        inputs.extend(matmul.inputs if matmul is not None else [source])
    return inputs


def own_matmul_ops(graph: tp.DependencyGraph, readers: list[nn.Module]) -> set[int]:
    """The ids of the op nodes' modules that are the linear `readers`' own matmul and
    its transposed weight (Torch-Pruning records them as ops before the layer): the
    readers' own contraction, not a mix of the channels on their way."""
    own = set()
    for reader in readers:
        node = graph.module2node[reader]
        for source in node.inputs:
            matmul = _own_matmul(node, source)
            if matmul is not None:
                weights = [i for i in matmul.inputs if _reads_weight(i, reader)]
                own |= {id(matmul.module), *(id(w.module) for w in weights)}
    return own


def unmasked_readers(
    graph: tp.DependencyGraph,
    readers: list[nn.Module],
    mask_at: nn.Module,
    group: list[nn.Module],
) -> list[nn.Module]:
    """The `readers` of a group's channels not proven to read zero where the mask at
    `mask_at` is zero; `group`: the modules that make or carry the channels (its
    producers, BNs, depthwise convs)."""
    proof = _Proof(mask_at, set(group))
    unproven = []
    for reader in readers:  # (a weight, read too, holds none of the group's channels)
        inputs = [i for i in _read_inputs(graph.module2node[reader]) if proof.holds(i)]
        if not inputs or not all(proof.is_zero(i) for i in inputs):
            unproven.append(reader)
    return unproven
