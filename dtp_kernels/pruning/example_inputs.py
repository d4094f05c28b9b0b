"""The example inputs a pruner runs the model on (to find its groups, prove them, count
its cost and check the export): a tensor, a tuple of positional arguments, or a dict of
keyword arguments (a Hugging Face processor's output: input ids with pixel values and
image grids), kept as one `ExampleInputs` and run by `call_model`; `on_model_device` moves them to
where the model is now (a pruner is often built on the CPU and moved with its model)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .precision import HALF


class ExampleInputs(tuple):
    """The positional example inputs (the tuple itself), with the keyword ones in
    `kwargs`; true when either holds anything."""

    kwargs: dict

    def __new__(cls, args: tuple = (), kwargs: Mapping | None = None) -> ExampleInputs:
        inputs = super().__new__(cls, args)
        inputs.kwargs = dict(kwargs or {})
        return inputs

    def __bool__(self) -> bool:
        return len(self) > 0 or bool(self.kwargs)

    def __repr__(self) -> str:
        return f"ExampleInputs(args={tuple(self)!r}, kwargs={self.kwargs!r})"


def as_example_inputs(value: object) -> ExampleInputs:
    """`value` as example inputs: a dict's items as keyword arguments (its keys must be
    strings), a tuple's as positional ones, anything else as the one positional input."""
    if isinstance(value, ExampleInputs):
        return value
    if isinstance(value, Mapping):
        names = [key for key in value if not isinstance(key, str)]
        if names:
            raise TypeError(
                f"example_inputs: a dict's keys are the model's keyword arguments, so they "
                f"must be strings; got {names[:3]}"
            )
        return ExampleInputs((), value)
    return ExampleInputs(value if isinstance(value, tuple) else (value,))


def call_model(model: nn.Module, inputs: tuple):
    """`model` run on example inputs (an ExampleInputs, or a plain tuple of positional
    ones)."""
    return model(*inputs, **getattr(inputs, "kwargs", {}))


def _mapped(value: Any, change: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with `change` applied to every tensor in it (through tuples, lists and
    dicts): of `value`'s own type."""
    if isinstance(value, torch.Tensor):
        return change(value)
    if isinstance(value, Mapping):
        return {key: _mapped(item, change) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        items = [_mapped(item, change) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _moved(value: Any, device: torch.device) -> Any:
    """`value` with every tensor in it (through tuples, lists and dicts) on `device`."""
    return _mapped(value, lambda tensor: tensor.to(device))


def in_float32(inputs: ExampleInputs) -> ExampleInputs:
    """`inputs` with their half-precision tensors in float32 (images, embeddings), for a
    model run with float32 weights."""

    def widen(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.float() if tensor.dtype in HALF else tensor

    return ExampleInputs(_mapped(tuple(inputs), widen), _mapped(inputs.kwargs, widen))


def model_device(model: nn.Module) -> torch.device | None:
    """The device of the model's first parameter or buffer; None when it has neither."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return None


def on_model_device(inputs: object, model: nn.Module) -> ExampleInputs:
    """`inputs` as example inputs whose tensors are on `model`'s device (the same tensors
    where they are already there; their dtypes unchanged)."""
    inputs = as_example_inputs(inputs)
    device = model_device(model)
    if device is None:
        return inputs
    return ExampleInputs(_moved(tuple(inputs), device), _moved(inputs.kwargs, device))
