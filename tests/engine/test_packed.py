"""The engine's oneDNN-packed linear layers: the same products as ``F.linear`` (to float32 rounding), once per layer,
undone on request; the engine's answers unchanged."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from common import tiny_model
from kvcompress.engine.packed import can_pack, pack_linears, packed_bytes, unpack_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.nn.Linear(2, 2)), reason="this torch build has no oneDNN packed linear")


@settings(max_examples=20, deadline=None)
@given(rows=st.sampled_from([1, 3, 8, 64]), lead=st.sampled_from([(), (2,)]), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_a_packed_linear_computes_what_f_linear_does(rows, lead, bias, dtype, seed):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(48, 80, bias=bias).to(dtype)
    x = torch.randn(*lead, rows, 48).to(dtype)
    with torch.no_grad():
        expected = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
        pack_linears(layer)
        out = layer(x)
    assert out.shape == expected.shape and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance * float(expected.abs().max()), rtol=tolerance)


def test_packing_is_done_once_counted_and_undone():
    model = tiny_model(seed=2, layers=2)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids).logits
        made = pack_linears(model)
        assert made == weight_bytes == packed_bytes(model) and pack_linears(model) == 0  # a second call packs nothing
        packed = model(ids).logits
        unpack_linears(model)
        assert packed_bytes(model) == 0 and torch.equal(model(ids).logits, before)
    torch.testing.assert_close(packed, before, atol=1e-4, rtol=1e-4)
    assert all(isinstance(m.weight, torch.nn.Parameter) for m in linears)  # the weights themselves untouched
