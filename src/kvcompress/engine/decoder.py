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
import torch.nn.functional as F
from torch import nn

from ..models import decoder_stack, model_facts
from .packed import FusedLinear, copy_bytes, packed_or_own

# (layer, queries [T, Hq, d], keys [T, H, d], values [T, H, d] after RoPE, positions [T], attention inputs [T, D],
# scaling) → attention output [T, Hq, d]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


class _Rotary:
    """transformers' RoPE ``x·cos + rotate_half(x)·sin`` for tokens at ``positions``, written as ``x·cos + roll(x)·sin'``
    with sin' = (−sin₁, sin₂): ``rotate_half`` (x₁, x₂) → (−x₂, x₁) is ``roll`` by half a head with the first half's sign
    moved into sin', and −(x₂·s) = x₂·(−s) exactly, so the products are transformers' bit for bit in four operations
    instead of seven."""

    def __init__(self, rotary: nn.Module, hidden: torch.Tensor, positions: torch.Tensor):
        cos, sin = (x[0, :, None] for x in rotary(hidden[None], positions[None]))  # [T, 1, d]
        half = cos.shape[-1] // 2
        self.cos, self.sin, self.half = cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1), half

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, d] rotated to its tokens' positions."""
        return x * self.cos + x.roll(self.half, dims=-1) * self.sin


def _norm(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's RMSNorm as ``F.rms_norm`` in float32, then its weight: transformers' Llama-family RMSNorm (float32
    mean of squares, ``rsqrt``, the weight times the result in the input's dtype) in three operations instead of eight,
    the same numbers (tested against the module). Another norm runs its own forward."""
    if not (type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")):
        return module
    weight, eps = module.weight, module.variance_epsilon

    def norm(x: torch.Tensor) -> torch.Tensor:
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    return norm


class _Layer:
    """One decoder layer's modules, the products that share an input fused."""

    def __init__(self, layer: nn.Module, head_dim: int, pack: bool):
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)
        self.qkv = FusedLinear([attention.q_proj, attention.k_proj, attention.v_proj], pack)
        self.heads = attention.q_proj.out_features // head_dim, attention.k_proj.out_features // head_dim
        self.q_norm = self.k_norm = None
        if getattr(attention, "q_norm", None) is not None:  # Qwen3: per-head norms before RoPE
            self.q_norm, self.k_norm = _norm(attention.q_norm), _norm(attention.k_norm)
        self.o_proj, self.scaling, self.head_dim = packed_or_own(attention.o_proj, pack), attention.scaling, head_dim
        self.gate_up = FusedLinear([mlp.gate_proj, mlp.up_proj], pack)
        self.down_proj, self.act = packed_or_own(mlp.down_proj, pack), mlp.act_fn
        self.nbytes = sum(copy_bytes(p) for p in (self.qkv, self.o_proj, self.gate_up, self.down_proj))

    def __call__(self, index: int, hidden: torch.Tensor, positions: torch.Tensor, rotary: _Rotary, attend: Attend) -> torch.Tensor:
        tokens = hidden.shape[0]
        inputs = self.input_norm(hidden)
        queries, kv_heads = self.heads
        heads = self.qkv.joint(inputs).view(tokens, queries + 2 * kv_heads, self.head_dim)
        value = heads[:, queries + kv_heads :]
        if self.q_norm is None:  # the queries and keys rotated as one
            rotated = rotary(heads[:, : queries + kv_heads])
            query, key = rotated[:, :queries], rotated[:, queries:]
        else:
            query, key = rotary(self.q_norm(heads[:, :queries])), rotary(self.k_norm(heads[:, queries : queries + kv_heads]))
        out = attend(index, query, key, value, positions, inputs, self.scaling)
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
        rotary = _Rotary(self.rotary, hidden, positions)
        for index, layer in enumerate(self.layers):
            hidden = layer(index, hidden, positions, rotary, attend)
        return self.lm_head(self.norm(hidden[keep]))


__all__ = ["Attend", "Decoder"]
