"""The DTP transport-mask op: validation, backend dispatch, the eager closed form, and
the torch.library registration (fake tensor and autograd) of the compiled kernels.

Math: docs/design.md section 1. State semantics: docs/design.md section 4 and TransportState.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import overload

import torch

from ._extension import (
    _C,
    BACKENDS,
    available_backends,
    compiled,
    require_backend,
    triton_installed,
    triton_interpreted,
)
from .transport_state import TransportState

Scores = torch.Tensor | Sequence[torch.Tensor]
Step = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
NONFINITE_MODES = ("propagate", "neutral")

# ---------------------------------------------------------------------------------------
# Input checking: everything is checked before any state is touched.
# ---------------------------------------------------------------------------------------


_SCORE_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def _check_scores(scores: Scores, state: TransportState) -> tuple[torch.Tensor, bool]:
    """Return the flat scores tensor and whether the caller gave a list of segments."""
    if (  # the per-step case in one test (each failing part is reported below)
        isinstance(scores, torch.Tensor)
        and scores.dtype in _SCORE_DTYPES
        and scores.dim() == 1
        and scores.numel() == state._numel
        and scores.device == state.device
    ):
        return scores, False
    if isinstance(scores, torch.Tensor):
        parts, is_list = [scores], False
    elif isinstance(scores, Sequence) and all(isinstance(t, torch.Tensor) for t in scores):
        parts, is_list = list(scores), True
    else:
        raise TypeError(
            f"scores must be a 1-D tensor or a list of 1-D tensors, got {type(scores).__name__}"
        )
    for index, part in enumerate(parts):
        where = f"scores[{index}] (segment {index})" if is_list else "scores"
        if part.is_complex() or not part.is_floating_point():
            raise TypeError(
                f"{where} has dtype {part.dtype}; allowed: float16, bfloat16, float32, float64"
            )
        if part.dim() != 1:
            raise ValueError(f"{where} must be 1-D, got shape {tuple(part.shape)}")
        if part.device != state.device:
            raise ValueError(
                f"{where} is on {part.device} but the transport state is on {state.device}; "
                "move one of them"
            )
    if is_list:
        if len(parts) != state.num_segments:
            raise ValueError(
                f"scores has {len(parts)} segments, the transport state has {state.num_segments}"
            )
        for index, (part, n) in enumerate(zip(parts, state.sizes, strict=True)):
            if part.numel() != n:
                raise ValueError(
                    f"scores[{index}] (segment {index}) has {part.numel()} entries, "
                    f"the transport state expects n = {n}"
                )
        dtypes = {p.dtype for p in parts}
        if len(dtypes) > 1:
            raise TypeError(f"scores segments mix dtypes {sorted(map(str, dtypes))}")
        return torch.cat(parts), True
    (whole,) = parts
    if whole.numel() != state.numel:
        raise ValueError(
            f"scores has {whole.numel()} entries, the transport state expects "
            f"{state.numel} (segment sizes {list(state.sizes)})"
        )
    return whole, False


def _check_keep(keep, state: TransportState) -> torch.Tensor:
    """k per segment as a float tensor on the state's device; each in [0, n]."""
    compiling = torch.compiler.is_compiling()
    checked = None if compiling else state._keep_checked
    if checked is not None and checked[0] is keep and checked[1] == keep._version:
        return checked[2]  # the same, unmodified tensor as last step: its version proves it
    original = keep
    if isinstance(keep, torch.Tensor):  # the per-step case first: ABC isinstance is slow
        if keep.is_complex() or not keep.is_floating_point():
            raise TypeError(f"keep has dtype {keep.dtype}; it must be float32 or float64")
        if keep.dim() > 1:
            raise ValueError(f"keep must be 0-D or 1-D, got shape {tuple(keep.shape)}")
        if keep.device != state.device:
            raise ValueError(
                f"keep is on {keep.device} but the transport state is on {state.device}"
            )
        keep = keep.reshape(-1)
    else:
        if isinstance(keep, numbers.Real) and not isinstance(keep, bool):
            keep = [keep]
        if not isinstance(keep, Sequence):
            raise TypeError(
                f"keep must be a tensor or a sequence of numbers, got {type(keep).__name__}"
            )
        for index, k in enumerate(keep):
            if isinstance(k, bool) or not isinstance(k, numbers.Real):
                raise TypeError(f"keep[{index}] (segment {index}) = {k!r} is not a real number")
        keep = torch.tensor([float(k) for k in keep], dtype=torch.float32, device=state.device)
    if keep.numel() != state.num_segments:
        raise ValueError(
            f"keep has {keep.numel()} entries, one per segment is needed ({state.num_segments})"
        )
    # Fixed counts on the CPU are checked on the host (a clear message); learned counts
    # (keep requires grad, budget="flops") and device tensors on the device, as on a GPU.
    if keep.device.type == "cpu" and not keep.requires_grad and not compiling:
        values = keep.detach().tolist()
        if not all(map(_in_range, values, state.sizes)):
            index = next(i for i, k in enumerate(values) if not _in_range(k, state.sizes[i]))
            raise ValueError(
                f"keep[{index}] (segment {index}) = {values[index]} is outside the allowed "
                f"range [0, {state.sizes[index]}]"
            )
    else:  # checked on the device (no host sync per step, and traceable by torch.compile)
        sizes = _sizes_tensor(state, keep.dtype)
        ok = ((keep >= 0) & (keep <= sizes)).all()
        torch._assert_async(ok, "keep: a kept count is outside [0, n] of its segment")
    if isinstance(original, torch.Tensor) and not compiling:
        state._keep_checked = (original, original._version, keep)
    return keep


