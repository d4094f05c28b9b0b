"""Prunable channel groups, found with Torch-Pruning's DependencyGraph.

A group is the output channels of one convolution, or the output features of one linear
layer (an MLP's hidden neurons), together with everything coupled to them (its BN, the
next layers' input channels, depthwise convolutions in between). Groups whose channels
meet a residual add or a concatenation involve several layers' outputs; following the
paper (for ResNets: the last convolution of a residual block is not pruned), those are
left alone, so a basic block prunes its first convolution and a bottleneck its first two.
Several linear layers whose outputs are multiplied (a gated MLP: act(gate(x)) * up(x))
form one group whose mask goes on the consuming layer's input columns. InstanceNorm
works per channel, as BatchNorm does; through a GroupNorm the unit is one of its groups.
LayerNorm and RMSNorm over the channels normalize each channel by all the others, so no
mask there survives export, and such groups are refused.
A layer whose outputs no layer consumes (the classifier, any model output) keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch_pruning as tp
from torch import nn

from .channel_affines import CHANNEL_AFFINES, LAST
from .channel_graph import (
    RETURNED,
    ChannelGraphError,
    SearchFailedError,
    bounded_search,
    failed_searches,
)
from .conv1d import is_conv1d
from .excitations import excited_root
from .frozen_norms import FROZEN_BATCH_NORM
from .graph_workarounds import UNMAPPED_RESHAPE
from .group_search import TENSOR_OPS, UNFOLLOWED, mappings_held
from .grouped_convs import Conv, equal_parts, is_grouped
from .masked_reads import own_matmul_ops, unmasked_readers
from .module_tensors import tensor_of
from .recurrent_readers import (
    RECURRENT_INPUTS,
    STATE_READERS,
    UNCUT_OUTPUTS,
    UNCUT_READERS,
)


@dataclass
class ChannelGroup:
    name: str  # the root layer's module name
    layer: nn.Conv1d | nn.Conv2d | nn.Conv3d | nn.Linear  # the root: its output channels (features)
    # the group's last per-channel affine op (BatchNorm, InstanceNorm, a per-channel
    # affine layer), when there is one
    bn: nn.Module | None
    size: int  # units: channels, or the groups of a GroupNorm (see `channels_per_unit`)
    kept_out: list[nn.Module] = field(default_factory=list)  # modules losing output channels
    kept_in: list[nn.Module] = field(default_factory=list)  # modules losing input channels
    # normalizations over all channels that the group passes through (LayerNorm, RMSNorm,
    # several GroupNorms): removing any channel changes what they compute for the others,
    # so the masked model and the exported one would differ (the pruner refuses these)
    norms: list[nn.Module] = field(default_factory=list)
    # where a parameter mask goes when `bn` is None: the rows of the root, or of the
    # depthwise conv after it whose bias would otherwise be added to masked channels
    # (None given: the root, set by __post_init__)
    rows: nn.Module = None  # type: ignore[assignment]
    # a gated group (several outputs multiplied): the mask goes on the input columns of
    # the consuming linear layers instead, the one place where it is exact
    gated: bool = False
    # a GroupNorm the channels pass through: the unit is one of its groups (removing a
    # whole group leaves the others' statistics as they were); masked after it
    group_norm: nn.GroupNorm | None = None
    # residual-coupled channels (prune_coupled=True): every layer that writes into the
    # shared width, each with the module whose rows take the mask (its BN, or itself)
    producers: list[tuple[nn.Module, nn.Module]] = field(default_factory=list)
    # the root's outputs are this many equal parts combined channel by channel (Phi-3's
    # gate_up_proj, chunked into gate and up): unit i is channel i of every part
    parts: int = 1
    # the modules owning raw parameters of the group's width (Torch-Pruning cuts them
    # with it: a GRN's weight and bias, a per-channel scale)
    param_owners: list[nn.Module] = field(default_factory=list)
    # a global response normalization the channels pass through (ConvNeXt V2's GRN),
    # exact when its bias is masked too and export rescales it (response_norms.py)
    response_norms: list[nn.Module] = field(default_factory=list)
    # raw parameters of the channels' width outside the layers and norms (SSD's L2-norm
    # scale), which Torch-Pruning cuts with them: (owner, attribute, dim)
    scales: list[tuple[nn.Module, str, int]] = field(default_factory=list)
    # consumers that read each channel at several inputs, with how many (a linear layer
    # after a flatten: the feature map's area)
    reads: dict[nn.Module, int] = field(default_factory=dict)
    # grouped convolutions write or read the channels: as many parts, each keeping as
    # many channels (grouped_convs.py)
    conv_groups: int = 1
    # per-channel affine layers the channels pass through (channel_affines.py), cut with
    # them; no layer formula counts their parameters
    channel_affines: list[nn.Module] = field(default_factory=list)
    # layers the group cuts whose weights other modules hold too (an output layer tied to
    # the embedding): export would untie them, so the pruner refuses the group
    shared_weights: list[str] = field(default_factory=list)
    # RMS norms over the channels, each with the module whose output it reads (the root,
    # a depthwise conv, another of them), exact when export rescales them with it
    # (channel_rms_norms.py)
    rms_norms: list[tuple[nn.Module, nn.Module]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.rows is None:
            self.rows = self.layer

    @property
    def segments(self) -> int:
        """Transport segments of equal size, each keeping as many units."""
        return self.conv_groups

    @property
    def channels_per_unit(self) -> int:
        if self.group_norm is None:
            return 1
        return self.group_norm.num_channels // self.group_norm.num_groups

    @property
    def rows_per_table_unit(self) -> int:
        """Entries a per-channel table (`scales`; a subclass's `tables`) loses per unit
        removed."""
        return self.channels_per_unit

    @property
    def width(self) -> dict[nn.Module, int]:
        """Channels each module loses per unit removed (the cost model counts channels)."""
        if self.parts > 1:  # the root loses a channel of each part; its consumers one
            return {self.layer: self.parts}
        per_unit = self.channels_per_unit
        widths = {m: per_unit for m in [*self.kept_out, *self.kept_in]}
        widths.update({m: per_unit * n for m, n in self.reads.items()})
        return {m: n for m, n in widths.items() if n != 1}

    @property
    def cut_norms(self) -> list[tuple[nn.Module, int]]:
        """The norms cut with the units: (norm, its parameters per unit)."""
        norms = [*self.response_norms, *self.channel_affines, *(n for n, _ in self.rms_norms)]
        return [(n, sum(p.numel() for p in n.parameters()) // self.size) for n in norms]

    def unit_weights(self) -> torch.Tensor:
        """The root's weights, one row per unit (its filter, or a GroupNorm group's); of
        a coupled group, every producer's filters of the channel side by side."""
        if self.parts > 1:  # unit i: row i of every part
            weight = self.layer.weight.detach()
            return weight.view(self.parts, self.size, -1).transpose(0, 1).reshape(self.size, -1)
        layers = [layer for layer, _ in self.producers] or [self.layer]
        weights = [tensor_of(m).detach().reshape(self.size, -1) for m in layers]
        return torch.cat(weights, dim=1)

    def channels(self, units: torch.Tensor) -> torch.Tensor:
        """The channel indices of `units`."""
        if self.parts > 1:
            return (units[None, :] + self.size * torch.arange(self.parts)[:, None]).flatten()
        per_unit = self.channels_per_unit
        return (units[:, None] * per_unit + torch.arange(per_unit)).flatten()


