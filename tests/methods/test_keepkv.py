"""KeepKV: votes + ZIP-merging are exact for the reference query; votes travel; fallbacks; threshold; refresh."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common import layer_from, layers_of, random_layer, tiny_model
from kvcompress import CompressedCache, get_method
from kvcompress.methods.ema import ema_over_queries
from kvcompress.methods.keepkv import EXTERNAL
from kvcompress.methods.merging import MergePlan, query_reference, relative_error, reference_output, zip_merge
from kvcompress.read import group_queries, read


def reference_query(window_queries, heads):
    """q̄ [B, H, d] float64: the window's queries averaged over the GQA group and the window."""
    return group_queries(window_queries.double(), heads).mean(dim=(2, 3))


def attend64(q, keys, values, log_weights=None, scaling=1.0, valid=None):
    """One query per head q [B, H, d] over every entry [B, H, L, d] in float64: (output [B, H, d], lse [B, H])."""
    logits = torch.einsum("bhd,bhld->bhl", q.double(), keys.double()) * scaling
    if log_weights is not None:
        logits = logits + log_weights.double()
    if valid is not None:
        logits = logits.masked_fill(~valid, float("-inf"))
    return torch.einsum("bhl,bhld->bhd", torch.softmax(logits, -1), values.double()), torch.logsumexp(logits, -1)


def held(layer):
    view = layer.view()
    return view.keys, view.values, view.log_weights, view.valid


def votes_per_head(layer):
    """Σ p per (row, head) [B, H] float64."""
    view = layer.view()
    p = torch.ones(view.positions.shape, dtype=torch.float64)
    if view.log_weights is not None:
        p = view.log_weights.double().exp()
    return (p * (view.valid if view.valid is not None else 1)).sum(-1)


def held_keys(layer):
    """The keys of the entries held [N, d]."""
    view = layer.view()
    return view.flat(view.keys)


PAPER = {"max_key_scale": float("inf")}  # the paper's unbounded ZIP key


@pytest.mark.parametrize("options", [PAPER, {}, {"key_rule": "votes"}, {"key_rule": "shift"}])
def test_reference_query_output_is_unchanged_by_compression(options):
    """The paper's claim, in float32: after compression q̄'s output equals the uncompressed one (every key rule)."""
    layer, context, queries, _, valid = random_layer(batch=2, heads=2, group=2, length=96, dim=16, window=8, seed=1, lengths=[96, 70])
    view = layer.view()
    keys, values, full_valid = view.keys.clone(), view.values.clone(), view.valid
    q = reference_query(layer.observations["window_queries"], 2)
    expected, lse_before = attend64(q, keys, values, scaling=context.scaling, valid=full_valid)
    method = get_method("keepkv", budget=24, window=8, **options)
    layer.compress(method)
    assert layer.head_lengths().tolist() == [[24, 24], [24, 24]]
    assert layer.counts["dropped"] == 0
    k, v, log_p, kvalid = held(layer)
    out, lse_after = attend64(q, k, v, log_p, context.scaling, kvalid)
    assert relative_error(out, expected) <= 1e-4
    assert torch.allclose(lse_after, lse_before, atol=1e-4)  # no attention sag: the mass is all there
    assert layer.state["merge_error"] <= 1e-4
    log_p = layer.view().flat(layer.view().log_weights)
    assert float(log_p.min()) >= -1e-6 and float(log_p.exp().max()) >= 3  # p ≥ 1, groups of several
    tokens = torch.tensor([[96.0, 96.0], [70.0, 70.0]], dtype=torch.float64)
    if options is PAPER:  # p_r = Σ p: every token keeps its vote
        assert layer.counts.get("zip_fallbacks", 0) == 0
        assert torch.allclose(votes_per_head(layer), tokens, atol=1e-3)
    else:  # the votes rule gives p_r ≤ Σ p (the group's effective number of tokens)
        assert bool((votes_per_head(layer) <= tokens + 1e-3).all())


def test_bounded_key_scale_keeps_merged_keys_in_range_where_the_paper_blows_them_up():
    """Reference logits near 0 with a spread: T/λ̄ is large, so the paper's key leaves the range of real keys."""
    layer, context, _, _, _ = random_layer(heads=2, group=2, length=64, dim=16, window=8, seed=11, key_scale=0.3)  # small logits: λ̄ ≈ 0 for many groups
    largest = float(held_keys(layer).norm(dim=-1).max())
    paper, bounded = layer.clone(), layer.clone()
    paper.compress(get_method("keepkv", budget=16, window=8, **PAPER))
    bounded.compress(get_method("keepkv", budget=16, window=8))
    assert float(held_keys(paper).norm(dim=-1).max()) > 2 * largest
    assert float(held_keys(bounded).norm(dim=-1).max()) <= 1.25 * largest + 1e-5
    assert bounded.counts["zip_fallbacks"] > 0
    assert paper.state["merge_error"] <= 1e-4 and bounded.state["merge_error"] <= 1e-4  # both exact for q̄


