"""The heads of Gated DeltaNet linear-attention layers (Qwen3-Next, Qwen3.5 and
Qwen3.5-MoE, OLMo-Hybrid, LaRA-mini): one group per layer, ratio kind
``"linear_attention"``.

Such a layer projects the hidden state into queries and keys (K key heads of head_k_dim)
and values (V value heads of head_v_dim, V / K = R per key head, the value heads of key
head i being i R to i R + R - 1), an output gate z of the values' width, and b and a (one
per value head); runs a causal depthwise ``conv1d`` over the queries, keys and values;
runs the gated delta rule per value head (its key head's query and key, L2-normalized
per head; its own decay from a, ``A_log`` and ``dt_bias``); normalizes each value head's
output by an RMS norm over that head (one weight all heads share) gated by z; and its
output projection reads them. Nothing mixes the heads, so a unit is a key head with its
R value heads, and removing it computes what zeroing its output columns computes: the
mask goes there, as on an attention layer's heads (heads.py), and export cuts the unit's
rows of every projection, its conv channels, its entries of ``A_log`` and ``dt_bias``
and its output columns. The layers name their projections three ways:

- ``in_proj_qkv`` (all queries, all keys, all values), ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a`` and ``out_proj`` (Qwen3.5, Qwen3.5-MoE, LaRA-mini);
- ``in_proj_qkvz`` (per key head: its query, key, values and gates) and ``in_proj_ba``
  (per key head: its b, then its a) with ``out_proj`` (Qwen3-Next);
- ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj``, ``a_proj``, ``b_proj`` and ``o_proj``
  (OLMo-Hybrid).

A layer is recognised by these names, its head counts and sizes (``num_k_heads``,
``num_v_heads``, ``head_k_dim``, ``head_v_dim``) and its shapes, and each group is proven
on its example input like every head group before any mask.

Kimi Delta Attention (Kimi Linear; the Bailing hybrid's linear-attention layers) is the
same rule with a decay per channel instead of per head: ``num_heads`` heads of
``head_dim`` (one value head per key head), ``q_proj``, ``k_proj``, ``v_proj`` and
``conv1d`` over their concatenation, a ``forget_gate`` whose low-rank ``f_b_proj`` (the
Bailing hybrid's full-rank ``f_proj``) makes each head's decays (with a ``dt_bias`` entry
per channel and an ``A_log`` entry per head), ``b_proj`` (one per head), the output
gate's low-rank ``g_b_proj`` (full-rank ``g_proj``: a head's channels), a norm per head
of one weight all heads share, and ``o_proj``. The low-rank inputs ``f_a_proj`` and
``g_a_proj`` serve all heads and stay.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .heads import HeadGroup, Projection

# the rows per unit of each block of a projection, by what they hold: "k" a key head's
# (head_k_dim), "v" its value heads' (R head_v_dim), "h" one per value head (R)
LAYOUTS = (
    (  # Qwen3.5, Qwen3.5-MoE, LaRA-mini
        (("in_proj_qkv", ("k", "k", "v")), ("in_proj_z", ("v",))),
        (("in_proj_b", ("h",)), ("in_proj_a", ("h",))),
        "out_proj",
    ),
    (  # Qwen3-Next: one block per key head of its query, key, values and gates; b, a
        (("in_proj_qkvz", ("kkvv",)),),
        (("in_proj_ba", ("hh",)),),
        "out_proj",
    ),
    (  # OLMo-Hybrid
        (("q_proj", ("k",)), ("k_proj", ("k",)), ("v_proj", ("v",)), ("g_proj", ("v",))),
        (("a_proj", ("h",)), ("b_proj", ("h",))),
        "o_proj",
    ),
)
SIZES = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
# Kimi Delta Attention's projections of one row (b_proj) or one head's channels per head
KIMI_ROWS = ("q_proj", "k_proj", "v_proj", "b_proj")
# and those of its gates, under their low-rank (Kimi Linear) or full-rank (Bailing
# hybrid) names: the output gate's on the layer, the decays' on its forget gate
KIMI_GATES = (("g_b_proj", "g_proj"), ("f_b_proj", "f_proj"))
# the parameters with one entry per value head
TABLES = ("A_log", "dt_bias")


@dataclass(eq=False)
class LinearAttentionGroup(HeadGroup):
    """A Gated DeltaNet layer's heads: `units` key heads, `query_heads_per_unit` value
    heads each, `head_dim` the value heads' size."""


def _rows(symbols: str, sizes: dict[str, int]) -> int:
    return sum(sizes[s] for s in symbols)


