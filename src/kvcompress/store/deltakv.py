"""DeltaKV's coded storage (Sparse-vLLM / DeltaKV, seed 004; METHODS.md "DeltaKV").

A token of a layer is one vector over every KV head, x = concat(keys, values) ∈ R^{2·H·d}, with
**pre-RoPE** keys (RoPE is undone with the token's position and re-applied on read). Tokens at
positions ``i mod stride = 0`` and the first ``sinks`` are *references*, stored raw. Every other
token keeps only a residual code z = f_c(x) − f_c(m) of width d_c (the paper's: a quarter of 2·H·d;
the shipped codecs: half, stored in 4 bits), m the mean of its ``top_k`` nearest earlier references
by L2, and the ids of those references; reading it gives x̂ = f_d(z) + m. f_c is a SwiGLU block
beside a linear path and f_d a bias-free linear map (the paper's "light" variant: reconstruction is
what runs at every step), one pair per layer; inputs are divided by a per-channel scale fixed from
the first training batch. Training starts from the best linear code (``fit_principal``: the linear
path and the decoder on the residuals' top d_c principal components, the SwiGLU's output at zero)
— from a random start, 32 minutes on two cores left a codec with 2.8× the error of that closed
form (docs/results.md, "DeltaKV's codec from the residuals' principal components").

In the slot pool this is two tiers whose blocks are one token of one layer, an entry per KV head
(entry id = block · H + head, so the slot tables stay per head):

* ``DeltaKVReferences``: the reference tokens' keys (as read: post-RoPE, so they come back
  exactly) and values, and each one's position.
* ``DeltaKVCodec``: per coded token its code (in the model's dtype, or 4-bit per token with a
  16-bit zero point and scale), the block ids of its references, its position and its layer.
  Each coded token holds its references (a reference is freed only when no table entry and no
  code points at it). Decoding reconstructs each token once for all its heads.

``code_rows`` moves a layer's plain entries into these tiers (the session calls it after the prefill
and whenever ``chunk`` new tokens have arrived, keeping the ``recent`` newest raw). Every head of a
row must hold the same tokens (DeltaKV evicts nothing; evicting methods cannot use it as a codec).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_kernels
from .codecs import Fields, KiviCodec, PlainCodec, field_bytes, pack, unpack
from .slots import ENTRY_MASK, TIER_SHIFT
from .view import DeltaKVBlocks


# ----- RoPE and token vectors ------------------------------------------------------------------
def rope(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Keys [..., n, d] rotated to ``positions`` [..., n] (transformers' rotate-half RoPE), float32;
    ``inverse`` undoes it."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(keys.device)  # [..., n, d/2]
    cos, sin = angles.cos(), angles.sin()
    first, second = keys.float().chunk(2, -1)
    if inverse:  # the products of k·cos ∓ rotate_half(k)·sin, half by half (bit for bit the same)
        return torch.cat([first * cos + second * sin, second * cos - first * sin], -1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], -1)


def token_vectors(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x = concat(pre-RoPE keys over heads, values over heads) [..., n, 2·H·d] float32 of keys/values
    [..., H, n, d] (post-RoPE, as read) at ``positions`` [..., n]."""
    pre = rope(keys, positions.unsqueeze(-2), inv_freq, inverse=True)
    return torch.cat([pre.transpose(-3, -2).flatten(-2), values.float().transpose(-3, -2).flatten(-2)], -1)


