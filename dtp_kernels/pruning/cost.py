"""The one cost model of the pruning layer: parameters and FLOPs of a model, before and
after pruning, and the FLOPs as a differentiable function of learned kept ratios.

FLOPs follow the paper's appendix (Eq. flops_comput, after ChipNet): a convolution costs
(K * n_in / groups + 1) * n_out * A multiply-adds (K the kernel area, A the output
feature-map area, +1 for the bias term); a linear layer (n_in + 1) * n_out per output
row; nonlinearities, BN and pooling are ignored. A transposed convolution spreads each
input position over K outputs, so its A is the input's area. A depthwise convolution
loses its input and output channels together. An expert of a mixture-of-experts block
counts as its two linear layers over the tokens the example forward routed to it (over
every token where every expert computes on every token: Llama 4's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .cuts import input_weights
from .example_inputs import as_example_inputs, call_model
from .experts import ExpertProjection, Layout, expert_layout
from .module_tensors import tensor_of
from .recurrent_readers import RECURRENT

CONV = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
COSTED = (*CONV, nn.Linear)  # the layers whose FLOPs are counted
Conv = (
    nn.Conv1d | nn.Conv2d | nn.Conv3d | nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d
)


@dataclass(frozen=True)
class Layer:
    """One costed layer as one forward saw it."""

    module: Conv | nn.Linear
    kernel: int  # kernel area (1 for a linear layer)
    rows: int  # output positions: batch x feature-map area (linear: batch x tokens)

    @property
    def depthwise(self) -> bool:
        m = self.module
        return isinstance(m, CONV) and m.groups > 1 and m.groups == m.in_channels

    def channels(self, out_lost: int = 0, in_lost: int = 0) -> tuple[int, int, int]:
        """(out, in, groups) after losing channels; depthwise loses both together."""
        m = self.module
        if isinstance(m, nn.Linear):
            return m.out_features - out_lost, m.in_features - in_lost, 1
        if self.depthwise and m.out_channels == m.in_channels:
            kept = m.out_channels - max(out_lost, in_lost)
            return kept, kept, kept
        return m.out_channels - out_lost, m.in_channels - in_lost, m.groups

    def flops(self, out_lost: int = 0, in_lost: int = 0) -> int:
        out_c, in_c, groups = self.channels(out_lost, in_lost)
        return (self.kernel * in_c // groups + 1) * out_c * self.rows


@dataclass(frozen=True)
class ExpertMatmul:
    """One expert's up or down projection as one forward saw it: a linear layer of
    `rows` tokens (the tokens routed to the expert)."""

    module: ExpertProjection
    out_c: int
    in_c: int
    rows: int
    kernel: int = 1
    depthwise: bool = False

    def channels(self, out_lost: int = 0, in_lost: int = 0) -> tuple[int, int, int]:
        return self.out_c - out_lost, self.in_c - in_lost, 1

    def flops(self, out_lost: int = 0, in_lost: int = 0) -> int:
        out_c, in_c, _ = self.channels(out_lost, in_lost)
        return (in_c + 1) * out_c * self.rows


@dataclass(frozen=True)
class PackedProjection:
    """One block (query, key or value) of an attention layer's packed input projection
    (`in_proj_weight`: nn.MultiheadAttention's, or the pruned one it exports to) as one
    forward saw it: `rows` tokens (the queries' or the keys')."""

    module: nn.Module  # the attention layer: its units' rows go from every block alike
    out_c: int  # the block's rows
    in_c: int
    rows: int
    kernel: int = 1
    depthwise: bool = False

    def channels(self, out_lost: int = 0, in_lost: int = 0) -> tuple[int, int, int]:
        return self.out_c - out_lost // 3, self.in_c - in_lost, 1  # a third of its rows

    def flops(self, out_lost: int = 0, in_lost: int = 0) -> int:
        out_c, in_c, _ = self.channels(out_lost, in_lost)
        return (in_c + 1) * out_c * self.rows


def _packed_attention(module: nn.Module) -> bool:
    """An attention layer with a packed input projection whose forward reads its weights
    without calling a layer: nn.MultiheadAttention (one embedding width) and the pruned
    layer it exports to."""
    return isinstance(getattr(module, "in_proj_weight", None), torch.Tensor) and isinstance(
        getattr(module, "out_proj", None), nn.Linear
    )


# attention layers whose forward reads their projections' weights without calling them
# (WavLM's, through F.multi_head_attention_forward), by class name: the projections,
# each run once per token of the layer's input. The classes export gives them call them.
READ_PROJECTIONS = {"WavLMAttention": ("q_proj", "k_proj", "v_proj", "out_proj")}


def _routed(module: nn.Module, experts: int, args: tuple, kwargs: dict) -> list[int]:
    """Tokens an experts module's forward routes to each expert: read from its integer
    argument, the experts chosen per token (ids outside [0, experts) are dropped tokens)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and not value.is_floating_point():
            chosen = value.flatten().long()
            chosen = chosen[(chosen >= 0) & (chosen < experts)]
            return torch.bincount(chosen.cpu(), minlength=experts).tolist()
    raise ValueError(
        f"the experts module {type(module).__name__} got no integer tensor of the experts "
        "chosen per token in its forward, so its FLOPs cannot be counted"
    )


def _counted(module: nn.Module, experts: int, args: tuple, kwargs: dict) -> list[int]:
    """Tokens routed to each expert, as a call inside an experts module that routes them
    itself is given them: a list of as many counts as experts (JetMoe's expert_size)."""
    for value in (*args, *kwargs.values()):
        counts = isinstance(value, (list, tuple)) and len(value) == experts
        if counts and all(isinstance(n, int) for n in value):
            return list(value)
    raise ValueError(
        f"the experts module {type(module).__name__} handed on no list of the tokens "
        "routed to each expert, so its FLOPs cannot be counted"
    )


def count_params(model: nn.Module) -> int:
    """Number of parameters (BN affine included; buffers excluded)."""
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def trace_layers(
    model: nn.Module, example_inputs: torch.Tensor | tuple | Mapping
) -> list[Layer | ExpertMatmul | PackedProjection]:
    """The costed layers of one eval-mode forward of `example_inputs`, in call order."""
    layers: list[Layer | ExpertMatmul | PackedProjection] = []

    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if isinstance(module, CONV):
            positions = inputs[0] if getattr(module, "transposed", False) else output
            if positions.dim() == module.weight.dim() - 1:  # unbatched
                positions = positions[None]
            layers.append(
                Layer(
                    module,
                    math.prod(module.kernel_size),
                    positions.shape[0] * math.prod(positions.shape[2:]),
                )
            )
        elif isinstance(module, nn.Linear):  # (the hook is on COSTED layers only)
            # a Linear subclass may return more (PhiMoE's router: logits first)
            if not isinstance(output, torch.Tensor):
                output = next(t for t in output if isinstance(t, torch.Tensor))
            layers.append(Layer(module, 1, output.numel() // max(module.out_features, 1)))

    def expert_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        layout = expert_layout(module)
        assert layout is not None  # the hook is on experts modules only
        if layout.counts_at is not None:  # counted where they are handed on
            return
        if layout.every_token:  # its input: every token once per expert
            tokens = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            routed = [tokens.numel() // (layout.hidden * layout.experts)] * layout.experts
        else:
            routed = _routed(module, layout.experts, args, kwargs)
        add_experts(module, layout, routed)

    def counts_hook(experts: nn.Module, layout: Layout):
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            add_experts(experts, layout, _counted(experts, layout.experts, args, kwargs))

        return hook

    def add_experts(module: nn.Module, layout: Layout, routed: list[int]) -> None:
        up_out = layout.parts * layout.width
        for e, rows in enumerate(routed):
            up = ExpertProjection(module, layout.up, e)
            layers.append(ExpertMatmul(up, up_out, layout.hidden, rows))
            down = ExpertProjection(module, layout.down, e)
            layers.append(ExpertMatmul(down, layout.hidden, layout.width, rows))

    def attention_hook(module: nn.Module, args: tuple, kwargs: dict, _output) -> None:
        names = ("query", "key", "value")
        given = dict(zip(names, args, strict=False)) | {n: kwargs[n] for n in names if n in kwargs}
        packed = tensor_of(module, "in_proj_weight")
        width, block = packed.shape[1], packed.shape[0] // 3
        queries, keys = given["query"].numel() // width, given["key"].numel() // width
        for tokens in (queries, keys, keys):
            layers.append(PackedProjection(module, block, width, tokens))
        if isinstance(module, nn.MultiheadAttention):  # its out_proj is read, not called
            layers.append(Layer(module.out_proj, 1, queries))

    def read_projections_hook(module: nn.Module, args: tuple, kwargs: dict, _output) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        for name in READ_PROJECTIONS[type(module).__name__]:
            projection = getattr(module, name)
            layers.append(Layer(projection, 1, hidden.numel() // projection.in_features))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, COSTED)]
    handles += [
        m.register_forward_hook(read_projections_hook, with_kwargs=True)
        for m in model.modules()
        if type(m).__name__ in READ_PROJECTIONS
    ]
    handles += [
        m.register_forward_hook(attention_hook, with_kwargs=True)
        for m in model.modules()
        if _packed_attention(m)
    ]
    handles += [
        m.register_forward_pre_hook(expert_hook, with_kwargs=True)
        for m in model.modules()
        if expert_layout(m) is not None
    ]
    handles += [
        m.get_submodule(layout.counts_at).register_forward_pre_hook(
            counts_hook(m, layout), with_kwargs=True
        )
        for m in model.modules()
        if (layout := expert_layout(m)) is not None and layout.counts_at is not None
    ]
    run_hooked(model, example_inputs, handles)
    return layers


@torch.no_grad()
def run_hooked(
    model: nn.Module, example_inputs: torch.Tensor | tuple | Mapping, handles: list
) -> None:
    """One eval-mode forward of `example_inputs`; the mode restored and the hooks of
    `handles` removed after it."""
    was_training = model.training
    model.eval()
    try:
        call_model(model, as_example_inputs(example_inputs))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()


def count_flops(model: nn.Module, example_inputs: torch.Tensor | tuple | Mapping) -> int:
    """FLOPs of one forward of `example_inputs` (batch 1 expected), the paper's convention."""
    return sum(layer.flops() for layer in trace_layers(model, example_inputs))


def flops_after(
    layers: list[Layer | ExpertMatmul | PackedProjection],
    lost: dict[nn.Module | ExpertProjection, tuple[int, int]],
    kept_rows: dict[nn.Module, tuple[int, int]] | None = None,
) -> int:
    """FLOPs with each layer's (output, input) channels reduced by `lost` (keyed by the
    layer's module, or the expert's projection), and the rows of a layer run on each
    attention head apart by `kept_rows` (kept heads, heads)."""
    kept_rows = kept_rows or {}
    total = 0
    for layer in layers:
        flops = layer.flops(*lost.get(layer.module, (0, 0)))
        module = layer.module
        kept, heads = kept_rows.get(module, (1, 1)) if isinstance(module, nn.Module) else (1, 1)
        total += flops * kept // heads
    return total


# norms with one weight and one bias per channel
PER_CHANNEL_AFFINE = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.GroupNorm,
)


def params_after(module: nn.Module, out_lost: int, in_lost: int) -> int:
    """Parameters of a conv, linear, norm layer, nn.MultiheadAttention's input
    projection (rows lost) or recurrent layer (input features lost) after losing
    channels."""
    if isinstance(module, COSTED):
        out_c, in_c, groups = Layer(module, 0, 0).channels(out_lost, in_lost)
        kernel = math.prod(module.kernel_size) if isinstance(module, CONV) else 1
        return out_c * (in_c // groups) * kernel + (out_c if module.bias is not None else 0)
    if isinstance(module, RECURRENT):  # the input columns of its input weights
        total = sum(p.numel() for p in module.parameters(recurse=False))
        gate_rows = sum(tensor_of(module, n).shape[0] for n in input_weights(module))
        return total - in_lost * gate_rows
    if isinstance(module, nn.MultiheadAttention):  # its packed input projection
        rows = 3 * module.embed_dim - out_lost
        return rows * module.embed_dim + (rows if module.in_proj_bias is not None else 0)
    if isinstance(module, PER_CHANNEL_AFFINE):
        channels = module.num_channels if isinstance(module, nn.GroupNorm) else module.num_features
        if not module.affine:
            return 0
        # timm's norms without a bias (GroupNorm1NoBias) keep `affine` with bias None
        kept = [getattr(module, name, None) is not None for name in ("weight", "bias")]
        return sum(kept) * (channels - out_lost)
    raise TypeError(f"no parameter formula for {type(module).__name__}")


def extra_parameters(module: nn.Module) -> int:
    """The values of a conv or linear layer's own parameters besides its weight and bias,
    which params_after's formula leaves out and export keeps whole: a subclass's own
    (NFNet's ScaledStdConv2d's `gain`, one per filter; such a conv's channels are never
    cut, as weight_transforms.py proves). 0 for any other module."""
    if not isinstance(module, COSTED):
        return 0
    return sum(
        p.numel()
        for name, p in module.named_parameters(recurse=False)
        if name not in ("weight", "bias")
    )


class FlopsRatio:
    """F(alpha) of the appendix: the FLOPs kept at per-group kept ratios alpha over the
    dense FLOPs, differentiable in alpha (the FLOPs budget). Every costed layer scales
    with the kept ratio of the group whose output channels it loses and, unless it is
    depthwise, of the group whose input channels it loses."""

    def __init__(self, layers: list[Layer | ExpertMatmul | PackedProjection], groups: list) -> None:
        out_group, in_group = {}, {}
        for index, group in enumerate(groups):
            out_group.update(dict.fromkeys(group.kept_out, index))
            in_group.update(dict.fromkeys(group.kept_in, index))
            # run on each head apart: its rows, so its FLOPs, scale with the kept heads
            out_group.update(dict.fromkeys(getattr(group, "per_head_layers", ()), index))
        whole = len(groups)  # index of the constant ratio 1
        per_in, outs, ins, out_index = [], [], [], []
        for layer in layers:
            out_c, in_c, groups_ = layer.channels()
            per_in.append(layer.kernel if layer.depthwise else layer.kernel * in_c / groups_)
            outs.append(out_c * layer.rows)
            ins.append(whole if layer.depthwise else in_group.get(layer.module, whole))
            out_index.append(out_group.get(layer.module, whole))
        self.per_in = torch.tensor(per_in, dtype=torch.float64)
        self.outs = torch.tensor(outs, dtype=torch.float64)
        self.in_index, self.out_index = torch.tensor(ins), torch.tensor(out_index)
        self.dense = float(((self.per_in + 1) * self.outs).sum())

    def __call__(self, alpha: torch.Tensor) -> torch.Tensor:
        if self.per_in.device != alpha.device:  # once: no host-to-device copies per step
            for name in ("per_in", "outs", "in_index", "out_index"):
                setattr(self, name, getattr(self, name).to(alpha.device))
        a = torch.cat([alpha.double(), alpha.new_ones(1, dtype=torch.float64)])
        flops = (self.per_in * a[self.in_index] + 1) * self.outs
        return (flops * a[self.out_index]).sum() / self.dense
