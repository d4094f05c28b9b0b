"""WavLM's attention layers with some of their heads removed.

WavLM's first attention layer computes a relative position bias for all the model's
heads from its table (``rel_attn_embed``) and hands it to every later layer. Each layer
scales its heads' entries by a gate that reads the layer's input split into as many
chunks as the model has heads (head h's gate from chunk h, through one linear layer
all heads share), then attends through ``F.multi_head_attention_forward``, which takes
the head size from the input's width. With heads removed, export gives each layer
:class:`PrunedWavLMAttention`: it keeps the table and the gate's linear layer whole
(the first layer still computes the bias for all the model's heads and hands it on),
picks its kept heads' entries of the bias and chunks of the input (`kept_heads`,
picked_heads.py), and attends with the pruned projections' head count. Every layer
keeps its own heads.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.wavlm.modeling_wavlm import WavLMAttention

from .picked_heads import PicksItsHeads


class PrunedWavLMAttention(PicksItsHeads, WavLMAttention):
    """WavLM's attention computing its kept heads: their gates from their chunks of the
    input, their entries of the bias for all the model's heads, (batch * the model's
    heads, queries, keys), which it hands on whole. Same parameters and outputs (the
    attention weights averaged over the kept heads, one copy per kept head)."""

    replaces = WavLMAttention
    picked, head_count = "position_bias", "num_heads"
    # serve all the model's heads: the bias table, the gate's linear layer (run on each
    # kept head's chunk of the input)
    whole = ("rel_attn_embed", "gru_rel_pos_linear")
    per_head = ("gru_rel_pos_linear",)

    def forward(  # type: ignore[override]  # (transformers types its returned bias a tuple)
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_bias: torch.Tensor | None = None,
        index: int = 0,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, length, width = hidden_states.shape
        model_heads, heads, size = width // self.head_dim, self.num_heads, self.head_dim
        if position_bias is None:  # the first layer: the bias of all the model's heads
            table = self.compute_bias(length, length)
            position_bias = table.unsqueeze(0).expand(batch, -1, -1, -1)
            position_bias = position_bias.reshape(batch * model_heads, length, length)
        # each kept head's gate, from its own chunk of the input
        chunks = hidden_states.view(batch, length, model_heads, size).index_select(
            2, self.kept_heads
        )
        gates = self.gru_rel_pos_linear(chunks.transpose(1, 2))
        gate_a, gate_b = torch.sigmoid(gates.view(*gates.shape[:-1], 2, 4).sum(-1)).chunk(2, -1)
        gate = gate_a * (gate_b * self.gru_rel_pos_const - 1.0) + 2.0  # (batch, heads, T, 1)
        bias = position_bias.view(batch, model_heads, length, length)
        bias = (gate * bias.index_select(1, self.kept_heads)).view(batch * heads, length, length)
        if attention_mask is not None:  # padded keys: -inf, as multi_head_attention_forward
            padded = attention_mask.ne(1).view(batch, 1, 1, length)
            bias = bias.view(batch, heads, length, length).masked_fill(padded, float("-inf"))
            bias = bias.view(batch * heads, length, length)

        def split(x: torch.Tensor) -> torch.Tensor:  # (batch * heads, T, size)
            return x.view(batch, length, heads, size).transpose(1, 2).reshape(-1, length, size)

        query = split(self.q_proj(hidden_states) * self.scaling)
        scores = torch.baddbmm(bias, query, split(self.k_proj(hidden_states)).transpose(1, 2))
        weights = nn.functional.softmax(scores, dim=-1)
        dropped = nn.functional.dropout(weights, p=self.dropout, training=self.training)
        context = torch.bmm(dropped, split(self.v_proj(hidden_states)))
        context = context.view(batch, heads, length, size).transpose(1, 2)
        output = self.out_proj(context.reshape(batch, length, heads * size))
        averaged = weights.view(batch, heads, length, length).mean(dim=1)
        return output, averaged[:, None].expand(-1, heads, -1, -1), position_bias


PRUNED_CLASSES: dict[type[nn.Module], type[nn.Module]] = {WavLMAttention: PrunedWavLMAttention}
