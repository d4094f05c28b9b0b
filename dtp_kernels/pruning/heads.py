"""Attention-head groups: one segment over the heads of an attention layer.

These forms of attention layer are recognised by their structure (Torch-Pruning's graph
does not follow the per-head reshapes):

- separate projections, as Hugging Face writes them: ``q_proj``, ``k_proj``, ``v_proj``
  and ``o_proj`` (Llama, Mistral, Qwen, Gemma), ``out_proj`` (OPT, BART, Whisper, CLIP,
  GPT-J, XGLM), ``dense`` (Phi), ``Wo`` (ModernBERT's decoder), ``projection_layer``
  (InternVL's vision tower) or ``proj`` (timm's EVA, unfused), with ``head_dim``;
  DistilBERT's ``q_lin``, ``k_lin``, ``v_lin``, ``out_lin`` and ALBERT's ``query``,
  ``key``, ``value``, ``dense`` with ``attention_head_size``; T5's and UMT5's ``q``, ``k``,
  ``v``, ``o`` with ``key_value_proj_dim``; CTRL's ``Wq``, ``Wk``, ``Wv``, ``dense``
  with ``head_dim``; XLM's and FlauBERT's ``q_lin``, ``k_lin``, ``v_lin``, ``out_lin``
  with ``head_dim``. An RMS normalization of the queries or keys
  over all heads (OLMo 2's ``q_norm``, not Qwen3's per head) is kept exact as heads go
  (head_norms.py); any other normalization over all heads refuses the group; an output
  gate of the query width (AFMoE's ``gate_proj``) is cut with the heads, and any other
  linear layer computing the query width from the layer's input refuses the group;
- one fused ``qkv`` projection and ``proj``, with ``num_heads`` and ``head_dim``, as
  timm's ViT and DeiT write them (or ``num_heads`` alone: timm's and torchvision's Swin,
  timm's MaxxViT, whose ``head_first`` layers hold each head's query, key and value in
  turn); layers whose code ties the head size or the output width to the input width
  (torchvision's Swin and MaxViT; timm's EVA, BEiT, Swin V2, Swin V2 CR, DaViT, XCiT,
  EdgeNeXt, VOLO, relative-position ViT, PVT v2, Twins, NesT, ConViT and CaiT, whose
  talking heads' mixes over the heads are cut with them; Hugging Face's
  TrOCR and PVT v2, of the separate form) are exported as classes of
  torchvision_attention.py, timm_attention.py and transformers_attention.py
  (``PRUNED_CLASS_MODULES``); GPT-2's ``c_attn`` and ``c_proj`` with ``split_size`` (its
  Conv1D layers made ``nn.Linear`` by :func:`conv1d_to_linear` first; OpenAI GPT's with
  ``n_head``); MPNet's ``q``, ``k``, ``v``, ``o`` with ``attention_head_size``; Phi-3's
  ``qkv_proj`` (query heads, then key and value heads) and ``o_proj``, whose head count
  the layers read from the config they share;
- a query projection ``q`` and one ``kv`` of all the keys then all the values (timm's
  PVT v2, Twins' global attention and VOLO's class attention), or one ``qk`` and ``v``
  (ConViT's gated positional attention), and ``proj``, with ``num_heads`` and
  ``head_dim`` or the head count alone;
- a fused ``qkv`` holding each head's query, key and value in turn, with ``key_dim``,
  ``val_dim`` and ``num_heads`` (timm's TinyViT, EfficientFormer and LeViT; Hugging
  Face's LeViT, ``queries_keys_values``; LeViT's projections carry a batch norm of their
  rows, cut with them);
- ``query``, ``key``, ``value`` with ``num_attention_heads`` and ``attention_head_size``,
  the output projection being the ``output.dense`` beside it (Hugging Face's BERT), or
  ``query_proj``, ``key_proj``, ``value_proj`` there (DeBERTa);
- one fused projection holding each unit's query heads, key and value in turn: GPT-NeoX's,
  Falcon's and BLOOM's ``query_key_value`` with ``dense``, GPT-BigCode's ``c_attn`` with
  ``c_proj``; MPT's ``Wqkv`` (query, key and value blocks) with ``out_proj``,
  ModernBERT's with ``Wo``;
- multi-head latent attention (DeepSeek-V2 and V3, and the families built on them): the
  query projection ``q_b_proj`` (or ``q_proj``) and the key/value up-projection
  ``kv_b_proj`` hold each head's rows, ``o_proj`` its columns; the compressed latents
  before them (``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms) serve all heads
  and stay whole, as does the rotary key all heads share;
- torch's ``nn.MultiheadAttention`` (torchvision's ViT). Its inner width is tied to the
  embedding width, so export replaces it with :class:`PrunedMultiheadAttention`, the same
  computation with fewer heads.

Some are found only to be refused by name when their heads are asked for: layers handed
a bias for all heads computed outside them (ALiBi), which would not lose the removed
heads. T5's layers, handed the relative position bias the first layer of their stack
computes, are one group with that layer, and MPNet's, handed the one their encoder
computes from its table, one group with that table (tied_heads.py).

The unit is a key/value head together with the query heads that share it (grouped-query
attention; one query head per unit without it); in multi-query attention, one key/value
head for all, the unit is a query head and the key and value stay whole. Removing a
unit removes its query, key and value rows and the output projection's input columns of
its query heads; the heads left attend exactly as before, so masking those output
columns per unit is exactly what removing the unit does. Every head group asked to be
pruned is proven so on its example input before any mask (:func:`prove_head_groups`,
proof.py), and refused by name when its layer's code treats the heads otherwise. A
layer whose code reshapes its output to its own ``embed_dim`` (XGLM's) is proven, where
the plain cut fails, with that attribute set to the kept width, which export then writes.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from .cost import run_hooked
from .cuts import cut_batch_norm, cut_depthwise, cut_linear
from .groups import is_norm
from .head_norms import (
    RescaledNorm,
    cut_norm,
    fed_norms,
    norms_after_output,
    norms_over_all_heads,
    norms_read_by,
    rescales_exactly,
)
from .proof import cuts_exactly, dropped, example_calls


@dataclass
class Projection:
    """A linear layer whose rows (or, for the output projection, columns) are `blocks`
    blocks of the units in order, `per_unit` rows each (timm's fused qkv: 3 blocks; the
    `nn.MultiheadAttention` itself for its packed input projection)."""

    layer: nn.Module
    blocks: int
    per_unit: int
    # rows per unit of each block when the blocks differ (Phi-3's qkv_proj: a unit's
    # query heads, then its key head, then its value head); else `per_unit` for each
    sizes: tuple[int, ...] = ()
    # rows after the blocks that all units share, always kept (the one key and value
    # head of multi-query attention in a fused projection)
    shared_rows: int = 0

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return self.sizes or (self.per_unit,) * self.blocks

    def kept(self, units: int, kept_units: torch.Tensor) -> torch.Tensor:
        """Indices of the rows (columns) that `kept_units` keep."""
        rows, start = [], 0
        for size in self.block_sizes:
            rows.append(start + (kept_units[:, None] * size + torch.arange(size)).flatten())
            start += units * size
        rows.append(torch.arange(start, start + self.shared_rows))
        return torch.cat(rows)


@dataclass
class HeadGroup:
    name: str  # the attention module's name
    module: nn.Module
    rows: list[Projection]  # query, key, value (fused or separate)
    out: Projection  # the output projection, by its input columns
    units: int  # key/value heads
    query_heads_per_unit: int
    head_dim: int
    # normalizations over all heads (the pruner refuses the group when asked to prune it)
    norms: tuple = ()
    # RMS normalizations over all the rows of a projection: the mask zeroes the removed
    # units' rows before them too, and export rescales them (head_norms.py)
    rescaled: list[RescaledNorm] = field(default_factory=list)
    # why removing heads would change what the others compute, or "" (the pruner refuses
    # the group when asked to prune it)
    refusal: str = ""
    # per-head parameters besides the projections (owner, name, dimension of the heads),
    # which export cuts to the kept heads
    tables: list = field(default_factory=list)
    # raw vectors of the attention layer with one entry per query row (timm EVA's and
    # BEiT's `q_bias` and `v_bias`): export cuts them to the kept rows
    row_vectors: list[tuple[nn.Module, str]] = field(default_factory=list)
    # the layer reads its head count from the model's config, which all layers share
    # (Phi-3): export needs every such layer to keep as many heads, written there
    heads_from_config: bool = False
    # multi-query attention: the units are query heads and the one key/value head they
    # all read is kept whole (not in `rows`)
    shared_kv: bool = False
    # latent attention: its norms act on the latents all heads share, not over heads, and
    # `head_dim` (the value head's) is not the config's head_dim
    latent: bool = False
    # the layer's attribute holding the width its code reshapes the attention output to
    # (XGLM's `embed_dim`, read where others write -1), set by the proof when the cut
    # computes what the mask does only with it rewritten; export writes the kept width
    output_width: str = ""
    # depthwise convolutions whose channels are the units' (a linear attention's conv1d
    # over its queries, keys and values), cut with them
    convs: list[Projection] = field(default_factory=list)
    # batch norms over a projection's rows (LeViT's LinearNorm: a linear layer, then a
    # BatchNorm1d of its outputs), cut with them
    row_norms: list[Projection] = field(default_factory=list)
    # linear layers over the heads themselves, one input and one output per head (CaiT's
    # talking heads: `proj_l` mixes the heads' attention logits, `proj_w` their attention
    # weights): the mask zeroes the removed heads' columns, so the mix reads nothing of
    # them, and export cuts their rows and columns
    head_mixers: list[nn.Linear] = field(default_factory=list)
    # the layer's attributes of its sizes, each set at export to the kept units times its
    # value here, in place of the attention forms' (a linear attention's head counts)
    attributes: dict[str, int] = field(default_factory=dict)
    kept_out: list[nn.Module] = field(init=False)
    kept_in: list[nn.Module] = field(init=False)
    # channels a module loses per unit removed: the cost model counts channels
    width: dict[nn.Module, int] = field(init=False)

    def __post_init__(self) -> None:
        self.kept_out = [p.layer for p in [*self.rows, *self.convs, *self.row_norms]]
        self.kept_out += self.head_mixers
        self.kept_in = [self.out.layer, *self.head_mixers]
        projections = [*self.rows, *self.convs, *self.row_norms, self.out]
        self.width = {p.layer: sum(p.block_sizes) for p in projections}
        self.width |= dict.fromkeys(self.head_mixers, self.query_heads_per_unit)

    @property
    def cut_norms(self) -> list[tuple[nn.Module, int]]:
        """The norms cut with the units: (norm, channels per unit)."""
        return [(r.norm, r.channels_per_unit) for r in self.rescaled]

    @property
    def rows_per_table_unit(self) -> int:
        """Entries each of `tables` loses per unit removed: one per query head."""
        return self.query_heads_per_unit

    @property
    def members(self) -> list[HeadGroup]:
        """The attention layers whose heads are these units: this one (a chain of layers
        sharing one bias per head: tied_heads.py)."""
        return [self]

    def cut_call(self, member: HeadGroup, call: tuple, keep: torch.Tensor) -> tuple:
        """The example call `member` runs on once cut to the units `keep`: as it was (a
        chain's later layers are handed a bias cut with the first's: tied_heads.py)."""
        return call

    def add_rows(self, projection: Projection) -> None:
        """One more projection whose rows are the units' (an output gate)."""
        self.rows.append(projection)
        self.__post_init__()

    @property
    def size(self) -> int:
        return self.units

    @property
    def layer(self) -> nn.Linear:
        return self.out.layer

    def unit_weights(self) -> torch.Tensor:
        """The output projection's columns, one row per unit (the unit's filter)."""
        weight = self.out.layer.weight.detach()
        columns = torch.stack(
            [self.out.kept(self.units, torch.tensor([u])) for u in range(self.units)]
        )
        return weight[:, columns.to(weight.device)].transpose(0, 1).reshape(self.units, -1)


