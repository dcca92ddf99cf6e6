"""The read path: reference attention, log-sum-exp merging, log-weights, the fast paths against the reference."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.integrations.sdpa_attention import repeat_kv

from kvcompress.kernels import cpu_kernels
from kvcompress.read import attend_reference, chunk_attention, group_queries, merge_lse, read
from kvcompress.store.slots import SlotTable, SlotPool
from kvcompress.store.view import KVView


def _table(keys, values, positions):
    """A pool and a table holding entries [B, H, L, d] at positions [B, L]."""
    pool = SlotPool(keys.shape[-1])
    table = SlotTable(keys.shape[0], keys.shape[1])
    table.append(pool, keys, values, positions)
    return pool, table


def _dense_attention(q, k, v, scaling):
    """Plain softmax attention in float64, queries [B, Hq, q, d] over keys [B, Hq, L, d], no mask."""
    w = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scaling, dim=-1)
    return w @ v.double()


def test_group_queries_matches_repeat_kv():
    q = torch.randn(2, 6, 3, 4)
    k = torch.randn(2, 2, 5, 4)
    grouped = group_queries(q, 2)  # [B, H, G, q, d]
    expanded = repeat_kv(k, 3)  # query head j reads KV head j // 3
    for j in range(6):
        assert torch.equal(grouped[:, j // 3, j % 3], q[:, j])
        assert torch.equal(expanded[:, j], k[:, j // 3])


def test_reference_equals_dense_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 2, 1, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    out, lse, _ = attend_reference(q, k, v, 0.3, query_positions=torch.tensor([[10]]), key_positions=torch.arange(10).expand(1, 2, 10))
    ref = _dense_attention(q.reshape(1, 4, 1, 8), repeat_kv(k, 2), repeat_kv(v, 2), 0.3)
    assert torch.allclose(out.reshape(1, 4, 1, 8).double(), ref, atol=1e-5)
    logits = (q.double() @ k.double()[:, :, None].transpose(-1, -2)) * 0.3
    assert torch.allclose(lse.double(), torch.logsumexp(logits, -1).squeeze(-1).view_as(lse.double()), atol=1e-5)


def test_merge_of_disjoint_parts_equals_attention_over_union():
    """Attending two halves and merging by LSE is exact: the summary path's foundation."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 1, 3, 2, 8), torch.randn(1, 1, 20, 8), torch.randn(1, 1, 20, 8)
    pos = torch.arange(20).expand(1, 1, 20)
    qpos = torch.tensor([[30, 31]])
    whole, lse_whole, _ = attend_reference(q, k, v, 0.5, query_positions=qpos, key_positions=pos)
    a, lse_a, _ = attend_reference(q, k[:, :, :7], v[:, :, :7], 0.5, query_positions=qpos, key_positions=pos[..., :7])
    b, lse_b, _ = attend_reference(q, k[:, :, 7:], v[:, :, 7:], 0.5, query_positions=qpos, key_positions=pos[..., 7:])
    merged, lse = merge_lse(a, lse_a, b, lse_b)
    assert torch.allclose(merged, whole, atol=1e-6)
    assert torch.allclose(lse, lse_whole, atol=1e-6)


def test_merge_with_empty_side_is_identity():
    out = torch.randn(1, 1, 1, 1, 4)
    lse = torch.tensor([[[[2.0]]]])
    merged, merged_lse = merge_lse(out, lse, torch.full_like(out, float("nan")), torch.full_like(lse, float("-inf")))
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse)


class _SharedKeySummary:
    """The exact summary of held-out entries that share one key per head (an affine read, as MomentKV's): their
    output is their mean value whatever the query, their log partition function log n + τ·qᵀk."""

    def __init__(self, key, values):
        self.key, self.values = key, values  # [B, H, d], [B, H, n, d]

    def readout(self, scaling):
        b, h, d = self.key.shape
        matrix = torch.cat([torch.zeros(b, h, d, d), scaling * self.key[:, :, None, :]], dim=2)
        count = torch.full((b, h, 1), float(self.values.shape[2]))
        return matrix, torch.cat([self.values.mean(dim=2), count.log()], dim=-1)

    def nbytes(self):
        return 0


