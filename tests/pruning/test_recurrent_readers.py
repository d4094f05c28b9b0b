"""Recurrent layers and nn.Bilinear as readers (recurrent_readers.py): the layers feeding
an nn.RNN, nn.GRU or nn.LSTM (or a cell run step by step; a CRNN's columns of channels
over the height too) are pruned, the recurrent layer's input weights cut with them, and
the export equals the hard-masked model; a layer computing a recurrent layer's initial
hidden state, one whose outputs are added to a recurrent layer's, and one feeding an
nn.Bilinear are left whole, each with why."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import rnn as rnn_utils

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.cost import count_params
from dtp_kernels.pruning.precision import ieee_fp32
from dtp_kernels.pruning.recurrent_readers import run_as_one_op
from utils import check_export, drawn_statistics, exported_as_masked, randomised

RECURRENT = {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}


class Tagger(nn.Module):
    """Two linear layers, a recurrent layer (batch first), a classifier per step."""

    def __init__(self, kind: str, bidirectional: bool = False, layers: int = 1) -> None:
        super().__init__()
        self.embed, self.mix = nn.Linear(8, 16), nn.Linear(16, 12)
        self.rnn = RECURRENT[kind](
            12, 6, num_layers=layers, batch_first=True, bidirectional=bidirectional
        )
        self.head = nn.Linear(6 * (2 if bidirectional else 1), 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.mix(torch.relu(self.embed(x))))[0])


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("kind", list(RECURRENT))
def test_the_layers_feeding_a_recurrent_layer_are_pruned_and_exported_exactly(
    kind: str, bidirectional: bool, layers: int
) -> None:
    torch.manual_seed(0)
    model, x = Tagger(kind, bidirectional, layers), torch.randn(3, 5, 8)
    pruner = randomised(DTPPruner(model, x[:1], 0.5))
    assert [g.name for g in pruner.groups] == ["embed", "mix"]
    assert pruner.left_whole == {"head": "its outputs are the model's outputs: no layer reads them"}
    exported = check_export(pruner, model, x)
    rnn = exported.rnn
    assert rnn.input_size == 6 and rnn.weight_ih_l0.shape[1] == 6
    if bidirectional:
        assert rnn.weight_ih_l0_reverse.shape[1] == 6
    if layers == 2:  # the second layer reads the first's hidden units: not cut
        assert rnn.weight_ih_l1.shape[1] == 6 * (2 if bidirectional else 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_recurrent_readers_prune_on_the_device(kind: str, device: str) -> None:
    """On a GPU the recurrent layers run as cuDNN's one op (and the trace's form is the
    same): the groups, the cut and the export's equality hold there too (float32 in
    full precision: cuDNN's TF32 would round the two models apart)."""
    torch.manual_seed(0)
    model = Tagger(kind, bidirectional=True, layers=2).to(device)
    x = torch.randn(3, 5, 8, device=device)
    pruner = randomised(DTPPruner(model, x[:1], 0.5))
    assert [g.name for g in pruner.groups] == ["embed", "mix"]
    with ieee_fp32():
        exported = check_export(pruner, model, x)
    assert exported.rnn.weight_ih_l0_reverse.shape[1] == 6
    assert exported.rnn.weight_ih_l0.device.type == device


CELLS = {"rnn": nn.RNNCell, "gru": nn.GRUCell, "lstm": nn.LSTMCell}


class Stepped(nn.Module):
    """A recurrent cell run step by step over a linear layer's features (a decoder's
    loop), its state the previous step's output, then a classifier per step."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.embed, self.cell, self.head = nn.Linear(8, 16), CELLS[kind](16, 6), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, state, steps = torch.relu(self.embed(x)), None, []
        for t in range(h.shape[1]):
            state = self.cell(h[:, t], state)
            steps.append(state[0] if isinstance(state, tuple) else state)
        return self.head(torch.stack(steps, 1))


@pytest.mark.parametrize("kind", list(CELLS))
def test_the_layer_feeding_a_recurrent_cell_prunes_with_its_input_columns(kind: str) -> None:
    torch.manual_seed(0)
    model, x = Stepped(kind), torch.randn(3, 4, 8)
    pruner = randomised(DTPPruner(model, x[:1], 0.5))
    assert [g.name for g in pruner.groups] == ["embed"]
    exported = check_export(pruner, model, x)
    assert exported.cell.input_size == exported.cell.weight_ih.shape[1] == 8


class Encoder(nn.Module):
    """A recurrent layer inside a module of its own; `scaled`: its output scaled by one
    over the square root of its input's width (which export changes)."""

    def __init__(self, scaled: bool) -> None:
        super().__init__()
        self.rnn, self.scaled = nn.GRU(12, 6, batch_first=True), scaled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0] * (x.shape[-1] ** -0.5 if self.scaled else 1.0)


