"""One pruning run: optional dense pre-training, pruning (DTP soft-mask training, or a
one-shot baseline), export, fine-tuning and evaluation, from a recipe."""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import json
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..models import CIFAR_MODELS, TORCHVISION_MODELS
from ..pruning import DTPPruner, L1Pruner, RandomPruner, save_pruned
from ..pruning.base import ChannelPruner
from ..pruning.config_forecast import config_forecast, forecast_message
from ..pruning.cost import count_flops, count_params
from ..pruning.hf_config import describes
from . import data as datasets
from . import distributed, plots, schema, sharding, text_data
from . import out_dir as out_dir_rules
from .device import resolve_device
from .errors import DivergedError, UsageError
from .model_source import (
    RANDOM,
    build_model,
    check_labels,
    checkpoint_activations,
    example_input,
    hugging_face_model,
    load_weights,
    vocabulary_size,
)
from .preemption import PreemptionGuard
from .train import Checkpointing, MetricsLog, RunOptions, metrics, train

METHODS = ("dtp", "l1", "random")


def build_data(recipe: dict, device: torch.device | None = None, vocab_size: int | None = None):
    """The training and test loaders of the recipe's `data` section, for a run on
    `device` (CPU by default: it decides pinned memory); text for a language model of
    `vocab_size` token ids."""
    spec = recipe["data"]
    device = torch.device(device or "cpu")
    train_set: Dataset
    test_set: Dataset
    if spec["name"] == "text":
        train_set, test_set = text_data.text(
            spec["root"], spec["seq_len"], spec["tokenizer"], recipe["model"]["path"], vocab_size
        )
    elif spec["name"] == "digits":
        train_set, test_set = datasets.digits(seed=recipe["seed"])
    elif spec["name"] in ("cifar10", "cifar100"):
        train_set, test_set = datasets.cifar(spec["root"], spec["name"], spec["augment"])
    elif spec["name"] == "imagefolder":
        train_set, test_set = datasets.image_folder(
            spec["root"], spec["image_size"], spec["augment"], spec["skip_bad_files"]
        )
    else:
        raise UsageError(
            f"data.name = {spec['name']!r}; allowed: digits, cifar10, cifar100, imagefolder, text"
        )
    pin = spec["pin_memory"] if spec["pin_memory"] is not None else device.type == "cuda"
    return datasets.loaders(
        train_set,
        test_set,
        spec["batch_size"],
        recipe["seed"],
        eval_batch_size=spec["eval_batch_size"],
        num_workers=spec["num_workers"],
        pin_memory=pin,
        persistent_workers=spec["persistent_workers"],
        prefetch_factor=spec["prefetch_factor"],
    )


def check_starting_point(recipe: dict) -> None:
    """Refuse, before any work, a run that would prune a network nobody trained."""
    weights = recipe["model"]["weights"]
    if recipe["model"]["source"] == "huggingface":
        return  # its weights are in model.path (build_model reads them)
    if weights is None and not recipe["pretrain"]["epochs"]:
        raise UsageError(
            "model.weights is not set and pretrain.epochs is 0: the run would prune a "
            "randomly initialised network. Give the dense model's weights (--set "
            "model.weights=PATH, a state_dict file such as torchvision's "
            "resnet50-0676ba61.pth or a checkpoint holding one under 'state_dict' or "
            "'model'), train it first (--set pretrain.epochs=N), or prune the random "
            "initialisation on purpose (--set model.weights=random)"
        )
    if weights not in (None, RANDOM) and not Path(weights).is_file():
        raise FileNotFoundError(
            f"model.weights = {weights!r}: no such file (a state_dict of the dense model; "
            "or train one with --set model.weights=null --set pretrain.epochs=N)"
        )


def skipped_modules(model: nn.Module, patterns: list[str]) -> list[nn.Module]:
    """The modules prune.skip names (fnmatch globs over module names)."""
    names = [name for name, _ in model.named_modules() if name]
    chosen = []
    for pattern in patterns:
        hits = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            raise UsageError(
                f"prune.skip names {pattern!r}, which matches no module of the "
                f"model; modules include {names[:8]}"
            )
        chosen += hits
    modules = dict(model.named_modules())
    return [modules[name] for name in dict.fromkeys(chosen)]


