"""The exported sizes written into a Hugging Face model's config, so that
``save_pretrained`` / ``from_pretrained`` rebuild the pruned model.

A config holds one size per kind for all layers (heads, key/value heads, head_dim,
intermediate_size); a composite model's parts hold theirs in its sub-configs (a
vision-language model's `text_config` and `vision_config`), each written with the groups
inside that part. A model whose config holds sizes per layer (transformers' heterogeneous
configs, `per_layer_config`: Gemma 4's full-attention layers have their own head_dim)
gets them layer by layer where one size for all cannot describe it, in its own config or
a part's sub-config; a field holding one MLP width per layer (Gemma 3n's
intermediate_size) gets each pruned layer's. The new values are kept only when a model
built from the updated config (on the meta device: no memory) has exactly the exported
model's shapes; otherwise the config is left as it was, with a warning (the exported
model itself is right; dtp_kernels.save_pruned saves it).
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# the config field of an MLP's hidden width, by family: most; OPT; GPT-2 (when set);
# DistilBERT; T5; Falcon; CTRL; XLNet and Funnel
MLP_FIELDS = (
    "intermediate_size",
    "ffn_dim",
    "n_inner",
    "hidden_dim",
    "d_ff",
    "ffn_hidden_size",
    "dff",
    "d_inner",
)
# an encoder-decoder's MLP widths, a field per side (BART, Marian, Whisper; TrOCR's
# decoder), by the module name's part
SIDE_MLP_FIELDS = {"encoder": "encoder_ffn_dim", "decoder": "decoder_ffn_dim"}
# the experts' width: its own field where the family has dense MLPs too (Qwen3-MoE,
# DeepSeek), else the MLP's (Mixtral, OLMoE, GPT-OSS), or a sub-config's (DBRX's
# ffn_config); the one holding the experts' width
EXPERT_FIELDS = ("moe_intermediate_size", "intermediate_size", "ffn_config.ffn_hidden_size")
# the module name of a shared expert and its config field
SHARED_EXPERT, SHARED_EXPERT_FIELD = "shared_expert.", "shared_expert_intermediate_size"
# the number of experts per block
COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


# the config field of a low-rank layer's rank, by the rank's first layer's name: Gemma
# 3n's learned augmented residual (LAuReL); DeepSeek-V4's compressed query (through its
# RMS norm: channel_rms_norms.py)
RANK_FIELDS = {"laurel.linear_left": "laurel_rank", "self_attn.q_a_proj": "q_lora_rank"}


# a group's decoder layer by its module name ("model.layers.3.self_attn")
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# a field left None for a width of a multiple of the hidden size: GPT-2's n_inner (its
# pretrained configs' null: 4 x n_embd), GPT-Neo's intermediate_size
UNSET_MLP_FIELDS = {"n_inner": ("n_embd", 4), "intermediate_size": ("hidden_size", 4)}


def _get(config, field: str):
    """`config`'s field, a dotted one read in its sub-config ("ffn_config.ffn_hidden_size")."""
    for name in field.split("."):
        config = getattr(config, name, None)
    return config


def _set(config, field: str, value) -> None:
    """Set `config`'s field, a dotted one in its sub-config."""
    *path, name = field.split(".")
    for part in path:
        config = getattr(config, part)
    setattr(config, name, value)


def _mlp_field(config) -> str | None:
    return next((f for f in MLP_FIELDS if isinstance(_mlp_width(config, f), int)), None)


def _mlp_width(config, field: str) -> int | None:
    """The MLP width `field` of `config` says, the default where it is unset (None)."""
    value = getattr(config, field, None)
    if value is None and field in UNSET_MLP_FIELDS and hasattr(config, field):
        hidden, times = UNSET_MLP_FIELDS[field]
        width = getattr(config, hidden, None)
        return width * times if isinstance(width, int) else None
    return value


def _mlp_widths_field(config) -> str | None:
    """The MLP field holding one width per layer (Gemma 3n's intermediate_size), or None."""
    layers = getattr(config, "num_hidden_layers", None)
    return next(
        (
            f
            for f in MLP_FIELDS
            if isinstance(widths := getattr(config, f, None), list)
            and len(widths) == layers
            and all(isinstance(w, int) for w in widths)
        ),
        None,
    )


