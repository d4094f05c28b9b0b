"""dtp_kernels: Differentiable Transportation Pruning (Li et al., ICCV 2023) for PyTorch.

Public API: :func:`transport_mask`, :class:`TransportState`,
:func:`masked_channel_epilogue`, :func:`available_backends`, :func:`build_info`,
:func:`set_cpu_huge_pages`, :func:`set_cpu_output_cache`,
:func:`cpu_output_cache_info`;
pruning: :class:`DTPPruner`, :func:`prepare`, :func:`save_pruned`, :func:`load_pruned`,
:func:`conv1d_to_linear`.
The literal reference is :mod:`dtp_kernels.reference`.
"""

from ._extension import (
    BackendUnavailableError,
    available_backends,
    build_info,
    cpu_output_cache_info,
    set_cpu_huge_pages,
    set_cpu_output_cache,
)
from ._version import __version__
from .masked_channel_epilogue import masked_channel_epilogue
from .pruning import (
    DTPPruner,
    L1Pruner,
    RandomPruner,
    conv1d_to_linear,
    load_pruned,
    prepare,
    save_pruned,
)
from .transport_mask import transport_mask
from .transport_state import TransportState

__all__ = [
    "BackendUnavailableError",
    "DTPPruner",
    "L1Pruner",
    "RandomPruner",
    "TransportState",
    "__version__",
    "available_backends",
    "build_info",
    "conv1d_to_linear",
    "cpu_output_cache_info",
    "load_pruned",
    "masked_channel_epilogue",
    "prepare",
    "save_pruned",
    "set_cpu_huge_pages",
    "set_cpu_output_cache",
    "transport_mask",
]