def check_pruning_plan(model: nn.Module, settings: dict, example: torch.Tensor) -> None:
    """prune.ratios and prune.skip against the model before any training: the groups are
    found and the ratios resolved as the pruner will do after pretraining (nothing of the
    model changes), so a ratio naming no layer, a stage count that does not fit or a layer
    that cannot be exported exactly is a UsageError now, not hours later."""
    skip = skipped_modules(model, settings["skip"])
    if settings["granularity"] != "filter":
        return  # unstructured: every weight is a candidate, nothing to resolve
    budget = "layer" if settings["budget"] == "flops" else settings["budget"]
    try:
        L1Pruner(model, example, settings["ratios"], budget=budget, ignored_layers=skip)
    except (TypeError, ValueError) as error:
        raise UsageError(
            f"prune.ratios = {settings['ratios']!r} does not fit the model: {error}"
        ) from None


# The recipe sections each stage's result depends on: a checkpoint of that stage resumes
# only a run that agrees on all of their fields, except where the data lives and how it
# is loaded (a job restarted on another node may read the same data from another path).
STAGE_SECTIONS = {
    "pretrain": ("seed", "data", "model", "pretrain", "run.amp"),
    "dtp": ("seed", "data", "model", "pretrain", "prune", "run.amp"),
    "finetune": ("seed", "data", "model", "pretrain", "prune", "finetune", "run.amp"),
}
LOADING_FIELDS = (
    "data.root",
    "data.eval_batch_size",
    "data.num_workers",
    "data.pin_memory",
    "data.persistent_workers",
    "data.prefetch_factor",
)


def stage_fields(recipe: dict, stage: str) -> dict:
    """{"section.key": value} of the recipe fields stage `stage` depends on."""
    sections = STAGE_SECTIONS[stage]
    return {
        name: value
        for name, value in schema.flatten(recipe).items()
        if any(name == s or name.startswith(s + ".") for s in sections)
        and name not in LOADING_FIELDS
    }


def stage_checkpoint(
    checkpoints: Path | None, recipe: dict, stage: str, resume: bool
) -> Checkpointing | None:
    """Checkpoint settings of one stage: its file, and the fields a resumed file must match."""
    if checkpoints is None:
        return None
    return Checkpointing(checkpoints / f"{stage}.pt", stage_fields(recipe, stage), resume)


def make_pruner(model: nn.Module, settings: dict, example: torch.Tensor) -> ChannelPruner:
    """The pruner of the recipe's `prune` section (`settings`) on `model`."""
    skip = skipped_modules(model, settings["skip"])
    if settings["method"] == "dtp" or settings["granularity"] != "filter":
        # Under weight or n:m granularity l1 is one-shot magnitude pruning at the same
        # pattern: this pruner untrained, whose scores start at |w| (schema.validate
        # refuses random there).
        return DTPPruner(
            model,
            example,
            settings["ratios"],
            budget=settings["budget"],
            granularity=settings["granularity"],
            nm=tuple(settings["nm"]),
            scores=settings["scores"],
            eps=settings["eps"],
            iters=settings["iters"],
            ignored_layers=skip,
        )
    cls = L1Pruner if settings["method"] == "l1" else RandomPruner
    return cls(model, example, settings["ratios"], budget=settings["budget"], ignored_layers=skip)


