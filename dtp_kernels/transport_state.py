"""The warm-start state of the transport problem, carried between training steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from ._extension import _C

TINY_SEGMENT_SIZES = (4, 8, 16)  # sizes with kernels of their own (dtp::transport_mask)


class TransportState(nn.Module):
    """Per-segment state of DTP's one-step entropic transport (docs/design.md sections 1 and 4).

    For a segment of n channels the plan P (n x 2) enters the next step only through the
    row log-odds ``log_odds[i] = log P[i, 1] - log P[i, 0]`` and the dual shift
    ``shift = (g_1 - g_0) / eps``. Both start at 0 (uniform plan, g = 1).

    ``transport_mask(..., update=True)`` writes the next state into the ``pending_*``
    buffers; :meth:`commit` makes it current once per optimizer step, so several forwards
    before a commit (gradient accumulation, evaluation) all see the same state.

    Buffers (all in ``state_dict``): ``offsets`` (int64, segments + 1), ``log_odds`` and
    ``pending_log_odds`` (one per channel), ``shift`` and ``pending_shift`` (one per
    segment), ``has_pending`` (bool), ``steps`` (int64, committed steps),
    ``pending_nonfinite`` (bool, one per segment) and ``skipped_steps`` (int64, one per
    segment: committed steps in which the segment kept its state because its scores or
    its next state were NaN/Inf, or :meth:`hold` kept it). All of it is updated on the
    device, with no host sync.

    ``segment_size`` is the size every segment has when all have one size 4, 8 or 16
    (the blocks of N:M sparsity), else 0; the compiled backends then run their kernels
    for tiny equal segments (docs/ops.md). Setting it to 0 runs the general kernels.

    Args:
        sizes: channels per segment, each >= 1.
        dtype: float32 (default) or float64 for the carried state.
        device: where the buffers live; scores must be on the same device.
    """

    offsets: torch.Tensor
    log_odds: torch.Tensor
    shift: torch.Tensor
    pending_log_odds: torch.Tensor
    pending_shift: torch.Tensor
    has_pending: torch.Tensor
    steps: torch.Tensor
    pending_nonfinite: torch.Tensor
    skipped_steps: torch.Tensor

    def __init__(
        self,
        sizes: Sequence[int],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        sizes = list(sizes)
        if not sizes:
            raise ValueError("TransportState: sizes is empty; give at least one segment")
        for index, n in enumerate(sizes):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(
                    f"TransportState: sizes[{index}] = {n!r}; each segment size must be an int >= 1"
                )
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"TransportState: dtype must be float32 or float64, got {dtype}")
        self.sizes: tuple[int, ...] = tuple(sizes)
        # Segments all of one size the tiny-segment kernels take (N:M blocks): that size,
        # passed to the kernels as segment_size; 0 otherwise.
        uniform = all(n == sizes[0] for n in sizes)
        self.segment_size = sizes[0] if uniform and sizes[0] in TINY_SEGMENT_SIZES else 0
        total = self._numel = sum(sizes)
        offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
        self.register_buffer("offsets", offsets.to(device))
        self.register_buffer("log_odds", torch.zeros(total, dtype=dtype, device=device))
        self.register_buffer("shift", torch.zeros(len(sizes), dtype=dtype, device=device))
        self.register_buffer("pending_log_odds", torch.zeros(total, dtype=dtype, device=device))
        self.register_buffer("pending_shift", torch.zeros(len(sizes), dtype=dtype, device=device))
        self.register_buffer("has_pending", torch.zeros((), dtype=torch.bool, device=device))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64, device=device))
        self.register_buffer(
            "pending_nonfinite", torch.zeros(len(sizes), dtype=torch.bool, device=device)
        )
        self.register_buffer(
            "skipped_steps", torch.zeros(len(sizes), dtype=torch.int64, device=device)
        )
        # What transport_mask caches between calls to skip repeated argument work (not
        # state, not saved; each entry says what it was made from, so a stale one is
        # recomputed): the keep tensor last checked (the tensor, its version, the checked
        # copy), the segment sizes as a tensor, and the last float eps with its tensor and the
        # log-odds buffer it was made beside (a moved state has a new one).
        self._keep_checked: tuple[torch.Tensor, int, torch.Tensor] | None = None
        self._sizes_cache: torch.Tensor | None = None
        self._eps_cache: tuple[float, torch.Tensor, torch.Tensor] | None = None
        # Derived, not saved, built on first use (see segment_ids).
        self._segment_ids: torch.Tensor | None = None

    def _state_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers by name, read without Module.__getattr__ (slow on a per-step path);
        none of them is ever None."""
        return cast(dict[str, torch.Tensor], self._buffers)

    @property
    def segment_ids(self) -> torch.Tensor:
        """Segment index of every channel (int64, on the state's device). Only the eager
        ``torch`` backend and :meth:`hold` read it, so it is built on first use: the
        compiled kernels never pay its 8 bytes per channel."""
        ids = self._segment_ids
        if ids is None or ids.device != self.device:
            sizes = torch.tensor(self.sizes, dtype=torch.int64)
            ids = torch.repeat_interleave(torch.arange(len(self.sizes)), sizes).to(self.device)
            self._segment_ids = ids
        return ids

    @property
    def num_segments(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def device(self) -> torch.device:
        return self._state_buffers()["log_odds"].device

    def write_pending(
        self, log_odds: torch.Tensor, shift: torch.Tensor, nonfinite: torch.Tensor | None = None
    ) -> None:
        """Store the next state (tensors without grad); it becomes current at :meth:`commit`.
        ``nonfinite`` (bool, one per segment; the transport kernels return it) marks the
        segments that kept their state in it: :meth:`commit` counts them as skipped. The
        last write before a commit decides both (several forwards per optimizer step)."""
        buffers = self._state_buffers()  # direct: Module.__getattr__ is slow per step
        pending_d, pending_s = buffers["pending_log_odds"], buffers["pending_shift"]
        if log_odds.dtype != pending_d.dtype:  # float64 scores on a float32 state
            log_odds, shift = log_odds.to(pending_d.dtype), shift.to(pending_d.dtype)
        torch._foreach_copy_([pending_d, pending_s], [log_odds, shift])
        if nonfinite is None:
            buffers["pending_nonfinite"].zero_()
        else:
            buffers["pending_nonfinite"].copy_(nonfinite)
        buffers["has_pending"].fill_(True)

    @torch.no_grad()
    def hold(self, segments: torch.Tensor) -> None:
        """Keep the current state of the marked segments (bool, one per segment) at the
        next :meth:`commit` and count the step as skipped for them, if a forward wrote a
        pending step; on the device."""
        buffers = self._state_buffers()
        pending_d, pending_s = buffers["pending_log_odds"], buffers["pending_shift"]
        torch.where(segments[self.segment_ids], buffers["log_odds"], pending_d, out=pending_d)
        torch.where(segments, buffers["shift"], pending_s, out=pending_s)
        buffers["pending_nonfinite"].logical_or_(segments & buffers["has_pending"])

    @torch.no_grad()
    def commit(self) -> None:
        """Make the pending state current and count a step, if a forward wrote one.

        One C++ call when dtp_kernels._C is built (plain loops on CPU tensors, one kernel
        on a GPU when its CUDA kernels are built), else four ops; on the device, without a
        host sync. Outside a pending step the
        pending buffers equal the current ones (every commit leaves them so), so copying
        is always right, and ``pending_nonfinite`` is only ever set with a pending step.
        """
        buffers = self._state_buffers()
        if _C is not None and not torch.compiler.is_compiling():  # one call from Python
            _C.transport_commit(
                buffers["log_odds"],
                buffers["shift"],
                buffers["pending_log_odds"],
                buffers["pending_shift"],
                buffers["steps"],
                buffers["skipped_steps"],
                buffers["has_pending"],
                buffers["pending_nonfinite"],
            )
            return
        torch._foreach_copy_(
            [buffers["log_odds"], buffers["shift"]],
            [buffers["pending_log_odds"], buffers["pending_shift"]],
        )
        buffers["steps"].add_(buffers["has_pending"])
        buffers["skipped_steps"].add_(buffers["pending_nonfinite"])
        torch._foreach_zero_([buffers["has_pending"], buffers["pending_nonfinite"]])

    @torch.no_grad()
    def reset(self) -> None:
        """Back to the uniform plan: all log-odds and shifts 0, no pending step, 0 steps."""
        for buffer in (self.log_odds, self.shift, self.pending_log_odds, self.pending_shift):
            buffer.zero_()
        self.has_pending.fill_(False)
        self.pending_nonfinite.fill_(False)
        self.steps.zero_()
        self.skipped_steps.zero_()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "offsets"
        if key in state_dict and not torch.equal(state_dict[key].cpu(), self.offsets.cpu()):
            raise ValueError(
                f"TransportState: the saved segment offsets {state_dict[key].tolist()} do not "
                f"match this state's {self.offsets.tolist()}"
            )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"segments={self.num_segments}, numel={self.numel}, dtype={self.log_odds.dtype}"