# the convolutions whose output channels are group roots (1-D, images, video and volumes)
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED_CONVS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
# how Torch-Pruning names the autograd nodes that merge several layers' outputs
MERGING_OPS = ("AddBackward", "SubBackward", "CatBackward", "StackBackward")
# attention (a softmax, or torch's fused scaled_dot_product_attention): its code
# reshapes the channels into heads of a fixed size that export cannot change (a fused
# qkv projection not in a recognised form: Falcon's, BLOOM's, MPT's); a softmax over
# channels would also make each channel depend on the others
ATTENTION_OPS = ("ScaledDotProduct", "SoftmaxBackward", "LogSoftmaxBackward")


def _op_name(module) -> str:
    if isinstance(module, tp.ops._ConcatOp):  # Torch-Pruning's own node for torch.cat
        return "CatBackward0"
    return str(getattr(module, "_grad_fn", "")) if isinstance(module, tp.ops._ElementWiseOp) else ""


# what an addition inside one channel's computation is called in a group's ops: not a
# merge (T5's and UMT5's tanh GELU, x + 0.044715 * x**3, is one in a gated MLP)
WITHIN_CHANNEL_ADD = "WithinChannelAdd"
# ops Torch-Pruning follows as elementwise that mix channels: a term reached through one
# counts as a source of its own
MIXING_OPS = (
    "MmBackward",
    "BmmBackward",
    "AddmmBackward",
    "BaddbmmBackward",
    "SumBackward",
    "MeanBackward",
    "CumsumBackward",
    "TBackward",
    "TransposeBackward",
    "PermuteBackward",
    *ATTENTION_OPS,
)
# reductions over the channels (a sum of squares, a norm, a maximum): every channel left
# in reads the removed ones through them
REDUCING_OPS = (
    "SumBackward",
    "MeanBackward",
    "CumsumBackward",
    "NormBackward",
    "LinalgVectorNormBackward",
    "VarBackward",
    "StdBackward",
    "AmaxBackward",
    "MaxBackward",
    "LogsumexpBackward",
)