def test_summary_term_merges_through_lse():
    """Retained entries + an exact summary of the evicted ones reproduce full attention (one query a row: the compiled
    merge; the reference read: the PyTorch one)."""
    torch.manual_seed(2)
    k, v = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    k[:, :, :6] = torch.randn(1, 2, 1, 8)  # the six entries left out share one key per head
    pos = torch.arange(16).expand(1, 16)
    q = torch.randn(1, 4, 1, 8)
    full_pool, full = _table(k, v, pos)
    part_pool, part = _table(k[:, :, 6:], v[:, :, 6:], pos[:, 6:])
    summary = _SharedKeySummary(k[:, :, 0], v[:, :, :6])
    qpos = torch.tensor([[16]])
    out_full = read(q, qpos, full.view(full_pool), 0.35).out
    for reference in (False, True):
        out_part = read(q, qpos, part.view(part_pool, summary=summary), 0.35, reference=reference).out
        assert torch.allclose(out_part, out_full, atol=1e-6)


def test_log_weight_equals_duplicated_entry():
    """An entry with log-weight log p attends like p copies of it (KeepKV's votes)."""
    torch.manual_seed(3)
    k, v = torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    q = torch.randn(1, 1, 1, 1, 8)
    pos = torch.arange(5).expand(1, 1, 5)
    weights = torch.tensor([[[0.0, math.log(3.0), 0.0, 0.0, 0.0]]])
    out, _, _ = attend_reference(q, k, v, 0.4, query_positions=torch.tensor([[9]]), key_positions=pos, log_weights=weights)
    dup_k = torch.cat([k, k[:, :, 1:2], k[:, :, 1:2]], dim=2)
    dup_v = torch.cat([v, v[:, :, 1:2], v[:, :, 1:2]], dim=2)
    ref, _, _ = attend_reference(q, dup_k, dup_v, 0.4, query_positions=torch.tensor([[9]]), key_positions=torch.arange(7).expand(1, 1, 7))
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.parametrize("num_queries", [1, 3])
def test_exact_path_matches_reference(num_queries):
    """The SDPA path (uniform heads, several queries) or the in-place read (one decoding query) and the
    float32 reference agree, causal by positions."""
    torch.manual_seed(4)
    pool, table = _table(torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16), torch.arange(12).expand(2, 12))
    new_k, new_v = torch.randn(2, 2, num_queries, 16), torch.randn(2, 2, num_queries, 16)
    qpos = torch.arange(12, 12 + num_queries).expand(2, num_queries)
    table.append(pool, new_k, new_v, qpos)
    q = torch.randn(2, 4, num_queries, 16)
    view = table.view(pool)
    fast = read(q, qpos, view, 0.25)
    slow = read(q, qpos, view, 0.25, col_sums=True, reference=True)
    if num_queries == 1:  # a decoding step: the paged kernel, which reports its lse
        assert view.pages is not None and torch.allclose(fast.lse, slow.lse, atol=1e-5)
    else:
        assert fast.lse is None  # the exact path: transformers' own SDPA call
    assert torch.allclose(fast.out, slow.out, atol=1e-5)
    masked = read(q, qpos, view, 0.25, col_sums=True)  # same view, the masked kernel (asked for column sums)
    assert torch.allclose(masked.out, slow.out, atol=1e-5) and torch.allclose(masked.lse, slow.lse, atol=1e-5)
    assert torch.allclose(masked.col_sums, slow.col_sums, atol=1e-5)


