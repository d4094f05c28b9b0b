"""Type hints of the compiled module (csrc/ops.cpp's pybind11 bindings). The ops themselves
are registered in torch.ops.dtp; these are the eager helpers the Python layer calls."""

from typing import Any

from torch import Tensor

def build_info() -> dict[str, Any]: ...
def fold_products(params: list[Tensor], mask: Tensor, channels: Tensor | None) -> list[Tensor]: ...
def transport_mask_step(
    scores: Tensor,
    offsets: Tensor,
    keep: Tensor,
    eps: Tensor,
    log_odds: Tensor,
    shift: Tensor,
    iters: int,
    neutral_nonfinite: bool,
    blocks_per_segment: int,
    segment_size: int,
    pending_log_odds: Tensor,
    pending_shift: Tensor,
    pending_nonfinite: Tensor,
    has_pending: Tensor,
) -> Tensor: ...
def transport_commit(
    log_odds: Tensor,
    shift: Tensor,
    pending_log_odds: Tensor,
    pending_shift: Tensor,
    steps: Tensor,
    skipped_steps: Tensor,
    has_pending: Tensor,
    pending_nonfinite: Tensor,
) -> None: ...
def set_huge_page_outputs(enabled: bool) -> bool: ...
def set_output_cache_limit(bytes: int) -> int: ...
def output_cache_info() -> tuple[int, int, int]: ...
