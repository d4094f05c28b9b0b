"""DTPPruner and the baselines on the paper's CIFAR networks (small inputs, random weights)."""

import math

import pytest
import torch
from torch.nn.utils import parametrize
from torch.utils._python_dispatch import TorchDispatchMode

import dtp_kernels
from dtp_kernels import DTPPruner, L1Pruner, RandomPruner, load_pruned, save_pruned
from dtp_kernels.models import resnet20, resnet56, vgg19_bn
from dtp_kernels.pruning.cost import count_flops, count_params

X1 = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
XB = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
CASES = [
    (resnet20, 0.3),
    (resnet20, 0.9),
    (resnet56, 0.5),
    (vgg19_bn, "[0:0, 1-15:0.5]"),
    (vgg19_bn, 0.7),
]


def build(make, ratio, **kwargs):
    torch.manual_seed(0)
    model = make()
    return model, DTPPruner(model, X1, ratio, **kwargs)


@pytest.mark.parametrize("make,ratio", CASES)
def test_kept_counts_are_exact(make, ratio):
    _, pruner = build(make, ratio)
    for group, mask, k in zip(pruner.groups, pruner.hard_masks(), pruner.kept, strict=True):
        p = pruner.ratios[group.name]
        assert k == max(1, group.size - math.ceil(group.size * p - 1e-9))
        assert int(mask.sum()) == k and set(mask.unique().tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("make,ratio", CASES[:3])
def test_gradients_reach_every_score(make, ratio):
    model, pruner = build(make, ratio)
    model.train()
    model(XB).square().sum().backward()
    assert pruner.scores.grad is not None and torch.all(pruner.scores.grad != 0)


@pytest.mark.parametrize("make,ratio", CASES)
def test_export_equals_hard_masked_model_and_report(make, ratio):
    model, pruner = build(make, ratio)
    model.train()
    optimizer = torch.optim.SGD([*model.parameters(), *pruner.parameters()], lr=0.01)
    pruner.attach(optimizer)
    for _ in range(2):  # move the scores and the state a little first
        optimizer.zero_grad()
        model(XB).square().mean().backward()
        optimizer.step()
    report = pruner.report()
    exported = pruner.export()
    assert count_params(exported) == report["params_after"] < report["params_before"]
    assert count_flops(exported, X1) == report["flops_after"] < report["flops_before"]
    model.eval()
    exported.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(XB)
    torch.testing.assert_close(exported(XB), want, rtol=1e-4, atol=1e-5)
    assert not any(parametrize.is_parametrized(m) for m in exported.modules())
    assert all(g["mass_in_top_k"] >= 0 and g["distance_to_hard"] >= 0 for g in report["groups"])


# Paper, Table 1 "Sparsity / Speedup" (sparsity in % of parameters, speed-up in FLOPs).
TABLE1 = [
    (resnet56, 0.5, 49.82, 1.99),
    (resnet56, 0.7, 70.57, 3.59),
    (resnet56, 0.9, 90.39, 11.41),
    (resnet56, 0.925, 93.43, 14.76),
    (resnet56, 0.95, 95.19, 19.31),
    (vgg19_bn, "[0:0, 1-15:0.5]", 74.87, 3.60),
    (vgg19_bn, "[0:0, 1-15:0.6]", 84.00, 5.41),
    (vgg19_bn, "[0:0, 1-15:0.7]", 90.98, 8.84),
    (vgg19_bn, "[0:0, 1-15:0.8]", 95.95, 17.30),
    (vgg19_bn, "[0:0, 1-15:0.9]", 98.96, 44.22),
]


@pytest.mark.parametrize("make,ratio,sparsity,speedup", TABLE1)
def test_table1_sparsity_and_speedup(make, ratio, sparsity, speedup):
    _, pruner = build(make, ratio)
    exported = pruner.export()
    got_sparsity = 100 * (1 - count_params(exported) / count_params(make()))
    got_speedup = count_flops(make(), X1) / count_flops(exported, X1)
    assert abs(got_sparsity - sparsity) <= 0.3, (got_sparsity, sparsity)
    assert abs(got_speedup / speedup - 1) <= 0.05, (got_speedup, speedup)


def test_activation_masking_equals_parameter_masking():
    model_p, _ = build(resnet20, 0.5)
    model_a, _ = build(resnet20, 0.5, mask_at="activation")
    model_a.load_state_dict(model_p.state_dict(), strict=False)
    for model in (model_p, model_a):
        model.train()
    torch.testing.assert_close(model_a(XB), model_p(XB), rtol=1e-5, atol=1e-6)
    assert not any(parametrize.is_parametrized(m) for m in model_a.modules())


def test_attach_commits_after_each_step():
    model, pruner = build(resnet20, 0.5)
    optimizer = torch.optim.SGD(pruner.parameters(), lr=0.1)
    pruner.attach(optimizer)
    for step in range(3):
        model(XB).sum().backward()
        optimizer.step()
        assert int(pruner.state.steps) == step + 1


def test_eval_forward_does_not_advance_state():
    model, pruner = build(resnet20, 0.5)
    model.eval()
    model(XB)
    pruner.state.commit()
    assert int(pruner.state.steps) == 0


def test_parameters_loaded_with_assign_are_the_ones_the_fold_masks():
    """load_state_dict(assign=True) puts new tensors in the BNs (the fold multiplies them
    by the masks all at once): the model then computes, and trains, what an in-place load
    of the same values gives."""
    results = []
    for assign in (False, True):
        model, pruner = build(resnet20, 0.5)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        for key in state:
            if key.endswith(".original"):  # the BNs' weights and biases under the masks
                state[key] = torch.rand_like(state[key]) + 0.5
        model.load_state_dict(state, assign=assign)
        out = model(XB)
        out.square().mean().backward()
        masked = (m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
        bn = next(m for m in masked if parametrize.is_parametrized(m)).parametrizations
        results.append((out.detach(), bn.weight.original.grad.clone(), pruner.scores.grad.clone()))
    for loaded, assigned in zip(*results, strict=True):
        torch.testing.assert_close(assigned, loaded)
    exported = pruner.export()  # keeps none of the pruner's hooks
    assert not any(m._load_state_dict_post_hooks for m in exported.modules())


def test_a_model_moved_without_its_pruner_is_refused_by_name():
    """model.to() does not move the pruner (a module of its own, like an optimizer's
    state): the next forward names both devices and the call that fixes it, before the
    mask step reads the scores. Moved too, the pruner masks the model's new parameter
    tensors (a move to the meta device replaces them; to a GPU it does not: the model
    and pruner moved together train in tests/pipeline/test_activation_memory.py)."""
    model, pruner = build(resnet20, 0.5)
    model.to("meta")  # a second device on any machine
    with pytest.raises(RuntimeError, match=r"parameters are on meta but the pruner's .* on cpu"):
        model(XB.to("meta"))
    assert int(pruner.state.steps) == 0
    pruner.to("meta")
    assert model(XB.to("meta")).shape == (4, 10)


def test_pruner_is_built_and_exported_under_no_grad():
    """Torch-Pruning traces the graph through autograd; the pruner turns it on for that
    trace, so building and exporting inside torch.no_grad() (an evaluation script's
    habit) work and give what they give outside it."""
    with torch.no_grad():
        model, pruner = build(resnet20, 0.5)
        exported = pruner.export()
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(XB)
    torch.testing.assert_close(exported.eval()(XB), want, rtol=1e-5, atol=1e-5)
    assert torch.is_grad_enabled()


def test_a_kind_the_model_lacks_may_be_named_with_ratio_zero():
    _, pruner = build(resnet20, {"channels": 0.5, "heads": 0.0, "mlp": 0})
    assert len(pruner.groups) == 9


class FusedGateUp(torch.nn.Module):
    """A plain MLP beside a fused gate-and-up projection chunked in two (Phi-3's form):
    gate channel i and up channel i + 16 come and go together."""

    def __init__(self):
        super().__init__()
        self.plain, self.plain_out = torch.nn.Linear(8, 12), torch.nn.Linear(12, 8)
        self.gate_up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(16, 8)

    def forward(self, x):
        x = self.plain_out(torch.relu(self.plain(x)))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


def test_a_projection_chunked_into_gate_and_up_prunes_its_pairs_as_units():
    """The group's unit is gate channel i with up channel i + 16: 16 units, the mask on
    the down projection's input columns, scores from both rows of each pair, and the
    export keeps both halves of exactly the units asked for."""
    torch.manual_seed(0)
    model, x = FusedGateUp(), torch.randn(4, 8)
    pruner = DTPPruner(model, x[:1], {"plain": 0.5, "gate_up": 0.5})
    assert [(g.name, g.size) for g in pruner.groups] == [("plain", 12), ("gate_up", 16)]
    weight = model.gate_up.weight.detach()
    want_scores = torch.cat([weight[:16], weight[16:]], dim=1).norm(dim=1)
    torch.testing.assert_close(pruner.scores[12:], want_scores)
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
    kept = pruner.hard_masks()[1].nonzero().flatten()
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    exported = pruner.export().eval()
    assert (exported.gate_up.out_features, exported.down.in_features) == (16, 8)
    torch.testing.assert_close(exported.gate_up.weight, weight[torch.cat([kept, kept + 16])])
    torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=1e-5)
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


def test_export_refuses_a_group_that_lost_other_than_its_kept_channels(monkeypatch):
    """The safety net behind that rule: were such a group built, its export (outputs
    equal, half the channels asked for gone) is refused by name."""
    from dtp_kernels.pruning import ExportMismatchError, groups

    monkeypatch.setattr(groups, "_parts", lambda graph, layer: 1)
    torch.manual_seed(0)
    pruner = DTPPruner(FusedGateUp(), torch.randn(1, 8), {"mlp": 0.5})
    assert [(g.name, g.size) for g in pruner.groups] == [
        ("plain", 12),
        ("plain_out", 8),
        ("gate_up", 32),
    ]
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ExportMismatchError, match=r"layer 'gate_up' kept \d+ output"):
        pruner.export()


