"""Checkpoints written while DTP trains, named as the model was built: a masked weight's
state-dict key is "fc.parametrizations.weight.original"; renamed to "fc.weight" it loads
into the model before any pruner is made (a resumed run makes its pruner after the
weights load)."""

from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from .masking import is_mask


def unmasked_keys(model: nn.Module) -> dict[str, str]:
    """The state-dict keys of the parameters masks parametrize in `model`, each to the key
    it has without them ("fc.parametrizations.weight.original" to "fc.weight")."""
    keys = {}
    for name, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        prefix = f"{name}." if name else ""
        for tensor, plist in module.parametrizations.items():
            if all(is_mask(p) for p in plist):
                keys[f"{prefix}parametrizations.{tensor}.original"] = f"{prefix}{tensor}"
    return keys


def _save_unmasked(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    renamed = {prefix + key: prefix + new for key, new in unmasked_keys(module).items()}
    if renamed:  # in place, in the dict's order (a post hook's return value is ignored)
        items = [(renamed.get(key, key), value) for key, value in state_dict.items()]
        state_dict.clear()
        state_dict.update(items)


def _load_unmasked(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    # before the children read their keys: they read the renamed ones
    for key, new in unmasked_keys(module).items():
        if prefix + new in state_dict and prefix + key not in state_dict:
            state_dict[prefix + key] = state_dict.pop(prefix + new)


def name_weights_unmasked(model: nn.Module) -> list[RemovableHandle]:
    """Make ``model.state_dict()`` hold every masked weight under its key without the
    mask, and ``model.load_state_dict()`` take it so. Returns the hooks' handles."""
    return [
        model.register_state_dict_post_hook(_save_unmasked),
        model.register_load_state_dict_pre_hook(_load_unmasked),
    ]
