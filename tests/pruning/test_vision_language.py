"""Vision-language models (LLaVA, Qwen2.5-VL, Gemma 3, Qwen3-VL; tiny configurations
built here) pruned from keyword example inputs, as a processor gives them (input ids
with image tokens, pixel values, Qwen's image grid): the vision tower's heads and MLPs,
the projector and the language model prune together, and the export computes what the
hard-masked model computes and generates as it does. Example inputs in each form run
the model alike."""

import warnings

import pytest
import torch

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.cost import count_flops
from dtp_kernels.pruning.example_inputs import ExampleInputs, as_example_inputs, call_model
from dtp_kernels.pruning.heads import HeadGroup
from dtp_kernels.pruning.ratios import kept_count
from utils import TINY_HF_VIT, randomised

transformers = pytest.importorskip("transformers")

VOCAB = 64  # then the image tokens
TEXT = dict(
    vocab_size=VOCAB + 8,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    head_dim=8,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def llava():
    """A CLIP vision tower of 16 patches (all 17 tokens fed to the language model), a
    projector and a Llama."""
    config = transformers.LlavaConfig(
        vision_config=TINY_HF_VIT | {"model_type": "clip_vision_model"},
        text_config=TEXT | {"model_type": "llama"},
        image_token_index=VOCAB,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    ids = torch.randint(3, VOCAB, (1, 21), generator=torch.Generator().manual_seed(1))
    ids[0, 2:19] = VOCAB
    return model, {"input_ids": ids, "pixel_values": torch.randn(1, 3, 16, 16)}


# the vision tower both Qwen families share: 4 x 4 patches of 4 pixels merged 2 x 2
QWEN_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=4,
    out_hidden_size=32,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
)


def qwen_vl(family: str, vision: dict, rope: dict) -> tuple:
    """A Qwen `{family}ForConditionalGeneration` with one image of 4 x 4 patches merged
    into 4 tokens, and its inputs (Qwen3-VL's with the token types its rotary positions
    read)."""
    config = getattr(transformers, f"{family}Config")(
        vision_config=QWEN_VISION | vision,
        text_config=TEXT | {"rope_scaling": rope, "max_position_embeddings": 128},
        image_token_id=VOCAB,
        video_token_id=VOCAB + 1,
        vision_start_token_id=VOCAB + 2,
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForConditionalGeneration")(config)
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    ids[0, 2], ids[0, 3:7] = VOCAB + 2, VOCAB
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(16, 3 * 2 * 4 * 4),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
    }
    if family == "Qwen3VL":
        inputs["mm_token_type_ids"] = (ids == VOCAB).long()
    return model, inputs


def qwen2_5_vl():
    """Qwen2.5-VL: a windowed and a full-attention vision block, the patch merger, and
    the language model with multimodal rotary positions."""
    vision = {"window_size": 16, "fullatt_block_indexes": [1]}
    return qwen_vl("Qwen2_5_VL", vision, {"type": "mrope", "mrope_section": [1, 1, 2]})


SIGLIP = TINY_HF_VIT | {"model_type": "siglip_vision_model"}


def gemma3():
    """Gemma 3: a SigLIP tower (with its attention-pooling head), 16 patches pooled into
    4 image tokens, and Gemma 3's language model."""
    text = TEXT | {"model_type": "gemma3_text", "sliding_window": 8, "query_pre_attn_scalar": 8}
    config = transformers.Gemma3Config(
        vision_config=SIGLIP,
        text_config=text,
        mm_tokens_per_image=4,
        image_token_index=VOCAB,
        boi_token_index=VOCAB + 1,
        eoi_token_index=VOCAB + 2,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config)
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    ids[0, 2:6] = VOCAB
    return model, {
        "input_ids": ids,
        "pixel_values": torch.randn(1, 3, 16, 16),
        "token_type_ids": (ids == VOCAB).long(),
    }


def qwen3_vl():
    """Qwen3-VL: the vision blocks, its merger and a deep-stack merger feeding a
    language-model layer, the language model with interleaved multimodal rotary
    positions."""
    vision = {"num_position_embeddings": 16, "deepstack_visual_indexes": [1]}
    rope = {"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True}
    return qwen_vl("Qwen3VL", vision, rope)


# family: (builder, the vision tower's attention layers, a group of its MLPs or projector)
FAMILIES = {
    "llava": (
        llava,
        [f"model.vision_tower.encoder.layers.{i}.self_attn" for i in (0, 1)],
        "model.multi_modal_projector.linear_1",
    ),
    "qwen2_5_vl": (
        qwen2_5_vl,
        [f"model.visual.blocks.{i}.attn" for i in (0, 1)],
        "model.visual.merger.mlp.0",
    ),
    "gemma3": (  # the projector has no group (a raw weight and a norm)
        gemma3,
        [
            *(f"model.vision_tower.encoder.layers.{i}.self_attn" for i in (0, 1)),
            "model.vision_tower.head.attention",
        ],
        "model.vision_tower.encoder.layers.1.mlp.fc1",
    ),
    "qwen3_vl": (
        qwen3_vl,
        [f"model.visual.blocks.{i}.attn" for i in (0, 1)],
        "model.visual.deepstack_merger_list.0.linear_fc1",
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_vision_language_model_prunes_from_keyword_inputs(family):
    build, vision_heads, projector = FAMILIES[family]
    model, inputs = build()
    pruner = randomised(DTPPruner(model, inputs, 0.5))
    heads = [g.name for g in pruner.groups if isinstance(g, HeadGroup)]
    language = [f"model.language_model.layers.{i}.self_attn" for i in (0, 1)]
    assert heads == vision_heads + language
    assert projector in [g.name for g in pruner.groups]
    masks = pruner.hard_masks()  # exactly the counts asked for, each group
    assert [int(m.sum()) for m in masks] == [kept_count(g.size, 0.5) for g in pruner.groups]
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(**inputs).logits
    with warnings.catch_warnings():  # its config holds the sizes in its parts' configs
        warnings.simplefilter("ignore")
        exported = pruner.export().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(**inputs).logits, want, rtol=1e-5, atol=1e-5)
    params, flops = pruner.predicted_counts()
    assert params == sum(p.numel() for p in exported.parameters())
    assert flops == count_flops(exported, inputs) < pruner.report()["flops_before"]
    with torch.no_grad(), pruner.hard_masked():
        want = model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    got = exported.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)


def test_example_inputs_in_each_form_run_the_model_alike():
    """A tensor is the one positional input, a tuple the positional ones, a dict the
    keyword ones (true even with no positional one); a dict whose keys are not strings
    is refused naming them."""

    def echo(*args, **kwargs):
        return args, kwargs

    x = torch.ones(2)
    assert call_model(echo, as_example_inputs(x)) == ((x,), {})
    assert call_model(echo, as_example_inputs((x, None))) == ((x, None), {})
    keywords = as_example_inputs({"pixel_values": x})
    assert call_model(echo, keywords) == ((), {"pixel_values": x})
    assert keywords and not ExampleInputs() and as_example_inputs(keywords) is keywords
    with pytest.raises(TypeError, match=r"example_inputs: a dict's keys .* got \[0\]"):
        as_example_inputs({0: x})


@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen3_vl", "qwen2_5_vl"])
def test_the_language_models_sizes_go_to_its_own_config(family, tmp_path):
    """The language model's exported sizes are written to the composite config's
    `text_config`, so save_pretrained / from_pretrained rebuild the pruned model; where
    that config cannot hold them (Qwen2.5-VL's text attention sizes its heads as the
    width over their count) it is left unchanged with a warning."""
    build = FAMILIES[family][0]
    model, inputs = build()
    pruner = randomised(DTPPruner(model, inputs, {"model.language_model.*": 0.5}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported = pruner.export().eval()
    described = not [w for w in caught if "config cannot describe" in str(w.message)]
    assert described == (family != "qwen2_5_vl")
    if not described:
        assert exported.config.text_config.num_attention_heads == 4  # left as it was
        return
    text = exported.config.text_config
    assert (text.num_attention_heads, text.num_key_value_heads, text.intermediate_size) == (
        2,
        1,
        32,
    )
    exported.save_pretrained(tmp_path)
    loaded = type(exported).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, exported(**inputs).logits)


def test_on_text_alone_the_vision_tower_stays_whole_and_is_named():
    """Example inputs without an image never run the vision tower: its attention heads
    stay whole like its idle linear layers (nothing would check them), the warning names
    its projections, and the export keeps every vision head while the language model's
    go to half."""
    model, inputs = llava()
    text = {"input_ids": inputs["input_ids"][:, 19:]}  # no image token, no pixels
    with pytest.warns(UserWarning, match=r"vision_tower\.encoder\.layers\.0\.self_attn\.k_proj"):
        pruner = randomised(DTPPruner(model, text, 0.5))
    assert all(g.name.startswith("model.language_model.") for g in pruner.groups)
    assert [g.name for g in pruner.groups if isinstance(g, HeadGroup)] == [
        f"model.language_model.layers.{i}.self_attn" for i in (0, 1)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = pruner.export().eval()
    tower = exported.model.vision_tower.encoder.layers
    assert all(layer.self_attn.q_proj.out_features == 32 for layer in tower)
    assert exported.model.language_model.layers[0].self_attn.q_proj.out_features == 16
    with torch.no_grad(), pruner.hard_masked():  # an image as well: the tower is the dense one
        want = model(**inputs).logits
    with torch.no_grad():
        torch.testing.assert_close(exported(**inputs).logits, want, rtol=1e-5, atol=1e-5)
