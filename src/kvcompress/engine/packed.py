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


class PackedForward:
    """``nn.Linear.forward`` over a oneDNN-packed copy of the module's weight (made once, here)."""

    def __init__(self, module: nn.Linear):
        with torch.no_grad():
            self.weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), ROWS_HINT)
        self.bias = None if module.bias is None else module.bias.detach()
        self.nbytes = module.weight.numel() * module.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Give every linear layer of ``model`` that can take it (``can_pack``) a forward over a packed copy of its
    weight (once: a layer already packed is left as it is). Returns the bytes of the copies made."""
    made = 0
    for module in model.modules():
        if can_pack(module) and not isinstance(module.__dict__.get("forward"), PackedForward):
            module.forward = PackedForward(module)
            made += module.forward.nbytes
    return made


def unpack_linears(model: nn.Module) -> None:
    """Back to transformers' own forward for every linear layer of ``model`` (the packed copies are let go)."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), PackedForward):
            del module.forward


def packed_bytes(model: nn.Module) -> int:
    """Bytes the packed copies of ``model``'s linear weights hold."""
    return sum(module.forward.nbytes for module in model.modules() if isinstance(module.__dict__.get("forward"), PackedForward))


__all__ = ["can_pack", "pack_linears", "packed_bytes", "unpack_linears"]
