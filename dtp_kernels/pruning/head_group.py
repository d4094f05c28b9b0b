"""The group of an attention layer's heads: which rows and columns of which layers hold
each unit (a key/value head with the query heads that share it) and what else export
cuts with them. attention_forms.py builds one from each layer it recognises; heads.py
finds, proves and exports them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .head_norms import RescaledNorm
from .module_tensors import tensor_of


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
    # the units split into this many equal runs, each run's rows laid out in blocks of its
    # own units in turn (CodeGen's fused projection, interleaved over the 4 shards it was
    # trained on: each shard's queries, values and keys of its heads)
    outer: int = 1
    # an output projection block-diagonal over this many equal runs of the units: run g's
    # columns feed the g-th block of rows only, and the weight holds one run's columns
    # (DeepSeek-V4's grouped o_a_proj, computed run by run with a batched matmul)
    diagonal: int = 1

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return self.sizes or (self.per_unit,) * self.blocks

    def unit_block(self, weight: torch.Tensor, units: int) -> torch.Tensor:
        """A block-diagonal output projection's weight viewed (runs, rows of a run, units
        of a run, per_unit): unit u's columns are [u // run, :, u % run]."""
        runs = self.diagonal
        return weight.view(runs, weight.shape[0] // runs, units // runs, self.per_unit)

    def kept(self, units: int, kept_units: torch.Tensor) -> torch.Tensor:
        """Indices of the rows (columns) that `kept_units` keep."""
        if self.diagonal > 1:  # its units' columns differ by run: unit_block, not indices
            raise ValueError("a block-diagonal projection's kept units are not columns")
        rows, start, run = [], 0, units // self.outer
        for first in range(0, units, run):  # each run of units (one run but for `outer`)
            local = kept_units[(kept_units >= first) & (kept_units < first + run)] - first
            for size in self.block_sizes:
                rows.append(start + (local[:, None] * size + torch.arange(size)).flatten())
                start += run * size
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
    # equal runs of units that each keep as many (CodeGen's shards): transport segments
    segments: int = 1
    # key/value heads per unit (DiffLlama's differential attention: a unit is a pair)
    kv_heads_per_unit: int = 1
    # the layer's own parameters that serve all heads, never per-head tables whatever
    # their size (DiffLlama's lambda vectors of the head size, which may equal the heads')
    shared_parameters: tuple[str, ...] = ()
    # layers inside the attention layer run on each query head apart (MViT's pooling: a
    # depthwise conv over the head size): their FLOPs scale with the kept query heads
    per_head_layers: list[nn.Module] = field(default_factory=list)
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
        # a block-diagonal output projection loses a unit's columns from its run's rows
        # only: per unit removed, its per_unit columns over 1 / diagonal of the rows
        self.width[self.out.layer] //= self.out.diagonal
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
    def layer(self) -> nn.Module:
        return self.out.layer

    def unit_weights(self) -> torch.Tensor:
        """The output projection's columns, one row per unit (the unit's filter)."""
        weight = tensor_of(self.out.layer).detach()
        if self.out.diagonal > 1:  # a unit's columns in its own run's rows
            blocks = self.out.unit_block(weight, self.units)
            return blocks.permute(0, 2, 1, 3).reshape(self.units, -1)
        columns = torch.stack(
            [self.out.kept(self.units, torch.tensor([u])) for u in range(self.units)]
        )
        return weight[:, columns.to(weight.device)].transpose(0, 1).reshape(self.units, -1)
