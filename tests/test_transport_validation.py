"""Bad input: a clear error naming the argument, the segment and the allowed range, and
the state untouched."""

import pytest
import torch

from dtp_kernels import TransportState, transport_mask

SIZES = [3, 5]


@pytest.fixture
def state():
    s = TransportState(SIZES)
    transport_mask(torch.randn(8), [1.0, 2.0], s)
    s.commit()
    transport_mask(torch.randn(8), [1.0, 2.0], s)  # a pending step exists
    return s


def snapshot(state):
    return {k: v.clone() for k, v in state.state_dict().items()}


CASES = [
    # (kwargs, error type, message pattern)
    (dict(scores=torch.randn(8, 1)), ValueError, r"scores must be 1-D, got shape \(8, 1\)"),
    (dict(scores=torch.randn(9)), ValueError, r"scores has 9 entries.*expects 8"),
    (dict(scores=[torch.randn(3)]), ValueError, r"scores has 1 segments.*has 2"),
    (
        dict(scores=[torch.randn(3), torch.randn(4)]),
        ValueError,
        r"scores\[1\] \(segment 1\) has 4 entries.*n = 5",
    ),
    (
        dict(scores=[torch.randn(3), torch.randn(5, 1)]),
        ValueError,
        r"scores\[1\] \(segment 1\) must be 1-D",
    ),
    (dict(scores=torch.arange(8)), TypeError, r"scores has dtype torch.int64; allowed: float16"),
    (
        dict(scores=torch.randn(8, dtype=torch.complex64)),
        TypeError,
        r"scores has dtype torch.complex64",
    ),
    (dict(scores="abc"), TypeError, r"scores must be a 1-D tensor"),
    (
        dict(keep=[1.0, 6.0]),
        ValueError,
        r"keep\[1\] \(segment 1\) = 6.0 is outside the allowed range \[0, 5\]",
    ),
    (
        dict(keep=[-0.5, 2.0]),
        ValueError,
        r"keep\[0\] \(segment 0\) = -0.5 is outside the allowed range \[0, 3\]",
    ),
    (
        dict(keep=torch.tensor([float("nan"), 2.0])),
        ValueError,
        r"keep\[0\] \(segment 0\) = nan is outside",
    ),
    (dict(keep=[1.0]), ValueError, r"keep has 1 entries, one per segment is needed \(2\)"),
    (dict(keep=torch.tensor([1, 2])), TypeError, r"keep has dtype torch.int64"),
    (dict(keep=[1.0, "2"]), TypeError, r"keep\[1\] \(segment 1\) = '2' is not a real number"),
    (dict(eps=0.0), ValueError, r"eps\[0\] \(segment 0\) = 0.0; eps must be finite and > 0"),
    (
        dict(eps=[1.0, -2.0]),
        ValueError,
        r"eps\[1\] \(segment 1\) = -2.0; eps must be finite and > 0",
    ),
    (dict(eps=float("inf")), ValueError, r"eps\[0\] \(segment 0\) = inf"),
    (dict(eps=[1.0, 1.0, 1.0]), ValueError, r"eps has 3 entries, the state has 2 segments"),
    (dict(iters=0), ValueError, r"iters = 0; it must be an int >= 1"),
    (dict(iters=1.5), ValueError, r"iters = 1.5; it must be an int >= 1"),
    (dict(update="yes"), TypeError, r"update must be a bool"),
    (
        dict(nonfinite="zero"),
        ValueError,
        r"nonfinite = 'zero'; allowed: \['propagate', 'neutral'\]",
    ),
    (
        dict(backend="fast"),
        ValueError,
        r"backend = 'fast'; allowed: \['auto', 'reference', 'torch', 'cpu'",
    ),
    (dict(state=object()), TypeError, r"state must be a TransportState"),
]


@pytest.mark.parametrize("kwargs,error,pattern", CASES, ids=[c[2][:40] for c in CASES])
def test_bad_input_raises_and_leaves_state(state, kwargs, error, pattern):
    args = dict(scores=torch.randn(8), keep=[1.0, 2.0], state=state, eps=1.0, iters=1)
    args.update(kwargs)
    before = snapshot(state)
    with pytest.raises(error, match=pattern):
        transport_mask(**args)
    after = snapshot(state)
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_scores_on_another_device_than_state(state):
    meta_scores = torch.randn(8, device="meta")
    before = snapshot(state)
    with pytest.raises(ValueError, match=r"scores is on meta but the transport state is on cpu"):
        transport_mask(meta_scores, [1.0, 2.0], state)
    assert all(torch.equal(v, snapshot(state)[k]) for k, v in before.items())


def test_eps_requiring_grad_is_refused(state):
    with pytest.raises(ValueError, match="eps must not require grad"):
        transport_mask(torch.randn(8), [1.0, 2.0], state, eps=torch.ones(2, requires_grad=True))


def test_compiled_op_checks_its_own_inputs():
    """Calling torch.ops.dtp directly still gets range checks, not undefined behaviour."""
    pytest.importorskip("dtp_kernels._C")
    offsets = torch.tensor([0, 3, 8])
    scores, d, shift = torch.randn(8), torch.zeros(8), torch.zeros(2)
    eps = torch.ones(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"keep\[1\] = 6 is outside \[0, 5\]"):
        torch.ops.dtp.transport_mask(scores, offsets, torch.tensor([1.0, 6.0]), eps, d, shift, 1)
    with pytest.raises(
        RuntimeError, match=r"offsets must start at 0 and end at scores.numel\(\) = 8"
    ):
        torch.ops.dtp.transport_mask(
            scores, torch.tensor([0, 3, 7]), torch.tensor([1.0, 2.0]), eps, d, shift, 1
        )
    with pytest.raises(RuntimeError, match=r"iters must be >= 1"):
        torch.ops.dtp.transport_mask(scores, offsets, torch.tensor([1.0, 2.0]), eps, d, shift, 0)
