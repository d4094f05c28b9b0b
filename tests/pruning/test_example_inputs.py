"""Example inputs moved to the model's device: every tensor, through tuples, lists,
named tuples and dicts, keeping dtypes and leaving everything else as it is."""

from collections import namedtuple

import torch
from torch import nn

from dtp_kernels.pruning.example_inputs import ExampleInputs, model_device, on_model_device

Pair = namedtuple("Pair", "first second")


def test_every_tensor_goes_to_the_models_device_with_its_dtype():
    model = nn.Linear(2, 2, device="meta")
    ids = torch.arange(4)
    inputs = ExampleInputs(
        (torch.ones(2), [ids, 3], Pair(ids, "text")),
        {"attention_mask": torch.ones(1, 4, dtype=torch.bool), "nested": {"x": ids}, "n": 5},
    )
    moved = on_model_device(inputs, model)
    (tensor, (listed, three), pair), kwargs = tuple(moved), moved.kwargs
    assert isinstance(moved, ExampleInputs)
    assert tensor.device.type == listed.device.type == pair.first.device.type == "meta"
    assert kwargs["attention_mask"].device.type == kwargs["nested"]["x"].device.type == "meta"
    assert listed.dtype == torch.int64 and kwargs["attention_mask"].dtype == torch.bool
    assert three == 3 and kwargs["n"] == 5 and isinstance(pair, Pair) and pair.second == "text"
    assert inputs[0].device.type == "cpu"  # the pruner's own copy stays where it was


def test_tensors_already_there_are_the_same_tensors():
    x = torch.randn(2)
    moved = on_model_device({"x": x}, nn.Linear(2, 2))
    assert moved.kwargs["x"] is x and model_device(nn.Linear(2, 2)) == torch.device("cpu")


def test_a_model_without_tensors_leaves_the_inputs_alone():
    x = torch.randn(2)
    assert model_device(nn.ReLU()) is None
    assert on_model_device(x, nn.ReLU())[0] is x
