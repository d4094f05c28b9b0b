"""State semantics (docs/design.md section 4): pending vs committed, update=False, state_dict."""

import io

import pytest
import torch

import dtp_kernels
from dtp_kernels import TransportState, transport_mask

SIZES = [3, 17, 1, 64]
KEEP = [1.0, 8.5, 1.0, 20.0]


def snapshot(state: TransportState) -> dict:
    return {k: v.clone() for k, v in state.state_dict().items()}


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_repeated_forwards_before_commit_are_identical(any_backend):
    state = TransportState(SIZES)
    scores = torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(0))
    for _ in range(3):  # move off the uniform start
        transport_mask(scores, KEEP, state, backend=any_backend)
        state.commit()
    first = transport_mask(scores, KEEP, state, backend=any_backend)
    pending = state.pending_log_odds.clone()
    for _ in range(3):
        again = transport_mask(scores, KEEP, state, backend=any_backend)
        assert torch.equal(again, first)
        assert torch.equal(state.pending_log_odds, pending)


def test_update_false_never_changes_state(any_backend):
    state = TransportState(SIZES)
    scores = torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(1))
    transport_mask(scores, KEEP, state, backend=any_backend)
    state.commit()
    before = snapshot(state)
    for _ in range(3):
        transport_mask(scores * 2, KEEP, state, update=False, backend=any_backend)
    state.commit()  # nothing pending: a no-op
    assert_same_state(before, snapshot(state))


def test_commit_advances_once_per_pending_step(any_backend):
    state = TransportState(SIZES)
    scores = torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(2))
    m0 = transport_mask(scores, KEEP, state, backend=any_backend)
    assert int(state.steps) == 0 and torch.all(state.log_odds == 0)
    state.commit()
    assert int(state.steps) == 1 and torch.equal(state.log_odds, state.pending_log_odds)
    state.commit()
    assert int(state.steps) == 1
    m1 = transport_mask(scores, KEEP, state, backend=any_backend)
    assert not torch.equal(m0, m1)


def test_state_dict_round_trip():
    state = TransportState(SIZES)
    scores = torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(3))
    for _ in range(4):
        transport_mask(scores, KEEP, state)
        state.commit()
    transport_mask(scores, KEEP, state)  # leave a pending step in the saved state
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    restored = TransportState(SIZES)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert_same_state(snapshot(state), snapshot(restored))
    state.commit()
    restored.commit()
    assert torch.equal(transport_mask(scores, KEEP, state), transport_mask(scores, KEEP, restored))


def test_load_state_dict_with_other_segments_fails_cleanly():
    state = TransportState(SIZES)
    other = TransportState([3, 17, 1, 63])
    before = snapshot(other)
    with pytest.raises(ValueError, match="offsets"):
        other.load_state_dict(state.state_dict())
    assert_same_state(before, snapshot(other))


def test_reset_returns_to_uniform_start():
    state = TransportState(SIZES)
    scores = torch.randn(sum(SIZES))
    first = transport_mask(scores, KEEP, state)
    state.commit()
    state.reset()
    assert int(state.steps) == 0
    assert torch.equal(transport_mask(scores, KEEP, state), first)


@pytest.mark.parametrize("bad", [[], [3, 0], [2, -1], [2.0], [True]])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="size"):
        TransportState(bad)


def test_segment_index_is_built_only_when_read():
    """The compiled kernels never read the per-channel segment index (8 bytes a channel):
    it is built on first use (eager torch backend, hold) and is then right."""
    state = TransportState([2, 3, 1])
    scores = torch.rand(6)
    if "cpu" in dtp_kernels.available_backends("cpu"):
        transport_mask(scores, [1.0, 1.0, 0.5], state, backend="cpu")
        assert state._segment_ids is None
    transport_mask(scores, [1.0, 1.0, 0.5], state, backend="torch")
    assert state.segment_ids.tolist() == [0, 0, 1, 1, 1, 2]
    assert "segment_ids" not in state.state_dict()


