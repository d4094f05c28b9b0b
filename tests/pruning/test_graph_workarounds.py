"""Where Torch-Pruning 1.6.1's graph fails on code it could follow (graph_workarounds.py):
a concatenation whose input widths it cannot infer (an addition of tensors no layer
produced, as rotary and position tables make), left unmapped as its code means to; an
nn.Linear subclass returning a tuple (a router), left out of its trace. A float ratio
then prunes these models (tiny configurations built here, nothing downloaded): every
group keeps exactly its count and the export computes what the hard-masked model
computes."""

import warnings

import pytest
import torch
from torch import nn
from torch_pruning.dependency import index_mapping

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.graph_workarounds import (
    tuple_returning_linears,
    unknown_concat_widths_left_unmapped,
)
from utils import LLAMA_VOCAB as VOCAB
from utils import tiny_deepseek

transformers = pytest.importorskip("transformers")

TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


# the sizes the decoders with experts share: 4 experts of 16 neurons in every layer
DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    **TOKEN_IDS,
)


def minimax():  # a lightning (linear) attention layer, then a full one
    config = transformers.MiniMaxConfig(head_dim=8, num_experts_per_tok=2, block_size=4, **DECODER)
    return transformers.MiniMaxForCausalLM(config)


def prophetnet():  # its decoder's n-gram attention concatenates the streams
    config = transformers.ProphetNetConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_encoder_layers=2,
        num_decoder_layers=2,
        num_encoder_attention_heads=4,
        num_decoder_attention_heads=4,
        max_position_embeddings=64,
        **TOKEN_IDS,
    )
    return transformers.ProphetNetForCausalLM(config)


def phimoe():  # its router, an nn.Linear, returns logits, weights and experts chosen
    config = transformers.PhimoeConfig(num_experts_per_tok=2, **DECODER)
    return transformers.PhimoeForCausalLM(config)


def llama4():  # a dense layer, then one of experts whose router returns a tuple
    config = transformers.Llama4TextConfig(
        intermediate_size_mlp=64,
        head_dim=8,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        **DECODER,
    )
    return transformers.Llama4ForCausalLM(config)


def deepseek_v2():  # latent attention: its latents stay whole, out of the graph's search
    return tiny_deepseek(version=2)


def deepseek_v3():  # and a concatenation of its rotary part the width inference fails on
    return tiny_deepseek(version=3)


# the groups a float ratio finds: heads, each expert's neurons, MLP neurons (ProphetNet's
# feed-forward layers; Llama 4's dense MLP and shared expert; DeepSeek's dense MLP and
# shared experts)
GROUPS = {
    deepseek_v2: {"HeadGroup": 2, "ChannelGroup": 2, "ExpertGroup": 4},
    deepseek_v3: {"HeadGroup": 2, "ChannelGroup": 2, "ExpertGroup": 4},
    minimax: {"HeadGroup": 1, "ExpertGroup": 8},  # heads of its one full-attention layer
    prophetnet: {"ChannelGroup": 2},
    phimoe: {"HeadGroup": 2, "ExpertGroup": 8},
    llama4: {"HeadGroup": 2, "ChannelGroup": 2, "ExpertGroup": 4},
}


@pytest.mark.parametrize("build", GROUPS)
def test_a_float_ratio_prunes_models_whose_graph_failed(build):
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pruner = DTPPruner(model, (ids,), 0.5)
    assert not [w for w in caught if "kept in raw parameters" in str(w.message)]
    kinds = [type(g).__name__ for g in pruner.groups]
    assert {kind: kinds.count(kind) for kind in kinds} == GROUPS[build]
    with torch.no_grad():  # scores away from their initial order
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    masks = pruner.hard_masks()
    for group, mask in zip(pruner.groups, masks, strict=True):
        assert int(mask.sum()) == group.size - -(-group.size // 2), group.name
    with torch.no_grad(), pruner.hard_masked():
        want = model(ids).logits
    exported = pruner.export().eval()  # checks the invariant itself; asserted here too
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, want, rtol=1e-5, atol=1e-5)
    params, _ = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())


def test_a_float_ratio_prunes_dinov3_whose_concatenation_reads_a_split_it_recorded_less_of():
    """DINOv3 concatenates its prefix tokens (class, registers) with the patches its
    rotary embedding rotated, and Torch-Pruning's width inference then reads a split's
    size it did not record (IndexError): the concatenation is left unmapped and a float
    prunes its heads and MLPs, exported equal to the hard-masked model."""
    config = transformers.DINOv3ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
    )
    torch.manual_seed(0)
    model = transformers.DINOv3ViTModel(config).eval()
    x = torch.randn(2, 3, 32, 32)
    pruner = DTPPruner(model, (x[:1],), 0.5)
    kinds = [type(g).__name__ for g in pruner.groups]
    assert kinds == ["HeadGroup", "ChannelGroup"] * 2
    assert [int(m.sum()) for m in pruner.hard_masks()] == [2, 32, 2, 32]
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
        with pruner.hard_masked():
            want = model(x).last_hidden_state
        exported = pruner.export().eval()
        torch.testing.assert_close(exported(x).last_hidden_state, want, rtol=1e-5, atol=1e-5)
    assert exported.model.layer[0].attention.num_heads == 2


class _Concat:
    def __init__(self, widths):
        self.concat_sizes = widths


class _Node:
    def __init__(self, widths):
        self.module = _Concat(widths)


def test_only_an_unknown_width_is_let_through_and_the_library_is_restored(monkeypatch):
    def failing(graph, node):  # the library's failure, its widths recorded on the node
        raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")

    monkeypatch.setattr(index_mapping, "update_concat_index_mapping", failing)
    with unknown_concat_widths_left_unmapped():
        index_mapping.update_concat_index_mapping(None, _Node([16, None]))  # left unmapped
        with pytest.raises(TypeError):  # every width known: another failure, kept
            index_mapping.update_concat_index_mapping(None, _Node([16, 8]))
        with pytest.raises(TypeError):
            index_mapping.update_concat_index_mapping(None, _Node(None))
    assert index_mapping.update_concat_index_mapping is failing

    def short_split(graph, node):  # a split's size it did not record
        raise IndexError("list index out of range")

    monkeypatch.setattr(index_mapping, "update_concat_index_mapping", short_split)
    with unknown_concat_widths_left_unmapped():
        index_mapping.update_concat_index_mapping(None, _Node([16, 8]))  # left unmapped
    assert index_mapping.update_concat_index_mapping is short_split


class _Router(nn.Linear):
    def forward(self, x):
        logits = super().forward(x)
        return logits, logits.argmax(-1)


class _Scaled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class _Block(nn.Module):
    def __init__(self, router: type[nn.Linear]):
        super().__init__()
        self.calls = 0
        self.up, self.router, self.scaled = nn.Linear(4, 8), router(8, 3), _Scaled(8, 8)

    def forward(self, x):
        self.calls += 1
        h = self.scaled(self.up(x))
        logits = self.router(h)
        return h.sum(-1) + (logits[0] if isinstance(logits, tuple) else logits).sum(-1)


def test_only_linear_subclasses_returning_tuples_are_named_and_only_they_cost_a_forward():
    block, x = _Block(_Router), torch.randn(2, 4)
    assert tuple_returning_linears(block, (x,)) == [block.router]
    assert block.calls == 1 and block.training  # its mode is restored
    plain = _Block(nn.Linear)
    plain.scaled = nn.Linear(8, 8)
    assert tuple_returning_linears(plain, (x,)) == [] and plain.calls == 0
    assert tuple_returning_linears(_Block(nn.Linear), (x,)) == []  # _Scaled returns a tensor