def test_hidden_future_keys_get_no_weight():
    q, k, v = torch.randn(1, 1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    _, _, probs = attend_reference(
        q, k, v, 1.0, query_positions=torch.tensor([[0, 1]]), key_positions=torch.tensor([[[0, 1, 2]]]), return_probs=True
    )
    assert probs[0, 0, 0, 0].tolist()[1:] == [0.0, 0.0]
    assert probs[0, 0, 0, 1, 2] == 0.0
    assert torch.allclose(probs.sum(-1), torch.ones(1, 1, 1, 2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_no_nan_with_extreme_logits_in_half_precision(dtype):
    q = torch.full((1, 1, 1, 1, 8), 100.0, dtype=dtype)
    k = torch.cat([torch.full((1, 1, 2, 8), 100.0), torch.full((1, 1, 2, 8), -100.0)], dim=2).to(dtype)
    v = torch.randn(1, 1, 4, 8).to(dtype)
    out, lse, _ = attend_reference(q, k, v, 1.0, query_positions=torch.tensor([[9]]), key_positions=torch.arange(4).expand(1, 1, 4))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def _ragged_view(seed, batch, heads, dim, lengths, log_weights, summary, new_tokens):
    """A table view whose heads hold different entries (a random keep mask), optional log-weights and an
    exact summary of some held-out entries, after ``new_tokens`` were appended."""
    from kvcompress.store.view import Edit

    gen = torch.Generator().manual_seed(seed)
    length = max(lengths)
    keys, values = torch.randn(batch, heads, length, dim, generator=gen), torch.randn(batch, heads, length, dim, generator=gen)
    pool, table = _table(keys, values, torch.arange(length).expand(batch, length))
    keep = torch.rand(batch, heads, length, generator=gen) < 0.6
    keep[..., -1] = True  # every head keeps something
    for h, n in enumerate(lengths[:heads]):
        keep[:, h, n:] = False
        keep[:, h, n - 1] = True
    edit = Edit(keep=keep)
    if log_weights:
        edit.log_weights = torch.randn(batch, heads, length, generator=gen)
    table.apply(pool, edit)
    table.append(pool, torch.randn(batch, heads, new_tokens, dim, generator=gen), torch.randn(batch, heads, new_tokens, dim, generator=gen),
                 torch.arange(length, length + new_tokens).expand(batch, new_tokens))
    held_out = None
    if summary:
        held_out = _SharedKeySummary(torch.randn(batch, heads, dim, generator=gen), torch.randn(batch, heads, 5, dim, generator=gen))
    return pool, table.view(pool, summary=held_out)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 3), heads=st.integers(1, 3), group=st.integers(1, 3),
       lengths=st.lists(st.integers(1, 24), min_size=3, max_size=3), queries=st.integers(1, 3),
       log_weights=st.booleans(), summary=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_fast_read_matches_reference_on_ragged_heads(seed, batch, heads, group, lengths, queries, log_weights, summary, dtype):
    """Ragged heads, log-weights, a summary, several causal queries, column sums: the masked kernel = the oracle."""
    pool, view = _ragged_view(seed, batch, heads, 16, lengths, log_weights, summary, queries)
    gen = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(batch, heads * group, queries, 16, generator=gen) * 2).to(dtype)
    length = view.positions.shape[-1]
    qpos = torch.arange(max(lengths), max(lengths) + queries).expand(batch, queries)
    fast = read(q, qpos, view, 0.25, col_sums=True)
    slow = read(q, qpos, view, 0.25, col_sums=True, reference=True)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert fast.out.dtype == dtype and fast.out.shape == (batch, heads * group, queries, 16)
    assert torch.allclose(fast.out.float(), slow.out.float(), atol=tol, rtol=tol)
    assert torch.allclose(fast.lse, slow.lse, atol=tol, rtol=tol)
    assert torch.allclose(fast.col_sums, slow.col_sums, atol=tol, rtol=tol)
    assert fast.col_sums.shape == (batch, heads, length)
    valid = view.valid_or_ones()
    assert bool((fast.col_sums[~valid] == 0).all())  # padding receives nothing
    if not summary:  # each query's weights sum to one: Σ over entries = the number of queries
        assert torch.allclose(fast.col_sums.sum(-1), torch.full((batch, heads), float(queries)), atol=1e-2)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), heads=st.integers(1, 3), group=st.integers(1, 3), log_weights=st.booleans())