def test_global_budget():
    _, pruner = build(resnet20, 0.6, budget="global")
    masks = pruner.hard_masks()
    total = sum(pruner.sizes)
    assert len(pruner.kept) == 1 and pruner.kept[0] == total - math.ceil(total * 0.6)
    assert all(m.sum() >= 1 for m in masks)
    assert sum(int(m.sum()) for m in masks) >= pruner.kept[0]


@pytest.mark.parametrize("cls", [L1Pruner, RandomPruner])
def test_baselines_same_interface(cls):
    model = resnet20()
    pruner = cls(model, X1, 0.5)
    masks = pruner.hard_masks()
    assert [int(m.sum()) for m in masks] == pruner.kept
    exported = pruner.export()
    assert count_params(exported) == pruner.report()["params_after"]
    if cls is L1Pruner:
        group, mask = pruner.groups[0], masks[0]
        l1 = group.layer.weight.detach().flatten(1).abs().sum(1)
        assert l1[mask == 1].min() >= l1[mask == 0].max()


def test_save_and_load_pruned_weights_only(tmp_path):
    _, pruner = build(resnet20, 0.5)
    exported = pruner.export().eval()
    path = tmp_path / "pruned.pt"
    save_pruned(path, exported, {"name": "resnet20", "num_classes": 10}, {"ratios": "0.5"})
    torch.load(path, weights_only=True)  # the format allows it
    loaded = load_pruned(path, expect={"name": "resnet20", "ratios": "0.5"}).eval()
    torch.testing.assert_close(loaded(XB), exported(XB))
    assert sum(p.numel() for p in loaded.parameters()) == pruner.report()["params_after"]
    with pytest.raises(ValueError, match=r"ratios = '0.5', expected '0.7'"):
        load_pruned(path, expect={"ratios": "0.7"})
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="is not a pruned model"):
        load_pruned(tmp_path / "other.pt")


def test_pruned_file_from_another_architecture_or_newer_version_is_refused(tmp_path):
    _, pruner = build(resnet20, 0.5)
    payload = {
        "format": "dtp-kernels/pruned-model",
        "version": 2,
        "architecture": {"name": "resnet56", "num_classes": 10},
        "metadata": {},
        "state_dict": pruner.export().state_dict(),
    }
    torch.save(payload, tmp_path / "wrong.pt")  # resnet20 weights labelled resnet56
    with pytest.raises(ValueError, match="saved from another model"):
        load_pruned(tmp_path / "wrong.pt")
    payload["version"] = 3
    torch.save(payload, tmp_path / "newer.pt")
    with pytest.raises(ValueError, match=r"format version 3.*upgrade"):
        load_pruned(tmp_path / "newer.pt")


def test_pickled_module_format_needs_trust(tmp_path):
    _, pruner = build(resnet20, 0.5)
    exported = pruner.export().eval()
    save_pruned(tmp_path / "any.pt", exported)  # no architecture: the module is pickled
    with pytest.raises(ValueError, match="trusted=True"):
        load_pruned(tmp_path / "any.pt")
    loaded = load_pruned(tmp_path / "any.pt", trusted=True).eval()
    torch.testing.assert_close(loaded(XB), exported(XB))


def test_attach_refuses_what_is_no_optimizer():
    pruner = DTPPruner(resnet20(), X1, 0.5)
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer, got str"):
        pruner.attach("sgd")


