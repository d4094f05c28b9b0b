"""save_pruned / load_pruned with a builder: any model a function builds is saved as its
entry point, its keyword arguments and safetensors weights, and loaded without pickle."""

import json

import pytest
import torch

from dtp_kernels import DTPPruner, load_pruned, save_pruned
from dtp_kernels.pruning import built_model

timm = pytest.importorskip("timm")

DEIT = "timm.models.vision_transformer:VisionTransformer"
DEIT_KWARGS = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5)


def pruned_deit():
    torch.manual_seed(0)
    model = built_model.build(DEIT, DEIT_KWARGS)
    x = torch.randn(2, 3, 16, 16)
    return DTPPruner(model, (x[:1],), {"heads": 0.5, "mlp": 0.5}).export().eval(), x


def test_a_built_model_round_trips_without_pickle(tmp_path, monkeypatch):
    exported, x = pruned_deit()
    path = tmp_path / "deit.safetensors"
    save_pruned(path, exported, metadata={"ratio": 0.5}, builder=DEIT, builder_kwargs=DEIT_KWARGS)

    def no_pickle(*args, **kwargs):
        raise AssertionError("torch.load (pickle) was called")

    monkeypatch.setattr(torch, "load", no_pickle)
    loaded = load_pruned(path, expect={"ratio": 0.5, "builder": DEIT}).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), exported(x), rtol=0, atol=0)
    attn = loaded.blocks[0].attn
    assert (attn.num_heads, attn.attn_dim, attn.qkv.out_features) == (2, 16, 48)


def test_a_group_norm_model_keeps_its_groups(tmp_path):
    from utils import group_norm_net

    torch.manual_seed(0)
    model = group_norm_net()
    x = torch.randn(2, 3, 8, 8)
    exported = DTPPruner(model, (x[:1],), 0.5).export().eval()
    path = tmp_path / "gn.safetensors"
    save_pruned(path, exported, builder="utils:group_norm_net", builder_kwargs={"width": 8})
    fields, _ = built_model.read_header(path)
    assert json.loads(fields["attributes"])["1"] == {"num_groups": 1, "num_channels": 4}
    loaded = load_pruned(path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), exported(x), rtol=0, atol=0)


def test_bad_builders_and_mismatched_files_are_refused(tmp_path):
    exported, _ = pruned_deit()
    with pytest.raises(ValueError, match=r"builder = .timm.VisionTransformer.; it must be"):
        save_pruned(tmp_path / "a", exported, builder="timm.VisionTransformer")
    with pytest.raises(ValueError, match=r"builder = 'timm:NoSuchModel' cannot be imported"):
        save_pruned(tmp_path / "a", exported, builder="timm:NoSuchModel")
    with pytest.raises(ValueError, match=r"builder_kwargs needs builder"):
        save_pruned(tmp_path / "a", exported, builder_kwargs={})
    with pytest.raises(ValueError, match=r"do not build this model"):  # another depth
        save_pruned(
            tmp_path / "a", exported, builder=DEIT, builder_kwargs={**DEIT_KWARGS, "depth": 1}
        )
    path = tmp_path / "deit.safetensors"
    save_pruned(path, exported, builder=DEIT, builder_kwargs=DEIT_KWARGS)
    with pytest.raises(ValueError, match=r"holds a model with ratio = None, expected 0.5"):
        load_pruned(path, expect={"ratio": 0.5})
    # the file's builder now makes a smaller model: its weights do not fit
    fields, _ = built_model.read_header(path)
    fields["builder_kwargs"] = json.dumps({**DEIT_KWARGS, "embed_dim": 16})
    with pytest.raises(ValueError, match=r"saved shapes do not fit the builder's model"):
        built_model.load_built(path, fields, built_model.read_header(path)[1])


def test_a_foreign_safetensors_file_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match=r"is a safetensors file but not a pruned model"):
        load_pruned(path)


VIT = "torchvision.models.vision_transformer:VisionTransformer"
VIT_KWARGS = dict(image_size=16, patch_size=4, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=64)
SWIN = "torchvision.models.swin_transformer:SwinTransformer"
SWIN_KWARGS = dict(patch_size=[4, 4], embed_dim=16, depths=[2], num_heads=[4], window_size=[2, 2])