def _per_layer_widths(config, field: str, mlps: list[tuple[Any, int]]) -> list[int]:
    """`config`'s list of MLP widths per layer with each pruned layer's kept width, from
    the groups of `mlps` named in a layer and as wide as its MLP (others, another
    module's hidden width, are left to the rebuild check)."""
    widths = list(getattr(config, field))
    for group, kept in mlps:
        found = LAYER_INDEX.search(group.name)
        index = int(found.group(1)) if found else -1
        if 0 <= index < len(widths) and widths[index] == group.size:
            widths[index] = kept
    return widths


def _uniform(kept: list[int]) -> int | None:
    return kept[0] if kept and len(set(kept)) == 1 else None


def config_fields(config, groups: list[tuple[str, Any]], masks: list) -> dict | None:
    """The config fields the exported sizes need; None when one size per kind cannot
    describe them (layers pruned to different sizes)."""
    heads = [
        (g, int(m.sum())) for (kind, g), m in zip(groups, masks, strict=True) if kind == "heads"
    ]
    mlp_field = _mlp_field(config)
    shared = [  # the shared expert beside the routed ones (Qwen2-MoE's, Qwen3-Next's)
        int(m.sum())
        for (kind, g), m in zip(groups, masks, strict=True)
        if kind == "mlp" and SHARED_EXPERT in g.name and hasattr(config, SHARED_EXPERT_FIELD)
    ]
    mlps = [
        int(m.sum())
        for (kind, g), m in zip(groups, masks, strict=True)
        if kind == "mlp"
        and mlp_field is not None
        and g.size == _mlp_width(config, mlp_field)
        and not (shared and SHARED_EXPERT in g.name)
    ]
    fields: dict[str, Any] = {}
    if heads:
        units = _uniform([k for _, k in heads])
        per_unit = _uniform([g.query_heads_per_unit for g, _ in heads])
        # multi-query: 1; DiffLlama's pairs: 2 a unit
        kv_heads = _uniform([1 if g.shared_kv else k * g.kv_heads_per_unit for g, k in heads])
        # whether every attention layer was pruned is left to the rebuild check (a hybrid
        # model's attention is one layer in a few: Jamba's)
        if units is None or per_unit is None or kv_heads is None:
            return None
        fields["num_attention_heads"] = units * per_unit
        if not any(g.latent for g, _ in heads):  # latent attention keeps the config's
            fields["head_dim"] = heads[0][0].head_dim
        if hasattr(config, "num_key_value_heads"):
            fields["num_key_value_heads"] = kv_heads
    if mlps and mlp_field is not None:  # whether every MLP was pruned is left to the
        # rebuild check (DeepSeek's first layers are dense, the others mixtures of experts)
        size = _uniform(mlps)
        if size is None:
            return None
        fields[mlp_field] = size
    for side, field in SIDE_MLP_FIELDS.items():
        width = getattr(config, field, None)
        kept = [
            int(m.sum())
            for (kind, g), m in zip(groups, masks, strict=True)
            if kind == "mlp" and f".{side}." in f".{g.name}" and g.size == width
        ]
        if kept:  # whether every layer of the side was pruned is left to the rebuild check
            if (size := _uniform(kept)) is None:
                return None
            fields[field] = size
    widths_field = None if mlp_field else _mlp_widths_field(config)
    if widths_field is not None:  # one width per layer: each layer's own
        pruned = [
            (g, int(m.sum())) for (kind, g), m in zip(groups, masks, strict=True) if kind == "mlp"
        ]
        fields[widths_field] = _per_layer_widths(config, widths_field, pruned)
    if shared:
        size = _uniform(shared)
        if size is None:
            return None
        fields[SHARED_EXPERT_FIELD] = size
    for suffix, field in RANK_FIELDS.items():
        ranks = [
            int(m.sum())
            for (kind, g), m in zip(groups, masks, strict=True)
            if kind == "mlp" and g.name.endswith(suffix) and g.size == getattr(config, field, -1)
        ]
        if ranks:  # whether every such layer was pruned is left to the rebuild check
            if (rank := _uniform(ranks)) is None:
                return None
            fields[field] = rank
    linear = [
        int(m.sum())
        for (kind, _), m in zip(groups, masks, strict=True)
        if kind == "linear_attention"
    ]
    if linear:  # Gated DeltaNet: key heads, each with as many value heads as before
        keys = _uniform(linear)
        per_key = _uniform(
            [g.query_heads_per_unit for kind, g in groups if kind == "linear_attention"]
        )
        if keys is None or per_key is None:
            return None
        if hasattr(config, "linear_num_heads") and per_key == 1:  # Kimi Delta Attention
            fields["linear_num_heads"] = keys
        else:
            fields |= {"linear_num_key_heads": keys, "linear_num_value_heads": keys * per_key}
    mixers = [int(m.sum()) for (kind, _), m in zip(groups, masks, strict=True) if kind == "mamba"]
    if mixers:
        found = _mamba_fields(config, groups, _uniform(mixers))
        if found is None:
            return None
        fields |= found
    experts = [
        (g, int(m.sum())) for (kind, g), m in zip(groups, masks, strict=True) if kind == "experts"
    ]
    if experts:  # whether every block was pruned is left to the rebuild check
        width = experts[0][0].size
        expert_field = next((f for f in EXPERT_FIELDS if _get(config, f) == width), None)
        size = _uniform([kept for _, kept in experts])
        if expert_field is None or size is None or fields.get(expert_field, size) != size:
            return None
        fields[expert_field] = size
    whole = [
        (g, int(m.sum())) for (k, g), m in zip(groups, masks, strict=True) if k == "whole_experts"
    ]
    if whole:  # whether every block was pruned is left to the rebuild check
        size = _uniform([kept for _, kept in whole])
        count_field = next(
            (f for f in COUNT_FIELDS if getattr(config, f, None) == whole[0][0].size), None
        )
        if count_field is None or size is None:
            return None
        fields[count_field] = size
    return fields