def test_metadata_is_plain_and_checked_in_every_format(tmp_path):
    """save_pruned refuses metadata it cannot store plainly, naming the entry, before
    writing (a weights-only file would need unpickling, a builder file would not be
    written); the pickled format stores it too, and load_pruned(expect=...) checks it
    there as in the others."""
    model = resnet20()
    with pytest.raises(TypeError, match=r"metadata\['ratios'\]\[1\] is a set"):
        save_pruned(
            tmp_path / "a.pt",
            model,
            {"name": "resnet20", "num_classes": 10},
            metadata={"ratios": [0.5, {0.5}]},
        )
    with pytest.raises(TypeError, match=r"builder_kwargs has the key 3"):
        save_pruned(
            tmp_path / "b", model, builder="dtp_kernels.models:resnet20", builder_kwargs={3: "x"}
        )
    assert not list(tmp_path.iterdir())
    save_pruned(tmp_path / "any.pt", model, metadata={"method": "dtp", "ratio": 0.5})
    assert isinstance(
        load_pruned(tmp_path / "any.pt", expect={"ratio": 0.5}, trusted=True), torch.nn.Module
    )
    with pytest.raises(ValueError, match=r"holds a model with ratio = 0.5, expected 0.7"):
        load_pruned(tmp_path / "any.pt", expect={"ratio": 0.7}, trusted=True)


BAD = [
    (dict(ratios=1.0), ValueError, r"ratio 1.0 is outside \[0, 1\)"),
    (dict(ratios=-0.1), ValueError, r"outside \[0, 1\)"),
    (dict(ratios="[0, 0.5, 0.5]"), ValueError, r"gives 3 stages, the model has 4"),
    (dict(ratios="[0:0, 1-25:0.5]"), ValueError, r"indices \[19, 20, .*the model has 19"),
    (dict(ratios={"layer9.conv1": 0.5}), ValueError, r"match no prunable layer of this model"),
    (
        dict(ratios={"channels": 0.5, "heads": 0.5}),  # a CNN has no heads: nothing silent
        ValueError,
        r"asks to prune \['heads'\], but this model has no group of that kind",
    ),
    (
        dict(ratios={"coupled": 0.3}),  # coupled widths are groups only when asked for
        ValueError,
        r"no group of that kind .*only with prune_coupled=True",
    ),
    (dict(example_inputs=torch.randn(1, 5, 32, 32)), ValueError, r"do not run through"),
    (dict(budget="flops2"), ValueError, r"budget = 'flops2'"),
    (
        dict(granularity="kernel"),
        ValueError,
        r"granularity = 'kernel'; allowed: \['filter', 'weight', 'n:m'\]",
    ),
    (dict(mask_at="weights"), ValueError, r"mask_at = 'weights'"),
    (dict(eps=float("inf")), ValueError, r"eps = inf; it must be a finite number > 0"),
    # ignored layers the model does not have would leave nothing whole, without a word
    (dict(ignored_layers=["layer1.0.conv9"]), ValueError, r"\[0\] = 'layer1.0.conv9' names no"),
    (
        dict(ignored_layers=[torch.nn.Conv2d(3, 16, 3)]),
        ValueError,
        r"\[0\] is a Conv2d that is not",
    ),
    (dict(ignored_layers=["conv1", 3]), TypeError, r"ignored_layers\[1\] is a int; give"),
    (dict(ignored_layers="conv1"), TypeError, r"list .* got str \(put it in a list\)"),
]


@pytest.mark.parametrize("kwargs,error,pattern", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input_leaves_model_untouched(kwargs, error, pattern):
    model = resnet20()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = dict(example_inputs=X1, ratios=0.5)
    args.update(kwargs)
    with pytest.raises(error, match=pattern):
        DTPPruner(model, args.pop("example_inputs"), args.pop("ratios"), **args)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    assert not model._forward_pre_hooks
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_model_with_no_group_is_refused_with_why_each_layer_is_whole():
    """No group at all: the error says why each layer is left whole (the first four),
    not a guess at the cause."""
    with pytest.raises(ValueError) as error:
        DTPPruner(torch.nn.Sequential(torch.nn.Linear(4, 3)), torch.randn(1, 4), 0.5)
    assert str(error.value) == (
        "the ratios prune nothing of this model (no group was found in it; "
        "0: its outputs are the model's outputs: no layer reads them)"
    )
    layers = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(6)))
    fourth = r"; 3: in ignored_layers \(or inside one of them\); and 2 more\)$"
    with pytest.raises(ValueError, match=fourth):
        DTPPruner(layers, torch.randn(1, 4), 0.5, ignored_layers=list(layers))
    with pytest.raises(ValueError, match="it has no convolution or linear layer"):
        DTPPruner(torch.nn.Sequential(torch.nn.ReLU()), torch.randn(1, 4), 0.5)


def test_a_mask_that_fails_to_attach_leaves_the_model_untouched(monkeypatch):
    """An error while the masks go on (the third group's here) takes off the ones
    already attached, with the pruner's hooks: the model is as it was given."""
    model = resnet20()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attach, calls = DTPPruner._attach_mask, []

    def failing(self, mask, group):
        calls.append(group.name)
        if len(calls) == 3:
            raise RuntimeError(f"cannot mask {group.name}")
        attach(self, mask, group)

    monkeypatch.setattr(DTPPruner, "_attach_mask", failing)
    with pytest.raises(RuntimeError, match="cannot mask"):
        DTPPruner(model, X1, 0.5)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    assert not model._forward_pre_hooks and not model._forward_hooks
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    monkeypatch.undo()
    DTPPruner(model, X1, 0.5)  # (no masks of the failed pruner left to refuse)


def test_ignored_layers_by_name_leave_the_same_layers_whole_as_by_module():
    """ignored_layers takes the model's modules or their names alike (the names refusals
    print); a module holding layers leaves them all whole; a model that is no module is
    refused by name."""
    by_module = DTPPruner(resnet20(), X1, 0.5, ignored_layers=[])
    names = [g.name for g in by_module.groups]
    model = resnet20()
    pruned = DTPPruner(model, X1, 0.5, ignored_layers=[model.layer1[0].conv1, "layer2"])
    by_name = DTPPruner(resnet20(), X1, 0.5, ignored_layers=("layer1.0.conv1", "layer2"))
    kept = [n for n in names if n != "layer1.0.conv1" and not n.startswith("layer2.")]
    assert [g.name for g in pruned.groups] == [g.name for g in by_name.groups] == kept
    assert by_name.left_whole["layer2.1.conv1"] == "in ignored_layers (or inside one of them)"
    with pytest.raises(TypeError, match=r"model must be an nn\.Module, got str"):
        DTPPruner("resnet20", X1, 0.5)


MODELS = [
    ("resnet20", 32),
    ("resnet56", 32),
    ("vgg19_bn", 32),
    ("mobilenet_v2", 32),
    ("wrn26", 32),
    ("torchvision.resnet34", 64),
    ("torchvision.resnet50", 64),
    ("torchvision.mobilenet_v2", 64),
]


