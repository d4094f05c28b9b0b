"""The CPU kernels ask for transparent huge pages for outputs of 4 MiB and more
(csrc/cpu_outputs.h): faults on fresh 4 KiB pages slow a large step down. The advice
shows in the mapping's VmFlags ("hg") in /proc/self/smaps; the values are the
same as on the usual pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dtp_kernels
from dtp_kernels import TransportState, masked_channel_epilogue, transport_mask

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

pytestmark = [
    pytest.mark.skipif(dtp_kernels._C is None, reason="dtp_kernels._C is not built"),
    pytest.mark.skipif(
        not THP.exists() or "[never]" in THP.read_text(),
        reason="transparent huge pages are off or absent here",
    ),
]

HUGE_PAGE = 2 << 20
# Every tensor here is above glibc's largest mmap threshold (32 MiB), so each lands in a
# fresh mapping (or a block of the output cache made under the same advice setting): none
# inherits the advice from memory an earlier tensor freed.


def advised_for_huge_pages(t: torch.Tensor) -> bool:
    """Whether the mapping holding the first 2 MiB-aligned byte of `t` carries
    MADV_HUGEPAGE."""
    address = (t.data_ptr() + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds address {address:#x}")


def test_transport_outputs_are_advised_and_equal_the_torch_backend():
    n = 5 << 20  # 40 MiB of float64
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(n, generator=gen, dtype=torch.float64).requires_grad_(True)
    grad = torch.randn(n, generator=gen, dtype=torch.float64)
    results = {}
    for backend in ("cpu", "torch"):
        state = TransportState([n // 2, n // 2], dtype=torch.float64)
        mask = transport_mask(scores, [n / 4, n / 8], state, backend=backend)
        mask.backward(grad)
        results[backend] = (mask.detach(), scores.grad, state.pending_log_odds.clone())
        if backend == "cpu":
            assert advised_for_huge_pages(mask) and advised_for_huge_pages(scores.grad)
        scores.grad = None
    for got, want in zip(results["cpu"], results["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_the_advice_can_be_turned_off():
    n = 9 << 20
    # an advised block of the mask's size, freed into the output cache: with the advice
    # off it must not be reused
    advised = transport_mask(torch.rand(n), [n / 2], TransportState([n]), backend="cpu")
    assert advised_for_huge_pages(advised)
    del advised
    previous = dtp_kernels.set_cpu_huge_pages(False)
    try:
        assert previous is True  # on by default
        mask = transport_mask(torch.rand(n), [n / 2], TransportState([n]), backend="cpu")
        assert not advised_for_huge_pages(mask)
    finally:
        assert dtp_kernels.set_cpu_huge_pages(previous) is False
    with pytest.raises(TypeError, match="enabled must be a bool"):
        dtp_kernels.set_cpu_huge_pages(1)


def test_epilogue_outputs_are_advised_and_equal_the_torch_backend():
    y = torch.randn(4, 64, 192, 192).contiguous(memory_format=torch.channels_last)
    y.requires_grad_(True)
    mask, bias = torch.rand(64), torch.randn(64)
    out = {}
    for backend in ("cpu", "torch"):
        result = masked_channel_epilogue(y, mask, bias, "relu", backend=backend)
        result.square().sum().backward()
        out[backend] = (result.detach(), y.grad)
        if backend == "cpu":
            assert advised_for_huge_pages(result) and advised_for_huge_pages(y.grad)
        y.grad = None
    for got, want in zip(out["cpu"], out["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
