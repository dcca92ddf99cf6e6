"""The engine's oneDNN-packed linear layers: the same products as ``F.linear`` (to float32 rounding); the engine's
decoder holds one packed copy of every linear weight and leaves the model's own modules as they were."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from common import tiny_model
from kvcompress.engine.decoder import Decoder
from kvcompress.engine.packed import PackedLinear, can_pack, packed_or_own

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
        packed = packed_or_own(layer, pack=True)
        out = packed(x)
    assert isinstance(packed, PackedLinear) and packed_or_own(layer, pack=False) is layer
    assert out.shape == expected.shape and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance * float(expected.abs().max()), rtol=tolerance)


def test_the_decoder_packs_each_linear_weight_once_and_leaves_the_model_as_it_was():
    model = tiny_model(seed=2, layers=2)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids).logits
        assert Decoder(model, pack=True).nbytes == weight_bytes and Decoder(model, pack=False).nbytes == 0
        assert torch.equal(model(ids).logits, before)  # transformers' own products, as before
    assert all("forward" not in m.__dict__ and isinstance(m.weight, torch.nn.Parameter) for m in linears)
