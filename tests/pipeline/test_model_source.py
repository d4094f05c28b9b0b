"""A recipe's model: built-in, torchvision or the user's own `package.module:function`,
started from the user's weights file; errors name the field and what is wrong."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dtp_kernels.cli import main
from dtp_kernels.models import resnet20
from dtp_kernels.pipeline import model_source, recipe, run
from utils import DIGITS_RECIPE, prune_argv

ROOT = Path(__file__).resolve().parents[2]


def spec(**fields) -> dict:
    return {**recipe.DEFAULTS["model"], **fields}


def test_sources_build_their_models():
    assert type(model_source.build_model(spec(name="resnet20"))).__name__ == "CifarResNet"
    vision = model_source.build_model(spec(source="torchvision", name="resnet18", num_classes=7))
    assert vision.fc.out_features == 7
    own = model_source.build_model(
        spec(
            source="python",
            entry="dtp_kernels.models.cifar_resnet:resnet20",
            kwargs={"num_classes": 3},
        )
    )
    assert own.fc.out_features == 3
    with pytest.raises(ValueError, match=r"model.source = 'hub'"):
        model_source.build_model(spec(source="hub"))
    with pytest.raises(ValueError, match=r"model.entry = 'nope'.*package.module:function"):
        model_source.build_model(spec(source="python", entry="nope"))
    with pytest.raises(ValueError, match=r"model.entry = 'no_such_pkg:f' cannot be imported"):
        model_source.build_model(spec(source="python", entry="no_such_pkg:f"))
    with pytest.raises(ValueError, match=r"model.name = 'resnet9000' is not a torchvision"):
        model_source.build_model(spec(source="torchvision", name="resnet9000"))


@pytest.mark.parametrize(
    "layout", ["plain", "state_dict", "model", "dataparallel", "safetensors", "safetensors_dp"]
)
def test_weights_files_in_every_layout_load(tmp_path, layout):
    """torch files holding the state_dict or a checkpoint with it, and safetensors files
    (as the Hugging Face Hub and timm ship weights), DataParallel's prefix or not."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    trained = resnet20()
    state = trained.state_dict()
    parallel = {f"module.{k}": v for k, v in state.items()}
    payload = {
        "plain": state,
        "state_dict": {"state_dict": state, "epoch": 3},
        "model": {"model": state, "optimizer": {}},
        "dataparallel": parallel,
    }.get(layout)
    if payload is None:  # a safetensors file, whatever its name
        save_file(state if layout == "safetensors" else parallel, str(tmp_path / "w.pt"))
    else:
        torch.save(payload, tmp_path / "w.pt")
    model = resnet20()
    model_source.load_weights(model, tmp_path / "w.pt")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_weights_that_do_not_fit_are_listed_and_nothing_loads(tmp_path):
    state = resnet20().state_dict()
    state.pop("fc.bias")
    state["extra.weight"] = torch.zeros(1)
    state["conv1.weight"] = torch.zeros(1, 1, 1, 1)
    torch.save(state, tmp_path / "w.pt")
    model = resnet20()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ValueError,
        match=r"missing keys \['fc.bias'\].*unexpected keys "
        r"\['extra.weight'\].*conv1.weight: file \(1, 1, 1, 1\)",
    ):
        model_source.load_weights(model, tmp_path / "w.pt")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="not a readable weights file"):
        model_source.load_weights(model, tmp_path / "bad.pt")
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(ValueError, match=r"'.*cut.safetensors' is not a readable weights"):
        model_source.load_weights(model, tmp_path / "cut.safetensors")
    torch.save({"epoch": 3}, tmp_path / "nothing.pt")
    with pytest.raises(ValueError, match="holds no state_dict"):
        model_source.load_weights(model, tmp_path / "nothing.pt")


def test_input_shape_or_a_data_sample():
    assert model_source.example_input(spec(input_shape=[3, 8, 8]), None).shape == (1, 3, 8, 8)
    assert model_source.example_input(spec(), torch.zeros(4, 1, 8, 8)).shape == (1, 1, 8, 8)
    for bad in ([3, -1], 3, [], [3, True]):
        with pytest.raises(ValueError, match=rf"model.input_shape = {re.escape(repr(bad))};"):
            model_source.example_input(spec(input_shape=bad), None)


