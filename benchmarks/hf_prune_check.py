"""Prune every architecture of the installed transformers for a task at a float ratio and
check each export (`python benchmarks/hf_prune_check.py [--task causal-lm | masked-lm |
sequence-classification | image-classification | object-detection |
semantic-segmentation | audio-classification | video-classification |
image-text-to-text] [model_type ...]`): the groups found by kind, the FLOPs reduction,
the export's largest difference from the hard-masked model, its parameters against the
report, whether the layers it leaves their shapes are the ones `pruner.left_whole` lists,
and whether its config rebuilds it (what save_pretrained needs). A model the pruner
refuses, when it is made or when it exports, is tried again with the ratios its error
gives (the ones that leave the refused groups whole), with the layers it names left
whole (`ignored_layers`: those whose search for coupled channels fails), or with
prune_coupled=True where it says residual-coupled widths are groups only so, as a user
would, up to four tries; one refused then, or refused without any of them, gets the
first error's first words and the last's. GPT-2's Conv1D layers are made nn.Linear
first, as `dtp prune` does.

Each architecture is built from its default config (`AutoConfig.for_model`, nothing
downloaded) with the size fields it has set small (SIZES: 2 layers of width 64, 4 heads,
a vocabulary of 256, 64 x 64 images, 4 frames; in each part's config too, and its
parts', for a multimodal model; a config that derives sizes from others, or holds
sizes per layer, when built is built again with them as arguments), random weights and
random scores, on 12 tokens (a sequence
classifier's last one its end of sequence; a vision-language model's with one image of
its vision config's size where `image_and_text` can build it, else its text alone, its
vision tower then whole), one image (classifiers, detectors, segmenters; SigLIP 2's as
its patches), one clip
(video classifiers), or 4,000 samples of audio (a spectrogram of the config's size for
Whisper). A config whose own checks refuse that
size, or a model that does not run at it, is listed as not built; one still over 30M
parameters (a field SIZES does not name) is skipped."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers
from _harness import RESULTS, environment
from _prune_sweep import Refused, first_words, prune_as_refusals_say, row_within, table
from transformers import (
    AutoConfig,
    AutoModelForAudioClassification,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForImageTextToText,
    AutoModelForMaskedLM,
    AutoModelForObjectDetection,
    AutoModelForSemanticSegmentation,
    AutoModelForSequenceClassification,
    AutoModelForVideoClassification,
)
from transformers.models.auto import modeling_auto

from dtp_kernels import conv1d_to_linear
from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.config_forecast import config_forecast
from dtp_kernels.pruning.cost import count_params
from dtp_kernels.pruning.group_kinds import kind_of
from dtp_kernels.pruning.hf_config import describes

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from utils import layer_shapes, whole_as_listed

# the size fields of the families' configs, set where a config has them as numbers
SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "decoder_vocab_size": 256,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "d_model": 64,
    "d_ff": 128,
    "ffn_dim": 128,
    "n_inner": 128,
    "num_layers": 2,
    "n_positions": 128,
    "max_position_embeddings": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,  # group-limited routing: one group of the few experts
    "topk_group": 1,
    "mamba_n_heads": 8,  # Mamba-2 mixers of a hybrid: 8 heads of 16, twice the width
    "mamba_d_head": 16,
    "attn_layer_period": 2,  # Jamba's and Zamba's attention layers: the second of two
    "attn_layer_offset": 1,
    "decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    # multi-head latent attention (DeepSeek's) and partial rotary embeddings
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "rotary_dim": 8,
    "attention_hidden_size": 64,
    "index_n_heads": 2,  # the sparse attention's indexer (DeepSeek-V3.2's); fewer heads
    # than the attention, as in the checkpoints (as many, its weights_proj reads as their table)
    "index_head_dim": 16,
    "pooler_hidden_size": 64,  # DeBERTa's classification head
    # images
    "image_size": 64,
    "patch_size": 8,
    "window_size": 4,  # Swin's: a whole stage of 8 x 8 patches is 4 windows
    "num_frames": 4,  # videos
    "num_labels": 5,
}
# fields with one entry per stage, cut to the first stages where the layer count is the
# stage count (ConvNeXt's, Swin's)
STAGE_LISTS = ("depths", "hidden_sizes", "num_heads", "masked_unit_attention")
# sizes of a vision-language model's parts besides SIZES (Qwen2-VL's vision tower: its
# blocks, width and heads, its output the language model's width)
PART_SIZES = {
    "depth": 2,
    "embed_dim": 64,
    "num_heads": 4,
    "out_hidden_size": 64,
    "adapter_input_size": 64,  # dots.llm3's audio adapter: from the audio width to the text's
    "adapter_out_dim": 64,
    "cross_attention_hidden_size": 64,  # T5Gemma's decoder: the encoder's width
}
# sizes of an architecture that SIZES' do not fit, set after them (Mamba-2's mixer: 8
# heads of 16 make twice the width of 64, in 2 groups sharing their B and C), and fields
# its default config leaves unset that its checkpoints set (dots.llm1's experts, LFM2-MoE's
# layer types, DBRX's rotary base and clipping; its key/value heads and its experts'
# sizes are in parts' configs)
OWN_SIZES = {
    "mamba2": {"num_heads": 8, "n_groups": 2},
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1},
    "recurrent_gemma": {"lru_width": 64},  # its recurrent blocks' width
    "step3p5": {"sliding_window": 8},  # Step 3.7's language model: unset by default
    "esm": {"vocab_size": 33, "pad_token_id": 1, "mask_token_id": 32},  # ESM-2's: unset
    "laguna": {"num_attention_heads_per_layer": [4, 4]},  # one per layer, 40 by default
    "zaya": {"num_experts_per_tok": 1},  # the only routing it supports
    # xLSTM: its width besides hidden_size; its query/key width at the full width, as its
    # cache rounds that width up to 64 where its layers do not
    "xlstm": {"embedding_dim": 64, "qk_dim_factor": 1.0, "num_blocks": 2},
    # the Bailing hybrid's linear attention: 4 heads of 16 (32 of 128 by default)
    "bailing_hybrid": {"linear_num_heads": 4, "linear_head_dim": 16},
    # Zamba's and Zamba2's shared transformer block in two layers, the later one holding
    # the first one's tensors, as their checkpoints' layers do
    "zamba2": {
        "num_hidden_layers": 3,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
        "hybrid_layer_ids": [1, 2],  # derived from the types when built: set with them
        "num_mem_blocks": 1,
    },
    "zamba": {
        "num_hidden_layers": 3,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
        "mamba_dt_rank": 8,
    },
    # GPT-Neo's layers' attention kinds (global, then local) for 2 layers, as its config
    # derives them from attention_types when built
    "gpt_neo": {
        "attention_types": [[["global", "local"], 1]],
        "attention_layers": ["global", "local"],
    },
    # 4 layers, the last 2 reading the keys and values of the first 2 (KV sharing); its
    # per-layer inputs and activation sparsity at that size
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
        "vocab_size_per_layer_input": 256,
        "hidden_size_per_layer_input": 16,
        "laurel_rank": 8,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
    },
    # its grouped output projection: 2 groups of 4 heads of 16, to a rank of 24 each (its
    # o_b_proj then reads 48, not the compressed query's 32 as q_b_proj does); 8 heads,
    # not the 4 tokens its compressors pool, whose position biases would look per head
    "deepseek_v4": {"num_attention_heads": 8, "o_groups": 2, "o_lora_rank": 24, "head_dim": 16},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "qwen4_exp_text": {  # its sparse attention's indexer, n-gram embeddings in no layer
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
        "ple_layer_ids": [],
        "hc_lowrank": 16,
    },
    # text models whose layers' sizes are tied otherwise: Funnel's blocks (one layer
    # each), SqueezeBERT's embeddings (its width), MobileBERT's (under its width: its
    # language-model head makes up the rest), ESM C's key/value heads (one per query
    # head), LayoutLMv3's box embeddings (4 coordinates and 2 sizes make its width),
    # LiLT's (6 of a sixth of its width, so 96 wide)
    "funnel": {"block_sizes": [1, 1], "block_repeats": [1, 1], "n_head": 4, "d_head": 16},
    "squeezebert": {"embedding_size": 64},
    "mobilebert": {"embedding_size": 32},
    "esmc": {"num_key_value_heads": 4},
    "layoutlmv3": {"coordinate_size": 10, "shape_size": 12},
    "lilt": {"hidden_size": 96, "intermediate_size": 192},
    "xlnet": {"d_head": 16, "mem_len": 16},
    "xmod": {"default_language": "en_XX"},  # its adapters': which language's to run
    # vision-language models' image features at the small sizes: PaliGemma's projected to
    # the text width; Gemma 3's 8 x 8 patches pooled to 4 x 4 tokens
    "paligemma": {"projection_dim": 64, "vision_config.projection_dim": 64},
    "gemma3": {"mm_tokens_per_image": 16},
    "shieldgemma2": {"mm_tokens_per_image": 16},
    # Qwen2.5-VL's vision tower: windows of 2 x 2 merged tokens (the SIZES' window of 4
    # pixels holds none), its second block of full attention; ViP-LLaVA's projector
    # reading the last 2 of the 2 vision layers
    **{
        vision: {"window_size": 32, "fullatt_block_indexes": [1]}
        for vision in ("qwen2_5_vl_vision", "exaone4_5_vision", "qwen2_5_omni_vision_encoder")
    },
    "vipllava": {"vision_feature_layers": [-2, -1]},
    "dbrx": {
        "attn_config.rope_theta": 500000.0,
        "attn_config.clip_qkv": 8.0,
        "attn_config.kv_n_heads": 2,
        "ffn_config.hidden_size": 64,
        "ffn_config.ffn_hidden_size": 128,
    },
}
# sizes a config with sizes per layer takes as arguments only (Gemma 4's full-attention
# head_dim, its per-layer input embeddings' width and vocabulary)
PER_LAYER_SIZES = {
    "global_head_dim": 32,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 256,
}
# sizes per layer an architecture takes as arguments of its own (dots.llm3's sliding-window
# layers: latent attention of sizes apart from the others'; its vision adapter, from the
# vision width to the text's)
PER_LAYER_OWN = {
    "dots3_note_vision_encoder": {"adapter_in_dim": 64, "adapter_out_dim": 64},
    "dots3_note_text": {
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_q_lora_rank": 32,
        "swa_kv_lora_rank": 16,
        "swa_head_dim": 16,
        "swa_qk_nope_head_dim": 8,
        "swa_v_head_dim": 16,
    },
}
# size fields an architecture needs as they are: LeViT's stem always downsamples 16
# times; MobileViT V2's last stage at 64 x 64 is smaller than 8 x 8 patches; BEiT's
# and DPT's segmentation heads read four of their 12 layers
KEPT = {
    "levit": ("patch_size",),
    "mobilevitv2": ("patch_size",),
    "beit": ("num_hidden_layers",),
    "data2vec-vision": ("num_hidden_layers",),
    "dpt": ("num_hidden_layers",),
    "falcon_h1": ("mamba_n_heads", "mamba_d_head"),  # its mixer's width is its own field
    **{  # twice the width: its own and the embeddings'
        zamba: ("attention_hidden_size",) for zamba in ("zamba", "zamba2")
    },
}
# fields with one type per layer (attention's, the feed-forward's: dense or experts;
# Zamba2's blocks: Mamba-2 alone or with the shared attention; RecurrentGemma's
# recurrent and attention blocks, repeated)
LAYER_TYPES = ("layer_types", "mlp_layer_types", "layers_block_type", "block_types")
# architectures whose configs compute sizes from others when they are built (Zamba2's
# heads' widths): built again with SIZES' fields as arguments
DERIVED_SIZES = ("zamba", "zamba2")
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
# task: (model class, its architectures, what the results file calls them)
TASKS = {
    "causal-lm": (
        AutoModelForCausalLM,
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "causal language models",
    ),
    "masked-lm": (
        AutoModelForMaskedLM,
        modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        "masked language models",
    ),
    "sequence-classification": (
        AutoModelForSequenceClassification,
        modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        "sequence classifiers",
    ),
    "audio-classification": (
        AutoModelForAudioClassification,
        modeling_auto.MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES,
        "audio classifiers",
    ),
    "image-classification": (
        AutoModelForImageClassification,
        modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
        "image classifiers",
    ),
    "object-detection": (
        AutoModelForObjectDetection,
        modeling_auto.MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES,
        "object detectors",
    ),
    "semantic-segmentation": (
        AutoModelForSemanticSegmentation,
        modeling_auto.MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES,
        "semantic segmenters",
    ),
    "image-text-to-text": (
        AutoModelForImageTextToText,
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        "vision-language models (on text, with an image where the harness gives one)",
    ),
    "video-classification": (
        AutoModelForVideoClassification,
        modeling_auto.MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES,
        "video classifiers",
    ),
}
IMAGE_TASKS = ("image-classification", "object-detection", "semantic-segmentation")
# a vision-language model's config fields of its image token id
IMAGE_TOKEN_FIELDS = ("image_token_id", "image_token_index")
VIDEO_TASKS = ("video-classification",)
LARGEST = 30e6  # parameters at the small size
SECONDS = 120  # per architecture


def small_model(model_type: str, task: str) -> torch.nn.Module:
    """The architecture built from its default config at the small size."""
    auto = TASKS[task][0]
    config = AutoConfig.for_model(model_type)
    stage_lists = {  # built again so that the fields derived from them follow
        field: list(getattr(config, field))[: SIZES["num_hidden_layers"]]
        for field in STAGE_LISTS
        if isinstance(getattr(config, field, None), (list, tuple))
        and config.attribute_map.get("num_hidden_layers") in ("num_stages", "num_layers")
    }
    if isinstance(getattr(config, "num_query_pool", None), int) and stage_lists:
        stage_lists["num_query_pool"] = 1  # Hiera's pooling stages: fewer than the stages
    if stage_lists:
        config = AutoConfig.for_model(model_type, **stage_lists)
    # a config of sizes per layer, built again at the small size; a multimodal one's
    # parts are, each on its own, below (dots.llm3's takes no sizes of its parts)
    per_layer = config.__dict__.get("_heterogeneity_spec") is not None and not getattr(
        config, "sub_configs", None
    )
    if per_layer:  # its global sizes read and written below, the layers' own kept
        config = _small_config(model_type, config)
        config.allow_global_per_layer_attribute_access = True
    elif model_type in DERIVED_SIZES:
        config = _small_config(model_type, config)
    _shrink(config, model_type)
    _shrink_parts(config)
    if task == "semantic-segmentation" and len(getattr(config, "out_indices", None) or []) == 1:
        layers = config.num_hidden_layers  # BEiT's segmenter reads one layer per quarter
        config.set_output_features_output_indices(
            out_features=None, out_indices=[layers * q // 4 for q in (1, 2, 3, 4)]
        )
    if per_layer:
        config.allow_global_per_layer_attribute_access = False
    if task == "image-text-to-text":
        _small_image_inputs(config)
    with torch.device("meta"):
        meta = auto.from_config(config)
    if sum(p.numel() for p in meta.parameters()) > LARGEST:
        raise OverflowError("over 30M parameters at this size")
    torch.manual_seed(0)
    return auto.from_config(config).eval()


def _small_image_inputs(config) -> None:
    """A vision-language model's image token id moved to the small vocabulary's last id
    (its default is an id of the full vocabulary), and the resolutions it cuts an image
    into crops at (LLaVA-NeXT's grid pinpoints) one crop of the small image size."""
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    for field in IMAGE_TOKEN_FIELDS:
        token = getattr(config, field, None)
        if isinstance(token, int) and isinstance(vocab, int) and token >= vocab:
            setattr(config, field, vocab - 1)
    size = getattr(getattr(config, "vision_config", None), "image_size", None)
    if getattr(config, "image_grid_pinpoints", None) and isinstance(size, int):
        config.image_grid_pinpoints = [[size, size]]


def _shrink_parts(config) -> None:
    """Make each part of a multimodal model (CLIP's, a VLM's: its own config) small, and
    the parts of those parts (T5Gemma 2's encoder holds a text and a vision config)."""
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if not hasattr(sub, "to_dict"):
            continue
        if sub.__dict__.get("_heterogeneity_spec") is not None:  # Gemma 4's language model
            sub = _small_config(sub.model_type, sub)
            setattr(config, key, sub)
            sub.allow_global_per_layer_attribute_access = True
        _shrink(sub, sub.model_type, PART_SIZES)
        if sub.__dict__.get("_heterogeneity_spec") is not None:
            sub.allow_global_per_layer_attribute_access = False
        _shrink_parts(sub)


def _shrink(config, model_type: str, extra: dict | None = None) -> None:
    """Set the size fields of SIZES (and `extra`) `config` has, as the small model needs
    them; a multimodal rotary embedding's sections (Qwen2-VL's: time, height, width in
    the proportions 2 : 3 : 3 of its pairs) fitted to the small head size."""
    for field, value in {**SIZES, **(extra or {})}.items():
        current = getattr(config, field, None)
        if field in KEPT.get(model_type, ()):
            continue
        if isinstance(current, int) and not isinstance(current, bool):
            # a property derived from others, or one the family does not set (XLNet's
            # positions: it has no limit; Funnel's layers: the sum of its blocks')
            with contextlib.suppress(AttributeError, NotImplementedError):
                setattr(config, field, value)
    if isinstance(getattr(config, "qk_rope_head_dim", None), int):  # latent attention's
        # rotary key is its head_dim, or that part of it its rotary factor says (Mistral 4's)
        rope = getattr(config, "rope_parameters", None)
        if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
            rope = next(iter(rope.values()))  # one per layer type (dots.llm3's): alike here
        part = rope.get("partial_rotary_factor", 1) if isinstance(rope, dict) else 1
        with contextlib.suppress(AttributeError):
            config.head_dim = round(config.qk_rope_head_dim / part)
        if isinstance(getattr(config, "qk_head_dim", None), int):  # a stored sum
            config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        if isinstance(getattr(config, "kv_lora_rank", None), int):  # keys and values
            config.num_key_value_heads = config.num_attention_heads  # per query head
    for field, value in OWN_SIZES.get(model_type, {}).items():
        owner, _, name = field.rpartition(".")  # a field of a part's config: "part.field"
        setattr(getattr(config, owner) if owner else config, name, value)
    for field in TOKEN_IDS:  # ids of the default vocabulary, past the small one
        current = getattr(config, field, None)
        if isinstance(current, int) and current >= SIZES["vocab_size"]:
            setattr(config, field, TOKEN_IDS.index(field))
    layers = getattr(config, "num_hidden_layers", None)  # an architecture's own count
    layers = layers if isinstance(layers, int) else SIZES["num_hidden_layers"]
    for field in LAYER_TYPES:  # one type per layer
        types = getattr(config, field, None)
        if isinstance(types, list) and types:
            with contextlib.suppress(AttributeError):
                setattr(config, field, _every_type(types, layers))
    rope = getattr(config, "rope_parameters", None)
    sections = "mrope_section" in getattr(type(config), "ignore_keys_at_rope_validation", ())
    if isinstance(rope, dict) and (sections or "mrope_section" in rope):
        # the pairs of its rotary part (GLM-4.5V's: half of each head)
        rotary = (getattr(config, "head_dim", None) or SIZES["head_dim"]) * rope.get(
            "partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1
        )
        pairs = round(rotary) // 2
        time = pairs // 4
        rope["mrope_section"] = [time, (pairs - time) // 2, pairs - time - (pairs - time) // 2]
    _fill_unset_defaults(config)


def _small_config(model_type: str, config):
    """A config built again at the small size, its sizes given as arguments: one with
    sizes per layer (Gemma 4's), whose layers' own sizes come from arguments
    (PER_LAYER_SIZES) its constructor turns into per-layer overrides and whose global
    values cannot be read to be changed; or one of DERIVED_SIZES."""
    if model_type not in DERIVED_SIZES:
        config.allow_global_per_layer_attribute_access = True
    sizes = {
        field: value
        for field, value in SIZES.items()
        if isinstance(getattr(config, field, None), int)
        and not isinstance(getattr(config, field), bool)
        and field not in KEPT.get(model_type, ())
    }
    for field in LAYER_TYPES:
        types = getattr(config, field, None)
        if isinstance(types, list) and types:
            sizes[field] = _every_type(types, SIZES["num_hidden_layers"])
    if isinstance(getattr(config, "kv_lora_rank", None), int):  # keys and values per head
        sizes["num_key_value_heads"] = sizes.get("num_attention_heads", config.num_attention_heads)
    if model_type in DERIVED_SIZES:
        return AutoConfig.for_model(model_type, **sizes)
    own = PER_LAYER_OWN.get(model_type, {})
    return AutoConfig.for_model(model_type, **sizes, **PER_LAYER_SIZES, **own)


def _every_type(types: list, layers: int) -> list:
    """`layers` layer types holding every type of `types` where they fit (a hybrid's
    attention layers are few and far between): the last layers when they hold every
    type or no `layers` can, or else each type's first layer, in order, the first type
    repeated to fill."""
    if set(types[-layers:]) == set(types) or len(set(types)) > layers:
        return types[-layers:]
    firsts = sorted({kind: i for i, kind in reversed(list(enumerate(types)))}.values())
    kept = [types[i] for i in firsts][:layers]
    return [types[0]] * (layers - len(kept)) + kept


def _fill_unset_defaults(config) -> None:
    """Fields some default configs leave unset although their models read them (the
    pretrained checkpoints' configs set them)."""
    if getattr(config, "architectures", []) is None:  # the task's first class
        config.architectures = []
    if getattr(config, "head_dim", 0) is None and isinstance(config.hidden_size, int):
        config.head_dim = config.hidden_size // config.num_attention_heads
    # a hybrid whose small layers would hold no attention layer (transformers' cache then
    # fails on the forward): the last of them attention, as the full-size model has
    layers = SIZES["num_hidden_layers"]
    if getattr(config, "attn_layer_indices", 0) is None:  # Bamba's
        config.attn_layer_indices = [layers - 1]
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and set(types) == {"linear_attention"}:  # GraniteMoeHybrid's
        with contextlib.suppress(AttributeError):  # derived in Mamba's: none to choose
            config.layer_types = [*types[: layers - 1], "full_attention"]
    if getattr(config, "num_key_value_heads", 0) is None:  # "None: as many as queries"
        config.num_key_value_heads = config.num_attention_heads
    if getattr(config, "num_experts_per_tok", 0) is None:
        config.num_experts_per_tok = SIZES["num_experts_per_tok"]
    pad = getattr(config, "pad_token_id", None)
    start = getattr(config, "decoder_start_token_id", None)
    if config.is_encoder_decoder and start is None and pad is not None:
        config.decoder_start_token_id = pad  # T5's convention


def kinds(pruner: DTPPruner) -> str:
    """The groups by kind, as ratio dicts name them ("heads", "mlp", "experts", ...)."""
    counts: dict[str, int] = {}
    for group in pruner.groups:
        counts[kind_of(group)] = counts.get(kind_of(group), 0) + 1
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))


