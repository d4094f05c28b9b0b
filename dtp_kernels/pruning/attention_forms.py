"""The forms of attention layer whose heads the pruner recognises by their structure
(Torch-Pruning's graph does not follow the per-head reshapes), and the head group of
each (:func:`match_form`):

- DiffLlama's differential attention (the separate form's names, its heads paired
  across the two halves: a unit is a pair of key/value heads with their query heads);
- separate projections, as Hugging Face writes them: ``q_proj``, ``k_proj``, ``v_proj``
  and ``o_proj`` (Llama, Mistral, Qwen, Gemma), ``out_proj`` (OPT, BART, Whisper, CLIP,
  GPT-J, XGLM), ``dense`` (Phi), ``Wo`` (ModernBERT's decoder), ``projection_layer``
  (InternVL's vision tower) or ``proj`` (timm's EVA, unfused), with ``head_dim``;
  DistilBERT's ``q_lin``, ``k_lin``, ``v_lin``, ``out_lin`` and ALBERT's ``query``,
  ``key``, ``value``, ``dense`` with ``attention_head_size``; T5's and UMT5's ``q``,
  ``k``, ``v``, ``o`` with ``key_value_proj_dim``; CTRL's ``Wq``, ``Wk``, ``Wv``,
  ``dense`` with ``head_dim``; XLM's and FlauBERT's ``q_lin``, ``k_lin``, ``v_lin``,
  ``out_lin`` with ``head_dim``; Wav2Vec2-Conformer's ``linear_q``, ``linear_k``,
  ``linear_v``, ``linear_out`` with ``head_size`` (its ``linear_pos`` of the relative
  positions cut with the heads: heads.py). An RMS normalization of the queries or keys over all
  heads (OLMo 2's ``q_norm``, not Qwen3's per head) is kept exact as heads go
  (head_norms.py); any other normalization over all heads refuses the group; an output
  gate of the query width (AFMoE's ``gate_proj``) is cut with the heads, and any other
  linear layer computing the query width from the layer's input refuses the group;
- one fused ``qkv`` projection and ``proj``, with ``num_heads`` and ``head_dim``, as
  timm's ViT and DeiT write them (or ``num_heads`` alone: timm's and torchvision's Swin,
  timm's MaxxViT, whose ``head_first`` layers hold each head's query, key and value in
  turn); layers whose code ties the head size or the output width to the input width
  (torchvision's Swin and MaxViT; timm's EVA, BEiT, Swin V2, Swin V2 CR, DaViT, XCiT,
  EdgeNeXt, VOLO, relative-position ViT, PVT v2, Twins, NesT, ConViT and CaiT, whose
  talking heads' mixes over the heads are cut with them; Hugging Face's TrOCR and PVT
  v2, of the separate form) are exported as classes of torchvision_attention.py,
  timm_attention.py and transformers_attention.py (pruned_classes.py); GPT-2's
  ``c_attn`` and ``c_proj`` with ``split_size`` (its Conv1D layers made ``nn.Linear`` by
  :func:`conv1d_to_linear` first; OpenAI GPT's with ``n_head``); MPNet's ``q``, ``k``,
  ``v``, ``o`` with ``attention_head_size``; Phi-3's ``qkv_proj`` (query heads, then key
  and value heads) and ``o_proj``, whose head count the layers read from the config they
  share;
- a query projection ``q`` and one ``kv`` of all the keys then all the values (timm's
  PVT v2, Twins' global attention and VOLO's class attention), or one ``qk`` and ``v``
  (ConViT's gated positional attention), and ``proj``, with ``num_heads`` and
  ``head_dim`` or the head count alone;
- a fused ``qkv`` holding each head's query, key and value in turn, with ``key_dim``,
  ``val_dim`` and ``num_heads`` (timm's TinyViT, EfficientFormer and LeViT; Hugging
  Face's LeViT, ``queries_keys_values``; LeViT's projections carry a batch norm of their
  rows, cut with them);
- ``query``, ``key``, ``value`` with ``num_attention_heads`` and
  ``attention_head_size``, the output projection being the ``output.dense`` beside it
  (Hugging Face's BERT), or ``query_proj``, ``key_proj``, ``value_proj`` there
  (DeBERTa-v2), or ``in_proj`` holding each head's query, key and value in turn
  (DeBERTa), or one ``qkv`` of all heads' queries, keys, then values with ``num_heads``
  (TimeSformer's space and time attention);
- one fused projection holding each unit's query heads, key and value in turn:
  GPT-NeoX's, Falcon's and BLOOM's ``query_key_value`` with ``dense``, GPT-BigCode's
  ``c_attn`` with ``c_proj``; MPT's ``Wqkv`` (query, key and value blocks) with
  ``out_proj``, ModernBERT's with ``Wo``; DBRX's ``Wqkv`` of fewer key/value heads
  (``num_key_value_heads``) than query heads, whose code splits it at its
  ``hidden_size``, the query width export writes;
- multi-head latent attention (DeepSeek-V2 and V3, and the families built on them): the
  query projection ``q_b_proj`` (or ``q_proj``, or A.X K2's ``q_gate_proj`` of each
  head's query and output gate in turn) and the key/value up-projection
  ``kv_b_proj`` hold each head's rows, ``o_proj`` its columns; the compressed latents
  before them (``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms) serve all heads and
  stay whole, as does the rotary key all heads share;
- a layer reading the keys and values of an earlier layer (Gemma 3n's and Gemma 4's KV
  sharing): ``q_proj`` and ``o_proj``, pruned tied to that layer (shared_kv.py);
- DeepSeek-V4's multi-query attention: ``q_b_proj`` holds each query head's rows,
  ``kv_proj`` the one key/value head all read (kept whole; the compressed query
  ``q_a_proj`` is no part of the heads: its width, through its RMS norm, is a channel
  group of its own), the grouped ``o_a_proj`` is block-diagonal over ``n_groups`` equal runs
  of heads (a head's columns in its run's rows only: its mask and cut are per run, and
  every run keeps as many heads), and the per-head sinks are cut with the heads;
- CodeGen's ``qkv_proj``, interleaved over its 4 training shards (each shard's queries,
  values and keys of its heads), and ``out_proj``: every shard keeps as many heads;
- torch's ``nn.MultiheadAttention`` (torchvision's ViT). Its inner width is tied to the
  embedding width, so export replaces it with a ``PrunedMultiheadAttention``
  (multihead_attention.py), the same computation with fewer heads.
"""