def _in_range(k: float, n: int) -> bool:
    return 0 <= k <= n  # False for NaN


def _sizes_tensor(state: TransportState, dtype: torch.dtype) -> torch.Tensor:
    if torch.compiler.is_compiling():  # a constant of the graph: a cache written while
        # tracing would be guarded on and recompile the caller at its next call
        return torch.tensor(state.sizes, dtype=dtype, device=state.device)
    cached = state._sizes_cache
    if cached is None or cached.dtype != dtype or cached.device != state.device:
        cached = torch.tensor(state.sizes, dtype=dtype, device=state.device)
        state._sizes_cache = cached
    return cached


def _check_eps(eps, state: TransportState) -> torch.Tensor:
    """eps per segment as a float64 tensor on the state's device; each finite and > 0. A
    number gives one value expand()ed over the segments: the kernels read it once instead
    of once per segment (8 bytes per segment in memory and in each direction)."""
    cached = state._eps_cache  # the common case: the same float every step
    if (
        type(eps) is float
        and cached is not None
        and cached[0] == eps
        and cached[2] is state._state_buffers()["log_odds"]  # replaced when the state moves
    ):
        return cached[1]
    shared = isinstance(eps, numbers.Real) and not isinstance(eps, bool)
    if shared:
        values = [float(eps)]
    elif isinstance(eps, torch.Tensor):
        if eps.requires_grad:
            raise ValueError("eps must not require grad: DTP treats eps as a constant")
        values = eps.detach().reshape(-1).cpu().tolist()
    elif isinstance(eps, Sequence):
        values = [float(v) for v in eps]
    else:
        raise TypeError(f"eps must be a float or one float per segment, got {type(eps).__name__}")
    if not shared and len(values) != state.num_segments:
        raise ValueError(
            f"eps has {len(values)} entries, the state has {state.num_segments} segments"
        )
    for index, v in enumerate(values):
        if not (v > 0 and v < float("inf")):
            raise ValueError(f"eps[{index}] (segment {index}) = {v}; eps must be finite and > 0")
    result = torch.tensor(values, dtype=torch.float64, device=state.device)
    if shared:
        result = result.expand(state.num_segments)
    # not while compiling: a cache written while tracing is a graph output, which torch
    # 2.11's partitioner refused ("Node expand_3 was invalid, but is output", triton)
    if type(eps) is float and not torch.compiler.is_compiling():
        state._eps_cache = (eps, result, state._state_buffers()["log_odds"])
    return result