def example(model: torch.nn.Module, task: str) -> torch.Tensor | dict:
    """12 token ids (a vision-language model's: 10 around the image tokens of one image,
    and the image, where image_and_text gives them); one image of the
    config's size and channels (SigLIP 2's as patches, with their mask and grid: keyword
    inputs); 4,000 samples of audio or, for a model of spectrograms, one of the config's
    mel bins and length."""
    generator = torch.Generator().manual_seed(1)
    if task == "image-text-to-text":
        with_image = image_and_text(model)
        if with_image is not None:
            return with_image
    if task == "audio-classification":
        if model.main_input_name == "input_values":
            return torch.randn(1, 4000, generator=generator)
        config = model.config  # Whisper's encoder: (mel bins, twice its positions)
        length = 2 * getattr(config, "max_source_positions", 1500)
        return torch.randn(1, getattr(config, "num_mel_bins", 80), length, generator=generator)
    if task not in (*IMAGE_TASKS, *VIDEO_TASKS):
        vocab = getattr(model.config.get_text_config(), "vocab_size", None)
        high = min(200, vocab) if isinstance(vocab, int) else 200  # ESM-2's 33 amino acids
        ids = torch.randint(3, high, (1, 12), generator=generator)
        eos = getattr(model.config, "eos_token_id", None)
        if task == "sequence-classification" and isinstance(eos, int):
            ids[0, -1] = eos  # an encoder-decoder classifies at its last end of sequence
        return ids
    # the image config: the model's, or its vision part's (CLIP's, SigLIP's classifiers)
    config = getattr(model.config, "vision_config", None) or model.config
    size = getattr(config, "image_size", 224)
    size = size if isinstance(size, int) else size[0]
    channels = getattr(config, "num_channels", 3)
    if "spatial_shapes" in inspect.signature(model.forward).parameters:
        # SigLIP 2's patches of any aspect ratio (NaFlex), as its processor gives them
        patch = config.patch_size
        grid, width = size // patch, channels * patch * patch
        return {
            "pixel_values": torch.randn(1, grid * grid, width, generator=generator),
            "pixel_attention_mask": torch.ones(1, grid * grid, dtype=torch.long),
            "spatial_shapes": torch.tensor([[grid, grid]]),
        }
    if task in VIDEO_TASKS:  # (batch, frames, channels, height, width)
        frames = getattr(model.config, "num_frames", 4)
        return torch.randn(1, frames, channels, size, size, generator=generator)
    return torch.randn(1, channels, size, size, generator=generator)