def _mamba_fields(config, groups: list[tuple[str, Any]], kept: int | None) -> dict | None:
    """The config field of the Mamba mixers' inner width: intermediate_size (Mamba,
    FalconMamba), or the expansion over hidden_size (Jamba's mamba_expand) when the kept
    width is a whole multiple of it; None when no field describes `kept`."""
    width = next(g.size for kind, g in groups if kind == "mamba")
    if kept is None:
        return None
    if getattr(config, "intermediate_size", None) == width:
        return {"intermediate_size": kept}
    hidden = getattr(config, "hidden_size", None)
    for name in ("mamba_expand", "expand"):
        expand = getattr(config, name, None)
        if isinstance(expand, int) and isinstance(hidden, int) and expand * hidden == width:
            return {name: kept // hidden} if kept % hidden == 0 else None
    return None


def _shapes(model: nn.Module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _transformers_config(model: nn.Module):
    """`model.config` when it is a transformers config, else None."""
    config = getattr(model, "config", None)
    return config if config is not None and hasattr(config, "to_dict") else None


def describes(model: nn.Module) -> bool:
    """Whether `model.config` (a transformers config) builds a model of `model`'s class
    with its parameter and buffer shapes: what save_pretrained's files need to load."""
    config = _transformers_config(model)
    return config is not None and _rebuilds(model, config)


# whether a model built from a config is the one wanted (`_rebuilds`)
Matches = Callable[[nn.Module], bool]


def _rebuilds(model: nn.Module, config, matches: Matches | None = None) -> bool:
    """Whether a model built from `config` has `model`'s parameter and buffer shapes (or,
    given `matches`, is matched by it)."""
    try:
        if hasattr(config, "validate"):
            config.validate()
        with torch.device("meta"):
            fresh = type(model)(copy.deepcopy(config))
    except Exception:
        return False
    return matches(fresh) if matches is not None else _shapes(fresh) == _shapes(model)


def _unexplained(model: nn.Module, config, writes: list[tuple[Any, dict]]) -> list[str]:
    """The modules of `model` whose parameter or buffer shapes a model built from
    `config` with `writes` made (to it or its parts' configs) would not have, in order;
    [] where that model cannot be built."""
    keys = {id(getattr(config, k, None)): k for k in getattr(config, "sub_configs", None) or {}}
    try:
        trial = copy.deepcopy(config)
        for target, fields in writes:
            dest = trial if target is config else getattr(trial, keys[id(target)])
            for name, value in fields.items():
                _set(dest, name, value)
        with torch.device("meta"):
            fresh = _shapes(type(model)(trial))
    except Exception:  # a config refusing the sizes, or a part not found by its key
        return []
    exported = _shapes(model)
    differ = [n for n in exported if fresh.get(n) != exported[n]]
    return list(dict.fromkeys(n.rpartition(".")[0] for n in differ))


def _parts(model: nn.Module, config) -> list[tuple[str, Any]]:
    """(module name, config) of each part of a composite model that holds one of its
    config's sub-configs as its own (a vision-language model's vision tower and language
    model: `vision_config`, `text_config`), outermost first; [] for a model of one
    config."""
    subs = [getattr(config, key, None) for key in getattr(config, "sub_configs", None) or {}]
    subs = [sub for sub in subs if sub is not None]
    parts: list[tuple[str, Any]] = []
    for name, module in model.named_modules():
        own = getattr(module, "config", None)
        inside = any(name.startswith(f"{prefix}.") for prefix, _ in parts)
        if name and not inside and any(own is sub for sub in subs):
            parts.append((name, own))
    return parts


def _assignments(model: nn.Module, config, groups: list) -> list[tuple[Any, list[int]]]:
    """(config, the indices of its groups) for each config the exported sizes go to:
    each part's sub-config for the groups inside that part, the model's config (last)
    for the rest."""
    rest = list(range(len(groups)))
    assigned = []
    for prefix, sub in _parts(model, config):
        mine = [i for i in rest if groups[i][1].name.startswith(f"{prefix}.")]
        rest = [i for i in rest if i not in mine]
        assigned.append((sub, mine))
    return [*assigned, (config, rest)]


def _writes(model: nn.Module, config, groups: list, masks: list) -> list[tuple[Any, dict | None]]:
    """(config, its fields) for each config the exported sizes go to (`_assignments`)."""
    writes = []
    for target, indices in _assignments(model, config, groups):
        if indices or target is config:
            fields = config_fields(
                target, [groups[i] for i in indices], [masks[i] for i in indices]
            )
            writes.append((target, fields))
    return writes


def _per_layer_fields(config, groups: list, masks: list) -> tuple[dict, dict] | None:
    """(global fields, per-layer overrides) for a config that holds sizes per layer
    (transformers' heterogeneous configs: Gemma 4's full-attention layers have their own
    head_dim): each decoder layer's fields from its own config; a field is written per
    layer where the layer already overrides it or where the layers differ, else once
    for all. None when a group is in no numbered layer or a layer's sizes fit no field."""
    spec = config.__dict__.get("_heterogeneity_spec")
    existing = copy.deepcopy(spec.per_layer_overrides) if spec is not None else {}
    members: dict[int, list[int]] = {}
    for i, (_, group) in enumerate(groups):
        found = LAYER_INDEX.search(group.name)
        if found is None:
            return None
        members.setdefault(int(found.group(1)), []).append(i)
    per_layer = {}
    for layer, indices in members.items():
        own = config.per_layer_config[layer]
        fields = config_fields(own, [groups[i] for i in indices], [masks[i] for i in indices])
        if fields is None:
            return None
        per_layer[layer] = fields
    shared, overrides = {}, existing
    for field in {f for fields in per_layer.values() for f in fields}:
        values = {layer: fields[field] for layer, fields in per_layer.items() if field in fields}
        free = {}
        for layer, value in values.items():
            if field in existing.get(layer, {}):
                overrides[layer][field] = value
            else:
                free[layer] = value
        if len(set(free.values())) == 1:
            shared[field] = next(iter(free.values()))
        else:
            for layer, value in free.items():
                overrides.setdefault(layer, {})[field] = value
    return shared, overrides


def _write_per_layer(
    model: nn.Module, config, groups: list, masks: list, matches: Matches | None
) -> bool:
    """Write the exported sizes layer by layer (`_per_layer_fields`) into each config
    they go to (`_assignments`) when a model built from the result matches; the configs
    are unchanged otherwise."""
    keys = {id(getattr(config, k, None)): k for k in getattr(config, "sub_configs", None) or {}}
    trial = copy.deepcopy(config)
    writes = []  # (the config, its copy in `trial`, shared fields, per-layer overrides)
    try:
        for target, indices in _assignments(model, config, groups):
            if not indices:
                continue
            found = _per_layer_fields(
                target, [groups[i] for i in indices], [masks[i] for i in indices]
            )
            if found is None:
                return False
            copied = trial if target is config else getattr(trial, keys[id(target)])
            writes.append((target, copied, *found))
        for _, copied, shared, overrides in writes:
            _set_sizes(copied, shared, overrides)
        if not _rebuilds(model, trial, matches):
            return False
    except Exception:  # a config without per-layer sizes, or whose checks refuse them
        return False
    for target, _, shared, overrides in writes:
        _set_sizes(target, shared, overrides)
    return True


def _set_sizes(config, shared: dict, overrides: dict) -> None:
    """Write `shared` fields for all layers and `overrides` layer by layer."""
    for name, value in shared.items():
        _set(config, name, value)
    if overrides or config.__dict__.get("_heterogeneity_spec") is not None:
        config.per_layer_config = overrides


def update_config(
    model: nn.Module,
    groups: list[tuple[str, Any]],
    masks: list,
    matches: Matches | None = None,
) -> bool:
    """Write the exported sizes into `model.config` (and, for a composite model, each
    part's sub-config) when a model built from it matches; whether the config describes
    the exported model (False without a config). A model built from the config matches
    when it has `model`'s shapes, or, given `matches` (a prediction made on the unpruned
    model: `predicts_described`), when `matches` accepts it; then nothing is warned."""
    config = _transformers_config(model)
    if config is None:
        return False
    # a group keeping all its units changes no size: nothing of it is written (Falcon's
    # read-only head_dim; MiMo's sliding-window layers' own head count, their heads whole)
    cut = [i for i, mask in enumerate(masks) if not bool(mask.all())]
    groups, masks = [groups[i] for i in cut], [masks[i] for i in cut]
    writes = _writes(model, config, groups, masks)
    described = [fields for _, fields in writes]
    complete = [(target, fields) for target, fields in writes if fields is not None]
    if all(fields == {} for fields in described) and _rebuilds(model, config, matches):
        return True
    before = []  # (config, field, value) to restore
    if len(complete) == len(writes):  # None: no one size per kind; all {}: not rebuilt
        try:
            for target, fields in complete:
                for name, value in fields.items():
                    current = _get(target, name)
                    # one per stage (SegFormer's heads), unless written as a list of as many
                    # (Gemma 3n's MLP widths, one per layer)
                    if isinstance(current, (list, tuple)) and not (
                        isinstance(value, list) and len(value) == len(current)
                    ):
                        raise TypeError(f"{name} holds one value per stage")
                    # a read-only field (Falcon's head_dim) raises, as does a value a
                    # config's own checks refuse
                    _set(target, name, value)
                    before.append((target, name, current))
            if _rebuilds(model, config, matches):
                return True
        except Exception:  # any refusal of a write leaves the config as it was
            pass
        for target, name, value in reversed(before):
            _set(target, name, value)
    if _write_per_layer(model, config, groups, masks, matches):
        return True
    if matches is not None:
        return False
    fields = {k: v for f in described if f for k, v in f.items()}
    if None in described:
        why = (
            "no field of it holds them: layers pruned to different sizes, a width no field "
            "holds, or a Mamba-2 mixer's norm epsilon, rescaled in each layer"
        )
    else:
        layers = _unexplained(model, config, complete)
        named = f": {layers[:4]}{' ...' if len(layers) > 4 else ''}" if layers else ""
        why = (
            f"a model built from the updated config {fields} would not have the exported "
            f"shapes{named}; a ratio of 0 for those layers' groups keeps a config that does"
        )
    warnings.warn(
        f"the exported model's config cannot describe its sizes ({why}); the config is "
        "unchanged. The model is right; save it with dtp_kernels.save_pruned, not "
        "save_pretrained",
        UserWarning,
        stacklevel=3,
    )
    return False


def _configs_within(config) -> list:
    """`config` and the configs its fields hold, theirs too (a composite model's parts'
    sub-configs; DBRX's ffn_config)."""
    found = [config]
    for value in vars(config).values():
        if hasattr(value, "to_dict") and hasattr(value, "sub_configs"):
            found += [c for c in _configs_within(value) if all(c is not f for f in found)]
    return found


def predicts_described(
    model: nn.Module, groups: list[tuple[str, Any]], masks: list, params_after: int
) -> bool | None:
    """Whether the export of `model` (unpruned) with `masks` will have a config that
    describes it, before any export: update_config run on `model`'s own config, a model
    built from the updated config matching when it has `params_after` parameters (the
    pruner's prediction of the export's: exact, the sweeps check it). The config and its
    parts' sub-configs are given back their fields afterwards. None without a
    transformers config."""
    config = _transformers_config(model)
    if config is None:
        return None
    configs = _configs_within(config)
    keep = {id(c): c for c in configs}  # the configs stay the objects the modules hold
    saved = [(c, copy.deepcopy(vars(c), dict(keep))) for c in configs]

    def matches(fresh: nn.Module) -> bool:
        return sum(p.numel() for p in fresh.parameters()) == params_after

    try:
        return update_config(model, groups, masks, matches)
    finally:
        for c, fields in saved:
            vars(c).clear()
            vars(c).update(fields)