def prune_and_finetune(
    dense: nn.Module,
    recipe: dict,
    train_loader,
    test_loader,
    log: MetricsLog,
    checkpoints: Path | None = None,
    resume: bool = False,
    options: RunOptions | None = None,
    example: torch.Tensor | None = None,
    copy_model: bool = True,
) -> dict:
    """Prune a copy of `dense` per recipe["prune"], fine-tune it; return the summary.
    `example` is one input for tracing (default: the first test image). With
    `copy_model=False`, `dense` itself is pruned (no second copy of a large model; the
    caller no longer uses it).

    Under `options.sharding` "fsdp" both stages train sharded (sharding.py): the DTP
    stage's model after the pruner is made, the exported model before fine-tuning; the
    export gathers the model into one built again from the recipe (on the CPU), and the
    summary's model is the fine-tuned one gathered whole, on the CPU."""
    settings = recipe["prune"]
    method = settings["method"]
    if method not in METHODS:
        raise UsageError(f"prune.method = {method!r}; allowed: {list(METHODS)}")
    options = options or RunOptions()
    if example is None:
        example = next(iter(test_loader))[0][:1]
    example = example.to(options.device)
    base_params, base_flops = count_params(dense), count_flops(dense, example)
    model = copy.deepcopy(dense) if copy_model else dense
    times = {}
    start = time.perf_counter()
    pruner = make_pruner(model, settings, example)
    forecast = config_forecast(pruner) if recipe["model"]["source"] == "huggingface" else None
    if forecast is not None and not forecast["describes"]:  # said now, not after training
        learned = method == "dtp" and settings["budget"] != "layer"
        message = forecast_message(forecast, learned) + " (the run writes it to pruned.pt)"
        warnings.warn(message, UserWarning, stacklevel=2)
    if method == "dtp":
        assert isinstance(pruner, DTPPruner)  # make_pruner's for "dtp"

        def trace(epoch: int) -> None:  # soft masks of sample filters, for the Fig. 3a plot
            log.write(stage="mask-trace", epoch=epoch, masks=sample_masks(pruner))

        trace(-1)
        with frozen(model, not settings.get("train_weights", True)):
            if options.sharding == "fsdp":  # after the pruner: it is made on the whole model
                sharding.shard(model, options.shard_units)
            result = train(
                model,
                train_loader,
                test_loader,
                settings,
                log,
                f"dtp-{settings['ratios']}",
                pruner=pruner,
                flops_target=settings["flops_target"],
                checkpoint=stage_checkpoint(checkpoints, recipe, "dtp", resume),
                options=options,
                on_epoch=trace,
            )
        times["prune"] = result["seconds"]  # the whole stage's, across resumes
    else:
        times["prune"] = time.perf_counter() - start
    report = pruner.report()
    start = time.perf_counter()
    if sharding.is_sharded(model):  # the weights are gathered into the model built again
        assert isinstance(pruner, DTPPruner)  # only DTP's stage shards the model
        pruned = pruner.export_sharded(rebuilt(recipe, options))
    else:
        pruned = pruner.export()
    times["export"] = time.perf_counter() - start
    here = next(pruned.parameters()).device
    params, flops = count_params(pruned), count_flops(pruned, example.to(here))
    whole = None
    if options.sharding == "fsdp":
        whole = copy.deepcopy(pruned).cpu()  # what the fine-tuned shards are gathered into
        sharding.shard(pruned, options.shard_units)
    before_finetune = metrics(pruned, test_loader, options)  # the paper's star point
    zeros = zero_pattern(pruned) if settings["granularity"] != "filter" else None
    saving = stage_checkpoint(checkpoints, recipe, "finetune", resume)
    result = train(
        pruned,
        train_loader,
        test_loader,
        recipe["finetune"],
        log,
        f"finetune-{method}-{settings['ratios']}",
        checkpoint=saving,
        options=options,
        keep_zero=zeros,
    )
    times["finetune"] = result["seconds"]
    if zeros is not None:  # unstructured: the same shapes, pruned weights held at zero
        params -= sum(int((~keep).sum()) for keep in zeros.values())
    summary = {
        "method": method,
        "ratios": settings["ratios"],
        "accuracy_before_finetune": before_finetune["accuracy"],
        **metrics(pruned, test_loader, options),  # a language model's perplexity too
        "params": params,
        "flops": flops,
        "sparsity": 1 - params / base_params,
        "speedup": base_flops / flops,
        "seconds": times,
        "groups": report["groups"],
        "left_whole": report["left_whole"],  # the layers no group cut, with why
        "model": pruned,
    }
    if whole is not None:
        whole.load_state_dict(sharding.model_state(pruned))
        summary["model"] = whole
    if "perplexity" in before_finetune:
        summary["perplexity_before_finetune"] = before_finetune["perplexity"]
    return summary