def _of_scalars(node) -> bool:
    """Whether an op the graph records with no inputs computes on one-element
    parameters alone (so it is the same for every channel it is broadcast to)."""
    grad_fn = getattr(node, "grad_fn", None)
    stack, leaves, seen = [grad_fn] if grad_fn is not None else [], [], set()
    while stack:
        function = stack.pop()
        if function in seen:  # shared by two terms: walked once
            continue
        seen.add(function)
        variable = getattr(function, "variable", None)
        if variable is not None:
            leaves.append(variable)
        stack.extend(f for f, _ in getattr(function, "next_functions", ()) if f is not None)
    return bool(leaves) and all(leaf.numel() == 1 for leaf in leaves)


def _group_op(graph: tp.DependencyGraph, module) -> str:
    """The op's name in a group; an addition whose terms all come from one layer (through
    elementwise ops only, none of MIXING_OPS, and ops on scalar parameters) is
    WITHIN_CHANNEL_ADD, not a merge of widths."""
    name = _op_name(module)
    if not name.startswith(("AddBackward", "SubBackward")):
        return name
    sources, stack, seen = set(), list(graph.module2node[module].inputs), set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        op = _op_name(node.module)
        if op and node.inputs and not op.startswith(MIXING_OPS):
            stack.extend(node.inputs)
        elif not node.inputs and _of_scalars(node):
            continue  # the same for every channel: XIELU's softplus of its scalar alphas
        else:
            sources.add(node.module)
            if len(sources) > 1:  # a merge: no need to walk a residual stream to its start
                return name
    return WITHIN_CHANNEL_ADD


PER_CHANNEL_NORMS = (
    tp.prune_batchnorm_out_channels,
    tp.prune_instancenorm_out_channels,
    FROZEN_BATCH_NORM.prune_out_channels,
    *(pruner.prune_out_channels for pruner in CHANNEL_AFFINES.values()),
)


def _is_depthwise(module: nn.Module) -> bool:
    return (
        isinstance(module, CONVS)
        and module.groups > 1
        and (module.groups == module.in_channels == module.out_channels)
    )


def _per_channel_width(module: nn.Module) -> int:
    """The channels a BN, InstanceNorm, per-channel affine layer or depthwise conv acts on."""
    if isinstance(module, CONVS):
        return module.out_channels
    return getattr(module, "num_features", None) or tensor_of(module).numel()


def _plain_layer(module: nn.Module) -> bool:
    """Whether `module` is a linear layer or an ungrouped convolution: a gated group's
    mask goes on such a consumer's input columns."""
    return isinstance(module, nn.Linear) or (isinstance(module, CONVS) and module.groups == 1)


def _in_width(layer: nn.Module) -> int:
    """A linear layer's input features, a convolution's input channels."""
    root = _root(layer)
    return root.in_features if isinstance(root, nn.Linear) else root.in_channels


def out_width(layer: nn.Module) -> int:
    """A group root's output channels (a convolution) or features (a linear layer, or
    the transformers Conv1D an exported GPT-2 has back)."""
    if is_conv1d(layer):
        return layer.nf
    root = _root(layer)
    return root.out_features if isinstance(root, nn.Linear) else root.out_channels


def _root(layer: nn.Module) -> Conv | nn.Linear:
    """`layer` as what a group's root is: a convolution or a linear layer."""
    if isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)):
        return layer
    kind = type(layer).__name__
    raise TypeError(f"a group's root is a convolution or a linear layer, not a {kind}")


def out_channel_handler(layer: nn.Module):
    """Torch-Pruning's function that removes a group root's output channels."""
    return (
        tp.prune_linear_out_channels if isinstance(layer, nn.Linear) else tp.prune_conv_out_channels
    )


