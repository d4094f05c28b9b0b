"""The Hugging Face Trainer's checkpoints of a DTP run (DTPTrainerCallback): a resumed run
ends bitwise equal to one that never stopped, the model's files load into the model as it
was built, and a resume that cannot continue the DTP run is refused before any mask."""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.utils import parametrize

from utils import tiny_llama

transformers = pytest.importorskip("transformers")
from dtp_kernels.integrations.huggingface import CHECKPOINT_FILE, DTPTrainerCallback  # noqa: E402

IDS = torch.randint(0, 61, (16, 12), generator=torch.Generator().manual_seed(1))
DATA = [{"input_ids": row, "labels": row} for row in IDS]
EXAMPLE = {"input_ids": IDS[:1], "attention_mask": torch.ones(1, 12, dtype=torch.long)}
RATIOS = {"heads": 0.5, "mlp": 0.5}


def train(
    output_dir, resume=None, callback=None, max_steps=6, model=None, batch=4, before=(), **options
):
    """Six steps of a tiny Llama (a warm-up and a linear decay: the scores' learning rate
    changes every step), a checkpoint every two; ``before``: callbacks ahead of DTP's."""
    callback = callback or DTPTrainerCallback(EXAMPLE, RATIOS, score_lr=0.05)
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=batch,
        learning_rate=1e-3, warmup_steps=2, save_strategy="steps", save_steps=2,
        report_to=[], logging_strategy="no", use_cpu=True, disable_tqdm=True, **options,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model or tiny_llama(), args=args, train_dataset=DATA, callbacks=[*before, callback]
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, callback


def whole_optimizer_state(callback) -> dict:
    return callback.scores_group.whole_state_dict()


def assert_equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_equal_states(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


RUNS = {  # the pruner's arguments, the Trainer's gradient accumulation
    "heads-mlp": (RATIOS, {"score_lr": 0.05}, 1),
    "heads-mlp-accumulated": (RATIOS, {"score_lr": 0.05}, 2),
    "flops-budget": (0.5, {"budget": "flops", "score_lr": 0.05}, 1),  # learned ratios too
    "magnitude": (0.5, {"granularity": "weight", "scores": "magnitude"}, 1),  # no group
}


@pytest.mark.parametrize("ratios, kwargs, accumulation", RUNS.values(), ids=RUNS.keys())
def test_a_resumed_run_ends_bitwise_equal_to_one_that_never_stopped(
    tmp_path, ratios, kwargs, accumulation
):
    """Weights, scores, transport state and the optimizer's state of weights and scores.
    The scores' gradients are the pruner's, which the Trainer's model.zero_grad() leaves:
    summed over the steps they would differ after a resume (the callback drops them)."""
    options = {"gradient_accumulation_steps": accumulation}
    whole, whole_callback = train(
        tmp_path / "whole", callback=DTPTrainerCallback(EXAMPLE, ratios, **kwargs), **options
    )
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed, resumed_callback = train(
        tmp_path / "resumed",
        resume=True,
        callback=DTPTrainerCallback(EXAMPLE, ratios, **kwargs),
        **options,
    )
    assert int(resumed_callback.pruner.state.steps) == 6
    assert_equal_states(resumed.model.state_dict(), whole.model.state_dict())
    assert_equal_states(resumed_callback.pruner.state_dict(), whole_callback.pruner.state_dict())
    if whole_callback.scores_group is not None:
        assert_equal_states(
            whole_optimizer_state(resumed_callback)["state"],
            whole_optimizer_state(whole_callback)["state"],
        )
    assert resumed.lr_scheduler.get_last_lr() == whole.lr_scheduler.get_last_lr()
    assert all(p.grad is None for p in whole_callback.pruner.parameters())
    a, b = whole_callback.pruner.export(), resumed_callback.pruner.export()
    assert_equal_states(a.state_dict(), b.state_dict())


def test_a_resumed_run_started_over_with_a_smaller_batch_ends_as_one_resumed_at_it(tmp_path):
    """auto_find_batch_size after a resume: the first step runs out of memory, and the
    Trainer starts over at 3 (from 4), loading the checkpoint's optimizer file again
    into the optimizer that now holds the scores' group (which the load keeps). It ends
    bitwise where a run resumed at 3 from the start ends."""
    from test_integrations import OutOfMemoryOnce

    train(tmp_path / "whole")
    for run in ("at-3", "started-over"):
        shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / run / "checkpoint-2")
    at_3, at_3_callback = train(tmp_path / "at-3", resume=True, batch=3)
    started_over, callback = train(
        tmp_path / "started-over", resume=True, before=[OutOfMemoryOnce()],
        auto_find_batch_size=True,
    )  # fmt: skip
    assert started_over._train_batch_size == 3
    assert int(callback.pruner.state.steps) == 6
    assert_equal_states(started_over.model.state_dict(), at_3.model.state_dict())
    assert_equal_states(callback.pruner.state_dict(), at_3_callback.pruner.state_dict())
    assert_equal_states(
        whole_optimizer_state(callback)["state"], whole_optimizer_state(at_3_callback)["state"]
    )


