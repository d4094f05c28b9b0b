"""DTP in existing training code: prepare() on a plain loop, the Hugging Face Trainer
callback on a tiny Llama and the Lightning callback on a small module, each with a few
real training steps of the framework itself."""

import warnings

import pytest
import torch

from dtp_kernels import prepare
from dtp_kernels.pruning.cost import count_params
from utils import tiny_llama


def small_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 3),
    )


# a Lightning Trainer on the CPU that writes nothing of its own
QUIET = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)


def classifier(lightning, net, configure_optimizers):
    """A LightningModule of `net` trained with cross-entropy on (x, y) batches."""

    class Module(lightning.pytorch.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, _index):
            x, y = batch
            return torch.nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return configure_optimizers(self)

    return Module()


def test_prepare_adds_the_scores_and_the_commit_hook():
    model = small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    pruner = prepare(model, optimizer, torch.randn(1, 8), 0.5, score_lr=0.01)
    group = optimizer.param_groups[-1]
    assert group["params"] == [pruner.scores] and group["lr"] == 0.01
    assert group["weight_decay"] == 0.0
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    start = pruner.scores.detach().clone()
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert int(pruner.state.steps) == 3 and not torch.equal(start, pruner.scores.detach())
    assert [m.out_features for m in pruner.export() if isinstance(m, torch.nn.Linear)] == [
        16,
        16,
        3,
    ]


def test_prepare_checks_its_arguments_before_changing_the_model():
    model = small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"score_lr = -1; it must be a number > 0"):
        prepare(model, optimizer, torch.randn(1, 8), 0.5, score_lr=-1)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer, got list"):
        prepare(model, [], torch.randn(1, 8), 0.5)
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())
    assert len(optimizer.param_groups) == 1


def test_prepare_puts_the_scores_on_the_existing_schedule():
    """A scheduler made before prepare(): the scores' group follows the first group's
    schedule, scaled to score_lr (LambdaLR warm-up, then StepLR, in a SequentialLR)."""
    model = small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler
    warmup = sched.LambdaLR(optimizer, lambda step: (step + 1) / 2)
    decay = sched.StepLR(optimizer, step_size=1, gamma=0.5)
    schedule = sched.SequentialLR(optimizer, [warmup, decay], milestones=[2])
    pruner = prepare(model, optimizer, torch.randn(1, 8), 0.5, score_lr=0.01, scheduler=schedule)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    for _ in range(4):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        schedule.step()
        model_lr, score_lr = (g["lr"] for g in optimizer.param_groups)
        assert score_lr == pytest.approx(model_lr / 10)
    assert int(pruner.state.steps) == 4


def test_a_scheduler_with_per_group_settings_is_refused_first():
    model = small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    with pytest.raises(ValueError, match=r"scheduler OneCycleLR keeps per-group settings"):
        prepare(model, optimizer, torch.randn(1, 8), 0.5, scheduler=cycle)
    assert len(optimizer.param_groups) == 1
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())


def test_prepare_learns_the_flops_ratios_too():
    model = small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pruner = prepare(model, optimizer, torch.randn(1, 8), 0.5, budget="flops")
    assert optimizer.param_groups[-1]["params"] == [pruner.scores, pruner.theta]


TRAINER_OPTIONS = {
    "plain": {},
    # the Trainer's own activation checkpointing (non-reentrant by default) and two
    # batches per optimizer step
    "checkpointing-accumulation": {
        "activation_checkpointing": True,
        "gradient_accumulation_steps": 2,
    },
}


@pytest.mark.parametrize("options", TRAINER_OPTIONS.values(), ids=TRAINER_OPTIONS.keys())
def test_hugging_face_trainer_callback_prunes_a_llama(tmp_path, options):
    transformers = pytest.importorskip("transformers")
    from dtp_kernels.integrations.huggingface import DTPTrainerCallback

    model = tiny_llama()
    ids = torch.randint(0, 61, (8, 12), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    example = {"input_ids": ids[:1], "attention_mask": torch.ones(1, 12, dtype=torch.long)}
    callback = DTPTrainerCallback(example, {"heads": 0.5, "mlp": 0.5}, score_lr=0.05)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        **options,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if "will not describe" in str(w.message)]  # it will
    pruner = callback.pruner
    assert int(pruner.state.steps) == 4  # committed after each of the Trainer's steps
    assert pruner.state.log_odds.abs().sum() > 0  # the scores learned
    exported = pruner.export()
    assert (exported.config.num_attention_heads, exported.config.intermediate_size) == (2, 24)
    exported.save_pretrained(tmp_path / "pruned")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "pruned")
    assert count_params(loaded) == count_params(exported)


