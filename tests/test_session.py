"""The session: a plan across layers, forks that share a pool, release."""

import pytest
import torch

from common import layers_of, left_padded_batch, tiny_model
from kvcompress import CompressedCache, get_method


def _ids(n, seed=1):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_a_global_plan_gives_layers_different_sizes_within_one_budget():
    model = tiny_model(layers=4, seed=2)
    with torch.no_grad():  # peaked attention in some layers, flat in others, so that their needs differ
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.q_proj.weight.mul_(1 + 6 * (i % 2))
    method = get_method("snapkv+global", budget=24, window=8)
    assert method.plans_globally
    cache = CompressedCache(model, method)
    model(_ids(100), past_key_values=cache)
    per_layer = [int(layer.head_lengths().sum()) for layer in layers_of(cache)]
    per_head = torch.cat([layer.head_lengths().flatten() for layer in layers_of(cache)])
    assert sum(per_layer) == 24 * 4 * 2  # budget × layers × KV heads, exactly
    assert len(set(per_layer)) > 1 and len(set(per_head.tolist())) > 2  # layers and heads hold different amounts
    assert all(int(n) >= 8 for n in per_head)  # every head keeps its window
    assert cache.stats()["entries"] == 24 * 4 * 2 and cache.session.pool.num_used == 24 * 4 * 2
    # the plan ranks the unprotected entries of every layer and head on one scale
    uniform = CompressedCache(model, get_method("snapkv", budget=24, window=8))
    model(_ids(100), past_key_values=uniform)
    assert [int(layer.head_lengths().sum()) for layer in layers_of(uniform)] == [48] * 4


def test_global_plan_forks_like_it_compresses():
    model = tiny_model(layers=3)
    ids = _ids(90)
    method = get_method("adakv+global", ratio=0.3, window=8)
    direct = CompressedCache(model, method)
    model(ids, past_key_values=direct)
    shared = CompressedCache.shared(model, [method])
    model(ids, past_key_values=shared)
    forked = shared.fork(method)
    for a, b in zip(layers_of(direct), layers_of(forked)):
        assert torch.equal(a.view().positions, b.view().positions)


def test_forks_share_the_pool_and_give_their_slots_back():
    model = tiny_model()
    ids = _ids(60)
    shared = CompressedCache.shared(model, [get_method("h2o", budget=12), get_method("keepkv", budget=12, window=8)])
    model(ids, past_key_values=shared)
    pool = shared.session.pool
    prefill = pool.num_used
    assert prefill == 2 * 2 * 60  # layers × KV heads × tokens: one slot per entry
    fork = shared.fork(get_method("keepkv", budget=12, window=8))
    model.generate(ids, past_key_values=fork, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert pool.num_used > prefill  # its decoded entries and merged carriers
    fork.release()
    assert pool.num_used == prefill and fork.stats()["entries"] == 0
    assert int(pool.refs.max()) == 1  # the shared prefill holds its slots alone again


class _LayerByLayer:
    """A method whose decoding step runs layer by layer (the session's other path)."""

    def __init__(self, method):
        self._method = method

    def __getattr__(self, name):
        return getattr(self._method, name)

    decodes_all_layers = False


@pytest.mark.parametrize("name", ["streamingllm", "h2o", "momentkv", "keepkv", "cam", "d2o"])
def test_acting_on_every_layer_at_once_equals_layer_by_layer(name):
    """A step's edits for all layers applied after the last read = each layer's edit right after its read."""
    model = tiny_model(layers=3, seed=4)
    rows, batch, mask = left_padded_batch([70, 52], seed=3)
    method = get_method(name, budget=20, **({"window": 8} if name not in ("streamingllm", "h2o") else {}))
    assert method.decodes_all_layers
    stacked, layered = CompressedCache(model, method), CompressedCache(model, method)
    layered.session.method = _LayerByLayer(method)
    outs = [model.generate(batch, attention_mask=mask, past_key_values=cache, max_new_tokens=12, do_sample=False, pad_token_id=0)
            for cache in (stacked, layered)]
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(layers_of(stacked), layers_of(layered)):
        va, vb = a.view(), b.view()
        assert torch.equal(va.positions, vb.positions) and torch.allclose(va.keys, vb.keys)
        assert va.channels.keys() == vb.channels.keys()
        assert all(torch.allclose(va.channels[k], vb.channels[k], atol=1e-6) for k in va.channels)
    assert stacked.stats()["entries"] == layered.stats()["entries"]
    assert stacked.stats().get("merge_counts") == layered.stats().get("merge_counts")
