"""Property-based tests (hypothesis, issue 8): random segment layouts (1 to 64 segments
of 1 to 5000 channels, k = 0, k = n or any k at least 1e-9 from both), scores up to 1e4
in magnitude, eps from 1e-3 to 1e2. Outputs are finite, every segment's mask sums to its
k, and every backend present equals the literal reference, over a step and the next
warm-started one."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtp_kernels import TransportState, transport_mask
from utils import ALL_CPU_BACKENDS

pytestmark = pytest.mark.slow  # end to end or long: `make test-fast` leaves it out

BACKENDS = [b for b in ALL_CPU_BACKENDS if b != "reference"]


@st.composite
def problems(draw):
    nseg = draw(st.integers(1, 64))
    # Mostly small segments, some large: the total stays test-sized.
    sizes = draw(
        st.lists(st.one_of(st.integers(1, 40), st.integers(41, 5000)), min_size=nseg, max_size=nseg)
    )
    if sum(sizes) > 40_000:
        sizes = [min(n, 40) for n in sizes]
    # k = 0 or n exactly, or at least 1e-9 away from both: a k of 1e-300 keeps no channel
    # representably (the mask underflows to 0) and is left out (README, "Guarantees").
    keep = [
        draw(st.one_of(st.sampled_from([0.0, float(n)]), st.floats(1e-9, max(1e-9, n - 1e-9))))
        for n in sizes
    ]
    magnitude = draw(st.sampled_from([1e-3, 1.0, 1e2, 1e4]))
    eps = draw(st.floats(1e-3, 1e2))
    seed = draw(st.integers(0, 2**31 - 1))
    return sizes, keep, magnitude, eps, seed


# Derandomized: the same 40 examples every run, so CI is reproducible; set
# HYPOTHESIS_EXPLORE=1 to draw new ones.
EXPLORE = os.environ.get("HYPOTHESIS_EXPLORE") == "1"


@settings(
    max_examples=40,
    deadline=None,
    derandomize=not EXPLORE,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(problems())
def test_every_backend_equals_the_reference_on_random_problems(problem):
    sizes, keep, magnitude, eps, seed = problem
    gen = torch.Generator().manual_seed(seed)
    scores = [
        (torch.rand(sum(sizes), generator=gen, dtype=torch.float64) * 2 - 1) * magnitude
        for _ in range(2)
    ]  # two steps
    keep_t = torch.tensor(keep, dtype=torch.float64)
    states = {b: TransportState(sizes, dtype=torch.float64) for b in ["reference", *BACKENDS]}
    for step_scores in scores:
        masks = {}
        for backend, state in states.items():
            mask = transport_mask(step_scores, keep_t, state, eps=eps, backend=backend)
            state.commit()
            assert torch.isfinite(mask).all(), backend
            assert torch.isfinite(state.log_odds).all() and torch.isfinite(state.shift).all()
            sums = torch.stack([m.sum() for m in mask.split(sizes)])
            torch.testing.assert_close(sums, keep_t, rtol=1e-9, atol=1e-7, msg=backend)
            masks[backend] = mask
        # The literal algorithm works with log-plan entries as large as the log-odds
        # x = (2s - 1) / eps plus the carried state, up to 4e7 here; its float64 sums then
        # lose about 1e-7 per 1e4 of |x| (seen: 2e-5 relative at |x| = 2e7, where the
        # closed form gives exactly k / 13 for 13 saturated channels). The closed-form
        # backends agree with each other to 1e-9 regardless.
        spread = max(1.0, (2 * magnitude + 1) / eps / 1e4) * 2
        rtol = 1e-7 * spread
        # A k within 1e-9 of 0 or n is ill-conditioned: the rounding of k alone (about
        # 1e-16 n) moves log k - log(n - k) by 1e-16 n / min(k, n - k), 5e-4 at n = 5000,
        # and the reference and the closed form round it differently.
        condition = torch.tensor(
            [n / min(k, n - k) if 0 < k < n else 1.0 for n, k in zip(sizes, keep, strict=True)],
            dtype=torch.float64,
        ).repeat_interleave(torch.tensor(sizes))
        allowed = rtol + 1e-15 * condition
        for backend in BACKENDS:
            error = (masks[backend] - masks["reference"]).abs()
            bound = allowed * masks["reference"].abs() + 1e-9 * spread
            worst = int((error - bound).argmax())
            assert bool((error <= bound).all()), (
                f"{backend} vs ref: element {worst} differs by {float(error[worst]):.3g}, "
                f"allowed {float(bound[worst]):.3g}"
            )
            torch.testing.assert_close(
                masks[backend],
                masks[BACKENDS[0]],
                rtol=1e-9,
                atol=1e-12,
                msg=f"{backend} vs {BACKENDS[0]}",
            )
    for backend in BACKENDS:
        seg_condition = torch.tensor(
            [n / min(k, n - k) if 0 < k < n else 1.0 for n, k in zip(sizes, keep, strict=True)],
            dtype=torch.float64,
        )
        shift_error = (states[backend].shift - states["reference"].shift).abs()
        shift_bound = (rtol + 1e-15 * seg_condition) * states["reference"].shift.abs()
        assert bool((shift_error <= shift_bound + 1e-7 * spread).all()), f"{backend} shift"