def test_the_trainer_callback_warns_at_the_start_of_a_config_that_will_not_describe(tmp_path):
    """Two MLPs asked for different counts: no one intermediate_size holds both, so
    training begins with the warning to save the export with save_pruned."""
    transformers = pytest.importorskip("transformers")
    from dtp_kernels.integrations.huggingface import DTPTrainerCallback

    ids = torch.randint(0, 61, (4, 12), generator=torch.Generator().manual_seed(1))
    ratios = {"mlp": 0.5, "model.layers.1.mlp.gate_proj": 0.75}
    callback = DTPTrainerCallback(ids[:1], ratios)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to=[],
        save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = transformers.Trainer(
        model=tiny_llama(), args=args, train_dataset=data, callbacks=[callback]
    )
    with pytest.warns(UserWarning, match=r"it is to be saved with dtp_kernels.save_pruned"):
        trainer.train()


def test_lightning_callback_refuses_a_scheduler_before_the_module_gets_masks():
    """A scheduler that keeps per-group settings (OneCycleLR) cannot take the scores'
    group: refused when fitting starts, with the module left without masks."""
    lightning = pytest.importorskip("lightning")
    from torch.nn.utils import parametrize

    from dtp_kernels.integrations.lightning import DTPCallback

    def one_cycle(module):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=8)]

    module = classifier(lightning, small_net(), one_cycle)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    callback = DTPCallback(torch.randn(1, 8), 0.5)
    trainer = lightning.pytorch.Trainer(max_steps=2, callbacks=[callback], **QUIET)
    with pytest.raises(ValueError, match=r"scheduler OneCycleLR keeps per-group settings"):
        trainer.fit(module, loader)
    assert callback.pruner is None
    assert not any(parametrize.is_parametrized(m) for m in module.modules())


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_callback_prunes_a_module(accumulate):
    """One commit per optimizer step, also when Lightning accumulates two batches."""
    lightning = pytest.importorskip("lightning")
    from dtp_kernels.integrations.lightning import DTPCallback

    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    callback = DTPCallback(torch.randn(1, 8), 0.5)
    module = classifier(lightning, small_net(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    trainer = lightning.pytorch.Trainer(
        max_steps=4, callbacks=[callback], accumulate_grad_batches=accumulate, **QUIET
    )
    start = module.net[0].weight.detach().norm(dim=1)  # the scores' initial values
    trainer.fit(module, loader)
    pruner = callback.pruner
    assert int(pruner.state.steps) == 4
    assert not torch.allclose(pruner.scores.detach()[:32], start)
    exported = pruner.export()
    assert exported.net[0].out_features == 16


def test_a_lightning_checkpoint_resumes_the_dtp_run_bitwise(tmp_path):
    """A checkpoint written after the first epoch holds the module's weights under their
    own names and the pruner's state; fitting on from it with a new callback ends
    bitwise equal to one uninterrupted run: weights, BN statistics, scores, transport
    state, the scores' momentum and their learning-rate schedule."""
    lightning = pytest.importorskip("lightning")
    from dtp_kernels.integrations.lightning import DTPCallback

    def conv_net():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.Conv2d(8, 8, 3),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, 3),
        )

    def sgd_halved_each_epoch(module):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)]

    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 3, 8, 8, generator=generator), torch.randint(0, 3, (32,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    example = torch.randn(1, 3, 8, 8, generator=generator)

    def fit(epochs: int, resume=None, save=None):
        module = classifier(lightning, conv_net(), sgd_halved_each_epoch)
        callback = DTPCallback(example, 0.5)
        trainer = lightning.pytorch.Trainer(max_epochs=epochs, callbacks=[callback], **QUIET)
        trainer.fit(module, loader, ckpt_path=resume)
        if save is not None:
            trainer.save_checkpoint(save)
        return module, callback.pruner, trainer.optimizers[0]

    whole, whole_pruner, whole_optimizer = fit(3)
    fit(1, save=tmp_path / "epoch1.ckpt")
    saved = torch.load(tmp_path / "epoch1.ckpt", weights_only=False)
    assert not any("parametrizations" in key for key in saved["state_dict"])
    assert "net.0.weight" in saved["state_dict"]
    resumed, pruner, optimizer = fit(3, resume=tmp_path / "epoch1.ckpt")
    assert int(pruner.state.steps) == int(whole_pruner.state.steps) == 6
    for one, other in ((whole_pruner, pruner), (whole, resumed)):
        want, got = one.state_dict(), other.state_dict()
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), key
    scores = optimizer.param_groups[-1]
    assert scores["params"][0] is pruner.scores
    assert scores["lr"] == whole_optimizer.param_groups[-1]["lr"] == pytest.approx(0.1 * 0.5**3)
    momentum = optimizer.state[pruner.scores]["momentum_buffer"]
    assert torch.equal(momentum, whole_optimizer.state[whole_pruner.scores]["momentum_buffer"])


class OutOfMemoryOnce:
    """A TrainerCallback whose first step fails as an exhausted CPU allocator fails: the
    Trainer under auto_find_batch_size starts over with a smaller batch. ``optimizers``:
    what each start of training was given."""

    def __new__(cls):
        import transformers

        class Callback(transformers.TrainerCallback):
            raised = False

            def __init__(self) -> None:
                self.optimizers = []  # the optimizer each start of training had

            def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
                self.optimizers.append(optimizer)

            def on_step_begin(self, args, state, control, **kwargs):
                if not self.raised:
                    self.raised = True
                    raise RuntimeError("DefaultCPUAllocator: can't allocate memory: 1 bytes")

        return Callback()


@pytest.mark.parametrize("fresh_optimizer", [False, True], ids=["same", "fresh"])
def test_the_trainer_callback_goes_on_when_the_trainer_starts_over(tmp_path, fresh_optimizer):
    """auto_find_batch_size: after an out-of-memory error the Trainer starts training
    again, with its optimizer (scores' group and hooks included) and a new scheduler
    over every group, or, in a subclass, with an optimizer made anew, which the scores
    join and the hooks move to. The pruner and its masks stay, as the weights do."""
    transformers = pytest.importorskip("transformers")
    from dtp_kernels.integrations.huggingface import DTPTrainerCallback
    from dtp_kernels.pruning.prepare import unwrap_optimizer

    optimizers = []

    class Trainer(transformers.Trainer):
        def create_optimizer(self, model=None):
            if fresh_optimizer:
                self.optimizer = None
            optimizer = super().create_optimizer(model)
            optimizers.append(unwrap_optimizer(optimizer))  # (the second: in Accelerate's)
            return optimizer

    ids = torch.randint(0, 61, (32, 12), generator=torch.Generator().manual_seed(1))
    callback = DTPTrainerCallback({"input_ids": ids[:1]}, {"heads": 0.5, "mlp": 0.5}, score_lr=0.05)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8,
        auto_find_batch_size=True, learning_rate=1e-3, report_to=[], save_strategy="no",
        logging_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = Trainer(
        model=tiny_llama(), args=args, train_dataset=data, callbacks=[OutOfMemoryOnce(), callback]
    )
    trainer.train()
    assert trainer._train_batch_size < 8  # it started over
    assert len(optimizers) == 2 and (optimizers[0] is optimizers[1]) != fresh_optimizer
    pruner = callback.pruner
    assert int(pruner.state.steps) == 4  # each step committed once, by the last optimizer
    inner = unwrap_optimizer(trainer.optimizer)
    assert inner is optimizers[-1]
    groups = [g for g in inner.param_groups if any(p is pruner.scores for p in g["params"])]
    assert len(groups) == 1 and groups[0]["initial_lr"] == 0.05
    assert groups[0]["lr"] == pytest.approx(0.05 * inner.param_groups[0]["lr"] / 1e-3)
    if fresh_optimizer:  # the first optimizer keeps neither the scores' hooks nor the group
        first = optimizers[0]
        assert not first._optimizer_step_post_hooks
        assert not first._optimizer_state_dict_post_hooks