@pytest.mark.parametrize("name,size", MODELS)
@pytest.mark.parametrize("ratio", [0.3, 0.7])
def test_every_model(name, size, ratio):
    """Exact kept counts, gradients to every score, export == hard-masked model, and the
    exported parameters and FLOPs equal to what report() predicted."""
    from dtp_kernels.models import get_model

    torch.manual_seed(0)
    model = get_model(name)
    x1 = torch.randn(1, 3, size, size)
    xb = torch.randn(2, 3, size, size)
    pruner = DTPPruner(model, x1, ratio)
    model.train()
    model(xb).square().sum().backward()
    assert torch.all(pruner.scores.grad != 0)
    masks = pruner.hard_masks()
    assert [int(m.sum()) for m in masks] == pruner.kept
    report = pruner.report()
    exported = pruner.export()
    assert count_params(exported) == report["params_after"]
    assert count_flops(exported, x1) == report["flops_after"]
    model.eval()
    exported.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(xb)
    torch.testing.assert_close(exported(xb), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make", [resnet20, vgg19_bn])
def test_flops_budget(make):
    """Learned kept ratios: F(alpha) at alpha = k/n equals the exported FLOPs ratio, the
    task loss and the penalty both reach theta, and the penalty drives F to the budget."""
    from dtp_kernels.models import mobilenet_v2

    for maker in (make, mobilenet_v2):
        model, pruner = build(maker, 0.5, budget="flops")
        report = pruner.report()
        torch.testing.assert_close(
            pruner.flops_ratio().item(), report["flops_after"] / report["flops_before"]
        )
        model.train()
        model(XB).square().sum().backward()
        assert pruner.theta.grad is not None and torch.any(pruner.theta.grad != 0)
        optimizer = torch.optim.SGD([pruner.theta], lr=5.0)
        start = abs(pruner.flops_ratio().item() - 0.3)
        for _ in range(50):
            optimizer.zero_grad()
            pruner.penalty(0.3).backward()
            optimizer.step()
        assert abs(pruner.flops_ratio().item() - 0.3) < 0.2 * start
        masks = pruner.hard_masks()
        assert [int(m.sum()) for m in masks] == pruner.kept_counts()
        exported = pruner.export()
        ratio = count_flops(exported, X1) / report["flops_before"]
        assert abs(ratio - 0.3) < 0.05


def test_penalty_needs_flops_budget():
    _, pruner = build(resnet20, 0.5)
    with pytest.raises(ValueError, match="need budget='flops'"):
        pruner.penalty(0.5)
    _, pruner = build(resnet20, 0.5, budget="flops")
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        pruner.penalty(1.5)


@pytest.mark.parametrize("budget", ["layer", "global"])
def test_weight_granularity(budget):
    """Unstructured DTP: scores |w|, the mask on the weights, exact kept counts; the export
    zeroes exactly the pruned weights and equals the hard-masked model."""
    model, pruner = build(resnet20, 0.8, granularity="weight", budget=budget)
    model.train()
    model(XB).square().sum().backward()
    assert torch.all(pruner.scores.grad != 0)
    masks = pruner.hard_masks()
    if budget == "layer":
        assert [int(m.sum()) for m in masks] == pruner.kept
    else:
        assert sum(int(m.sum()) for m in masks) >= pruner.kept[0]
    exported = pruner.export()
    modules = dict(exported.named_modules())
    zeros = sum(int((modules[g.name].weight == 0).sum()) for g in pruner.groups)
    pruned = sum(int(m.numel() - m.sum()) for m in masks)
    assert zeros == pruned
    report = pruner.report()
    assert report["params_after"] == report["params_before"] - pruned
    model.eval()
    exported.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(XB)
    torch.testing.assert_close(exported(XB), want)


def test_weight_granularity_has_no_flops_budget():
    with pytest.raises(ValueError, match="budget='flops' needs granularity='filter'"):
        DTPPruner(resnet20(), X1, 0.5, granularity="weight", budget="flops")


class _BNAfterSome(torch.nn.Module):
    """The first group has no BN (its conv rows are masked), the others do: the folded
    BN masks cover only some segments of the flat mask."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.c2, self.b2 = torch.nn.Conv2d(8, 7, 3, padding=1), torch.nn.BatchNorm2d(7)
        self.c3, self.b3 = torch.nn.Conv2d(7, 6, 3, padding=1), torch.nn.BatchNorm2d(6)
        self.head = torch.nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.c1(x))
        x = torch.relu(self.b2(self.c2(x)))
        x = torch.relu(self.b3(self.c3(x)))
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("make", [resnet20, _BNAfterSome])
@pytest.mark.parametrize("budget", ["layer", "flops"])
def test_folded_masks_equal_the_per_parameter_product(budget, make):
    """The pruner multiplies all BN parameters by their masks in one foreach op; the same
    model with one product per parameter (the parametrizations' own path) gives the same
    outputs and gradients."""
    results = []
    for fold in (True, False):
        torch.manual_seed(0)
        model = make()
        with torch.no_grad():  # BN weights and biases away from 1 and 0: both are masked
            for bn in (m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)):
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-0.5, 0.5)
        pruner = DTPPruner(model, X1, 0.5, budget=budget)
        if not fold:
            pruner._fold = []  # every parametrization multiplies on its own
        out = model(XB)
        loss = out.square().mean() + (pruner.penalty(0.5) if budget == "flops" else 0)
        loss.backward()
        grads = [p.grad.clone() for p in (*model.parameters(), *pruner.parameters())]
        results.append((out.detach(), grads, pruner.state.pending_log_odds.clone()))
        if fold and make is _BNAfterSome:
            assert pruner._fold_plan.channels is not None  # the placement path ran
    (out_a, grads_a, state_a), (out_b, grads_b, state_b) = results
    torch.testing.assert_close(out_a, out_b, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state_a, state_b, rtol=0, atol=0)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def compiled_fold(mask, plan, params):
    """The C++ fold node (dtp_kernels._C.fold_products), which DTPPruner uses when built."""
    if "cpu" not in dtp_kernels.available_backends("cpu"):
        pytest.skip("dtp_kernels._C is not built")
    return dtp_kernels._C.fold_products(params, mask, plan.channels)


@pytest.mark.parametrize("implementation", ["python", "c++"])
@pytest.mark.parametrize("groups,sizes", [([0, 1], [2, 3]), ([1, 2], [4, 2, 3])])
def test_fold_masks_gradcheck(groups, sizes, implementation):
    """The folded product's values and gradients, float64: BN pairs covering every
    segment, and pairs covering some (the mask gradient placed by channel); the C++ node
    equals the Python ops, and takes outputs without a gradient."""
    from dtp_kernels.pruning.masking import FoldPlan, folded_products

    gen = torch.Generator().manual_seed(0)
    plan = FoldPlan.build(groups, sizes, torch.device("cpu"))
    mask = torch.rand(sum(sizes), generator=gen, dtype=torch.float64, requires_grad=True)
    params = [
        torch.randn(sizes[g], generator=gen, dtype=torch.float64, requires_grad=True)
        for g in groups
        for _ in (0, 1)
    ]
    fold_impl = folded_products if implementation == "python" else compiled_fold
    fold = lambda m, *p: tuple(fold_impl(m, plan, list(p)))  # noqa: E731
    assert torch.autograd.gradcheck(fold, (mask, *params))
    expected = folded_products(mask, plan, params)
    got = fold(mask, *params)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    (got[0].sum() + got[3].pow(2).sum()).backward()  # two products of four
    want = [t.grad.clone() for t in (mask, *params)]
    for t in (mask, *params):
        t.grad = None
    (expected[0].sum() + expected[3].pow(2).sum()).backward()
    for a, t in zip(want, (mask, *params), strict=True):
        torch.testing.assert_close(a, t.grad if t.grad is not None else torch.zeros_like(t))


class RecordOps(TorchDispatchMode):
    """The names of the operators dispatched inside it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _fold_inputs(mask_grad: bool, params_grad: bool):
    from dtp_kernels.pruning.masking import FoldPlan

    gen = torch.Generator().manual_seed(1)
    plan = FoldPlan.build([1, 2], [4, 2, 3], torch.device("cpu"))
    mask = torch.rand(9, generator=gen, dtype=torch.float64).requires_grad_(mask_grad)
    params = [
        torch.randn(n, generator=gen, dtype=torch.float64).requires_grad_(params_grad)
        for n in (2, 2, 3, 3)
    ]
    return plan, mask, params


@pytest.mark.parametrize("mask_grad,params_grad", [(True, False), (False, True)])
def test_fold_node_computes_only_the_gradients_asked_for(mask_grad, params_grad):
    """A frozen mask or frozen BN parameters: the node's gradients of what requires grad
    equal the Python ops', and nothing else gets one."""
    from dtp_kernels.pruning.masking import folded_products

    plan, mask, params = _fold_inputs(mask_grad, params_grad)
    got = compiled_fold(mask, plan, params)
    assert got[0].grad_fn.name() == "dtp::FoldProductsBackward"
    sum(t.pow(2).sum() for t in got).backward()
    want_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in (mask, *params)]
    expected = folded_products(want_inputs[0], plan, want_inputs[1:])
    sum(t.pow(2).sum() for t in expected).backward()
    for a, b in zip((mask, *params), want_inputs, strict=True):
        assert (a.grad is None) == (not a.requires_grad)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_fold_node_records_nothing_without_grad_and_guards_its_saved_inputs():
    """No graph under no_grad; a second backward and a mask changed in place before
    backward raise autograd's errors instead of giving wrong gradients."""
    plan, mask, params = _fold_inputs(True, True)
    with torch.no_grad():
        products = compiled_fold(mask, plan, params)
    assert all(t.grad_fn is None and not t.requires_grad for t in products)
    out = compiled_fold(mask, plan, params)
    out[0].sum().backward(retain_graph=False)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out[1].sum().backward()
    out = compiled_fold(mask, plan, params)
    with torch.no_grad():
        mask.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out[0].sum().backward()


def test_fold_node_refuses_forward_mode_ad():
    """Dual BN parameters raise instead of losing their tangent."""
    import torch.autograd.forward_ad as forward_ad

    plan, mask, params = _fold_inputs(False, False)
    with forward_ad.dual_level():
        params[1] = forward_ad.make_dual(params[1], torch.ones_like(params[1]))
        with pytest.raises(RuntimeError, match="forward-mode AD"):
            compiled_fold(mask, plan, params)


def test_fold_node_under_a_dispatch_mode_splits_through_the_dispatcher():
    """Under a TorchDispatchMode the node's outputs are cut by split_with_sizes, which the
    mode sees, instead of being built on the product's storage; the values are the same."""
    plan, mask, params = _fold_inputs(True, True)
    plain = compiled_fold(mask, plan, params)
    with RecordOps() as record:
        recorded = compiled_fold(mask, plan, params)
    assert any("split_with_sizes" in op for op in record.ops)
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded, strict=True))