def _linear(module: nn.Module, name: str) -> nn.Linear | None:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Linear) else None


def _fused_pair(
    module: nn.Module, forms: tuple[tuple[str, str], ...]
) -> tuple[str, str, nn.Linear, nn.Linear] | None:
    """The first (fused projection, output projection) names of `forms` that `module`
    holds as linear layers, with the layers."""
    for fused, output in forms:
        qkv, out = _linear(module, fused), _linear(module, output)
        if qkv is not None and out is not None:
            return fused, output, qkv, out
    return None


# separate query/key/value/output projections, by the names families give them, and the
# attribute holding the head size
SEPARATE_FORMS = (
    (("q_proj", "k_proj", "v_proj", "o_proj"), "head_dim"),  # Llama, Mistral, Qwen, Gemma
    (("q_proj", "k_proj", "v_proj", "out_proj"), "head_dim"),  # OPT, BART, CLIP, GPT-J
    (("q_proj", "k_proj", "v_proj", "dense"), "head_dim"),  # Phi
    (("q_proj", "k_proj", "v_proj", "Wo"), "head_dim"),  # ModernBERT's decoder
    (("q_proj", "k_proj", "v_proj", "projection_layer"), "head_dim"),  # InternVL's vision tower
    (("q_proj", "k_proj", "v_proj", "proj"), "head_dim"),  # timm's EVA, unfused
    (("q_lin", "k_lin", "v_lin", "out_lin"), "attention_head_size"),  # DistilBERT
    (("query", "key", "value", "dense"), "attention_head_size"),  # ALBERT
    (("query", "key", "value", "proj"), "attention_head_size"),  # PVT v2
    (("q", "k", "v", "o"), "key_value_proj_dim"),  # T5, UMT5
    (("q", "k", "v", "o"), "attention_head_size"),  # MPNet
    (("Wq", "Wk", "Wv", "dense"), "head_dim"),  # CTRL
    (("q_lin", "k_lin", "v_lin", "out_lin"), "head_dim"),  # XLM, FlauBERT
    # timm's NeXt-ViT, the attention pools of its CLIP ResNets (separate projections)
    (("q", "k", "v", "proj"), "head_dim"),
    # timm's class attention (CaiT, XCiT): num_heads, no head size
    (("q", "k", "v", "proj"), None),
)


def _separate(name: str, module: nn.Module) -> HeadGroup | None:
    """Separate query, key, value and output projections (Hugging Face's; timm's NeXt-ViT,
    attention pools and class attention) with an attribute holding the head size, or (a
    form's size None) a layer with no head_dim and a num_heads, the head size then the
    output projection's inputs over it."""
    for names, size in SEPARATE_FORMS:
        layers = [_linear(module, p) for p in names]
        head_dim = None if size is None else getattr(module, size, None)
        heads = getattr(module, "num_heads", None)
        alone = size is None and not hasattr(module, "head_dim")  # a head count alone
        if alone and layers[3] is not None and isinstance(heads, int) and heads > 0:
            if layers[3].in_features % heads:
                raise ValueError(
                    f"attention layer {name!r}: {names[3]} ({layers[3].in_features} inputs) "
                    f"does not split into its num_heads {heads}"
                )
            head_dim, size = layers[3].in_features // heads, "size"
        if all(layer is not None for layer in layers) and isinstance(head_dim, int):
            break
    else:
        return None
    q, k, v, o = layers
    # each query head's rows followed by as many of its output gate's (Qwen3-Next's and
    # Qwen3.5's gated attention: sigmoid(gate) scales the head's output channel by channel)
    gated = q.out_features == 2 * o.in_features
    if not (
        o.in_features % head_dim == 0
        and k.out_features % head_dim == 0
        and k.out_features == v.out_features
        and (o.in_features == q.out_features or gated)
    ):
        raise ValueError(
            f"attention layer {name!r}: {names[0]} ({q.out_features}), {names[1]} "
            f"({k.out_features}), {names[2]} ({v.out_features}) outputs and {names[3]} "
            f"({o.in_features}) inputs do not split into heads of {size} {head_dim}"
        )
    heads, units = o.in_features // head_dim, k.out_features // head_dim
    if heads % units:
        raise ValueError(
            f"attention layer {name!r}: {heads} query heads do not share {units} key/value "
            "heads evenly"
        )
    query_rows = 2 * head_dim if gated else head_dim  # per query head
    if units == 1 and heads > 1:  # multi-query: a unit is a query head; k and v stay whole
        rows, out = [Projection(q, 1, query_rows)], Projection(o, 1, head_dim)
        return HeadGroup(name, module, rows, out, heads, 1, head_dim, shared_kv=True)
    per_unit = heads // units
    rows = [
        Projection(q, 1, per_unit * query_rows),
        Projection(k, 1, head_dim),
        Projection(v, 1, head_dim),
    ]
    out = Projection(o, 1, per_unit * head_dim)
    return HeadGroup(name, module, rows, out, units, per_unit, head_dim)