def test_huge_logits_stay_exact_and_finite():
    # logits in the hundreds: e^λ overflows float32 and float64 alike
    layer, context, _, _, _ = random_layer(batch=1, heads=2, group=2, length=64, dim=16, window=8, seed=2, key_scale=40.0)
    view = layer.view()
    keys, values = view.keys.clone(), view.values.clone()
    q = reference_query(layer.observations["window_queries"], 2)
    expected, _ = attend64(q, keys, values, scaling=context.scaling)
    layer.compress(get_method("keepkv", budget=16, window=8))
    k, v, log_p, _ = held(layer)
    out, _ = attend64(q, k, v, log_p, context.scaling)
    assert torch.isfinite(held_keys(layer)).all() and torch.isfinite(layer.view().log_weights).all()
    assert relative_error(out, expected) <= 1e-3


def test_ratio_one_keeps_everything_untouched():
    layer, context, _, _, _ = random_layer(length=40, window=8, seed=3)
    keys = layer.view().keys.clone()
    layer.compress(get_method("keepkv", ratio=1.0, window=8))
    assert torch.equal(layer.view().keys, keys) and layer.view().log_weights is None
    assert layer.state["merge_error"] == 0.0


def _decode(layer, method, context, steps, start, seed=0, check=None):
    """Append random tokens one by one, read through the layer (votes included), let the method act."""
    gen = torch.Generator().manual_seed(seed)
    b, h = layer.head_lengths().shape
    d = layer.view().keys.shape[-1]
    for step in range(start, start + steps):
        key, value = torch.randn(b, h, 1, d, generator=gen), torch.randn(b, h, 1, d, generator=gen)
        query = torch.randn(b, 2 * h, 1, d, generator=gen) * 2
        positions = torch.full((b, 1), step)
        layer.append(key, value, positions)
        view = layer.view()
        col_sums = read(query, positions, view, layer.scaling, col_sums=True).col_sums
        step_context = layer.context(query, positions)
        before = reference_output(query_reference(view, step_context), *_held_reference_args(layer), layer.scaling)[0]
        layer.decode_step(method, col_sums, query, positions)
        if check is not None:
            check(layer, step, key, value, query, step_context, before)


def _held_reference_args(layer):
    view = layer.view()
    return view.keys, view.values, view.positions, view.valid, view.log_weights


def test_votes_travel_through_decoding_and_the_budget_holds():
    layer, context, _, _, _ = random_layer(batch=2, heads=2, group=2, length=48, dim=8, window=8, seed=4, lengths=[48, 33])
    method = get_method("keepkv", budget=16, window=8, **PAPER)
    layer.compress(method)
    merged_at_prefill = layer.counts["merged"]

    def check(layer, step, *_):
        assert int(layer.head_lengths().max()) <= 16
        assert float(layer.view().flat(layer.view().log_weights).min()) >= -1e-6  # p ≥ 1
        seen = layer.tokens_seen.double()[:, None].expand(-1, 2)
        assert torch.allclose(votes_per_head(layer), seen, atol=1e-3)  # nothing dropped: every token is somewhere

    _decode(layer, method, context, steps=20, start=48, check=check)
    assert layer.counts["merged"] == merged_at_prefill + 20 * 4  # one merge per head and step once full


def test_decoding_merges_are_exact_for_the_current_query():
    layer, context, _, _, _ = random_layer(heads=2, group=2, length=40, dim=8, window=8, seed=5)
    method = get_method("keepkv", budget=12, window=8)
    layer.compress(method)

    def check(layer, step, key, value, query, step_context, before):
        after = reference_output(query_reference(layer.view(), step_context), *_held_reference_args(layer), context.scaling)[0]
        assert relative_error(after, before) <= 1e-4

    _decode(layer, method, context, steps=10, start=40, check=check)


def test_slack_lets_heads_grow_then_merges_back():
    layer, context, _, _, _ = random_layer(length=40, dim=8, window=8, seed=6)
    method = get_method("keepkv", budget=12, window=8, slack=4)
    layer.compress(method)
    lengths = []
    _decode(layer, method, context, steps=15, start=40, check=lambda layer, *_: lengths.append(int(layer.head_lengths().max())))
    assert max(lengths) == 16 and 12 in lengths[1:]