# Options already accepted, keyed by everything the check reads (whether _C loaded and
# TRITON_INTERPRET included, as they decide which backends exist): the per-step call then
# costs a dict lookup instead of resolving "auto" (~10 us). Only exact int/bool/str values
# are cached, so True never passes for an iters of 1.
_ACCEPTED_OPTIONS: dict[tuple, str] = {}


def _check_options(
    iters, update, backend, nonfinite, blocks_per_segment, device: torch.device
) -> str:
    if torch.compiler.is_compiling():
        # traced once into constants: a lookup would guard on the cache's contents, and
        # the first call's insertion would then recompile the caller on the next
        return _resolve_options(iters, update, backend, nonfinite, blocks_per_segment, device)
    exact = (
        type(iters) is int
        and type(blocks_per_segment) is int
        and type(update) is bool
        and type(backend) is str
        and type(nonfinite) is str
    )
    if exact:
        # TRITON_INTERPRET decides whether triton exists on the CPU: only "auto" and
        # "triton" depend on it
        interpreted = backend in ("auto", "triton") and triton_interpreted()
        key = (
            iters,
            update,
            backend,
            nonfinite,
            blocks_per_segment,
            device,
            compiled(),
            interpreted,
        )
        accepted = _ACCEPTED_OPTIONS.get(key)
        if accepted is not None:
            return accepted
    resolved = _resolve_options(iters, update, backend, nonfinite, blocks_per_segment, device)
    if exact:
        _ACCEPTED_OPTIONS[key] = resolved
    return resolved


def _resolve_options(
    iters, update, backend, nonfinite, blocks_per_segment, device: torch.device
) -> str:
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters = {iters!r}; it must be an int >= 1")
    if (
        isinstance(blocks_per_segment, bool)
        or not isinstance(blocks_per_segment, int)
        or blocks_per_segment < 0
    ):
        raise ValueError(
            f"blocks_per_segment = {blocks_per_segment!r}; it must be an int >= 0 "
            "(0 = chosen by size)"
        )
    if not isinstance(update, bool):
        raise TypeError(f"update must be a bool, got {type(update).__name__}")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite = {nonfinite!r}; allowed: {list(NONFINITE_MODES)}")
    if backend not in BACKENDS:
        raise ValueError(f"backend = {backend!r}; allowed: {list(BACKENDS)}")
    if backend == "auto":
        backend = available_backends(device)[-1]
    else:
        require_backend(backend, device)
    if blocks_per_segment != 0 and backend not in ("cuda", "triton"):
        raise ValueError(
            f"blocks_per_segment = {blocks_per_segment} picks a schedule of the cuda and "
            f"triton backends; backend {backend!r} takes only 0"
        )
    if blocks_per_segment != 0 and backend == "triton" and iters > 1:
        raise ValueError(
            f"blocks_per_segment = {blocks_per_segment} picks a schedule of the triton "
            f"kernels, which do iters = 1; iters = {iters} runs the eager closed form, so "
            "blocks_per_segment must be 0"
        )
    return backend


# ---------------------------------------------------------------------------------------
# Backend "torch": the closed form in eager torch, all segments at once.
# ---------------------------------------------------------------------------------------