# queries, keys and values split over two projections, by name and the blocks each holds
# (all heads' queries, keys or values in turn), before ``proj``: timm's PVT v2, Twins and
# VOLO's class attention (q, kv); ConViT's gated positional attention (qk, v)
SPLIT_FORMS = ((("q", 1), ("kv", 2)), (("qk", 2), ("v", 1)))


def _split(name: str, module: nn.Module) -> HeadGroup | None:
    """A SPLIT_FORMS pair of projections and ``proj``, with ``num_heads`` and ``head_dim``
    or the head count alone, the head size then ``proj``'s inputs over it."""
    out, heads = _linear(module, "proj"), getattr(module, "num_heads", None)
    if out is None or not isinstance(heads, int) or heads < 1:
        return None
    for form in SPLIT_FORMS:
        layers = [_linear(module, part) for part, _ in form]
        if all(layer is not None for layer in layers):
            break
    else:
        return None
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int):
        head_dim = out.in_features // heads
    width = heads * head_dim
    blocks = [count for _, count in form]
    if (
        head_dim < 1
        or out.in_features != width
        or any(
            layer.out_features != count * width for layer, count in zip(layers, blocks, strict=True)
        )
    ):
        sizes = ", ".join(
            f"{part} ({layer.out_features} outputs)"
            for (part, _), layer in zip(form, layers, strict=True)
        )
        raise ValueError(
            f"attention layer {name!r}: {sizes} and proj ({out.in_features} inputs) are not "
            f"{heads} heads of head size {head_dim} (each projection all heads' queries, keys "
            "or values in turn)"
        )
    rows = [Projection(layer, count, head_dim) for layer, count in zip(layers, blocks, strict=True)]
    return HeadGroup(name, module, rows, Projection(out, 1, head_dim), heads, 1, head_dim)


def _latent(name: str, module: nn.Module) -> HeadGroup | None:
    """Multi-head latent attention: q_b_proj (or q_proj) rows of qk_nope_head_dim +
    qk_rope_head_dim per head, kv_b_proj rows of qk_nope_head_dim + v_head_dim per head
    (its key part, then its value), o_proj columns of v_head_dim per head; beside the
    compressed key/value latent kv_a_proj_with_mqa (DeepSeek-V2, V3)."""
    query = _linear(module, "q_b_proj") or _linear(module, "q_proj")
    kv_up, out = _linear(module, "kv_b_proj"), _linear(module, "o_proj")
    sizes = [getattr(module, f"{part}_head_dim", None) for part in ("qk_nope", "qk_rope", "v")]
    if (
        query is None
        or kv_up is None
        or out is None
        or _linear(module, "kv_a_proj_with_mqa") is None
        or not all(isinstance(size, int) for size in sizes)
    ):
        return None
    nope, rope, value = sizes
    heads = out.in_features // value
    if (
        out.in_features % value
        or query.out_features != heads * (nope + rope)
        or kv_up.out_features != heads * (nope + value)
    ):
        raise ValueError(
            f"latent attention layer {name!r}: its query ({query.out_features} outputs), "
            f"kv_b_proj ({kv_up.out_features} outputs) and o_proj ({out.in_features} inputs) "
            f"are not {heads} heads of {nope} + {rope} query, {nope} + {value} key/value "
            "dimensions"
        )
    rows = [Projection(query, 1, nope + rope), Projection(kv_up, 1, nope + value)]
    return HeadGroup(name, module, rows, Projection(out, 1, value), heads, 1, value, latent=True)


# one fused projection of query, key and value blocks and the output projection
# timm, MPT, ModernBERT, torchvision's MaxViT
FUSED_FORMS = (("qkv", "proj"), ("Wqkv", "out_proj"), ("Wqkv", "Wo"), ("to_qkv", "merge"))
# where a fused form's layer keeps its head count (SAM's vision encoder: the third)
HEAD_COUNTS = ("num_heads", "n_heads", "num_attention_heads")


def _fused(name: str, module: nn.Module) -> HeadGroup | None:
    """A FUSED_FORMS projection with head_dim, and the head count in one of HEAD_COUNTS
    or else the output projection's inputs over head_dim (timm's ViT and DeiT, MPT,
    ModernBERT); or the head count alone (timm's Swin and MaxxViT, SAM's vision
    encoder). Its rows are the query, key and value blocks of all heads, or each head's
    query, key and value in turn where the layer is `head_first` (timm's MaxxViT)."""
    pair = _fused_pair(module, FUSED_FORMS)
    if pair is None:
        return None
    fused, output, qkv, proj = pair
    head_dim = getattr(module, "head_dim", None)
    heads = next(
        (getattr(module, a) for a in HEAD_COUNTS if isinstance(getattr(module, a, None), int)),
        None,
    )
    if not isinstance(head_dim, int) and isinstance(heads, int) and heads > 0:
        head_dim = proj.in_features // heads  # timm's Swin and SAM keep only the head count
    if not isinstance(head_dim, int) or head_dim < 1:
        return None
    if not isinstance(heads, int):
        heads = proj.in_features // head_dim
    if qkv.out_features != 3 * heads * head_dim or proj.in_features != heads * head_dim:
        raise ValueError(
            f"attention layer {name!r}: {fused} ({qkv.out_features} outputs) and {output} "
            f"({proj.in_features} inputs) are not {heads} heads of head_dim {head_dim}"
        )
    # timm MaxxViT's layers with `head_first` hold each head's query, key and value in turn
    if getattr(module, "head_first", False) is True:
        rows = [Projection(qkv, 1, 3 * head_dim)]
    else:
        rows = [Projection(qkv, 3, head_dim)]
    # a layer whose code merges its heads' outputs with the head innermost (channel c of
    # head h at c * heads + h: NesT's), as its pruned class says
    innermost = getattr(pruned_classes().get(type(module)), "heads_innermost", False)
    out = Projection(proj, head_dim, 1) if innermost else Projection(proj, 1, head_dim)
    return HeadGroup(name, module, rows, out, heads, 1, head_dim)


def _linear_and_norm(module: nn.Module | None) -> tuple[nn.Linear | None, nn.Module | None]:
    """A linear layer as it is; the linear layer and the batch norm of LeViT's LinearNorm
    (``linear``, then ``bn``, a BatchNorm1d over its outputs; Hugging Face's
    MLPLayerWithBN: ``batch_norm``); or either of those as the last module of a
    Sequential (timm LeViT's ``proj``: an activation, then a LinearNorm). (None, None)
    for anything else."""
    if isinstance(module, nn.Sequential) and len(module):
        module = module[-1]
    if isinstance(module, nn.Linear):
        return module, None
    linear = getattr(module, "linear", None)
    norm = getattr(module, "bn", None) or getattr(module, "batch_norm", None)
    if (
        isinstance(linear, nn.Linear)
        and isinstance(norm, nn.BatchNorm1d)
        and norm.num_features == linear.out_features
        and len(list(module.children())) == 2
    ):
        return linear, norm
    return None, None