def test_ema_importance_is_bias_corrected():
    layer, context, _, _, _ = random_layer(length=30, dim=8, window=8, seed=7)
    method = get_method("keepkv", ratio=1.0, window=8, ema_decay=0.5)
    layer.compress(method)
    layer.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.tensor([[30]]))
    col_sums = torch.zeros(1, 2, 31)
    col_sums[..., -1] = 0.7  # the new entry receives 0.7 from both query heads at its first update
    layer.decode_step(method, col_sums, torch.randn(1, 4, 1, 8), torch.tensor([[30]]))
    assert float(method.score.importance(layer.view())[0, 0, -1]) == pytest.approx(0.7)  # not (1 − α)·0.7


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), length=st.integers(1, 12), q=st.integers(1, 4),
       decay=st.sampled_from([0.5, 0.9, 0.99]), seed=st.integers(0, 2**16))
def test_ema_of_several_queries_equals_one_query_at_a_time(batch, heads, length, q, decay, seed):
    """The closed form over q queries (prefill windows, chunks) equals q decoding steps of one query each, in order
    (a decoding step takes its own few operations): for each entry, only the queries that see it (by position, real
    ones, real entries) count, and its bias correction counts its own updates."""
    gen = torch.Generator().manual_seed(seed)
    s, norm = torch.rand(batch, heads, length, generator=gen), torch.rand(batch, heads, length, generator=gen)
    probs = torch.rand(batch, heads, q, length, generator=gen)
    key_positions = torch.randint(0, length + q, (batch, heads, length), generator=gen)
    key_valid = torch.rand(batch, heads, length, generator=gen) < 0.8
    query_positions = torch.sort(torch.randint(0, length + q, (batch, q), generator=gen), dim=-1).values
    query_valid = torch.arange(q) >= torch.randint(0, q, (batch, 1), generator=gen)  # left padding
    together = ema_over_queries(s, norm, probs, query_positions, key_positions, key_valid, decay, query_valid)
    for j in range(q):
        step_valid = key_valid & query_valid[:, j, None, None]
        s, norm = ema_over_queries(s, norm, probs[:, :, j : j + 1], query_positions[:, j : j + 1], key_positions, step_valid, decay)
    torch.testing.assert_close(together, (s, norm), atol=1e-6, rtol=1e-5)


def _orthogonal_layer(length=40, dim=8, seed=8):
    """Keys orthogonal to every window query: every reference logit is 0, so Σ w λ = 0 in each group."""
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, 2, length, dim, generator=gen), torch.randn(1, 2, length, dim, generator=gen)
    keys[..., 0] = 0.0
    queries = torch.zeros(1, 4, length, dim)
    queries[:, :, -8:, 0] = torch.randn(1, 4, 8, generator=gen)
    layer = layer_from(keys, values, queries, window=8)
    return layer, layer.context()


def test_cancelling_logits_fall_back_to_the_votes_rule_and_are_counted():
    layer, context = _orthogonal_layer()
    layer.compress(get_method("keepkv", budget=16, window=8))
    carriers = int((layer.view().log_weights > 1e-6).sum())
    assert carriers > 0 and layer.counts["zip_fallbacks"] == carriers
    assert any("fallback" in note for note in layer.notes)
    assert layer.state["merge_error"] <= 1e-5  # all logits are 0: the convex key with p_r = Σ p is exact here


def _pair_plan():
    return MergePlan(
        keep=torch.tensor([[[True, False]]]), merged=torch.tensor([[[False, True]]]), dropped=torch.tensor([[[False, False]]]),
        target=torch.tensor([[[0, 0]]]), similarity=torch.tensor([[[float("-inf"), 0.9]]]),
    )


def test_zip_guard_on_a_pair_whose_weighted_logits_cancel():
    # w_c λ_c + w_e λ_e = 0 with λ_c = 0.1: solve λ e^λ = −0.1·e^{0.1} for λ_e (Newton)
    target, lam = -0.1 * torch.exp(torch.tensor(0.1, dtype=torch.float64)), torch.tensor(-0.12, dtype=torch.float64)
    for _ in range(50):
        lam = lam - (lam * lam.exp() - target) / ((1 + lam) * lam.exp())
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, dtype=torch.float64, generator=gen), torch.randn(2, 4, dtype=torch.float64, generator=gen)
    k = k + ((torch.tensor([0.1, float(lam)], dtype=torch.float64) - k @ q) / (q @ q))[:, None] * q  # k @ q = [0.1, λ_e]
    q, keys = q[None, None], k[None, None]
    values = torch.randn(1, 1, 2, 4, generator=gen)
    logits = torch.einsum("bhd,bhld->bhl", q, keys)  # [0.1, λ_e]: τ = 1
    for options in ({}, PAPER):
        result = zip_merge(keys, values, torch.zeros(1, 1, 2), logits, _pair_plan(), query=q, scaling=1.0, **options)
        assert result.fallbacks == 1 and torch.isfinite(result.keys).all()
        merged_logit = float(result.keys[0] @ q[0, 0]) + float(result.log_votes[0])
        assert merged_logit == pytest.approx(float(torch.logsumexp(logits[0, 0], -1)), abs=1e-6)  # p_r e^{λ_r} = Σ w
        assert 0.0 <= float(result.log_votes[0]) <= float(torch.log(torch.tensor(2.0))) + 1e-6  # 1 ≤ p_r ≤ 2
    healthy_keys = keys + ((torch.tensor([0.1, 0.5], dtype=torch.float64) - keys[0, 0] @ q[0, 0]) / (q[0, 0] @ q[0, 0]))[:, None] * q[0, 0]
    healthy = zip_merge(healthy_keys, values, torch.zeros(1, 1, 2), torch.einsum("bhd,bhld->bhl", q, healthy_keys), _pair_plan(),
                        query=q, scaling=1.0)
    assert healthy.fallbacks == 0 and float(healthy.log_votes[0]) == pytest.approx(float(torch.log(torch.tensor(2.0))))