from __future__ import annotations

from torch import nn

from .head_group import HeadGroup, Projection
from .pruned_classes import pruned_classes


def _linear(module: nn.Module, name: str) -> nn.Linear | None:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Linear) else None


def _linears(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    """`module`'s linear layers `names`, in order, when it holds every one."""
    layers = [_linear(module, name) for name in names]
    return [layer for layer in layers if layer is not None] if None not in layers else None


def _ints(module: nn.Module, names: tuple[str, ...]) -> list[int] | None:
    """`module`'s int attributes `names` (sizes, counts), in order, when every one is an
    int."""
    values = [getattr(module, name, None) for name in names]
    ints = [value for value in values if isinstance(value, int)]
    return ints if len(ints) == len(values) else None


def _fused_pair(
    module: nn.Module, forms: tuple[tuple[str, str], ...]
) -> tuple[str, str, nn.Linear, nn.Linear] | None:
    """The first (fused projection, output projection) names of `forms` that `module`
    holds as linear layers, with the layers."""
    for fused, output in forms:
        qkv, out = _linear(module, fused), _linear(module, output) or _first_linear(module, output)
        if qkv is not None and out is not None:
            return fused, output, qkv, out
    return None


def _first_linear(module: nn.Module, name: str) -> nn.Linear | None:
    """The linear layer of `module`'s Sequential `name` that holds it and then dropout
    alone (torchvision MViT's `project`), or None."""
    child = getattr(module, name, None)
    if not isinstance(child, nn.Sequential) or not len(child):
        return None
    if isinstance(child[0], nn.Linear) and all(isinstance(m, nn.Dropout) for m in child[1:]):
        return child[0]
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
    (("linear_q", "linear_k", "linear_v", "linear_out"), "head_size"),  # Wav2Vec2-Conformer
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
        head_dim = None if size is None else getattr(module, size, None)
        heads = getattr(module, "num_heads", None)
        alone = size is None and not hasattr(module, "head_dim")  # a head count alone
        output = _linear(module, names[3])
        if alone and output is not None and isinstance(heads, int) and heads > 0:
            if output.in_features % heads:
                raise ValueError(
                    f"attention layer {name!r}: {names[3]} ({output.in_features} inputs) "
                    f"does not split into its num_heads {heads}"
                )
            head_dim, size = output.in_features // heads, "size"
        layers = _linears(module, names)
        if layers is not None and isinstance(head_dim, int):
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


def _differential(name: str, module: nn.Module) -> HeadGroup | None:
    """DiffLlama's differential attention: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``
    and ``head_dim``, with the learned ``lambda_q1`` and a ``groupnorm``. Its code pairs
    query head h of the first half of the heads with head h of the second half (their
    two attention maps subtracted, normalized together over both value halves), so a
    unit is key/value heads j and j + K/2 with the G query heads that read each: G rows
    of queries in each half of ``q_proj``, a key and a value head in each half of
    ``k_proj`` and ``v_proj``, and the G pairs' 2 G head_dim columns of ``o_proj``.
    The layer reads its head counts from the config, which export writes."""
    layers = _linears(module, ("q_proj", "k_proj", "v_proj", "o_proj"))
    head_dim = getattr(module, "head_dim", None)
    if not (
        layers is not None
        and isinstance(head_dim, int)
        and isinstance(getattr(module, "lambda_q1", None), nn.Parameter)
        and isinstance(getattr(module, "groupnorm", None), nn.Module)
    ):
        return None
    q, k, v, o = layers
    heads, kv_heads = o.in_features // head_dim, k.out_features // head_dim
    if not (
        q.out_features == o.in_features == heads * head_dim
        and v.out_features == k.out_features == kv_heads * head_dim
        and kv_heads % 2 == 0
        and heads % kv_heads == 0
    ):
        raise ValueError(
            f"attention layer {name!r}: q_proj ({q.out_features}), k_proj "
            f"({k.out_features}), v_proj ({v.out_features}) outputs and o_proj "
            f"({o.in_features}) inputs are not pairs of heads of head_dim {head_dim}"
        )
    per_kv = heads // kv_heads  # query heads per key/value head
    rows = [
        Projection(q, 2, per_kv * head_dim),
        Projection(k, 2, head_dim),
        Projection(v, 2, head_dim),
    ]
    out = Projection(o, 1, 2 * per_kv * head_dim)
    lambdas = tuple(n for n, _ in module.named_parameters(recurse=False) if n.startswith("lambda"))
    return HeadGroup(
        name,
        module,
        rows,
        out,
        kv_heads // 2,
        2 * per_kv,
        head_dim,
        kv_heads_per_unit=2,
        shared_parameters=lambdas,
    )


def _split(name: str, module: nn.Module) -> HeadGroup | None:
    """A SPLIT_FORMS pair of projections and ``proj``, with ``num_heads`` and ``head_dim``
    or the head count alone, the head size then ``proj``'s inputs over it."""
    out, heads = _linear(module, "proj"), getattr(module, "num_heads", None)
    if out is None or not isinstance(heads, int) or heads < 1:
        return None
    for form in SPLIT_FORMS:
        layers = _linears(module, tuple(part for part, _ in form))
        if layers is not None:
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
    compressed key/value latent kv_a_proj_with_mqa (DeepSeek-V2, V3). A.X K2's fused
    q_gate_proj holds each head's query rows, then the v_head_dim rows of its output
    gate (applied before o_proj, channel by channel)."""
    query = _linear(module, "q_b_proj") or _linear(module, "q_proj")
    gated = query is None and _linear(module, "q_gate_proj") is not None
    query = _linear(module, "q_gate_proj") if gated else query
    kv_up, out = _linear(module, "kv_b_proj"), _linear(module, "o_proj")
    sizes = _ints(module, ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if (
        query is None
        or kv_up is None
        or out is None
        or _linear(module, "kv_a_proj_with_mqa") is None
        or sizes is None
    ):
        return None
    nope, rope, value = sizes
    per_query = nope + rope + (value if gated else 0)
    heads = out.in_features // value
    if (
        out.in_features % value
        or query.out_features != heads * per_query
        or kv_up.out_features != heads * (nope + value)
    ):
        gate = f" + {value} gate" if gated else ""
        raise ValueError(
            f"latent attention layer {name!r}: its query ({query.out_features} outputs), "
            f"kv_b_proj ({kv_up.out_features} outputs) and o_proj ({out.in_features} inputs) "
            f"are not {heads} heads of {nope} + {rope} query{gate}, {nope} + {value} "
            "key/value dimensions"
        )
    rows = [Projection(query, 1, per_query), Projection(kv_up, 1, nope + value)]
    return HeadGroup(name, module, rows, Projection(out, 1, value), heads, 1, value, latent=True)


def _grouped_output(name: str, module: nn.Module) -> HeadGroup | None:
    """Multi-query attention whose output projection is block-diagonal over groups of
    heads (DeepSeek-V4's): ``q_b_proj`` holds each query head's rows (after the
    compressed query ``q_a_proj`` all heads share), ``kv_proj`` the one head all heads
    read as key and value (kept whole), and ``o_a_proj`` (with ``n_groups``) projects
    each equal run of heads to its own rows, which ``o_b_proj`` then mixes. A unit is a
    query head; every run keeps as many (transport segments), as the grouped projection
    needs."""
    layers = _linears(module, ("q_b_proj", "kv_proj", "o_a_proj"))
    counts = _ints(module, ("num_heads", "head_dim"))
    if layers is None or counts is None:
        return None
    (query, kv, out), (heads, head_dim) = layers, counts
    runs = getattr(out, "n_groups", None)
    if not isinstance(runs, int) or min(runs, heads, head_dim) < 1:
        return None
    if (
        query.out_features != heads * head_dim
        or kv.out_features != head_dim
        or heads % runs
        or head_dim % runs  # a removed head's columns span 1 / runs of the rows
        or out.in_features * runs != heads * head_dim
        or out.out_features % runs
    ):
        raise ValueError(
            f"attention layer {name!r}: q_b_proj ({query.out_features} outputs), kv_proj "
            f"({kv.out_features}) and o_a_proj ({out.in_features} inputs, {runs} groups) "
            f"are not {heads} query heads of head_dim {head_dim} reading one key/value "
            f"head, in {runs} groups of as many heads (a head_dim they divide)"
        )
    rows = [Projection(query, 1, head_dim)]
    output = Projection(out, 1, head_dim, diagonal=runs)
    return HeadGroup(name, module, rows, output, heads, 1, head_dim, shared_kv=True, segments=runs)


# one fused projection of query, key and value blocks and the output projection
# timm, MPT, ModernBERT, torchvision's MaxViT
FUSED_FORMS = (
    ("qkv", "proj"),
    ("Wqkv", "out_proj"),
    ("Wqkv", "Wo"),
    ("to_qkv", "merge"),
    ("qkv", "project"),  # torchvision's MViT: a linear layer, then dropout
)
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
    grouped = _grouped_fused(name, module, qkv, proj, heads, head_dim)
    if grouped is not None:
        return grouped
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


def _grouped_fused(
    name: str, module: nn.Module, qkv: nn.Linear, proj: nn.Linear, heads: int, head_dim: int
) -> HeadGroup | None:
    """A FUSED_FORMS projection of all query heads, then fewer key heads, then as many
    value heads, with ``num_key_value_heads`` (DBRX's ``Wqkv``): a unit is a key/value
    head with its query heads (one query head where there is a single key/value head, as
    in multi-query attention). None where the layer has as many key/value heads as
    query heads, or its shapes are not those of this layout."""
    units = getattr(module, "num_key_value_heads", None)
    if (
        not isinstance(units, int)
        or not 0 < units < heads
        or heads % units
        or proj.in_features != heads * head_dim
        or qkv.out_features != (heads + 2 * units) * head_dim
    ):
        return None
    if units == 1:  # rows: all query heads, then the key, then the value
        return _query_head_units(name, module, qkv, proj, heads, head_dim)
    per_unit = heads // units
    rows = [Projection(qkv, 3, head_dim, (per_unit * head_dim, head_dim, head_dim))]
    return HeadGroup(
        name, module, rows, Projection(proj, 1, per_unit * head_dim), units, per_unit, head_dim
    )


def _linear_and_norm(module: nn.Module | None) -> tuple[nn.Linear | None, nn.Module | None]:
    """A linear layer as it is; the linear layer and the batch norm of LeViT's LinearNorm
    (``linear``, then ``bn``, a BatchNorm1d over its outputs; Hugging Face's
    MLPLayerWithBN: ``batch_norm``); or either of those as the last module of a
    Sequential (timm LeViT's ``proj``: an activation, then a LinearNorm). (None, None)
    for anything else."""
    if isinstance(module, nn.Sequential) and len(module):
        module = module[-1]
    if module is None:
        return None, None
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
    if not (isinstance(key_dim, int) and isinstance(val_dim, int) and isinstance(heads, int)):
        return None
    if min(key_dim, val_dim, heads) < 1:
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
BERT_FORMS = (
    ("query", "key", "value"),
    ("query_proj", "key_proj", "value_proj"),
    ("in_proj",),
    ("qkv",),
)


def _bert(name: str, module: nn.Module) -> HeadGroup | None:
    """A parent holding ``self`` (query, key, value) and ``output.dense`` (BERT; the inner
    layer named ``attention`` in the ViT layout of Data2Vec's vision model and YOLOS);
    DeBERTa-v2's ``query_proj``, ``key_proj``, ``value_proj``, with the projections of its
    relative position embeddings, ``pos_key_proj`` and ``pos_query_proj``, per head too;
    DeBERTa's ``in_proj`` (each head's query, key and value in turn; its query and value
    biases are vectors of the query width) with ``pos_proj`` and ``pos_q_proj``;
    TimeSformer's ``qkv`` (all heads' queries, keys, then values) with ``num_heads``, the
    head size its outputs over three times that."""
    # the inner layer is `self` (BERT), or `attention` (the ViT layout of Data2Vec's
    # vision model and YOLOS): the first of them holding a form's projections
    found = next(
        (
            (inner_name, inner, names, layers)
            for inner_name in ("self", "attention")
            if isinstance(inner := getattr(module, inner_name, None), nn.Module)
            for names in BERT_FORMS
            if (layers := _linears(inner, names)) is not None
        ),
        None,
    )
    output = getattr(module, "output", None)
    out = _linear(output, "dense") if isinstance(output, nn.Module) else None
    if found is None or out is None:
        return None
    inner_name, inner, names, layers = found
    heads = getattr(inner, "num_attention_heads", None)
    head_dim = getattr(inner, "attention_head_size", None)
    fused = names == ("qkv",)  # TimeSformer's: the head count alone
    num_heads = getattr(inner, "num_heads", None)
    if fused and isinstance(num_heads, int) and num_heads > 0:
        heads, head_dim = num_heads, layers[0].out_features // (3 * num_heads)
    if not isinstance(heads, int):
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
    if fused:  # all heads' queries, then keys, then values
        rows = [Projection(layers[0], 3, head_dim)]
    else:
        rows = [Projection(x, 1, blocks * head_dim) for x in layers]
    rows += [Projection(x, 1, head_dim) for x in extra]
    out_rows = Projection(out, 1, head_dim)
    return HeadGroup(f"{name}.{inner_name}", inner, rows, out_rows, heads, 1, head_dim)


def _sharded(name: str, module: nn.Module) -> HeadGroup | None:
    """CodeGen's ``qkv_proj``, interleaved over the ``mp_num`` shards it was trained on
    (each shard's queries, values and keys of its heads in turn), with ``out_proj``,
    ``num_attention_heads`` and ``head_dim``: its code splits the projection into
    ``mp_num`` equal parts, so every shard keeps as many heads (one segment each)."""
    qkv, out = _linear(module, "qkv_proj"), _linear(module, "out_proj")
    counts = _ints(module, ("mp_num", "num_attention_heads", "head_dim"))
    if qkv is None or out is None or counts is None:
        return None
    shards, heads, head_dim = counts
    width = heads * head_dim
    if qkv.out_features != 3 * width or out.in_features != width or heads % shards:
        raise ValueError(
            f"attention layer {name!r}: qkv_proj ({qkv.out_features} outputs) and out_proj "
            f"({out.in_features} inputs) are not {heads} heads of head_dim {head_dim} in "
            f"{shards} equal shards"
        )
    rows = [Projection(qkv, 3, head_dim, outer=shards)]
    out_rows = Projection(out, 1, head_dim)
    # one head per shard: none can go while every shard keeps as many
    alone = ""
    if heads == shards:
        alone = "each of its shards holds one head, and every shard must keep as many"
    return HeadGroup(
        name, module, rows, out_rows, heads, 1, head_dim, refusal=alone, segments=shards
    )


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


# the flag of a layer that reads another layer's keys and values (transformers' KV sharing)
READS_KV = "is_kv_shared_layer"


def _kv_reusing(name: str, module: nn.Module) -> HeadGroup | None:
    """The heads of a layer that reads its keys and values from an earlier layer (KV
    sharing, Gemma 3n's and Gemma 4's: it has no key or value projection):
    ``q_proj``'s rows and ``o_proj``'s columns of each unit (a key/value head it reads,
    with its ``num_key_value_groups`` query heads; each query head where it reads one);
    None for any other layer."""
    if getattr(module, READS_KV, None) is not True:
        return None
    q, o = getattr(module, "q_proj", None), getattr(module, "o_proj", None)
    counts = _ints(module, ("head_dim", "num_key_value_groups"))
    if not (isinstance(q, nn.Linear) and isinstance(o, nn.Linear)):
        return None
    if counts is None or min(counts) < 1:
        return None
    head_dim, per_unit = counts
    heads = o.in_features // head_dim
    if q.out_features != o.in_features or o.in_features % head_dim or heads % per_unit:
        raise ValueError(
            f"attention layer {name!r}: q_proj ({q.out_features} outputs) and o_proj "
            f"({o.in_features} inputs) are not query heads of head_dim {head_dim} in "
            f"groups of {per_unit} per key/value head"
        )
    units = heads // per_unit
    if units == 1 and heads > 1:  # it reads one key/value head: a unit is a query head
        rows, out = [Projection(q, 1, head_dim)], Projection(o, 1, head_dim)
        return HeadGroup(name, module, rows, out, heads, 1, head_dim, shared_kv=True)
    # its units are the store layer's key/value heads: pruned only tied to it (shared_kv.py)
    rows = [Projection(q, 1, per_unit * head_dim)]
    out = Projection(o, 1, per_unit * head_dim)
    return HeadGroup(name, module, rows, out, units, per_unit, head_dim)


# the forms in the order they are tried: the first that matches gives the group
FORMS = (
    _kv_reusing,  # before _separate: it has q_proj and o_proj only
    _differential,  # before _separate, whose names it has
    _separate,
    _split,
    _per_head_qkv,
    _fused,
    _per_head_fused,
    _phi3,
    _gpt2,
    _bert,
    _latent,
    _grouped_output,
    _sharded,
    _torch_mha,
)


def match_form(name: str, module: nn.Module) -> HeadGroup | None:
    """The head group of `module` in the first of FORMS it has, or None; a refused group
    where it has a form's names but not its shapes (an error naming it when it holds no
    linear layer)."""
    try:
        return next((g for form in FORMS if (g := form(name, module)) is not None), None)
    except ValueError as error:  # the form's names, but not its shapes
        return _unsplit(name, module, str(error))