# a fused projection of each head's query, key and value in turn: its name, the output
# projection's and the head count's (timm's; Hugging Face LeViT's)
PER_HEAD_FORMS = (
    ("qkv", "proj", "num_heads"),
    ("queries_keys_values", "projection", "num_attention_heads"),
)


def _per_head_qkv(name: str, module: nn.Module) -> HeadGroup | None:
    """A fused ``qkv`` whose rows hold each head's query, key and value in turn, the
    query and key of ``key_dim`` rows and the value of ``val_dim`` (or ``attention_ratio``
    times ``key_dim``): timm's TinyViT, EfficientFormer and LeViT, Hugging Face's LeViT
    (PER_HEAD_FORMS; LeViT's projections are a linear layer and a batch norm of its
    rows, timm's ``proj`` an activation, then such a pair). The heads' output is their
    value width, reshaped to ``out_dim`` (``val_attn_dim``, ``out_dim_projection``),
    which export writes with the head count."""
    for form in PER_HEAD_FORMS:
        qkv, qkv_norm = _linear_and_norm(getattr(module, form[0], None))
        proj, _ = _linear_and_norm(getattr(module, form[1], None))
        if qkv is not None and proj is not None:
            break
    else:
        return None
    count = form[2]
    key_dim, val_dim, heads = (getattr(module, a, None) for a in ("key_dim", "val_dim", count))
    ratio = getattr(module, "attention_ratio", None)
    if val_dim is None and isinstance(ratio, int) and isinstance(key_dim, int):
        val_dim = ratio * key_dim
    if not all(isinstance(v, int) and v > 0 for v in (key_dim, val_dim, heads)):
        return None
    per_unit = 2 * key_dim + val_dim
    if qkv.out_features != heads * per_unit or proj.in_features != heads * val_dim:
        return None
    sizes = {"out_dim": val_dim, "val_attn_dim": val_dim, "out_dim_projection": val_dim}
    sizes["out_dim_keys_values"] = per_unit
    widths = {a: size for a, size in sizes.items() if isinstance(getattr(module, a, None), int)}
    rows = [Projection(qkv, 1, per_unit)]
    norms = [] if qkv_norm is None else [Projection(qkv_norm, 1, per_unit)]
    out = Projection(proj, 1, val_dim)
    attributes = {count: 1, **widths}
    return HeadGroup(
        name, module, rows, out, heads, 1, val_dim, row_norms=norms, attributes=attributes
    )


def _phi3(name: str, module: nn.Module) -> HeadGroup | None:
    """qkv_proj (all query heads, then the key heads, then the value heads), o_proj,
    head_dim and num_key_value_heads; the query head count read from the config (Phi-3)."""
    qkv, o = _linear(module, "qkv_proj"), _linear(module, "o_proj")
    head_dim = getattr(module, "head_dim", None)
    units = getattr(module, "num_key_value_heads", None)
    if qkv is None or o is None or not isinstance(head_dim, int) or not isinstance(units, int):
        return None
    heads = o.in_features // head_dim
    if (
        o.in_features % head_dim
        or heads % units
        or qkv.out_features != (heads + 2 * units) * head_dim
    ):
        raise ValueError(
            f"attention layer {name!r}: qkv_proj ({qkv.out_features} outputs) and o_proj "
            f"({o.in_features} inputs) are not query heads and {units} key/value heads of "
            f"head_dim {head_dim}"
        )
    per_unit = heads // units
    sizes = (per_unit * head_dim, head_dim, head_dim)
    if units == 1:  # multi-query: a unit is a query head; the key and value stay whole
        return _query_head_units(name, module, qkv, o, heads, head_dim, heads_from_config=True)
    rows = [Projection(qkv, 3, head_dim, sizes)]
    out = Projection(o, 1, per_unit * head_dim)
    return HeadGroup(name, module, rows, out, units, per_unit, head_dim, heads_from_config=True)


def _query_head_units(
    name: str,
    module: nn.Module,
    fused: nn.Linear,
    out: nn.Linear,
    heads: int,
    head_dim: int,
    **kwargs,
) -> HeadGroup:
    """Multi-query attention in one fused projection (all query heads, then the key, then
    the value head): a unit is a query head; the key and value rows stay whole."""
    rows = [Projection(fused, 1, head_dim, shared_rows=2 * head_dim)]
    out_rows = Projection(out, 1, head_dim)
    return HeadGroup(name, module, rows, out_rows, heads, 1, head_dim, shared_kv=True, **kwargs)


def _per_head_fused(name: str, module: nn.Module) -> HeadGroup | None:
    """One fused projection whose rows hold each unit's query heads, key and value in
    turn: GPT-NeoX's, BLOOM's and Falcon's query_key_value with dense (Falcon's new
    decoder architecture: a unit is a key/value head and its query heads); GPT-BigCode's
    c_attn with c_proj. In multi-query attention (all query heads, then one key and one
    value head) a unit is a query head (Falcon-7B); GPT-BigCode's is refused, as its code
    splits c_attn at the model width."""
    pair = _fused_pair(module, (("query_key_value", "dense"), ("c_attn", "c_proj")))
    if pair is None:
        return None
    fused, output, qkv, out = pair
    multi_query = getattr(module, "multi_query", None)
    if fused == "c_attn" and (multi_query is None or hasattr(module, "q_attn")):
        return None  # GPT-2's layout (_gpt2); GPT-BigCode's cross-attention
    head_dim = getattr(module, "head_dim", getattr(module, "head_size", None))
    if not isinstance(head_dim, int) or out.in_features % head_dim:
        return None
    heads = out.in_features // head_dim
    grouped = bool(getattr(module, "new_decoder_architecture", False))
    units = getattr(module, "num_kv_heads", None) if grouped else heads
    if multi_query and not grouped:
        units = 1
    if not isinstance(units, int) or units < 1 or heads % units:
        return None
    per_unit = heads // units
    if qkv.out_features != (heads + 2 * units) * head_dim:
        raise ValueError(
            f"attention layer {name!r}: {fused} ({qkv.out_features} outputs) and {output} "
            f"({out.in_features} inputs) are not {heads} query and {units} key/value heads "
            f"of head_dim {head_dim}"
        )
    if units == 1 and heads > 1:  # rows: all query heads, then the key, then the value
        return _query_head_units(name, module, qkv, out, heads, head_dim)
    rows = [Projection(qkv, 1, (per_unit + 2) * head_dim)]
    out_rows = Projection(out, 1, per_unit * head_dim)
    return HeadGroup(name, module, rows, out_rows, units, per_unit, head_dim)


