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

A product over a decoding step's few rows (at most ``rows_streamed`` of its dtype on this CPU) runs the compiled ``linear_rows``
(``csrc/linear_rows.cpp``) where the CPU runs it: it reads the layers' own weights (a stack's pieces in turn, no copy),
prefetched far ahead, and is limited by the memory's read rate where oneDNN's products over the packed copy are not. In
bfloat16 with AVX512-BF16 (a decoding step of the 135M model in bfloat16, 8 rows: 19.2 → 16.6 ms); in float32 with AVX2
and FMA (on an AVX2-only Zen 3, a step's products over 8 rows: 43 → 34 ms, over 4 rows 35-40 → 25-32 ms,
benchmarks/linears.py; on an AVX-512 Zen 5 over 8 rows 17.7 → 15.6 ms, and a step's layers then each one compiled
call); in bfloat16 with AVX2 and FMA alone, each weight widened in registers. Its float32 sums run in
another order again. Where oneDNN has no bfloat16 products (an AVX2-only CPU), bfloat16 layers are not copied: more rows
than ``rows_streamed`` take a float32 product over their weights widened for the call (ATen's own bfloat16 product there
is ~7× slower than float32's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_kernels

PACKED_DTYPES = (torch.float32, torch.bfloat16)
ROWS_HINT = 8  # rows oneDNN lays the weight out for (any number of rows may use it)
# up to this many rows a product runs ``linear_rows`` (beyond, oneDNN's is as fast or faster): AVX512-BF16's bfloat16
# dots; float32 multiply-adds, on an AVX2-only CPU (a Zen 3: 20-30 % faster than oneDNN at 4-12 rows, level at 16) and
# on an AVX-512 one (a Zen 5, eight rows a pass: the engine's float32 SnapKV step at 8 rows 20.4-21.3 ms, against
# 23.5-25.9 with oneDNN's products in an earlier run; beyond 8 rows a second pass makes it slower: at 12 rows 35.1-35.5
# ms against oneDNN's 28.0-28.5, at 16 rows 37.9-40.4 against 32.7-33.8)
ROWS_STREAMED = {torch.bfloat16: 16, torch.float32: 12}
ROWS_STREAMED_AVX512 = {**ROWS_STREAMED, torch.float32: 8}


def rows_streamed(dtype: torch.dtype) -> int:
    """The most rows a product of ``dtype`` runs ``linear_rows`` for on this CPU."""
    return (ROWS_STREAMED if torch.backends.cpu.get_cpu_capability() == "AVX2" else ROWS_STREAMED_AVX512)[dtype]

def can_pack(module: nn.Module) -> bool:
    """True for a plain ``nn.Linear`` on the CPU in float32 or bfloat16 that the engine runs its own product for: over a
    oneDNN-packed copy of the weight (float32; bfloat16 where oneDNN runs it), over the weight streamed
    (``linear_rows``), or both."""
    if not (type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype in PACKED_DTYPES):
        return False
    return packs(module.weight.dtype) or module.weight.dtype in streamed_dtypes()


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed products run for ``dtype`` here: float32 where PyTorch has oneDNN, bfloat16 only on a CPU
    oneDNN runs it on (AVX512BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU such as AMD's Zen 3 has neither)."""
    mkldnn = torch.ops.mkldnn
    available = (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
                 and hasattr(mkldnn, "_linear_pointwise"))
    return available and (dtype != torch.bfloat16 or packs_bfloat16())


def packs_bfloat16() -> bool:
    """Whether oneDNN's packed bfloat16 products run on this CPU."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return supported is not None and bool(supported())


def streamed_dtypes() -> set[torch.dtype]:
    """The dtypes whose few-row products run ``linear_rows`` here: where it was measured faster than oneDNN's packed
    product (bfloat16 with AVX512-BF16's dots; float32, up to ``rows_streamed`` rows), or oneDNN has none (bfloat16 on
    an AVX2-only CPU). On an AVX-512 CPU without BF16 dots, bfloat16 keeps oneDNN's products (there they ran at
    20-35 GB/s; this kernel's AVX2 multiply-adds were not measured against them)."""
    kernels = cpu_kernels()
    if kernels is None:
        return set()
    runs = {getattr(torch, name) for name in kernels.linear_rows_dtypes()}
    chosen = set()
    if torch.bfloat16 in runs and (kernels.linear_rows_bf16_dots() or not packs_bfloat16()):
        chosen.add(torch.bfloat16)
    if torch.float32 in runs:
        chosen.add(torch.float32)
    return chosen


class PackedLinear:
    """``F.linear(x, W, bias)`` for ``W`` the ``weights`` [out_i, in] stacked (their outputs side by side): over at most
    ``ROWS_STREAMED`` rows the compiled ``linear_rows`` over the weights themselves where the CPU runs it; otherwise over a
    oneDNN-packed copy of the stack (made once, here: ``nbytes``), or, where oneDNN has none for the dtype (bfloat16 on
    an AVX2-only CPU), a float32 product over the weights widened for the call."""

    def __init__(self, weights: list[torch.Tensor], bias: torch.Tensor | None):
        self.own = [weight.detach() for weight in weights]
        self.bias = None if bias is None else bias.detach()
        dtype = self.own[0].dtype
        self.weight, self.nbytes = None, 0
        if packs(dtype):
            with torch.no_grad():
                stacked = self.own[0] if len(self.own) == 1 else torch.cat(self.own)
                self.weight = torch.ops.mkldnn._reorder_linear_weight(stacked, ROWS_HINT)
            self.nbytes = stacked.numel() * stacked.element_size()
        streams = (dtype in streamed_dtypes() and self.own[0].shape[1] % 32 == 0 and all(w.is_contiguous() for w in self.own))
        self.rows, self.rows_streamed = (cpu_kernels(), rows_streamed(dtype)) if streams else (None, 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows is not None and x.dim() == 2 and x.shape[0] <= self.rows_streamed and x.dtype == self.own[0].dtype:
            return self.rows.linear_rows(x, self.own, self.bias)
        if self.weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        weight = torch.cat(self.own) if len(self.own) > 1 else self.own[0]  # widened (a copy) for the call
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), weight.float(), bias).to(x.dtype)


class FusedLinear:
    """Linear layers that take the same input, as one product: their outputs side by side, one tensor [..., Σ out].
    With ``pack`` (and ``can_pack`` for each) the product is a ``PackedLinear`` over their weights (a packed copy of them
    stacked: ``nbytes``, where oneDNN packs the dtype); otherwise each layer runs its own forward and nothing is copied."""

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
    """The layer's ``PackedLinear`` where ``pack`` and ``can_pack``; else the layer itself."""
    return PackedLinear([module.weight], module.bias) if pack and can_pack(module) else module


def copy_bytes(product: PackedLinear | FusedLinear | nn.Module) -> int:
    """Bytes of the packed copy behind a product (0 for a module running its own forward)."""
    return product.nbytes if isinstance(product, (PackedLinear, FusedLinear)) else 0


__all__ = ["FusedLinear", "PackedLinear", "can_pack", "copy_bytes", "packed_or_own", "packs", "packs_bfloat16", "rows_streamed",
           "streamed_dtypes"]
