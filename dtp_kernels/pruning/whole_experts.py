"""Whole experts of mixture-of-experts blocks: which experts each block keeps, learned.

A block holds an experts module in transformers' layout (experts.py) and, beside it, a
router: a module whose ``weight`` has one row per expert, from which it computes one
logit per expert with a linear map, then chooses each token's top-k experts from them
(softmax then top-k, top-k then softmax, sigmoid). The mask goes on those logits as
log(mask): a soft mask m scales expert e's routing probability by m_e (softmax(l +
log m) is proportional to m * softmax(l)), and a hard 0 is a logit of -inf, an expert
never chosen and absent from every normalisation. That is exactly the block without it:
export cuts the router's rows and the expert's slice of every 3-D parameter.

The logits are caught where the router computes them (LogitMask, a TorchFunctionMode
around the router's forward): the output of its linear map of E outputs, and every sum
with one of its per-expert vectors (a score correction bias added to sigmoid scores for
the choice, GLM-4.5's and DeepSeek-V3's; MiniMax-M2's, handed to the router by its
block). A router is kept only when proven on its example input (proof.py's rule): with
the logits of half its experts at -inf and its per-expert vectors favouring those, it
must choose the same experts with the same weights as the router cut to the other half,
again for the other half, and once more keeping the count asked for. Hash routing and a
bias added out of the mask's reach fail it and are refused by name. Every block keeps at
least top-k experts; whole experts are pruned only when a dict names them
(ratios.OPT_IN_KINDS).

Group-limited routing (DeepSeek-V3 and the models built on it, GLM-4.5, Dots1, Mistral
4: the experts in ``num_group`` contiguous groups, each token choosing among the
``topk_group`` best groups, a group's score the sum of its best experts') stays exact
when every group keeps the same count: the cut router's groups are then the old groups'
kept experts, contiguous again. Such a block is one group of ``num_group`` transport
segments, each keeping k / num_group.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional
from torch.overrides import TorchFunctionMode

from .channel_graph import output_tensors
from .experts import Layout, expert_layout
from .module_tensors import tensor_of
from .precision import ieee_fp32
from .proof import close, example_calls
from .ratios import kept_count

# the attributes that hold a block's, router's or experts module's number of experts
COUNT_ATTRIBUTES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# the attributes that hold how many experts each token is routed to
TOP_K_ATTRIBUTES = ("top_k", "num_experts_per_tok", "topk")
# group-limited routing: the number of groups of experts, and how many a token chooses
EXPERT_GROUPS_ATTRIBUTES = ("num_group", "n_group")
GROUPS_CHOSEN_ATTRIBUTES = ("topk_group",)


def logit_bias(mask: torch.Tensor) -> torch.Tensor:
    """log(mask), -inf where the mask is 0 (and a zero gradient there, not NaN)."""
    positive = mask > 0
    return torch.where(positive, torch.where(positive, mask, 1).log(), float("-inf"))


# the ways a router adds a per-expert vector to its scores
ADDS = (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__)


class LogitMask(TorchFunctionMode):
    """While active, adds `bias` to every linear map of `experts` outputs (the router's
    logits) and to every sum with one of `added` (the router's per-expert vectors: a
    score correction bias added to the scores its choice is made on)."""

    def __init__(self, bias: torch.Tensor, experts: int, added: tuple = ()) -> None:
        super().__init__()
        self.bias, self.experts, self.added = bias, experts, added

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        logits = func is functional.linear and out.shape[-1] == self.experts
        if logits or (func in ADDS and any(a is t for a in args for t in self.added)):
            out = out + self.bias.to(out.dtype)
        return out


class MaskedRouting:
    """A router's forward with mask `index` of `source` on its logits: set as the
    router's ``forward`` while the pruner is attached (the class's forward runs inside)."""

    def __init__(self, router: nn.Module, source, index: int, experts: int) -> None:
        self.router, self.source, self.index, self.experts = router, source, index, experts

    def __call__(self, *args, **kwargs):
        bias = logit_bias(self.source.get(self.index))
        # looked up every forward: moving the model to a device replaces its buffers
        added = per_expert_vectors(self.router, self.experts) + tuple(
            a for a in args if _is_per_expert(a, self.experts)
        )  # MiniMax-M2's block hands its router the correction bias
        with LogitMask(bias, self.experts, added):
            return type(self.router).forward(self.router, *args, **kwargs)


class FixedMask:
    """A mask source of one fixed mask (the proof's)."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def get(self, _index: int) -> torch.Tensor:
        return self.mask


def _is_per_expert(value: object, experts: int) -> bool:
    """Whether `value` is a floating-point vector of one entry per expert."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 1
        and value.shape[0] == experts
        and value.is_floating_point()
    )


def per_expert_vectors(router: nn.Module, experts: int) -> tuple[torch.Tensor, ...]:
    """The router's own floating-point vectors of one entry per expert but the bias its
    linear map adds itself (a score correction bias)."""
    linear_bias = getattr(router, "bias", None) if isinstance(router, nn.Linear) else None
    return tuple(
        t
        for t in (*router.parameters(recurse=False), *router.buffers(recurse=False))
        if _is_per_expert(t, experts) and t is not linear_bias
    )


def mask_router(router: nn.Module, source, index: int, experts: int) -> None:
    """Route `router` through mask `index` of `source` (a MaskSource)."""
    router.forward = MaskedRouting(router, source, index, experts)


def unmask_router(router: nn.Module) -> None:
    """Give `router` its class's forward back."""
    router.__dict__.pop("forward", None)


@dataclass(eq=False)
class WholeExpertsGroup:
    """The experts of the experts module `name` as units: which of them the block keeps.
    `router` computes their logits (masked there); `top_k`: experts per token; under
    group-limited routing `segments` contiguous groups of experts, of which a token
    chooses among `groups_chosen` (None: not limited)."""

    name: str
    block: nn.Module
    router: nn.Module
    experts: nn.Module
    layout: Layout
    top_k: int
    segments: int = 1  # transport segments of equal size, each keeping size / segments
    groups_chosen: int | None = None
    refusal: str = ""  # why its experts cannot be removed exactly ("": they can)

    norms = ()  # nothing normalises over the experts but the router, which the mask is in

    @property
    def size(self) -> int:
        return self.layout.experts

    @property
    def kept_out(self) -> tuple[nn.Module, ...]:
        """The router's rows, where it is a linear layer (the cost model counts those);
        the experts' FLOPs per token do not change: each token still runs top-k."""
        return (self.router,) if isinstance(self.router, nn.Linear) else ()

    @property
    def kept_in(self) -> tuple[nn.Module, ...]:
        return ()

    def unit_weights(self) -> torch.Tensor:
        """Per expert, its up and down projections' weights in one row."""
        up = getattr(self.experts, self.layout.up).detach()
        down = tensor_of(self.experts, "down_proj").detach()
        return torch.cat([up.flatten(1), down.flatten(1)], dim=1)

    def removed_params(self, units: int) -> int:
        """Parameters `units` removed experts take with them outside linear layers: their
        slices of the experts' parameters, the block's own per-expert entries and, for a
        router that is not a linear layer, its rows and per-expert entries (what
        cut_experts cuts)."""
        modules = [self.experts, self.block]
        if not isinstance(self.router, nn.Linear):
            modules.append(self.router)
        return units * sum(sum(_per_expert(m, self.size).values()) for m in modules)


def _per_expert(module: nn.Module, experts: int) -> dict[str, int]:
    """Parameters of `module` (its own) with one entry per expert along dim 0: their
    numbers of values per expert."""
    return {
        name: p[0].numel()
        for name, p in module.named_parameters(recurse=False)
        if p.dim() >= 1 and p.shape[0] == experts
    }


def _int_attribute(block: nn.Module, router: nn.Module, names: tuple[str, ...]) -> int | None:
    """The first integer attribute of `names` on the router, else on the block."""
    for module in (router, block):
        for name in names:
            value = getattr(module, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _router(block: nn.Module, experts: nn.Module, layout: Layout) -> nn.Module | None:
    """The one child of `block` besides `experts` whose weight has a row per expert."""
    found = [
        child
        for child in block.children()
        if child is not experts
        and isinstance(weight := getattr(child, "weight", None), torch.Tensor)
        and tuple(weight.shape) == (layout.experts, layout.hidden)
    ]
    return found[0] if len(found) == 1 else None


def cut_tensors(module: nn.Module, experts: int, keep: torch.Tensor) -> None:
    """Keep entries `keep` of every parameter and buffer of `module` (its own) with one
    entry per expert along dim 0, and the counts its attributes hold."""
    for name, p in list(module.named_parameters(recurse=False)):
        if p.dim() >= 1 and p.shape[0] == experts:
            kept = p.detach().index_select(0, keep.to(p.device)).clone()
            setattr(module, name, nn.Parameter(kept, requires_grad=p.requires_grad))
    for name, b in list(module.named_buffers(recurse=False)):
        if b.dim() >= 1 and b.shape[0] == experts:
            setattr(module, name, b.index_select(0, keep.to(b.device)).clone())
    if isinstance(module, nn.Linear):
        module.out_features = len(keep)
    for name in COUNT_ATTRIBUTES:
        if getattr(module, name, None) == experts:
            setattr(module, name, len(keep))


@torch.no_grad()
def cut_experts(group: WholeExpertsGroup, block: nn.Module, keep: torch.Tensor) -> None:
    """Remove the experts not in `keep` (sorted indices) from `block`, a copy of the
    group's block: the router's rows and per-expert entries, the experts' slices."""
    keep = keep.cpu()
    names = {m: n for n, m in group.block.named_children()}
    for module in (
        block,
        getattr(block, names[group.router]),
        getattr(block, names[group.experts]),
    ):
        cut_tensors(module, group.size, keep)


def _favouring(
    router: nn.Module, experts: int, keep: torch.Tensor
) -> tuple[nn.Module, torch.Tensor]:
    """A copy of `router` whose per-expert vectors (a bias, a score correction bias) favour
    the experts not in `keep`, and that vector: the proof must hold whatever they learn,
    and a router that adds them where the mask does not reach would choose those."""
    router = copy.deepcopy(router)
    router.eval()
    favour = torch.full((experts,), 3.0)
    favour[keep] = -3.0
    favour += 0.1 * torch.randn(experts, generator=torch.Generator().manual_seed(1))
    for tensor in [*router.parameters(recurse=False), *router.buffers(recurse=False)]:
        if _is_per_expert(tensor, experts):
            tensor.data.copy_(favour.to(tensor.device, tensor.dtype))
    return router, favour


def routes_exactly(
    router: nn.Module, call: tuple[tuple, dict], group: WholeExpertsGroup, kept: int
) -> bool:
    """Whether `router` (the group's or a copy), with the logits of some of its experts at
    -inf, routes every token of the example call as the router cut to the other experts
    does: the same experts (ids mapped back), the same weights, the same logits of the
    kept experts; its per-expert vectors favouring the removed ones. Shown for a random
    half kept (at least top-k) and for the other half, so that a router choosing the same
    experts whatever the logits (hash routing) fails one of them, and for `kept` experts
    kept, the count asked for. Under group-limited routing every group of experts keeps
    the same share."""
    experts, segments = group.size, group.segments
    per_segment = experts // segments
    chosen = group.groups_chosen or segments  # groups a token chooses among
    half = max(per_segment // 2, -(-group.top_k // chosen))
    if half >= per_segment:
        return False
    generator = torch.Generator().manual_seed(0)
    orders = [
        s * per_segment + torch.randperm(per_segment, generator=generator) for s in range(segments)
    ]
    keeps = [
        torch.cat([order[:half] for order in orders]),
        torch.cat([order[-half:] for order in orders]),
        torch.cat([order[: kept // segments] for order in orders]),
    ]
    return all(_routes_exactly(router, call, experts, keep.sort().values) for keep in keeps)


def _routes_exactly(
    router: nn.Module, call: tuple[tuple, dict], experts: int, keep: torch.Tensor
) -> bool:
    masked, favour = _favouring(router, experts, keep)
    smaller = copy.deepcopy(masked)
    cut_tensors(smaller, experts, keep)
    mask = torch.zeros(experts)
    mask[keep] = 1
    given, kwargs = call
    device = tensor_of(masked).device
    # per-expert vectors the block hands its router favour the removed experts too
    args = [favour.to(a.device, a.dtype) if _is_per_expert(a, experts) else a for a in given]
    cut_args = [
        a.index_select(0, keep.to(a.device)) if _is_per_expert(a, experts) else a for a in args
    ]
    mask_router(masked, FixedMask(mask.to(device)), 0, experts)
    with torch.no_grad(), ieee_fp32():
        try:
            want = output_tensors(masked(*args, **kwargs))
            got = output_tensors(smaller(*cut_args, **kwargs))
        except Exception:  # its code reads the old count, or the logits are not these
            return False
    return _same_routing(want, got, keep.to(device))


def _same_routing(want: list, got: list, keep: torch.Tensor) -> bool:
    """Outputs of the masked and the cut router equal: the chosen ids (the one integer
    output) mapped back through `keep` and sorted per token, outputs of their shape (the
    weights) in that order, per-expert outputs (logits) on the kept experts."""
    if not want or len(want) != len(got):
        return False
    ids = [i for i, t in enumerate(want) if not t.is_floating_point()]
    if len(ids) != 1 or got[ids[0]].is_floating_point():
        return False
    chosen, mapped = want[ids[0]].long(), keep[got[ids[0]].long()]
    if chosen.shape != mapped.shape:
        return False
    order_want, order_got = chosen.argsort(-1), mapped.argsort(-1)
    for index, (w, g) in enumerate(zip(want, got, strict=True)):
        if index == ids[0]:
            if not torch.equal(chosen.gather(-1, order_want), mapped.gather(-1, order_got)):
                return False
            continue
        if w.shape == chosen.shape:  # the chosen experts' weights
            w, g = w.gather(-1, order_want), g.gather(-1, order_got)
        elif w.dim() and g.shape[-1] == len(keep) and w.shape[:-1] == g.shape[:-1]:
            w = w.index_select(-1, keep)  # one entry per expert: the kept experts'
        if w.dtype != g.dtype or not close(g, w):
            return False
    return True


def find_whole_expert_groups(
    model: nn.Module, ignored: list[nn.Module], inputs: tuple
) -> list[WholeExpertsGroup]:
    """One group per mixture-of-experts block of `model` (neither its experts nor its
    router in `ignored`), in model order; `refusal` says why when its router is not
    proven on `inputs`."""
    ignored_set = set(ignored)
    found = []
    for block_name, block in model.named_modules():
        for child_name, experts in block.named_children():
            layout = expert_layout(experts)
            if layout is None or experts in ignored_set:
                continue
            router = _router(block, experts, layout)
            top_k = None if router is None else _int_attribute(block, router, TOP_K_ATTRIBUTES)
            if router is None or router in ignored_set or top_k is None:
                continue
            name = f"{block_name}.{child_name}" if block_name else child_name
            group = WholeExpertsGroup(name, block, router, experts, layout, top_k)
            segments = _int_attribute(block, router, EXPERT_GROUPS_ATTRIBUTES)
            if segments is not None and segments > 1:
                group.segments = segments
                group.groups_chosen = _int_attribute(block, router, GROUPS_CHOSEN_ATTRIBUTES)
                if layout.experts % segments:
                    group.refusal = (
                        f"its {layout.experts} experts do not split into its {segments} "
                        "groups of experts (num_group)"
                    )
            found.append(group)
    return found


def prove_whole_expert_groups(
    model: nn.Module, groups: list[WholeExpertsGroup], kept: dict[str, int], inputs: tuple
) -> None:
    """Refuse each of `groups` (the blocks to lose experts) whose router, with the logits
    of removed experts at -inf, does not route on its example input as the router cut to
    the kept ones does (routes_exactly), keeping half and `kept[name]` experts."""
    calls = example_calls(model, [g.router for g in groups if not g.refusal], inputs)
    for group in groups:
        if group.refusal:
            continue
        if group.router not in calls:
            group.refusal = "its router was not called on the example inputs"
        elif not routes_exactly(group.router, calls[group.router], group, kept[group.name]):
            per_group = (
                f" keeping {kept[group.name] // group.segments} of each of its "
                f"{group.segments} groups of experts"
                if group.segments > 1
                else ""
            )
            group.refusal = (
                f"its router ({type(group.router).__name__}) with the logits of removed "
                f"experts at -inf does not route as the router without them does{per_group} "
                "(a per-expert bias added after the logits, such as a score correction "
                "bias; hash routing; a group's score taken over more experts than it "
                "keeps; logits not computed by one linear map; the experts chosen outside "
                "the router)"
            )


def check_whole_expert_ratios(groups: list, ratios: dict[str, float], budget: str) -> None:
    """ValueError, before any mask, when the ratios would remove whole experts under a
    budget other than "layer", keep fewer experts than a token is routed to (or can
    choose among the groups it routes to), keep a count that group-limited routing cannot
    split evenly over its groups of experts, or remove whole experts from a block whose
    experts' neurons are pruned too."""
    pruned = [g for g in groups if isinstance(g, WholeExpertsGroup) and ratios[g.name] > 0]
    if pruned and budget != "layer":
        raise ValueError(
            f"budget = {budget!r} cannot remove whole experts ({pruned[0].name!r} and "
            f"{len(pruned) - 1} more): every block keeps its own exact count of experts, and "
            "a token runs top-k experts whatever the count (its FLOPs do not change); use "
            "budget='layer'"
        )
    neurons = {g.module_name for g in groups if hasattr(g, "module_name") and ratios[g.name] > 0}
    for group in pruned:
        kept = kept_count(group.size, ratios[group.name])
        if kept < group.top_k:
            raise ValueError(
                f"ratio {ratios[group.name]} keeps {kept} of the {group.size} experts of "
                f"{group.name!r}, fewer than the {group.top_k} each token is routed to; the "
                f"largest ratio that keeps {group.top_k} is "
                f"{(group.size - group.top_k) / group.size:g}"
            )
        _check_group_limited(group, ratios[group.name], kept)
        if group.name in neurons:
            raise ValueError(
                f"the ratios prune both the neurons of the experts of {group.name!r} (kind "
                "'experts') and whole experts of it (kind 'whole_experts'); prune one of the "
                "two per block (give the other a ratio of 0)"
            )


def _check_group_limited(group: WholeExpertsGroup, ratio: float, kept: int) -> None:
    """Under group-limited routing: `kept` splits evenly over the groups of experts, and
    the groups a token chooses among hold at least top-k of them."""
    segments = group.segments
    if segments == 1:
        return
    per_segment = group.size // segments
    if kept % segments:
        nearest = [k * segments for k in (kept // segments, kept // segments + 1)]
        options = [f"{1 - k / group.size:g} (keeps {k})" for k in nearest if 0 < k < group.size]
        raise ValueError(
            f"ratio {ratio} keeps {kept} of the {group.size} experts of {group.name!r}, whose "
            f"router chooses among {segments} groups of {per_segment} experts (group-limited "
            f"routing): every group must keep the same count, so the kept count must be a "
            f"multiple of {segments}; the nearest ratios that give one: {', '.join(options)}"
        )
    chosen = group.groups_chosen or segments
    if kept // segments * chosen < group.top_k:
        raise ValueError(
            f"ratio {ratio} keeps {kept // segments} of the {per_segment} experts of each of "
            f"the {segments} groups of {group.name!r}; a token chooses its {group.top_k} "
            f"experts among {chosen} groups (topk_group), which would then hold "
            f"{kept // segments * chosen}: keep at least {-(-group.top_k // chosen) * segments}"
        )


def prune_whole_experts(
    group: WholeExpertsGroup, names: dict[str, nn.Module], original_names: dict, mask
) -> None:
    """Cut the experts whose hard mask is 0 from the exported copy's block (`names`: the
    copy's modules by name; `original_names`: the original model's names by module)."""
    keep = mask.nonzero().flatten()
    if len(keep) < len(mask):
        cut_experts(group, names[original_names[group.block]], keep)


def set_model_counts(model: nn.Module, groups: list, masks: list) -> None:
    """When every experts module of the exported `model` keeps the same number of experts
    and some lost experts, the model's own count (the load-balancing loss reads it, as
    MixtralForCausalLM.num_experts) follows."""
    pruned = [
        (g.size, int(m.sum()))
        for g, m in zip(groups, masks, strict=True)
        if isinstance(g, WholeExpertsGroup) and int(m.sum()) < g.size
    ]
    counts = {layout.experts for m in model.modules() if (layout := expert_layout(m))}
    if not pruned or len(counts) != 1 or len({size for size, _ in pruned}) != 1:
        return
    kept = next(iter(counts))
    for name in COUNT_ATTRIBUTES:
        if getattr(model, name, None) == pruned[0][0]:
            setattr(model, name, kept)