def _gpt2(name: str, module: nn.Module) -> HeadGroup | None:
    """c_attn (query, key and value; in cross-attention key and value, the queries from
    q_attn), c_proj, num_heads, head_dim and split_size (GPT-2, its Conv1D layers made
    nn.Linear by conv1d_to_linear; OpenAI GPT's keeps its head count as n_head and no
    head_dim, its head size being split_size over it)."""
    qkv, proj, query = (_linear(module, p) for p in ("c_attn", "c_proj", "q_attn"))
    heads = getattr(module, "num_heads", getattr(module, "n_head", None))
    split = getattr(module, "split_size", None)
    if not isinstance(heads, int) or not isinstance(split, int) or heads < 1:
        return None
    head_dim = getattr(module, "head_dim", split // heads)
    if qkv is None or proj is None or not isinstance(head_dim, int):
        return None
    if hasattr(module, "multi_query"):  # GPT-BigCode: its c_attn has other layouts
        return None
    width, blocks = heads * head_dim, 3 if query is None else 2
    if (
        split != width
        or qkv.out_features != blocks * width
        or proj.in_features != width
        or (query is not None and query.out_features != width)
    ):
        raise ValueError(
            f"attention layer {name!r}: c_attn ({qkv.out_features} outputs), c_proj "
            f"({proj.in_features} inputs) and split_size {split} are not {heads} heads of "
            f"head_dim {head_dim}"
        )
    rows = [Projection(qkv, blocks, head_dim)]
    if query is not None:
        rows.insert(0, Projection(query, 1, head_dim))
    return HeadGroup(name, module, rows, Projection(proj, 1, head_dim), heads, 1, head_dim)


# the inner layer's projections in BERT's layout: separate (BERT; DeBERTa-v2), or one
# holding each head's query, key and value in turn (DeBERTa's `in_proj`)
BERT_FORMS = (("query", "key", "value"), ("query_proj", "key_proj", "value_proj"), ("in_proj",))


def _bert(name: str, module: nn.Module) -> HeadGroup | None:
    """A parent holding ``self`` (query, key, value) and ``output.dense`` (BERT; the inner
    layer named ``attention`` in the ViT layout of Data2Vec's vision model and YOLOS);
    DeBERTa-v2's ``query_proj``, ``key_proj``, ``value_proj``, with the projections of its
    relative position embeddings, ``pos_key_proj`` and ``pos_query_proj``, per head too;
    DeBERTa's ``in_proj`` (each head's query, key and value in turn; its query and value
    biases are vectors of the query width) with ``pos_proj`` and ``pos_q_proj``."""
    output = getattr(module, "output", None)
    # the inner layer is `self` (BERT), or `attention` (the ViT layout of Data2Vec's
    # vision model and YOLOS)
    for inner_name in ("self", "attention"):
        inner = getattr(module, inner_name, None)
        for names in BERT_FORMS:
            layers = [_linear(inner, p) for p in names] if inner is not None else [None]
            if all(x is not None for x in layers):
                break
        if all(x is not None for x in layers):
            break
    out = _linear(output, "dense") if output is not None else None
    heads = getattr(inner, "num_attention_heads", None)
    head_dim = getattr(inner, "attention_head_size", None)
    if any(x is None for x in layers) or out is None or not isinstance(heads, int):
        return None
    blocks = 3 if len(layers) == 1 else 1  # per head: rows of each of `layers`
    positions = ("pos_key_proj", "pos_query_proj", "pos_proj", "pos_q_proj")
    extra = [x for p in positions if (x := _linear(inner, p))]
    if (
        not isinstance(head_dim, int)
        or any(x.out_features != blocks * heads * head_dim for x in layers)
        or any(x.out_features != heads * head_dim for x in extra)
        or out.in_features != heads * head_dim
    ):
        raise ValueError(
            f"attention layer {name!r}: {'/'.join(names)} and output.dense are not "
            f"{heads} heads of attention_head_size {head_dim}"
        )
    rows = [Projection(x, 1, blocks * head_dim) for x in layers]
    rows += [Projection(x, 1, head_dim) for x in extra]
    out_rows = Projection(out, 1, head_dim)
    return HeadGroup(f"{name}.{inner_name}", inner, rows, out_rows, heads, 1, head_dim)


def _torch_mha(name: str, module: nn.Module) -> HeadGroup | None:
    """torch's nn.MultiheadAttention with one packed input projection."""
    if not isinstance(module, nn.MultiheadAttention):
        return None
    if not module._qkv_same_embed_dim or module.bias_k is not None or module.add_zero_attn:
        raise ValueError(
            f"attention layer {name!r}: nn.MultiheadAttention with separate kdim/vdim, "
            "add_bias_kv or add_zero_attn is not pruned by heads; leave it whole with "
            "ignored_layers=[...]"
        )
    heads, head_dim = module.num_heads, module.head_dim
    rows = [Projection(module, 3, head_dim)]
    return HeadGroup(
        name, module, rows, Projection(module.out_proj, 1, head_dim), heads, 1, head_dim
    )


class PrunedMultiheadAttention(nn.Module):
    """nn.MultiheadAttention's computation with `num_heads` heads of `head_dim` whose
    inner width (num_heads * head_dim) need not equal `embed_dim`: what a pruned
    nn.MultiheadAttention exports to. Same forward signature and outputs."""

    replaces = nn.MultiheadAttention

    def __init__(self, source: nn.MultiheadAttention, kept_rows: torch.Tensor) -> None:
        super().__init__()
        self.embed_dim, self.head_dim = source.embed_dim, source.head_dim
        self.num_heads = len(kept_rows) // (3 * source.head_dim)
        self.batch_first, self.dropout = source.batch_first, source.dropout
        rows = kept_rows.to(source.in_proj_weight.device)
        self.in_proj_weight = nn.Parameter(source.in_proj_weight.detach()[rows].clone())
        bias = source.in_proj_bias
        self.in_proj_bias = None if bias is None else nn.Parameter(bias.detach()[rows].clone())
        self.out_proj = source.out_proj  # its columns are cut by the caller

    @classmethod
    def from_dense(cls, source: nn.MultiheadAttention) -> PrunedMultiheadAttention:
        """One with every head of `source` (a loader then gives it the saved shapes)."""
        return cls(source, torch.arange(source.in_proj_weight.shape[0]))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batched = query.dim() == 3
        if not batched:
            query, key, value = (
                t.unsqueeze(0 if self.batch_first else 1) for t in (query, key, value)
            )
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        batch, length, source = query.shape[0], query.shape[1], key.shape[1]
        inner = self.num_heads * self.head_dim
        w, b = self.in_proj_weight, self.in_proj_bias
        parts = [
            nn.functional.linear(
                x,
                w[i * inner : (i + 1) * inner],
                None if b is None else b[i * inner : (i + 1) * inner],
            )
            for i, x in enumerate((query, key, value))
        ]
        q, k, v = (p.view(batch, -1, self.num_heads, self.head_dim).transpose(1, 2) for p in parts)
        mask = _additive_mask(
            attn_mask, key_padding_mask, batch, self.num_heads, length, source, q.dtype
        )
        if is_causal and mask is None:  # a key after the query is never attended to
            causal = torch.ones(length, source, dtype=torch.bool, device=q.device).triu(1)
            mask = _additive_mask(causal, None, batch, self.num_heads, length, source, q.dtype)
        scores = (q * self.head_dim**-0.5) @ k.transpose(-2, -1)
        if mask is not None:
            scores = scores + mask
        attention = scores.softmax(dim=-1)
        weights = attention
        if self.training and self.dropout > 0:
            attention = nn.functional.dropout(attention, self.dropout)
        out = (attention @ v).transpose(1, 2).reshape(batch, length, inner)
        out = self.out_proj(out)
        if not self.batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(0 if self.batch_first else 1)
        if not need_weights:
            return out, None
        weights = weights.mean(dim=1) if average_attn_weights else weights
        return out, (weights if batched else weights.squeeze(0))


def _additive_mask(attn_mask, key_padding_mask, batch, heads, length, source, dtype):
    """nn.MultiheadAttention's attn_mask ((L, S) or (B * heads, L, S), bool or float) and
    key_padding_mask ((B, S), bool or float) as one additive (B, heads, L, S) mask."""
    total = None
    for mask, shape in ((attn_mask, None), (key_padding_mask, (batch, 1, 1, source))):
        if mask is None:
            continue
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                mask, float("-inf")
            )
        mask = mask.to(dtype)
        if shape is not None:
            mask = mask.view(shape)
        elif mask.dim() == 3:
            mask = mask.view(batch, heads, length, source)
        total = mask if total is None else total + mask
    return total