class EncodedTagger(Tagger):
    def __init__(self, scaled: bool) -> None:
        super().__init__("gru")
        self.rnn = Encoder(scaled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.mix(torch.relu(self.embed(x)))))


def test_a_module_around_a_recurrent_layer_is_proven_before_its_group_prunes() -> None:
    """The module holding the reader is run cut and with the channels zeroed
    (enclosing_readers.py): a plain wrapper passes and prunes exactly; one whose code
    scales by its input's width is refused when the pruner is made, naming it."""
    torch.manual_seed(0)
    model, x = EncodedTagger(scaled=False), torch.randn(3, 5, 8)
    pruner = randomised(DTPPruner(model, x[:1], 0.5))
    assert [g.name for g in pruner.groups] == ["embed", "mix"]
    assert check_export(pruner, model, x).rnn.rnn.input_size == 6
    with pytest.raises(ValueError, match=r"Encoder 'rnn' \(through 'rnn.rnn'\), which computes"):
        DTPPruner(EncodedTagger(scaled=True), x[:1], 0.5)


class PackedTagger(Tagger):
    """The recurrent layer reads a packed batch of sequences of different lengths."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lengths = torch.tensor([x.shape[1] - i for i in range(x.shape[0])])
        packed = rnn_utils.pack_padded_sequence(self.mix(self.embed(x)), lengths, True)
        out, _ = rnn_utils.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)
        return self.head(out)


def test_a_packed_sequence_is_read_like_a_tensor() -> None:
    torch.manual_seed(0)
    model, x = PackedTagger("lstm"), torch.randn(3, 5, 8)
    pruner = randomised(DTPPruner(model, x, 0.5))
    assert [g.name for g in pruner.groups] == ["embed", "mix"]
    check_export(pruner, model, x, example=(x,))


class CRNN(nn.Module):
    """A CRNN for text lines: two convs with BNs, the feature map turned into a sequence
    of columns (each the C * H features of the channels over the height), a reader
    of that sequence (a bidirectional LSTM, or a linear layer), a classifier."""

    def __init__(self, reader: str) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        lstm = reader == "lstm"
        self.reader = nn.LSTM(16 * 4, 10, bidirectional=True) if lstm else nn.Linear(64, 20)
        self.head = nn.Linear(20, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))
        n, c, h, w = x.shape
        columns = x.reshape(n, c * h, w).permute(2, 0, 1)  # (W, N, C * H)
        out = self.reader(columns)
        return self.head(out[0] if isinstance(out, tuple) else out)


@pytest.mark.parametrize("reader", ["lstm", "linear"])
def test_a_crnn_prunes_through_its_columns_of_channels_over_the_height(reader: str) -> None:
    """The reshape of (N, C, H, W) into (N, C * H, W) maps channel c to the H features
    c * H ... c * H + H - 1 (graph_workarounds._merged_channels): each filter of conv2
    removed takes its 4 input columns of the reader with it."""
    torch.manual_seed(0)
    model, x = drawn_statistics(CRNN(reader)), torch.randn(2, 1, 4, 7)
    pruner = randomised(DTPPruner(model, x[:1], 0.5))
    assert {"conv1", "conv2"} <= {g.name for g in pruner.groups}
    exported = check_export(pruner, model, x)
    assert exported.conv2.out_channels == 8
    width = exported.reader.input_size if reader == "lstm" else exported.reader.in_features
    assert width == 8 * 4


class Decoder(nn.Module):
    """A GRU whose initial hidden state a linear layer computes from a summary vector;
    its outputs are added to a linear layer's (a skip around it, from the inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.start, self.embed, self.skip = nn.Linear(5, 6), nn.Linear(8, 12), nn.Linear(8, 6)
        self.rnn = nn.GRU(12, 6, batch_first=True)
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, summary: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        out = self.rnn(h, torch.tanh(self.start(summary))[None])[0]
        return self.head(out + self.skip(x))