def _parts(graph: tp.DependencyGraph, layer: nn.Module) -> int | None:
    """How many of `layer`'s output channels go when its channel 0 goes: 1 when each goes
    alone; h when they are channel 0 of h equal parts, as a fused projection split into
    parts combined channel by channel (Phi-3's gate_up_proj, chunked into gate and up:
    channel i goes with channel i + n/2); None for any other coupling, such as a split
    whose parts Torch-Pruning does not remove together (timm's GluMlp chunks fc1 into
    value and gate: its export would cut the consumers' inputs at the wrong indices)."""
    group = graph.get_pruning_group(layer, out_channel_handler(layer), [0])
    if getattr(group, UNFOLLOWED, False):
        return None
    removed = sorted({int(i) for dep, idxs in group if dep.target.module is layer for i in idxs})
    width, parts = out_width(layer), len(removed)
    if not parts or width % parts or removed != [p * (width // parts) for p in range(parts)]:
        return None
    if parts == 1 and any(isinstance(dep.target.module, tp.ops._SplitOp) for dep, _ in group):
        return None
    return parts


# the handlers of layers that read a group's channels into channels of their own
READER_HANDLERS = (
    tp.prune_conv_in_channels,
    tp.prune_depthwise_conv_in_channels,
    tp.prune_linear_in_channels,
    RECURRENT_INPUTS.prune_in_channels,
)


def _shared_parameters(model: nn.Module) -> set[int]:
    """The ids of parameters more than one module holds (tied weights)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            holders[id(parameter)] = holders.get(id(parameter), 0) + 1
    return {key for key, count in holders.items() if count > 1}


def _parameter_owners(model: nn.Module) -> dict[int, nn.Module]:
    return {
        id(parameter): module
        for module in model.modules()
        for parameter in module.parameters(recurse=False)
    }


def is_response_norm_shaped(module: nn.Module, width: int) -> bool:
    """Whether `module` has the parameters of a GRN over `width` channels
    (response_norms.py): a weight and a bias of `width` entries each, along their last
    dimension, and nothing else."""
    params = dict(module.named_parameters())
    return set(params) == {"weight", "bias"} and all(
        p.numel() == width and p.shape[-1] == width for p in params.values()
    )


def is_norm(module: nn.Module) -> bool:
    """A normalization layer (RMSNorm, LayerNorm2d, model-specific norms Torch-Pruning has
    no handler for), known by its class name."""
    return "norm" in type(module).__name__.lower()


def _coupled_producers(
    graph: tp.DependencyGraph, out_layers: list, bns: list
) -> list[tuple[nn.Module, nn.Module]]:
    """Each layer writing into a residual-coupled width, with the BN right after it (whose
    rows take the mask) or itself when none follows; and each BN of the width after none
    of them (RepVGG's identity branch, a BN of the block's input added to the sum), whose
    rows take the mask too: it would give the removed channels its bias back."""
    producers = []
    for layer in out_layers:
        after = [n.module for n in graph.module2node[layer].outputs if n.module in bns]
        producers.append((layer, after[0] if after else layer))
    masked = {target for _, target in producers}
    return producers + [(bn, bn) for bn in bns if bn not in masked]


def _coupling_problem(ops: list[str], norms: list, params: list, bns: list, rest: list) -> str:
    """Why a residual-coupled group cannot be masked exactly, or ""."""
    merging = [op for op in ops if op.startswith(MERGING_OPS)]
    if any(not op.startswith(("AddBackward", "SubBackward")) for op in merging):
        return "its width meets a concatenation"
    if norms:
        return "a normalization over all channels reads the shared width"
    if params:
        return "a parameter (a position embedding, a class token) is added to it"
    if rest or any(not getattr(bn, "affine", False) for bn in bns):
        return "a depthwise conv, a GroupNorm or a BN without affine parameters is in it"
    return ""


def output_layers(graph: tp.DependencyGraph, roots: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """The layers of the `roots` types from whose outputs only tensor ops lead, to the
    model's outputs: no module reads their channels, so they keep them all, and their
    groups need no search. A detection head's box regressor is one: its outputs are decoded
    into boxes, and there Torch-Pruning's search does not end."""
    # whether some module (anything but a tensor op) is reached from a node's outputs,
    # decided for each node once, after its outputs (depth first; a node met again while
    # its outputs are visited closes a cycle and adds nothing)
    reaches: dict[int, bool] = {}
    entered: set[int] = set()
    state_readers = getattr(graph, STATE_READERS, {})
    for start in graph.module2node.values():
        stack = [(start, False)]
        while stack:
            node, outputs_done = stack.pop()
            if outputs_done:
                reaches[id(node)] = any(
                    not isinstance(out.module, TENSOR_OPS)
                    or out.grad_fn in state_readers  # a recurrent layer's initial state
                    or reaches.get(id(out), False)
                    for out in node.outputs
                )
            elif id(node) not in entered:
                entered.add(id(node))
                stack.append((node, True))
                stack.extend((out, False) for out in node.outputs)
    return [
        module
        for module, node in graph.module2node.items()
        if isinstance(module, roots) and not reaches[id(node)]
    ]


def shuffled_layers(
    graph: tp.DependencyGraph, roots: tuple[type[nn.Module], ...]
) -> list[nn.Module]:
    """The layers of the `roots` types whose channels meet a reshape the graph left
    unmapped (UNMAPPED_RESHAPE: a channel shuffle): their groups are left whole, with no
    search (Torch-Pruning's search through a shuffle fails). The channels' reach is
    followed both ways through everything but the layers that mix channels (a
    concatenation's other inputs, a depthwise conv's inputs and a residual stream share
    them): more than the group, never less, so no group searched passes one."""
    if not any(getattr(n.module, UNMAPPED_RESHAPE, False) for n in graph.module2node.values()):
        return []

    def mixes(node) -> bool:
        return isinstance(node.module, roots) and not _is_depthwise(node.module)

    found = []
    for module, start in graph.module2node.items():
        if not isinstance(module, roots):
            continue
        stack = list(start.outputs) + (list(start.inputs) if _is_depthwise(module) else [])
        seen = {id(start)}
        while stack:
            node = stack.pop()
            if id(node) in seen or mixes(node):
                continue
            seen.add(id(node))
            if getattr(node.module, UNMAPPED_RESHAPE, False):
                found.append(module)
                break
            stack.extend([*node.outputs, *node.inputs])
    return found


def find_groups(
    model: nn.Module,
    graph: tp.DependencyGraph,
    ignored: list[nn.Module],
    coupled: bool = False,
    whole: dict[nn.Module, str] | None = None,
) -> list[ChannelGroup]:
    """All prunable groups, in model order. `coupled`: also the residual-coupled widths
    that can be masked exactly (each producer masked at its BN). `whole`, when given,
    gets why each layer whose output channels no group holds was left whole (its first
    reason: a layer may be in several of the graph's groups)."""
    whole = {} if whole is None else whole
    names = {module: name for name, module in model.named_modules()}
    roots = [*CONVS, nn.Linear]
    outputs, shuffled = output_layers(graph, tuple(roots)), shuffled_layers(graph, tuple(roots))
    for layer in outputs:
        whole.setdefault(layer, "its outputs are the model's outputs: no layer reads them")
    for layer in shuffled:
        whole.setdefault(layer, "a channel shuffle reorders its channels")
    ignored = ignored + outputs + shuffled
    # the roots whose searches fail are left out and the search begun again, so that one
    # error names all of them: a user leaves them whole at the next try
    failed: dict[nn.Module, str] = {}
    while True:
        try:
            with bounded_search(graph, names), mappings_held(graph):  # nothing pruned here
                found = _channel_groups(
                    model, graph, ignored + list(failed), coupled, names, roots, whole
                )
                if not failed:  # (the index mappings held: updated once for all searches)
                    grouped = [m for g in found.values() for m in g.kept_out]
                    decided = [*found, *grouped, *whole, *ignored]
                    _held_with_left_out(graph, decided, set(ignored), names, roots, whole)
            break
        except SearchFailedError as error:
            if error.layer in failed:  # a search of the root's own code, not a root's
                raise
            failed[error.layer] = error.why
    if failed:
        raise ChannelGraphError(failed_searches(failed, names))
    return [found[m] for m in model.modules() if m in found]


def _held_with_left_out(
    graph: tp.DependencyGraph,
    decided: list[nn.Module],
    left_out: set[nn.Module],
    names: dict[nn.Module, str],
    roots: list[type[nn.Module]],
    whole: dict[nn.Module, str],
) -> None:
    """Why each root layer that neither has a group nor a reason yet is left whole:
    Torch-Pruning's search yields no group whose channels a layer it was told to leave
    out also writes (the projections of attention heads, a layer in ignored_layers), so
    such a layer's output channels go with that one's."""
    done, kinds = set(decided), tuple(roots)
    for module in graph.module2node:
        if not isinstance(module, kinds) or module in done:
            continue
        try:
            group = graph.get_pruning_group(module, out_channel_handler(module), [0])
        except SearchFailedError:  # no reason found here: the general one stands
            continue
        written = [d.target.module for d, _ in group if graph.is_out_channel_pruning_fn(d.handler)]
        # one search answers for every layer whose outputs are in the group
        writers = [m for m in written if isinstance(m, kinds)]
        done.update(writers)
        held = [m for m in dict.fromkeys(written) if m in left_out]
        if not held:
            continue
        listed = ", ".join(repr(names.get(m, type(m).__name__)) for m in held[:3])
        for writer in writers:
            if writer not in left_out:
                whole.setdefault(
                    writer,
                    f"its output channels go with those of {listed}, which the channel "
                    "search leaves out (an attention layer's projections, a layer in "
                    "ignored_layers)",
                )


def _leave(
    whole: dict[nn.Module, str],
    layers: list[nn.Module],
    why: str,
    readers: list[nn.Module] | tuple = (),
) -> None:
    """Record why `layers` are left whole, and why their `readers` read all of their
    channels, where no reason was recorded for them before."""
    for layer in layers:
        whole.setdefault(layer, why)
    for layer in readers:
        whole.setdefault(layer, f"the channels it reads are left whole ({why})")


def _uncut_why(layer: nn.Module, group, names: dict[nn.Module, str]) -> str:
    """Why channels that `layer`, a layer the pruner never cuts, reads or writes are left
    whole."""
    kind = f"{type(layer).__name__} ({names[layer]!r})"
    if any(dep.target.module is layer and dep.handler in UNCUT_OUTPUTS for dep, _ in group):
        return f"its channels are coupled with the outputs of a {kind}, which are never cut"
    return f"a {kind} reads its channels, and the pruner does not cut its inputs"


def _coupled_why(
    layers: list[nn.Module], ops: list[str], names: dict[nn.Module, str], coupled: bool
) -> str:
    """Why channels several layers produce together are left whole: where they meet."""
    merges = sorted({op.rstrip("0123456789") for op in ops if op.startswith(MERGING_OPS)})
    at = f" at {', '.join(merges)}" if merges else ""
    others = f"{len(layers) - 1} other layer{'s' if len(layers) > 2 else ''}"
    why = (
        f"its output channels are coupled with those of {others}{at} "
        f"({', '.join(repr(names[m]) for m in layers[:3])}{' ...' if len(layers) > 3 else ''})"
    )
    if not coupled and not any(isinstance(m, nn.Linear) for m in layers):
        why += "; prune_coupled=True prunes coupled conv channels masked at their BNs"
    return why


def _channel_groups(
    model: nn.Module,
    graph: tp.DependencyGraph,
    ignored: list[nn.Module],
    coupled: bool,
    names: dict[nn.Module, str],
    roots: list[type[nn.Module]],
    whole: dict[nn.Module, str],
) -> dict[nn.Module, ChannelGroup]:
    """find_groups' search: each prunable group by its root layer; why each group it
    leaves out is left whole goes into `whole`, for the layers whose outputs it holds."""
    owners = _parameter_owners(model)
    shared = _shared_parameters(model)
    order = {module: index for index, module in enumerate(model.modules())}
    returned: set[object] = getattr(graph, RETURNED, set())  # grad_fns
    returning = {n for n in graph.module2node.values() if n.grad_fn in returned}
    state_readers: dict[object, nn.Module] = getattr(graph, STATE_READERS, {})
    found: dict[nn.Module, ChannelGroup] = {}
    for group in graph.get_all_groups(ignored_layers=list(ignored), root_module_types=roots):
        out_layers: list[nn.Module] = [group[0].dep.target.module]  # the root, until all found
        uncut = [d.target.module for d, _ in group if d.handler in UNCUT_READERS + UNCUT_OUTPUTS]
        if uncut:  # (whether or not the search went on past them)
            reading = [d.target.module for d, _ in group if d.handler in READER_HANDLERS]
            _leave(whole, out_layers, _uncut_why(uncut[0], group, names), reading)
            continue
        if getattr(group, UNFOLLOWED, False):
            _leave(
                whole,
                out_layers,
                "the channel graph cannot follow its channels (a reshape it maps wrongly)",
            )
            continue
        if any(d.target in returning and d.handler not in READER_HANDLERS for d, _ in group):
            _leave(whole, out_layers, "the model returns its channels (a detector's feature maps)")
            continue
        out_layers, bns, outs, ins, norms, depthwise, ops = [], [], [], [], [], [], []
        op_ids: list[int] = []  # each op's module, to tell the readers' own matmuls
        group_norms, params, param_owners, affines = [], [], [], []
        read: dict[nn.Module, int] = {}  # input channels of each consumer the group holds
        grouped_reads: dict[Conv, list[int]] = {}  # grouped convs' inputs, in order
        for dep, idxs in group:
            module, handler = dep.target.module, dep.handler
            ops.append(_group_op(graph, module))
            op_ids.append(id(module))
            if handler in (tp.prune_conv_out_channels, tp.prune_depthwise_conv_out_channels):
                outs.append(module)
                if not _is_depthwise(module):
                    out_layers.append(module)
                elif module.bias is not None:
                    depthwise.append(module)
            elif handler == tp.prune_linear_out_channels:
                outs.append(module)
                out_layers.append(module)
            elif handler in PER_CHANNEL_NORMS:
                bns.append(module)
                outs.append(module)
                pruner = getattr(handler, "__self__", None)  # a bound method's owner
                if pruner is not None and pruner in CHANNEL_AFFINES.values():
                    affines.append((module, pruner.form))
            elif handler == tp.prune_groupnorm_out_channels:
                group_norms.append(module)
                outs.append(module)
            elif handler == tp.prune_layernorm_out_channels:
                norms.append(module)
            elif handler == tp.prune_parameter_out_channels:
                owner = owners.get(id(module))
                if owner is not None and owner not in param_owners:
                    param_owners.append(owner)
                if owner is not None and is_norm(owner):
                    if owner not in norms:
                        norms.append(owner)
                else:
                    params.append(module)
            elif handler in READER_HANDLERS:
                ins.append(module)
                read[module] = len(idxs)
                if is_grouped(module):
                    grouped_reads[module] = [int(i) for i in idxs]
        read_as_state = [
            state_readers[d.target.grad_fn] for d, _ in group if d.target.grad_fn in state_readers
        ]
        if read_as_state:
            name = names[read_as_state[0]]
            why = f"a recurrent layer ({name!r}) reads its channels as its initial hidden state"
            _leave(whole, out_layers, why, ins)
            continue
        if any(isinstance(m, TRANSPOSED_CONVS) for m in outs):
            # its output channels lie along the weight's second dimension, where no mask
            # goes (a transposed convolution is never a root for the same reason)
            _leave(whole, out_layers, "a transposed convolution writes its channels", ins)
            continue
        gated = (
            len(out_layers) > 1
            and all(_plain_layer(m) for m in [*out_layers, *ins])
            and any(op.startswith("MulBackward") for op in ops)
            and not any(op.startswith(MERGING_OPS) for op in ops)
            and not bns + norms + depthwise + group_norms
        )
        if gated and len({out_width(m) for m in out_layers} | {_in_width(m) for m in ins}) > 1:
            # the mask goes on the consumers' columns, one per channel: a consumer or a
            # producer of another width (CaiT's qkv through its talking heads, where
            # Torch-Pruning follows the channels through a matmul) is no gated MLP
            _leave(
                whole,
                out_layers,
                "its channels are multiplied with channels of another width",
                ins,
            )
            continue
        if gated and any(op.startswith(REDUCING_OPS) for op in ops):
            # a sum over the channels after the product (Dory's L2 norm): the removed ones
            # would still count in it, masked on the consumers' columns
            _leave(
                whole,
                out_layers,
                "its gated channels are summed over after the product (a norm over them)",
                ins,
            )
            continue
        residual = (
            coupled
            and len(out_layers) > 1
            and not gated
            and all(not isinstance(m, nn.Linear) for m in out_layers)
            and not _coupling_problem(ops, norms, params, bns, depthwise + group_norms)
            and len({m.out_channels for m in out_layers}) == 1  # no padded shortcut between
        )
        if (
            len(out_layers) > 1
            and not gated
            and not residual
            and ins
            and not any(op.startswith(MERGING_OPS) for op in ops)
        ):  # scaled by their own squeeze-and-excitation (a merge would fail its proof)
            path = [m for m in outs if m not in out_layers]  # BNs, depthwise convs
            mask_at = max([*bns, *depthwise], key=lambda m: order[m], default=None)
            root = excited_root(graph, out_layers, path, mask_at)
            out_layers = [root] if root is not None else out_layers
        if not ins:
            _leave(
                whole, out_layers, "no layer reads its channels (they reach the model's outputs)"
            )
            continue
        if len(out_layers) != 1 and not gated and not residual:
            _leave(whole, out_layers, _coupled_why(out_layers, ops, names, coupled), ins)
            continue
        if any(op.startswith(ATTENTION_OPS) for op in ops):
            _leave(
                whole,
                out_layers,
                "attention code the pruner does not know reshapes its channels into heads",
                ins,
            )
            continue
        if any(
            not isinstance(m, nn.Linear if form == LAST else nn.Conv2d)
            for m in out_layers
            for _, form in affines
        ):
            _leave(
                whole,
                out_layers,
                "a per-channel affine layer reads its channels along another dimension",
                ins,
            )
            continue
        if set(out_layers) & set(ignored):
            held = [names[m] for m in out_layers if m in ignored]
            _leave(
                whole,
                out_layers,
                f"its output channels go with those of {held}, left whole",
                ins,
            )
            continue
        layer = _root(min(out_layers, key=lambda m: order[m]))
        # cutting one use of a shared weight would untie it from the others (refused)
        tied = [names[m] for m in [*outs, *ins] if any(id(p) in shared for p in m.parameters())]
        size = out_width(layer)
        conv_groups = 1
        if any(is_grouped(m) for m in [*outs, *ins]):  # as many from each of its groups
            equal = equal_parts([m for m in outs if is_grouped(m)], grouped_reads, size)
            if equal is None or residual or gated or group_norms:
                _leave(
                    whole,
                    out_layers,
                    "a grouped conv reads its channels in groups of unequal parts",
                    ins,
                )
                continue
            conv_groups = equal
        # a consumer reading each channel at several inputs (a linear layer after a
        # flatten reads a channel's whole feature map) loses that many per channel
        reads = {m: n // size for m, n in read.items() if n != size and n % size == 0}
        if not residual and any(_per_channel_width(m) != size for m in [*bns, *depthwise]):
            # a BN over a concatenation (DenseNet): it reads other layers' channels too, and
            # every such BN would need the mask at the group's offset in it, not one place
            _leave(
                whole,
                out_layers,
                "a BatchNorm over a concatenation of several layers' channels reads them",
                ins,
            )
            continue
        parts = _parts(graph, layer)
        if parts is None:
            _leave(
                whole,
                out_layers,
                "its channels go in parts the channel graph does not remove together",
                ins,
            )
            continue
        if parts > 1:  # channel i of each part combined into the consumers' input i
            part = size // parts
            if (
                residual
                or len(out_layers) != 1
                or not isinstance(layer, nn.Linear)
                or not all(isinstance(m, nn.Linear) and m.in_features == part for m in ins)
                or not any(op.startswith("MulBackward") for op in ops)
                or any(op.startswith(MERGING_OPS) for op in ops)
                or bns + norms + depthwise + group_norms + params
            ):  # the mask could not go where the parts are combined
                _leave(
                    whole,
                    out_layers,
                    "its channels are split into parts combined where no mask can go",
                    ins,
                )
                continue
            found[layer] = ChannelGroup(
                names[layer],
                layer,
                None,
                part,
                outs,
                ins,
                [],
                layer,
                gated=True,
                parts=parts,
                shared_weights=tied,
            )
            continue
        # Mask at the last affine op before the nonlinearity that ends the group: a
        # depthwise conv (with a bias) or its BN after the root would otherwise add its
        # bias back to the masked channels.
        last = max([*bns, *depthwise], key=lambda m: order[m], default=None)
        if (
            not residual
            and len([*bns, *depthwise]) > 1
            and any(op.startswith(MERGING_OPS) for op in ops)
        ):
            # the channels also leave before `last` (GhostNet concatenates the root's
            # output with the depthwise conv's): a mask at `last` would not cover them
            _leave(
                whole, out_layers, "its channels are concatenated before the last per-channel op"
            )
            continue
        bn = last if last in bns else None
        rows: nn.Module = last if last is not None and last in depthwise else layer
        if residual:
            found[layer] = ChannelGroup(
                names[layer],
                layer,
                None,
                size,
                outs,
                ins,
                [],
                layer,
                producers=_coupled_producers(graph, out_layers, bns),
                reads=reads,
                shared_weights=tied,
            )
            continue
        group_norm = None
        if len(group_norms) == 1 and not bns + depthwise:
            group_norm = group_norms[0]  # masked after it, per group of channels
            size, rows = group_norm.num_groups, group_norm
        else:
            norms.extend(group_norms)
        if (
            param_owners
            and not norms + group_norms
            and not gated
            and not any(is_response_norm_shaped(owner, size) for owner in param_owners)
            and unmasked_readers(graph, ins, bn or rows, outs)
        ):  # a raw per-channel parameter added after the mask: left whole
            _leave(
                whole,
                out_layers,
                "a raw per-channel parameter is added to its channels after the mask",
                ins,
            )
            continue
        if (
            not norms + param_owners
            and not gated
            and unmasked_readers(graph, ins, bn or rows, outs)
        ):  # (a GRN's raw per-channel parameters have rules of their own)
            # a layer reads the channels where the mask does not reach them (after an op
            # that maps zero elsewhere: MetaFormer's StarReLU adds a bias): masked on every
            # reader's input columns instead, where the readers are all there is
            own = own_matmul_ops(graph, ins)
            between = [op for op, i in zip(ops, op_ids, strict=True) if i not in own]
            if not _columns_cover(ins, read, size, between, group_norm, params, conv_groups):
                _leave(
                    whole,
                    out_layers,
                    "a layer reads its channels where no mask reaches them",
                    ins,
                )
                continue
            gated, bn, rows = True, None, layer
        found[layer] = ChannelGroup(
            names[layer],
            layer,
            bn,
            size,
            outs,
            ins,
            norms,
            rows,
            gated,
            group_norm,
            param_owners=param_owners,
            scales=[_table(graph, owners[id(p)], p) for p in params],
            reads=reads,
            conv_groups=conv_groups,
            channel_affines=[module for module, _ in affines],
            shared_weights=tied,
        )
    return found


def _columns_cover(
    ins: list[nn.Module],
    read: dict[nn.Module, int],
    size: int,
    ops: list[str],
    group_norm: nn.Module | None,
    params: list,
    conv_groups: int,
) -> bool:
    """Whether a mask on the readers' input columns removes what removing the channels
    does: every reader a linear layer or an ungrouped conv that reads exactly the group's
    channels, and nothing between the producer and them that mixes channels (a mean or a
    matmul over them, an addition or concatenation with other channels: a channel left
    in would see the removed ones) or is cut per unit (a GroupNorm, raw parameters)."""
    if group_norm is not None or params or conv_groups != 1:
        return False
    if any(op.startswith((*MIXING_OPS, *MERGING_OPS)) for op in ops):
        return False
    for reader in ins:
        if isinstance(reader, nn.Linear):
            width = reader.in_features
        elif isinstance(reader, CONVS) and reader.groups == 1:
            width = reader.in_channels
        else:
            return False
        if width != size or read.get(reader) != size:
            return False
    return True


def _table(
    graph: tp.DependencyGraph, owner: nn.Module, parameter: nn.Parameter
) -> tuple[nn.Module, str, int]:
    """(owner, attribute, dim) of a raw parameter Torch-Pruning cuts along `dim`."""
    name = next(n for n, p in owner.named_parameters(recurse=False) if p is parameter)
    return owner, name, graph.module2node[parameter].pruning_dim % parameter.dim()