def find_head_groups(
    model: nn.Module, ignored: list[nn.Module], inputs: tuple = ()
) -> list[HeadGroup]:
    """Every attention layer of these forms, in model order; an error names one whose
    projections do not split into whole heads. `inputs` (the example inputs) show which
    layers are handed a bias for their heads from outside (see `_biases_from_outside`)."""
    modules = dict(model.named_modules())
    groups = []
    for name, module in model.named_modules():
        if module in ignored:
            continue
        try:
            group = (
                _separate(name, module)
                or _split(name, module)
                or _per_head_qkv(name, module)
                or _fused(name, module)
                or _per_head_fused(name, module)
                or _phi3(name, module)
                or _gpt2(name, module)
                or _bert(name, module)
                or _latent(name, module)
                or _torch_mha(name, module)
            )
        except ValueError as error:  # the form's names, but not its shapes
            group = _unsplit(name, module, str(error))
        if group is None or any(layer in ignored for layer in [*group.kept_out, group.layer]):
            continue
        if group.refusal:  # not split into heads: refused when asked for, nothing to find
            groups.append(group)
            continue
        if not group.latent:  # a latent's norms act before the heads' own projections
            group.norms = norms_over_all_heads(group.module, group.head_dim)
            group.refusal = group.refusal or _other_linears(group)
            group.head_mixers = _head_mixers(group)
            group.__post_init__()
        parent = group.name.rpartition(".")[0]  # the block holding the attention layer
        group.tables, mixed = _per_head_tables(group, modules[parent] if parent else None)
        group.row_vectors = _row_vectors(group)
        group.refusal = group.refusal or mixed
        groups.append(group)
    outside = _biases_from_outside(model, inputs, [g for g in groups if not g.refusal])
    for group in groups:
        group.refusal = group.refusal or outside.get(group.module, "")
    normed = [g for g in groups if g.norms and not g.refusal]
    if normed and inputs:  # a norm of the layer's input or output is no norm over its heads
        before = norms_read_by(model, inputs, {n: g.kept_out for g in normed for n in g.norms})
        after = norms_after_output(model, inputs, {n: g.out.layer for g in normed for n in g.norms})
        for group in normed:
            group.norms = tuple(n for n in group.norms if n not in before | after)
    _rescale_norms(model, inputs, [g for g in groups if g.norms and not g.refusal])
    return groups


def _rescale_norms(model: nn.Module, inputs: tuple, groups: list[HeadGroup]) -> None:
    """Move each norm of `groups` that normalizes one projection's output as it is (seen
    in one forward on `inputs`) and stays exact cut and rescaled (an RMS norm) from the
    group's refused `norms` to its `rescaled`."""
    candidates = {
        norm: [(p.layer, p.per_unit) for p in g.rows if p.blocks == 1 and not p.shared_rows]
        for g in groups
        for norm in g.norms
    }
    if not candidates or not inputs:
        return
    fed = fed_norms(model, inputs, candidates)
    # a norm of the attention output, where a value projection of its own holds the
    # units' rows: masked and rescaled there (head_norms.py)
    valued = {n: g.out.layer for g in groups if _value(g) is not None for n in g.norms}
    after = norms_read_by(model, inputs, {n: [o] for n, o in valued.items() if n not in fed})
    for group in groups:
        exact = [n for n in group.norms if n in fed and rescales_exactly(n)]
        group.rescaled = [RescaledNorm(n, *fed[n]) for n in exact]
        for norm in group.norms:
            if norm in after and rescales_exactly(norm):
                value = _value(group)
                group.rescaled.append(
                    RescaledNorm(norm, value.layer, value.per_unit, group.out.per_unit)
                )
                exact.append(norm)
        group.norms = tuple(n for n in group.norms if n not in exact)


def _value(group: HeadGroup) -> Projection | None:
    """`group`'s value projection when it is a layer of its own, one row block per unit
    (separate query, key and value projections, in that order), else None."""
    if len(group.rows) != 3:  # multi-query attention shares its value head: only the query
        return None
    value = group.rows[2]
    if (
        value.blocks != 1
        or value.shared_rows
        or any(p.layer is value.layer for p in group.rows[:2])
    ):
        return None
    return value


def _unsplit(name: str, module: nn.Module, why: str) -> HeadGroup | None:
    """A refused group for an attention layer with a form's names whose shapes do not
    split into its heads (a value head size other than the query's: MiMo-V2-Flash's):
    refused by name when its heads are asked for, so a ratio for the MLPs alone still
    prunes the model (ConvBERT's, whose output projection also reads its convolutions).
    None (the error raised) when the layer holds no linear layer."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(why)
    out = Projection(linears[-1], 1, 1)  # its output projection: never cut
    reason = why.split(": ", 1)[-1].split("; leave ", 1)[0]  # the refusal gives the advice
    return HeadGroup(name, module, [], out, 1, 1, 1, refusal=reason)


def _proof_scope(group: HeadGroup, model: nn.Module) -> nn.Module | None:
    """The module a proof of `group` runs: its attention layer, or the block holding it
    when a table or the output projection lies beside it (BERT's output.dense, BEiT's
    bias table); None where no proof is made: torch's MultiheadAttention (replaced at
    export), a head count read from the shared config (Phi-3), a table further out, or a
    single unit."""
    if isinstance(group.module, nn.MultiheadAttention) or group.heads_from_config:
        return None
    if group.units < 2:
        return None
    needed = {group.out.layer, *(p.layer for p in group.rows), *(o for o, _, _ in group.tables)}
    names = {m: n for n, m in model.named_modules()}
    name = names[group.module]
    for scope_name in (name, name.rpartition(".")[0]):
        scope = model.get_submodule(scope_name)
        if needed <= set(scope.modules()):
            return scope if scope is not model else None
    return None


def prove_head_groups(model: nn.Module, groups: list[HeadGroup], inputs: tuple) -> None:
    """Refuse each of `groups` (the heads to prune) whose attention layer, with half its
    units removed as export removes them, does not compute on its example input what it
    computes with their output columns zeroed as the hard mask zeroes them (proof.py):
    a head form the layer's code does not follow (a differential attention pairing its
    heads, a projection of the heads' width the forms do not know). Every layer of a
    chain tied by its bias (tied_heads.py) is proven so, the chain refused naming the
    layer that fails."""
    scopes = [
        (g, m, s) for g in groups for m in g.members if (s := _proof_scope(m, model)) is not None
    ]
    calls = example_calls(model, list({id(s): s for _, _, s in scopes}.values()), inputs)
    for tied, group, scope in scopes:
        if scope not in calls or tied.refusal:
            continue  # never ran on the example (export's check still runs), or refused
        names = {m: n for n, m in scope.named_modules()}

        def zero(copy: nn.Module, keep: torch.Tensor, group=group, names=names) -> None:
            out = copy.get_submodule(names[group.out.layer])
            units = dropped(group.units, keep, torch.device("cpu"))
            columns = group.out.kept(group.units, units).to(out.weight.device)
            out.weight[:, columns] = 0
            for mixer in group.head_mixers:  # the columns of the heads' mixes too
                weight = copy.get_submodule(names[mixer]).weight
                weight[:, units.to(weight.device)] = 0
            for rescaled in group.rescaled:  # the hard mask zeroes their rows too
                rows = copy.get_submodule(names[rescaled.rows])
                removed = Projection(rows, 1, rescaled.per_unit).kept(group.units, units)
                for tensor in (rows.weight, rows.bias):
                    if tensor is not None:
                        tensor[removed.to(tensor.device)] = 0

        def cut(copy: nn.Module, keep: torch.Tensor, group=group, names=names) -> None:
            mask = torch.zeros(group.units)
            mask[keep] = 1
            prune_heads(group, dict(copy.named_modules()), names, mask)

        # a layer of a chain is handed the bias cut as the exported first layer hands it
        if not _proven(group, scope, calls[scope], zero, cut, partial(tied.cut_call, group)):
            where = "" if group.module is tied.module else f"its tied layer {group.name!r}: "
            tied.refusal = where + (
                "with some of its heads removed it does not compute what it computes with "
                "them masked, on the example inputs: its code treats its heads in a way "
                "the head forms do not know (a differential attention pairing them, a "
                "projection of their width, a reshape to the model width, a table of "
                "them shared by all layers)"
            )


# the libraries' modules holding attention layers whose code ties the head size or the
# output width to the model width, and this package's modules of the classes export
# gives them
PRUNED_CLASS_MODULES = {
    "torchvision.models.swin_transformer": "torchvision_attention",
    "torchvision.models.maxvit": "torchvision_attention",
    "timm": "timm_attention",  # EVA's, BEiT's, Swin V2's, DaViT's, XCiT's, EdgeNeXt's, ...
    "transformers.models.trocr.modeling_trocr": "transformers_attention",
    "transformers.models.pvt_v2.modeling_pvt_v2": "transformers_attention",
}


def pruned_classes() -> dict[type[nn.Module], type[nn.Module]]:
    """The class export gives an attention layer of each class above that loses heads
    (`from_dense(layer)` gives it). Only the libraries' modules already imported are
    looked at: a model holding such a layer has imported its module. A library version
    without the classes these subclass gives none: its layers fail their heads' proof and
    are refused by name, as without this package's classes."""
    classes = {}
    for library, own in PRUNED_CLASS_MODULES.items():
        if library in sys.modules:
            try:
                classes |= importlib.import_module(f"{__package__}.{own}").PRUNED_CLASSES
            except (ImportError, AttributeError):
                continue
    return classes


