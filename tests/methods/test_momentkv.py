"""MomentKV: running moments, the corrected read, moment-informed eviction, numerics."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common import kept_positions, random_layer
from kvcompress import get_method
from kvcompress.methods.momentkv import MOMENTS, Moments, moment_floats_per_head
from kvcompress.kernels import cpu_kernels
from kvcompress.read import attend_reference, read
from kvcompress.read.sdpa import merge_summary, merge_summary_torch
from kvcompress.store.slots import RowSummaries
from kvcompress.store.view import KVView


def _view(keys, values, positions, summary=None):
    """A view over entries [B, H, L, d] at positions [B, L]."""
    b, h, length, _ = keys.shape
    return KVView.of(keys, values, positions[:, None, :].expand(b, h, length), summary=summary)


def test_moments_equal_sums_recomputed_from_the_evicted_tokens():
    layer, context, _, _, _ = random_layer(batch=2, heads=2, group=2, length=80, window=8, seed=4)
    keys, values = layer.view().keys.clone(), layer.view().values.clone()
    layer.compress(get_method("momentkv", budget=20, window=8))
    moments = layer.state[MOMENTS]
    for b, row in enumerate(kept_positions(layer)):
        for h, kept in enumerate(row):
            gone = sorted(set(range(80)) - set(kept))
            k, v = keys[b, h, gone].double(), values[b, h, gone].double()
            assert moments.count[b, h] == len(gone)
            assert torch.allclose(moments.key_sum[b, h].double(), k.sum(0), atol=1e-4)
            assert torch.allclose(moments.value_sum[b, h].double(), v.sum(0), atol=1e-4)
            assert torch.allclose(moments.value_key_sum[b, h].double(), v.T @ k, atol=1e-3)


def test_corrected_read_is_exact_when_evicted_keys_are_identical():
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    keys[:, :, :12] = torch.randn(1, 2, 1, 16)  # the 12 entries to evict share one key per head
    positions = torch.arange(30).expand(1, 30)
    evicted = torch.zeros(1, 2, 30, dtype=torch.bool)
    evicted[:, :, :12] = True
    summary = Moments.empty(1, 2, 16, "cpu").add(keys, values, evicted)
    query, qpos = torch.randn(1, 4, 1, 16), torch.tensor([[30]])
    expected = read(query, qpos, _view(keys, values, positions), 0.25).out
    out = read(query, qpos, _view(keys[:, :, 12:], values[:, :, 12:], positions[:, 12:], summary), 0.25).out
    assert torch.allclose(out, expected, atol=1e-5)
    plain = read(query, qpos, _view(keys[:, :, 12:], values[:, :, 12:], positions[:, 12:]), 0.25).out
    assert not torch.allclose(plain, expected, atol=1e-3)  # without the correction the output is off


def _moments(gen: torch.Generator, rows: int, heads: int, d: int, empty_heads: torch.Tensor) -> Moments:
    """Moments of 12 random entries per head, none evicted where ``empty_heads`` [R, H]."""
    keys, values = torch.randn(rows, heads, 12, d, generator=gen), torch.randn(rows, heads, 12, d, generator=gen) * 2
    evicted = (torch.rand(rows, heads, 12, generator=gen) < 0.6) & ~empty_heads[..., None]
    return Moments.empty(rows, heads, d, "cpu").add(keys, values, evicted)


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 3), heads=st.integers(1, 3), group=st.integers(1, 4), d=st.sampled_from([1, 8, 64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
def test_the_compiled_summary_merge_equals_the_pytorch_merge(rows, heads, group, d, dtype, seed):
    """A decoding read's output merged with the moments in one compiled pass, as ``merge_lse`` merges the summary's
    affine read (float32 sums in another order): over queries and outputs that are views of wider arrays, heads
    with nothing evicted (log m = -inf), reads that saw nothing (lse -inf) and both at once (output 0, lse -inf)."""
    gen = torch.Generator().manual_seed(seed)
    moments = _moments(gen, rows, heads, d, torch.rand(rows, heads, generator=gen) < 0.3)
    wide = (torch.randn(rows, heads * group, 2, d, generator=gen) * 2).to(dtype)
    query, out = wide[:, :, :1], wide[:, :, 1:]  # each [R, Hq, 1, d], strided
    lse = (torch.randn(rows, heads * group, 1, generator=gen) * 3).masked_fill(
        torch.rand(rows, heads * group, 1, generator=gen) < 0.3, float("-inf"))
    expected, expected_lse = merge_summary_torch(query, out, lse, moments, heads, 0.3)
    assert cpu_kernels() is not None  # the test machine builds the kernels (make setup)
    for merged, merged_lse in (cpu_kernels().summary_merge(query, out, lse, *moments.readout(0.3)),
                               merge_summary(query, out, lse, moments, heads, 0.3)):
        torch.testing.assert_close(merged, expected, atol=1e-5 * (1 + float(expected.abs().max())),
                                   rtol=0.0 if dtype == torch.float32 else 1e-2)
        torch.testing.assert_close(merged_lse, expected_lse, atol=1e-5, rtol=1e-5)
    both_empty = torch.isinf(expected_lse)
    assert torch.equal(expected[both_empty], torch.zeros_like(expected[both_empty]))


def test_rows_without_a_summary_read_nothing_from_the_stacked_summaries():
    """``RowSummaries`` (a batch whose rows hold their own moments, or none): each row reads its own, a row without
    moments reads as if it had none."""
    gen = torch.Generator().manual_seed(3)
    parts = [_moments(gen, 1, 2, 8, torch.zeros(1, 2, dtype=torch.bool)), None, _moments(gen, 1, 2, 8, torch.zeros(1, 2, dtype=torch.bool))]
    query, out = torch.randn(3, 4, 1, 8, generator=gen), torch.randn(3, 4, 1, 8, generator=gen)
    lse = torch.randn(3, 4, 1, generator=gen)
    merged, merged_lse = merge_summary(query, out, lse, RowSummaries(parts, [1, 1, 1]), 2, 0.5)
    for row, part in enumerate(parts):
        if part is None:
            assert torch.equal(merged[row], out[row]) and torch.equal(merged_lse[row], lse[row])
        else:
            alone, alone_lse = merge_summary_torch(query[row : row + 1], out[row : row + 1], lse[row : row + 1], part, 2, 0.5)
            torch.testing.assert_close(merged[row : row + 1], alone, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(merged_lse[row : row + 1], alone_lse, atol=1e-5, rtol=1e-5)


def test_nothing_evicted_reads_as_plain_attention():
    layer, context, queries, _, _ = random_layer(length=40, window=8, seed=2)
    reference = _view(layer.view().keys.clone(), layer.view().values.clone(), torch.arange(40).expand(1, 40))
    layer.compress(get_method("momentkv", ratio=1.0, window=8))
    assert float(layer.state[MOMENTS].count.sum()) == 0 and layer.summary is None
    q, qpos = queries[:, :, -1:], torch.tensor([[40]])
    assert torch.allclose(read(q, qpos, layer.view(), 0.3).out, read(q, qpos, reference, 0.3).out, atol=1e-6)


def test_log_domain_mix_matches_float64_closed_form():
    torch.manual_seed(5)
    keys, values = torch.randn(1, 1, 20, 8), torch.randn(1, 1, 20, 8)
    evicted = torch.zeros(1, 1, 20, dtype=torch.bool)
    evicted[..., :9] = True
    moments = Moments.empty(1, 1, 8, "cpu").add(keys, values, evicted)
    query = torch.randn(1, 1, 1, 1, 8) * 3
    retained_k, retained_v = keys[:, :, 9:], values[:, :, 9:]
    out, _, _ = attend_reference(query, retained_k, retained_v, 0.4, query_positions=torch.tensor([[99]]),
                                 key_positions=torch.arange(9, 20).expand(1, 1, 11), summary=moments)
    # closed form in float64 (eq. 9, 11, 12)
    q, k, v = query.double().view(8), keys.double()[0, 0], values.double()[0, 0]
    logits_r = 0.4 * k[9:] @ q
    o_r = torch.softmax(logits_r, 0) @ v[9:]
    lse_r = torch.logsumexp(logits_r, 0)
    mu_k, mu_v = k[:9].mean(0), v[:9].mean(0)
    cov = (v[:9].T @ k[:9]) / 9 - torch.outer(mu_v, mu_k)
    o_e = mu_v + 0.4 * cov @ q
    log_z = torch.log(torch.tensor(9.0, dtype=torch.float64)) + 0.4 * q @ mu_k
    alpha = torch.sigmoid(lse_r - log_z)
    expected = alpha * o_r + (1 - alpha) * o_e
    assert torch.allclose(out.double().view(8), expected, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_no_nan_or_inf_with_huge_logits_in_half_precision(dtype):
    from kvcompress.store.view import LayerContext

    torch.manual_seed(6)
    keys = (torch.randn(1, 2, 40, 16) * 100).to(dtype)  # logits reach ±1e4
    values = torch.randn(1, 2, 40, 16).to(dtype)
    view = _view(keys, values, torch.arange(40).expand(1, 40))
    observations = {"window_queries": (torch.randn(1, 4, 8, 16) * 100).to(dtype), "window_positions": torch.arange(32, 40).expand(1, 8)}
    edit = get_method("momentkv", budget=12, window=8).compress(view, LayerContext(0, 1, 0.25, torch.tensor([40]), observations))
    kept = KVView.of(keys, values, view.positions, edit.keep, summary=edit.summary)
    out = read((torch.randn(1, 4, 1, 16) * 100).to(dtype), torch.tensor([[40]]), kept, 0.25).out
    assert torch.isfinite(out).all() and out.dtype == dtype
    assert torch.isfinite(edit.state[MOMENTS].value_key_sum).all()


def test_moment_overhead_is_counted_in_bytes_held():
    layer, context, _, _, _ = random_layer(batch=1, heads=2, length=64, window=8, seed=3)
    layer.compress(get_method("momentkv", budget=16, window=8))
    entries = layer.num_entries * (2 * 8 * 4 + 4 + 4) + 2 * 8  # keys, values, slot indices, positions; head lengths
    assert layer.nbytes() == entries + 2 * moment_floats_per_head(8) * 4


def test_ablations_change_what_they_should():
    layer, context, _, _, _ = random_layer(length=96, window=8, seed=8)
    mi_only, nc_only, default = (layer.clone() for _ in range(3))
    mi_only.compress(get_method("momentkv", budget=24, window=8, correction=False))
    nc_only.compress(get_method("momentkv", budget=24, window=8, moment_eviction=False))
    default.compress(get_method("momentkv", budget=24, window=8))
    assert mi_only.summary is None and MOMENTS in mi_only.state
    assert nc_only.summary is not None
    assert kept_positions(mi_only) == kept_positions(default)  # same eviction rule
    assert kept_positions(nc_only) != kept_positions(default)  # attention-only eviction keeps other entries
    adakv = layer.clone()
    adakv.compress(get_method("adakv", budget=24, window=8, sinks=1, chunk_size=4))
    assert kept_positions(nc_only) == kept_positions(adakv)  # NC only = Ada-KV's keep set + the correction


def test_decoding_evicts_back_to_budget_after_slack_and_updates_moments():
    layer, context, _, _, _ = random_layer(length=40, window=8, seed=9)
    method = get_method("momentkv", budget=16, window=8, slack=4)
    layer.compress(method)
    for step in range(40, 70):
        layer.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.tensor([[step]]))
        length = layer.view().keys.shape[2]
        layer.decode_step(method, torch.softmax(torch.randn(1, 2, 2, 1, length), -1).sum(3).mean(2))
        assert int(layer.head_lengths().max()) <= 16 + 4
    count = layer.state[MOMENTS].count
    assert torch.equal(count + layer.head_lengths().float(), torch.full_like(count, 70.0))
