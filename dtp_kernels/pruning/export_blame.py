"""Which pruned groups make an export fail its check.

When `DTPPruner.export()` finds that the physically smaller model fails on the example
inputs, or computes something other than the hard-masked model, the cause is usually a
few groups whose channels something outside them still counts at the old width (a
reshape to the input's shape, a table with an entry per channel). To name those groups
instead of the whole model's, the pruner exports again with only some groups pruned
(the others kept whole) and splits the set of pruned groups in halves while an export
fails: adaptive group testing, a few exports per culprit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# trial exports allowed on top of the failed one; each costs a copy of the model, a
# trace and a run of the example inputs
TRIAL_EXPORTS = 48


class _OutOfTrialsError(Exception):
    """The trials ran out before the culprits were narrowed down."""


def culprit_groups(
    candidates: Sequence[int],
    export_fails: Callable[[list[int]], bool | None],
    trials: int = TRIAL_EXPORTS,
) -> list[int] | None:
    """The candidates whose pruning alone makes the export fail, given that pruning all
    of them does.

    `export_fails(subset)` exports with only `subset` pruned: True if the check fails,
    False if it passes, None if the trial cannot tell (it failed another way). A set
    that fails while each of its halves passes is returned whole (its groups fail only
    together). None when a trial could not tell or `trials` ran out."""
    used = 0

    def fails(subset: list[int]) -> bool:
        nonlocal used
        if used == trials:
            raise _OutOfTrialsError
        used += 1
        verdict = export_fails(subset)
        if verdict is None:
            raise _OutOfTrialsError
        return verdict

    def narrow(subset: list[int]) -> list[int]:
        # `subset` is known to fail
        if len(subset) == 1:
            return subset
        half = len(subset) // 2
        found = []
        for part in (subset[:half], subset[half:]):
            if fails(part):
                found += narrow(part)
        return found or subset

    try:
        return narrow(list(candidates))
    except _OutOfTrialsError:
        return None
