"""What the pipeline raises for a mistake in its input and for a run that cannot go on.

The command line prints either as one `error: ...` line: a UsageError (a recipe field,
an output directory, a file the user named) exits 2, a RunError (divergence, a write
that failed) exits 1.
"""

from __future__ import annotations


class UsageError(ValueError):
    """A mistake in what the user asked for, found before it could do harm."""


class RecipeError(UsageError):
    """A recipe field with a type, range or value that is not allowed."""


class RunError(RuntimeError):
    """A run that stopped because it could not go on correctly."""


class DivergedError(RunError):
    """A training loss that is not finite: the stage stops, its last checkpoint stays."""
