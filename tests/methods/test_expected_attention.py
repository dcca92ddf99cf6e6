"""Expected Attention: scores against a float64 reference written out head by head, the queries rotated back
before RoPE, the mean-only case as a plain softmax, budgets through the cache and ``kvc.generate``."""

import math

import pytest
import torch

import kvcompress as kvc
from common import kept_positions, layers_of, left_padded_batch, tiny_model
from conftest import tiny_tokenizer
from kvcompress import CompressedCache, get_method
from kvcompress.methods.budget import MAX_BUDGET
from kvcompress.methods.gvote import project_queries
from kvcompress.methods.rotary import apply_rotary, averaged_rotary
from kvcompress.read import attention_probs, group_queries


def _shared(model, ids, mask=None):
    """An uncompressed cache that recorded every prompt query and attention input."""
    cache = CompressedCache(model, compress_on_prefill=False, observation_window=MAX_BUDGET, hidden_states=True)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    return cache


def _ids(n, seed=1):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def rope_matrix(inv_freq, position):
    """R_p [d, d] float64 as transformers rotates: (R q)_i = q_i cos − q_{i+d/2} sin, (R q)_{i+d/2} = q_{i+d/2} cos + q_i sin."""
    half = inv_freq.shape[0]
    rot = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    for i in range(half):
        angle = position * float(inv_freq[i])
        c, s = math.cos(angle), math.sin(angle)
        rot[i, i], rot[i, i + half], rot[i + half, i], rot[i + half, i + half] = c, -s, s, c
    return rot


def reference_scores(queries, query_positions, keys, values, key_positions, inv_freq, scaling, *, window, sinks, future,
                     use_covariance=True, use_vnorm=True, epsilon=0.0):
    """One row, written out head by head in float64: queries [Hq, n, d] after RoPE at ``query_positions`` [n], keys and
    values [H, L, d] at ``key_positions`` [L]. Returns [H, L] (0 on the sinks)."""
    hq, n, d = queries.shape
    heads = keys.shape[0]
    group = hq // heads
    chosen = [i for i in range(n)[-window if window else 0 :] if int(query_positions[i]) >= sinks]
    last = int(query_positions[-1])
    mean_rotation = sum(rope_matrix(inv_freq, t) for t in range(last + 1, last + 1 + future)) / future
    counted = [j for j in range(keys.shape[1]) if int(key_positions[j]) >= sinks]
    scores = torch.zeros(heads, keys.shape[1], dtype=torch.float64)
    for h in range(heads):
        for g in range(group):
            head = h * group + g
            pre = torch.stack([rope_matrix(inv_freq, int(query_positions[i])).T @ queries[head, i].double() for i in chosen])
            mu = pre.mean(0)
            sigma = (pre - mu).T @ (pre - mu) / len(chosen)
            mu_bar = mean_rotation @ mu
            sigma_bar = mean_rotation @ sigma @ mean_rotation.T
            logits = []
            for j in counted:
                k = keys[h, j].double()
                z = scaling * float(mu_bar @ k)
                if use_covariance:
                    z += scaling**2 * float(k @ sigma_bar @ k) / 2
                logits.append(z)
            scores[h, counted] += torch.softmax(torch.tensor(logits, dtype=torch.float64), 0) / group
        if use_vnorm:
            norms = values[h].double().norm(dim=-1)
            scores[h, counted] = (scores[h, counted] + epsilon) * norms[counted]
    return scores


@pytest.mark.parametrize("kind,options", [
    ("llama", {}),
    ("qwen3", {"window": 24, "sinks": 2, "future": 16}),
    ("qwen2", {"sinks": 0, "future": 64, "epsilon": 0.02}),
    ("llama", {"use_covariance": False, "window": 8}),
])
def test_scores_equal_a_float64_reference(kind, options):
    model = tiny_model(kind)
    shared = _shared(model, _ids(50))
    method = get_method("expected_attention", ratio=0.25, **options)
    for layer in layers_of(shared):
        view, context = layer.view(), layer.context()
        got = method.score.score(view, context)
        obs = context.observations
        want = reference_scores(obs["window_queries"][0], obs["window_positions"][0], view.keys[0], view.values[0],
                                view.positions[0, 0], model.model.rotary_emb.inv_freq, context.scaling,
                                window=method.score.window, sinks=method.score.sinks, future=method.score.future,
                                use_covariance=method.score.use_covariance, epsilon=method.score.epsilon)
        assert torch.allclose(got[0].double(), want, rtol=1e-4, atol=1e-6), (kind, options)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2"])