def test_memory_benchmark_counts_every_part():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import dtp_memory

    count, parts = dtp_memory.measure(3 * 32 * 32, "2:4", "Adam", "learned")
    assert count == 3 * 32 * 32
    assert parts["scores"] == parts["score gradient"] == 4 * count
    assert parts["optimizer state"] >= 8 * count  # exp_avg and exp_avg_sq
    # log-odds; per block of 4: shift, offsets and skipped steps; the offsets' end, the
    # step count, the has-pending flag and eps (one float64 for all blocks)
    assert parts["transport state"] == 4 * count + (count // 4) * (4 + 8 + 8) + 8 + 8 + 1 + 8
    assert parts["kept counts"] == 4  # N once, read by every block
    if "cpu" in dtp_kernels.available_backends("cpu"):  # the tile kernels' float32 stats
        # measured: the mask, 3 float32 stats per block of 4, and the masked weights of
        # the two layers whose input gradient the backward needs
        assert parts["forward-to-backward"] == 4 * count + 3 * count + 2 * 4 * (count // 3)
    assert all(value > 0 for value in parts.values())
    # magnitude scores: no score parameter, gradient or optimizer state; the op keeps |w|
    same, lean = dtp_memory.measure(3 * 32 * 32, "2:4", "Adam", "magnitude")
    assert same == count
    assert lean["scores"] == lean["score gradient"] == lean["optimizer state"] == 0
    assert lean["forward-to-backward"] == parts["forward-to-backward"] + 4 * count
    assert lean["transport state"] == parts["transport state"]


def _commit_with_torch_ops(b: dict) -> None:
    """TransportState.commit as torch ops (what runs without dtp_kernels._C)."""
    torch._foreach_copy_([b["log_odds"], b["shift"]], [b["pending_log_odds"], b["pending_shift"]])
    b["steps"].add_(b["has_pending"])
    b["skipped_steps"].add_(b["pending_nonfinite"])
    torch._foreach_zero_([b["has_pending"], b["pending_nonfinite"]])


BUFFER_ORDER = (
    "log_odds",
    "shift",
    "pending_log_odds",
    "pending_shift",
    "steps",
    "skipped_steps",
    "has_pending",
    "pending_nonfinite",
)


# Three small segments, and a state of more elements than the CUDA kernel's grid has
# threads (4,096 blocks of 256): its grid-stride loop.
COMMIT_LAYOUTS = {"small": [3, 1, 5], "large": [1_100_000, 1, 5]}


@pytest.mark.parametrize("layout", sorted(COMMIT_LAYOUTS))
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compiled_commit_equals_the_torch_ops(device, dtype, strided, layout):
    """The one-call commit (plain loops for contiguous CPU buffers, one kernel for
    contiguous CUDA ones, torch ops otherwise) leaves every buffer as the four torch ops
    do: with and without a pending step, with held segments. Contiguous buffers dispatch
    no torch op."""
    if dtp_kernels._C is None:
        pytest.skip("dtp_kernels._C is not built")
    gen = torch.Generator().manual_seed(3)
    sizes = COMMIT_LAYOUTS[layout]
    state = TransportState(sizes, dtype=dtype, device=device)
    for pending in (True, False):
        raw = {k: v.clone() for k, v in state.state_dict().items() if k in BUFFER_ORDER}
        raw["pending_log_odds"] = torch.randn(sum(sizes), generator=gen, dtype=dtype).to(device)
        raw["pending_shift"] = torch.randn(3, generator=gen, dtype=dtype).to(device)
        raw["pending_nonfinite"] = torch.tensor([True, False, pending], device=device)
        raw["has_pending"] = torch.tensor(pending, device=device)
        raw["skipped_steps"] = torch.tensor([4, 0, 7], device=device)
        raw["steps"] = torch.tensor(11, device=device)
        if strided:  # views of every second element: the torch-ops path of the C++ call
            raw = {k: torch.stack([v, torch.zeros_like(v)], -1)[..., 0] for k, v in raw.items()}
            assert not raw["log_odds"].is_contiguous()
        want = {k: v.clone() for k, v in raw.items()}
        _commit_with_torch_ops(want)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            dtp_kernels._C.transport_commit(*(raw[k] for k in BUFFER_ORDER))
        ops = [e.key for e in prof.key_averages() if e.key.startswith("aten::")]
        assert (ops == []) == (not strided), ops
        for k in BUFFER_ORDER:
            assert torch.equal(raw[k], want[k]), k
        assert not raw["has_pending"] and not raw["pending_nonfinite"].any()


def test_backward_after_a_commit_fails_or_uses_the_state_of_its_forward(any_backend):
    """A commit between a forward and its backward changes the state the forward read.
    Backends whose backward reads that state must refuse, as autograd refuses any tensor
    changed in place after it was saved; the others must give the gradient of the state
    their forward saw. Never the gradient of the new state (the C++ commit writes raw
    memory, so it bumps the version counters itself)."""
    gen = torch.Generator().manual_seed(5)
    weights = torch.randn(sum(SIZES), generator=gen, dtype=torch.float64)
    state = TransportState(SIZES, dtype=torch.float64)
    for step in range(3):
        scores = torch.randn(sum(SIZES), generator=gen, dtype=torch.float64) * 3
        s_want = scores.clone().requires_grad_(True)
        twin = TransportState(SIZES, dtype=torch.float64)
        twin.load_state_dict(state.state_dict())
        (weights * transport_mask(s_want, KEEP, twin, backend=any_backend)).sum().backward()

        s = scores.clone().requires_grad_(True)
        mask = transport_mask(s, KEEP, state, backend=any_backend)
        state.commit()
        try:
            (weights * mask).sum().backward()
        except RuntimeError as error:
            assert "modified by an inplace operation" in str(error), error
            continue
        torch.testing.assert_close(s.grad, s_want.grad, rtol=1e-12, atol=1e-14, msg=f"step {step}")


def test_cached_eps_follows_the_state_to_another_device():
    """The per-step eps tensor is cached beside the state's buffers: a state moved to
    another device gets one made there, not the old device's."""
    from dtp_kernels.transport_mask import _check_eps

    state = TransportState([3, 4])
    first = _check_eps(0.5, state)
    assert _check_eps(0.5, state) is first
    state.to("meta")
    moved = _check_eps(0.5, state)
    assert moved.device.type == "meta" and moved is not first
    assert _check_eps(0.25, state).device.type == "meta"


@pytest.mark.skipif(
    "cpu" not in dtp_kernels.available_backends("cpu"), reason="dtp_kernels._C is not built"
)
def test_eager_step_marks_the_pending_state_as_an_in_place_op_would():
    """The eager CPU step sets has_pending with a host write: the flag and its version
    counter change as fill_ would change them."""
    state = TransportState([3, 4])
    flag = state.has_pending
    version = flag._version
    transport_mask(torch.rand(7), [1.0, 2.0], state, backend="cpu")
    assert bool(flag) and flag._version > version
