"""The engine's forward: a Llama-family decoder run from its own modules, a few products per layer.

transformers' forward is made for every use: in each layer it calls seven linear modules, and around them
it builds masks and cache layers and passes through hooks and wrappers. At a decoding step's few rows that
work costs as much as the attention itself. An engine step needs none of it: each token comes with its own
position, the runner attends (``attend``) and no mask is needed. ``Decoder`` computes what transformers'
Llama, Mistral, Qwen2 and Qwen3 decoder layers compute, with the layers' own norms, rotary embedding and
activation in the same order, over one row of tokens [T, D]. Where the engine packs weights
(``engine/packed.py``) every linear product runs over a packed copy of its weight, the query, key and value
products as one product and the gate and up products as another (their weights stacked); ``nbytes`` counts the
copies. On the CPU the residual sums and norms, RoPE and SiLU·up run as one compiled pass each
(``csrc/decoder_ops.cpp``: about 2-6 µs where their ATen operations take 8-15 µs), rounding where PyTorch rounds.
Results then differ from transformers' only by the order of float32 sums inside those products and norms, and by
SiLU's exp in the last bit. In a decoding step whose layers read their entries in place, a layer whose every part runs
compiled runs as one call of those same functions (``_Layer.compiled``, ``csrc/decode_layer.cpp``): the same numbers
without the interpreter between them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_kernels
from ..models import decoder_stack, model_facts
from .packed import FusedLinear, PackedLinear, copy_bytes, packed_or_own

# (layer, queries [T, Hq, d], keys [T, H, d], values [T, H, d] after RoPE, positions [T], attention inputs [T, D],
# scaling) → attention output [T, Hq, d]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


class InPlace(Protocol):
    """A decoding step's reads in place, every layer's (``csrc/paged_decode.cpp``'s ``PagedStep``: where the new entries
    go, the pool's arrays, the tables; ``read.paged.compiled_step``), as the compiled layers take them."""

    def __call__(self, layer: int) -> object | None:
        """The reads for ``layer``, or None: the layer attends instead."""

    def every_layer(self) -> object | None:
        """The reads where every layer takes them (the step's layers may then run as one call), else None."""


class _Rotary:
    """transformers' RoPE ``x·cos + rotate_half(x)·sin`` for tokens at ``positions``, written as ``x·cos + roll(x)·sin'``
    with sin' = (−sin₁, sin₂): ``rotate_half`` (x₁, x₂) → (−x₂, x₁) is ``roll`` by half a head with the first half's sign
    moved into sin', and −(x₂·s) = x₂·(−s) exactly, so the products are transformers' bit for bit in four operations
    instead of seven, or in one pass of the compiled ``rope`` (``kernels``: the CPU kernels, or None)."""

    def __init__(self, rotary: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, kernels=None):
        cos, sin = (x[:, None] for x in _cos_sin(rotary, hidden, positions))  # [T, 1, d]
        half = cos.shape[-1] // 2
        self.cos, self.sin, self.half = cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1), half
        self.kernels = kernels if hidden.device.type == "cpu" else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, d] rotated to its tokens' positions."""
        if self.kernels is not None:
            return self.kernels.rope(x, self.cos, self.sin)
        return x * self.cos + x.roll(self.half, dims=-1) * self.sin


