"""The config fields an exported model's MLP widths are written to, so save_pretrained /
from_pretrained rebuild it (tiny Hugging Face configurations built here): an
encoder-decoder's one field per side (BART's encoder_ffn_dim and decoder_ffn_dim,
Whisper's), Falcon's ffn_hidden_size beside its read-only head_dim (unwritten where its heads
keep every unit), CTRL's dff, XLNet's and Funnel's d_inner, and GPT-Neo's unset
intermediate_size (4 x hidden_size)."""

import warnings

import pytest
import torch

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.config_forecast import config_forecast
from utils import randomised

transformers = pytest.importorskip("transformers")

VOCAB = 64
IDS = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))


def bart():
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=48, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.BartForCausalLM(config)  # its decoder


def bart_seq2seq():
    config = bart().config
    config.is_decoder, config.is_encoder_decoder = False, True
    return transformers.BartForConditionalGeneration(config)


def falcon():
    config = transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ffn_hidden_size=64,
    )  # fmt: skip
    return transformers.FalconForCausalLM(config)


def ctrl():
    config = transformers.CTRLConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, dff=64)
    return transformers.CTRLLMHeadModel(config)


def gpt_neo():
    config = transformers.GPTNeoConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
        attention_types=[[["global", "local"], 1]],
    )  # fmt: skip
    assert config.intermediate_size is None  # 4 x hidden_size, as its checkpoints leave it
    return transformers.GPTNeoForCausalLM(config)


def xlnet():
    config = transformers.XLNetConfig(
        vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, d_head=8, d_inner=64,
    )  # fmt: skip
    return transformers.XLNetLMHeadModel(config)


def funnel():
    config = transformers.FunnelConfig(
        vocab_size=VOCAB, d_model=32, block_sizes=[1, 1], n_head=4, d_head=8, d_inner=64,
        num_decoder_layers=1,
    )  # fmt: skip
    return transformers.FunnelForMaskedLM(config)


# model -> (ratios, the fields the export writes)
CASES = {
    # (its layers' cross-attention, which no encoder feeds here, stays whole)
    "bart-decoder": (bart, {"mlp": 0.5}, {"decoder_ffn_dim": 24}),
    # each side its own count
    "bart": (
        bart_seq2seq,
        {"model.encoder.layers.*.fc1": 0.5, "model.decoder.layers.*.fc1": 0.25},
        {"encoder_ffn_dim": 32, "decoder_ffn_dim": 36},
    ),
    "falcon": (falcon, {"mlp": 0.5}, {"ffn_hidden_size": 32}),
    "ctrl": (ctrl, {"mlp": 0.5}, {"dff": 32}),
    "gpt_neo": (gpt_neo, {"mlp": 0.5}, {"intermediate_size": 64}),
    "xlnet": (xlnet, {"mlp": 0.5}, {"d_inner": 32}),
    # its blocks' and its decoder's MLPs (its MLM head's dense stays whole: no field)
    "funnel": (funnel, {"*.ffn.linear_1": 0.5}, {"d_inner": 32}),
}


@pytest.mark.parametrize("case", CASES)
def test_the_mlp_widths_are_written_where_the_family_keeps_them(case, tmp_path):
    build, ratios, fields = CASES[case]
    torch.manual_seed(0)
    model = build().eval()
    inputs = {"input_ids": IDS, "decoder_input_ids": IDS} if case == "bart" else {"input_ids": IDS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cross-attention not called, in BART's decoder
        pruner = randomised(DTPPruner(model, inputs, ratios))
    assert pruner.config_describes_export() is True
    with torch.no_grad(), pruner.hard_masked():
        want = model(**inputs).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "config cannot describe" warning
        exported = pruner.export().eval()
    assert {field: getattr(exported.config, field) for field in fields} == fields
    exported.save_pretrained(tmp_path)
    loaded = type(exported).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, want, rtol=1e-5, atol=1e-5)


def test_falcons_heads_kept_whole_leave_its_read_only_head_dim_unwritten():
    """Falcon derives head_dim from hidden_size / heads (a read-only property): groups
    that keep every unit write no field, so the forecast finds its MLPs describable with
    its heads whole, and advises that."""
    torch.manual_seed(0)
    pruner = DTPPruner(falcon(), {"input_ids": IDS}, 0.5)
    assert pruner.config_describes_export() is False  # fewer heads: no config holds them
    assert config_forecast(pruner)["ratios"] == {"heads": 0, "mlp": 0.5}