def rebuilt(recipe: dict, options: RunOptions, state: dict | None = None) -> nn.Module:
    """The recipe's model built again, on the CPU, as `prepare` builds it, holding
    `state` when given (the whole tensors of a sharded model: sharding.model_state).
    Building it draws nothing from the run's random numbers."""
    with torch.random.fork_rng(devices=[]):
        model = build_model(recipe["model"], options.task)
    if recipe["run"]["activation_checkpointing"]:
        checkpoint_activations(model)
    if state is not None:
        model.load_state_dict(state)
    return model


@contextlib.contextmanager
def frozen(model: nn.Module, freeze: bool) -> Iterator[None]:
    """With `freeze`, the model's trainable parameters take no gradient inside the block
    (prune.train_weights: false; the stage's optimizer then holds the pruner's scores
    alone) and train again after it."""
    weights = [p for p in model.parameters() if p.requires_grad] if freeze else []
    for weight in weights:
        weight.requires_grad_(False)
    try:
        yield
    finally:
        for weight in weights:
            weight.requires_grad_(True)


def zero_pattern(model: nn.Module) -> dict[torch.Tensor, torch.Tensor]:
    """The kept entries (weight != 0) of every conv and linear weight of an exported
    unstructured model, which fine-tuning keeps at zero where they are pruned."""
    return {
        m.weight: m.weight.detach() != 0
        for m in model.modules()
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear))
    }


def saved_architecture(recipe: dict) -> dict | None:
    """How pruned.pt names the architecture: {name, num_classes} for a model get_model
    builds (the file then holds weights only), None otherwise (a pickled module, which
    load_pruned reads with trusted=True)."""
    spec = recipe["model"]
    name = spec["name"]
    if spec["source"] == "torchvision":
        name = "torchvision." + name.removeprefix("torchvision.")
    if spec["source"] in ("python", "huggingface") or spec["kwargs"]:
        return None
    if name in CIFAR_MODELS or name.removeprefix("torchvision.") in TORCHVISION_MODELS:
        return {"name": name, "num_classes": spec["num_classes"]}
    return None


SAMPLE_GROUPS, SAMPLE_FILTERS = 6, 4


def sample_masks(pruner: DTPPruner) -> dict[str, list[float]]:
    """The current soft masks of the first filters of the first groups."""
    masks = pruner.channel_scores().detach().float().cpu().split(pruner.sizes)
    return {
        group.name: [round(float(v), 6) for v in mask[:SAMPLE_FILTERS]]
        for group, mask in zip(pruner.groups[:SAMPLE_GROUPS], masks, strict=False)
    }


def write_plots(summary: dict, rows: list[dict], where: Path, recipe: dict) -> list[Path]:
    """Fig. 3a (from the mask-trace rows of a DTP run) and Fig. 7 as PNG files."""
    where.mkdir(parents=True, exist_ok=True)
    prune = recipe["prune"]
    model = recipe["model"]
    name = Path(model["path"]).name if model["source"] == "huggingface" else model["name"]
    label = f"{name}, {prune['method']} {prune['ratios']} ({prune['budget']})"
    written = []
    traces = [r for r in rows if r["stage"] == "mask-trace"]
    if traces:
        by_group = {name: [r["masks"][name] for r in traces] for name in traces[0]["masks"]}
        plots.mask_evolution(
            by_group, where / "mask_evolution.png", f"soft masks of sample filters, {label}"
        )
        written.append(where / "mask_evolution.png")
    plots.learned_sparsity(
        summary["groups"], where / "sparsity.png", f"kept fraction per group, {label}"
    )
    written.append(where / "sparsity.png")
    return written