def split_vectors(x: torch.Tensor, positions: torch.Tensor, heads: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``token_vectors``: keys (RoPE re-applied) and values [..., H, n, d], float32."""
    *lead, n, width = x.shape
    d = width // (2 * heads)
    keys, values = x.view(*lead, n, 2, heads, d).unbind(-3)
    return rope(keys.transpose(-3, -2), positions.unsqueeze(-2), inv_freq), values.transpose(-3, -2)


def reference_mask(positions: torch.Tensor, stride: int, sinks: int) -> torch.Tensor:
    """Which tokens are references: every ``stride``-th position and the first ``sinks``."""
    return (positions % stride == 0) | (positions < sinks)


def nearest_references(x: torch.Tensor, refs: torch.Tensor, ref_positions: torch.Tensor, positions: torch.Tensor,
                       k: int) -> torch.Tensor:
    """For each token x [n, D] at ``positions`` [n], the indices [n, k] of its k nearest references
    refs [r, D] (L2) among those at earlier positions; with fewer than k earlier ones, the nearest is
    repeated (encoding and decoding use the same list, so the mean stays consistent). Every token
    needs at least one earlier reference."""
    distance = (x.float().pow(2).sum(-1, keepdim=True) - 2 * x.float() @ refs.float().T + refs.float().pow(2).sum(-1))
    earlier = ref_positions[None, :] < positions[:, None]
    if not bool(earlier.any(-1).all()):
        raise ValueError("DeltaKV: a coded token has no earlier reference (the first token is always one)")
    distance = distance.masked_fill(~earlier, float("inf"))
    count = min(k, refs.shape[0])
    nearest = distance.topk(count, dim=-1, largest=False).indices
    available = earlier.sum(-1, keepdim=True)
    slot = torch.arange(count, device=x.device)
    nearest = torch.where(slot < available, nearest, nearest[:, :1])
    return nearest if count == k else torch.cat([nearest, nearest[:, :1].expand(-1, k - count)], -1)


# ----- the learned part ------------------------------------------------------------------------
class DeltaKVWeights(nn.Module):
    """Per layer: the compressor f_c(x) = x̃W_lin + (SiLU(x̃W₁) ⊙ x̃W₂)W₃ and the decoder f_d(z) = zW_d (x̃ = x / scale,
    the decoder's output scaled back), and the codec's geometry (stride, top-k, sinks, RoPE frequencies).

    Args:
        num_layers, num_kv_heads, head_dim: of the model.
        hidden: the compressor's width d_h (0: no SwiGLU path, a linear codec).
        code_width: d_c (default a quarter of 2·H·d, the paper's).
        inv_freq: the model's RoPE frequencies [d/2].
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, inv_freq: torch.Tensor, *, hidden: int = 128,
                 code_width: int | None = None, stride: int = 10, top_k: int = 4, sinks: int = 4, seed: int = 0):
        super().__init__()
        width = 2 * num_kv_heads * head_dim
        code_width = code_width or width // 4
        gen = torch.Generator().manual_seed(seed)

        def init(*shape):
            return nn.Parameter(torch.randn(num_layers, *shape, generator=gen) / math.sqrt(shape[0]))

        self.w_gate, self.w_up, self.w_down = init(width, hidden), init(width, hidden), init(hidden, code_width)
        self.w_linear = nn.Parameter(torch.zeros(num_layers, width, code_width))
        self.decoder = nn.Parameter(torch.zeros(num_layers, code_width, width))  # x̂ = m at first: training starts there
        self.register_buffer("scale", torch.ones(num_layers, width))
        self.register_buffer("inv_freq", inv_freq.detach().float().clone())
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.stride, self.top_k, self.sinks = stride, top_k, sinks
        self.about: dict = {}  # what a loaded checkpoint's config.json says beside the dims (full_layers, training)

    @property
    def dims(self) -> dict:
        return {"num_layers": self.w_gate.shape[0], "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "hidden": self.w_gate.shape[2], "code_width": self.w_down.shape[2], "stride": self.stride,
                "top_k": self.top_k, "sinks": self.sinks}

    def compress(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        x = x.float() / self.scale[layer]
        linear = x @ self.w_linear[layer]
        if self.w_gate.shape[2] == 0:  # a linear codec (hidden width 0): no SwiGLU path
            return linear
        return linear + (F.silu(x @ self.w_gate[layer]) * (x @ self.w_up[layer])) @ self.w_down[layer]

    def code(self, layer: int, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """z = f_c(x) − f_c(m) [..., d_c]."""
        return self.compress(layer, x) - self.compress(layer, mean)

    def reconstruct(self, layer: int, z: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """x̂ = f_d(z) + m [..., 2·H·d] float32."""
        return (z.float() @ self.decoder[layer]) * self.scale[layer] + mean.float()

    def fit_scale(self, layer: int, x: torch.Tensor) -> None:
        """Fix a layer's input scale to the per-channel standard deviation of x [..., 2·H·d]."""
        with torch.no_grad():
            self.scale[layer] = x.detach().float().reshape(-1, x.shape[-1]).std(0).clamp_min(1e-3)

    def fit_principal(self, layer: int, residuals: torch.Tensor) -> None:
        """Start a layer at the best linear code of ``residuals`` (x − m)/scale [n, 2·H·d]: the linear path
        projects on their top d_c principal components, each divided by its spread, the decoder maps back
        (x̂ − m is the projection of x − m), the SwiGLU path's output starts at zero (its inner weights stay
        random to learn from)."""
        r = residuals.detach().float().reshape(-1, residuals.shape[-1])
        eigenvalues, vectors = torch.linalg.eigh(r.T @ r / max(1, r.shape[0]))
        top = eigenvalues.argsort(descending=True)[: self.w_linear.shape[2]]
        basis, spread = vectors[:, top], eigenvalues[top].clamp_min(1e-8).sqrt()  # [2Hd, d_c], [d_c]
        with torch.no_grad():  # whitened: every code channel has unit spread, as a per-token 4-bit grid wants
            self.w_linear[layer], self.decoder[layer], self.w_down[layer] = basis / spread, spread[:, None] * basis.T, 0.0

    MATRICES = ("w_gate", "w_up", "w_down", "w_linear", "decoder")

    def save(self, directory: Path | str, **about) -> None:
        """``model.safetensors`` + ``config.json``. The matrices are stored in 8 bits with a float16 scale per
        output channel (|error| ≤ half a step; a shipped codec stays under 5 MB), the input scales in
        float16, the RoPE frequencies in float32."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, value in self.state_dict().items():
            if name in self.MATRICES and value.numel() == 0:  # the SwiGLU path of a linear codec
                continue
            if name in self.MATRICES:
                tensors[name], step = columns_in_8_bits(value)
                tensors[f"{name}.step"] = step.half()
            else:
                tensors[name] = value if name == "inv_freq" else value.half()
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps({"method": "deltakv", **self.dims, **about}, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path | str) -> DeltaKVWeights:
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / "model.safetensors").is_file() or not (directory / "config.json").is_file():
            raise FileNotFoundError(f"deltakv checkpoint {directory}: needs model.safetensors and config.json "
                                    "(`kvcompress train deltakv --out DIR` writes them)")
        c = json.loads((directory / "config.json").read_text())
        stored = load_file(str(directory / "model.safetensors"))
        tensors = {k: v.float() * stored[f"{k}.step"].float() if f"{k}.step" in stored else v.float()
                   for k, v in stored.items() if not k.endswith(".step")}
        weights = cls(c["num_layers"], c["num_kv_heads"], c["head_dim"], tensors["inv_freq"], hidden=c["hidden"],
                      code_width=c["code_width"], stride=c["stride"], top_k=c["top_k"], sinks=c["sinks"])
        for name in cls.MATRICES:  # absent: a linear codec's empty SwiGLU path, or a codec saved before the
            tensors.setdefault(name, torch.zeros_like(getattr(weights, name)))  # linear path (f_c without it)
        weights.load_state_dict(tensors)
        weights.about = c
        return weights.eval().requires_grad_(False)


def columns_in_8_bits(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Matrices [L, rows, columns] as a checkpoint stores them: int8 codes and a step per output column [L, 1, columns]
    (the largest magnitude over 127, a float16 number), codes · step within half a step of the matrix."""
    step = (matrix.abs().amax(1, keepdim=True) / 127).half().float().clamp_min(1e-12)
    return torch.round(matrix / step).clamp(-127, 127).to(torch.int8), step


CODE_QUANTIZER = KiviCodec(4, 1, torch.float16)  # 4-bit codes: per token, a float16 zero point and scale


def four_bit(z: torch.Tensor) -> torch.Tensor:
    """Codes z [..., d_c] rounded as the store keeps them in 4 bits (per token, a float16 zero point and
    scale), read back as float32."""
    codes, zero, scale = CODE_QUANTIZER.quantize(z.float().reshape(-1, z.shape[-1]), dim=1)
    return torch.addcmul(zero.float(), codes.float(), scale.float()).reshape(z.shape)


# ----- the two pool tiers ----------------------------------------------------------------------
class DeltaKVReferences:
    """Reference tokens, raw: a block is one token of one layer (keys as read, values), an entry per KV head."""

    def __init__(self, num_kv_heads: int):
        self.block_size = num_kv_heads
        self.name = "deltakv-references"
        self.key = f"deltakv-references:{num_kv_heads}"

    def fields(self, head_dim: int, dtype: torch.dtype) -> Fields:
        h = self.block_size
        return {"keys": ((h, head_dim), dtype), "values": ((h, head_dim), dtype), "position": ((), torch.int32)}

    def decode(self, arrays, entries):
        d = arrays["keys"].shape[-1]
        return arrays["keys"].view(-1, d).index_select(0, entries), arrays["values"].view(-1, d).index_select(0, entries)


class DeltaKVCodec:
    """Coded tokens (see the module docstring).

    Args:
        weights: the trained compressor and decoder.
        bits: None keeps codes in the model's dtype; 4 quantizes each token's code to 4 bits.
        full_layers: layers left uncoded (the paper's hybrid layers).
        chunk: new tokens between two coding passes while decoding.
    """

    name = "deltakv"

    def __init__(self, weights: DeltaKVWeights, bits: int | None = None, full_layers: tuple[int, ...] = (), chunk: int = 32):
        if bits not in (None, 4):
            raise ValueError(f"deltakv keeps codes in the model's dtype (bits=None) or in 4 bits, got bits={bits!r}")
        self.weights, self.bits, self.full_layers, self.chunk = weights, bits, frozenset(full_layers), chunk
        self.block_size = weights.num_kv_heads
        self.key = f"deltakv:{id(weights)}:{bits}:{sorted(self.full_layers)}:{chunk}"
        self.references: object | None = None  # the reference tier's pool (``attach``)
        self.reference_tier = 0
        self.rotary = torch.empty(0, weights.head_dim)  # [P, d]: cos, then sin, of p · inv_freq for every position coded
        self._stored_keys: tuple[tuple[torch.Tensor, ...] | None] | None = None  # (stored_keys(),) once made

    def codes_layer(self, layer: int) -> bool:
        return layer not in self.full_layers

    def attach(self, pool) -> None:
        """Called by the pool when this codec's tier is made: the reference tier beside it."""
        self.reference_tier = pool.tier(DeltaKVReferences(self.block_size))
        self.references = pool.tiers[self.reference_tier - 1]

    def fields(self, head_dim: int, dtype: torch.dtype) -> Fields:
        width = self.weights.dims["code_width"]
        code = {"code": ((width,), dtype)} if self.bits is None else {
            "code": ((width // 2,), torch.uint8), "code_zero": ((1,), torch.float16), "code_scale": ((1,), torch.float16)}
        return {**code, "refs": ((self.weights.top_k,), torch.int32), "position": ((), torch.int32), "layer": ((), torch.int16)}

    def entry_bytes(self, head_dim: int, dtype: torch.dtype) -> float:
        """Per entry: a coded layer's token is a reference every ``stride`` positions (raw) and a code otherwise,
        each shared by the token's H entries; the layers left uncoded hold plain slots."""
        w, h = self.weights, self.block_size
        coded = ((1 - 1 / w.stride) * field_bytes(self.fields(head_dim, dtype))
                 + field_bytes(DeltaKVReferences(h).fields(head_dim, dtype)) / w.stride) / h
        share = len(self.full_layers) / w.dims["num_layers"]
        return (1 - share) * coded + share * PlainCodec().entry_bytes(head_dim, dtype)

    def dependencies(self, arrays, blocks: torch.Tensor) -> torch.Tensor:
        """Entry ids of the references freed code blocks held (one per reference listed)."""
        refs = arrays["refs"].index_select(0, blocks.to(arrays["refs"].device)).reshape(-1).long().cpu()
        return (self.reference_tier << TIER_SHIFT) | (refs * self.block_size)

    # ----- reading --------------------------------------------------------------------------
    def in_place(self, pool, tier: int):
        """How a decoding read reads this tier and its references where they live (``read/paged.py``'s compiled read:
        4-bit codes on the CPU), or None (the read gathers rebuilt entries instead)."""
        if self.bits != 4 or pool.arrays["keys"].device.type != "cpu":
            return None
        return {tier, self.reference_tier}, lambda: DeltaKVBlocks(tier, self.reference_tier, self, pool.tiers[tier - 1].arrays,
                                                                  self.references.arrays)

    def stored_keys(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The decoder's key columns as a checkpoint stores them, when they are exactly that (a loaded checkpoint's are)
        and d_c is a multiple of 4: int8 codes with four code channels together [L, d_c / 4, H·d, 4], each column's step
        and its codes' sum [L, H·d] float32, for the compiled read's integer product (``csrc/deltakv_rebuild.cpp``'s
        ``key_product``); else None. Made on first use: the decoder a codec reads with does not change."""
        if self._stored_keys is None:
            keys = self.weights.decoder[:, :, : self.weights.decoder.shape[2] // 2]
            codes, step = columns_in_8_bits(keys)
            layers, width, columns = codes.shape
            exact = width % 4 == 0 and torch.equal(codes.float() * step, keys)
            quads = codes.view(layers, width // 4, 4, columns).transpose(2, 3).contiguous() if exact else None
            self._stored_keys = ((quads, step[:, 0].contiguous(), codes.float().sum(1).contiguous()) if exact else None,)
        return self._stored_keys[0]

    def decode(self, arrays, entries):
        """Keys and values [n, d] float32 of ``entries`` (block · H + head): 4-bit codes on the CPU through the compiled
        pass (``csrc/deltakv_rebuild.cpp``: each token rebuilt once, in one matrix product per layer), else
        ``decode_torch``."""
        kernel = cpu_kernels() if entries.device.type == "cpu" and self.bits == 4 else None
        if kernel is None:
            return self.decode_torch(arrays, entries)
        w, references = self.weights, self.references.arrays
        keys, values = kernel.deltakv_rebuild(
            entries.long().contiguous(), arrays["code"], arrays["code_zero"], arrays["code_scale"], arrays["refs"], arrays["position"],
            arrays["layer"], references["keys"], references["values"], references["position"], w.decoder, w.scale, self.rotary)
        return keys, values

    def decode_torch(self, arrays, entries):
        """``decode`` in plain PyTorch: the reference of the compiled pass."""
        h = self.block_size
        blocks, heads = entries // h, entries % h
        unique, inverse = torch.unique(blocks, return_inverse=True)
        keys, values = self.reconstruct(arrays, unique)  # [u, H, d] each
        return keys[inverse, heads], values[inverse, heads]

    def cover_positions(self, last: int) -> None:
        """Grow the rotary table (at least doubling) to hold position ``last``: RoPE's angles as ``rope`` takes them."""
        if last < self.rotary.shape[0]:
            return
        angles = torch.arange(max(last + 1, 2 * self.rotary.shape[0], 1024), dtype=torch.float32)[:, None] * self.weights.inv_freq.cpu()
        self.rotary = torch.cat([angles.cos(), angles.sin()], -1).to(self.rotary.device)

    def reconstruct(self, arrays, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (RoPE applied) and values [n, H, d] float32 of coded tokens ``blocks`` [n], in plain PyTorch."""
        w = self.weights
        refs = arrays["refs"].index_select(0, blocks).long()  # [n, k]
        shared, inverse = torch.unique(refs, return_inverse=True)  # a reference serves many tokens: un-rotate it once
        mean = F.embedding_bag(inverse, self.reference_vectors(shared), mode="mean")  # [n, 2Hd]
        z = self.codes(arrays, blocks)
        layers = arrays["layer"].index_select(0, blocks).long()
        x = torch.empty_like(mean)
        for layer in torch.unique(layers).tolist():
            where = (layers == layer).nonzero().squeeze(1)
            x[where] = w.reconstruct(layer, z.index_select(0, where), mean.index_select(0, where))
        positions = arrays["position"].index_select(0, blocks)
        keys, values = split_vectors(x[:, None], positions[:, None], self.block_size, w.inv_freq)  # [n, H, 1, d]
        return keys[:, :, 0], values[:, :, 0]

    def reference_vectors(self, blocks: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE token vectors [n, 2·H·d] float32 of reference ``blocks`` [n]."""
        arrays = self.references.arrays
        keys, values = arrays["keys"].index_select(0, blocks), arrays["values"].index_select(0, blocks)  # [n, H, d]
        positions = arrays["position"].index_select(0, blocks)
        return token_vectors(keys[:, :, None], values[:, :, None], positions[:, None], self.weights.inv_freq)[:, 0]

    def codes(self, arrays, blocks: torch.Tensor) -> torch.Tensor:
        """Codes z [n, d_c] float32."""
        if self.bits is None:
            return arrays["code"].index_select(0, blocks).float()
        codes = unpack(arrays["code"].index_select(0, blocks), 4, torch.float32)
        return torch.addcmul(arrays["code_zero"].index_select(0, blocks).float(), codes, arrays["code_scale"].index_select(0, blocks).float())

    def code_fields(self, z: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        if self.bits is None:
            return {"code": z.to(dtype)}
        codes, zero, scale = CODE_QUANTIZER.quantize(z.float(), dim=1)
        return {"code": pack(codes, 4), "code_zero": zero, "code_scale": scale}

    # ----- coding ---------------------------------------------------------------------------
    def code_rows(self, table, pool, tier: int, recent: int, rows: slice, layer: int) -> int:
        """Code the plain entries of ``rows`` (one layer's batch rows of ``table``) but each row's ``recent``
        newest: references into the reference tier, the others as codes. Returns the entries coded."""
        if not self.codes_layer(layer):
            return 0
        coded = 0
        for row in range(*rows.indices(table.num_rows)):
            lengths = table.lengths[row]
            if bool((lengths != lengths[0]).any()):
                raise ValueError("deltakv codes a token over every KV head at once: every head must hold the same "
                                 "tokens (it cannot store what a per-head eviction keeps)")
            coded += self._code_row(table, pool, tier, row, int(lengths[0]) - recent, layer)
        return coded

    def _code_row(self, table, pool, tier: int, row: int, limit: int, layer: int) -> int:
        if limit <= 0:
            return 0
        ids = table.ids[row, :, :limit]  # [H, n, 2], a view: written below
        slots, positions = ids[..., 0], ids[0, :, 1].long()
        columns = ((slots[0] >> TIER_SHIFT) == 0).nonzero().squeeze(1)
        if columns.numel() == 0:
            return 0
        old = slots[:, columns]  # [H, m]
        keys, values = pool.gather(old)  # [H, m, d]
        pos = positions[columns]
        self.cover_positions(int(pos.max()))
        w, h = self.weights, self.block_size
        x = token_vectors(keys, values, pos, w.inv_freq)  # [m, 2Hd]
        held = ((slots[0] >> TIER_SHIFT) == self.reference_tier).nonzero().squeeze(1)
        held_blocks = (slots[0, held].long() & ENTRY_MASK) // h
        is_ref = reference_mask(pos, w.stride, w.sinks)
        known = torch.cat([positions[held], pos[is_ref]])
        is_ref |= pos <= (known.min() if known.numel() else pos.min())  # a token with no earlier reference is one
        new_blocks = self.references.allocate(int(is_ref.sum()), holders=h)
        for name, rows in (("keys", keys[:, is_ref].transpose(0, 1)), ("values", values[:, is_ref].transpose(0, 1)),
                           ("position", pos[is_ref].to(torch.int32))):
            self.references.arrays[name].index_copy_(0, new_blocks, rows.to(self.references.arrays[name].dtype))
        new_ids = torch.empty(h, columns.numel(), dtype=torch.int32, device=slots.device)
        heads = torch.arange(h, device=slots.device)[:, None]
        new_ids[:, is_ref] = ((self.reference_tier << TIER_SHIFT) | (new_blocks[None, :] * h + heads)).to(torch.int32)
        coding = ~is_ref
        if bool(coding.any()):
            candidates = torch.cat([held_blocks, new_blocks])
            candidate_x = torch.cat([self.reference_vectors(held_blocks), x[is_ref]])
            candidate_pos = torch.cat([positions[held], pos[is_ref]])
            nearest = nearest_references(x[coding], candidate_x, candidate_pos, pos[coding], w.top_k)  # [c, k]
            mean = candidate_x[nearest].mean(1)
            with torch.no_grad():
                z = w.code(layer, x[coding], mean)
            refs = candidates[nearest]
            store = pool.tiers[tier - 1]
            blocks = store.allocate(z.shape[0], holders=h)
            fields = {**self.code_fields(z, store.dtype), "refs": refs.to(torch.int32), "position": pos[coding].to(torch.int32),
                      "layer": torch.full_like(blocks, layer, dtype=torch.int16)}
            for name, rows in fields.items():
                store.arrays[name].index_copy_(0, blocks, rows)
            pool.share((self.reference_tier << TIER_SHIFT) | (refs.reshape(-1).cpu() * h))
            new_ids[:, coding] = ((tier << TIER_SHIFT) | (blocks[None, :] * h + heads)).to(torch.int32)
        slots[:, columns] = new_ids
        pool.release(old)
        return old.numel()


__all__ = ["DeltaKVCodec", "DeltaKVReferences", "DeltaKVWeights", "columns_in_8_bits", "four_bit", "nearest_references", "reference_mask", "rope",
           "split_vectors", "token_vectors"]
