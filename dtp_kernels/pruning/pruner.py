"""DTPPruner: learned, exact-size filter pruning with Differentiable Transportation Pruning.

All scores live in one flat Parameter (views per group), initialised to the L2 norms of
the filters (paper, Sec. 4). In training mode every forward of the model first computes
all masks with one `transport_mask` call; `attach(optimizer)` commits the transport state
after every optimizer step. Masks go where they cost nothing (DESIGN.md section 2): on
the affine weight and bias of the group's BN, or on a conv's output rows and bias when no
BN follows; `mask_at="activation"` multiplies the activations with the fused epilogue
instead.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..masked_channel_epilogue import masked_channel_epilogue
from ..transport_mask import transport_mask
from ..transport_state import TransportState
from .base import ChannelPruner

MASK_AT = ("auto", "parameters", "activation")


class _MaskSource:
    """The masks of the current forward, shared by the parametrizations and hooks."""

    def __init__(self) -> None:
        self.masks: list[torch.Tensor] = []
        self.hard: list[torch.Tensor] | None = None  # set: evaluate the hard-masked model

    def get(self, index: int) -> torch.Tensor:
        return self.hard[index] if self.hard is not None else self.masks[index]


class _ScaleRows(nn.Module):
    """Parametrization w -> w * mask, broadcast over the first (output-channel) dim."""

    def __init__(self, source: _MaskSource, index: int) -> None:
        super().__init__()
        self.source, self.index = source, index

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        mask = self.source.get(self.index).to(weight.dtype)
        return weight * mask.view(-1, *([1] * (weight.dim() - 1)))


class DTPPruner(ChannelPruner):
    """Prune `model` to exact sizes with DTP. See the module docstring and README.

    Args:
        model: the network; the pruner attaches masks to it (parametrizations/hooks).
        example_inputs: a tensor or tuple that runs through the model (batch 1 is enough).
        ratios: a float, {module name: ratio}, "[0, 0.5, 0.5, 0.5]" (per ResNet stage) or
            "[0:0, 1-15:0.5]" (per convolution index); each in [0, 1).
        budget: "layer" (one transport segment per group) or "global" (one over all).
        granularity: "filter" (structured).
        eps, iters, backend: passed to `transport_mask`.
        mask_at: "auto" (parameters where possible), "parameters" or "activation".
        ignored_layers: convolutions never to prune.
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: torch.Tensor | tuple,
        ratios: float | Mapping[str, float] | str,
        *,
        budget: str = "layer",
        granularity: str = "filter",
        eps: float = 1.0,
        iters: int = 1,
        mask_at: str = "auto",
        ignored_layers: Sequence[nn.Module] = (),
        backend: str = "auto",
    ) -> None:
        if granularity != "filter":
            raise ValueError(f"granularity = {granularity!r}; allowed: ['filter']")
        if mask_at not in MASK_AT:
            raise ValueError(f"mask_at = {mask_at!r}; allowed: {list(MASK_AT)}")
        if not (isinstance(eps, (int, float)) and eps > 0):
            raise ValueError(f"eps = {eps!r}; it must be a number > 0")
        super().__init__(
            model, example_inputs, ratios, budget=budget, ignored_layers=ignored_layers
        )
        self.eps, self.iters, self.backend, self.mask_at = float(eps), iters, backend, mask_at
        device = next(model.parameters()).device
        norms = [g.conv.weight.detach().flatten(1).norm(dim=1) for g in self.groups]
        self.scores = nn.Parameter(torch.cat(norms).float().to(device))
        segments = self.sizes if budget == "layer" else [sum(self.sizes)]
        self.state = TransportState(segments, device=device)
        self.register_buffer("keep", torch.tensor(self.kept, dtype=torch.float32, device=device))
        self._source = _MaskSource()
        with torch.no_grad():  # masks exist before the first forward (parametrize checks)
            self._compute_masks(model, ())
        self._handles = [model.register_forward_pre_hook(self._compute_masks)]
        for index, group in enumerate(self.groups):
            self._attach_mask(index, group)

    def _attach_mask(self, index: int, group) -> None:
        if self.mask_at != "activation" and group.bn is not None and group.bn.affine:
            for name in ("weight", "bias"):
                parametrize.register_parametrization(
                    group.bn, name, _ScaleRows(self._source, index)
                )
        elif self.mask_at != "activation" and group.bn is None:
            for name in ("weight", "bias") if group.conv.bias is not None else ("weight",):
                parametrize.register_parametrization(
                    group.conv, name, _ScaleRows(self._source, index)
                )
        else:  # on the activations, with the fused epilogue
            target = group.bn if group.bn is not None else group.conv

            def hook(_module, _inputs, output, index=index):
                mask = self._source.get(index)
                return masked_channel_epilogue(output, mask.to(output.dtype), backend="auto")

            self._handles.append(target.register_forward_hook(hook))

    def _compute_masks(self, model: nn.Module, _inputs) -> None:
        """Forward pre-hook: all masks in one transport_mask call."""
        update = model.training and torch.is_grad_enabled()
        mask = transport_mask(
            self.scores, self.keep, self.state, eps=self.eps, iters=self.iters,
            update=update, backend=self.backend,
        )  # fmt: skip
        self._source.masks = list(mask.split(self.sizes))

    def channel_scores(self) -> torch.Tensor:
        """The current soft masks (update=False): the top-k of each group is kept."""
        with torch.no_grad():
            mask = transport_mask(
                self.scores, self.keep, self.state, eps=self.eps, iters=self.iters,
                update=False, backend=self.backend,
            )  # fmt: skip
        return mask + 1e-12 * self.scores.detach()  # ties (masks at 0 or 1) by score

    def attach(self, optimizer: torch.optim.Optimizer):
        """Commit the transport state after every `optimizer.step()`; returns the handle."""
        return optimizer.register_step_post_hook(lambda *_: self.state.commit())

    def hard_masked(self) -> _HardMasks:
        """Context manager: inside it the model runs with the hard 0/1 masks."""
        return _HardMasks(self)

    def report(self) -> dict:
        """Base report plus, per group, the soft-mask mass inside the top k and the mean
        squared distance of the soft mask from the hard one."""
        result = super().report()
        with torch.no_grad():
            soft = transport_mask(
                self.scores, self.keep, self.state, eps=self.eps, iters=self.iters,
                update=False, backend=self.backend,
            ).float().cpu()  # fmt: skip
        hard = torch.cat(self.hard_masks())
        for row, s, h in zip(result["groups"], soft.split(self.sizes), hard.split(self.sizes),
                             strict=True):  # fmt: skip
            row["mass_in_top_k"] = float((s * h).sum() / h.sum().clamp(min=1))
            row["distance_to_hard"] = float(((s - h) ** 2).mean())
        return result

    def _unmasked_copy(self) -> nn.Module:
        """A deep copy of the model without this pruner's masks, hooks and state."""
        memo = {id(self): self, id(self._source): _MaskSource()}  # share, do not copy, these
        pruned = copy.deepcopy(self.model, memo)
        for module in list(pruned.modules()):
            for handle in self._handles:
                module._forward_pre_hooks.pop(handle.id, None)
                module._forward_hooks.pop(handle.id, None)
            if parametrize.is_parametrized(module):
                _strip_parametrizations(module)
        return pruned

    def remove(self) -> None:
        """Detach the pruner from the model: hooks and parametrizations are removed and the
        unmasked weights restored."""
        for handle in self._handles:
            handle.remove()
        for module in list(self.model.modules()):
            if parametrize.is_parametrized(module):
                _strip_parametrizations(module)


def _strip_parametrizations(module: nn.Module) -> None:
    """Put the original parameters back. Unlike parametrize.remove_parametrizations this
    leaves the parametrized class alone, which deep copies share with the original."""
    originals = {name: plist.original for name, plist in module.parametrizations.items()}
    module.__class__ = module.__class__.__bases__[0]
    del module._modules["parametrizations"]
    for name, parameter in originals.items():
        module._parameters[name] = parameter


class _HardMasks:
    def __init__(self, pruner: DTPPruner) -> None:
        self.pruner = pruner

    def __enter__(self) -> DTPPruner:
        device = self.pruner.scores.device
        self.pruner._source.hard = [m.to(device) for m in self.pruner.hard_masks()]
        return self.pruner

    def __exit__(self, *exc) -> None:
        self.pruner._source.hard = None