def run_options(recipe: dict, device: torch.device) -> RunOptions:
    """The RunOptions of the recipe's `run` and `data` sections, on `device`."""
    settings = recipe["run"]
    return RunOptions(
        settings["amp"],
        settings["channels_last"],
        settings["progress"],
        device,
        settings["compile"],
        checkpoint_minutes=settings["checkpoint_minutes"],
        checkpoint_steps=settings["checkpoint_steps"],
        eval_every_steps=settings["eval_every_steps"],
        task="causal_lm" if recipe["data"]["name"] == "text" else "classify",
        accumulate=recipe["data"]["accumulate"],
        optimizer_state_dtype=(
            torch.float32 if recipe["model"]["optimizer_state_dtype"] == "float32" else None
        ),
        sharding=settings["sharding"],
        shard_units=settings["shard_units"],
    )


def run(
    recipe: dict,
    out_dir: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
) -> dict:
    """The whole pipeline; writes metrics.jsonl, summary.json and pruned.pt to out_dir,
    and a checkpoint per stage to out_dir/checkpoints after every epoch (and within long
    epochs, run.checkpoint_minutes / run.checkpoint_steps). resume=True continues from
    those checkpoints (finished stages are restored, not rerun) and ends bitwise where an
    uninterrupted run ends. SIGTERM, SIGINT or SIGUSR1 stop the run after the current step
    with a checkpoint (raises preemption.Preempted).

    out_dir is refused when it already holds a run, unless `resume` or `overwrite` (which
    deletes that run's files first); it is locked while the run goes (out_dir.RunLock).
    Under torchrun a restarted worker group (TORCHELASTIC_RESTART_COUNT > 0) resumes from
    the checkpoints the failed attempt left. A recipe field that is not allowed raises
    RecipeError before any work; a training loss that is not finite, DivergedError."""
    schema.validate(recipe)
    device = resolve_device(recipe["run"]["device"])
    options = run_options(recipe, device)
    check_starting_point(recipe)
    out = Path(out_dir) if out_dir is not None else None
    if (resume or overwrite) and out is None:
        raise UsageError("--resume and --overwrite need the run's output directory (--out)")
    if out is not None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        # torchrun restarted the workers with the same command line: go on from what the
        # failed attempt left (its own files, so replacing them is safe when none is a
        # checkpoint yet).
        resume = out_dir_rules.has_checkpoints(out)
        overwrite = not resume
    distributed.init_from_env(device)  # under torchrun: one process per GPU (or CPU rank)
    main = distributed.is_main()
    lock = out_dir_rules.RunLock(out) if out is not None and main else contextlib.nullcontext()
    with lock:
        if out is not None:
            out_dir_rules.check(out, resume, overwrite)
            if overwrite and main:
                out_dir_rules.clear(out)
            distributed.barrier()  # no rank writes before rank 0 has cleared
        group = sharding.process_group(device) if options.sharding else contextlib.nullcontext()
        with group:  # FSDP shards over a process group, even of one process
            return _run(recipe, out, resume, options, main)


def prepare(
    recipe: dict, options: RunOptions
) -> tuple[nn.Module, DataLoader, DataLoader, torch.Tensor]:
    """The recipe's model (its weights loaded, on the run's device), its training and
    test loaders and an example input, with the pruning plan checked against the model."""
    model = build_model(recipe["model"], options.task)
    language = options.task == "causal_lm"
    if recipe["model"]["source"] == "huggingface" and not language:
        check_labels(model, recipe["model"]["num_classes"])
    if recipe["run"]["activation_checkpointing"]:
        checkpoint_activations(model)
    vocab = vocabulary_size(model) if language else None
    train_loader, test_loader = build_data(recipe, options.device, vocab)
    if recipe["model"]["weights"] not in (None, RANDOM):
        load_weights(model, recipe["model"]["weights"])
    model.to(options.device)
    sample = None if recipe["model"]["input_shape"] else next(iter(test_loader))[0]
    example = example_input(recipe["model"], sample)
    check_pruning_plan(model, recipe["prune"], example.to(options.device))
    if options.sharding:
        sharding.units(model, options.shard_units)  # a unit naming no module: said now
    return model, train_loader, test_loader, example


