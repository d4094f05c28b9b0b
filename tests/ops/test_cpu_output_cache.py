"""The CPU kernels' outputs of 4 MiB or more take their memory from blocks that freed
outputs left behind (csrc/cpu_output_cache.cpp): a freed block is reused for the next
output of its size, a live tensor's never, and the cache keeps no more than its limit."""

from __future__ import annotations

import threading

import pytest
import torch

import dtp_kernels
from dtp_kernels import (
    TransportState,
    cpu_output_cache_info,
    masked_channel_epilogue,
    set_cpu_output_cache,
    transport_mask,
)

pytestmark = pytest.mark.skipif(dtp_kernels._C is None, reason="dtp_kernels._C is not built")

N = 2 << 20  # 8 MiB of float32 per mask and gradient: every output here is cached


@pytest.fixture
def cache():
    """A cache emptied before the test, given back its previous limit after it."""
    previous = set_cpu_output_cache(0)
    set_cpu_output_cache(previous)
    yield
    set_cpu_output_cache(0)
    set_cpu_output_cache(previous)


def step(scores: torch.Tensor, state: TransportState) -> torch.Tensor:
    return transport_mask(scores, [N / 8] * 4, state, backend="cpu")


def test_a_freed_output_is_reused_and_a_live_one_is_not(cache):
    scores = torch.rand(N)
    state = TransportState([N // 4] * 4)
    first = step(scores, state)
    kept = first.clone()
    second = step(scores, state)  # `first` is alive: its memory must not be handed out
    assert second.data_ptr() != first.data_ptr()
    assert torch.equal(first, kept)
    address = first.data_ptr()
    del first
    held = cpu_output_cache_info()
    assert held["held_blocks"] >= 1 and held["held_bytes"] >= N * 4
    third = step(scores, state)
    assert third.data_ptr() == address
    assert torch.equal(third, kept)


def test_the_limit_bounds_what_is_held_and_zero_frees_it_now(cache):
    scores = torch.rand(N)
    state = TransportState([N // 4] * 4)
    set_cpu_output_cache(N * 4)  # one mask's block
    masks = [step(scores, state) for _ in range(4)]
    del masks
    info = cpu_output_cache_info()
    assert info["limit_bytes"] == N * 4
    assert 0 < info["held_bytes"] <= N * 4 and info["held_blocks"] == 1
    assert set_cpu_output_cache(0) == N * 4
    assert cpu_output_cache_info()["held_bytes"] == 0
    del state, scores
    mask = step(torch.rand(N), TransportState([N // 4] * 4))
    del mask
    assert cpu_output_cache_info() == {"held_bytes": 0, "held_blocks": 0, "limit_bytes": 0}


def test_a_full_cache_makes_room_by_freeing_the_longest_freed_blocks(cache):
    mib = 1 << 20
    set_cpu_output_cache(16 * mib)
    ones = torch.ones(64)

    def epilogue(y: torch.Tensor) -> torch.Tensor:
        return masked_channel_epilogue(y, ones, None, "relu", backend="cpu")

    y_large, y_small = torch.randn(8, 64, 64, 64), torch.randn(4, 64, 64, 64)  # 8, 4 MiB
    old, young = epilogue(y_large), epilogue(y_large)
    young_address = young.data_ptr()
    small = [epilogue(y_small) for _ in range(2)]
    small_addresses = {t.data_ptr() for t in small}
    del old, young  # 16 MiB held: the limit
    del small  # the block freed longest ago (old's) makes room for both
    assert cpu_output_cache_info() == {
        "held_bytes": 16 * mib,
        "held_blocks": 3,
        "limit_bytes": 16 * mib,
    }
    again = [epilogue(y_small), epilogue(y_small)]
    assert {t.data_ptr() for t in again} == small_addresses
    assert epilogue(y_large).data_ptr() == young_address


def test_set_cpu_output_cache_returns_the_previous_limit_and_checks_its_argument(cache):
    previous = set_cpu_output_cache(123 << 20)
    assert set_cpu_output_cache(previous) == 123 << 20
    with pytest.raises(ValueError, match=r"limit_bytes = -1; it must be >= 0"):
        set_cpu_output_cache(-1)
    with pytest.raises(TypeError, match="limit_bytes must be an int"):
        set_cpu_output_cache(1.5)
    with pytest.raises(TypeError, match="limit_bytes must be an int"):
        set_cpu_output_cache(True)
    assert cpu_output_cache_info()["limit_bytes"] == previous


def test_outputs_freed_on_another_thread_return_to_the_cache(cache):
    scores = torch.rand(N)
    state = TransportState([N // 4] * 4)
    masks = [step(scores, state) for _ in range(3)]
    addresses = {m.data_ptr() for m in masks}
    before = cpu_output_cache_info()["held_blocks"]

    def free_them() -> None:
        masks.clear()

    worker = threading.Thread(target=free_them)
    worker.start()
    worker.join()
    assert cpu_output_cache_info()["held_blocks"] == before + 3
    assert step(scores, state).data_ptr() in addresses


def test_gradients_and_the_backward_statistics_are_cached_too(cache):
    scores = torch.rand(N, requires_grad=True)
    state = TransportState([4] * (N // 4))  # the tiny-segment kernels: stats of 6 MiB
    grad = torch.randn(N)
    transport_mask(scores, torch.full((N // 4,), 2.0), state, backend="cpu").backward(grad)
    first = scores.grad.clone()
    address = scores.grad.data_ptr()
    scores.grad = None
    held = cpu_output_cache_info()["held_blocks"]
    assert held >= 3  # the mask, the statistics and the score gradient
    transport_mask(scores, torch.full((N // 4,), 2.0), state, backend="cpu").backward(grad)
    assert scores.grad.data_ptr() == address
    torch.testing.assert_close(scores.grad, first, rtol=0, atol=0)


def test_a_cached_output_can_be_resized(cache):
    scores = torch.rand(N)
    mask = step(scores, TransportState([N // 4] * 4))
    kept = mask.clone()
    mask.resize_(2 * N)
    assert torch.equal(mask[:N], kept)
    mask[N:] = 1.0
    assert mask.sum() >= N


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_epilogue_keeps_its_layout_in_cached_memory(cache, channels_last):
    y = torch.randn(4, 64, 64, 64)  # 4 MiB
    if channels_last:
        y = y.contiguous(memory_format=torch.channels_last)
    mask, bias = torch.rand(64), torch.randn(64)
    out = masked_channel_epilogue(y, mask, bias, "relu", backend="cpu")
    assert out.stride() == y.stride()
    want = torch.relu((y + bias[:, None, None]) * mask[:, None, None])
    torch.testing.assert_close(out, want)
    address = out.data_ptr()
    del out
    assert masked_channel_epilogue(y, mask, bias, "relu", backend="cpu").data_ptr() == address
