"""The model's linear layers over weights oneDNN has reordered once, for the engine on the CPU.

PyTorch's float32 ``F.linear`` on the CPU calls MKL's sgemm, which on the AMD EPYC machines this project is
measured on runs far below the core's peak at the engine's shapes (a decoding step's few rows, a prompt's
hundreds); oneDNN over a weight reordered once into its blocked layout (``torch.ops.mkldnn``, what
PyTorch's own compiler uses for frozen CPU models) computes the same products about 2.4× faster there
(benchmarks/linears.py). The engine's decoder (``engine/decoder.py``) runs each linear layer over such a copy
(``packed_or_own``), and the layers that take one input as one product over their weights stacked
(``FusedLinear``: a layer's query, key and value products; its gate and up products). The model's own modules
are left as they are (tied embeddings, ``state_dict`` and the user's own forwards see transformers' products), so
the copies cost one more set of the linear weights' bytes, reported by the engine. Results differ from
``F.linear`` only by the order of float32 sums (~1e-6 relative). The copies are made once: weights changed
afterwards are not seen (the engine never changes them).

In bfloat16, a product over a decoding step's few rows (at most ``ROWS_STREAMED``) runs the compiled ``linear_rows``
(``csrc/linear_rows.cpp``) where the CPU has AVX512-BF16: it reads the layers' own weights (a stack's pieces in turn,
no copy), prefetched far ahead, and is limited by the memory's read rate where oneDNN's products over the packed copy
are not (a decoding step of the 135M model in bfloat16, 8 rows: 19.2 → 16.6 ms). Its float32 sums run in another
order again.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import cpu_kernels

PACKED_DTYPES = (torch.float32, torch.bfloat16)
ROWS_HINT = 8  # rows oneDNN lays the weight out for (any number of rows may use it)
ROWS_STREAMED = 16  # up to this many rows a bfloat16 product runs ``linear_rows`` (beyond, oneDNN's is as fast or faster)


def can_pack(module: nn.Module) -> bool:
    """True for a plain ``nn.Linear`` on the CPU in float32 or bfloat16, where oneDNN's packed products are there: in
    bfloat16 only on a CPU oneDNN runs them on (AVX512BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU such as AMD's Zen 3
    has neither, and its bfloat16 layers keep their own products)."""
    mkldnn = torch.ops.mkldnn
    return (type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype in PACKED_DTYPES
            and torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise")
            and (module.weight.dtype != torch.bfloat16 or packs_bfloat16()))


def packs_bfloat16() -> bool:
    """Whether oneDNN's packed bfloat16 products run on this CPU."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return supported is not None and bool(supported())


class PackedLinear:
    """``F.linear(x, W, bias)`` for ``W`` the ``weights`` [out_i, in] stacked (their outputs side by side), over a
    oneDNN-packed copy of the stack (made once, here), or, in bfloat16 over at most ``ROWS_STREAMED`` rows, the
    compiled ``linear_rows`` over the weights themselves where the CPU runs it."""

    def __init__(self, weights: list[torch.Tensor], bias: torch.Tensor | None):
        own = [weight.detach() for weight in weights]
        with torch.no_grad():
            stacked = own[0] if len(own) == 1 else torch.cat(own)
            self.weight = torch.ops.mkldnn._reorder_linear_weight(stacked, ROWS_HINT)
        self.bias = None if bias is None else bias.detach()
        self.nbytes = stacked.numel() * stacked.element_size()
        kernels = cpu_kernels() if stacked.dtype == torch.bfloat16 else None
        streams = (kernels is not None and kernels.linear_rows_available() and stacked.shape[1] % 32 == 0
                   and all(w.is_contiguous() for w in own))
        self.rows, self.own = (kernels, own) if streams else (None, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows is not None and x.dim() == 2 and x.shape[0] <= ROWS_STREAMED and x.dtype == torch.bfloat16:
            return self.rows.linear_rows(x, self.own, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class FusedLinear:
    """Linear layers that take the same input, as one product: their outputs side by side, one tensor [..., Σ out].
    With ``pack`` (and ``can_pack`` for each) the product runs over a packed copy of their weights stacked
    (``nbytes``); otherwise each layer runs its own forward and nothing is copied."""

    def __init__(self, modules: list[nn.Linear], pack: bool):
        self.modules, self.packed = modules, None
        if pack and all(can_pack(m) for m in modules):
            biases = [m.bias for m in modules]
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat([b.detach() if b is not None else m.weight.new_zeros(m.out_features) for b, m in zip(biases, modules)])
            self.packed = PackedLinear([m.weight for m in modules], bias)
        self.nbytes = 0 if self.packed is None else self.packed.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([module(x) for module in self.modules], dim=-1) if self.packed is None else self.packed(x)


def packed_or_own(module: nn.Linear, pack: bool) -> PackedLinear | nn.Linear:
    """The layer's product over a packed copy of its weight where ``pack`` and ``can_pack``; else the layer itself."""
    return PackedLinear([module.weight], module.bias) if pack and can_pack(module) else module


def copy_bytes(product: PackedLinear | FusedLinear | nn.Module) -> int:
    """Bytes of the packed copy behind a product (0 for a module running its own forward)."""
    return product.nbytes if isinstance(product, (PackedLinear, FusedLinear)) else 0


__all__ = ["FusedLinear", "PackedLinear", "can_pack", "copy_bytes", "packed_or_own"]