def _cos_sin(rotary: nn.Module, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary module's cosines and sines for ``positions`` [T], each [T, d] in ``hidden``'s dtype. Where its
    frequencies are fixed (every RoPE type but the dynamic and long-context ones, which update them with the positions),
    its forward's own arithmetic on its ``inv_freq`` and ``attention_scaling`` (the same numbers without the module's
    call and decorator: ~14 against ~26 µs at a step's 8 rows); else the module."""
    kind = getattr(rotary, "rope_type", None)
    if not isinstance(kind, str) or "dynamic" in kind or kind == "longrope" or not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        return tuple(x[0] for x in rotary(hidden[None], positions[None]))
    freqs = positions[:, None].float() * rotary.inv_freq.to(device=hidden.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    scaling = rotary.attention_scaling
    return (emb.cos() * scaling).to(hidden.dtype), (emb.sin() * scaling).to(hidden.dtype)


class _Norm:
    """The layer's norm after a residual sum: (x, delta) → (s, norm(s)) with s = x + delta (x where delta is None).
    transformers' Llama-family RMSNorm (float32 mean of squares, ``rsqrt``, the weight times the result in the input's
    dtype) runs as ``F.rms_norm`` in float32 then the weight, the same numbers in three operations instead of eight
    (tested against the module), or, on the CPU with the compiled ``kernels``, the sum and the norm in one pass of
    ``add_rms_norm`` (``compiled``; the mean's float32 sum in another order: the last bit may differ). Another norm runs
    its own forward (``weight`` None)."""

    def __init__(self, module: nn.Module, kernels=None):
        self.module = module
        rms = type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
        self.weight, self.eps = (module.weight, module.variance_epsilon) if rms else (None, None)
        self.compiled = kernels if rms and module.weight.device.type == "cpu" else None

    def __call__(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.compiled is not None and x.dtype == self.weight.dtype:
            return tuple(self.compiled.add_rms_norm(x, delta, self.weight, self.eps))
        s = x if delta is None else x + delta
        if self.weight is None:
            return s, self.module(s)
        return s, self.weight * F.rms_norm(s.float(), (s.shape[-1],), eps=self.eps).to(s.dtype)


def _gated(mlp: nn.Module, kernels=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's ``act(gate) · up`` from the gate and up products side by side [T, 2I]: SiLU's in one pass of the
    compiled ``silu_mul`` on the CPU (its exp may differ from ATen's in the last bit), else the activation module's."""
    act = mlp.act_fn
    if kernels is not None and type(act).__name__ == "SiLUActivation" and mlp.gate_proj.weight.device.type == "cpu":
        return kernels.silu_mul

    def gated(joint: torch.Tensor) -> torch.Tensor:
        gate, up = joint.chunk(2, dim=-1)
        return act(gate) * up

    return gated


class _Layer:
    """One decoder layer's modules, the products that share an input fused."""

    def __init__(self, layer: nn.Module, head_dim: int, pack: bool, kernels=None):
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = _Norm(layer.input_layernorm, kernels), _Norm(layer.post_attention_layernorm, kernels)
        self.qkv = FusedLinear([attention.q_proj, attention.k_proj, attention.v_proj], pack)
        self.heads = attention.q_proj.out_features // head_dim, attention.k_proj.out_features // head_dim
        self.q_norm = self.k_norm = None
        if getattr(attention, "q_norm", None) is not None:  # Qwen3: per-head norms before RoPE
            self.q_norm, self.k_norm = _Norm(attention.q_norm, kernels), _Norm(attention.k_norm, kernels)
        self.o_proj, self.scaling, self.head_dim = packed_or_own(attention.o_proj, pack), attention.scaling, head_dim
        self.gate_up = FusedLinear([mlp.gate_proj, mlp.up_proj], pack)
        self.down_proj, self.gated = packed_or_own(mlp.down_proj, pack), _gated(mlp, kernels)
        self.nbytes = sum(copy_bytes(p) for p in (self.qkv, self.o_proj, self.gate_up, self.down_proj))
        self.compiled, self.compiled_rows, self.compiled_dtype = self._compiled(kernels)

    def _compiled(self, kernels) -> tuple[object | None, int, torch.dtype | None]:
        """The layer as one compiled call for a decoding step (``csrc/decode_layer.cpp``), the rows it takes at most and
        their dtype, where every part of the layer runs compiled here: RMSNorms, SiLU and RoPE on the CPU, and its four
        products streamed by ``linear_rows``; else (None, 0, None)."""
        products = [self.qkv.packed, self.o_proj, self.gate_up.packed, self.down_proj]
        norms = [self.input_norm, self.post_norm] + ([] if self.q_norm is None else [self.q_norm, self.k_norm])
        if (kernels is None or self.gated is not kernels.silu_mul or not all(n.compiled is not None for n in norms)
                or not all(isinstance(p, PackedLinear) and p.rows is not None for p in products)):
            return None, 0, None
        layer = kernels.DecodeLayer([n.weight for n in norms], [float(n.eps) for n in norms], [p.own for p in products],
                                    [p.bias for p in products], *self.heads, self.head_dim, float(self.scaling))
        return layer, min(p.rows_streamed for p in products), products[0].own[0].dtype

    def takes(self, hidden: torch.Tensor) -> bool:
        """Whether the compiled call takes a decoding step over ``hidden`` [R, D] (its rows streamed, in its dtype)."""
        return self.compiled is not None and hidden.shape[0] <= self.compiled_rows and hidden.dtype == self.compiled_dtype

    def __call__(self, index: int, hidden: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor, rotary: _Rotary,
                 attend: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``hidden`` [T, D] and the previous layer's output still to add to it (``delta``, or None)
        → this layer's (the stream with ``delta`` and its attention added, its MLP's output to add next)."""
        tokens = hidden.shape[0]
        hidden, inputs = self.input_norm(hidden, delta)
        queries, kv_heads = self.heads
        heads = self.qkv(inputs).view(tokens, queries + 2 * kv_heads, self.head_dim)
        value = heads[:, queries + kv_heads :]
        if self.q_norm is None:  # the queries and keys rotated as one
            rotated = rotary(heads[:, : queries + kv_heads])
            query, key = rotated[:, :queries], rotated[:, queries:]
        else:
            query = rotary(self.q_norm(heads[:, :queries])[1])
            key = rotary(self.k_norm(heads[:, queries : queries + kv_heads])[1])
        out = attend(index, query, key, value, positions, inputs, self.scaling)
        hidden, normed = self.post_norm(hidden, self.o_proj(out.reshape(tokens, -1)))
        return hidden, self.down_proj(self.gated(self.gate_up(normed)))


class Decoder:
    """A supported causal LM's forward for the engine (``pack``: products over packed weight copies, ``nbytes`` of
    them; else each module's own; ``compiled``: on the CPU, the norms, RoPE and SiLU by the compiled kernels where they
    are built, ``csrc/decoder_ops.cpp``)."""

    def __init__(self, model: nn.Module, pack: bool, compiled: bool = True):
        stack, facts = decoder_stack(model), model_facts(model)
        self.kernels = cpu_kernels() if compiled else None
        self.embed, self.rotary, self.norm = stack.embed_tokens, stack.rotary_emb, _Norm(stack.norm, self.kernels)
        self.lm_head = packed_or_own(model.lm_head, pack)
        self.layers = [_Layer(layer, facts.head_dim, pack, self.kernels) for layer in stack.layers]
        self.nbytes = copy_bytes(self.lm_head) + sum(layer.nbytes for layer in self.layers)
        # every layer compiled alike: a step whose reads every layer takes runs them all in one call (``decode_layers``)
        first = self.layers[0]
        alike = all(layer.compiled is not None and (layer.compiled_rows, layer.compiled_dtype) == (first.compiled_rows, first.compiled_dtype)
                    for layer in self.layers)
        self.stack = [layer.compiled for layer in self.layers] if alike else None

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend, keep: torch.Tensor,
                 in_place: InPlace | None = None) -> torch.Tensor:
        """Tokens ``ids`` [T] at ``positions`` [T], each layer's attention by ``attend`` → the logits [K, V] of the
        tokens at ``keep`` [K]. ``in_place``: where every token decodes one row and reads its entries in place, each
        layer's write and read as the compiled layer takes them (or None for a layer whose read needs more): such a
        layer runs as one compiled call (``_Layer.compiled``), the same numbers as ``attend``'s; where every layer does,
        the step's layers run as one call (``stack_call``)."""
        hidden, delta = self.embed(ids), None
        rotary = _Rotary(self.rotary, hidden, positions, self.kernels)
        whole = in_place is not None and self.stack is not None and self.layers[0].takes(hidden)
        reads = in_place.every_layer() if whole else None
        if reads is not None:
            hidden, delta = self.stack_call(hidden, rotary, reads)
        else:
            for index, layer in enumerate(self.layers):
                reads = in_place(index) if in_place is not None and layer.takes(hidden) else None
                if reads is not None:
                    hidden, delta = layer.compiled(hidden, delta, rotary.cos, rotary.sin, reads, index)
                else:
                    hidden, delta = layer(index, hidden, delta, positions, rotary, attend)
        return self.lm_head(self.norm(hidden[keep], delta[keep])[1])

    def stack_call(self, hidden: torch.Tensor, rotary: _Rotary, reads) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's compiled call in turn in one call (``csrc/decode_layer.cpp``'s ``decode_layers``): the same calls
        as the loop's, without the interpreter between them."""
        return tuple(self.kernels.decode_layers(self.stack, hidden, None, rotary.cos, rotary.sin, reads))


__all__ = ["Attend", "Decoder", "InPlace"]