def image_and_text(model: torch.nn.Module) -> dict | None:
    """One image of the vision config's size (as patches with their grid where the model
    takes a grid: Qwen2-VL's; with its one crop where it cuts crops: LLaVA-NeXT's; the one
    image of a sample's images where it takes several: Idefics') and 10 token ids with as
    many image tokens as the model makes features of it after the first 2 (with the image
    size, or the token types, where the model takes them). None where the config has no
    image token or vision config, or the model no get_image_features, or where these
    inputs do not run it (a model of other image inputs: the text alone is its example)."""
    config = model.config
    vision = getattr(config, "vision_config", None)
    token = next(
        (t for f in IMAGE_TOKEN_FIELDS if isinstance(t := getattr(config, f, None), int)), None
    )
    if token is None or vision is None or not hasattr(model, "get_image_features"):
        return None
    generator = torch.Generator().manual_seed(2)
    size = getattr(vision, "image_size", 64)
    size = size if isinstance(size, int) else size[0]
    channels = getattr(vision, "num_channels", getattr(vision, "in_channels", 3))
    pixels = torch.randn(1, channels, size, size, generator=generator)
    takes = inspect.signature(model.get_image_features).parameters
    extra = {}
    if "image_sizes" in takes:
        extra["image_sizes"] = torch.tensor([[size, size]])
        if getattr(config, "image_grid_pinpoints", None):  # the image and its one crop
            pixels = torch.randn(1, 2, channels, size, size, generator=generator)
    if "image_grid_thw" in takes:  # patches of `temporal` frames, merged `merge` x `merge`
        patch = vision.patch_size
        temporal = getattr(vision, "temporal_patch_size", 1)
        merge = getattr(vision, "spatial_merge_size", 1)
        side = size // patch // merge * merge
        width = channels * temporal * patch * patch
        pixels = torch.randn(side * side, width, generator=generator)
        extra["image_grid_thw"] = torch.tensor([[1, side, side]])
    vocab = config.get_text_config().vocab_size
    text = torch.randint(3, min(200, vocab), (1, 12 - 2), generator=generator)
    # (batch, channels, height, width), else one image of images per sample (Idefics')
    for form in (pixels, pixels[:, None]) if pixels.dim() == 4 else (pixels,):
        try:
            return _image_inputs(model, form, extra, text, token)
        except Exception:  # inputs of another form
            continue
    return None