def test_selection_reads_exactly_the_selected_entries(seed, heads, group, log_weights):
    """read(select=...) equals the reference over the selected entries alone; selecting everything is the plain read."""
    pool, view = _ragged_view(seed, 2, heads, 8, [12, 12, 12], log_weights, False, 1)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads * group, 1, 8, generator=gen)
    qpos = torch.tensor([[12], [12]])
    length = view.positions.shape[-1]
    k = int(view.lengths.min())
    select = torch.stack([torch.stack([torch.randperm(int(n), generator=gen)[:k] for n in row]) for row in view.lengths])
    chosen = read(q, qpos, view, 0.3, select=select, col_sums=True)
    sub = KVView.of(view.keys.gather(2, select[..., None].expand(-1, -1, -1, 8)), view.values.gather(2, select[..., None].expand(-1, -1, -1, 8)),
                    view.positions.gather(-1, select), None, None if view.log_weights is None else view.log_weights.gather(-1, select))
    expected = read(q, qpos, sub, 0.3, col_sums=True, reference=True)
    assert torch.allclose(chosen.out, expected.out, atol=1e-5)
    scattered = torch.zeros(2, heads, length).scatter(-1, select, expected.col_sums)
    assert torch.allclose(chosen.col_sums, scattered, atol=1e-5)
    everything = torch.arange(length).expand(2, heads, length)
    if bool((view.lengths == length).all()):
        assert torch.allclose(read(q, qpos, view, 0.3, select=everything).out, read(q, qpos, view, 0.3, reference=True).out, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(held=st.integers(0, 40), chunk=st.integers(1, 30), heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
       dim=st.sampled_from([8, 64]), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16),
       device=st.sampled_from(["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]))
def test_chunk_attention_equals_the_reference_over_the_prompt_so_far(held, chunk, heads, group, dim, dtype, seed, device):
    """A prompt chunk after its held entries (the chunked prefill): on the CPU the compiled causal attention (heads of
    64 channels, where it runs) or two flash calls merged by their log-sum-exp, on a GPU one SDPA call with the causal
    mask aligned to the last key, equal the float32 reference over the held entries and, causally, the chunk."""
    g = torch.Generator().manual_seed(seed)
    total = held + chunk
    keys, values = torch.randn(1, heads, total, dim, generator=g), torch.randn(1, heads, total, dim, generator=g)
    query = torch.randn(1, heads * group, chunk, dim, generator=g) * 2
    positions = torch.arange(total).expand(1, heads, total)
    expected, _, _ = attend_reference(group_queries(query, heads), keys, values, dim**-0.5,
                                      query_positions=torch.arange(held, total)[None], key_positions=positions)
    expected = expected.reshape(1, heads * group, chunk, dim)
    cast = [x.to(device, dtype) for x in (query, keys[:, :, :held], values[:, :, :held], keys[:, :, held:], values[:, :, held:])]
    out = chunk_attention(*cast, dim**-0.5).cpu()
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


CAUSAL = cpu_kernels() is not None and cpu_kernels().causal_attention_available()


@pytest.mark.skipif(not CAUSAL, reason="the compiled causal attention needs the CPU kernels and AVX-512")
@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3]), queries=st.integers(1, 40),
       before=st.integers(0, 150), dim=st.sampled_from([64, 128]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       scale=st.sampled_from([0.05, 1.0, 4.0]), cuts=st.lists(st.floats(0, 1), max_size=2), token_major=st.booleans(),
       seed=st.integers(0, 2**16))
def test_compiled_causal_attention_equals_float64_attention(batch, heads, group, queries, before, dim, dtype, scale, cuts, token_major,
                                                            seed):
    """``causal_attention``: query t of c sees keys 0 … L − c + t (the causal mask aligned to the last key), query head
    h·G + g reads KV head h; against float64 softmax attention over the same (rounded) numbers, within float32's
    rounding (blocks of 16 queries and 64 keys, partial ones at both ends, logits large enough to saturate). The keys and
    values come in pieces along L (empty ones too), read where they lie: contiguous, or token-major [B, L, H, d] views as
    a prompt's rows give them; the output is token-major ([B, c, Hq, d] permuted)."""
    g = torch.Generator().manual_seed(seed)
    length = before + queries
    query = (torch.randn(batch, heads * group, queries, dim, generator=g) * scale).to(dtype)
    keys, values = (torch.randn(batch, heads, length, dim, generator=g).to(dtype) for _ in range(2))
    if token_major:
        query, keys, values = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (query, keys, values))
    bounds = [0, *sorted(int(cut * length) for cut in cuts), length]
    pieces = [[x[:, :, a:b] for a, b in zip(bounds, bounds[1:])] for x in (keys, values)]
    out = cpu_kernels().causal_attention(query, *pieces, dim**-0.5)
    visible = torch.arange(length)[None, :] <= before + torch.arange(queries)[:, None]  # [c, L]
    logits = (query.double() @ repeat_kv(keys.double(), group).transpose(-1, -2)) * dim**-0.5
    weights = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    expected = weights @ repeat_kv(values.double(), group)
    assert out.shape == query.shape and out.dtype == dtype and out.transpose(1, 2).is_contiguous()
    # float32 sums: a relative error ~1e-6 in each weight (its logit's and exp's rounding) and in the weighted sum of the
    # values, bounded by their weighted magnitudes; in bfloat16 one more rounding of the output
    scale_of_sum = weights @ repeat_kv(values.double().abs(), group)
    bound = (2e-5 + (torch.finfo(dtype).eps if dtype == torch.bfloat16 else 0.0)) * scale_of_sum
    assert bool(((out.double() - expected).abs() <= bound).all())