def test_training_again_from_a_checkpoint_brings_back_its_pruner_state(tmp_path):
    """The same Trainer and callback train again from an earlier checkpoint: the Trainer
    loads its weights and optimizer, the callback its scores, transport state and the
    scores' optimizer state; the run ends where the first ended."""
    trainer, callback = train(tmp_path)
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    pruner_state = {k: v.clone() for k, v in callback.pruner.state_dict().items()}
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert_equal_states(trainer.model.state_dict(), weights)
    assert_equal_states(callback.pruner.state_dict(), pruner_state)


def test_a_callback_is_refused_a_second_model(tmp_path):
    _, callback = train(tmp_path / "first", max_steps=2)
    with pytest.raises(RuntimeError, match="prunes one model"):
        train(tmp_path / "second", callback=callback, max_steps=2)


def test_the_optimizer_state_without_the_scores_group_loads_keeping_the_group():
    """optimizer.state_dict() leaves the scores' group out; loading it (or an older
    state of the model's groups) changes those groups and keeps the scores' as they are."""
    from dtp_kernels import prepare
    from dtp_kernels.integrations.huggingface import ScoresGroup

    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pruner = prepare(model, optimizer, EXAMPLE, RATIOS, score_lr=0.05)
    group = ScoresGroup(pruner, optimizer)
    for _ in range(2):
        model(**EXAMPLE, labels=EXAMPLE["input_ids"]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        pruner.zero_grad()
    first = optimizer.state_dict()
    assert len(first["param_groups"]) == len(optimizer.param_groups) - 1
    model(**EXAMPLE, labels=EXAMPLE["input_ids"]).loss.backward()
    optimizer.step()
    scores_state = {k: v.clone() for k, v in optimizer.state[pruner.scores].items()}
    optimizer.load_state_dict(first)
    assert_equal_states(optimizer.state[pruner.scores], scores_state)
    assert optimizer.param_groups[-1]["params"][0] is pruner.scores
    assert_equal_states(optimizer.state_dict()["state"], first["state"])
    group.remove()
    with pytest.raises(ValueError, match="different number of parameter groups"):
        optimizer.load_state_dict(first)


def test_the_checkpoint_loads_into_the_model_and_optimizer_as_built(tmp_path):
    """What a resumed run's Trainer loads before the callback makes its pruner: the
    model's weights without the masks' keys (the masked weights as they are, unmasked)
    and an optimizer file without the scores' group; the scores' group and the pruner's
    state are in dtp_pruner.pt."""
    _, callback = train(tmp_path, max_steps=2)
    checkpoint = tmp_path / "checkpoint-2"
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    masked = callback.pruner.model
    for name, module in masked.named_modules():
        if parametrize.is_parametrized(module):
            original = module.parametrizations.weight.original
            assert torch.equal(model.get_submodule(name).weight, original), name
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    plain = transformers.Trainer(
        model=model, args=transformers.TrainingArguments(str(tmp_path / "x"), use_cpu=True)
    )
    plain.create_optimizer()
    plain.optimizer.load_state_dict(saved)  # the groups of the model's weights only
    pruner_file = torch.load(checkpoint / CHECKPOINT_FILE, weights_only=True)
    assert pruner_file["step"] == 2
    assert torch.equal(pruner_file["pruner"]["scores"], callback.pruner.scores.detach())
    group = pruner_file["scores_group"]["group"]
    live = callback.scores_group.optimizer.param_groups[-1]
    assert (group["initial_lr"], group["lr"]) == (0.05, live["lr"])


def test_the_best_checkpoint_brings_its_masks_with_its_weights(tmp_path):
    """load_best_model_at_end: the Trainer loads the best checkpoint's weights at the end,
    and the callback that checkpoint's scores and transport state (the highest loss is
    the best here: the first checkpoint, so not the state training ended with)."""
    callback = DTPTrainerCallback(EXAMPLE, RATIOS, score_lr=0.05)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4,
        learning_rate=1e-3, save_strategy="steps", save_steps=2, eval_strategy="steps",
        eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
        greater_is_better=True, report_to=[], logging_strategy="no", use_cpu=True,
        disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=tiny_llama(), args=args, train_dataset=DATA, eval_dataset=DATA[:4],
        callbacks=[callback],
    )  # fmt: skip
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and best.endswith("checkpoint-2")
    saved = torch.load(os.path.join(best, CHECKPOINT_FILE), weights_only=True)
    assert_equal_states(callback.pruner.state_dict(), saved["pruner"])
    weights = load_file(os.path.join(best, "model.safetensors"))
    state = trainer.model.state_dict()
    assert all(torch.equal(state[key], value) for key, value in weights.items())


