"""Budget arithmetic shared by the score-based methods: chunks, pyramid layers, Ada-KV heads."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common import random_layer
from kvcompress import get_method
from kvcompress.methods.selection import (
    PROTECTED_PRIORITY,
    adaptive_head_budgets,
    chunk_average,
    global_sizes,
    priority,
    pyramid_layer_budgets,
    round_preserving_sum,
    top_per_head,
)


@pytest.mark.parametrize("mean,layers", [(64, 30), (128, 30), (10, 7), (33, 4)])
def test_pyramid_budgets_average_to_budget_and_fall(mean, layers):
    budgets = pyramid_layer_budgets(mean, layers, 4.0, cap=10_000)
    assert sum(budgets) == mean * layers
    assert budgets == sorted(budgets, reverse=True)
    assert budgets[0] / budgets[-1] == pytest.approx(4.0, rel=0.25)


def test_pyramid_budgets_capped_by_context_keep_the_mean():
    budgets = pyramid_layer_budgets(100, 10, 4.0, cap=120)
    assert max(budgets) <= 120 and sum(budgets) == 1000


def test_pyramidkv_layers_hold_their_budgets():
    kept = []
    for idx in range(4):
        layer, context, _, _, _ = random_layer(length=200, window=8, seed=idx)
        layer.compress(get_method("pyramidkv", budget=40, window=8), layer_idx=idx)
        kept.append(int(layer.head_lengths()[0, 0]))
    assert sum(kept) == 4 * 40 and kept == sorted(kept, reverse=True)


def test_round_preserving_sum_is_exact_and_capped():
    values = torch.tensor([1.5, 2.5, 3.4, 0.6], dtype=torch.float64)
    out = round_preserving_sum(values, 8, torch.tensor([10, 10, 10, 10]))
    assert int(out.sum()) == 8 and (out - values).abs().max() < 1
    capped = round_preserving_sum(torch.tensor([5.0, 5.0], dtype=torch.float64), 10, torch.tensor([3, 10]))
    assert capped.tolist() == [3, 7]


def reference_adakv_budgets(key, budget, alpha):
    """Ada-KV's allocation for one row, written out: top H·B over heads, b_h = αB + (1-α)c_h."""
    heads, length = key.shape
    winners = sorted(range(heads * length), key=lambda i: -float(key.view(-1)[i]))[: heads * budget]
    counts = [sum(1 for i in winners if i // length == h) for h in range(heads)]
    return [alpha * budget + (1 - alpha) * c for c in counts]


def test_adaptive_budgets_sum_to_layer_budget_and_follow_reference():
    torch.manual_seed(0)
    key = torch.rand(1, 4, 50).double() ** torch.tensor([1.0, 3.0, 6.0, 0.5])[None, :, None]
    budgets = adaptive_head_budgets(key, torch.tensor([10]), 0.2, torch.full((1, 4), 50))
    assert int(budgets.sum()) == 40
    expected = reference_adakv_budgets(key[0], 10, 0.2)
    assert all(abs(int(b) - e) < 1 for b, e in zip(budgets[0], expected))
    assert len(set(budgets[0].tolist())) > 1  # heads really differ


def test_adakv_heads_hold_different_numbers_of_entries():
    layer, context, _, _, _ = random_layer(heads=4, group=2, length=120, window=8, seed=11)
    # make head 0's attention peaky and head 3's flat, so their needs differ
    layer.observations["window_queries"][:, :2] *= 8
    layer.compress(get_method("adakv", budget=30, window=8))
    lengths = layer.head_lengths()[0]
    assert int(lengths.sum()) == 4 * 30
    assert len(set(lengths.tolist())) > 1
    assert all(int(n) >= int(0.2 * 30) for n in lengths)
    entry_bytes = 2 * 8 * 4 + 4 + 4  # key + value float32, int32 slot index and position
    assert layer.nbytes() == pytest.approx(layer.num_entries * entry_bytes, rel=0.1)


def test_chunk_average_selects_whole_chunks():
    scores = torch.tensor([[[1.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.3, 0.3, 0.0, 0.0, 0.0, 0.9]]])
    averaged = chunk_average(scores, None, 4)
    assert torch.allclose(averaged[0, 0, :4], torch.full((4,), 0.25))
    key = priority(averaged, torch.zeros_like(scores, dtype=torch.bool), torch.arange(12).view(1, 1, 12), None)
    keep = top_per_head(key, torch.tensor([[4]]))
    assert keep[0, 0].nonzero().flatten().tolist() == [4, 5, 6, 7]


def test_protected_entries_rank_first_most_recent_first():
    scores = torch.tensor([[[9.0, 8.0, 0.0, 0.0]]])
    protected = torch.tensor([[[False, False, True, True]]])
    key = priority(scores, protected, torch.arange(4).view(1, 1, 4), None)
    assert top_per_head(key, torch.tensor([[1]]))[0, 0].tolist() == [False, False, False, True]
    assert top_per_head(key, torch.tensor([[3]]))[0, 0].tolist() == [True, False, True, True]


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 4), rows=st.integers(1, 3), heads=st.integers(1, 3), length=st.integers(1, 12),
       total=st.integers(0, 150), seed=st.integers(0, 2**16))
def test_global_sizes_count_each_heads_share_of_the_rows_best(layers, rows, heads, length, total, seed):
    """One budget over every layer and head, against a plain sort of every open key: a head's size is how many
    of the row's ``total`` best unprotected entries it holds (the few-losers path and the few-winners path)."""
    gen = torch.Generator().manual_seed(seed)
    keys = []
    for key in torch.randperm(layers * rows * heads * length, generator=gen).double().view(layers, rows, heads, length):
        kind = torch.randint(0, 5, key.shape, generator=gen)
        keys.append(key.masked_fill(kind == 0, PROTECTED_PRIORITY + 1.0).masked_fill(kind == 1, float("-inf")))
    totals = torch.full((rows,), total)
    sizes = global_sizes(keys, totals)
    for row in range(rows):
        entries = [(float(k[row, h, i]), layer, h) for layer, k in enumerate(keys) for h in range(heads) for i in range(length)
                   if math.isfinite(float(k[row, h, i])) and float(k[row, h, i]) < PROTECTED_PRIORITY]
        best = sorted(entries, reverse=True)[:total]
        for layer in range(layers):
            assert sizes[layer][row].tolist() == [sum(1 for _, lay, h in best if (lay, h) == (layer, head)) for head in range(heads)]


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 3), heads=st.integers(1, 3), length=st.integers(1, 40), levels=st.integers(1, 6),
       most_drop=st.integers(0, 6), seed=st.integers(0, 2**16))
def test_top_per_head_equals_a_stable_sort(rows, heads, length, levels, most_drop, seed):
    """Few entries to drop per head (a decoding step's eviction: the lowest are found) or many (a sort), against a
    stable descending sort: of equal keys the earlier stay; -inf (padding) never."""
    gen = torch.Generator().manual_seed(seed)
    key = torch.randint(0, levels, (rows, heads, length), generator=gen).double()  # few levels: many ties
    key = key.masked_fill(torch.rand(key.shape, generator=gen) < 0.2, float("-inf"))
    finite = torch.isfinite(key).sum(-1)
    budgets = (finite - torch.randint(0, most_drop + 1, finite.shape, generator=gen)).clamp(min=0)
    order = key.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(length).expand_as(order))
    expected = (rank < budgets[..., None]) & torch.isfinite(key)
    assert torch.equal(top_per_head(key, budgets), expected)