@pytest.mark.skipif(not CAUSAL, reason="the compiled causal attention needs the CPU kernels and AVX-512")
def test_compiled_causal_attention_refuses_what_it_cannot_read():
    kernels, q, x = cpu_kernels(), torch.randn(1, 2, 4, 64), torch.randn(1, 1, 4, 64)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernels.causal_attention(torch.randn(1, 2, 4, 32), [torch.randn(1, 1, 4, 32)], [torch.randn(1, 1, 4, 32)], 1.0)
    with pytest.raises(RuntimeError, match="at least as many keys"):
        kernels.causal_attention(q, [x[:, :, :3]], [x[:, :, :3]], 1.0)
    with pytest.raises(RuntimeError, match="all float32 or all bfloat16"):
        kernels.causal_attention(q, [x.bfloat16()], [x], 1.0)
    with pytest.raises(RuntimeError, match="multiple of the KV heads"):
        kernels.causal_attention(torch.randn(1, 3, 4, 64), [torch.randn(1, 2, 4, 64)], [torch.randn(1, 2, 4, 64)], 1.0)
    with pytest.raises(RuntimeError, match="as many pieces"):
        kernels.causal_attention(q, [x, x], [x], 1.0)
    with pytest.raises(RuntimeError, match="first piece's heads"):
        kernels.causal_attention(q, [x, torch.randn(1, 2, 4, 64)], [x, torch.randn(1, 2, 4, 64)], 1.0)


@pytest.mark.skipif(not CAUSAL, reason="the compiled causal attention needs the CPU kernels and AVX-512")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_attention_runs_compiled_and_equals_torchs_sdpa(monkeypatch, dtype):
    """``prompt_attention`` without a mask takes the compiled kernel on the CPU (and SDPA where autograd records it): the
    same output as torch's causal SDPA to float32 rounding (bfloat16: the two round their sums differently)."""
    import kvcompress.read.sdpa as sdpa

    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 6, 50, 64, generator=g).to(dtype)
    key, value = (torch.randn(1, 2, 50, 64, generator=g).to(dtype) for _ in range(2))
    calls = []
    real = cpu_kernels()
    monkeypatch.setattr(sdpa, "cpu_kernels", lambda: type("Spy", (), {
        "causal_attention_available": lambda self: True,
        "causal_attention": lambda self, *a: calls.append(a[0].shape) or real.causal_attention(*a)})())
    out, _ = sdpa.prompt_attention(query, key, value, 0.125)
    expected = torch.nn.functional.scaled_dot_product_attention(query.float(), key.float(), value.float(), is_causal=True,
                                                                enable_gqa=True, scale=0.125)
    assert calls == [query.shape]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    with torch.enable_grad():
        sdpa.prompt_attention(query.float().requires_grad_(), key.float(), value.float(), 0.125)
    assert calls == [query.shape]
