"""H2O: heavy hitters by accumulated attention plus recent tokens; eviction while decoding."""

import torch

from common import kept_positions, random_layer
from kvcompress import get_method
from kvcompress.cache import _attention_sums


def reference_attention_sums(keys, queries, scaling, group):
    """Σ_i a_ij over all causal queries, mean over the GQA group: [B, H, L]."""
    batch, heads, length, _ = keys.shape
    q = queries.double().view(batch, heads, group, length, -1)
    logits = torch.einsum("bhgid,bhjd->bhgij", q, keys.double()) * scaling
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    return probs.sum(dim=3).mean(dim=2)


def test_attention_sums_match_reference():
    layer, context, queries, positions, _ = random_layer(batch=2, heads=2, group=2, length=40, seed=7)
    sums = _attention_sums(layer, queries, positions, None, context.scaling, chunk=7)
    ref = reference_attention_sums(layer.padded_view().keys, queries, context.scaling, 2)
    assert torch.allclose(sums.view(2, 2, 40).double(), ref, atol=1e-4)


def test_keep_set_is_top_scores_plus_recent():
    layer, context, queries, positions, _ = random_layer(length=40, seed=8)
    sums = _attention_sums(layer, queries, positions, None, context.scaling)
    layer.observations["entry:attention_sums"] = sums
    get_method("h2o", budget=12, recent_ratio=0.5).compress(layer, context)
    scores = sums.view(1, 2, 40)
    for h, kept in enumerate(kept_positions(layer)[0]):
        heavy = torch.topk(scores[0, h, :34], 6).indices.tolist()
        assert kept == sorted(heavy + list(range(34, 40)))


def test_decoding_never_exceeds_budget_and_accumulates_scores():
    layer, context, queries, positions, _ = random_layer(length=30, seed=9)
    layer.observations["entry:attention_sums"] = _attention_sums(layer, queries, positions, None, context.scaling)
    method = get_method("h2o", budget=10)
    method.compress(layer, context)
    for step in range(30, 60):
        layer.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.tensor([[step]]))
        length = layer.padded_view().keys.shape[2]
        probs = torch.softmax(torch.randn(1, 2, 2, 1, length), dim=-1)
        before = layer.extras["h2o_score"].clone()
        method.after_decode_step(layer, probs, context)
        assert int(layer.head_lengths().max()) <= 10
        assert layer.extras["h2o_score"].shape[0] == layer.num_entries
        assert float(layer.extras["h2o_score"].sum()) >= float(before.sum()) - 2.0  # one entry per head left
    assert all(59 in head and 55 in head for head in kept_positions(layer)[0])  # recent half kept