def test_unknown_key_rule_and_bad_scale_are_refused():
    with pytest.raises(ValueError, match="key_rule"):
        get_method("keepkv", budget=8, key_rule="max")
    with pytest.raises(ValueError, match="max_key_scale"):
        get_method("keepkv", budget=8, max_key_scale=0.5)


def test_similarity_threshold_drops_instead_of_merging():
    base, context, _, _, _ = random_layer(heads=2, length=64, dim=8, window=8, seed=9)
    strict, loose = base.clone(), base.clone()
    strict.compress(get_method("keepkv", budget=16, window=8, similarity_threshold=0.9))
    loose.compress(get_method("keepkv", budget=16, window=8, similarity_threshold=-1.0))
    assert strict.counts["dropped"] > 0 and loose.counts["dropped"] == 0
    assert strict.counts["dropped"] + strict.counts["merged"] == loose.counts["merged"] == 2 * (64 - 16)
    total = float(votes_per_head(strict).sum())
    assert total == pytest.approx(2 * 64 - strict.counts["dropped"], abs=1e-3)  # a dropped token leaves its vote too
    assert strict.state["merge_error"] > 1e-3 and loose.state["merge_error"] <= 1e-4


def test_refresh_brings_the_error_back_to_its_post_compression_level():
    layer, context, queries, _, _ = random_layer(heads=2, group=2, length=48, dim=8, window=8, seed=10)
    full_keys, full_values = [layer.view().keys.clone()], [layer.view().values.clone()]
    all_queries = [queries]
    method = get_method("keepkv", budget=12, window=8, refresh_every=4)
    layer.compress(method)
    post_compression = layer.state["merge_error"]
    assert post_compression <= 1e-4
    assert layer.state["external_kv_bytes"] == layer.state[EXTERNAL].size_bytes() > 0
    errors = {}

    def check(layer, step, key, value, query, *_):
        full_keys.append(key)
        full_values.append(value)
        all_queries.append(query)
        q = reference_query(torch.cat(all_queries, dim=2)[:, :, -8:], 2)  # the last window of queries
        expected, _ = attend64(q, torch.cat(full_keys, 2), torch.cat(full_values, 2), scaling=context.scaling)
        k, v, log_p, _ = held(layer)
        errors[step] = relative_error(attend64(q, k, v, log_p, context.scaling)[0], expected)

    _decode(layer, method, context, steps=12, start=48, check=check)
    assert layer.state["refreshes"] == 3
    for step in (51, 55, 59):  # after the 4th, 8th and 12th decoded token
        assert errors[step] <= 1e-4
    assert max(e for s, e in errors.items() if s not in (51, 55, 59)) > 1e-3  # in between, decoding merges drift
    assert layer.state["merge_error"] <= 1e-4 and int(layer.head_lengths().max()) <= 12
    entries = layer.num_entries * (2 * 8 * 4 + 4 + 4 + 4 + 2 * 4) + 2 * 8  # K, V, slot index, position, vote, EMA pair; lengths
    assert layer.nbytes() == entries  # the CPU copy is not counted in kr


def test_cache_reports_merge_error_and_kr_with_a_tiny_model():
    model = tiny_model(seed=2)
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(4))
    cache = CompressedCache(model, get_method("keepkv", budget=16, window=8))
    model(ids, past_key_values=cache)
    assert cache.merge_error is not None and cache.merge_error <= 1e-4
    assert all(layer.num_entries == 2 * 16 for layer in layers_of(cache))
    stats = cache.stats()
    assert stats["kr"] < 0.5
    assert stats["merge_counts"]["merged"] == 2 * 2 * (80 - 16)  # every entry that left each head was merged
