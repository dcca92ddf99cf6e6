"""The session: a plan across layers, forks that share a pool, release."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common import kept_positions, layers_of, left_padded_batch, tiny_model
from kvcompress import CompressedCache, get_method
from kvcompress.session import Session
from kvcompress.store.slots import PoolExhausted, SlotPool


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


# ----- a prompt prefilled in chunks ------------------------------------------------------------
CHUNKED_METHODS = ["full", "snapkv:budget=12:window=4", "h2o:budget=12", "quest:budget=16", "keepkv:budget=12",
                   "adakv:budget=12:window=4", "snapkv:budget=12:window=4+kivi:bits=4"]


def _prefill_in_pieces(method, queries, keys, values, cuts):
    """A one-layer session with the prompt prefilled in the pieces ``cuts`` makes; the outputs joined."""
    session = Session(method, SlotPool(keys.shape[-1]), num_layers=1, num_kv_heads=keys.shape[1])
    positions = torch.arange(keys.shape[2])[None]
    bounds = [0, *cuts, keys.shape[2]]
    outs = []
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        part = (queries[:, :, start:end], keys[:, :, start:end], values[:, :, start:end], positions[:, start:end])
        final = end == keys.shape[2]
        if i == 0:
            outs.append(session.prefill(0, *part, keys.shape[-1] ** -0.5, final=final))
        else:
            outs.append(session.prefill_more(0, *part, final=final))
    return session, torch.cat(outs, dim=2)


@settings(max_examples=30, deadline=None)
@given(length=st.integers(2, 70), cuts=st.sets(st.integers(1, 69), max_size=4), spec=st.sampled_from(CHUNKED_METHODS),
       seed=st.integers(0, 2**16))
def test_a_prompt_prefilled_in_chunks_equals_one_prefill(length, cuts, spec, seed):
    """The outputs, the entries kept and what a method decodes from equal one prefill of the whole prompt (the
    chunks attend the prompt so far; the window, the attention sums and the key pages grow as one prefill's)."""
    g = torch.Generator().manual_seed(seed)
    heads, group, dim = 2, 2, 8
    keys, values = torch.randn(1, heads, length, dim, generator=g), torch.randn(1, heads, length, dim, generator=g)
    queries = torch.randn(1, heads * group, length, dim, generator=g) * 2
    whole, whole_out = _prefill_in_pieces(get_method(spec), queries, keys, values, [])
    chunked, chunked_out = _prefill_in_pieces(get_method(spec), queries, keys, values, sorted(c for c in cuts if c < length))
    torch.testing.assert_close(chunked_out, whole_out, atol=2e-5, rtol=1e-4)
    a, b = whole.view(0), chunked.view(0)
    assert torch.equal(a.lengths, b.lengths)
    assert torch.equal(a.positions, b.positions)  # the same entries kept, in the same places
    torch.testing.assert_close(b.keys, a.keys, atol=2e-5, rtol=1e-4)  # merges (KeepKV) rewrite kept entries
    assert whole.pool.num_used == chunked.pool.num_used and whole.kv_bytes() == chunked.kv_bytes()
    step = torch.randn(1, heads * group, 1, dim, generator=g), torch.randn(1, heads, 1, dim, generator=g)
    at = torch.tensor([[length]])
    torch.testing.assert_close(chunked.decode(0, step[0], step[1], step[1], at), whole.decode(0, step[0], step[1], step[1], at),
                               atol=2e-5, rtol=1e-4)


def test_a_chunked_prefill_refuses_what_it_cannot_extend():
    method = get_method("gvote")
    session = Session(method, SlotPool(8), num_layers=1, num_kv_heads=1)
    x = torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="no prompt being prefilled in chunks"):
        session.prefill_more(0, x, x, x, torch.arange(4)[None])
    session.prefill(0, x, x, x, torch.arange(4)[None], 8**-0.5, final=False)
    with pytest.raises(ValueError, match="prefilled in one piece"):
        session.prefill_more(0, x, x, x, torch.arange(4, 8)[None])
    with pytest.raises(ValueError, match="one unpadded row"):
        Session(get_method("full"), SlotPool(8), num_layers=1, num_kv_heads=1).prefill(
            0, x, x, x, torch.arange(4)[None], 8**-0.5, token_valid=torch.tensor([[False, True, True, True]]), final=False)


