"""A failed export names the groups to blame (export_blame.py): the group testing on its
own, then DTPPruner.export() on models where a few groups break the export and the
rest do not. A transformers test: DPT's readout projections, whose outputs its neck
reshapes to the backbone's width."""

import pytest
import torch
from torch import nn

from dtp_kernels.pruning import DTPPruner, ExportMismatchError
from dtp_kernels.pruning.export_blame import culprit_groups


def _tester(culprits: set[int], together: set[int] = frozenset(), log: list | None = None):
    """export_fails for a model where each of `culprits` fails alone and `together`
    fails only when all of it is pruned."""

    def export_fails(subset):
        if log is not None:
            log.append(list(subset))
        chosen = set(subset)
        return bool(chosen & culprits) or (bool(together) and together <= chosen)

    return export_fails


@pytest.mark.parametrize("culprits", [{0}, {7}, {3, 4}, {0, 9, 17}, set(range(20))])
def test_group_testing_finds_each_culprit(culprits):
    assert culprit_groups(list(range(20)), _tester(culprits)) == sorted(culprits)


def test_groups_that_fail_only_together_are_named_together():
    assert culprit_groups(list(range(8)), _tester(set(), {2, 5})) == [0, 1, 2, 3, 4, 5, 6, 7]
    # a lone culprit beside the pair: the pair's half is named whole, the culprit alone
    assert culprit_groups(list(range(8)), _tester({6}, {0, 1})) == [0, 1, 6]


def test_one_culprit_costs_about_two_trials_per_halving():
    log = []
    assert culprit_groups(list(range(64)), _tester({37}, log=log)) == [37]
    assert len(log) <= 2 * 6  # 64 = 2**6: both halves of each failing set


def test_out_of_trials_or_an_undecided_trial_gives_none():
    assert culprit_groups(list(range(64)), _tester({1, 40}), trials=3) is None
    assert culprit_groups(list(range(4)), lambda subset: None) is None


class _ReadoutReshape(nn.Module):
    """`proj`'s output reshaped to its input's shape (DPT's readout projection): cut, it
    no longer fits. With `input_residual`, fc2's output is added to the model's input,
    which no layer makes and export cannot cut."""

    def __init__(self, input_residual: bool = False) -> None:
        super().__init__()
        self.input_residual = input_residual
        self.embed = nn.Linear(8, 8)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.proj, self.out = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.input_residual else self.embed(x)
        h = h + self.fc2(torch.relu(self.fc1(h)))
        r = self.proj(h).reshape(h.shape)
        return self.out(torch.relu(r)).mean(1)


X = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))


def test_the_error_names_the_groups_that_break_the_export_and_their_ratios():
    torch.manual_seed(0)
    model = _ReadoutReshape()
    pruner = DTPPruner(model, X, 0.5)
    assert [g.name for g in pruner.groups] == ["fc1", "proj"]
    masks = pruner.hard_masks()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ExportMismatchError) as caught:
        pruner.export()
    message = str(caught.value)
    assert "fails on the example inputs" in message
    assert "only the groups ['proj'] pruned" in message
    assert "ratios={'*': 0.5, 'proj': 0}" in message
    # the trials leave the pruner and the model as they were
    assert all(torch.equal(a, b) for a, b in zip(pruner.hard_masks(), masks, strict=True))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert pruner._trial_masks is None
    # the ratios the error gives export, equal to the hard-masked model
    pruner.remove()
    pruner = DTPPruner(model, X, {"*": 0.5, "proj": 0})
    with torch.no_grad(), pruner.hard_masked():
        want = model(X)
    exported = pruner.export()
    torch.testing.assert_close(exported(X), want)
    assert exported.fc1.out_features == 8 and exported.proj.out_features == 8


def test_a_group_added_to_the_model_input_is_named_too():
    """fc2's output is added to the input: cut, the sum fails; proj fails as above."""
    torch.manual_seed(0)
    pruner = DTPPruner(_ReadoutReshape(input_residual=True), X, 0.5)
    assert [g.name for g in pruner.groups] == ["fc1", "fc2", "proj"]
    with pytest.raises(ExportMismatchError, match=r"only the groups \['fc2', 'proj'\] pruned"):
        pruner.export()


def test_without_enough_trials_the_error_says_so(monkeypatch):
    import dtp_kernels.pruning.pruner as pruner_module

    monkeypatch.setattr(pruner_module, "TRIAL_EXPORTS", 1)
    torch.manual_seed(0)
    pruner = DTPPruner(_ReadoutReshape(), X, 0.5)
    with pytest.raises(ExportMismatchError, match=r"not found within 1 trial exports"):
        pruner.export()
    assert pruner._trial_masks is None


def test_dpt_readout_projections_are_named():
    """transformers' DPT: the neck reshapes each readout projection's output to the
    backbone's hidden states; the error names exactly those four layers."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DPTConfig(
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
        backbone_out_indices=[0, 1, 2, 3],
        neck_hidden_sizes=[8, 16, 16, 16],
        fusion_hidden_size=16,
        head_in_index=-1,
    )
    torch.manual_seed(0)
    model = transformers.DPTForSemanticSegmentation(config).eval()
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    pruner = DTPPruner(model, image, 0.5)
    with pytest.raises(ExportMismatchError) as caught:
        pruner.export()
    readouts = [f"neck.reassemble_stage.readout_projects.{i}.0" for i in range(4)]
    assert f"only the groups {readouts} pruned" in str(caught.value)
    pruner.remove()
    ratios = {"*": 0.5, **dict.fromkeys(readouts, 0)}
    pruner = DTPPruner(model, image, ratios)
    with torch.no_grad(), pruner.hard_masked():
        want = model(image).logits
    with torch.no_grad():
        got = pruner.export().eval()(image).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
