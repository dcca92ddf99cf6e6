"""The engine's forward: a Llama-family decoder run from its own modules, a few products per layer.

transformers' forward is made for every use: in each layer it calls seven linear modules, and around them
it builds masks and cache layers and passes through hooks and wrappers. At a decoding step's few rows that
work costs as much as the attention itself. An engine step needs none of it: each token comes with its own
position, the runner attends (``attend``) and no mask is needed. ``Decoder`` computes what transformers'
Llama, Mistral, Qwen2 and Qwen3 decoder layers compute, with the layers' own norms, rotary embedding and
activation in the same order, over one row of tokens [T, D]. Where the engine packs weights
(``engine/packed.py``) every linear product runs over a packed copy of its weight, the query, key and value
products as one product and the gate and up products as another (their weights stacked); ``nbytes`` counts the
copies. Results then differ from transformers' only by the order of float32 sums inside those products.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

from ..models import decoder_stack, model_facts
from .packed import FusedLinear, copy_bytes, packed_or_own

# (layer, queries [T, Hq, d], keys [T, H, d], values [T, H, d] after RoPE, positions [T], attention inputs [T, D],
# scaling) → attention output [T, Hq, d]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' RoPE ``x·cos + rotate_half(x)·sin`` for x [T, H, d] and cos/sin [T, 1, d]."""
    return x * cos + rotate_half(x) * sin


class _Layer:
    """One decoder layer's modules, the products that share an input fused."""

    def __init__(self, layer: nn.Module, head_dim: int, pack: bool):
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = FusedLinear([attention.q_proj, attention.k_proj, attention.v_proj], pack)
        self.q_norm, self.k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)  # Qwen3
        self.o_proj, self.scaling, self.head_dim = packed_or_own(attention.o_proj, pack), attention.scaling, head_dim
        self.gate_up = FusedLinear([mlp.gate_proj, mlp.up_proj], pack)
        self.down_proj, self.act = packed_or_own(mlp.down_proj, pack), mlp.act_fn
        self.nbytes = sum(copy_bytes(p) for p in (self.qkv, self.o_proj, self.gate_up, self.down_proj))

    def __call__(self, index: int, hidden: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attend: Attend) -> torch.Tensor:
        tokens = hidden.shape[0]
        inputs = self.input_norm(hidden)
        query, key, value = (x.view(tokens, -1, self.head_dim) for x in self.qkv(inputs))
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        out = attend(index, _rotated(query, cos, sin), _rotated(key, cos, sin), value, positions, inputs, self.scaling)
        hidden = hidden + self.o_proj(out.reshape(tokens, -1))
        gate, up = self.gate_up(self.post_norm(hidden))
        return hidden + self.down_proj(self.act(gate) * up)


class Decoder:
    """A supported causal LM's forward for the engine (``pack``: products over packed weight copies, ``nbytes`` of
    them; else each module's own)."""

    def __init__(self, model: nn.Module, pack: bool):
        stack, facts = decoder_stack(model), model_facts(model)
        self.embed, self.rotary, self.norm = stack.embed_tokens, stack.rotary_emb, stack.norm
        self.lm_head = packed_or_own(model.lm_head, pack)
        self.layers = [_Layer(layer, facts.head_dim, pack) for layer in stack.layers]
        self.nbytes = copy_bytes(self.lm_head) + sum(layer.nbytes for layer in self.layers)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend, keep: torch.Tensor) -> torch.Tensor:
        """Tokens ``ids`` [T] at ``positions`` [T], each layer's attention by ``attend`` → the logits [K, V] of the
        tokens at ``keep`` [K]."""
        hidden = self.embed(ids)
        cos, sin = (x[0, :, None] for x in self.rotary(hidden[None], positions[None]))
        for index, layer in enumerate(self.layers):
            hidden = layer(index, hidden, positions, cos, sin, attend)
        return self.lm_head(self.norm(hidden[keep]))


__all__ = ["Attend", "Decoder"]