def test_queries_rotated_back_are_the_projected_pre_rope_queries(kind):
    """The window queries rotated back at their own positions equal W_q h (+ bias, + q-norm) of the attention input."""
    from kvcompress.methods.expected_attention import unrotate_queries

    model = tiny_model(kind)
    shared = _shared(model, _ids(40))
    for layer in layers_of(shared):
        context = layer.context()
        obs = context.observations
        with torch.no_grad():
            projected = project_queries(context.module, obs["hidden_states"], 16)
        pre = unrotate_queries(obs["window_queries"], obs["window_positions"], context.rotary)
        assert torch.allclose(pre, projected, atol=1e-5)


def test_mean_only_without_value_norm_is_the_softmax_of_the_rotated_mean_query():
    model = tiny_model(seed=4)
    shared = _shared(model, _ids(45, seed=3))
    method = get_method("expected_attention", ratio=0.5, use_covariance=False, use_vnorm=False, sinks=3, future=32)
    for layer in layers_of(shared):
        view, context = layer.view(), layer.context()
        obs = context.observations
        with torch.no_grad():
            mean = project_queries(context.module, obs["hidden_states"][:, 3:], 16).mean(dim=2, keepdim=True)  # [B, Hq, 1, d]
        last = obs["window_positions"][:, -1]
        cos, sin = averaged_rotary(context.rotary, last + 1, 32, mean)
        rotated = apply_rotary(mean, cos, sin)
        not_sinks = view.positions >= 3
        probs = attention_probs(group_queries(rotated, 2), view.keys, context.scaling, (last + 1)[:, None], view.positions,
                                not_sinks)
        want = probs[:, :, :, 0].mean(dim=2)
        got = method.score.score(view, context)
        assert torch.allclose(got, want, atol=1e-6)
        assert torch.allclose(got.sum(-1), torch.ones(1, 2))  # each head's scores are a distribution over its keys


def test_keeps_exactly_its_budget_per_head_and_ratio_one_equals_full():
    model = tiny_model(layers=3, seed=2)
    tokenizer = tiny_tokenizer()
    gen = torch.Generator().manual_seed(5)
    context = " ".join(f"w{int(x)}" for x in torch.randint(2, 60, (80,), generator=gen))
    cache = CompressedCache(model, get_method("expected_attention", ratio=0.25))
    ids = tokenizer(context, return_tensors="pt").input_ids
    with torch.no_grad():
        model(ids, past_key_values=cache)
    budget = ids.shape[1] // 4
    for layer in layers_of(cache):
        assert layer.head_lengths().tolist() == [[budget, budget]]
        assert all(set(range(4)) <= set(head) for head in kept_positions(layer)[0])  # the 4 sinks are protected
    out = kvc.generate(model, tokenizer, context, "w3 w4", "expected_attention", ratio=0.25, max_new_tokens=6)
    assert out.stats["entries_per_head"] == out.stats["context_tokens"] // 4
    full = kvc.generate(model, tokenizer, context, "w3 w4", "full", max_new_tokens=12)
    same = kvc.generate(model, tokenizer, context, "w3 w4", get_method("expected_attention", ratio=1.0), max_new_tokens=12)
    assert same.token_ids == full.token_ids and len(full.token_ids) == 12


def test_padded_rows_score_as_they_would_alone():
    """Left padding is out of the statistics and the normalisation: each row keeps what it keeps alone."""
    model = tiny_model(seed=3)
    rows, batch, mask = left_padded_batch([60, 37], seed=4)
    method = get_method("expected_attention", budget=12, window=48)
    cache = CompressedCache(model, method)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate() numbers left-padded rows
    with torch.no_grad():
        model(batch, attention_mask=mask, position_ids=positions, past_key_values=cache)
    for i, row in enumerate(rows):
        alone = CompressedCache(model, method)
        with torch.no_grad():
            model(row, past_key_values=alone)
        for together, single in zip(layers_of(cache), layers_of(alone)):
            assert kept_positions(together)[i] == kept_positions(single)[0]


def test_builds_with_kvpress_defaults_and_checks_its_options():
    method = get_method("expected_attention", ratio=0.5)
    assert method.name == "expected_attention" and method.ratio == 0.5 and method.variant == "expected_attention"
    score = method.score
    assert (score.window, score.future, score.sinks, score.use_covariance, score.use_vnorm, score.epsilon) == \
        (None, 512, 4, True, True, 0.0)
    assert method.needs().window == MAX_BUDGET and method.always_kept == 4
    assert get_method("expected_attention:window=16:epsilon=0.02", budget=8).needs().window == 16
    assert get_method("expected_attention:window=16", budget=8).label == "expected_attention@8[window=16]"
    for bad in ({"window": 0}, {"future": 0}, {"epsilon": -1.0}):
        with pytest.raises(ValueError):
            get_method("expected_attention", ratio=0.5, **bad)
    with pytest.raises(ValueError, match="CompressedCache"):  # no rotary embedding outside a model's cache
        from common import random_layer

        layer, _, _, _, _ = random_layer(length=20)
        layer.compress(get_method("expected_attention", budget=8))
