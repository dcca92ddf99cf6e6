"""H2O: heavy hitters by accumulated attention plus recent tokens; eviction while decoding."""

import torch

from common import kept_positions, random_layer
from kvcompress import get_method
from kvcompress.read import prompt_attention, prompt_column_sums


def reference_attention_sums(keys, queries, scaling, group):
    """Σ_i a_ij over all causal queries, mean over the GQA group: [B, H, L]."""
    batch, heads, length, _ = keys.shape
    q = queries.double().view(batch, heads, group, length, -1)
    logits = torch.einsum("bhgid,bhjd->bhgij", q, keys.double()) * scaling
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    return probs.sum(dim=3).mean(dim=2)


def _sums(layer, queries, chunk=64, key_block=512):
    """The sums the prefill records, with its tiling (``chunk`` queries × ``key_block`` keys)."""
    keys, values = layer.view().keys, layer.view().values
    if (chunk, key_block) == (64, 512):
        return prompt_attention(queries, keys, values, layer.scaling, col_sums=True)[1]
    b, hq, n, _ = queries.shape
    logits = torch.einsum("bhqd,bhkd->bhqk", queries.double(), keys.repeat_interleave(hq // keys.shape[1], 1).double())
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    lse = torch.logsumexp((logits * layer.scaling).masked_fill(~causal, float("-inf")), -1).float()
    return prompt_column_sums(queries, keys, lse, layer.scaling, chunk=chunk, key_block=key_block)


def test_attention_sums_match_reference():
    layer, context, queries, positions, _ = random_layer(batch=2, heads=2, group=2, length=40, seed=7)
    sums = _sums(layer, queries, chunk=7, key_block=5)
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
