"""Pruning ratios: a float, a dict (module names, name patterns or kinds of group to
ratios), a list (one per stage), or the paper's strings.

"[0, 0.5, 0.5, 0.5]" gives one ratio per ResNet stage (first entry: the stem, then
layer1, layer2, ...); "[0:0, 1-15:0.5]" gives ratios per convolution index (the i-th
Conv2d of the model, 0-based; "a-b" is a range, both ends included), as in the paper's
appendix. A ratio p prunes ceil(n p) of a group's n channels and keeps at least one.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Mapping, Sequence

# what every pruner's `ratios` argument takes (the module docstring says how each reads)
Ratios = float | Mapping[str, float] | Sequence[float] | str


def kept_count(n: int, ratio: float) -> int:
    """Channels kept of n at pruning ratio p: n - ceil(n p), at least 1."""
    return max(1, n - math.ceil(n * ratio - 1e-9))


def check_ratio(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: ratio {value!r} is not a number")
    if not 0 <= value < 1:
        raise ValueError(f"{where}: ratio {value} is outside [0, 1)")
    return float(value)


def stage_of(name: str) -> int:
    """ResNet stage of a module name: 0 for the stem, i for layer{i}.*."""
    match = re.match(r"(?:.*\.)?layer(\d+)\.", name)
    return int(match.group(1)) if match else 0


def _number(item: str, text: str, what: str) -> float:
    try:
        return float(item)
    except ValueError:
        raise ValueError(f"ratios {text!r}: {item.strip()!r} is not {what}") from None


def parse_stage_list(text: str) -> list[float]:
    body = text.strip()[1:-1]
    return [
        check_ratio(_number(item, text, "a number"), f"ratios {text!r}, stage {i}")
        for i, item in enumerate(body.split(","))
    ]


def parse_layer_map(text: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for item in text.strip()[1:-1].split(","):
        span, colon, value = item.partition(":")
        lo, _, hi = span.strip().partition("-")
        if not colon or not re.fullmatch(r"\d+", lo) or not re.fullmatch(r"\d*", hi):
            raise ValueError(
                f"ratios {text!r}: {item.strip()!r} is not 'index:ratio' or 'a-b:ratio' "
                "(indices are integers >= 0)"
            )
        ratio = check_ratio(
            _number(value, text, "a ratio"), f"ratios {text!r}, entry {item.strip()!r}"
        )
        for index in range(int(lo), int(hi or lo) + 1):
            out[index] = ratio
    return out


def with_zeros(ratios: object, names: list[str]) -> dict | None:
    """The ratios that leave the groups `names` whole and prune the rest as `ratios`
    asks: a float p becomes {"*": p, name: 0, ...} (a name beats a pattern), a dict gains
    name: 0 entries; None for the per-stage and per-layer forms."""
    zeros = dict.fromkeys(names, 0)
    if isinstance(ratios, (int, float)) and not isinstance(ratios, bool):
        return {"*": ratios, **zeros}
    if isinstance(ratios, Mapping):
        return {**ratios, **zeros}
    return None


def check_ratio_syntax(ratios: object) -> None:
    """Raise TypeError/ValueError unless `ratios` is one of the accepted forms, with every
    ratio in [0, 1); what needs the model (names, stage and layer counts) is checked when
    the pruner resolves them."""
    if isinstance(ratios, Mapping):
        for key, value in ratios.items():
            if not isinstance(key, str):
                raise TypeError(f"ratios: key {key!r} is not a layer name, pattern or kind")
            check_ratio(value, f"ratios[{key!r}]")
    elif isinstance(ratios, (list, tuple)):
        if not ratios:
            raise ValueError("ratios: an empty per-stage list")
        for i, value in enumerate(ratios):
            check_ratio(value, f"ratios {list(ratios)!r}, stage {i}")
    elif isinstance(ratios, str):
        body = ratios.strip()
        if not (body.startswith("[") and body.endswith("]")):
            raise ValueError(f"ratios {ratios!r} is not '[p0, p1, ...]' or '[i:p, a-b:p]'")
        (parse_layer_map if ":" in body else parse_stage_list)(body)
    else:
        check_ratio(ratios, "ratios")


# conv output channels; linear layers' output features; attention heads; residual widths;
# the intermediate neurons of mixture-of-experts blocks' experts; Mamba mixers' inner
# channels; whole experts; linear attention's heads (Gated DeltaNet's, Kimi Delta
# Attention's)
KINDS = (
    "channels",
    "mlp",
    "heads",
    "coupled",
    "experts",
    "mamba",
    "whole_experts",
    "linear_attention",
)
# kinds pruned only when a dict names them (their kind or a group's exact name): a float,
# a pattern or a per-stage list leaves them whole (removing whole experts is a choice of
# its own, on top of the experts' neurons a float ratio already prunes)
OPT_IN_KINDS = ("whole_experts",)


def _key_for(name: str, ratios: Mapping, matched: dict, kind: str | None) -> str | None:
    """The dict key that gives group `name` its ratio: its name, else the first pattern
    matching it, else its kind; None when none does."""
    if name in ratios:
        return name
    for key in ratios:
        if key not in KINDS and name in matched[key]:
            return key
    return kind if kind in ratios else None


def resolve(
    ratios: Ratios,
    names: list[str],
    conv_index: dict[str, int],
    all_convs: int,
    kinds: dict[str, str],
) -> dict[str, float]:
    """Ratio of every group root (by module name); groups a dict does not reach get 0.

    A dict's keys are module names, fnmatch patterns over them ("layer3.*"), or a kind
    of group (KINDS: "channels": convolutions, "mlp": linear layers, "heads", "coupled",
    "experts", "mamba": Mamba mixers' inner channels, "whole_experts",
    "linear_attention": Gated DeltaNet's and Kimi Delta Attention's heads); a name beats a
    pattern, a pattern beats a kind. `kinds` maps each group name to its kind; groups of
    OPT_IN_KINDS get a ratio only from their name or their kind in a dict."""
    opt_in = [name for name in names if kinds.get(name) in OPT_IN_KINDS]
    if not isinstance(ratios, Mapping):
        names = [name for name in names if name not in opt_in]
    if isinstance(ratios, (int, float)) and not isinstance(ratios, bool):
        ratio = check_ratio(ratios, "ratios")
        return {name: ratio for name in names} | dict.fromkeys(opt_in, 0.0)
    if isinstance(ratios, Mapping):
        matched = {  # a pattern reaches no group of an opt-in kind
            key: [n for n in names if fnmatch.fnmatchcase(n, key) and (n == key or n not in opt_in)]
            for key in ratios
        }
        unknown = sorted(k for k in ratios if not matched[k] and k not in KINDS)
        if unknown:
            raise ValueError(
                f"ratios names {unknown}, which match no prunable layer of this model; "
                f"prunable: {names}; kinds: {list(KINDS)}"
            )
        # a kind asked to prune that the model has no group of would prune nothing silently
        found = set(kinds.values())
        absent = sorted(
            k
            for k in ratios
            if k in KINDS
            and not matched[k]
            and k not in found
            and check_ratio(ratios[k], f"ratios[{k!r}]") > 0
        )
        if absent:
            hints = {
                "heads": "attention layers are recognised in the forms docs/architectures.md lists",
                "coupled": "residual-coupled widths are groups only with prune_coupled=True",
                "experts": "experts are recognised in transformers' layout (docs/architectures.md)",
            }
            why = "; ".join(hints[k] for k in absent if k in hints)
            raise ValueError(
                f"ratios asks to prune {absent}, but this model has no group of that kind "
                f"(its groups' kinds: {sorted(found)}; prunable: {names})"
                f"{'. ' + why[0].upper() + why[1:] if why else ''}; set the ratio to 0 or "
                "leave the key out"
            )
        out = {}
        for name in names:
            key = _key_for(name, ratios, matched, kinds.get(name))
            out[name] = check_ratio(ratios[key], f"ratios[{key!r}]") if key else 0.0
        return out
    if isinstance(ratios, (list, tuple)):  # [0, 0.5, 0.5, 0.5]: the per-stage form
        ratios = (
            "[" + ", ".join(str(check_ratio(r, f"ratios {list(ratios)!r}")) for r in ratios) + "]"
        )
    if isinstance(ratios, str) and ratios.strip().startswith("[") and ratios.strip().endswith("]"):
        if ":" in ratios:
            per_layer = parse_layer_map(ratios)
            missing = sorted(i for i in per_layer if i >= all_convs or i < 0)
            if missing:
                raise ValueError(
                    f"ratios {ratios!r} names convolution indices {missing}, but the model has "
                    f"{all_convs} (0 to {all_convs - 1})"
                )
            return {name: per_layer.get(conv_index.get(name, -1), 0.0) for name in names} | (
                dict.fromkeys(opt_in, 0.0)
            )
        stages = parse_stage_list(ratios)
        # the model's stages, counted over every convolution (skipped ones included)
        present = max((stage_of(n) for n in [*names, *conv_index]), default=0)
        if len(stages) != present + 1:
            parts = "the stem" if present == 0 else f"the stem and layer1..layer{present}"
            raise ValueError(
                f"ratios {ratios!r} gives {len(stages)} stages, the model has {present + 1} "
                f"({parts})"
            )
        return {name: stages[stage_of(name)] for name in names} | dict.fromkeys(opt_in, 0.0)
    raise TypeError(
        f"ratios must be a float, a dict from layer name to ratio, or a string like "
        f"'[0, 0.5, 0.5, 0.5]' or '[0:0, 1-15:0.5]', got {ratios!r}"
    )