def gated_deltanet(name: str, module: nn.Module) -> LinearAttentionGroup | None:
    """The group of a Gated DeltaNet layer in one of LAYOUTS, or None."""
    counts = [c for a in SIZES if isinstance(c := getattr(module, a, None), int) and c > 0]
    conv = getattr(module, "conv1d", None)
    if len(counts) != len(SIZES) or not isinstance(conv, nn.Conv1d):
        return None
    keys, values, key_dim, value_dim = counts
    if values % keys:
        return None
    per_key = values // keys
    if not all(
        isinstance(t := getattr(module, name, None), nn.Parameter) and tuple(t.shape) == (values,)
        for name in TABLES
    ):
        return None
    sizes = {"k": key_dim, "v": per_key * value_dim, "h": per_key}
    for projections, gates, output in LAYOUTS:
        wanted = {n for n, _ in (*projections, *gates)}
        layers = {n: x for n in wanted if isinstance(x := getattr(module, n, None), nn.Linear)}
        out = getattr(module, output, None)
        if not isinstance(out, nn.Linear) or len(layers) != len(wanted):
            continue
        rows = [
            Projection(
                layers[n],
                len(blocks),
                _rows(blocks[0], sizes),
                tuple(_rows(b, sizes) for b in blocks),
            )
            for n, blocks in (*projections, *gates)
        ]
        conv_rows = Projection(conv, 3, key_dim, (key_dim, key_dim, sizes["v"]))
        width = 2 * keys * key_dim + values * value_dim
        if (
            any(p.layer.out_features != keys * sum(p.block_sizes) for p in rows)
            or out.in_features != values * value_dim
            or not conv.groups == conv.in_channels == conv.out_channels == width
        ):
            return None
        per_unit = {
            "num_k_heads": 1,
            "num_v_heads": per_key,
            "key_dim": key_dim,
            "value_dim": sizes["v"],
            "conv_dim": 2 * key_dim + sizes["v"],
        }  # those the layer has
        attributes = {
            a: n for a, n in per_unit.items() if isinstance(getattr(module, a, None), int)
        }
        return LinearAttentionGroup(
            name,
            module,
            rows,
            Projection(out, 1, sizes["v"]),
            keys,
            per_key,
            value_dim,
            tables=[(module, t, 0) for t in TABLES],
            convs=[conv_rows],
            attributes=attributes,
        )
    return None


def kimi_delta_attention(name: str, module: nn.Module) -> LinearAttentionGroup | None:
    """The group of a Kimi Delta Attention layer, or None."""
    heads, size = getattr(module, "num_heads", None), getattr(module, "head_dim", None)
    gate = getattr(module, "forget_gate", None)
    conv = getattr(module, "conv1d", None)
    if not (isinstance(heads, int) and isinstance(size, int) and heads > 0 and size > 0):
        return None
    if not isinstance(gate, nn.Module) or not isinstance(conv, nn.Conv1d):
        return None
    width = heads * size
    layers = {n: getattr(module, n, None) for n in KIMI_ROWS}
    for owner, names in zip((module, gate), KIMI_GATES, strict=True):
        found = next((n for n in names if isinstance(getattr(owner, n, None), nn.Linear)), None)
        layers[found or names[0]] = getattr(owner, found) if found else None
    out = getattr(module, "o_proj", None)
    decay_bias, decay_rate = getattr(gate, "dt_bias", None), getattr(gate, "A_log", None)
    linear = {n: x for n, x in layers.items() if isinstance(x, nn.Linear)}
    if not isinstance(out, nn.Linear) or len(linear) != len(layers):
        return None
    if not (
        all(x.out_features == width for n, x in linear.items() if n != "b_proj")
        and linear["b_proj"].out_features == heads
        and out.in_features == width
        and conv.groups == conv.in_channels == conv.out_channels == 3 * width
        and isinstance(decay_bias, nn.Parameter)
        and tuple(decay_bias.shape) == (width,)
        and isinstance(decay_rate, nn.Parameter)
        and decay_rate.numel() == heads
        and heads in decay_rate.shape
    ):
        return None
    rows = [Projection(x, 1, 1 if n == "b_proj" else size) for n, x in linear.items()]
    per_unit = {"num_heads": 1, "qkv_dim": size, "conv_dim": 3 * size}
    group = LinearAttentionGroup(
        name,
        module,
        rows,
        Projection(out, 1, size),
        heads,
        1,
        size,
        tables=[(gate, "A_log", list(decay_rate.shape).index(heads))],
        convs=[Projection(conv, 3, size)],
        attributes={a: n for a, n in per_unit.items() if getattr(module, a, None) == heads * n},
    )
    group.row_vectors = [(gate, "dt_bias")]  # one decay bias per channel of each head
    return group


def find_linear_attention_groups(
    model: nn.Module, ignored: list[nn.Module]
) -> list[LinearAttentionGroup]:
    """Every Gated DeltaNet or Kimi Delta Attention layer of `model` of at least two key
    heads, none of whose layers is in `ignored`."""
    ignored_set = set(ignored)
    groups = []
    for name, module in model.named_modules():
        group = None
        if module not in ignored_set:
            group = gated_deltanet(name, module) or kimi_delta_attention(name, module)
        if group is None or group.units < 2:
            continue
        if {*group.kept_out, *group.kept_in} & ignored_set:
            continue
        groups.append(group)
    return groups
