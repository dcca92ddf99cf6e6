"""SnapKV keeps the window plus the top pooled window-attention scores, per KV head."""

import pytest
import torch

from common import kept_positions, random_layer
from kvcompress import get_method


def reference_snapkv(keys, queries, window, kernel, pooling, scaling, group):
    """Loops over heads, window queries and positions: SnapKV's score per (row, KV head) outside the window."""
    batch, heads, length, _ = keys.shape
    kept = []
    for b in range(batch):
        row = []
        for h in range(heads):
            per_query_head = []
            for g in range(group):
                votes = torch.zeros(length, dtype=torch.float64)
                for i in range(length - window, length):
                    q = queries[b, h * group + g, i].double()
                    logits = torch.tensor([float(q @ keys[b, h, j].double()) * scaling if j <= i else float("-inf") for j in range(length)])
                    votes += torch.softmax(logits, dim=0)
                votes[length - window :] = 0
                pooled = torch.zeros(length, dtype=torch.float64)
                for j in range(length):
                    lo, hi = max(0, j - kernel // 2), min(length, j + kernel // 2 + 1)
                    pooled[j] = votes[lo:hi].max() if pooling == "max" else votes[lo:hi].sum() / kernel  # zero padding
                per_query_head.append(pooled)
            row.append(torch.stack(per_query_head).mean(0)[: length - window])
        kept.append(row)
    return kept


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_keep_set_matches_reference(pooling):
    layer, context, queries, _, _ = random_layer(batch=2, heads=2, group=3, length=48, window=8, seed=5)
    keys = layer.view().keys.clone()
    method = get_method("snapkv", budget=20, window=8, kernel=5, pooling=pooling)
    layer.compress(method)
    scores = reference_snapkv(keys, queries, 8, 5, pooling, context.scaling, 3)
    for row_kept, row_scores in zip(kept_positions(layer), scores):
        for kept, score in zip(row_kept, row_scores):
            assert len(kept) == 20 and set(range(40, 48)) <= set(kept)
            chosen = [p for p in kept if p < 40]
            dropped = [p for p in range(40) if p not in kept]
            # the top 12 scores outside the window (max pooling makes exact ties: any of them may win)
            assert float(score[chosen].min()) >= float(score[dropped].max()) - 1e-6
            if pooling == "avg":
                assert chosen == sorted(torch.topk(score, 12).indices.tolist())


def test_window_is_always_kept_and_budget_respected():
    layer, context, _, _, _ = random_layer(length=64, window=16, seed=1)
    layer.compress(get_method("snapkv", budget=24, window=16))
    for head in kept_positions(layer)[0]:
        assert len(head) == 24
        assert set(range(48, 64)) <= set(head)


def test_ratio_one_keeps_everything():
    layer, context, _, _, _ = random_layer(length=40, seed=2)
    layer.compress(get_method("snapkv", ratio=1.0, window=8))
    assert kept_positions(layer) == [[list(range(40))] * 2]


def test_budget_above_context_keeps_everything_and_notes_it():
    layer, context, _, _, _ = random_layer(length=40, seed=2)
    layer.compress(get_method("snapkv", budget=500, window=8))
    assert layer.num_entries == 2 * 40
    assert any("budget >= context" in note for note in layer.notes)


def test_padded_rows_never_keep_padding():
    layer, context, _, _, valid = random_layer(batch=2, length=40, window=8, lengths=[40, 25], seed=3)
    layer.compress(get_method("snapkv", budget=16, window=8))
    kept = kept_positions(layer)
    assert all(len(h) == 16 for row in kept for h in row)
    assert all(max(h) < 25 for h in kept[1])  # row 1 has 25 real tokens at positions 0..24