def test_pruning_a_network_nobody_trained_is_refused_before_any_work(tmp_path):
    base = recipe.load(DIGITS_RECIPE, ["pretrain.epochs=0"])
    with pytest.raises(ValueError, match=r"model.weights is not set.*pretrain.epochs=N.*random"):
        run.run(base, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    missing = recipe.load(DIGITS_RECIPE, ["model.weights=nowhere.pt"])
    with pytest.raises(FileNotFoundError, match=r"model.weights = 'nowhere.pt': no such file"):
        run.run(missing, tmp_path / "out")


def test_prune_the_users_own_model_from_its_weights(tmp_path):
    """`dtp prune` on a model given as package.module:function with the user's weights;
    pruned.pt (a pickled module: the builder is the user's) loads and has the params."""
    from dtp_kernels import load_pruned
    from dtp_kernels.models import digits_cnn

    torch.manual_seed(0)
    torch.save({"state_dict": digits_cnn().state_dict()}, tmp_path / "dense.pt")
    out = tmp_path / "run"
    overrides = [
        "model.source=python",
        "model.entry=dtp_kernels.models.digits_cnn:digits_cnn",
        "model.kwargs={num_classes: 10}",
        "model.input_shape=[1, 8, 8]",
        f"model.weights={tmp_path / 'dense.pt'}",
        "pretrain.epochs=0",
        "prune.epochs=1",
        "finetune.epochs=1",
    ]
    code = main(prune_argv(out, overrides, "--no-progress"))
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    model = load_pruned(out / "pruned.pt", trusted=True)
    assert sum(p.numel() for p in model.parameters()) == summary["params"]
    assert 0 <= summary["accuracy_before_finetune"] <= 1


def test_prune_a_timm_model_from_its_safetensors_weights(tmp_path):
    """`dtp prune` on a timm model (entry timm:create_model) from a safetensors weights
    file, as the Hugging Face Hub ships timm's: its heads and MLP neurons prune, and the
    saved module has the summary's parameters."""
    from safetensors.torch import save_file

    from dtp_kernels import load_pruned

    timm = pytest.importorskip("timm")
    kwargs = dict(model_name="test_vit", num_classes=10, img_size=8, in_chans=1, patch_size=2)
    torch.manual_seed(0)
    save_file(timm.create_model(**kwargs).state_dict(), str(tmp_path / "model.safetensors"))
    out = tmp_path / "run"
    overrides = [
        "model.source=python",
        "model.entry=timm:create_model",
        "model.kwargs={" + ", ".join(f"{k}: {v}" for k, v in kwargs.items()) + "}",
        f"model.weights={tmp_path / 'model.safetensors'}",
        "prune.ratios={heads: 0.5, mlp: 0.5}",
        "pretrain.epochs=0",
        "prune.epochs=1",
        "finetune.epochs=1",
    ]
    assert main(prune_argv(out, overrides, "--no-progress")) == 0
    summary = json.loads((out / "summary.json").read_text())
    kinds = {g["name"].rsplit(".", 1)[-1] for g in summary["groups"]}
    assert kinds == {"attn", "fc1"}
    model = load_pruned(out / "pruned.pt", trusted=True)
    assert sum(p.numel() for p in model.parameters()) == summary["params"]
    assert model.blocks[0].attn.num_heads == 1


# Tiny Hugging Face image classifiers for the 8x8 digits (one channel, patches of 2)
DIGITS_IMAGES = dict(image_size=8, patch_size=2, num_channels=1)
HF_CLASSIFIERS = {
    "vit": ("ViT", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4)),
    "deit": ("DeiT", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4)),
    # stages of 2 and 4 heads in windows of 2 x 2 patches
    "swin": ("Swin", dict(embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=2)),
    "resnet": (
        "ResNet",
        dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"),
    ),
}


def save_classifier(where: Path, kind: str = "vit", labels: int = 10) -> Path:
    """A tiny Hugging Face image classifier of HF_CLASSIFIERS, saved."""
    transformers = pytest.importorskip("transformers")
    family, sizes = HF_CLASSIFIERS[kind]
    config = getattr(transformers, f"{family}Config")(**DIGITS_IMAGES, num_labels=labels, **sizes)
    if kind in ("vit", "deit"):
        config.intermediate_size = 64
    torch.manual_seed(0)
    getattr(transformers, f"{family}ForImageClassification")(config).save_pretrained(where)
    return where


