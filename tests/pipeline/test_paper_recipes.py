"""Every paper experiment's recipe parses, builds its real architecture, prunes what the
appendix says at the speed-ups the paper reports, and runs end to end at tiny scale on
generated data in the real on-disk format (CIFAR python batches, ImageFolder JPEGs)."""

from __future__ import annotations

import json

import pytest
import torch

from dtp_kernels.pipeline import experiments, recipe, synthetic
from dtp_kernels.pipeline.model_source import build_model
from dtp_kernels.pipeline.run import run, skipped_modules
from dtp_kernels.pruning import DTPPruner, L1Pruner

pytestmark = pytest.mark.slow  # end to end or long: `make test-fast` leaves it out

NAMES = sorted(experiments.EXPERIMENTS)
TINY = [
    "pretrain.epochs=0",
    "prune.epochs=1",
    "finetune.epochs=1",
    "data.batch_size=8",
    "data.eval_batch_size=8",
    "data.num_workers=0",
    "run.progress=false",
    "run.tensorboard=false",
    "run.plots=false",
]


def test_every_config_in_configs_paper_is_an_experiment():
    used = {e.config for e in experiments.EXPERIMENTS.values()}
    assert used == {p.name for p in experiments.CONFIGS.glob("*.yaml")}


@pytest.mark.parametrize("name", NAMES)
def test_recipes_follow_the_appendix(name):
    experiment = experiments.EXPERIMENTS[name]
    for row in experiment.rows:
        loaded = recipe.load(experiment.path, list(row.overrides))
        prune, data = loaded["prune"], loaded["data"]
        small = loaded["model"]["name"] in ("resnet56", "mobilenet_v2")
        assert prune["eps"] == (1.0 if small else 0.25)  # appendix: eps per network
        assert loaded["model"]["weights"] and not loaded["pretrain"]["epochs"]
        imagenet = data["name"] == "imagefolder"
        assert prune["weight_decay"] == (1e-4 if imagenet else 5e-4)
        assert (prune["epochs"], loaded["finetune"]["epochs"]) == (
            (90, 90) if imagenet else (120, 120)
        )
        assert loaded["finetune"]["milestones"] == ([30, 60, 75] if imagenet else [60, 90])
        assert data["batch_size"] == (64 if imagenet else 256)  # ImageNet: 64 per GPU x 4
        assert prune["lr"] == 0.1 and prune["schedule"] == "cosine"
        # the paper scores single weights by their magnitude, filters by learned scores
        unstructured = prune["granularity"] == "weight"
        assert prune["scores"] == ("magnitude" if unstructured else "learned")


@pytest.mark.parametrize(
    ("name", "speedups"),
    [("table4-resnet34", [1.32]), ("table4-resnet50", [2.31, 2.56, 3.06])],
)
def test_imagenet_rows_give_the_papers_speedups(name, speedups):
    experiment = experiments.EXPERIMENTS[name]
    for row, want in zip(experiment.rows, speedups, strict=True):
        loaded = recipe.load(experiment.path, list(row.overrides))
        model = build_model(loaded["model"])
        skip = skipped_modules(model, loaded["prune"]["skip"])
        pruner = L1Pruner(
            model, torch.randn(1, 3, 224, 224), loaded["prune"]["ratios"], ignored_layers=skip
        )
        assert pruner.report()["speedup"] == pytest.approx(want, abs=0.015), row.label


def test_resnet34_vector_on_every_block_gives_more_than_the_paper():
    """Why the ResNet-34 recipe skips blocks: applied to all of them, 1.62x."""
    loaded = recipe.load(experiments.EXPERIMENTS["table4-resnet34"].path)
    pruner = L1Pruner(
        build_model(loaded["model"]), torch.randn(1, 3, 224, 224), loaded["prune"]["ratios"]
    )
    assert pruner.report()["speedup"] == pytest.approx(1.62, abs=0.01)


def tiny_data(tmp_path, loaded: dict) -> list[str]:
    """Generated data in the recipe's format, and the overrides that point at it."""
    if loaded["data"]["name"] == "imagefolder":
        root = synthetic.write_image_folder(tmp_path / "images", classes=3, per_class=3, size=72)
        return [f"data.root={root}", "data.image_size=64"]
    root = synthetic.write_cifar(tmp_path / "cifar", loaded["data"]["name"], train=16, test=8)
    return [f"data.root={root}"]