def _segment_logsumexp(values: torch.Tensor, seg: torch.Tensor, nseg: int) -> torch.Tensor:
    shift = torch.full((nseg,), -torch.inf, dtype=values.dtype, device=values.device)
    shift = shift.scatter_reduce(0, seg, values.detach(), "amax", include_self=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    total = torch.zeros(nseg, dtype=values.dtype, device=values.device)
    total = total.index_add(0, seg, torch.exp(values - shift[seg]))
    return torch.log(total) + shift


def _transport_mask_torch(
    scores: torch.Tensor,
    keep: torch.Tensor,
    eps: torch.Tensor,
    state: TransportState,
    iters: int,
    neutral: bool = False,
) -> Step:
    acc = torch.float64 if scores.dtype == torch.float64 else torch.float32
    seg, nseg = state.segment_ids, state.num_segments
    scores_ok = None
    if neutral:
        scores_ok = torch.isfinite(scores.detach())
        scores = torch.where(scores_ok, scores, 0.5)
    n = _sizes_tensor(state, acc)
    d = state.log_odds.to(acc)
    delta = state.shift.to(acc)
    k = keep.to(acc)
    x = d + (2 * scores.to(acc) - 1) / eps.to(acc)[seg]
    degenerate = ~((k > 0) & (k < n))
    k_safe = torch.where(degenerate, n / 2, k)  # keeps the unused branch finite for autograd
    bias = torch.log(k_safe) - torch.log(n - k_safe)
    # A degenerate segment's mask is constant: its x enters as 0, so a NaN score there
    # cannot make a NaN gradient through the unused branch.
    x_used = torch.where(degenerate[seg], 0.0, x)
    for _ in range(iters):
        z = x_used + delta[seg]
        log_sig = torch.nn.functional.logsigmoid(z)
        l1 = _segment_logsumexp(log_sig, seg, nseg)
        l0 = _segment_logsumexp(torch.nn.functional.logsigmoid(-z), seg, nseg)
        new_delta = bias + delta - l1 + l0
        delta = new_delta
    mask = k_safe[seg] * torch.exp(log_sig - l1[seg])
    mask = torch.where(degenerate[seg], (k / n)[seg], mask)
    # uint8, not bool: CUDA's scatter_reduce has no bool kernels
    finite = torch.ones(nseg, dtype=torch.uint8, device=x.device)
    # A non-finite score makes x non-finite unless neutral mode replaced it first.
    finite_x = torch.isfinite(x.detach())
    if scores_ok is not None:
        finite_x &= scores_ok
    finite = finite.scatter_reduce(0, seg, finite_x.to(torch.uint8), "amin")
    nonfinite = ~(finite.bool() & torch.isfinite(new_delta.detach()))
    advance = ~nonfinite & ~degenerate
    new_d = torch.where(advance[seg], x.detach() + new_delta.detach()[seg], state.log_odds.to(acc))
    new_shift = torch.where(advance, new_delta.detach(), state.shift.to(acc))
    return mask.to(scores.dtype), new_d, new_shift, nonfinite


# ---------------------------------------------------------------------------------------
# Backend "cpu": the compiled op torch.ops.dtp.transport_mask and its fake implementation.
# Its autograd is registered in C++ (csrc/transport_mask_autograd.cpp).
# ---------------------------------------------------------------------------------------


def _transport_mask_fake(
    scores,
    offsets,
    keep,
    eps,
    log_odds,
    shift,
    iters,
    neutral_nonfinite=False,
    blocks_per_segment=0,
    segment_size=0,
):
    nseg = offsets.shape[0] - 1
    # stats: float64 from the general kernels; from the tiny-segment ones in the state's
    # compute dtype, segments innermost in memory (csrc/common.h: use_blocks_kernels,
    # stats_type; csrc/transport_blocks.h: blocks_stats)
    blocks_kernels = segment_size > 0 and blocks_per_segment == 0
    if blocks_kernels:
        stats = scores.new_empty((iters, 3, nseg), dtype=log_odds.dtype).permute(2, 0, 1)
    else:
        stats = scores.new_empty((nseg, iters, 3), dtype=torch.float64)
    return (
        torch.empty_like(scores),
        torch.empty_like(log_odds),
        torch.empty_like(shift),
        stats,
        scores.new_empty((nseg,), dtype=torch.bool),
    )


def _transport_mask_backward_fake(
    grad_mask,
    scores,
    offsets,
    keep,
    eps,
    log_odds,
    stats,
    neutral_nonfinite=False,
    blocks_per_segment=0,
    segment_size=0,
    mask=None,
):
    return torch.empty_like(scores), torch.empty_like(keep)


def _state_tensors(
    state: TransportState, scores: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(offsets, log-odds, shift) for a fused kernel, the state in its compute dtype:
    float32, or float64 for float64 scores."""
    acc = torch.float64 if scores.dtype == torch.float64 else torch.float32
    buffers = state._state_buffers()  # not Module.__getattr__: ~1 us a buffer
    log_odds, shift = buffers["log_odds"], buffers["shift"]
    if log_odds.dtype != acc:
        log_odds, shift = log_odds.to(acc), shift.to(acc)
    return buffers["offsets"], log_odds, shift


if compiled():  # the ops exist only when dtp_kernels._C loaded
    torch.library.register_fake("dtp::transport_mask", _transport_mask_fake)
    torch.library.register_fake("dtp::transport_mask_backward", _transport_mask_backward_fake)


def _transport_mask_compiled(
    scores: torch.Tensor,
    keep: torch.Tensor,
    eps: torch.Tensor,
    state: TransportState,
    iters: int,
    neutral: bool = False,
    blocks_per_segment: int = 0,
) -> Step:
    args = _op_args(scores, keep, eps, state, iters, neutral, blocks_per_segment)
    mask, new_d, new_shift, _stats, nonfinite = torch.ops.dtp.transport_mask(*args)
    return mask, new_d, new_shift, nonfinite


# dtp::transport_mask's arguments: scores, offsets, keep, eps, log-odds, shift (tensors),
# iters, neutral_nonfinite, blocks_per_segment, segment_size
OpArgs = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
    int, bool, int, int,
]  # fmt: skip


def _op_args(
    scores: torch.Tensor,
    keep: torch.Tensor,
    eps: torch.Tensor,
    state: TransportState,
    iters: int,
    neutral: bool,
    blocks_per_segment: int,
) -> OpArgs:
    """The arguments of dtp::transport_mask for a step on `state`: its segments (offsets,
    and segment_size when all have one tiny size) and its state in the compute dtype."""
    offsets, log_odds, shift = _state_tensors(state, scores)
    return (
        scores,
        offsets,
        keep,
        eps,
        log_odds,
        shift,
        iters,
        neutral,
        blocks_per_segment,
        state.segment_size,
    )


# ---------------------------------------------------------------------------------------
# Backend "triton": torch.library.triton_op, so torch.compile sees the kernels. The
# kernels do one Sinkhorn iteration; iters > 1 runs the eager closed form instead.
# ---------------------------------------------------------------------------------------

Tensor = torch.Tensor

if triton_installed():
    from torch.library import triton_op, wrap_triton

    from .kernels import transport_mask_triton as _tk

    @triton_op("dtp::transport_mask_triton", mutates_args=())
    def _transport_mask_triton_op(
        scores: Tensor,
        offsets: Tensor,
        keep: Tensor,
        eps: Tensor,
        log_odds: Tensor,
        shift: Tensor,
        neutral_nonfinite: bool,
        segment_size: int = 0,
        blocks_per_segment: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return _tk.transport_mask_forward(
            wrap_triton,
            scores,
            offsets,
            keep,
            eps,
            log_odds,
            shift,
            neutral_nonfinite,
            segment_size,
            blocks_per_segment,
        )

    @triton_op("dtp::transport_mask_triton_backward", mutates_args=())
    def _transport_mask_triton_backward_op(
        grad_mask: Tensor,
        scores: Tensor,
        offsets: Tensor,
        keep: Tensor,
        eps: Tensor,
        log_odds: Tensor,
        stats: Tensor,
        neutral_nonfinite: bool,
        segment_size: int = 0,
        blocks_per_segment: int = 0,
    ) -> tuple[Tensor, Tensor]:
        return _tk.transport_mask_backward(
            wrap_triton,
            grad_mask,
            scores,
            offsets,
            keep,
            eps,
            log_odds,
            stats,
            neutral_nonfinite,
            segment_size,
            blocks_per_segment,
        )

    def _triton_setup_context(ctx, inputs, output) -> None:
        scores, offsets, keep, eps, log_odds, _shift, neutral, segment_size, blocks = inputs
        _mask, new_d, new_shift, stats, nonfinite = output
        ctx.save_for_backward(scores, offsets, keep, eps, log_odds, stats)
        ctx.neutral, ctx.segment_size, ctx.blocks = neutral, segment_size, blocks
        ctx.mark_non_differentiable(new_d, new_shift, stats, nonfinite)

    def _triton_backward(ctx, grad_mask, _g_d, _g_shift, _g_stats, _g_nonfinite):
        scores, offsets, keep, eps, log_odds, stats = ctx.saved_tensors
        if grad_mask is None:
            grad_mask = torch.zeros_like(scores)
        grad_scores, grad_keep = _transport_mask_triton_backward_op(
            grad_mask,
            scores,
            offsets,
            keep,
            eps,
            log_odds,
            stats,
            ctx.neutral,
            ctx.segment_size,
            ctx.blocks,
        )
        return grad_scores, None, grad_keep, None, None, None, None, None, None

    _transport_mask_triton_op.register_autograd(
        _triton_backward, setup_context=_triton_setup_context
    )

    def _launch_directly(kernel):
        return kernel

    class _TritonStep(torch.autograd.Function):
        """The eager training step of the triton backend: the same kernels as the
        triton_op above, launched from a plain autograd Function, with the next state
        written into `pending` (the state's pending buffers). The custom-op layer (the
        dispatcher's Python kernels and its autograd wrapper) costs a step more host time
        than this Function (docs/benchmarks.md); torch.compile keeps tracing the
        triton_op. `ctx` is forward's argument rather than setup_context's: the latter
        binds the arguments with inspect.signature on every call. (A step that writes
        the state cannot run under torch.func transforms on any backend anyway.)"""

        @staticmethod
        def forward(ctx, *args):
            # the arguments of _tk.transport_mask_forward after `launch`, then the buffers
            *inputs, pending = args
            mask, _, _, stats, _ = _tk.transport_mask_forward(
                _launch_directly, *inputs, state_outputs=pending
            )
            scores, offsets, keep, eps, log_odds, _shift, *options = inputs
            ctx.save_for_backward(scores, offsets, keep, eps, log_odds, stats)
            ctx.options = options  # neutral, segment_size, blocks_per_segment
            return mask

        @staticmethod
        def backward(ctx, grad_mask):
            grad_scores, grad_keep = _tk.transport_mask_backward(
                _launch_directly, grad_mask, *ctx.saved_tensors, *ctx.options
            )
            keep_grad = grad_keep if ctx.needs_input_grad[2] else None
            return grad_scores, None, keep_grad, *([None] * 7)


def _transport_mask_triton(
    scores: torch.Tensor,
    keep: torch.Tensor,
    eps: torch.Tensor,
    state: TransportState,
    iters: int,
    neutral: bool = False,
    blocks_per_segment: int = 0,
) -> Step:
    if iters > 1:
        return _transport_mask_torch(scores, keep, eps, state, iters, neutral)
    mask, new_d, new_shift, _stats, nonfinite = _transport_mask_triton_op(
        *_triton_args(scores, keep, eps, state, neutral, blocks_per_segment)
    )
    return mask, new_d, new_shift, nonfinite


def _triton_args(scores, keep, eps, state: TransportState, neutral, blocks_per_segment) -> tuple:
    """The triton kernels' arguments for a step on `state`, in their host functions' order:
    scores, offsets, keep, eps, log-odds, shift (the state in its compute dtype), neutral,
    segment_size, blocks_per_segment."""
    offsets, log_odds, shift = _state_tensors(state, scores)
    return (
        scores.contiguous(),
        offsets,
        keep if keep.stride(0) == 0 else keep.contiguous(),  # expand()ed: read at stride 0
        eps,
        log_odds,
        shift,
        neutral,
        state.segment_size,
        blocks_per_segment,
    )


def _triton_step(
    scores: torch.Tensor,
    keep: torch.Tensor,
    eps: torch.Tensor,
    state: TransportState,
    neutral: bool,
    blocks_per_segment: int,
) -> torch.Tensor:
    """The eager training step on the triton backend (one iteration): the mask, with the
    next state in the pending buffers, bitwise as ``_transport_mask_triton`` followed by
    ``state.write_pending`` (tests/ops/test_transport_mask.py)."""
    args = _triton_args(scores, keep, eps, state, neutral, blocks_per_segment)
    buffers = state._state_buffers()
    if args[4] is not buffers["log_odds"]:  # float64 scores on a float32 state: copies
        mask, new_d, new_shift, flags = _transport_mask_triton(
            scores, keep, eps, state, 1, neutral, blocks_per_segment
        )
        state.write_pending(new_d, new_shift, nonfinite=flags)
        return mask
    pending = (buffers["pending_log_odds"], buffers["pending_shift"], buffers["pending_nonfinite"])
    mask = _TritonStep.apply(*args, pending)
    # written through pointers: bump the versions as the in-place write_pending would
    torch.autograd.graph.increment_version(pending)
    buffers["has_pending"].fill_(True)
    return mask


# ---------------------------------------------------------------------------------------
# Backend "reference": the literal Algorithm 1, looped over segments.
# ---------------------------------------------------------------------------------------


def _transport_mask_reference(
    scores: torch.Tensor,
    keep: torch.Tensor,
    eps: torch.Tensor,
    state: TransportState,
    iters: int,
    neutral: bool = False,
) -> Step:
    """Algorithm 1 per segment. The non-finite handling around it is this wrapper's: the
    literal algorithm has none (neutral scores enter as 0.5; a segment with non-finite
    scores or next state keeps its state and is flagged)."""
    from . import reference  # only this backend needs the oracle

    sizes = list(state.sizes)
    scores_ok = torch.isfinite(scores.detach())
    if neutral:
        scores = torch.where(scores_ok, scores, 0.5)
    masks, segment_d, new_shift, held = reference.transport_mask_segments(
        list(scores.split(sizes)),
        keep,
        list(state.log_odds.split(sizes)),
        state.shift,
        eps.tolist(),
        iters,
    )
    nonfinite = torch.tensor(
        [h or not bool(ok.all()) for h, ok in zip(held, scores_ok.split(sizes), strict=True)],
        device=scores.device,
    )
    held_channels = nonfinite.repeat_interleave(torch.tensor(sizes, device=scores.device))
    new_d = torch.where(held_channels, state.log_odds.to(torch.float64), torch.cat(segment_d))
    new_shift = torch.where(nonfinite, state.shift.to(torch.float64), new_shift)
    return torch.cat(masks).to(scores.dtype), new_d, new_shift, nonfinite


_COMPILED_BACKENDS = ("cpu", "cuda")


def _compiled_step(
    scores: torch.Tensor,
    keep: torch.Tensor,
    eps: torch.Tensor,
    state: TransportState,
    iters: int,
    neutral: bool,
    blocks_per_segment: int,
) -> torch.Tensor:
    """The eager training step on the compiled backends: the op and the pending-state
    write in one C++ call (csrc/transport_step.cpp), the same as
    ``_transport_mask_compiled`` followed by ``state.write_pending``."""
    buffers = state._state_buffers()
    return _C.transport_mask_step(
        *_op_args(scores, keep, eps, state, iters, neutral, blocks_per_segment),
        buffers["pending_log_odds"],
        buffers["pending_shift"],
        buffers["pending_nonfinite"],
        buffers["has_pending"],
    )


_IMPLEMENTATIONS = {
    "reference": _transport_mask_reference,
    "torch": _transport_mask_torch,
    "cpu": _transport_mask_compiled,
    "triton": _transport_mask_triton,
    "cuda": _transport_mask_compiled,  # the same op; the dispatcher picks the CUDA kernel
}


# the mask comes back in the form of the scores: type checkers see which (py.typed)
@overload
def transport_mask(
    scores: torch.Tensor,
    keep: torch.Tensor | Sequence[float] | float,
    state: TransportState,
    eps: float | Sequence[float] | torch.Tensor = 1.0,
    iters: int = 1,
    update: bool = True,
    backend: str = "auto",
    nonfinite: str = "propagate",
    blocks_per_segment: int = 0,
) -> torch.Tensor: ...


@overload
def transport_mask(
    scores: Sequence[torch.Tensor],
    keep: torch.Tensor | Sequence[float] | float,
    state: TransportState,
    eps: float | Sequence[float] | torch.Tensor = 1.0,
    iters: int = 1,
    update: bool = True,
    backend: str = "auto",
    nonfinite: str = "propagate",
    blocks_per_segment: int = 0,
) -> list[torch.Tensor]: ...


def transport_mask(
    scores: Scores,
    keep: torch.Tensor | Sequence[float] | float,
    state: TransportState,
    eps: float | Sequence[float] | torch.Tensor = 1.0,
    iters: int = 1,
    update: bool = True,
    backend: str = "auto",
    nonfinite: str = "propagate",
    blocks_per_segment: int = 0,
) -> torch.Tensor | list[torch.Tensor]:
    """Soft masks of every segment from one warm-started entropic transport step.

    Args:
        scores: importance scores, one flat 1-D tensor over all segments (laid out as
            ``state.sizes``) or a list of 1-D tensors, one per segment. float16, bfloat16,
            float32 or float64; the math runs in float32 (float64 for float64 scores).
        keep: kept count k per segment, each in [0, n]; floats, and may require grad
            (the FLOPs budget learns it). A plain number is allowed for one segment.
        state: the segments' TransportState; its current state is read, never changed here.
        eps: entropic regularisation, a float or one per segment, finite and > 0.
        iters: Sinkhorn iterations per step (the paper uses 1).
        update: write the next state to ``state.pending_*`` (made current by
            ``state.commit()``). False leaves the state untouched.
        backend: "auto", "reference", "torch", "cpu", "triton" or "cuda" (see
            ``available_backends``; "triton" does iters = 1 in its fused kernels and runs
            the eager closed form for iters > 1).
        nonfinite: what NaN/Inf scores do to their segment's mask: "propagate" (it
            becomes NaN) or "neutral" (they enter as the score 0.5, with zero gradient, so
            the mask stays finite; DTPPruner uses it). Either way the segment keeps its
            state, decided in the kernel, and ``update`` flags the step for
            ``state.skipped_steps``; so does a next state that is not finite.
        blocks_per_segment: the schedule of the cuda and triton backends: 0 chooses by
            size, 1 runs one block (Triton program) per segment, B > 1 splits every
            segment over B of them. All give the same result up to rounding; a value > 0
            also runs N:M segments on the general kernels; other backends, and triton
            with iters > 1, take only 0.

    Returns:
        The mask in the layout and dtype of ``scores``: ``mask[i] = n P_new[i, 1]``; each
        segment's mask sums to its k. Segments with k = 0 or k = n get the constant k/n.
    """
    flat, is_list = _check_scores(scores, _checked_state(state))
    keep_t = _check_keep(keep, state)
    eps_t = _check_eps(eps, state)
    backend = _check_options(iters, update, backend, nonfinite, blocks_per_segment, flat.device)
    neutral = nonfinite == "neutral"
    eager_step = update and not torch.compiler.is_compiling()
    if eager_step and backend in _COMPILED_BACKENDS:
        mask = _compiled_step(flat, keep_t, eps_t, state, iters, neutral, blocks_per_segment)
    elif eager_step and backend == "triton" and iters == 1:
        mask = _triton_step(flat, keep_t, eps_t, state, neutral, blocks_per_segment)
    else:
        schedule = (blocks_per_segment,) if backend in ("cuda", "triton") else ()
        mask, new_d, new_shift, flags = _IMPLEMENTATIONS[backend](
            flat, keep_t, eps_t, state, iters, neutral, *schedule
        )
        if update:
            state.write_pending(new_d, new_shift, nonfinite=flags)
    return list(mask.split(list(state.sizes))) if is_list else mask


def _checked_state(state) -> TransportState:
    if not isinstance(state, TransportState):
        raise TypeError(f"state must be a TransportState, got {type(state).__name__}")
    return state