@pytest.mark.parametrize(
    "param_dtype,mask_dtype", [(torch.float32, torch.float64), (torch.float64, torch.float32)]
)
def test_fold_node_with_a_mask_of_another_dtype(param_dtype, mask_dtype):
    """Products in the parameters' dtype and the mask's gradient in the mask's, as the
    Python ops give them (a half-precision model under float32 scores, say)."""
    from dtp_kernels.pruning.masking import FoldPlan, folded_products

    gen = torch.Generator().manual_seed(2)
    plan = FoldPlan.build([0, 1], [2, 3], torch.device("cpu"))
    mask = torch.rand(5, generator=gen, dtype=mask_dtype, requires_grad=True)
    params = [
        torch.randn(n, generator=gen, dtype=param_dtype, requires_grad=True) for n in (2, 2, 3, 3)
    ]
    got = compiled_fold(mask, plan, params)
    leaves = [t.detach().clone().requires_grad_(True) for t in (mask, *params)]
    expected = folded_products(leaves[0], plan, leaves[1:])
    assert [t.dtype for t in got] == [t.dtype for t in expected] == [param_dtype] * 4
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    want = torch.autograd.grad(sum(t.sum() for t in expected), leaves[0])[0]
    # the node itself, not through the engine (which would convert a wrong dtype)
    grad_mask = got[0].grad_fn(*[torch.ones_like(t) for t in got])[-1]
    assert grad_mask.dtype == mask_dtype
    torch.testing.assert_close(grad_mask, want, rtol=0, atol=0)


def test_fold_node_backward_dispatches_no_op_per_parameter():
    """The backward's operators do not grow with the number of BN parameters: a reshape
    or a view of each parameter's gradient would be a dispatch each, 66 per ResNet-50
    step, which an eager GPU step pays in host time."""
    from dtp_kernels.pruning.masking import FoldPlan

    recorded = {}
    for pairs in (2, 6):
        plan = FoldPlan.build(list(range(pairs)), [3] * pairs, torch.device("cpu"))
        mask = torch.rand(3 * pairs, dtype=torch.float64, requires_grad=True)
        params = [torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(2 * pairs)]
        out = compiled_fold(mask, plan, params)
        grads = [torch.ones(3, dtype=torch.float64) for _ in out]
        with RecordOps() as record:
            got = out[0].grad_fn(*grads)
        assert len(got) == 2 * pairs + 1 and all(g is not None for g in got)
        recorded[pairs] = record.ops
    assert recorded[2] == recorded[6], recorded