def prune_classifier(tmp_path: Path, kind: str, ratios: str, *overrides: str) -> tuple[dict, dict]:
    """One DTP epoch and one fine-tuning epoch of a saved classifier on the digits (with
    `overrides` of the recipe); the recipe and the summary."""
    settings = recipe.load(
        DIGITS_RECIPE,
        [
            "model.source=huggingface",
            f"model.path={save_classifier(tmp_path / kind, kind)}",
            f"prune.ratios={ratios}",
            "pretrain.epochs=0",
            "prune.epochs=1",
            "finetune.epochs=1",
            "run.progress=false",
            "run.plots=false",
            *overrides,
        ],
    )
    for stage in ("prune", "finetune"):
        settings[stage].update(optimizer="adamw", lr=0.003)
    return settings, run.run(settings, tmp_path / "run")


def digits_accuracy(model: torch.nn.Module, settings: dict) -> float:
    """`model`'s top-1 accuracy on the recipe's test set (a Hugging Face output's logits)."""
    _, test_loader = run.build_data(settings)
    correct = total = 0
    with torch.no_grad():
        for images, labels in test_loader:
            correct += int((model.eval()(images).logits.argmax(1) == labels).sum())
            total += len(labels)
    return correct / total


@pytest.mark.parametrize("kind", ["vit", "deit"])
def test_a_hugging_face_image_classifier_prunes_and_saves_for_from_pretrained(tmp_path, kind):
    """model.source huggingface on images: AutoModelForImageClassification from
    model.path, its logits read from the output; the pruned model is written with
    save_pretrained and computes the summary's accuracy."""
    transformers = pytest.importorskip("transformers")
    settings, summary = prune_classifier(tmp_path, kind, "{heads: 0.5, mlp: 0.5}")
    assert [(g["n"], g["k"]) for g in summary["groups"]] == [(4, 2), (64, 32)] * 2
    pruned = transformers.AutoModelForImageClassification.from_pretrained(
        tmp_path / "run" / "pruned"
    )
    assert (pruned.config.num_attention_heads, pruned.config.intermediate_size) == (2, 32)
    assert sum(p.numel() for p in pruned.parameters()) == summary["params"]
    assert summary["accuracy"] == pytest.approx(digits_accuracy(pruned, settings))
    assert summary["saved"] == "pruned"
    assert not (tmp_path / "run" / "pruned.pt").exists()


@pytest.mark.parametrize(
    ("kind", "ratios", "kept"),
    [
        ("swin", "{heads: 0.5, mlp: 0.5}", [(2, 1), (64, 32), (4, 2), (128, 64)]),
        ("resnet", "0.5", [(8, 4), (16, 8)]),
    ],
)
def test_a_classifier_its_config_cannot_describe_is_saved_as_a_module(tmp_path, kind, ratios, kept):
    """Pruned Swin stages keep 1 and 2 heads, a ResNet's blocks narrower inner convs: no
    config field holds those sizes, so save_pretrained's files would not load. The run
    writes pruned.pt (a pickled module) instead, and it computes the summary's accuracy."""
    from dtp_kernels import load_pruned

    settings, summary = prune_classifier(tmp_path, kind, ratios)
    assert [(g["n"], g["k"]) for g in summary["groups"]] == kept
    assert summary["saved"] == "pruned.pt"
    assert not (tmp_path / "run" / "pruned").exists()
    pruned = load_pruned(tmp_path / "run" / "pruned.pt", trusted=True)
    assert sum(p.numel() for p in pruned.parameters()) == summary["params"]
    assert summary["accuracy"] == pytest.approx(digits_accuracy(pruned, settings))


def test_a_hugging_face_classifier_of_other_labels_is_refused_with_the_way_out(tmp_path):
    overrides = [
        "model.source=huggingface",
        f"model.path={save_classifier(tmp_path / 'vit', labels=7)}",
    ]
    with pytest.raises(ValueError, match=r"has 7 labels and model.num_classes is 10.*num_labels"):
        run.run(recipe.load(DIGITS_RECIPE, overrides), tmp_path / "run")


def test_the_hugging_face_helpers_name_what_they_need_for_another_module():
    from dtp_kernels.pipeline.errors import UsageError

    with pytest.raises(UsageError, match=r"causal language model .* needs a Hugging Face model"):
        model_source.vocabulary_size(resnet20(10))
    with pytest.raises(UsageError, match=r"from model.path needs a Hugging Face model.* CifarRes"):
        model_source.check_labels(resnet20(10), 10)
