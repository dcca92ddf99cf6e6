"""KVzip: the replay's scores against a float64 recomputation, its sizes, and the replay's inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, DynamicCache

from common import layers_of, tiny_model
from kvcompress import CompressedCache, get_method
from kvcompress.hf.replay import QUOTED, ReplayPrompts
from kvcompress.kernels import cpu_kernels
from kvcompress.read import attend_with_max_weights, replay_attention
from kvcompress.store.slots import LENGTH_BYTES


def _reference_max_weights(query, keys, values, key_pos, valid, new_k, new_v, q_pos, scaling):
    """Loops in float64: each query over the held entries and the new ones up to itself."""
    b, hq, q, d = query.shape
    h, length = keys.shape[1], keys.shape[2]
    group = hq // h
    out = torch.zeros(b, hq, q, d, dtype=torch.float64)
    best = torch.zeros(b, h, length, dtype=torch.float64)
    for row in range(b):
        for head in range(hq):
            kv = head // group
            for t in range(q):
                seen = [j for j in range(length) if bool(valid[row, kv, j]) and key_pos[row, kv, j] <= q_pos[row, t]]
                ks = torch.cat([keys[row, kv, seen], new_k[row, kv, : t + 1]]).double()
                vs = torch.cat([values[row, kv, seen], new_v[row, kv, : t + 1]]).double()
                probs = torch.softmax(ks @ query[row, head, t].double() * scaling, dim=0)
                out[row, head, t] = probs @ vs
                for slot, j in enumerate(seen):
                    best[row, kv, j] = max(best[row, kv, j], probs[slot])
    return out, best


@settings(max_examples=25, deadline=None)
@given(length=st.integers(1, 12), q=st.integers(1, 6), group=st.sampled_from([1, 2, 3]), block=st.integers(1, 4),
       holes=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), d=st.sampled_from([8, 64]),
       seed=st.integers(0, 10**6))
def test_replay_attention_equals_a_float64_loop(length, q, group, block, holes, dtype, d, seed):
    """In float32, and in bfloat16 (the engine's: with a head dim of 64, through ``replay_chunk`` where the CPU has
    AVX512-BF16) against the loop over the same bfloat16 numbers: the scores as close as float32 sums allow, the output
    as its bfloat16 rounding."""
    gen = torch.Generator().manual_seed(seed)
    b, h = 2, 2
    keys, values = torch.randn(b, h, length, d, generator=gen).to(dtype), torch.randn(b, h, length, d, generator=gen).to(dtype)
    key_pos = torch.arange(length).expand(b, h, length).clone()
    valid = torch.ones(b, h, length, dtype=torch.bool)
    if holes:
        valid = torch.rand(b, h, length, generator=gen) > 0.3
    query = torch.randn(b, h * group, q, d, generator=gen).to(dtype)
    new_k, new_v = torch.randn(b, h, q, d, generator=gen).to(dtype), torch.randn(b, h, q, d, generator=gen).to(dtype)
    q_pos = torch.arange(length, length + q).expand(b, q)
    ref_out, ref_best = _reference_max_weights(query, keys, values, key_pos, valid, new_k, new_v, q_pos, 0.3)
    given_valid = valid if holes else None  # no holes: the fast path's one mask for every head
    out_tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    # the flash kernel's log-sum-exp over bfloat16 numbers (the masked path's) is good to about 1e-4
    best_tolerance = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-5, "rtol": 1e-4}
    for attend in (attend_with_max_weights, replay_attention):  # the float32 oracle, and the fast path the session takes
        out, best = attend(query, keys, values, key_pos, given_valid, new_k, new_v, q_pos, 0.3, block=block)
        torch.testing.assert_close(out.double(), ref_out, atol=out_tolerance, rtol=out_tolerance)
        torch.testing.assert_close(best.double(), ref_best, **best_tolerance)


bf16_dots = pytest.mark.skipif(cpu_kernels() is None or not cpu_kernels().replay_chunk_available(),
                               reason="replay_chunk needs the CPU kernels and AVX512-BF16")


@bf16_dots
@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), group=st.integers(1, 3), chunk=st.integers(1, 9),
       held=st.integers(0, 140), d=st.sampled_from([64, 128]), seed=st.integers(0, 10**6))
def test_replay_chunk_equals_a_float64_softmax(batch, heads, group, chunk, held, d, seed):
    """The compiled replay chunk, for any row count (tasks of six rows, across the group's queries), held count (key
    tiles of 64, value pairs, none at all) and head dim of 64s: row g · q + t's softmax over the held entries and the
    chunk's first t + 1, and each held entry's largest logit less its row's log-sum-exp."""
    gen = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randn(batch, heads, n, d, generator=gen).to(torch.bfloat16)

    rows, keys, values, new_keys, new_values = rand(group * chunk), rand(held), rand(held), rand(chunk), rand(chunk)
    out, best = cpu_kernels().replay_chunk(rows, keys, values, new_keys, new_values, 0.2)
    every_key, every_value = torch.cat([keys, new_keys], dim=2).double(), torch.cat([values, new_values], dim=2).double()
    logits = rows.double() @ every_key.transpose(-1, -2) * 0.2  # [B, H, G·q, L + q]
    token = torch.arange(group * chunk) % chunk
    hidden = torch.arange(held + chunk)[None, :] > held + token[:, None]  # the chunk's later tokens
    logits = logits.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    torch.testing.assert_close(out.double(), torch.softmax(logits, dim=-1) @ every_value, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(best.double(), (logits[..., :held] - lse[..., None]).amax(dim=2), atol=1e-5, rtol=1e-5)


@bf16_dots
def test_replay_chunk_refuses_what_it_cannot_take():
    kernels = cpu_kernels()
    rows, keys = torch.randn(1, 1, 2, 64).to(torch.bfloat16), torch.randn(1, 1, 5, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="rows, bfloat16"):
        kernels.replay_chunk(rows.float(), keys, keys, keys[:, :, :2], keys[:, :, :2], 1.0)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        small = keys[..., :32]
        kernels.replay_chunk(rows[..., :32], small, small, small[:, :, :2], small[:, :, :2], 1.0)
    with pytest.raises(RuntimeError, match="rows G·q"):
        kernels.replay_chunk(rows, keys, keys, keys[:, :, :3], keys[:, :, :3], 1.0)
    with pytest.raises(RuntimeError, match="as many values as keys"):
        kernels.replay_chunk(rows, keys, keys[:, :, :4], keys[:, :, :2], keys[:, :, :2], 1.0)


def test_replay_inputs_cover_the_prompt_in_chunks_each_after_its_prompt():
    prompts = ReplayPrompts(first=[900, 901], later=[910], turn=[920])
    ids = list(range(25))
    inputs = prompts.inputs(ids, 10)
    assert inputs[0] == [900, 901, 920, *range(10)]
    assert inputs[1] == [910, *range(10 - QUOTED, 10), 920, *range(10, 20)]
    assert inputs[2] == [910, *range(20 - QUOTED, 20), 920, *range(20, 25)]
    assert prompts.inputs(ids, 100) == [[900, 901, 920, *ids]]


def test_replay_prompts_take_the_chat_templates_turn(embedded):
    _, tokenizer = embedded
    prompts = ReplayPrompts.from_tokenizer(tokenizer)
    assert tokenizer.decode(prompts.turn) == "<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(prompts.first) == "\n\nRepeat the previous context exactly."


@pytest.mark.parametrize("chunk", [2048, 16])
def test_kvzip_scores_equal_a_float64_recomputation(chunk):
    """S[l, h, i] = the most attention any replay query of head h's group pays entry i, from an eager float64
    model given the same inputs (one chunk, or three chunks each over the whole prompt)."""
    model = tiny_model(seed=4).double()
    tokenizer = AutoTokenizer.from_pretrained(model.config.name_or_path)
    ids = torch.randint(3, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    prefix = DynamicCache(config=eager.config)
    with torch.no_grad():
        eager(ids, past_key_values=prefix, use_cache=True)
        expected = torch.zeros(2, 1, 2, 40, dtype=torch.float64)
        for replay_ids in ReplayPrompts.from_tokenizer(tokenizer).inputs(ids[0].tolist(), chunk):
            attentions = eager(torch.tensor([replay_ids]), past_key_values=copy.deepcopy(prefix), use_cache=True,
                               output_attentions=True).attentions
            for layer, probs in enumerate(attentions):  # [1, Hq, m, 40 + m]
                per_kv_head = probs[..., :40].view(1, 2, 2, len(replay_ids), 40).amax(dim=(2, 3))
                expected[layer] = torch.maximum(expected[layer], per_kv_head)
    cache = CompressedCache(model, compress_on_prefill=False, replay=chunk)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    for layer, state in enumerate(layers_of(cache)):
        torch.testing.assert_close(state.observations["replay_scores"].double(), expected[layer], atol=1e-6, rtol=1e-5)


def test_kvzip_keeps_one_budget_over_layers_and_heads_and_the_bytes_follow():
    model = tiny_model(seed=6, layers=3)
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(1))
    cache = CompressedCache(model, get_method("kvzip", budget=20))
    model(ids, past_key_values=cache)
    lengths = torch.stack([layer.head_lengths()[0] for layer in layers_of(cache)])  # [layers, heads]
    assert int(lengths.sum()) == 20 * 3 * 2  # budget × layers × KV heads
    assert len(set(lengths.flatten().tolist())) > 1  # heads keep what their scores earn
    for layer in layers_of(cache):
        assert bool((layer.view().positions[0, :, :4] == torch.arange(4)).all())  # the sinks stay
    stats, table = cache.stats(), cache.session.table
    per_entry = 2 * 16 * 4 + table.entry_metadata_bytes()  # keys and values of 16 floats, a slot id and a position
    assert stats["kv_bytes"] == stats["entries"] * per_entry + 3 * 2 * LENGTH_BYTES  # and a length per layer and head
    assert cache.timings["compress_s"] > 0


def test_kvzip_at_ratio_one_and_uniform_layers_keep_their_sizes():
    model = tiny_model(seed=6)
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(2))
    cache = CompressedCache(model, get_method("kvzip+uniform", budget=12))
    model(ids, past_key_values=cache)
    for layer in layers_of(cache):
        assert layer.head_lengths()[0].tolist() == [12, 12]