@pytest.mark.parametrize(
    ("builder", "kwargs", "layer", "replaced"),
    [
        (
            VIT,
            VIT_KWARGS,
            "encoder.layers.encoder_layer_0.self_attention",
            "PrunedMultiheadAttention",
        ),
        (SWIN, SWIN_KWARGS, "features.1.0.attn", "PrunedShiftedWindowAttention"),
    ],
)
def test_modules_export_replaced_are_replaced_when_loaded(
    tmp_path, builder, kwargs, layer, replaced
):
    """A layer export gives a class of its own (torch's MultiheadAttention, torchvision's
    shifted-window attention, with fewer heads) is saved by name and class and loaded as
    that class: the loaded model computes what the exported one does."""
    torch.manual_seed(0)
    model = built_model.build(builder, kwargs).eval()
    x = torch.randn(2, 3, 16, 16)
    exported = DTPPruner(model, (x[:1],), {"heads": 0.5}).export().eval()
    assert type(exported.get_submodule(layer)).__name__ == replaced
    path = tmp_path / "model.safetensors"
    save_pruned(path, exported, builder=builder, builder_kwargs=kwargs)
    fields, _ = built_model.read_header(path)
    module = type(exported.get_submodule(layer)).__module__  # where the class is now
    assert json.loads(fields["replaced"])[layer] == f"{module}:{replaced}"
    loaded = load_pruned(path).eval()
    assert type(loaded.get_submodule(layer)).__name__ == replaced
    assert loaded.get_submodule(layer).num_heads == 2
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), exported(x), rtol=0, atol=0)


def test_a_module_of_another_class_than_the_builders_is_refused(tmp_path):
    """A module whose class is not the builder's and not one export makes would be
    loaded as the builder's class: saving with a builder refuses it by name; a file
    naming a class export does not make, or a replacement of another class, is refused
    on loading."""
    torch.manual_seed(0)
    model = built_model.build(SWIN, SWIN_KWARGS).eval()
    model.features[1][0].mlp[1] = torch.nn.ReLU()  # the builder's has a GELU
    with pytest.raises(ValueError, match=r"module 'features.1.0.mlp.1' is a ReLU where the"):
        save_pruned(tmp_path / "a", model, builder=SWIN, builder_kwargs=SWIN_KWARGS)
    assert not (tmp_path / "a").exists()

    exported = DTPPruner(model.train(), (torch.randn(1, 3, 16, 16),), {"heads": 0.5}).export()
    exported.features[1][0].mlp[1] = torch.nn.GELU()
    path = tmp_path / "swin.safetensors"
    save_pruned(path, exported, builder=SWIN, builder_kwargs=SWIN_KWARGS)
    fields, shapes = built_model.read_header(path)
    fields["replaced"] = json.dumps({"features.1.0.attn": "os:system"})
    with pytest.raises(ValueError, match=r"replaced by 'os:system', which is not a class export"):
        built_model.load_built(path, fields, shapes)
    # the class's name, and the one files of earlier versions give it (it has moved)
    for name in ("multihead_attention", "heads"):
        fields["replaced"] = json.dumps(
            {"features.1.0.norm1": f"dtp_kernels.pruning.{name}:PrunedMultiheadAttention"}
        )
        with pytest.raises(ValueError, match=r"'features.1.0.norm1' of the builder's model is "):
            built_model.load_built(path, fields, shapes)


def test_a_version_3_file_without_replaced_modules_still_loads(tmp_path):
    """Files written before export's replacements were recorded (version 3: no
    "replaced" field) load as before."""
    from safetensors.torch import load_file, save_file

    exported, x = pruned_deit()
    path = tmp_path / "deit.safetensors"
    save_pruned(path, exported, builder=DEIT, builder_kwargs=DEIT_KWARGS)
    fields, _ = built_model.read_header(path)
    assert fields.pop("replaced") == "{}"
    save_file(load_file(str(path)), str(path), metadata={**fields, "version": "3"})
    with torch.no_grad():
        torch.testing.assert_close(load_pruned(path).eval()(x), exported(x), rtol=0, atol=0)
    save_file(load_file(str(path)), str(path), metadata={**fields, "version": "2"})
    with pytest.raises(ValueError, match=r"not a pruned model saved .* \(format .*version '2'"):
        load_pruned(path)