def test_hidden_state_and_output_coupled_layers_are_left_whole_with_why() -> None:
    torch.manual_seed(0)
    model = Decoder()
    x, summary = torch.randn(3, 5, 8), torch.randn(3, 5)
    pruner = randomised(DTPPruner(model, (x[:1], summary[:1]), 0.5))
    assert [g.name for g in pruner.groups] == ["embed"]
    why = pruner.left_whole
    assert (
        why["start"] == "a recurrent layer ('rnn') reads its channels as its initial hidden state"
    )
    assert why["skip"] == (
        "its channels are coupled with the outputs of a GRU ('rnn'), which are never cut"
    )
    exported = exported_as_masked(pruner, model, (x, summary), atol=1e-6)
    assert count_params(exported) == pruner.report()["params_after"]
    assert exported.rnn.input_size == 6 and exported.start.out_features == 6


class LearnedStart(Tagger):
    """An LSTM whose initial hidden and cell states are parameters of the model."""

    def __init__(self) -> None:
        super().__init__("lstm")
        self.h0, self.c0 = nn.Parameter(torch.randn(1, 3, 6)), nn.Parameter(torch.randn(1, 3, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mix(torch.relu(self.embed(x)))
        return self.head(self.rnn(h, (self.h0[:, : len(x)], self.c0))[0])


def test_learned_initial_states_are_read_as_states_not_as_the_inputs() -> None:
    """The parameters stay whole and the layers feeding the sequence prune; a state
    taken for the sequence input would be cut along with it."""
    torch.manual_seed(0)
    model, x = LearnedStart(), torch.randn(3, 5, 8)
    pruner = randomised(DTPPruner(model, x, 0.5))
    assert [g.name for g in pruner.groups] == ["embed", "mix"]
    exported = check_export(pruner, model, x, example=(x,))
    assert exported.h0.shape == exported.c0.shape == (1, 3, 6)


class Scorer(nn.Module):
    """A bilinear form of two linear layers' features."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(8, 12), nn.Linear(8, 10)
        self.bilinear = nn.Bilinear(12, 10, 3)
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bilinear(self.left(x), self.right(x)))


def test_the_layers_feeding_a_bilinear_layer_are_left_whole_with_why() -> None:
    model = Scorer()
    with pytest.raises(ValueError, match="no group was found") as caught:
        DTPPruner(model, torch.randn(1, 8), 0.5)
    message = str(caught.value)
    assert (
        "left: a Bilinear ('bilinear') reads its channels, and the pruner does not cut" in message
    )
    assert "right: a Bilinear ('bilinear') reads" in message


@pytest.mark.parametrize("kind", ["gru", "lstm", "bilinear"])
def test_one_op_forwards_compute_the_same_values_and_gradients(kind: str) -> None:
    """The traced form of each layer is its forward: float64 values, and the gradients
    of its inputs and parameters, match; a recurrent layer's initial state is read as a
    constant there (recorded, with no gradient), and the layer's own forward is back
    after the block."""
    torch.manual_seed(0)
    if kind == "bilinear":
        layer = nn.Bilinear(6, 3, 4).double()
        inputs: tuple = (torch.randn(5, 6), torch.randn(5, 3))
    else:
        layer = RECURRENT[kind](6, 5, num_layers=2, bidirectional=True).double()
        state = torch.randn(4, 2, 5)
        inputs = (torch.randn(7, 2, 6), (state, torch.randn(4, 2, 5)) if kind == "lstm" else state)
    inputs = torch.utils._pytree.tree_map(lambda t: t.double().requires_grad_(), inputs)
    states = torch.utils._pytree.tree_leaves(inputs[1:]) if kind != "bilinear" else []
    leaves = [*torch.utils._pytree.tree_leaves(inputs), *layer.parameters()]

    def run() -> tuple[list, tuple]:
        outputs = torch.utils._pytree.tree_leaves(layer(*inputs))
        weights = [
            torch.randn(o.shape, dtype=o.dtype, generator=torch.Generator().manual_seed(i))
            for i, o in enumerate(outputs)
        ]
        loss = sum((o * w).sum() for o, w in zip(outputs, weights, strict=True))
        return outputs, torch.autograd.grad(loss, leaves, allow_unused=True)

    want_out, want_grads = run()
    with run_as_one_op(layer) as read:
        got_out, got_grads = run()
        assert {o.grad_fn.name() for o in got_out} == {"_OneOpBackward"}
    assert "forward" not in vars(layer)
    assert len(read.tensors) == len(states) and set(read.readers.values()) <= {layer}
    for got, want, leaf in zip(got_grads, want_grads, leaves, strict=True):
        if any(leaf is s for s in states):
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for got, want in zip(got_out, want_out, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