def test_kvzip_refuses_what_it_cannot_replay():
    model = tiny_model()
    with pytest.raises(ValueError, match="chunk"):
        get_method("kvzip", ratio=0.5, chunk=0)
    cache = CompressedCache(model, get_method("kvzip", ratio=0.5))
    embeds = model.model.embed_tokens(torch.randint(3, 128, (1, 20)))
    with pytest.raises(ValueError, match="input_ids"):
        model(inputs_embeds=embeds, past_key_values=cache)
    padded = CompressedCache(model, get_method("kvzip", ratio=0.5))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :4] = 0
    with pytest.raises(ValueError, match="unpadded"):
        model(torch.randint(3, 128, (2, 20)), attention_mask=mask, past_key_values=padded)


def test_a_fork_of_a_replayed_prefill_equals_kvzip_directly_and_carries_the_replays_cost():
    model = tiny_model(seed=7)
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(3))
    method = get_method("kvzip", budget=15)
    shared = CompressedCache.shared(model, [method, get_method("snapkv", budget=15, window=8)])
    model(ids, past_key_values=shared)
    direct = CompressedCache(model, method)
    model(ids, past_key_values=direct)
    forked = shared.fork(method)
    for a, b in zip(layers_of(direct), layers_of(forked)):
        assert torch.equal(a.view().positions, b.view().positions)
    assert shared.timings["replay_s"] > 0 and forked.timings["compress_s"] >= shared.timings["replay_s"]


