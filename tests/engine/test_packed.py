"""The engine's oneDNN-packed linear layers: the same products as ``F.linear`` (to float32 rounding); the engine's
decoder holds one packed copy of every linear weight and leaves the model's own modules as they were. Over a decoding
step's rows, the compiled ``linear_rows`` over the layers' own weights (float32, or bfloat16 rounded once); bfloat16 where
oneDNN has no products for it, a float32 product over the weights widened for the call."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from common import tiny_model
from kvcompress.engine.decoder import Decoder
from kvcompress.engine.packed import (FusedLinear, PackedLinear, can_pack, packed_or_own, packs, packs_bfloat16,
                                      rows_streamed, streamed_dtypes)
from kvcompress.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not can_pack(torch.nn.Linear(2, 2)), reason="this torch build has no oneDNN packed linear")


@settings(max_examples=20, deadline=None)
@given(rows=st.sampled_from([1, 3, 8, 16, 17, 64]), lead=st.sampled_from([(), (2,)]), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16] if packs_bfloat16() else [torch.float32]),
       width=st.sampled_from([48, 64]), seed=st.integers(0, 2**16))
def test_a_packed_linear_computes_what_f_linear_does(rows, lead, bias, dtype, width, seed):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(width, 80, bias=bias).to(dtype)
    x = torch.randn(*lead, rows, width).to(dtype)
    with torch.no_grad():
        expected = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
        packed = packed_or_own(layer, pack=True)
        out = packed(x)
    assert isinstance(packed, PackedLinear) and packed_or_own(layer, pack=False) is layer
    assert out.shape == expected.shape and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance * float(expected.abs().max()), rtol=tolerance)


def test_bfloat16_layers_are_not_copied_where_onednn_cannot_run_them(monkeypatch):
    """An AVX2-only CPU (AMD Zen 3) has no oneDNN bfloat16 products: no bfloat16 copy is made (reordering would raise);
    a step's few rows stream the weights where the kernels run bfloat16, more rows take a float32 product over the
    weights widened for the call; without the kernels the layers keep their own products. Float32 is still packed."""
    import kvcompress.engine.packed as packed

    monkeypatch.setattr(packed, "packs_bfloat16", lambda: False)
    torch.manual_seed(0)
    bf16, f32 = torch.nn.Linear(64, 8).to(torch.bfloat16), torch.nn.Linear(64, 8)
    assert not packs(torch.bfloat16) and isinstance(packed_or_own(f32, pack=True), PackedLinear)
    fused = FusedLinear([bf16, torch.nn.Linear(64, 4, bias=False).to(torch.bfloat16)], pack=True)
    if torch.bfloat16 not in streamed_dtypes():
        assert packed_or_own(bf16, pack=True) is bf16 and fused.packed is None and fused.nbytes == 0
        return
    assert fused.packed.weight is None and fused.nbytes == 0
    with torch.no_grad():
        for rows in (1, rows_streamed(torch.bfloat16) + 5):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            expected = torch.cat([F.linear(x.float(), m.weight.float(), None if m.bias is None else m.bias.float())
                                  for m in fused.modules], -1)
            torch.testing.assert_close(fused(x).float(), expected, atol=0.05, rtol=0.02)


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


RUNS = [] if cpu_kernels() is None else [getattr(torch, name) for name in cpu_kernels().linear_rows_dtypes()]
streams = pytest.mark.skipif(not RUNS, reason="linear_rows needs the CPU kernels and AVX512-BF16, or AVX2 and FMA")


@streams
@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(RUNS or [torch.float32]), rows=st.integers(1, 20), pieces=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       width=st.sampled_from([32, 40, 64, 576, 1536]), bias=st.booleans(), strided=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_rows_is_the_stacked_product_rounded_once(dtype, rows, pieces, width, bias, strided, seed):
    """``linear_rows`` over weights of any row counts (odd ones: a last row taken alone) and any rows of x (passes of
    four or eight, the last one short; rows contiguous or apart; widths that take the sixteen-channel float32 pass and
    widths that do not: 40, not a multiple of 16, and 1536, past its limit) against float64 sums of the same numbers: within
    float32's bound on a sum's rounding error where terms cancel, plus, in bfloat16, one rounding of the output (and equal
    to the exact sum rounded but where the sums' other order crosses a rounding boundary)."""
    assume(dtype != torch.bfloat16 or width % 32 == 0)  # bfloat16's dots take 32 channels a step
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width + 32 * strided, generator=gen).to(dtype)[:, :width]  # rows apart in memory, or not
    weights = [torch.randn(n, width, generator=gen).to(dtype) for n in pieces]
    b = torch.randn(sum(pieces), generator=gen).to(dtype) if bias else None
    out = cpu_kernels().linear_rows(x, weights, b)
    stacked = torch.cat(weights).double()
    exact = x.double() @ stacked.T + (b.double() if bias else 0.0)
    assert out.shape == (rows, sum(pieces)) and out.dtype == dtype
    sum_error = width * torch.finfo(torch.float32).eps * (x.double().abs() @ stacked.abs().T)
    rounding = torch.finfo(dtype).eps * exact.abs() if dtype == torch.bfloat16 else 0.0
    assert bool(((out.double() - exact).abs() <= rounding + sum_error).all())
    if dtype == torch.bfloat16:
        assert int((out != exact.to(dtype)).sum()) <= max(1, out.numel() // 20)


@pytest.mark.skipif(not streamed_dtypes(), reason="no product is streamed on this CPU")
@pytest.mark.parametrize("dtype", sorted(streamed_dtypes(), key=str))
def test_a_step_streams_the_layers_own_weights_and_more_rows_do_not(monkeypatch, dtype):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 24, bias=True).to(dtype), torch.nn.Linear(64, 9, bias=False).to(dtype)]
    fused = FusedLinear(layers, pack=True)
    assert fused.packed.own[0].data_ptr() == layers[0].weight.data_ptr()  # no copy for the streamed path
    calls = []
    real = cpu_kernels().linear_rows
    monkeypatch.setattr(fused.packed, "rows", type("Spy", (), {"linear_rows": lambda self, *a: calls.append(a[0].shape[0]) or real(*a)})())
    limit = rows_streamed(dtype)
    tolerance = 0.02 if dtype == torch.bfloat16 else 1e-5
    with torch.no_grad():
        for rows in (1, limit, limit + 1):
            x = torch.randn(rows, 64).to(dtype)
            expected = torch.cat([F.linear(x.float(), m.weight.float(), None if m.bias is None else m.bias.float()) for m in layers], -1)
            torch.testing.assert_close(fused(x).float(), expected, atol=2.5 * tolerance, rtol=tolerance)
    assert calls == [1, limit]


@streams
def test_linear_rows_refuses_what_it_cannot_take():
    kernels, dtype = cpu_kernels(), RUNS[0]
    x = torch.randn(2, 64).to(dtype)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(RuntimeError, match="multiple of"):
        kernels.linear_rows(torch.randn(2, 44).to(dtype), [torch.randn(4, 44).to(dtype)], None)
    with pytest.raises(RuntimeError, match="weights"):
        kernels.linear_rows(x, [torch.randn(4, 64).to(other)], None)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.linear_rows(x, [torch.randn(4, 64).to(dtype)], torch.randn(5).to(dtype))
    with pytest.raises(RuntimeError, match="x, a float32 or bfloat16"):
        kernels.linear_rows(torch.randn(2, 64).half(), [torch.randn(4, 64).half()], None)
