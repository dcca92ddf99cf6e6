"""Every scorer under every sizer keeps the same promises: the entries held are the size's (per head, layer or
request), the protected entries always stay, the bytes held are the entries times the bytes of one, and the
whole size (ratio 1.0) answers as the full cache does. Parts compose by name (the spec) and by object."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common import layers_of, tiny_gates, tiny_model
from kvcompress import CompressedCache, Policy, get_method
from kvcompress.methods import Adaptive, KeepKV, SnapKV
from kvcompress.methods.budget import Budget
from kvcompress.store.slots import LENGTH_BYTES

LAYERS, HEADS, DIM = 2, 2, 16
SCORERS = {  # scorer spec → (the most recent entries it protects, its sinks)
    "snapkv:window=8": (8, 0), "h2o": (None, 0), "recency": (None, 4), "ema:window=8": (None, 4), "kvzip": (0, 4),
    "expected_attention": (0, 4),
}
SIZERS = ("uniform", "pyramid", "adaptive", "global")


def _held(cache) -> torch.Tensor:
    return torch.stack([layer.head_lengths()[0] for layer in layers_of(cache)])  # [layers, heads]


@settings(max_examples=40, deadline=None)
@given(scorer=st.sampled_from(sorted(SCORERS)), sizer=st.sampled_from(SIZERS), tokens=st.integers(40, 90),
       ratio=st.sampled_from([0.2, 0.35, 0.5]), seed=st.integers(0, 3))
def test_every_scorer_under_every_sizer_keeps_its_size_its_protected_entries_and_the_bytes_follow(scorer, sizer, tokens,
                                                                                                     ratio, seed):
    model = tiny_model(seed=seed, layers=LAYERS)
    ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(seed))
    policy = get_method(f"{scorer}+{sizer}", ratio=ratio)
    cache = CompressedCache(model, policy)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    held = _held(cache)
    size = Budget(ratio=ratio).count(tokens)
    if sizer == "uniform":
        assert bool((held == size).all())  # each head keeps exactly the size
    elif sizer == "adaptive":
        assert held.sum(dim=1).tolist() == [size * HEADS] * LAYERS  # each layer's heads share its size
    else:
        assert int(held.sum()) == size * HEADS * LAYERS  # pyramid: the layers average it; global: one total
    recent, sinks = SCORERS[scorer]
    for layer in layers_of(cache):
        kept = layer.view().positions[0]
        for head in range(HEADS):
            positions = set(kept[head][: int(layer.head_lengths()[0, head])].tolist())
            protected = set(range(sinks)) | (set(range(tokens - recent, tokens)) if recent else set())
            # the sinks and the window stay; a head sized below them keeps only protected entries
            assert protected <= positions if len(positions) >= len(protected) else positions <= protected
    stats = cache.stats()
    per_entry = 2 * DIM * 4 + cache.session.table.entry_metadata_bytes()
    assert stats["entries"] == int(held.sum())
    assert stats["kv_bytes"] == stats["entries"] * per_entry + LAYERS * HEADS * LENGTH_BYTES


@pytest.mark.parametrize("spec", ["snapkv:window=8+global", "kvzip+adaptive", "h2o+pyramid", "ema:window=8+uniform",
                                  "expected_attention+global", "recency+adaptive", "snapkv:window=8+keepkv",
                                  "kvzip+momentkv", "snapkv:window=8+adaptive+kivi:bits=4:group_size=8:residual=8"])
def test_the_whole_size_answers_as_the_full_cache(spec):
    model = tiny_model(seed=5, layers=LAYERS)
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(5))
    want = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    cache = CompressedCache(model, get_method(spec, ratio=1.0))
    got = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False, pad_token_id=0)
    if "kivi" in spec:  # coded storage: what it holds is every entry, fewer bytes
        assert cache.stats()["entries"] == 65 * LAYERS * HEADS and cache.stats()["kr"] < 1.0
    else:
        assert torch.equal(got, want)


def test_a_policy_built_from_objects_equals_its_spec():
    model = tiny_model(seed=2, layers=LAYERS)
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(2))
    by_spec = get_method("snapkv:window=8+adaptive:alpha=0.5", budget=12)
    by_objects = Policy(score=SnapKV(window=8), sizes=Adaptive(alpha=0.5), budget=12)
    assert by_objects.label == by_spec.label == "snapkv@12[window=8]+adaptive[alpha=0.5]"
    outs = []
    for policy in (by_spec, by_objects):
        cache = CompressedCache(model, policy)
        outs.append((model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False, pad_token_id=0), _held(cache)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_learned_gates_rank_under_another_fate_and_decode():
    """The retention gates as a scorer under KeepKV's merging (a learned KVzap-like scorer, merged not dropped)."""
    model = tiny_model(seed=3, layers=LAYERS)
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(3))
    policy = get_method(f'retention:checkpoint="{tiny_gates(model)}"+keepkv:window=8', budget=16)
    assert isinstance(policy.fate, KeepKV) and policy.score.name == "retention" and policy.decoding.acts
    cache = CompressedCache(model, policy)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 86)
    assert int(_held(cache).sum()) <= 16 * LAYERS * HEADS + 128  # the global total, plus the decoding slack
    stats = cache.stats()
    assert stats["merge_counts"]["merged"] > 0 and stats["merge_error"] < 1e-4  # what left was merged, exactly for q̄


