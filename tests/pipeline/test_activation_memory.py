"""saved_activation_bytes (dtp_kernels/pipeline/activation_memory.py): the bytes the
training forward keeps for the backward pass, measured on fake tensors, are those a real
forward keeps (counted by the same hooks on real tensors and, independently, by the
profiler's allocations); a transformers model's figure is above its eager run's by a
bounded amount; activation checkpointing lowers it; the model is left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.profiler import ProfilerActivity, profile

from dtp_kernels import DTPPruner
from dtp_kernels.models.cifar_resnet import resnet20
from dtp_kernels.pipeline.activation_memory import saved_activation_bytes
from dtp_kernels.pipeline.plan import measure_activations
from dtp_kernels.pipeline.step import forward_loss
from dtp_kernels.pipeline.train import RunOptions
from utils import tiny_llama, tiny_mixtral


def real_saved(model, inputs, labels, amp=None, outputs=None) -> int:
    """The bytes of the storages a real forward saves for the backward pass, parameters
    and buffers left out."""
    model.train()
    known = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in known:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = forward_loss(model, inputs, labels, amp, outputs)
    del loss
    return sum(seen.values())


def allocated(model, inputs, labels, amp=None, outputs=None) -> int:
    """What a real forward leaves allocated (its allocations less its frees, by the
    profiler): the tensors the backward pass needs, and the loss."""
    model.train()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as run:
        loss = forward_loss(model, inputs, labels, amp, outputs)
    del loss
    return sum(event.self_cpu_memory_usage for event in run.key_averages())


def estimate(model, inputs, labels, amp=None, outputs=None, prepare=None) -> int:
    return saved_activation_bytes(
        model, (inputs.shape, inputs.dtype), (labels.shape, labels.dtype), amp, outputs, prepare
    )


def test_a_small_network_keeps_what_its_backward_reads():
    """Linear(16, 32), ReLU, Linear(32, 10) on 8 samples: the first layer's input (its
    weight's gradient; 8 x 16 floats), the ReLU's output (its own backward and the second
    layer's weight gradient; 8 x 32), the log-softmax (8 x 10), the labels (8 int64) and
    the loss's normaliser (one float)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    inputs, labels = torch.randn(8, 16), torch.zeros(8, dtype=torch.long)
    expected = 8 * 16 * 4 + 8 * 32 * 4 + 8 * 10 * 4 + 8 * 8 + 4
    assert estimate(model, inputs, labels) == expected == real_saved(model, inputs, labels)
    # the profiler: the batch was allocated before the forward, the loss (4 bytes) in it
    assert allocated(model, inputs, labels) == expected - 8 * 16 * 4 - 8 * 8 + 4


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_a_cnn_with_dtp_masks_keeps_what_the_estimate_says(amp, channels_last):
    """ResNet-20 with DTP's soft masks, on fake tensors and on real ones."""
    torch.manual_seed(0)
    model = resnet20()
    pruner = DTPPruner(model, torch.randn(1, 3, 32, 32), 0.5)
    inputs, labels = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    prepare = (lambda x: x.to(memory_format=torch.channels_last)) if channels_last else None
    if channels_last:
        model.to(memory_format=torch.channels_last)
        inputs = prepare(inputs)
    fake = estimate(model, inputs, labels, amp, prepare=prepare)
    real = real_saved(model, inputs, labels, amp)
    if amp is None:
        assert fake == real
    else:  # torch's fake batch norm gives bfloat16 batch statistics, the real one float32
        assert fake == pytest.approx(real, rel=1e-3)
    assert fake > estimate(resnet20(), inputs, labels, amp)  # the masks keep more
    assert pruner.scores.grad is None  # nothing ran backward


def test_the_estimate_leaves_the_model_as_it_was():
    model = resnet20().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    estimate(model, torch.randn(4, 3, 32, 32), torch.zeros(4, dtype=torch.long))
    assert not model.training
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # BN statistics too


def test_a_pruner_trains_on_after_an_estimate_as_without_it():
    """The fake forward's masks and pending transport state are replaced by the next real
    forward: two training steps after an estimate equal two steps without one."""

    def two_steps(measure: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = resnet20()
        pruner = DTPPruner(model, torch.randn(1, 3, 32, 32), 0.5)
        optimizer = torch.optim.SGD([*model.parameters(), *pruner.parameters()], lr=0.1)
        pruner.attach(optimizer)
        inputs, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
        if measure:
            estimate(model, inputs, labels)
        for _ in range(2):
            optimizer.zero_grad()
            forward_loss(model, inputs, labels).backward()
            optimizer.step()
        return [*model.state_dict().values(), *pruner.state_dict().values()]

    assert all(map(torch.equal, two_steps(True), two_steps(False)))


def llama_forward(model, tokens):
    return model(tokens, use_cache=False).logits.transpose(1, 2)


def test_a_forward_that_cannot_run_on_fake_tensors_is_reported_not_measured(capfd):
    """A transformers Mixtral's experts run a grouped matmul that torch's fake kernel
    takes in bfloat16 only: --plan says so instead of failing, and logs no error."""
    model = tiny_mixtral()
    shapes = (((2, 16), torch.long), ((2, 16), torch.long))
    options = RunOptions(task="causal_lm")
    measured = measure_activations(model, shapes, options)
    assert measured.startswith("not measured: the forward does not run on fake tensors")
    assert "RuntimeError" in measured
    assert "Traceback" not in capfd.readouterr().err
    assert isinstance(measure_activations(tiny_llama(), shapes, options), int)


def test_a_transformers_model_is_estimated_above_its_eager_run_by_a_bounded_part():
    """Traced, transformers builds the causal mask and repeats the key/value heads (see
    the module's docstring): the figure is above the eager forward's, by less than 20%
    for a model whose sequence (64) is twice its width (32)."""
    model = tiny_llama()
    DTPPruner(model, torch.randint(0, 32, (1, 8)), {"heads": 0.5, "mlp": 0.5})
    tokens, labels = torch.randint(0, 32, (4, 64)), torch.randint(0, 32, (4, 64))
    real = real_saved(model, tokens, labels, outputs=llama_forward)
    fake = estimate(model, tokens, labels, outputs=llama_forward)
    assert real <= fake <= 1.2 * real, (real, fake)


def test_activation_checkpointing_keeps_the_layers_inputs_and_one_layer():
    """With transformers' checkpointing a layer more keeps one hidden state (its input,
    4 x 64 tokens x 32 floats) where it kept all its activations; one checkpointed layer
    saves nothing (its input kept, the layer itself recomputed at once); the figure is
    at least what the real checkpointed forward leaves allocated (the profiler)."""
    tokens, labels = torch.randint(0, 32, (4, 64)), torch.randint(0, 32, (4, 64))
    whole, checkpointed = {}, {}
    for layers in (1, 2, 4):
        model = tiny_llama(layers=layers)
        whole[layers] = estimate(model, tokens, labels, outputs=llama_forward)
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
        checkpointed[layers] = estimate(model, tokens, labels, outputs=llama_forward)
    hidden = 4 * 64 * 32 * 4
    assert checkpointed[2] - checkpointed[1] == hidden
    assert checkpointed[4] - checkpointed[2] == 2 * hidden
    assert whole[2] - whole[1] > 10 * hidden
    assert checkpointed[1] >= whole[1]
    held = allocated(model, tokens, labels, outputs=llama_forward)
    batch = tokens.numel() * 8 + labels.numel() * 8
    assert held + batch <= checkpointed[4] < 0.6 * whole[4]
    # and the checkpointing is switched back on after the estimate
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


@pytest.mark.cuda
@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_on_a_gpu_the_cpu_estimate_is_the_memory_a_forward_keeps(amp):
    """What --plan does: the estimate on the CPU's fake tensors, against the memory a
    real forward on the GPU leaves allocated (its allocations less its frees), the batch
    allocated before it; within the caching allocator's rounding (512-byte blocks) and,
    under autocast, the CPU's autocast rules standing in for the GPU's. A warm-up forward
    first, as in training: the memory a process keeps from its first step on is not the
    forward's."""
    torch.manual_seed(0)
    model = resnet20()
    pruner = DTPPruner(model, torch.randn(1, 3, 32, 32), 0.5)
    inputs, labels = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    predicted = estimate(model, inputs, labels, amp)
    model.cuda().train()
    pruner.cuda()
    inputs, labels = inputs.cuda(), labels.cuda()
    # a first forward allocates what the process keeps, not the forward: cuBLAS's
    # workspace (32 MiB on an H200, taken from the caching allocator on a stream's first
    # fp32 matmul) and the pruner's one-time state
    forward_loss(model, inputs, labels, amp)  # its graph freed at once
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = forward_loss(model, inputs, labels, amp)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    del loss
    batch = inputs.numel() * 4 + labels.numel() * 8
    assert held + batch == pytest.approx(predicted, rel=0.03), (held + batch, predicted)