def test_folded_bn_weight_read_after_a_step_is_current():
    """Reading a masked BN weight outside forward after the optimizer changed it gives
    the product with the new weight, not the cached one."""
    from dtp_kernels.models import resnet20

    torch.manual_seed(0)
    model = resnet20()
    pruner = DTPPruner(model, X1, 0.5)
    model(XB).sum().backward()
    bn = pruner.groups[0].bn
    with torch.no_grad():
        bn.parametrizations.weight.original.add_(1.0)
    mask = pruner._source.masks[0]
    torch.testing.assert_close(bn.weight, bn.parametrizations.weight.original * mask)
    # within a forward (after the pre-hook folded the masks), a weight changed in place
    # since the fold is read through parametrize, not from the fold
    pruner._compute_masks(model, ())
    assert bn.weight is pruner._source.folded[0]  # the fold's product while unchanged
    with torch.no_grad():
        bn.parametrizations.weight.original.add_(1.0)
    mask = pruner._source.masks[0]
    torch.testing.assert_close(bn.weight, bn.parametrizations.weight.original * mask)


class _ConvGroupNorm(torch.nn.Module):
    """conv -> norm -> ReLU, then conv -> BN -> ReLU: a mask on the first conv's rows
    would be renormalized away by a GroupNorm (or meet an InstanceNorm's bias)."""

    def __init__(self, norm: str = "group") -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = (
            torch.nn.GroupNorm(2, 8) if norm == "group" else torch.nn.InstanceNorm2d(8, affine=True)
        )
        self.c2, self.bn = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.c1(x)))
        x = torch.relu(self.bn(self.c2(x)))
        return self.head(x.mean((2, 3)))


def _randomize_norms(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for module in model.modules():
            if "Norm" in type(module).__name__ and getattr(module, "weight", None) is not None:
                module.weight.uniform_(0.5, 1.5)
                if getattr(module, "bias", None) is not None:
                    module.bias.uniform_(-0.5, 0.5)


@pytest.mark.parametrize("mask_at", ["auto", "activation"])
@pytest.mark.parametrize("norm", ["group", "instance"])
def test_groups_through_group_and_instance_norms_export_exactly(norm, mask_at):
    """InstanceNorm works per channel (masked at its rows, as a BN); through a GroupNorm
    the unit is one of its groups, so the other groups' statistics stay as they were.
    Export equals the hard-masked model with the kept counts asked for, and the norm
    parameters are not left at their defaults (they would hide a wrong placement)."""
    torch.manual_seed(0)
    model = _ConvGroupNorm(norm)
    _randomize_norms(model)
    pruner = DTPPruner(model, X1, 0.5, mask_at=mask_at)
    first = pruner.groups[0]
    assert first.name == "c1" and first.size == (2 if norm == "group" else 8)
    assert pruner.kept[0] == first.size // 2
    model.train()
    model(XB).square().mean().backward()
    assert torch.all(pruner.scores.grad != 0)
    exported = pruner.export()  # checked against the hard-masked model
    assert exported.c1.out_channels == 4 and exported.c2.in_channels == 4
    if norm == "group":
        assert (exported.norm.num_groups, exported.norm.num_channels) == (1, 4)
    assert count_params(exported) == pruner.report()["params_after"]


class _ChannelMean(torch.nn.Module):
    """conv -> BN -> an op with the mean over channels -> ReLU: an op Torch-Pruning sees
    as elementwise, but removing a channel changes the mean. `form` "gate" multiplies
    each channel by it (a masked channel stays zero, so the readers' proof passes and
    only export's check can tell); "centered" subtracts it (a masked channel reads minus
    the mean: the proof fails and the group is left whole)."""

    def __init__(self, form: str = "gate") -> None:
        super().__init__()
        self.form = form
        self.c1, self.b1 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b1(self.c1(x))
        mean = x.mean(dim=1, keepdim=True)
        x = x - mean if self.form == "centered" else x * (3 * mean).sigmoid()
        x = torch.relu(self.c2(torch.relu(x)))
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_that_would_differ_from_the_masked_model_raises(dtype):
    """In bfloat16 too, where the check allows the dtype's rounding: the outputs, of
    order 1 here, are off by about a tenth."""
    from dtp_kernels.pruning import ExportMismatchError

    torch.manual_seed(0)
    model = _ChannelMean()
    with torch.no_grad():
        model.b1.bias.uniform_(-1, 1)
        model.head.weight.mul_(10)
    model = model.to(dtype)
    pruner = DTPPruner(model, X1.to(dtype), 0.5)
    assert [g.name for g in pruner.groups] == ["c1", "c2"]
    with pytest.raises(ExportMismatchError, match=r"differs from the hard-masked model's by"):
        pruner.export()
    # the channel mean reads c1's channels; c2's are read by ReLU and the head only
    with pytest.raises(ExportMismatchError, match=r"only the groups \['c1'\] pruned"):
        pruner.export()


def test_channels_a_reader_sees_unmasked_are_left_whole():
    """The channel mean subtracted after the mask: a masked channel would read minus the
    mean, not zero, so c1's group is left whole before anything is masked."""
    torch.manual_seed(0)
    pruner = DTPPruner(_ChannelMean("centered"), X1, 0.5)
    assert [g.name for g in pruner.groups] == ["c2"]


@pytest.mark.parametrize("api", ["legacy", "new"])
def test_export_check_runs_float32_without_tf32(api):
    """The export check compares the masked and the exported model in full float32: with
    cuDNN's default TF32 convolutions (and recurrent layers) on a GPU they differ by
    ~1e-3 (seen on an H200), over the check's tolerance. Both forwards see TF32 off and
    the user's settings return, whether they were made with the legacy `allow_tf32`
    flags or the fp32_precision API (after which reading the legacy flags raises)."""
    matmul, conv, rnn = (
        torch.backends.cuda.matmul,
        torch.backends.cudnn.conv,
        torch.backends.cudnn.rnn,
    )
    model = resnet20()
    pruner = DTPPruner(model, torch.randn(1, 3, 32, 32), 0.5)
    seen = []  # (which model, precisions) per forward; the check's two forwards come last

    def record(name):
        seen.append((name, (matmul.fp32_precision, conv.fp32_precision, rnn.fp32_precision)))

    before = matmul.fp32_precision, conv.fp32_precision, rnn.fp32_precision
    if api == "legacy":
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    else:
        matmul.fp32_precision = conv.fp32_precision = rnn.fp32_precision = "tf32"
    try:
        model.register_forward_pre_hook(lambda *_: record("masked"))
        original = torch.nn.Module.__call__

        def call(module, *args, **kwargs):  # the exported copy's forward too
            if module.__class__ is type(model) and module is not model:
                record("exported")
            return original(module, *args, **kwargs)

        torch.nn.Module.__call__ = call
        try:
            pruner.export()
        finally:
            torch.nn.Module.__call__ = original
        after = matmul.fp32_precision, conv.fp32_precision, rnn.fp32_precision
        if api == "legacy":  # still readable the way they were set
            assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    finally:
        matmul.fp32_precision, conv.fp32_precision, rnn.fp32_precision = before
    last = {name: flags for name, flags in seen}
    assert last == {"masked": ("ieee",) * 3, "exported": ("ieee",) * 3}, seen
    assert after == ("tf32",) * 3


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(48, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 24),
        torch.nn.GELU(),
        torch.nn.Linear(24, 5),
    )