def _image_inputs(model: torch.nn.Module, pixels, extra: dict, text, token: int) -> dict:
    """The inputs of `pixels` with `text` around as many image tokens as the model makes
    features of them, run once (an error where the model does not take them so)."""
    with torch.no_grad():
        features = _feature_count(model.get_image_features(pixel_values=pixels, **extra))
        image = torch.full((1, features), token)
        ids = torch.cat([text[:, :2], image, text[:, 2:]], dim=1)
        inputs = {"input_ids": ids, "pixel_values": pixels, **extra}
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            inputs["mm_token_type_ids"] = (ids == token).long()
        model(**inputs)
    return inputs


def _feature_count(features) -> int:
    """The number of feature vectors get_image_features returned (a tensor, a list of
    them, or an output whose pooler_output holds them)."""
    if isinstance(features, torch.Tensor):
        return features.shape[:-1].numel()
    if isinstance(features, (list, tuple)):
        return sum(_feature_count(f) for f in features)
    return _feature_count(features.pooler_output)


def check(model_type: str, ratio: float, task: str) -> list[str]:
    """The table row of one architecture (a vision-language model's with what its
    example inputs hold after its result)."""
    try:
        model = small_model(model_type, task)
        ids = example(model, task)
        with torch.no_grad():
            _ = _run(model, ids).logits  # the output the check compares
    except OverflowError as error:
        return _with_inputs(_unpruned(model_type, "skipped", str(error)), task, None)
    except Exception as error:  # the config's own checks, or a model that needs more
        return _with_inputs(_unpruned(model_type, "not built", type(error).__name__), task, None)
    conv1d_to_linear(model)  # GPT-2's Conv1D layers, as `dtp prune` converts them
    shapes = layer_shapes(model)
    pruned = prune_as_refusals_say(
        model,
        _inputs(ids),
        ratio,
        lambda m: _run(m, ids).logits,
        before_export=lambda p: p.config_describes_export(),
    )
    if isinstance(pruned, Refused):
        return _with_inputs(_unpruned(model_type, "refused", pruned.why()), task, ids)
    pruner, exported, ignored = pruned.pruner, pruned.exported, pruned.ignored
    with torch.no_grad():
        got = _run(exported, ids).logits
    report = pruner.report()
    error = float((got - pruned.want).abs().max() / pruned.want.abs().max().clamp_min(1e-12))
    row = [
        model_type,
        pruned.result,
        kinds(pruner),
        f"{report['flops_before'] / report['flops_after']:.2f}x",
        f"{error:.1e}",
        "yes" if count_params(exported) == report["params_after"] else "NO",
        "yes" if whole_as_listed(exported, shapes, pruner.left_whole) else "NO",
        _config_cell(describes(exported), pruned.before),
        _advice_cell(model_type, task, ids, pruner, ignored, describes(exported)),
        " ".join(
            (["`prune_coupled=True`"] if pruned.coupled else [])
            + ([f"`ratios={pruned.ratios}`"] if pruned.ratios != ratio else [])
            + ([f"`ignored_layers` {ignored}"] if ignored else [])
        ),
    ]
    return _with_inputs(row, task, ids)


