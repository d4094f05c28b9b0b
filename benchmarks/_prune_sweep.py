"""What the architecture sweeps (hf_prune_check.py, timm_prune_check.py) share: pruning
as a user would after a refusal (the float ratio first, then the ratios or the layers
left whole that the refusal names, as its message gives them, or prune_coupled=True
where it says that residual-coupled widths are groups only so), a time limit per
architecture, and the results table."""

from __future__ import annotations

import ast
import signal
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner

TRIES = 4  # the float, then as the refusals say
# how a refusal names the layers whose search for coupled channels fails
IGNORED = "(the modules named "
# how a refusal says that residual-coupled widths would be groups
COUPLED = "prune_coupled=True"


@dataclass
class Pruned:
    """A model pruned and exported: the pruner, the hard-masked model's output `want`,
    the export, how it was reached (`result`, the `ratios`, the `ignored` layer names
    and whether with prune_coupled=True), and what `before_export` gave."""

    pruner: DTPPruner
    want: torch.Tensor
    exported: nn.Module
    result: str
    ratios: float | dict
    ignored: list[str]
    before: object
    coupled: bool = False


@dataclass
class Refused:
    """The refusals of a model none of whose tries succeeded, the first and the last."""

    first: ValueError
    last: ValueError

    def why(self, length: int = 160) -> str:
        """The first refusal's first words and, after it was followed, the last's."""
        said = first_words(self.first, length)
        if self.last is not self.first:
            said += f"; then: {first_words(self.last, length)}"
        return said


def first_words(error: Exception, length: int = 160) -> str:
    """The error's message on one line, cut to `length` characters, no table bars."""
    return " ".join(str(error).split())[:length].replace("|", "/")


def prune_as_refusals_say(
    model: nn.Module,
    inputs: tuple | dict,
    ratio: float,
    output: Callable[[nn.Module], torch.Tensor],
    before_export: Callable[[DTPPruner], object] | None = None,
) -> Pruned | Refused:
    """`model` pruned at `ratio` with random scores and exported, its hard-masked
    `output` taken before; after a refusal naming the ratios or the layers to leave
    whole, or saying that prune_coupled=True would find groups, pruned again so, up to
    TRIES times. The refusals where none succeeds."""
    result, ratios, ignored, coupled = "pruned", ratio, [], False
    refusals: list[ValueError] = []
    for _ in range(TRIES):
        pruner = None
        try:
            layers = [model.get_submodule(name) for name in ignored]
            pruner = DTPPruner(model, inputs, ratios, ignored_layers=layers, prune_coupled=coupled)
            with torch.no_grad():
                pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
                with pruner.hard_masked():
                    want = output(model)
            before = before_export(pruner) if before_export else None
            exported = pruner.export().eval()
            return Pruned(pruner, want, exported, result, ratios, ignored, before, coupled)
        except ValueError as error:
            refusals.append(error)
            if pruner is not None:  # refused by its export: the model as it was
                pruner.remove()
            text = str(error)
            if "ratios={" in text:
                ratios = ast.literal_eval(text.rsplit("ratios=", 1)[1])
                result = result if ignored else "pruned with the refusal's ratios"
            elif IGNORED in text:
                ignored += ast.literal_eval(text.rsplit(IGNORED, 1)[1].removesuffix(")"))
                result = "pruned with the refusal's layers left whole"
            elif COUPLED in text and not coupled:
                coupled = True
                result = "pruned with prune_coupled=True"
            else:
                break
    return Refused(refusals[0], refusals[-1])


class _ExpiredError(BaseException):
    """Raised by the timer; not an Exception, so no `except Exception` takes it."""


def _expire(*_) -> None:
    raise _ExpiredError


def row_within(
    seconds: int, expired: list[str], check: Callable[..., list[str]], *args
) -> list[str]:
    """`check(*args)`'s table row, or `expired` where it runs over `seconds`."""
    signal.signal(signal.SIGALRM, _expire)
    signal.alarm(seconds)
    try:
        return check(*args)
    except _ExpiredError:
        return expired
    finally:
        signal.alarm(0)


def table(header: list[str], rows: list[list[str]], status: int, what: str) -> list[str]:
    """The markdown lines of the results: a count per status (column `status` of each
    row) of the `what` checked, then the table."""
    statuses = [row[status] for row in rows]
    summary = ", ".join(f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses))
    return [
        f"{len(rows)} {what}: {summary}.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
        *("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows),
    ]