def test_begin_step_records_a_slot_per_layer_and_head_at_the_step_position():
    """The engine's step: every layer gains one entry per KV head at the position, in the slots returned (the keys
    are written there afterwards); a session of several rows is refused, and a pool without room leaves nothing."""
    model = tiny_model(layers=3)
    cache = CompressedCache(model, get_method("snapkv", budget=12, window=4))
    model(_ids(40), past_key_values=cache)
    session = cache.session
    before = session.table.lengths.clone()
    used, reads = session.pool.num_used, list(session.reads)
    slots = session.begin_step(40)
    assert slots.shape == (3, session.num_kv_heads) and session.pool.num_used == used + slots.numel()
    assert torch.equal(session.table.lengths, before + 1)
    for layer in range(3):
        view = session.view(layer)
        last = view.lengths[0] - 1  # [H]: each head's newest entry
        assert torch.equal(view.positions[0].gather(-1, last[:, None])[:, 0], torch.full((session.num_kv_heads,), 40))
        assert torch.equal(session.table.ids[layer, :, :, 0].gather(-1, last[:, None].to(torch.long))[:, 0].long(), slots[layer])
    assert session.reads[0] == reads[0] + int(session.table.lengths.sum())  # SnapKV only reads: counted here
    batch = CompressedCache(model, get_method("snapkv", budget=12, window=4))
    model(torch.cat([_ids(40), _ids(40, seed=2)]), past_key_values=batch)
    with pytest.raises(ValueError, match="one request"):
        batch.session.begin_step(40)
    fixed = SlotPool(session.pool.head_dim, capacity=1000)
    full = CompressedCache(model, get_method("snapkv", budget=12, window=4), pool=fixed)
    model(_ids(40), past_key_values=full)
    filler = fixed.allocate(fixed.capacity - fixed.num_used)  # no room left
    lengths, used = full.session.table.lengths.clone(), fixed.num_used
    with pytest.raises(PoolExhausted):
        full.session.begin_step(40)
    assert torch.equal(full.session.table.lengths, lengths) and fixed.num_used == used
    fixed.release(filler)


def test_a_forward_stopped_part_way_leaves_the_layers_it_did_not_reach_without_the_step():
    """One request's decoding step is begun at its first layer for every layer (``begin_step``); a forward that stops
    after layer 1 leaves layers 0 and 1 with the token and layer 2 without it, its recorded slot given back, once the
    next step comes: as appending layer by layer would have left them, with no slot held twice or leaked."""
    model = tiny_model(layers=3)
    cache = CompressedCache(model, get_method("snapkv", budget=12, window=4))
    model(_ids(40), past_key_values=cache)
    session = cache.session

    def stop(*_):
        raise RuntimeError("stopped")

    hook = model.model.layers[1].register_forward_hook(stop)
    with pytest.raises(RuntimeError, match="stopped"):
        model(_ids(1, seed=3), past_key_values=cache)
    hook.remove()
    model(_ids(1, seed=4), past_key_values=cache)
    held = [[sorted(row) for row in layer[0]] for layer in map(kept_positions, layers_of(cache))]
    assert all(40 in row and 41 in row for layer in held[:2] for row in layer)
    assert all(40 not in row and 41 in row for row in held[2])
    assert [layer.seen for layer in session.layers] == [42, 42, 41]
    assert session.pool.num_used == int(session.table.lengths.sum()) == session.table.held_slots().numel()


@pytest.mark.parametrize("spec", [("adakv", {"budget": 12}), ("h2o", {"budget": 10}), ("kivi", {"bits": 2, "group_size": 8}), ("full", {})])
def test_stats_sum_what_each_layer_holds_and_has_seen(spec):
    """``stats`` and ``kv_bytes`` count every layer at once (a plain pool's table in one pass, tokens seen from the
    layers' counts): the sums of each layer's bytes, entries and tokens seen, over a left-padded batch whose heads keep
    ragged sizes, and again with a layer released."""
    name, options = spec
    model = tiny_model(layers=3, seed=2)
    _, batch, mask = left_padded_batch([37, 22], seed=5)
    cache = CompressedCache(model, get_method(name, **options))
    model.generate(batch, attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False, pad_token_id=0)
    session = cache.session
    per_token = 2 * session.num_kv_heads * session.pool.head_dim * session.pool.arrays["keys"].element_size()
    for _ in range(2):
        present = session._present()
        stats = session.stats()
        seen = sum(int(session.layers[i].tokens_seen.sum()) for i in present)
        assert session.kv_bytes() == stats["kv_bytes"] == sum(session.layer_bytes(i) for i in present)
        assert stats["entries"] == sum(session.table.num_entries(session.rows(i)) for i in present)
        assert stats["entries_full"] == seen * session.num_kv_heads
        assert session.kv_bytes_full() == stats["kv_bytes_full"] == seen * per_token
        session.layers[1] = None  # as a released layer: counted no more