SCORERS = {"kvzip": {}, "snapkv": {"window": 8}, "expected_attention": {}}


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(sorted(SCORERS)), tau=st.floats(0.0, 0.3), cap=st.sampled_from([0.2, 0.5, 1.0]),
       seed=st.integers(0, 3))
def test_threshold_sizes_keep_what_passes_up_to_the_cap_and_the_protected_always(name, tau, cap, seed):
    model = tiny_model(seed=seed)
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(seed))
    method = get_method(f"{name}+threshold:tau={tau!r}", ratio=cap, **SCORERS[name])
    shared = CompressedCache.shared(model, [method])
    model(ids, past_key_values=shared)
    forked = shared.fork(method)
    session = shared.session
    for i, layer in enumerate(layers_of(forked)):
        view, context = session.view(i), session.context(i)
        scores = method.score.score(view, context)
        caps = method.row_budgets(context)
        protected = method.score.protected(view, context, caps)
        expected = torch.minimum(((scores >= tau) | protected).sum(-1), torch.maximum(caps[:, None], protected.sum(-1)))
        assert torch.equal(layer.head_lengths(), expected)
        kept = layer.view().positions[0]
        for head in range(2):
            assert set(view.positions[0, head][protected[0, head]].tolist()) <= set(kept[head].tolist())
    stats, per_entry = forked.stats(), 2 * 16 * 4 + forked.session.table.entry_metadata_bytes()
    assert stats["kv_bytes"] == stats["entries"] * per_entry + 2 * 2 * LENGTH_BYTES  # the bytes follow the entries


def test_threshold_sizes_follow_the_content_and_ratio_one_at_zero_is_full(embedded):
    model, tokenizer = embedded
    texts = ["The quarterly report lists revenue of 4.2 million, costs of 3.1 million and a new office in Lyon. " * 4,
             "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n" * 6]
    held = []
    for text in texts:
        ids = torch.tensor([tokenizer(text).input_ids])
        cache = CompressedCache(model, get_method("kvzip+threshold:tau=0.02", ratio=1.0), tokenizer=tokenizer)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        lengths = torch.stack([layer.head_lengths()[0] for layer in layers_of(cache)])  # [layers, heads]
        assert len(set(lengths.flatten().tolist())) > 1  # heads keep different counts
        assert cache.stats()["entries"] == int(lengths.sum()) < ids.shape[1] * lengths.numel()
        held.append(int(lengths.sum()) / ids.shape[1])
    assert held[0] != held[1]  # and prompts keep different shares
    small = tiny_model(seed=8)
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(5))
    everything = CompressedCache(small, get_method("kvzip+threshold:tau=0.0", ratio=1.0))
    out = small.generate(ids, past_key_values=everything, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, small.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
