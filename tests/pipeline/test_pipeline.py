"""Recipes, data errors and a short end-to-end `dtp prune` run on digits."""

import json
import pickle
from pathlib import Path

import pytest
import torch

from dtp_kernels.cli import main
from dtp_kernels.pipeline import data, recipe, synthetic
from utils import prune_argv

CONFIGS = Path(__file__).resolve().parents[2] / "dtp_kernels" / "configs"


@pytest.mark.parametrize(
    "name", sorted(str(p.relative_to(CONFIGS).with_suffix("")) for p in CONFIGS.rglob("*.yaml"))
)
def test_shipped_recipes_load(name):
    loaded = recipe.load(CONFIGS / f"{name}.yaml")
    assert loaded["prune"]["method"] == "dtp" and loaded["finetune"]["epochs"] > 0


def test_overrides_and_unknown_fields():
    loaded = recipe.load(None, ["prune.ratios=0.9", "finetune.milestones=[3, 4]", "seed=3"])
    assert loaded["prune"]["ratios"] == 0.9 and loaded["finetune"]["milestones"] == [3, 4]
    assert loaded["seed"] == 3
    with pytest.raises(ValueError, match=r"unknown recipe field 'prune\.ratio'"):
        recipe.load(None, ["prune.ratio=0.9"])
    with pytest.raises(ValueError, match=r"section\.key=value"):
        recipe.load(None, ["prune.ratios"])
    # a ratio map replaces the recipe's whole: its keys are the user's, not fields
    maps = ["prune.ratios={heads: 0.5, mlp: 0.5}", "prune.ratios={whole_experts: 0.25}"]
    assert recipe.load(None, maps)["prune"]["ratios"] == {"whole_experts": 0.25}