def test_a_resume_without_the_pruners_state_is_refused_before_any_mask(tmp_path):
    """A checkpoint of training without DTP, or one moved away from output_dir without
    resume_from: a FileNotFoundError naming the file; resume_from finds it."""
    args = dict(
        max_steps=2, per_device_train_batch_size=4, save_strategy="steps", save_steps=2,
        report_to=[], logging_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    dense = transformers.Trainer(
        model=tiny_llama(),
        args=transformers.TrainingArguments(str(tmp_path / "dense"), **args),
        train_dataset=DATA,
    )
    dense.train()
    model = tiny_llama()
    trainer = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(str(tmp_path / "dense"), **{**args, "max_steps": 4}),
        train_dataset=DATA,
        callbacks=[DTPTrainerCallback(EXAMPLE, RATIOS)],
    )
    with pytest.raises(FileNotFoundError, match=r"checkpoint-2/dtp_pruner.pt .* does not exist"):
        trainer.train(resume_from_checkpoint=True)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())

    train(tmp_path / "dtp", max_steps=2)
    shutil.move(tmp_path / "dtp" / "checkpoint-2", tmp_path / "moved")
    elsewhere = DTPTrainerCallback(EXAMPLE, RATIOS, score_lr=0.05, resume_from=tmp_path / "moved")
    _, callback = train(tmp_path / "dtp", resume=tmp_path / "moved", callback=elsewhere)
    assert int(callback.pruner.state.steps) == 6


def test_resume_from_is_checked(tmp_path):
    with pytest.raises(TypeError, match=r"resume_from must be a checkpoint directory, got int"):
        DTPTrainerCallback(EXAMPLE, RATIOS, resume_from=2)
    callback = DTPTrainerCallback(EXAMPLE, RATIOS, resume_from=tmp_path)
    with pytest.raises(ValueError, match=r"resume_from = .* the Trainer starts at step 0"):
        train(tmp_path, callback=callback, max_steps=1)


def test_name_weights_unmasked_round_trips_and_leaves_exports_alone():
    """The pruner's state_dict renaming: the model's dict loads into the model as built
    (strict) and back into the masked one; exports and remove() drop the hooks."""
    from dtp_kernels import DTPPruner

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    pruner = DTPPruner(net, torch.randn(2, 8), 0.5)
    masked_keys = set(net.state_dict())
    pruner.name_weights_unmasked()
    state = net.state_dict()
    assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias"} != masked_keys
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    plain.load_state_dict(state)  # strict
    changed = {key: value + 1 for key, value in state.items()}
    net.load_state_dict(changed)  # strict, through the renaming
    assert all(torch.equal(net.state_dict()[key], changed[key]) for key in changed)
    exported = pruner.export()
    assert not exported._state_dict_hooks and not exported._load_state_dict_pre_hooks
    pruner.remove()
    assert set(net.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert not net._state_dict_hooks and not net._load_state_dict_pre_hooks


def test_a_checkpoint_of_other_ratios_is_refused_and_the_model_left_as_it_was(tmp_path):
    train(tmp_path, max_steps=2)
    other = DTPTrainerCallback(EXAMPLE, {"heads": 0.5}, score_lr=0.05)  # fewer scores
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"does not fit this callback's pruner.*offsets"):
        train(tmp_path, resume=True, callback=other, max_steps=4, model=model)
    assert other.pruner is None
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    assert not model._forward_pre_hooks and not model._state_dict_hooks
