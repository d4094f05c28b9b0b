"""Whether removing units from a module computes what masking them does, shown on the
input the example forward gave the module.

Groups found by a module's form rather than by Torch-Pruning's graph (MLP modules where
the graph fails, Mamba mixers, the attention heads asked to be pruned) are kept only
when this holds: half the units, drawn at random, are zeroed the way the hard mask
zeroes them in a copy of the module, which runs on the module's example input, then cut
the way export cuts them, and it runs again. A module that mixes its units (a norm or
a softmax over them, a shift) fails and is not grouped (heads: refused by name);
`export()` checks the whole model again.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import torch
from torch import nn

from .channel_graph import output_tensors, without_cache
from .example_inputs import call_model
from .precision import ieee_fp32

# what a proof does to a copy of the module: zero (or cut) every unit but `keep`
Edit = Callable[[nn.Module, torch.Tensor], None]
# (relative, absolute) differences a proof allows, by output dtype: products over fewer
# (zero) terms round apart, by an ulp of the dtype in half precision; a module that
# mixes its units differs by far more
TOLERANCES = {torch.float16: (1e-2, 1e-3), torch.bfloat16: (5e-2, 1e-2)}
FP32_TOLERANCE = (1e-4, 1e-5)


def example_calls(
    model: nn.Module, modules: list[nn.Module], inputs: tuple
) -> dict[nn.Module, tuple[tuple, dict]]:
    """The (args, kwargs) of each of `modules`' first call in one eval forward of
    `model` on `inputs`, without key/value caches (the proof runs each module again);
    a module the forward does not call is absent."""
    seen: dict[nn.Module, tuple[tuple, dict]] = {}
    if not modules:  # no forward for nothing
        return seen

    def capture(module, args, kwargs):
        # a model that makes a cache whatever its config says (XLM) hands it on: each run
        # of the module would add its keys again, so the calls go without it
        args = tuple(None if _is_cache(a) else a for a in args)
        kwargs = {k: None if _is_cache(v) else v for k, v in kwargs.items()}
        seen.setdefault(module, (args, kwargs))

    run_watched(
        model, inputs, [m.register_forward_pre_hook(capture, with_kwargs=True) for m in modules]
    )
    return seen


def _is_cache(value: object) -> bool:
    """Whether `value` is a Hugging Face key/value cache (none exists where transformers
    was never imported)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    return cache_utils is not None and isinstance(value, cache_utils.Cache)


def run_watched(model: nn.Module, inputs: tuple, handles: list) -> None:
    """One eval forward of `model` on `inputs` without gradients or key/value caches, for
    the hooks of `handles`, removed after it; the mode restored."""
    was_training = model.training
    try:
        with torch.no_grad(), without_cache(model):
            model.eval()
            call_model(model, inputs)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()


def cuts_exactly(
    module: nn.Module,
    call: tuple[tuple, dict],
    units: int,
    zero: Edit,
    cut: Edit,
    first_output: bool = False,
    cut_call: Callable[[tuple[tuple, dict], torch.Tensor], tuple[tuple, dict]] | None = None,
    per_unit: tuple[int, ...] = (1,),
    segments: int = 1,
) -> bool:
    """Whether `module` with all but a random half of its `units` cut (`cut`) computes,
    on the example call, what it computes with them zeroed (`zero`). One copy of the
    module at a time (a 70B model's attention layer is hundreds of MB): zeroed and run,
    then cut and run again; `zero` touches only the units `cut` removes, so the cut copy
    is what cutting the module gives. With `first_output` only its first output tensor is
    compared (an attention layer's output, not its attention weights per head); the
    others may lose units only, along dimensions of `per_unit` entries a unit (a head's
    weights, a key/value head's cache), and must otherwise keep their shapes (a bias of
    the model width that the layer returns is not cut with its heads).
    `cut_call` gives the call the cut module runs on (an input of the units' width cut
    to the kept units: the bias a tied attention layer is handed). With `segments`, the
    units are that many equal runs, each keeping as many (CodeGen's shards)."""
    run = units // segments
    order = torch.stack(
        [torch.randperm(run, generator=torch.Generator().manual_seed(s)) for s in range(segments)]
    )
    keep = (order[:, : run // 2] + run * torch.arange(segments)[:, None]).flatten()
    keep = keep.sort().values
    edited = copy.deepcopy(module)
    edited.eval()  # not chained: some layers' train() returns None (timm's TinyViT's)
    args, kwargs = call
    with torch.no_grad(), ieee_fp32():  # TF32 would round the two apart
        zero(edited, keep)
        try:
            want = output_tensors(edited(*args, **kwargs))
        except Exception:  # the units are not these
            return False
        cut(edited, keep)
        if cut_call is not None:
            args, kwargs = cut_call(call, keep)
        try:
            got = output_tensors(edited(*args, **kwargs))
        except Exception:  # its code reads the old width, or the units are not these
            return False
    if not want or len(got) != len(want):
        return False
    if first_output:
        kept = len(keep)
        if not all(
            _loses_units(g.shape, w.shape, units, kept, per_unit)
            for g, w in zip(got[1:], want[1:], strict=True)
        ):
            return False
        want, got = want[:1], got[:1]
    return all(close(g, w) for g, w in zip(got, want, strict=True))


def _loses_units(
    got: torch.Size, want: torch.Size, units: int, kept: int, per_unit: tuple[int, ...]
) -> bool:
    """Whether shape `got` is `want` with `units` cut to `kept` along some dimensions, each
    of `n * units` entries for an `n` of `per_unit`."""
    if len(got) != len(want):
        return False
    return all(
        g == w or any(w == n * units and g == n * kept for n in per_unit)
        for g, w in zip(got, want, strict=True)
    )


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether `got` equals `want` within the proof's tolerance for `want`'s dtype (the
    absolute part scaled by want's largest magnitude)."""
    rtol, atol = TOLERANCES.get(want.dtype, FP32_TOLERANCE)
    got, want = got.double(), want.double()
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    return got.shape == want.shape and torch.allclose(got, want, rtol=rtol, atol=atol * scale)


def random_half(width: int, generator: torch.Generator) -> torch.Tensor:
    """A random half of [0, width) (at least one), sorted: the units a proof keeps."""
    return torch.randperm(width, generator=generator)[: max(1, width // 2)].sort().values


def dropped(width: int, keep: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The indices of [0, width) not in `keep` (on any device), on `device`."""
    mask = torch.ones(width, dtype=torch.bool)
    mask[keep.cpu()] = False  # a CPU tensor takes no CUDA indices
    return mask.nonzero().flatten().to(device)