@pytest.mark.parametrize("mask_at", ["auto", "activation"])
def test_mlp_hidden_neurons_are_groups(mask_at):
    """Linear-rooted groups: the hidden neurons of an MLP, the classifier's outputs never;
    exact counts, a gradient on every score, export equal to the hard-masked model."""
    torch.manual_seed(0)
    model = _mlp()
    x = torch.randn(8, 3, 4, 4)
    pruner = DTPPruner(model, x[:1], 0.5, mask_at=mask_at)
    assert [(g.name, g.size) for g in pruner.groups] == [("1", 32), ("3", 24)]
    assert pruner.kept_counts() == [16, 12]
    model.train()
    model(x).square().sum().backward()
    assert torch.all(pruner.scores.grad != 0)
    exported = pruner.export()  # checked against the hard-masked model inside
    assert [m.out_features for m in exported.modules() if isinstance(m, torch.nn.Linear)] == [
        16,
        12,
        5,
    ]
    assert count_params(exported) == pruner.report()["params_after"]


@pytest.mark.parametrize("mask_at", ["auto", "activation"])
def test_vision_transformer_mlp_neurons_prune_and_export(mask_at):
    """(batch, tokens, features) activations: the fused epilogue on the last dim."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=10,
    )
    torch.nn.init.normal_(model.heads.head.weight, std=0.1)  # torchvision zero-inits it
    x = torch.randn(4, 3, 32, 32)
    pruner = DTPPruner(model, x[:1], {"mlp": 0.5}, mask_at=mask_at)
    assert [g.name for g in pruner.groups] == [
        f"encoder.layers.encoder_layer_{i}.mlp.0" for i in (0, 1)
    ]
    model.train()
    model(x).square().mean().backward()
    assert torch.all(pruner.scores.grad != 0)
    exported = pruner.export()
    hidden = [m.out_features for n, m in exported.named_modules() if n.endswith("mlp.0")]
    assert hidden == [32, 32] and count_params(exported) == pruner.report()["params_after"]


@pytest.mark.parametrize("bias", [True, False])
def test_linear_group_through_a_token_norm_is_refused(bias):
    """A LayerNorm normalizes each feature by all the others, subtracting their mean: no
    rescaling keeps it exact (an RMS norm is rescaled: test_channel_rms_norms.py), so it
    is refused by name, before any mask goes on."""
    norm_layer = torch.nn.LayerNorm(16, bias=bias)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), norm_layer, torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    name = type(norm_layer).__name__
    with pytest.raises(ValueError, match=rf"layer '0' feeds {name} '1'"):
        DTPPruner(model, torch.randn(1, 5, 8), 0.5)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())


def test_ratios_by_kind_pattern_and_name():
    """A dict of ratios takes module names, fnmatch patterns and kinds of group; a name
    beats a pattern (of two patterns, the first in the dict), a pattern beats a kind."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 3),
    )
    pruner = DTPPruner(model, X1, {"channels": 0.5, "mlp": 0.25, "2": 0.75})
    assert dict(zip([g.name for g in pruner.groups], pruner.kept, strict=True)) == {
        "0": 4,
        "2": 2,
        "6": 12,
    }
    pruner.remove()
    kept = []  # two patterns match "0" and "2": the first gives their ratio
    for ratios in ({"[02]": 0.5, "*": 0.25}, {"*": 0.25, "[02]": 0.5}):
        pruner = DTPPruner(model, X1, ratios)
        kept.append(pruner.kept)
        pruner.remove()
    assert kept == [[4, 4, 12], [6, 6, 12]]
    pruner = DTPPruner(_mlp(), torch.randn(1, 3, 4, 4), {"[13]": 0.5})  # a pattern
    assert pruner.kept == [16, 12]
    kinds = (
        r"kinds: \['channels', 'mlp', 'heads', 'coupled', 'experts', 'mamba', 'whole_experts', "
        r"'linear_attention'\]"
    )
    with pytest.raises(ValueError, match=r"match no prunable layer.*" + kinds):
        DTPPruner(_mlp(), torch.randn(1, 3, 4, 4), {"attention": 0.5})


class _Conv1dNet(torch.nn.Module):
    """Sequence model: Conv1d -> BN1d -> ReLU, twice, then a pooled classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv1d(4, 16, 5, padding=2), torch.nn.BatchNorm1d(16)
        self.c2, self.b2 = torch.nn.Conv1d(16, 12, 3, padding=1), torch.nn.BatchNorm1d(12)
        self.c3 = torch.nn.Conv1d(12, 12, 3, padding=1, groups=12)  # depthwise, no BN
        self.head = torch.nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.c3(torch.relu(self.b2(self.c2(x)))))
        return self.head(x.mean(2))


@pytest.mark.parametrize("mask_at", ["auto", "activation"])
def test_conv1d_groups(mask_at):
    torch.manual_seed(0)
    model = _Conv1dNet()
    with torch.no_grad():
        for bn in (model.b1, model.b2):
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    x = torch.randn(6, 4, 20)
    pruner = DTPPruner(model, x[:1], 0.5, mask_at=mask_at)
    assert [(g.name, g.size) for g in pruner.groups] == [("c1", 16), ("c2", 12)]
    model.train()
    model(x).square().sum().backward()
    assert torch.all(pruner.scores.grad != 0)
    exported = pruner.export()  # checked against the hard-masked model inside
    assert [exported.c1.out_channels, exported.c2.out_channels, exported.c3.groups] == [8, 6, 6]
    report = pruner.report()
    assert count_params(exported) == report["params_after"]
    assert count_flops(exported, x[:1]) == report["flops_after"] < report["flops_before"]


class _SigmoidGatedMLP(torch.nn.Module):
    """down(sigmoid(gate(x)) * up(x)): the gate's value at 0 is 0.5, so a mask on the
    gate's rows would leave a removed neuron's output at up(x) / 2; the mask must go on
    the down projection's columns."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = torch.nn.Linear(8, 24), torch.nn.Linear(8, 24)
        self.down = torch.nn.Linear(24, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.sigmoid(self.gate(x)) * self.up(x))