# attributes an attention layer's code may reshape its output to, holding the query width
# (the model width as it is built): XGLM's, MVP's, InternVL's vision tower's; timm's
# Hiera's `dim_out`, Hugging Face Hiera's `hidden_size_output`
OUTPUT_WIDTH_ATTRIBUTES = ("embed_dim", "dim_out", "hidden_size_output")


def _proven(group: HeadGroup, scope: nn.Module, call: tuple, zero, cut, cut_call) -> bool:
    """Whether cutting `group`'s units computes what zeroing them does on `call`: as
    export cuts them, or else with the layer's attribute of the output width rewritten
    (which `group.output_width` then names for export), or else with its vectors of the
    query width left whole (one of the model width, as wide where the two widths are
    equal: GPT-NeoX Japanese's `dense_bias`, added after the output projection). Each
    is tried only where the ones before fail, so a layer whose code reads the attribute
    as the model width is left as it is."""
    per_unit = (1, group.query_heads_per_unit)  # key/value heads, query heads
    exact = partial(cuts_exactly, first_output=True, cut_call=cut_call, per_unit=per_unit)
    if exact(scope, call, group.units, zero, cut):
        return True
    width = group.units * group.query_heads_per_unit * group.head_dim
    for attribute in OUTPUT_WIDTH_ATTRIBUTES:
        if getattr(group.module, attribute, None) != width:
            continue
        group.output_width = attribute
        if exact(scope, call, group.units, zero, cut):
            return True
        group.output_width = ""
    if group.row_vectors:
        vectors, group.row_vectors = group.row_vectors, []
        if exact(scope, call, group.units, zero, cut):
            return True
        group.row_vectors = vectors
    return False


# an attention layer's linear layer of the query width that gates the attention output
# channel by channel before the output projection (AFMoE's, Beam's; timm EVA's `gate`)
OUTPUT_GATES = ("gate_proj", "gate")


def _head_mixers(group: HeadGroup) -> list[nn.Linear]:
    """The attention layer's linear layers with one input and one output per head (CaiT's
    talking heads), where every unit is one head."""
    heads = group.units * group.query_heads_per_unit
    if group.query_heads_per_unit != 1 or heads < 2:
        return []
    known = {group.out.layer, *(p.layer for p in group.rows)}
    return [
        child
        for child in group.module.children()
        if isinstance(child, nn.Linear)
        and child not in known
        and child.in_features == child.out_features == heads
    ]


def _other_linears(group: HeadGroup) -> str:
    """Add the attention layer's output gate to `group`'s rows; why another linear layer
    of the layer's that computes the query width from the layer's input refuses it, or
    ""."""
    width = group.units * group.query_heads_per_unit * group.head_dim  # the query width
    known = {group.out.layer, *(p.layer for p in group.rows)}
    for name, child in group.module.named_children():
        if (
            not isinstance(child, nn.Linear)
            or child in known
            or child.out_features != width
            or child.in_features != group.rows[0].layer.in_features
        ):
            continue
        if name not in OUTPUT_GATES:
            return (
                f"its linear layer {name!r} computes the query width ({width}) from the "
                "layer's input for a use the head forms do not know, so removing heads "
                "would leave it the wrong size"
            )
        group.add_rows(Projection(child, 1, group.query_heads_per_unit * group.head_dim))
    return ""


# the arguments by which attention layers receive a bias per head computed outside them
# (ALiBi: BLOOM's; Falcon's when config.alibi) when the example inputs hand them a tensor
# (T5's `position_bias`, and MPT's: tied_heads.py)
WHEN_GIVEN = ("alibi",)


def _biases_from_outside(
    model: nn.Module, inputs: tuple, groups: list[HeadGroup]
) -> dict[nn.Module, str]:
    """The attention layers (of `groups`) handed a bias per head from outside, with why
    that refuses them. The model runs once on `inputs`, only when a layer may receive
    one."""
    found, watched = {}, {}
    for group in groups:
        forward = inspect.signature(group.module.forward).parameters
        if any(a in forward for a in WHEN_GIVEN):
            watched[group.module] = [a for a in WHEN_GIVEN if a in forward]
    if not watched or not inputs:
        return found

    def record(module, args, kwargs):
        # the arguments by name: positional ones in the order forward declares them
        names = inspect.signature(module.forward).parameters
        given = dict(zip(names, args, strict=False)) | kwargs
        for argument in watched[module]:
            if isinstance(given.get(argument), torch.Tensor):
                found[module] = (
                    f"its forward is handed `{argument}`, a bias per head computed outside "
                    "the layer for all the model's heads: it would not lose the heads "
                    "removed from one layer"
                )

    run_hooked(
        model, inputs, [m.register_forward_pre_hook(record, with_kwargs=True) for m in watched]
    )
    return found


# modules whose parameters are never per-head tables of an attention layer they are beside
NOT_TABLES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.MultiheadAttention)
# layers inside an attention layer whose parameters are never its per-head tables (an
# embedding of one column per head is found apart)
CONVS_AND_EMBEDDINGS = (nn.Conv1d, nn.Conv2d, nn.Embedding)


def _per_head_tables(
    group: HeadGroup, block: nn.Module | None
) -> tuple[list[tuple[nn.Module, str, int]], str]:
    """Parameters with one entry per query head along one dimension, besides the
    projections, as (owner module, name, dimension): export cuts them to the kept heads.
    They are looked for in the attention layer (Swin's relative position bias table, the
    rows of Swin V2's per-head bias MLP output) and, as raw parameters, in the block
    holding it and its direct children that hold no linear layer (BEiT's bias table; not
    an MLP or a mixture of experts, whose per-expert biases may have as many entries as
    there are heads: AFMoE's; not deeper, where experts keep their raw weights). A
    parameter with several such dimensions (heads mixed with heads) makes the second
    item say why the heads cannot be pruned ("" when they can)."""
    heads = group.units * group.query_heads_per_unit
    projections = {*group.kept_out, group.layer}
    candidates = []  # (owner, owner's name, parameter name, tensor)
    # an embedding of one column per head (T5's relative position bias of a few dozen
    # buckets: their number may equal the heads')
    tables = [
        (owner, "weight", 1)
        for owner in group.module.modules()
        if isinstance(owner, nn.Embedding) and owner.embedding_dim == heads
    ]
    for owner_name, owner in group.module.named_modules():
        if owner in projections or is_norm(owner) or isinstance(owner, CONVS_AND_EMBEDDINGS):
            continue  # a conv's kernel may be as wide as there are heads (SegFormer's)
        if isinstance(owner, nn.Linear):  # a layer computing one output per head
            if owner.out_features == heads:
                candidates += [(owner, owner_name, n, p) for n, p in owner.named_parameters()]
            continue
        candidates += [(owner, owner_name, n, p) for n, p in owner.named_parameters(recurse=False)]
    inside = set(group.module.modules())
    beside = [("", block), *block.named_children()] if block is not None else []
    for owner_name, owner in beside:
        if owner in inside or isinstance(owner, NOT_TABLES) or is_norm(owner):
            continue
        if owner_name and any(isinstance(m, nn.Linear) for m in owner.modules()):
            continue  # an MLP or a mixture of experts beside the attention layer
        candidates += [(owner, owner_name, n, p) for n, p in owner.named_parameters(recurse=False)]
    mixed = []
    for owner, owner_name, name, p in candidates:
        if p.shape.count(heads) == 1:
            tables.append((owner, name, p.shape.index(heads)))
        elif p.shape.count(heads) > 1:
            mixed.append(f"{owner_name}.{name} {tuple(p.shape)}".lstrip("."))
    if mixed:
        return tables, (
            f"its {', '.join(mixed)} has a dimension of heads more than once (heads mixed "
            "with heads), so removing a head would change the others"
        )
    return tables, ""


