"""A concatenation whose input widths Torch-Pruning cannot infer (an addition of tensors
no layer produced, as rotary and position tables make) fails its whole graph in
Torch-Pruning 1.6.1; the pruner leaves such a concatenation unmapped, as that library's
code means to, so a float ratio prunes these models (tiny configurations built here,
nothing downloaded): every group keeps exactly its count and the export computes what
the hard-masked model computes."""

import pytest
import torch
from torch_pruning.dependency import index_mapping

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.concat_widths import unknown_concat_widths_left_unmapped
from dtp_kernels.pruning.heads import HeadGroup
from utils import LLAMA_VOCAB as VOCAB

transformers = pytest.importorskip("transformers")

TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def minimax():  # a lightning (linear) attention layer, then a full one; 4 experts each
    config = transformers.MiniMaxConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        block_size=4,
        **TOKEN_IDS,
    )
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


@pytest.mark.parametrize("build", [minimax, prophetnet])
def test_a_float_ratio_prunes_models_with_a_concatenation_of_unknown_width(build):
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    pruner = DTPPruner(model, (ids,), 0.5)
    assert pruner.groups
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
    if build is minimax:  # its full-attention layer's heads, its experts' neurons
        assert sum(isinstance(g, HeadGroup) for g in pruner.groups) == 1


class _Concat:
    def __init__(self, widths):
        self.concat_sizes = widths


class _Node:
    def __init__(self, widths):
        self.module = _Concat(widths)


def test_only_an_unknown_width_is_let_through_and_the_library_is_restored(monkeypatch):
    def failing(graph, node):
        node.module.concat_sizes = node.module.concat_sizes  # as the library records them
        raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")

    monkeypatch.setattr(index_mapping, "update_concat_index_mapping", failing)
    with unknown_concat_widths_left_unmapped():
        index_mapping.update_concat_index_mapping(None, _Node([16, None]))  # left unmapped
        with pytest.raises(TypeError):  # every width known: another failure, kept
            index_mapping.update_concat_index_mapping(None, _Node([16, 8]))
        with pytest.raises(TypeError):
            index_mapping.update_concat_index_mapping(None, _Node(None))
    assert index_mapping.update_concat_index_mapping is failing