class _TanhGeluGatedMLP(torch.nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)) with the GELU written out as T5's is:
    0.5 g (1 + tanh(c (g + 0.044715 g^3))), two additions inside each channel."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = torch.nn.Linear(8, 24), torch.nn.Linear(8, 24)
        self.down = torch.nn.Linear(24, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)
        gelu = 0.5 * g * (1.0 + torch.tanh(0.7978845608 * (g + 0.044715 * g**3)))
        return self.down(gelu * self.up(x))


@pytest.mark.parametrize("mlp", [_SigmoidGatedMLP, _TanhGeluGatedMLP])
def test_gated_mlp_is_masked_on_the_consumer_columns(mlp):
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(4, 5, 8)
    pruner = DTPPruner(model, x[:1], 0.5)
    (group,) = pruner.groups
    assert group.gated and pruner.kept == [12]
    assert parametrize.is_parametrized(model.down, "weight")
    assert not parametrize.is_parametrized(model.gate) and not parametrize.is_parametrized(model.up)
    model(x).square().mean().backward()
    assert torch.all(pruner.scores.grad != 0)
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
    exported = pruner.export()  # raises unless equal to the hard-masked model
    assert (exported.gate.out_features, exported.up.out_features) == (12, 12)
    assert exported.down.in_features == 12


class _ConvStarMLP(torch.nn.Module):
    """StarNet's star operation: down(relu6(f1(x)) * f2(x)) with 1x1 convs into a 3x3
    conv, no norm between: the same gating in convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.f1, self.f2 = torch.nn.Conv2d(8, 24, 1), torch.nn.Conv2d(8, 24, 1)
        self.down = torch.nn.Conv2d(24, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.relu6(self.f1(x)) * self.f2(x))


def test_a_gated_conv_mlp_is_masked_on_the_consumer_columns():
    """A mask on f1's rows would leave its bias, so relu6(bias) * f2(x) would still reach
    `down`: the mask goes on the consumer conv's input columns, exact whatever the gate
    computes."""
    torch.manual_seed(0)
    model, x = _ConvStarMLP(), torch.randn(4, 8, 6, 6)
    pruner = DTPPruner(model, x[:1], 0.5)
    (group,) = pruner.groups
    assert group.gated and group.name == "f1" and pruner.kept == [12]
    assert parametrize.is_parametrized(model.down, "weight")
    assert not parametrize.is_parametrized(model.f1) and not parametrize.is_parametrized(model.f2)
    model(x).square().mean().backward()
    assert torch.all(pruner.scores.grad != 0)
    with torch.no_grad():
        pruner.scores.uniform_(0, 1, generator=torch.Generator().manual_seed(1))
        removed = pruner.hard_masks()[0] == 0
        with pruner.hard_masked():
            assert torch.all(model.down.weight[:, removed] == 0)
    exported = pruner.export()  # raises unless equal to the hard-masked model
    assert (exported.f1.out_channels, exported.f2.out_channels) == (12, 12)
    assert exported.down.in_channels == 12


def test_timm_starnet_prunes_its_star_mlps():
    """Each block's f1/f2 product was no group (one group in StarNet-S1 before): now a
    gated group each, and the export equals the hard-masked model."""
    from utils import check_export, drawn_statistics, random_params, randomised

    starnet = pytest.importorskip("timm.models.starnet")
    torch.manual_seed(0)
    model = starnet.StarNet(base_dim=8, depths=[1, 1, 1, 1], num_classes=5)
    model = random_params(drawn_statistics(model), "conv.weight", std=0.1).eval()
    torch.nn.init.normal_(model.head.weight, std=0.1)  # so every kept channel shows
    x = torch.randn(2, 3, 64, 64)
    pruner = randomised(DTPPruner(model, (x[:1],), 0.5))
    gated = [g.name for g in pruner.groups if g.gated]
    assert gated == [f"stages.{i}.1.f1.conv" for i in range(4)]
    assert pruner.kept == [n // 2 for n in pruner.sizes]
    check_export(pruner, model, x)


@pytest.mark.parametrize("make", ["resnet20", "llama"])
def test_a_frozen_model_has_the_groups_of_a_trainable_one(make):
    """The channel graph is traced through autograd: parameters with requires_grad False
    (a model loaded for inference, or frozen to learn the masks alone) are traced as
    trainable ones, and stay frozen."""
    from utils import tiny_llama

    def pruner(frozen: bool) -> DTPPruner:
        torch.manual_seed(0)
        if make == "llama":
            model, example = tiny_llama(vocab=64), torch.randint(0, 64, (1, 8))
        else:
            model, example = resnet20(), torch.randn(1, 3, 32, 32)
        model.requires_grad_(not frozen)
        result = DTPPruner(model, example, 0.5)
        assert all(p.requires_grad != frozen for p in model.parameters())
        return result

    trainable, frozen = pruner(False), pruner(True)
    assert [(g.name, g.size) for g in frozen.groups] == [(g.name, g.size) for g in trainable.groups]
    kinds = {type(g).__name__ for g in frozen.groups}
    assert kinds == ({"HeadGroup", "ChannelGroup"} if make == "llama" else {"ChannelGroup"})


def test_masked_parameters_keep_their_gradient_accumulators():
    """register_parametrization would give every masked parameter a new gradient
    accumulator; DDP's hooks, on the old one when the model was wrapped first, would
    never fire (tests/pipeline/test_distributed.py runs that case on two ranks)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def accumulator(parameter):
        return parameter.view_as(parameter).grad_fn.next_functions[0][0]

    before = {id(p): accumulator(p) for p in net.parameters()}
    DTPPruner(net, torch.randn(2, 8), 0.5)
    masked = net[0].parametrizations.weight.original
    assert all(accumulator(p) is before[id(p)] for p in net.parameters())
    assert accumulator(masked) is before[id(masked)]


@pytest.fixture
def one_rank_group(tmp_path):
    """A torch.distributed process group of this process alone (gloo)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["fsdp2", "fsdp1"])
def test_a_model_with_sharded_parameters_is_refused_before_any_mask(one_rank_group, sharding):
    """FSDP's shards (DTensors for fully_shard, flat parameters for the wrapper) are no
    whole weights to mask: refused, naming the module, instead of a crash later."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if sharding == "fsdp2":
        fully_shard(net[0])
        fully_shard(net)
        message = r"the parameters of '0' and 1 more modules are sharded \(FSDP"
    else:
        net = FullyShardedDataParallel(net, device_id=torch.device("cpu"))
        message = r"the parameters of 'FullyShardedDataParallel' are sharded \(FSDP"
    with pytest.raises(ValueError, match=message + r".*DistributedDataParallel"):
        DTPPruner(net, torch.randn(2, 8), 0.5)
    assert not any(parametrize.is_parametrized(m) for m in net.modules())
