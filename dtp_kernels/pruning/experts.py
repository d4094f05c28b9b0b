"""The experts of a mixture-of-experts block: each expert's intermediate neurons, pruned
expert by expert, every expert of a block to the same count.

Hugging Face's mixture-of-experts families keep all experts of a block in raw 3-D
parameters, experts first: the gate and up projections `gate_up_proj` [E, 2I, H] (or
`up_proj` [E, I, H] without a gate) and the down projection `down_proj` [E, H, I], or
both transposed. transformers' ``use_experts_implementation`` describes the layout on the
module (has_gate, is_concatenated, is_transposed, has_bias); the modules carrying it are
recognised, and those of KNOWN_LAYOUTS by their class (Llama 4's, whose every expert
computes on every token). Intermediate neuron j of expert e is row j and I + j of its gate/up
projection (2j and 2j + 1 when interleaved) and column j of its down projection.

DBRX keeps its experts in 2-D parameters of its experts module's `mlp`, one expert's
matrix after another: the gate `w1` and up `v1` projections [E * I, H] (out, in per
expert) and the down projection `w2` [E * I, H] (in, out per expert); neuron j of expert
e is row e I + j of all three (DBRX_EXPERTS). JetMoe's experts block routes its tokens
itself and keeps its experts in modules of its own: `input_linear.weight` [E, 2I, H]
(gate rows, then up rows) and `output_linear.weight` [E, H, I] (JETMOE_EXPERTS); the
tokens each expert computes on are read where the block hands them on (`counts_at`).

Each expert is one group and one transport segment. The mask goes on the down
projection's columns (DBRX's: w2's rows): exact whatever the activation computes from
neuron j's gate and up. Export keeps the kept neurons of every expert in one smaller
parameter (3-D; DBRX's 2-D), so all experts of a block keep the same count: one ratio
per block, under budget "layer" or "flops" (one learned ratio per block); the pruner
checks. A kept width torch's
grouped_mm cannot read makes the exported model run its experts with batched_mm.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

# the attributes use_experts_implementation sets, which say how the weights are laid out
LAYOUT_FLAGS = ("has_gate", "is_concatenated", "is_transposed", "has_bias")
# an experts module's (or its parameters' module's) attributes that hold its
# intermediate width
WIDTH_ATTRIBUTES = ("intermediate_dim", "intermediate_size", "expert_dim", "ffn_hidden_size")
# experts modules without those flags, by class name: their flags (in LAYOUT_FLAGS order)
# and whether every expert computes on every token
KNOWN_LAYOUTS = {
    # gate_up_proj [E, H, 2I] chunked into gate and up, down_proj [E, I, H]; the block
    # hands each expert a copy of every token weighted by its router score (0 where the
    # expert was not chosen), viewed [E, tokens, H]
    "Llama4TextExperts": ((True, True, True, False), True),
}


@dataclass(frozen=True)
class Layout:
    """How one experts module stores its weights. Parameters are named by their path
    from the experts module ("gate_up_proj"; DBRX's "mlp.v1")."""

    up: str  # "gate_up_proj", or "up_proj" without a gate (or beside a separate `gate`)
    parts: int  # 2 (gate and up per neuron) or 1
    concatenated: bool  # gate rows [0, I), up rows [I, 2I); else interleaved
    transposed: bool  # the up projection stored (in, out) per expert: [E, H, 2I]
    bias: bool
    experts: int
    width: int  # I, the intermediate neurons per expert
    hidden: int  # H
    # every expert computes on every token (its input: experts x tokens rows of H);
    # else on the tokens routed to it (transformers' experts: the experts chosen per token)
    every_token: bool = False
    down: str = "down_proj"
    gate: str | None = None  # the gate in a parameter of its own, shaped as `up`
    # the down projection stored (in, out) per expert: [E, I, H] (transformers': as up)
    down_transposed: bool = False
    flat: bool = False  # 2-D parameters, the experts' matrices one after another
    # the submodule whose call is given the tokens routed to each expert, a list of E
    # counts, where the experts module routes them itself (JetMoe's input_linear, given
    # its router's expert_size); else its forward is given the experts chosen per token
    counts_at: str | None = None

    @property
    def fused_parts(self) -> int:
        """The parts of each neuron in the `up` parameter: 2 for a gate fused with it."""
        return 1 if self.gate is not None else self.parts

    def mask_shape(self) -> tuple[int, ...]:
        """The shape a block's flat mask (expert by expert) takes to scale its down
        projection's intermediate neurons."""
        if self.flat:  # rows e I + j: one row per neuron of every expert in turn
            return (-1, 1)
        return (self.experts, -1, 1) if self.down_transposed else (self.experts, 1, -1)


def owner_and_name(experts: nn.Module, path: str) -> tuple[nn.Module, str]:
    """The module holding the parameter at `path` from `experts`, and its name there."""
    owner, _, name = path.rpartition(".")
    return (experts.get_submodule(owner) if owner else experts), name


def stacked(experts: nn.Module, layout: Layout, path: str) -> torch.Tensor:
    """The parameter at `path` as [experts, rows, columns] (a view of a flat one)."""
    owner, name = owner_and_name(experts, path)
    tensor = getattr(owner, name)
    return tensor.view(layout.experts, -1, tensor.shape[-1]) if layout.flat else tensor


# DBRX's experts module: mlp.w1 (gate), mlp.v1 (up), mlp.w2 (down), each [E * I, H]
DBRX_EXPERTS = "DbrxExperts"


def _dbrx_layout(module: nn.Module) -> Layout | None:
    """The layout of DBRX's experts module (DBRX_EXPERTS), or None where its parameters
    do not have the shapes its counts say."""
    mlp = getattr(module, "mlp", None)
    experts, width = getattr(module, "num_experts", None), getattr(module, "ffn_hidden_size", None)
    found = [getattr(mlp, name, None) for name in ("w1", "v1", "w2")]
    weights = [w for w in found if isinstance(w, torch.Tensor) and w.dim() == 2]
    if not (isinstance(experts, int) and isinstance(width, int)) or len(weights) != 3:
        return None
    shapes = {tuple(w.shape) for w in weights}
    if len(shapes) != 1 or next(iter(shapes))[0] != experts * width:
        return None
    hidden = weights[0].shape[1]
    return Layout(
        "mlp.v1", 2, True, False, False, experts, width, hidden,
        down="mlp.w2", gate="mlp.w1", down_transposed=True, flat=True,
    )  # fmt: skip


# JetMoe's mixture of MLP experts: input_linear.weight [E, 2I, H] (gate rows, then up
# rows) and output_linear.weight [E, H, I], each in a module of its own
JETMOE_EXPERTS = "JetMoeMoE"


def _jetmoe_layout(module: nn.Module) -> Layout | None:
    """The layout of JetMoe's experts block (JETMOE_EXPERTS), or None where its
    parameters do not have the shapes that says."""
    up = getattr(getattr(module, "input_linear", None), "weight", None)
    down = getattr(getattr(module, "output_linear", None), "weight", None)
    if not (isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return None
    if up.dim() != 3 or down.dim() != 3:
        return None
    experts, hidden, width = down.shape
    if tuple(up.shape) != (experts, 2 * width, hidden):
        return None
    return Layout(
        "input_linear.weight", 2, True, False, False, experts, width, hidden,
        down="output_linear.weight", counts_at="input_linear",
    )  # fmt: skip


def expert_layout(module: nn.Module) -> Layout | None:
    """The layout of an experts module in transformers' form; None for any other module
    (or one whose weight shapes do not match its flags)."""
    if type(module).__name__ == DBRX_EXPERTS:
        return _dbrx_layout(module)
    if type(module).__name__ == JETMOE_EXPERTS:
        return _jetmoe_layout(module)
    found = [getattr(module, name, None) for name in LAYOUT_FLAGS]
    every_token = False
    flags = tuple(flag for flag in found if isinstance(flag, bool))
    if len(flags) != len(found):
        if type(module).__name__ not in KNOWN_LAYOUTS:
            return None
        flags, every_token = KNOWN_LAYOUTS[type(module).__name__]
    has_gate, concatenated, transposed, bias = flags
    up_name = "gate_up_proj" if has_gate else "up_proj"
    up, down = getattr(module, up_name, None), getattr(module, "down_proj", None)
    if not (isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return None
    if up.dim() != 3 or down.dim() != 3:
        return None
    parts = 2 if has_gate else 1
    experts = down.shape[0]
    width, hidden = (down.shape[1], down.shape[2]) if transposed else (down.shape[2], down.shape[1])
    want_up = (experts, hidden, parts * width) if transposed else (experts, parts * width, hidden)
    if tuple(up.shape) != want_up:
        return None
    return Layout(
        up_name, parts, concatenated, transposed, bias, experts, width, hidden, every_token,
        down_transposed=transposed,
    )  # fmt: skip


@dataclass(frozen=True)
class ExpertProjection:
    """One expert's slice of a 3-D projection: what the cost model counts and a group
    loses channels of (it stands where a linear layer would)."""

    experts: nn.Module
    name: str  # the parameter: the layout's up projection, or "down_proj"
    expert: int


@dataclass(eq=False)
class ExpertGroup:
    """The intermediate neurons of expert `expert` of the experts module `module_name`."""

    module_name: str
    experts: nn.Module
    layout: Layout
    expert: int

    norms = ()  # the neurons reach no normalization over all of them

    @property
    def name(self) -> str:
        return f"{self.module_name}.{self.expert}"

    @property
    def size(self) -> int:
        return self.layout.width

    @property
    def kept_out(self) -> tuple[ExpertProjection, ...]:
        return (ExpertProjection(self.experts, self.layout.up, self.expert),)

    @property
    def kept_in(self) -> tuple[ExpertProjection, ...]:
        return (ExpertProjection(self.experts, self.layout.down, self.expert),)

    @property
    def width(self) -> dict[ExpertProjection, int]:
        """Channels each projection loses per neuron removed (gate and up: one each)."""
        return {self.kept_out[0]: self.layout.parts}

    def unit_weights(self) -> torch.Tensor:
        """The gate and up weights of each neuron side by side, one row per neuron."""
        layout = self.layout
        parts = [layout.up] if layout.gate is None else [layout.gate, layout.up]
        weights = []
        for path in parts:
            weight = stacked(self.experts, layout, path).detach()[self.expert]
            weights.append(weight.t() if layout.transposed else weight)
        if layout.gate is not None:  # [I, H] each
            return torch.cat(weights, dim=1)
        weight, width, hidden = weights[0], layout.width, layout.hidden
        if layout.parts > 1 and layout.concatenated:
            return weight.reshape(2, width, hidden).transpose(0, 1).reshape(width, -1)
        return weight.reshape(width, -1)  # interleaved pairs are already side by side

    def removed_params(self, units: int) -> int:
        """Parameters `units` removed neurons take with them (weights and gate/up biases)."""
        layout = self.layout
        per_unit = layout.parts * layout.hidden + layout.hidden
        return units * (per_unit + (layout.parts if layout.bias else 0))


def find_expert_groups(model: nn.Module, ignored: list[nn.Module]) -> list[ExpertGroup]:
    """One group per expert of every recognised experts module not in `ignored`."""
    groups = []
    for name, module in model.named_modules():
        layout = expert_layout(module)
        if layout is None or module in ignored:
            continue
        groups += [ExpertGroup(name, module, layout, e) for e in range(layout.experts)]
    return groups


# an experts module's attributes that hold its expert count
COUNT_ATTRIBUTES = ("num_experts", "moe_num_experts", "num_local_experts", "n_routed_experts")


def _inside_known_experts(model: nn.Module) -> set[nn.Module]:
    """The modules within experts modules `expert_layout` recognises (DBRX's `mlp`)."""
    return {
        inner
        for module in model.modules()
        if expert_layout(module) is not None
        for inner in module.modules()
    }


def _raw_expert_weights(module: nn.Module) -> bool:
    """Whether `module` holds experts' matrices in raw parameters of its own: a 3-D
    `down_proj`, experts first, or, where it has an expert count E, one parameter of E
    matrices stacked ([E, out, in]: JetMoe's) or concatenated ([E * out, in] with out
    above 1: DBRX's w1, v1 and w2). A router's [E, in] is neither."""
    down = getattr(module, "down_proj", None)
    if isinstance(down, nn.Parameter) and down.dim() == 3:
        return True
    counts = [c for a in COUNT_ATTRIBUTES if isinstance(c := getattr(module, a, None), int)]
    return any(
        (p.dim() == 3 and p.shape[0] == e)
        or (p.dim() == 2 and p.shape[0] % e == 0 < p.shape[0] - e)
        for p in module.parameters(recurse=False)
        for e in counts
        if e > 1
    )


def unrecognised_experts(model: nn.Module, ignored: list[nn.Module]) -> list[str]:
    """Names of the modules not in `ignored` that hold experts in raw parameters
    (`_raw_expert_weights`) in a layout `expert_layout` does not recognise: no group is
    found for them, so they stay whole."""
    known = _inside_known_experts(model)
    return [
        name
        for name, module in model.named_modules()
        if _raw_expert_weights(module) and module not in ignored and module not in known
    ]


def check_expert_ratios(groups: list[ExpertGroup], ratios: dict[str, float], budget: str) -> None:
    """Every expert of a block has the same ratio, and no pruned block is under budget
    "global" (one segment over all groups, counts free per group): one 3-D parameter
    holds the experts, so they keep the same count. ValueError naming the block
    otherwise, before any mask. (Budget "flops" learns one ratio per block: tied_units.)"""
    blocks: dict[str, dict[str, float]] = {}
    for group in groups:
        blocks.setdefault(group.module_name, {})[group.name] = ratios[group.name]
    for block, per_expert in blocks.items():
        if len(set(per_expert.values())) > 1:
            raise ValueError(
                f"the experts of {block!r} have different ratios {per_expert}: one 3-D "
                "parameter holds all of them, so every expert keeps the same number of "
                f"neurons; give them one ratio (the pattern '{block}.*' or the kind "
                "'experts')"
            )
        if budget == "global" and max(per_expert.values()) > 0:
            raise ValueError(
                f"budget = {budget!r} would keep a different number of neurons in each "
                f"expert of {block!r}, which one 3-D parameter cannot hold; use "
                "budget='layer' or 'flops', or leave the experts whole with the ratio "
                "{'experts': 0, ...}"
            )


def tied_units(groups: list) -> list[int] | None:
    """Per group, the index of its learned kept ratio under budget "flops": the experts
    of one block share one (they keep one count), every other group has its own. None
    when no groups share."""
    units: list[int] = []
    block_unit: dict[str, int] = {}
    for group in groups:
        block = group.module_name if isinstance(group, ExpertGroup) else None
        if block is None or block not in block_unit:
            unit = len(set(units))  # a new unit: the next index
            if block is not None:
                block_unit[block] = unit
        units.append(unit if block is None else block_unit[block])
    return None if len(set(units)) == len(groups) else units


def intermediate_index(layout: Layout, units: torch.Tensor) -> torch.Tensor:
    """Positions of neurons `units` along the up projection's intermediate dimension."""
    if layout.fused_parts == 1:
        return units
    if layout.concatenated:
        return torch.cat([units, units + layout.width])
    return torch.stack([2 * units, 2 * units + 1], dim=1).flatten()


@torch.no_grad()
def prune_experts(experts: nn.Module, layout: Layout, masks: list[torch.Tensor]) -> None:
    """Keep in `experts` the neurons each expert's 0/1 mask keeps (as many in each)."""
    kept = [mask.nonzero().flatten().to(torch.long) for mask in masks]
    width = len(kept[0])
    # (in, out) storage: the intermediate dimension is the last of the up projection
    up_dim = 2 if layout.transposed else 1
    down_dim = 1 if layout.down_transposed else 2
    paths = [(layout.up, up_dim, True), (layout.down, down_dim, False)]
    if layout.gate is not None:
        paths.append((layout.gate, up_dim, True))
    if layout.bias:
        paths.append((f"{layout.up}_bias", 1, True))
    for path, dim, up_side in paths:
        owner, name = owner_and_name(experts, path)
        old = getattr(owner, name)
        view = stacked(experts, layout, path)
        picked = torch.stack(
            [
                view[e].index_select(
                    dim - 1,
                    (intermediate_index(layout, units) if up_side else units).to(old.device),
                )
                for e, units in enumerate(kept)
            ]
        )
        if layout.flat:
            picked = picked.reshape(-1, old.shape[-1])
        setattr(owner, name, nn.Parameter(picked, old.requires_grad))
    for module in experts.modules():  # DBRX's experts module and its `mlp` both hold I
        for attribute in WIDTH_ATTRIBUTES:
            if getattr(module, attribute, None) == layout.width:
                setattr(module, attribute, width)


# torch's grouped_mm, transformers' default experts implementation, reads rows of a
# multiple of 16 bytes: 8 neurons per expert in bf16 / fp16, 4 in fp32
GROUPED_MM_ROW_BYTES = 16


def run_misaligned_experts(model: nn.Module, blocks: dict[str, nn.Module]) -> None:
    """Switch an exported model whose experts keep a width grouped_mm cannot read (not a
    multiple of 16 bytes) from grouped_mm to batched_mm, with a warning naming them: it
    would fail at its first forward otherwise."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != "grouped_mm":
        return
    layouts = {name: layout for name, block in blocks.items() if (layout := expert_layout(block))}
    misaligned = {
        name: layout.width
        for name, layout in layouts.items()
        if layout.width
        * stacked(blocks[name], layout, layout.down).element_size()
        % GROUPED_MM_ROW_BYTES
    }
    if not misaligned:
        return
    model.set_experts_implementation("batched_mm")  # type: ignore[operator]  # (a PreTrainedModel)
    warnings.warn(
        f"the experts of {misaligned} (block: neurons kept per expert) keep a width torch's "
        f"grouped_mm cannot run (rows of a multiple of {GROUPED_MM_ROW_BYTES} bytes: 8 "
        "neurons in bf16/fp16, 4 in fp32), so the exported model runs its experts with "
        "batched_mm; load it with from_pretrained(..., experts_implementation='batched_mm'), "
        "or choose ratios that keep such multiples to keep grouped_mm",
        UserWarning,
        stacklevel=4,
    )
