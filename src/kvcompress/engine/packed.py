"""The model's linear layers over weights oneDNN has reordered once, for the engine on the CPU.

PyTorch's float32 ``F.linear`` on the CPU calls MKL's sgemm, which on the AMD EPYC machines this project is
measured on runs far below the core's peak at the engine's shapes (a decoding step's few rows, a prompt's
hundreds); oneDNN over a weight reordered once into its blocked layout (``torch.ops.mkldnn``, what
PyTorch's own compiler uses for frozen CPU models) computes the same products about 2.4× faster there
(benchmarks/linears.py). ``pack_linears`` gives each ``nn.Linear`` of a model a forward over such a
copy; the weight itself stays as it was (tied embeddings, ``state_dict`` and the user's own uses of the
model see no change), so the packed copies cost one more set of the linear weights' bytes, reported
by the engine. Results differ from ``F.linear`` only by the order of float32 sums (~1e-6 relative).
The copy is made once: weights changed afterwards are not seen (the engine never changes them).
``FusedLinear`` stacks the weights of layers that take one input (a layer's query, key and value products;
its gate and up products) into one packed copy, for the engine's own decoder (``engine/decoder.py``).
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)
ROWS_HINT = 8  # rows oneDNN lays the weight out for (any number of rows may use it)


def can_pack(module: nn.Module) -> bool:
    """True for a plain ``nn.Linear`` on the CPU in float32 or bfloat16, where oneDNN's packed products are there."""
    mkldnn = torch.ops.mkldnn
    return (type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype in PACKED_DTYPES
            and torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


class PackedLinear:
    """``F.linear(x, weight, bias)`` over a oneDNN-packed copy of ``weight`` [out, in] (made once, here)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        with torch.no_grad():
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
        self.bias = None if bias is None else bias.detach()
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class FusedLinear:
    """Linear layers that take the same input, as one product: their outputs, in order. With ``pack`` (and
    ``can_pack`` for each) the product runs over a packed copy of their weights stacked (``nbytes``); otherwise
    each layer runs its own forward and nothing is copied."""

    def __init__(self, modules: list[nn.Linear], pack: bool):
        self.modules, self.sizes, self.packed = modules, [m.out_features for m in modules], None
        if pack and all(can_pack(m) for m in modules):
            weight = torch.cat([m.weight.detach() for m in modules])
            biases = [m.bias for m in modules]
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat([b.detach() if b is not None else weight.new_zeros(m.out_features) for b, m in zip(biases, modules)])
            self.packed = PackedLinear(weight, bias)
        self.nbytes = 0 if self.packed is None else self.packed.nbytes

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.packed is None:
            return [module(x) for module in self.modules]
        return list(self.packed(x).split(self.sizes, dim=-1))


def pack_linears(model: nn.Module) -> int:
    """Give every linear layer of ``model`` that can take it (``can_pack``) a forward over a packed copy of its
    weight (once: a layer already packed is left as it is). Returns the bytes of the copies made."""
    made = 0
    for module in model.modules():
        if can_pack(module) and not isinstance(module.__dict__.get("forward"), PackedLinear):
            module.forward = PackedLinear(module.weight, module.bias)
            made += module.forward.nbytes
    return made


def unpack_linears(model: nn.Module) -> None:
    """Back to transformers' own forward for every linear layer of ``model`` (the packed copies are let go)."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), PackedLinear):
            del module.forward


def packed_bytes(model: nn.Module) -> int:
    """Bytes the packed copies of ``model``'s linear weights hold."""
    return sum(module.forward.nbytes for module in model.modules() if isinstance(module.__dict__.get("forward"), PackedLinear))


__all__ = ["FusedLinear", "PackedLinear", "can_pack", "pack_linears", "packed_bytes", "unpack_linears"]