def _with_inputs(row: list[str], task: str, example) -> list[str]:
    """`row` with, for a vision-language model, what its example holds after its result
    ("" where it was not built)."""
    if task != "image-text-to-text":
        return row
    held = "" if example is None else "text"
    if isinstance(example, dict) and "pixel_values" in example:
        held = "text and image"
    return [*row[:2], held, *row[2:]]


def _advice_cell(
    model_type: str, task: str, ids, pruner: DTPPruner, ignored: list[str], described: bool
) -> str:
    """Where the config does not describe the export: whether a model pruned with the
    ratios config_forecast advises exports with a config that does ("none": it advises
    none)."""
    if described:
        return ""
    advice = config_forecast(pruner)["ratios"]
    if advice is None:
        return "none"
    model = small_model(model_type, task)
    with torch.no_grad():  # as check's model ran (BigBird's switches its attention then)
        _run(model, ids)
    conv1d_to_linear(model)
    layers = [model.get_submodule(name) for name in ignored]
    try:
        exported = DTPPruner(model, _inputs(ids), advice, ignored_layers=layers).export()
    except ValueError as error:
        return f"NO ({first_words(error, 60)})"
    return "yes" if describes(exported) else "NO"


def _config_cell(described: bool, predicted: bool | None) -> str:
    """Whether the config describes the export; flagged where the pruner's prediction,
    made before the export (config_describes_export), says otherwise."""
    said = "yes" if described else "no"
    return said if predicted == described else f"{said.upper()} (predicted {predicted})"


