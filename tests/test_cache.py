"""CompressedCache inside model.generate: exactness, padded batches, eviction, accounting."""

import pytest
import torch

from common import layers_of, left_padded_batch, tiny_method, tiny_model
from kvcompress import CompressedCache, available_methods, get_method
from kvcompress.methods import REGISTRY
from kvcompress.store.slots import SlotTable, SlotPool

METHODS = [m for m in available_methods() if REGISTRY[m].needs_budget]  # full and adaptive ones (gvote) take no size


def _generate(model, ids, cache=None, mask=None, new=8):
    return model.generate(
        ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False, pad_token_id=0
    )


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2", "mistral"])
def test_full_and_ratio_one_reproduce_generate(kind):
    model = tiny_model(kind)
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(1))
    reference = _generate(model, ids)
    assert torch.equal(_generate(model, ids, CompressedCache(model, get_method("full"))), reference)
    for name in METHODS:
        out = _generate(model, ids, CompressedCache(model, tiny_method(name, model, ratio=1.0)))
        assert torch.equal(out, reference), name


def test_plain_caches_still_work_after_switching_attention():
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 30))
    before = _generate(model, ids)
    CompressedCache(model, get_method("snapkv", budget=8))  # switches the model to kvcompress attention
    assert model.config._attn_implementation == "kvcompress"
    assert torch.equal(_generate(model, ids), before)


@pytest.mark.parametrize("name", ["full", "snapkv", "adakv", "h2o", "streamingllm", "pyramidkv", "momentkv", "retention"])
def test_padded_batch_matches_per_sample_runs(name):
    model = tiny_model(seed=3)
    rows, batch, mask = left_padded_batch([64, 41], seed=2)
    method = tiny_method(name, model, budget=24, **({"slack": 3} if name == "retention" else {})) if name != "full" else get_method("full")
    cache = CompressedCache(model, method)
    batched = _generate(model, batch, cache, mask)
    for i, row in enumerate(rows):
        alone = _generate(model, row, CompressedCache(model, method))
        assert batched[i, 64:].tolist() == alone[0, row.shape[1] :].tolist(), (name, i)
    # padding is never stored: row 1 holds at most its own tokens
    assert int(layers_of(cache)[0].tokens_seen[1]) == 41 + 7


@pytest.mark.parametrize("name", ["h2o", "streamingllm"])
def test_decoding_eviction_keeps_the_budget(name):
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 50))
    cache = CompressedCache(model, get_method(name, budget=16))
    _generate(model, ids, cache, new=30)
    for layer in layers_of(cache):
        assert int(layer.head_lengths().max()) <= 16


def test_kr_is_bytes_held_over_full_and_adakv_is_ragged():
    model = tiny_model(seed=5)
    ids = torch.randint(3, 128, (1, 120))
    cache = CompressedCache(model, get_method("adakv", budget=20, window=8))
    model(ids, past_key_values=cache)
    stats = cache.stats()
    assert stats["kr"] == stats["kv_bytes"] / stats["kv_bytes_full"]
    assert stats["kv_bytes_full"] == 2 * 120 * 2 * 2 * 16 * 4  # layers × tokens × (K,V) × heads × dim × fp32
    entry_bytes = 2 * 16 * 4
    assert stats["kv_bytes"] == pytest.approx(stats["entries"] * entry_bytes, rel=0.10)
    for layer in layers_of(cache):
        assert int(layer.head_lengths().sum()) == 2 * 20
    assert cache.session.pool.num_used == stats["entries"] == 2 * 2 * 20  # stored without padding: a slot per entry


def test_fork_equals_compressing_directly():
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 60))
    shared = CompressedCache(model, compress_on_prefill=False, observation_window=2**31 - 1, attention_sums=True,
                             hidden_states=True, replay=2048)  # every prompt query: expected_attention's statistics
    model(ids, past_key_values=shared)
    for name in METHODS:
        method = tiny_method(name, model, budget=12)
        direct = CompressedCache(model, method, attention_sums=True)  # the same prefill pass as the shared one's
        model(ids, past_key_values=direct)
        forked = shared.fork(method)
        for a, b in zip(layers_of(direct), layers_of(forked)):
            assert torch.equal(a.view().positions, b.view().positions) and torch.equal(a.view().keys, b.view().keys), name
    assert layers_of(shared)[0].num_entries == 2 * 60  # the shared prefill is untouched
    before = shared.stats()
    forked = shared.fork(get_method("h2o", budget=12))
    _generate(model, ids, forked, new=5)  # decoding on a fork leaves the shared prefill as it was
    assert shared.stats() == before and forked.stats()["kv_bytes_full"] > before["kv_bytes_full"]


def test_unsupported_generation_modes_fail_clearly():
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 20))
    with pytest.raises(NotImplementedError, match="beam search|num_return_sequences"):
        model.generate(ids, past_key_values=CompressedCache(model), num_beams=2, max_new_tokens=3, pad_token_id=0)


def test_wrong_attention_implementation_is_refused():
    model = tiny_model()
    cache = CompressedCache(model)
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="kvcompress"):
        model(torch.randint(3, 128, (1, 5)), past_key_values=cache)


def test_table_append_and_retain_keep_ragged_heads_aligned():
    pool = SlotPool(4)
    table = SlotTable(2, 2)
    keys = torch.arange(2 * 2 * 5 * 4, dtype=torch.float32).view(2, 2, 5, 4)
    table.append(pool, keys, -keys, torch.arange(5).expand(2, 5))
    keep = torch.zeros(2, 2, 5, dtype=torch.bool)
    keep[0, 0, [0, 3]] = True
    keep[0, 1, [1, 2, 4]] = True
    keep[1, 0, 4] = True
    keep[1, 1, :] = True
    table.retain(pool, keep)
    assert table.lengths.tolist() == [[2, 3], [1, 5]]
    assert pool.num_used == 11  # the evicted entries' slots are free again
    table.append(pool, torch.full((2, 2, 1, 4), 7.0), torch.full((2, 2, 1, 4), -7.0), torch.tensor([[5], [5]]))
    view = table.view(pool)
    assert table.lengths.tolist() == [[3, 4], [2, 6]]
    assert view.positions[0, 1, :4].tolist() == [1, 2, 4, 5]
    assert torch.equal(view.keys[0, 1, 2], keys[0, 1, 4]) and torch.equal(view.values[1, 0, 1], torch.full((4,), -7.0))
    assert view.valid[0, 0].tolist() == [True, True, True, False, False, False]


def test_hidden_stats_are_the_attention_input_moments_without_padding():
    model = tiny_model()
    cache = CompressedCache(model, hidden_stats=True, compress_on_prefill=False)
    ids = torch.randint(3, 128, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0
    model(ids, attention_mask=mask, past_key_values=cache)
    hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    obs = layers_of(cache)[0].observations
    assert torch.allclose(obs["hidden_mean"][0], hidden[0].mean(0), atol=1e-5)
    assert torch.allclose(obs["hidden_mean"][1], hidden[1, 5:].mean(0), atol=1e-5)
    assert torch.allclose(obs["hidden_std"][1], hidden[1, 5:].std(0, unbiased=False), atol=1e-5)