@pytest.mark.parametrize("name", NAMES)
def test_first_row_runs_end_to_end_at_tiny_scale(tmp_path, name):
    experiment = experiments.EXPERIMENTS[name]
    row = experiment.rows[0]
    loaded = recipe.load(experiment.path, list(row.overrides))
    torch.manual_seed(0)
    dense = build_model(loaded["model"])
    torch.save(dense.state_dict(), tmp_path / "dense.pt")  # the user's weights file
    overrides = [
        *row.overrides,
        *TINY,
        *tiny_data(tmp_path, loaded),
        f"model.weights={tmp_path / 'dense.pt'}",
    ]
    summary = run(recipe.load(experiment.path, overrides), tmp_path / "run")
    assert 0 <= summary["accuracy_before_finetune"] <= 1 and 0 <= summary["accuracy"] <= 1
    if loaded["prune"]["granularity"] == "weight":  # unstructured: 82.7% zeros, kept so
        weights = [
            m.weight
            for m in summary["model"].modules()
            if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))
        ]
        zeros = sum(int((w == 0).sum()) for w in weights)
        assert zeros == pytest.approx(0.827 * sum(w.numel() for w in weights), abs=2)
        assert summary["sparsity"] == pytest.approx(
            zeros / sum(p.numel() for p in dense.parameters()), rel=1e-6
        )
    else:
        assert summary["speedup"] > 1
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["method"] == "dtp"


def test_every_row_builds_its_pruner():
    for experiment in experiments.EXPERIMENTS.values():
        for row in experiment.rows:
            loaded = recipe.load(experiment.path, list(row.overrides))
            if loaded["data"]["name"] == "imagefolder" and len(experiment.rows) == 1:
                continue  # built by the speed-up and end-to-end tests
            model = build_model(loaded["model"])
            prune = loaded["prune"]
            size = 64 if loaded["data"]["name"] == "imagefolder" else 32
            pruner = DTPPruner(
                model,
                torch.randn(1, 3, size, size),
                prune["ratios"],
                budget=prune["budget"],
                granularity=prune["granularity"],
                scores=prune["scores"],
                eps=prune["eps"],
                ignored_layers=skipped_modules(model, prune["skip"]),
            )
            assert sum(pruner.sizes) > 0, f"{experiment.name} {row.label}"


def test_runner_reports_mean_and_std_over_seeds(tmp_path, capsys):
    from dtp_kernels.cli import main

    experiment = experiments.EXPERIMENTS["table1-resnet56"]
    loaded = recipe.load(experiment.path, ["model.name=resnet20"])  # a shorter ResNet
    torch.save(build_model(loaded["model"]).state_dict(), tmp_path / "dense.pt")
    overrides = [
        *TINY,
        *tiny_data(tmp_path, loaded),
        f"model.weights={tmp_path / 'dense.pt'}",
        "model.name=resnet20",
    ]
    argv = [
        "paper",
        "table1-resnet56",
        "--seeds",
        "0",
        "1",
        "--rows",
        "p=0.5",
        "p=0.9",
        "--out",
        str(tmp_path / "out"),
    ]
    assert main([*argv, *[a for o in overrides for a in ("--set", o)]]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["row"] for r in results] == ["p=0.5", "p=0.9"]
    for r in results:
        per_seed = [
            json.loads(
                (
                    tmp_path
                    / "out"
                    / experiments.row_folder(r["row"])
                    / f"seed{s}"
                    / "summary.json"
                ).read_text()
            )["accuracy"]
            * 100
            for s in (0, 1)
        ]
        assert r["accuracy_mean"] == pytest.approx(sum(per_seed) / 2)
        assert r["accuracy_std"] == pytest.approx(abs(per_seed[0] - per_seed[1]) / 2**0.5)
        assert r["paper"] in (93.46, 89.84) and r["seeds"] == [0, 1]
    assert results[1]["speedup"] > results[0]["speedup"] > 1
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| p=0.9 |" in table and table in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"--rows \['p=0.6'\]: the rows of table1-resnet56"):
        experiments.run_experiment("table1-resnet56", [0], tmp_path / "x", rows=["p=0.6"])