def _row_vectors(group: HeadGroup) -> list[tuple[nn.Module, str]]:
    """The attention layer's own 1-D parameters of the query width (a bias per query row
    kept outside the projection: timm EVA's and BEiT's `q_bias`, `v_bias`)."""
    width = group.units * group.query_heads_per_unit * group.head_dim
    return [
        (group.module, name)
        for name, p in group.module.named_parameters(recurse=False)
        if p.dim() == 1 and len(p) == width
    ]


def prune_heads(
    group: HeadGroup, copy: dict[str, nn.Module], names: dict[nn.Module, str], mask: torch.Tensor
) -> None:
    """Remove the units whose mask is 0 from a copy of the model, in place, in every layer
    of the group. `copy` maps the copy's module names to its modules; `names` the
    original modules to their names."""
    for member in group.members:
        _prune_layer_heads(member, copy, names, mask)
    own = [t for t in group.tables if not any(t in m.tables for m in group.members)]
    if own:  # a table outside every layer (MPNet's encoder's bias table: tied_heads.py)
        query_heads = _query_heads(mask, group.query_heads_per_unit)
        _cut_tables(own, copy, names, query_heads)
        for owner, _, _ in own:  # the head count the table's holder keeps (MPNet's n_heads)
            holder = copy[names[owner].rpartition(".")[0]]
            _set_head_count(holder, group.units * group.query_heads_per_unit, len(query_heads))


def _set_head_count(owner: nn.Module, heads: int, kept: int) -> None:
    """The head count a module of an attention layer keeps of its own, `num_heads` (or
    `n_heads`) and the head entry (last, or else first) of `bias_shape` (timm's relative-position
    modules, which shape their bias by it), set from `heads` to `kept`."""
    for count in ("num_heads", "n_heads"):
        if getattr(owner, count, None) == heads:
            setattr(owner, count, kept)
    shape = getattr(owner, "bias_shape", None)
    if isinstance(shape, tuple) and shape and shape[-1] == heads:
        owner.bias_shape = (*shape[:-1], kept)
    elif isinstance(shape, tuple) and shape and shape[0] == heads:
        owner.bias_shape = (kept, *shape[1:])


def _query_heads(mask: torch.Tensor, per_unit: int) -> torch.Tensor:
    """The query heads of the units `mask` keeps, in order (on the CPU)."""
    kept = mask.nonzero().flatten().cpu()
    return (kept[:, None] * per_unit + torch.arange(per_unit)).flatten()


def _cut_tables(
    tables: list[tuple[nn.Module, str, int]],
    copy: dict[str, nn.Module],
    names: dict[nn.Module, str],
    query_heads: torch.Tensor,
) -> None:
    """Cut each (owner, name, dim) table of the copy to the entries of `query_heads`."""
    for owner, name, dim in tables:
        target = copy[names[owner]]
        table = getattr(target, name).detach()
        kept_entries = table.index_select(dim, query_heads.to(table.device)).clone()
        setattr(target, name, nn.Parameter(kept_entries))
        if isinstance(target, nn.Linear) and name == "weight":  # one output per head
            target.out_features = len(query_heads)
        if isinstance(target, nn.Embedding):  # one column per head
            target.embedding_dim = len(query_heads)


def _prune_layer_heads(
    group: HeadGroup, copy: dict[str, nn.Module], names: dict[nn.Module, str], mask: torch.Tensor
) -> None:
    """prune_heads for one attention layer."""
    kept = mask.nonzero().flatten().cpu()
    per_unit = group.query_heads_per_unit
    query_heads = _query_heads(mask, per_unit)
    _cut_tables(group.tables, copy, names, query_heads)
    for inner in copy[names[group.module]].modules():  # its position-bias modules' counts
        _set_head_count(inner, group.units * per_unit, len(query_heads))
    query_rows = Projection(group.module, 1, per_unit * group.head_dim).kept(group.units, kept)
    for owner, name in group.row_vectors:
        vector = getattr(copy[names[owner]], name).detach()
        setattr(copy[names[owner]], name, nn.Parameter(vector[query_rows.to(vector.device)]))
    if isinstance(group.module, nn.MultiheadAttention):  # replaced: its width is fixed
        parent, _, attr = names[group.module].rpartition(".")
        source = copy[names[group.module]]
        rows = group.rows[0].kept(group.units, kept)
        cut_linear(source.out_proj, group.out.kept(group.units, kept), dim=1)
        setattr(copy[parent], attr, PrunedMultiheadAttention(source, rows))
        return
    for projection in group.rows:
        cut_linear(copy[names[projection.layer]], projection.kept(group.units, kept))
    cut_linear(copy[names[group.out.layer]], group.out.kept(group.units, kept), dim=1)
    for rescaled in group.rescaled:  # their rows are cut: the norms follow, rescaled
        channels = Projection(rescaled.norm, 1, rescaled.channels_per_unit).kept(group.units, kept)
        cut_norm(copy[names[rescaled.norm]], copy[names[rescaled.rows]], channels)
    for conv in group.convs:
        cut_depthwise(copy[names[conv.layer]], conv.kept(group.units, kept))
    for norm in group.row_norms:
        cut_batch_norm(copy[names[norm.layer]], norm.kept(group.units, kept))
    for mixer in group.head_mixers:  # one head per unit (_head_mixers)
        cut_linear(copy[names[mixer]], kept)
        cut_linear(copy[names[mixer]], kept, dim=1)
    cache = getattr(copy[names[group.module]], "attention_bias_cache", None)
    if isinstance(cache, dict):  # timm's cache of its per-head bias table, of the old heads
        cache.clear()
    if group.attributes:  # the layer's own sizes
        for attr, per_unit in group.attributes.items():
            setattr(copy[names[group.module]], attr, len(kept) * per_unit)
        return
    # the attributes implementations read (the others reshape with -1)
    heads = len(kept) * group.query_heads_per_unit
    module = copy[names[group.module]]
    sizes = {
        "num_heads": heads,
        "n_heads": heads,
        "n_head": heads,  # OpenAI GPT's
        "heads": heads,  # timm's Hiera
        "num_attention_heads": heads,
        "attn_dim": heads * group.head_dim,
        "all_head_size": heads * group.head_dim,
        "split_size": heads * group.head_dim,
        "inner_dim": heads * group.head_dim,
    }
    if group.output_width:
        sizes[group.output_width] = heads * group.head_dim
    if group.shared_kv:  # the one key/value head stays; it serves fewer query heads
        sizes["num_key_value_groups"] = heads
    else:
        kv_heads = len(kept)
        sizes |= {
            "num_key_value_heads": kv_heads,
            "num_kv_heads": kv_heads,
            "kv_heads": kv_heads,
            "kv_dim": kv_heads * group.head_dim,
        }
    for attr, value in sizes.items():
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, value)
    pruned_class = pruned_classes().get(type(module))
    if pruned_class is not None:  # its code ties the head size to the model width
        pruned_class.from_dense(module)