def _inputs(example: torch.Tensor | dict) -> tuple | dict:
    """The pruner's example inputs: the one positional input, or keyword inputs."""
    return example if isinstance(example, dict) else (example,)


def _run(model: torch.nn.Module, example: torch.Tensor | dict):
    """`model` run on the example (positional, or keyword inputs)."""
    return model(**example) if isinstance(example, dict) else model(example)


def _unpruned(model_type: str, result: str, why: str) -> list[str]:
    """The row of an architecture not pruned: its result and why, the rest blank."""
    return [model_type, result, "", "", "", "", "", "", "", why]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="model types (default: every one of the task)")
    parser.add_argument("--task", choices=list(TASKS), default="causal-lm")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    _, architectures, what = TASKS[args.task]
    rows = []
    for name in args.models or sorted(architectures):
        start = time.perf_counter()
        expired = _with_inputs(_unpruned(name, "timed out", f"over {SECONDS} s"), args.task, None)
        row = row_within(SECONDS, expired, check, name, args.ratio, args.task)
        rows.append(row)
        print(f"{' | '.join(row)} ({time.perf_counter() - start:.1f} s)", flush=True)
    env = environment(torch.device("cpu"))
    header = [
        "model type",
        "result",
        *(["inputs"] if args.task == "image-text-to-text" else []),
        "groups",
        "FLOPs fewer",
        "export error",
        "params = report",
        "whole = listed",
        "config",
        "advice",
        "why",
    ]
    inputs = "12 tokens"
    if args.task in IMAGE_TASKS:
        inputs = "one 64 x 64 image"
    elif args.task in VIDEO_TASKS:
        inputs = "one clip of 4 frames of 64 x 64"
    elif args.task == "audio-classification":
        inputs = "4,000 samples of audio or Whisper's 80 x 3,000 spectrogram"
    elif args.task == "image-text-to-text":
        inputs = (
            "12 tokens, or where the model takes an image in the harness's form (its "
            "`inputs` column), one image of its vision config's size and 10 tokens around "
            "its image tokens"
        )
    lines = [
        f"# Hugging Face {what} pruned and exported "
        f"(`benchmarks/hf_prune_check.py --task {args.task}`)",
        "",
        f"{env['device']}; torch {env['torch']}, transformers {transformers.__version__}; "
        f"{env['date']}; float ratio {args.ratio}, each architecture's default config at 2 "
        "layers of width 64 (the script's SIZES), random weights and scores, "
        f"{inputs}. Export error: "
        "largest difference from the hard-masked model's logits, relative to their largest. "
        "Whole = listed: whether the layers the export leaves their shapes are the ones "
        "pruner.left_whole lists. Config: whether the exported model's config rebuilds it, "
        "so save_pretrained writes what from_pretrained loads (else save it with "
        "dtp_kernels.save_pruned); in capitals, with the prediction, where "
        "pruner.config_describes_export() said otherwise before the export. Advice: where "
        "it does not, whether the model pruned with the ratios config_forecast advises "
        "exports with a config that does (none: no ratios but leaving everything whole).",
        "",
        *table(header, rows, 1, "architectures"),
    ]
    report = "\n".join(lines) + "\n"
    if not args.no_save:
        name = "hf_prune_check" if args.task == "causal-lm" else f"hf_prune_check_{args.task}"
        (RESULTS / f"{name.replace('-', '_')}_cpu.md").write_text(report)
    else:
        print(report)


if __name__ == "__main__":
    main()
