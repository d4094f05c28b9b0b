"""`dtp prune --plan`: what a recipe will do, before any training.

The recipe, the model (its weights loaded) and the data are read and checked as a run
reads them, on the CPU; the pruner is built on the model and reports each group's size
and kept count, the parameters and FLOPs before and after pruning, how a Hugging Face
model will be saved (save_pretrained, or pruned.pt where its config cannot describe the
pruned sizes), and the memory each stage's training state takes. Nothing is trained and
nothing is written.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..pruning.config_forecast import config_forecast
from . import schema
from .activation_memory import saved_activation_bytes
from .data import epoch_sampler
from .run import check_starting_point, make_pruner, prepare, run_options
from .run import frozen as run_frozen
from .train import RunOptions, accumulation_plan, stage_steps

Shape = tuple[tuple[int, ...], torch.dtype]  # a batch's shape and dtype


def state_bytes(
    params: int, element: int, settings: dict, trains: bool = True, state_element: int = 4
) -> int:
    """Bytes of `params` parameters of `element` bytes each in a training stage: the
    weights, and when they train their gradients and the optimizer's state (AdamW: two
    moments; SGD: a momentum buffer when momentum > 0; for weights of 2 bytes, the
    compensation buffer of compensated_optim.py, and the moments or buffer in
    `state_element` bytes each, model.optimizer_state_dtype)."""
    if not trains:
        return params * element
    if settings.get("optimizer", "sgd") == "adamw":
        states = 2
    else:
        states = 1 if settings.get("momentum", 0.9) > 0 else 0
    if element != 2:
        return params * element * (2 + states)
    return params * (element * 3 + states * state_element)


def measure_activations(
    model: nn.Module, shapes: tuple[Shape, Shape], options: RunOptions
) -> int | str:
    """saved_activation_bytes for the run's batch shapes, or why it could not be measured
    (a forward that does not run on fake tensors: a transformers mixture of experts'
    grouped matmul in float32, for one)."""
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # its failed op would be logged as an error first
    try:
        inputs, labels = shapes
        return saved_activation_bytes(
            model, inputs, labels, options.amp_dtype, options.outputs, options.images
        )
    except Exception as error:
        first = (str(error).strip().splitlines() or [""])[0]
        cause = f"{type(error).__name__}: {first}"
        return f"not measured: the forward does not run on fake tensors ({cause})"
    finally:
        quiet.setLevel(level)


def saved_form(pruner, learned: bool) -> dict | None:
    """How the run will save the pruned Hugging Face model: {"saved": "pruned" (with
    save_pretrained) or "pruned.pt" (save_pruned), "ratios_for_save_pretrained": for
    pruned.pt, the ratios that would keep save_pretrained (None if none found)}; None
    without a transformers config. `learned`: the counts are learned (budget "global"
    or "flops"), so the forecast, from the counts at the start, says so: layers of one
    kind learned to different counts go to pruned.pt."""
    forecast = config_forecast(pruner)
    if forecast is None:
        return None
    saved = "pruned" if forecast["describes"] else "pruned.pt"
    form = {"saved": saved, "ratios_for_save_pretrained": forecast["ratios"]}
    if learned:
        form["forecast_from"] = (
            "the counts at the start; layers of one kind learned to different counts are "
            "saved to pruned.pt"
        )
    return form


def plan(recipe: dict) -> dict:
    """What `run(recipe)` will prune and the training state each stage holds, from the
    model and the pruner built as the run builds them (on the CPU; nothing trains)."""
    schema.validate(recipe)
    check_starting_point(recipe)
    options = run_options(recipe, torch.device("cpu"))
    model, train_loader, _, example = prepare(recipe, options)
    sampler, batch = epoch_sampler(train_loader)
    batches = accumulation_plan(len(sampler), batch, recipe["data"]["accumulate"])
    settings = recipe["prune"]
    frozen = not settings["train_weights"]
    sample, target = train_loader.dataset[0, 0]  # (index, seed): SeededSamples
    shapes = (
        ((batch, *sample.shape), sample.dtype),
        ((batch, *torch.as_tensor(target).shape), torch.long),
    )
    activations = {"dense": measure_activations(model, shapes, options)}
    pruner = make_pruner(model, settings, example)
    report = pruner.report()
    if settings["method"] == "dtp":
        with run_frozen(model, frozen):
            activations["dtp"] = measure_activations(model, shapes, options)
    element = next(model.parameters()).element_size()
    scores = sum(p.numel() for p in pruner.parameters())
    state = sum(b.numel() * b.element_size() for b in pruner.buffers())
    learned = settings["method"] == "dtp" and settings["budget"] != "layer"
    # unstructured and N:M pruning keep the shapes: the zeros are still held
    kept = (
        report["params_after"] if settings["granularity"] == "filter" else report["params_before"]
    )
    trains = {
        "pretrain": recipe["pretrain"]["epochs"] > 0,
        "prune": settings["method"] == "dtp",
        "finetune": recipe["finetune"]["epochs"] > 0,
    }
    moment = 4 if recipe["model"]["optimizer_state_dtype"] == "float32" else element
    memory = {
        "pretrain": state_bytes(report["params_before"], element, recipe["pretrain"], True, moment),
        "prune": state_bytes(report["params_before"], element, settings, not frozen, moment)
        + state_bytes(scores, 4, settings)  # float32 scores, in the stage's optimizer
        + state,
        "finetune": state_bytes(kept, element, recipe["finetune"], True, moment),
    }
    return {
        "method": settings["method"],
        "ratios": settings["ratios"],
        "budget": settings["budget"],
        # under a global or FLOPs budget DTP learns each layer's count; the total is fixed
        "kept_counts": "learned per group" if learned else "fixed",
        "groups": [{k: g[k] for k in ("name", "kind", "n", "k")} for g in report["groups"]],
        # the conv and linear layers no group cuts, with why (a ratio of 0, a residual add)
        "left_whole": report["left_whole"],
        # a Hugging Face model: saved with save_pretrained ("pruned") or to pruned.pt,
        # and the ratios that would keep save_pretrained (config_forecast.py)
        "saved": (
            saved_form(pruner, learned) if recipe["model"]["source"] == "huggingface" else None
        ),
        "params_before": report["params_before"],
        "params_after": report["params_after"],
        "flops_before": report["flops_before"],
        "flops_after": report["flops_after"],
        "speedup": report["speedup"],
        "parameter_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        # the moments' and momentum buffers' (model.optimizer_state_dtype for 2-byte weights)
        "optimizer_state_dtype": "float32" if moment == 4 else "bfloat16",
        # parameters, gradients and optimizer state of each stage that trains (l1 and
        # random prune in one shot); activations come on top
        "training_state_bytes": {stage: count for stage, count in memory.items() if trains[stage]},
        # what one batch of data.batch_size keeps for the backward pass: the dense model
        # (pre-training; fine-tuning's smaller model keeps at most this) and the model
        # with DTP's masks (activation_memory.py)
        "saved_activation_bytes": activations,
        # on this process's share of the data (under torchrun: per rank)
        "optimizer_steps": {
            stage: stage_steps(batches, recipe[stage]) if trains[stage] else 0
            for stage in ("pretrain", "prune", "finetune")
        },
    }