def test_one_rounding_rule_for_every_size():
    budget = Budget(ratio=0.3)
    tokens = torch.arange(1, 200)
    assert torch.equal(budget.entries(tokens), torch.clamp((tokens * 3) // 10, min=1))  # ⌊0.3·n⌋, at least 1
    assert Budget(budget=7).count(5) == 5 and Budget(budget=7).count(50) == 7
    with pytest.raises(ValueError, match="exactly one"):
        Budget.check("x", 4, 0.5)


def test_a_global_decoding_rerank_computes_the_scorers_key_once(monkeypatch):
    """While decoding under one budget over every layer (h2o+global), the re-rank's key serves the sizer and the fate:
    the scorer makes it once per eviction."""
    model = tiny_model(seed=4, layers=LAYERS)
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(4))
    policy = get_method("h2o+global", budget=12)
    keys, evictions = [], []
    original_key, original_evict = type(policy.score).decode_key, type(policy.fate).decode_evict
    monkeypatch.setattr(type(policy.score), "decode_key", lambda *a: keys.append(1) or original_key(*a))
    monkeypatch.setattr(type(policy.fate), "decode_evict", lambda *a: evictions.append(1) or original_evict(*a))
    model.generate(ids, past_key_values=CompressedCache(model, policy), max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert len(evictions) > 0 and len(keys) == len(evictions)


@settings(max_examples=60, deadline=None)
@given(start=st.lists(st.integers(0, 60), min_size=2, max_size=12), size=st.integers(1, 40), slack=st.integers(0, 12),
       steps=st.integers(1, 120))
def test_heads_over_their_size_go_back_together_once_one_passes_the_slack(start, size, slack, steps):
    """Heads of different lengths, one more entry each step: an eviction comes when a head holds more than size + slack,
    and takes every head over its size back to it, so that evictions come at most once per slack + 1 steps."""
    lengths = torch.tensor([start], dtype=torch.long)  # one row, len(start) heads
    budgets = torch.tensor([size])
    view = type("View", (), {"shape": (1, len(start), 0)})()
    evictions = []
    for step in range(steps):
        lengths = lengths + 1
        view.lengths = lengths
        per_head = Adaptive().decode_per_head(None, view, None, None, budgets, slack)
        over = lengths > size + slack
        assert (per_head is None) == (not bool(over.any()))
        if per_head is not None:
            assert torch.equal(per_head, torch.where(lengths > size, torch.full_like(lengths, size), lengths))
            lengths = per_head
            evictions.append(step)
        if evictions:  # over the slack only before the first
            assert int(lengths.max()) <= size + slack
    assert all(b - a >= slack + 1 for a, b in zip(evictions, evictions[1:]))
