"""H2O: heavy hitters by accumulated attention plus recent tokens; eviction while decoding."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from common import kept_positions, random_layer
from kvcompress import get_method
from kvcompress.read import prompt_attention_with_sums


def reference_attention_sums(keys, queries, scaling, group):
    """Σ_i a_ij over all causal queries, mean over the GQA group: [B, H, L]."""
    batch, heads, length, _ = keys.shape
    q = queries.double().view(batch, heads, group, length, -1)
    logits = torch.einsum("bhgid,bhjd->bhgij", q, keys.double()) * scaling
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    return probs.sum(dim=3).mean(dim=2)


def _sums(layer, queries, chunk=64):
    """The sums the prefill records, with its tiling (``chunk`` queries at a time)."""
    keys, values = layer.view().keys, layer.view().values
    return prompt_attention_with_sums(queries, keys, values, layer.scaling, chunk=chunk)[1]


def test_attention_sums_match_reference():
    layer, context, queries, positions, _ = random_layer(batch=2, heads=2, group=2, length=40, seed=7)
    sums = _sums(layer, queries, chunk=7)
    ref = reference_attention_sums(layer.view().keys, queries, context.scaling, 2)
    assert torch.allclose(sums.double(), ref, atol=1e-4)


def test_prefill_records_the_sums_without_padding():
    """A left-padded row's sums are its own prompt's alone, laid out like its entries."""
    padded, _, queries, _, valid = random_layer(batch=2, length=40, seed=7, lengths=[40, 27], attention_sums=True)
    row = padded.observations["attention_sums"][1, :, :27]
    keys = padded.view().keys[1:, :, :27]
    ref = reference_attention_sums(keys, queries[1:, :, 13:], padded.scaling, 2)
    assert torch.allclose(row.double(), ref[0], atol=1e-4)


def test_keep_set_is_top_scores_plus_recent():
    layer, context, queries, positions, _ = random_layer(length=40, seed=8, attention_sums=True)
    sums = _sums(layer, queries)
    assert torch.allclose(layer.observations["attention_sums"], sums)
    layer.compress(get_method("h2o", budget=12, recent_ratio=0.5))
    scores = sums.view(1, 2, 40)
    for h, kept in enumerate(kept_positions(layer)[0]):
        heavy = torch.topk(scores[0, h, :34], 6).indices.tolist()
        assert kept == sorted(heavy + list(range(34, 40)))


def test_decoding_never_exceeds_budget_and_accumulates_scores():
    layer, context, queries, positions, _ = random_layer(length=30, seed=9, attention_sums=True)
    method = get_method("h2o", budget=10)
    layer.compress(method)
    for step in range(30, 60):
        layer.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.tensor([[step]]))
        length = layer.view().positions.shape[2]
        col_sums = torch.softmax(torch.randn(1, 2, 2, 1, length), dim=-1).sum(dim=3).mean(dim=2)
        before = layer.view().channels["h2o_score"].clone()
        layer.decode_step(method, col_sums)
        assert int(layer.head_lengths().max()) <= 10
        scores = layer.view().channels["h2o_score"]
        assert scores.shape == (1, 2, layer.view().positions.shape[2])
        assert float(scores.sum()) >= float(before.sum()) - 2.0  # one entry per head left
    assert all(59 in head and 55 in head for head in kept_positions(layer)[0])  # recent half kept


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), length=st.integers(1, 70), group=st.sampled_from([1, 2, 3]), chunk=st.integers(1, 33))
def test_one_pass_attention_and_sums_equal_float64_reference(seed, length, group, chunk):
    """The fused prefill pass: its output equals torch's causal SDPA and its sums the float64 oracle,
    whatever the chunking."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, 2, length, 8, generator=g), torch.randn(1, 2, length, 8, generator=g)
    queries = torch.randn(1, 2 * group, length, 8, generator=g) * 2
    out, sums = prompt_attention_with_sums(queries, keys, values, 0.35, chunk=chunk)
    expected = F.scaled_dot_product_attention(queries, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1),
                                              is_causal=True, scale=0.35)
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.allclose(sums.double(), reference_attention_sums(keys, queries, 0.35, group), atol=1e-4)


def test_padded_prompt_pass_matches_sdpa_on_real_rows_and_stays_finite():
    """Left padding through transformers' 4-D boolean mask: the real queries' outputs equal SDPA's, a
    padding query that sees nothing gets 0 (never NaN), and padding neither votes nor is voted for."""
    g = torch.Generator().manual_seed(3)
    n, short = 12, 7
    keys, values = torch.randn(2, 1, n, 4, generator=g), torch.randn(2, 1, n, 4, generator=g)
    queries = torch.randn(2, 2, n, 4, generator=g)
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, : n - short] = False
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    out, sums = prompt_attention_with_sums(queries, keys, values, 0.5, mask, token_valid=valid, chunk=5)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1, :, : n - short], torch.zeros(2, n - short, 4))
    expected = F.scaled_dot_product_attention(queries[1:, :, n - short:], keys[1:, :, n - short:].repeat_interleave(2, 1),
                                              values[1:, :, n - short:].repeat_interleave(2, 1), is_causal=True, scale=0.5)
    assert torch.allclose(out[1:, :, n - short:], expected, atol=1e-5)
    assert torch.equal(sums[1, :, : n - short], torch.zeros(1, n - short))
    ref = reference_attention_sums(keys[1:, :, n - short:], queries[1:, :, n - short:], 0.5, 2)
    assert torch.allclose(sums[1:, :, n - short:].double(), ref, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prompt_pass_in_half_precision_is_finite(dtype):
    g = torch.Generator().manual_seed(4)
    keys = (torch.randn(1, 2, 40, 8, generator=g) * 30).to(dtype)  # logits far beyond exp's float16 range
    out, sums = prompt_attention_with_sums((torch.randn(1, 4, 40, 8, generator=g) * 30).to(dtype), keys, keys, 1.0, chunk=16)
    assert out.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(sums).all()
    assert torch.allclose(sums.sum(-1), torch.full((1, 2), 40.0), atol=1e-3)  # every query's weights sum to one


def test_prompt_pass_under_autograd_equals_the_buffered_pass():
    """With gradients recorded the pass allocates per chunk instead of reusing one buffer: same numbers."""
    g = torch.Generator().manual_seed(5)
    queries, keys, values = (torch.randn(1, 4, 30, 8, generator=g), torch.randn(1, 2, 30, 8, generator=g),
                             torch.randn(1, 2, 30, 8, generator=g))
    out, sums = prompt_attention_with_sums(queries, keys, values, 0.4, chunk=7)
    tracked = queries.clone().requires_grad_(True)
    out_t, sums_t = prompt_attention_with_sums(tracked, keys, values, 0.4, chunk=7)
    out_t.sum().backward()
    assert torch.equal(out, out_t.detach()) and torch.equal(sums, sums_t.detach())
    assert tracked.grad is not None and torch.isfinite(tracked.grad).all()