def _run(recipe: dict, out: Path | None, resume: bool, options: RunOptions, main: bool) -> dict:
    settings = recipe["run"]
    device = options.device
    torch.manual_seed(recipe["seed"])
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    checkpoints = out / "checkpoints" if out is not None else None
    with PreemptionGuard() as options.preemption:
        writes = out if main else None  # where rank 0 writes the files (None: nowhere)
        tensorboard = (
            writes / "tensorboard" if writes is not None and settings["tensorboard"] else None
        )
        log = MetricsLog(writes / "metrics.jsonl" if writes is not None else None, tensorboard)
        model, train_loader, test_loader, example = prepare(recipe, options)
        hugging = recipe["model"]["source"] == "huggingface"
        if recipe["pretrain"]["epochs"]:
            saving = stage_checkpoint(checkpoints, recipe, "pretrain", resume)
            if options.sharding == "fsdp":
                sharding.shard(model, options.shard_units)
            dense = train(
                model,
                train_loader,
                test_loader,
                recipe["pretrain"],
                log,
                "pretrain",
                checkpoint=saving,
                options=options,
            )
        else:
            dense = {"seconds": 0.0, **metrics(model, test_loader, options)}
        if sharding.is_sharded(model):  # the pruner is made on the whole model
            model = rebuilt(recipe, options, sharding.model_state(model)).to(device)
        summary = prune_and_finetune(
            model,
            recipe,
            train_loader,
            test_loader,
            log,
            checkpoints,
            resume,
            options,
            example,
            copy_model=False,
        )
    summary["dense_accuracy"] = dense["accuracy"]
    if "perplexity" in dense:
        summary["dense_perplexity"] = dense["perplexity"]
    summary["device"] = str(device)
    summary["seconds"]["pretrain"] = dense["seconds"]
    summary["skipped_files"] = datasets.skipped_files(train_loader, test_loader)
    check_finite(summary["model"])
    # A Hugging Face model goes to a directory from_pretrained reads when its config can
    # describe the pruned sizes; one with layers of different sizes cannot, and goes to
    # pruned.pt (a pickled module) instead of a save_pretrained that would not load.
    pretrained = hugging and describes(summary["model"])
    if writes is None:
        return summary
    summary["saved"] = "pruned" if pretrained else "pruned.pt"
    if pretrained:
        save_hugging_face(summary["model"], recipe, writes / "pruned")
    else:
        metadata = {"method": summary["method"], "ratios": str(summary["ratios"])}
        save_pruned(writes / "pruned.pt", summary["model"], saved_architecture(recipe), metadata)
        if hugging:
            save_tokenizer(recipe, writes / "tokenizer")
    if settings["plots"]:
        write_plots(summary, log.rows, writes / "plots", recipe)
    printable = {k: v for k, v in summary.items() if k != "model"}
    (writes / "summary.json").write_text(json.dumps(printable, indent=2, allow_nan=False))
    return summary


def save_hugging_face(model: nn.Module, recipe: dict, where: Path) -> None:
    """save_pretrained of the pruned Hugging Face model (its config holds the pruned
    sizes), with the tokenizer of model.path when the text data used it."""
    hugging_face_model(model, "save_pretrained").save_pretrained(where)
    save_tokenizer(recipe, where)


def save_tokenizer(recipe: dict, where: Path) -> None:
    """The tokenizer of model.path, saved to `where`, when the text data used it, or,
    for token ids read as they are (pretokenized), when model.path holds one."""
    kind = recipe["data"]["tokenizer"]
    if recipe["data"]["name"] != "text" or kind == "bytes":
        return
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(recipe["model"]["path"], local_files_only=True)
    except (OSError, ValueError):
        if kind == "model":
            raise
        return  # pretokenized ids and no tokenizer beside the model: nothing to copy
    tokenizer.save_pretrained(where)


def check_finite(model: nn.Module) -> None:
    """Refuse to export a model with a NaN or Inf parameter or buffer, naming it."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise DivergedError(
                f"the pruned model's {name} holds NaN or Inf values; nothing was exported"
            )