def test_missing_cifar_directory_names_path_and_layout(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing \['data_batch_1'.*data_batch_1 \.\.\."):
        data.cifar(tmp_path, "cifar10")
    with pytest.raises(FileNotFoundError, match=r"train/<class>/<image> folders"):
        data.image_folder(tmp_path)


def test_cifar_python_format_is_read(tmp_path):
    where = synthetic.write_cifar(tmp_path, "cifar10", train=20, test=4)
    for root in (where, tmp_path):  # the extracted folder, or the folder holding it
        train, test = data.cifar(root, "cifar10")
        assert len(train) == 20 and len(test) == 4 and train[0][0].shape == (3, 32, 32)
    (where / "test_batch").write_bytes(pickle.dumps({"data": [1, 2]}))
    with pytest.raises(ValueError, match="is not a cifar10 directory"):
        data.cifar(tmp_path, "cifar10")


@pytest.mark.parametrize("method", ["dtp", "l1"])
def test_prune_command_end_to_end(tmp_path, method, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "prune",
            "--config",
            str(CONFIGS / "digits.yaml"),
            "--out",
            str(out),
            "--set",
            "pretrain.epochs=1",
            "--set",
            "prune.epochs=1",
            "--set",
            "finetune.epochs=1",
            "--set",
            f"prune.method={method}",
            "--set",
            "prune.ratios=0.5",
        ]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == method and 0 < summary["sparsity"] < 1 and summary["speedup"] > 1
    assert summary["left_whole"] == {}  # every layer of the digits CNN is cut
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["stage"].split("-")[0] for r in rows} >= {"pretrain", "finetune"}
    from dtp_kernels import load_pruned

    model = load_pruned(out / "pruned.pt")
    assert sum(p.numel() for p in model.parameters()) == summary["params"]
    assert '"accuracy"' in capsys.readouterr().out


def test_check_command(capsys):
    assert main(["check"]) == 0
    assert "reference" in capsys.readouterr().out


def test_run_writes_plots_tensorboard_and_progress(tmp_path, capsys):
    out = tmp_path / "run"
    sets = ["pretrain.epochs=1", "prune.epochs=3", "finetune.epochs=1", "prune.budget=global"]
    code = main(prune_argv(out, sets))
    assert code == 0
    for name in ("mask_evolution.png", "sparsity.png"):
        png = (out / "plots" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    traces = [r for r in rows if r["stage"] == "mask-trace"]
    assert [r["epoch"] for r in traces] == [-1, 0, 1, 2]  # before training, then per epoch
    assert all(v >= 0 for r in traces for vs in r["masks"].values() for v in vs)  # may pass 1
    summary = json.loads((out / "summary.json").read_text())
    ratios = {g["k"] / g["n"] for g in summary["groups"]}
    assert len(ratios) > 1  # a global budget learns different kept fractions per layer
    assert "it/s" in capsys.readouterr().err  # tqdm


@pytest.mark.slow
def test_amp_bf16_and_channels_last_run(tmp_path, capsys):
    out = tmp_path / "run"
    epochs = ["pretrain.epochs=1", "prune.epochs=1", "finetune.epochs=1"]
    quiet = ["run.plots=false", "run.tensorboard=false"]
    code = main(
        prune_argv(out, [*epochs, *quiet], "--amp", "bf16", "--channels-last", "--no-progress")
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert 0 < summary["accuracy"] <= 1 and not (out / "plots").exists()
    fp16 = tmp_path / "fp16"
    assert main(prune_argv(fp16, epochs, "--amp", "fp16", "--no-progress")) == 0
    assert json.loads((fp16 / "summary.json").read_text())["accuracy"] > 0
    saved = torch.load(fp16 / "checkpoints" / "dtp.pt", weights_only=True)
    assert saved["scaler"]["scale"] > 0  # resumable: the GradScaler state is saved
    capsys.readouterr()
    bad = ["run.amp=fp8", "pretrain.epochs=0", *epochs[1:]]
    assert main(prune_argv(tmp_path / "fp8", bad)) == 2
    assert "error: run.amp = 'fp8'" in capsys.readouterr().err


def test_bench_command(capsys):
    assert main(["bench", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "ResNet-50's 32 groups" in out
    for backend in ("reference", "torch", "cpu"):
        assert any(line.split()[:1] == [backend] for line in out.splitlines())
    with pytest.raises(SystemExit, match="--rounds = 1"):
        main(["bench", "--rounds", "1"])


def test_resnet50_group_sizes_match_torchvision():
    """The benchmark layout is conv1 and conv2 of every torchvision ResNet-50 bottleneck."""
    import torchvision

    from dtp_kernels.benchmarking import RESNET50_GROUPS

    model = torchvision.models.resnet50()
    sizes = []
    for module in model.modules():
        if isinstance(module, torchvision.models.resnet.Bottleneck):
            sizes += [module.conv1.out_channels, module.conv2.out_channels]
    assert sizes == RESNET50_GROUPS


def test_device_field_is_checked_before_any_work(tmp_path):
    from dtp_kernels.pipeline.device import resolve_device
    from dtp_kernels.pipeline.run import run

    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"run.device = 'gpu'; allowed: auto, cpu, cuda"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match=r"run.device = 'cuda:1', but no CUDA device"):
            run(recipe.load(CONFIGS / "digits.yaml", ["run.device=cuda:1"]), tmp_path / "out")
        assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_sample_masks_reads_the_scores_without_a_warning():
    """The run log's sample of the first groups' scores: plain floats, and no autograd
    warning printed into a user's `dtp prune` output."""
    import warnings

    from dtp_kernels import DTPPruner
    from dtp_kernels.pipeline.run import sample_masks

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3)
    )
    pruner = DTPPruner(model, torch.randn(1, 3, 8, 8), 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sample = sample_masks(pruner)
    assert [len(v) for v in sample.values()] == [4] and all(
        type(x) is float for v in sample.values() for x in v
    )


def test_compiled_model_keeps_static_shapes_after_a_smaller_last_batch():
    """compile_model (what run.compile uses): after an epoch's smaller last batch, full
    batches still run the graph specialised for their size, not a dynamic-shape one (torch's
    default would recompile with a symbolic batch size and keep using that graph)."""
    from dtp_kernels.pipeline.step import compile_model

    torch._dynamo.reset()
    graphs: list[bool] = []  # per call: did the graph that ran take symbolic sizes?

    def recording(gm, example_inputs):
        symbolic = any(
            isinstance(x, torch.SymInt)
            or (isinstance(x, torch.Tensor) and any(isinstance(n, torch.SymInt) for n in x.shape))
            for x in example_inputs
        )

        def run(*args):
            graphs.append(symbolic)
            return gm.forward(*args)

        return run

    model = compile_model(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), backend=recording
    )
    for batch in (8, 8, 3, 8, 8):
        model(torch.randn(batch, 4))
    torch._dynamo.reset()
    assert graphs == [False] * 5


def test_compiled_training_step_matches_eager(tmp_path):
    """run.compile: the DTP and fine-tuning stages under torch.compile (inductor on the
    CPU here) give the eager run's losses and accuracies."""
    from torch._dynamo.utils import counters

    rows, graphs = {}, {}
    for compiled in ("false", "true"):
        out = tmp_path / compiled
        before = counters["stats"]["unique_graphs"]
        overrides = [
            "model.weights=random",
            "pretrain.epochs=0",
            "prune.epochs=1",
            "finetune.epochs=1",
            f"run.compile={compiled}",
            "run.plots=false",
        ]
        args = prune_argv(out, overrides, "--no-progress")
        assert main(args) == 0
        graphs[compiled] = counters["stats"]["unique_graphs"] - before
        lines = (out / "metrics.jsonl").read_text().splitlines()
        rows[compiled] = [json.loads(line) for line in lines if '"loss"' in line]
    assert graphs["false"] == 0 and graphs["true"] >= 2  # each stage's step was compiled
    assert len(rows["true"]) == len(rows["false"]) == 2
    for eager, compiled in zip(rows["false"], rows["true"], strict=True):
        assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-3)
        assert abs(compiled["accuracy"] - eager["accuracy"]) <= 0.01


def test_n_m_run_keeps_the_pattern_through_fine_tuning(tmp_path):
    from dtp_kernels import load_pruned

    out = tmp_path / "run"
    sets = ["pretrain.epochs=1", "prune.epochs=1", "finetune.epochs=2", "run.plots=false"]
    sets += ["prune.granularity=n:m", "prune.nm=[2, 4]", "prune.skip=[features.0]"]
    assert main(prune_argv(out, sets, "--no-progress")) == 0
    model = load_pruned(out / "pruned.pt")
    for name in ("features.3", "features.7", "classifier"):
        weight = dict(model.named_modules())[name].weight.detach()
        per_block = (weight.movedim(1, -1).reshape(-1, 4) != 0).sum(1)
        assert torch.equal(per_block.unique(), torch.tensor([2])), name
    assert (model.features[0].weight != 0).all()  # skipped: dense


def test_l1_at_n_m_is_one_shot_magnitude_n_m(tmp_path, capsys):
    out = tmp_path / "run"
    sets = ["pretrain.epochs=1", "finetune.epochs=1", "run.plots=false", "prune.method=l1"]
    sets += ["prune.granularity=n:m", "prune.skip=[features.0]"]
    assert main(prune_argv(out, sets, "--no-progress")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "l1" and summary["sparsity"] > 0.4
    capsys.readouterr()
    sets[3] = "prune.method=random"
    assert main(prune_argv(tmp_path / "random", sets, "--no-progress")) == 2
    assert "random prunes filters" in capsys.readouterr().err
    assert not (tmp_path / "random").exists()  # refused before any work


def test_compiled_dtp_model_compiles_once():
    """A DTP-pruned model under compile_model: two frames (the pruner's pre-hook and the
    model; its forward hook runs eagerly, cheaper than a frame) compile at the first
    training step and nothing recompiles at the next steps (a guard on per-step Python
    state would recompile every step)."""
    import dtp_kernels
    from dtp_kernels.models import get_model
    from dtp_kernels.pipeline.step import compile_model

    torch._dynamo.reset()
    compiled: list[int] = []

    def counting(gm, example_inputs):
        compiled.append(len(gm.graph.nodes))
        return gm.forward

    torch.manual_seed(0)
    model = get_model("digits_cnn")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dtp_kernels.prepare(model, optimizer, torch.randn(1, 1, 8, 8), ratios=0.5)
    step_model = compile_model(model, backend=counting)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    counts = []
    for _ in range(4):
        loss = torch.nn.functional.cross_entropy(step_model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        counts.append(len(compiled))
    torch._dynamo.reset()
    assert counts == [2, 2, 2, 2], counts
