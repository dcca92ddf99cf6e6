"""Merging machinery and the convex baselines (CaM, D2O): attention sag against KeepKV's exactness."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcompress.methods.merging as merging
from common import layers_of, left_padded_batch, random_layer, tiny_model
from kvcompress import CompressedCache, get_method
from kvcompress.kernels import cpu_kernels
from kvcompress.methods.merging import MergePlan, group_mean, group_weights, leaving_pairs_torch, nearest_carriers, relative_error
from kvcompress.read import group_queries


def _reference_output(layer, q, scaling):
    """q [B, H, d] float64 over what the layer holds (votes included): output [B, H, d], lse [B, H]."""
    view = layer.view()
    logits = torch.einsum("bhd,bhld->bhl", q, view.keys.double()) * scaling
    if view.log_weights is not None:
        logits = logits + view.log_weights.double()
    if view.valid is not None:
        logits = logits.masked_fill(~view.valid, float("-inf"))
    return torch.einsum("bhl,bhld->bhd", torch.softmax(logits, -1), view.values.double()), torch.logsumexp(logits, -1)


@pytest.mark.parametrize("name,options", [("keepkv", {"max_key_scale": float("inf")}), ("keepkv", {}), ("cam", {}), ("d2o", {"similarity_threshold": -1.0}), ("d2o", {})])
def test_both_sides_of_the_argument(name, options):
    """KeepKV keeps q̄'s output and attention mass; convex merges lose mass (attention sag) and the output."""
    layer, context, _, _, _ = random_layer(batch=2, heads=2, group=2, length=96, dim=16, window=8, seed=1, lengths=[96, 70])
    q = group_queries(layer.observations["window_queries"].double(), 2).mean(dim=(2, 3))
    expected, lse_before = _reference_output(layer, q, context.scaling)
    layer.compress(get_method(name, budget=24, window=8, **options))
    out, lse_after = _reference_output(layer, q, context.scaling)
    error = relative_error(out, expected)
    assert layer.state["merge_error"] == pytest.approx(error, rel=1e-3, abs=1e-6)
    if name == "keepkv":
        assert error <= 1e-4
        if options:  # the paper's rule: exact without any fallback
            assert layer.counts.get("zip_fallbacks", 0) == 0
        assert torch.allclose(lse_after, lse_before, atol=1e-4)
    else:
        assert layer.view().log_weights is None  # no votes
        assert bool((lse_after < lse_before).all())  # Σ_j exp(logit_j) shrank in every head
        assert error > 1e-3
        if options:
            assert layer.counts["dropped"] == 0  # pure merging: the mass went in the convex mix itself


def test_cam_keeps_carrier_keys_and_d2o_mixes_them():
    layer, context, _, _, _ = random_layer(length=64, dim=8, window=8, seed=2)
    keys = layer.view().keys.clone()
    cam, d2o = layer.clone(), layer.clone()
    cam.compress(get_method("cam", budget=16, window=8))
    d2o.compress(get_method("d2o", budget=16, window=8, similarity_threshold=-1.0))
    for compressed, same in ((cam, True), (d2o, False)):
        view = compressed.view()
        original = keys.gather(2, view.positions[..., None].expand(-1, -1, -1, 8))
        assert torch.equal(view.positions, view.positions.sort(-1).values)  # entries stay in position order
        assert torch.equal(view.keys, original) == same


def test_d2o_moving_threshold_drops_the_least_similar_half_or_so():
    layer, context, _, _, _ = random_layer(batch=2, length=80, dim=8, window=8, seed=3)
    layer.compress(get_method("d2o", budget=16, window=8))
    threshold = layer.state["d2o_threshold"]
    assert threshold.shape == (2,) and bool(((threshold > -1.0) & (threshold < 1.0)).all())
    assert 0 < layer.counts["dropped"] < 2 * 2 * 64 and layer.counts["merged"] + layer.counts["dropped"] == 2 * 2 * 64


def test_nearest_carriers_matches_a_loop():
    gen = torch.Generator().manual_seed(4)
    keys = torch.randn(2, 3, 30, 8, generator=gen)
    candidates = torch.rand(2, 3, 30, generator=gen) < 0.5
    carriers = ~candidates & (torch.rand(2, 3, 30, generator=gen) < 0.6)
    similarity, index = nearest_carriers(keys, candidates, carriers, chunk=4)
    unit = keys / keys.norm(dim=-1, keepdim=True)
    for b in range(2):
        for h in range(3):
            allowed = carriers[b, h].nonzero().flatten()
            for i in range(30):
                if not candidates[b, h, i]:
                    assert index[b, h, i] == i and similarity[b, h, i] == float("-inf")
                    continue
                sims = unit[b, h, allowed] @ unit[b, h, i]
                assert int(index[b, h, i]) == int(allowed[sims.argmax()])
                assert float(similarity[b, h, i]) == pytest.approx(float(sims.max()), abs=1e-6)


@settings(max_examples=120, deadline=None)
@given(rows=st.integers(1, 3), heads=st.integers(1, 3), length=st.integers(1, 24), spare=st.integers(0, 3),
       d=st.sampled_from([1, 5, 16, 64]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       levels=st.integers(1, 6), open_share=st.sampled_from([0.0, 0.3, 0.9, 1.0]), seed=st.integers(0, 2**16))
def test_the_compiled_leaving_pairs_equal_the_reference(rows, heads, length, spare, d, dtype, levels, open_share, seed):
    """A decoding step's merge pairs read where the keys live (``csrc/merge_pairs.cpp``) against ``leaving_pairs_torch``
    over the gathered keys: the same leaving entry (scores of few levels, so that ties take the first), similarities
    within float32 rounding, and a carrier whose similarity is the best within that rounding; slot tables as the store
    holds them (views of longer tables, slots in any order), heads with no open entry or only one."""
    gen = torch.Generator().manual_seed(seed)
    slots = 1 + torch.randperm(rows * heads * (length + spare) + 4, generator=gen)[: rows * heads * (length + spare)]
    tables = slots.view(rows, heads, length + spare).int()
    pool = torch.randn(int(slots.max()) + 1, d, generator=gen).to(dtype)
    score = torch.randint(0, levels, (rows, heads, length), generator=gen).float()
    open_ = torch.rand(rows, heads, length, generator=gen) < open_share
    leaving, carrier, similarity = cpu_kernels().merge_pairs(pool, list(tables.unbind(0)), score, open_)
    keys = pool[tables[..., :length].long()]
    expected_leaving, expected_carrier, expected_similarity = leaving_pairs_torch(keys, score, open_)
    assert torch.equal(leaving, expected_leaving)
    torch.testing.assert_close(similarity, expected_similarity, atol=1e-5, rtol=0)
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    chosen = (unit.gather(2, carrier[..., None, None].expand(-1, -1, 1, d))[:, :, 0] *
              unit.gather(2, leaving[..., None, None].expand(-1, -1, 1, d))[:, :, 0]).sum(-1)
    found = torch.isfinite(expected_similarity)
    assert torch.equal(torch.isfinite(similarity), found)
    assert torch.equal(carrier[~found], expected_carrier[~found])  # none: column 0, as the reference's
    torch.testing.assert_close(chosen[found], expected_similarity[found], atol=1e-5, rtol=0)
    assert bool((open_.gather(2, carrier[..., None])[..., 0] | ~found).all()) and bool((carrier != leaving)[found].all())


@pytest.mark.parametrize("name", ["keepkv", "cam", "d2o"])
def test_decoding_merges_the_same_pairs_without_the_compiled_search(name, monkeypatch):
    """The merging methods' decoding steps give the same tokens and the same merge tallies whether the pairs come from
    the compiled search over the keys where they live or from the reference over the gathered keys."""
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(7))

    def run():
        cache = CompressedCache(model, get_method(name, budget=16))
        out = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False, pad_token_id=0)
        return out[0, 40:].tolist(), dict(cache.session.counts)

    compiled = run()
    monkeypatch.setattr(merging, "cpu_kernels", lambda: None)
    assert run() == compiled and compiled[1]["merged"] + compiled[1].get("dropped", 0) > 0


def test_group_means_are_shifted_weighted_means_at_the_carriers():
    keep = torch.tensor([[[True, True, False, False, False]]])
    merged = torch.tensor([[[False, False, True, True, False]]])  # entry 4 is dropped
    plan = MergePlan(keep=keep, merged=merged, dropped=~keep & ~merged, target=torch.tensor([[[0, 1, 0, 0, 4]]]),
                     similarity=torch.zeros(1, 1, 5))
    x = torch.randn(1, 1, 5, 3)
    log_w = torch.tensor([[[900.0, -3.0, 901.0, 899.0, 5.0]]])  # e^900 overflows even float64
    weights = group_weights(log_w, plan)
    mean = group_mean(x, weights, plan)
    w = torch.softmax(torch.tensor([900.0, 901.0, 899.0], dtype=torch.float64), 0)
    assert plan.carriers[0, 0].tolist() == [True, False, False, False, False] and mean.shape == (1, 3)
    assert torch.allclose(mean[0], (w[:, None] * x[0, 0, [0, 2, 3]].double()).sum(0))
    assert float(weights.log_total[0, 0, 0]) == pytest.approx(float(torch.logsumexp(torch.tensor([900.0, 901.0, 899.0], dtype=torch.float64), 0)))
    assert float(weights.log_total[0, 0, 1]) == pytest.approx(-3.0)  # a kept entry alone is its own group


@pytest.mark.parametrize("name", ["keepkv", "cam", "d2o"])
def test_padded_batch_matches_per_sample_runs(name):
    model = tiny_model(seed=3)
    rows, batch, mask = left_padded_batch([64, 41], seed=2)
    method = get_method(name, budget=24)
    generate = lambda ids, cache, m=None: model.generate(ids, attention_mask=m, past_key_values=cache, max_new_tokens=8,  # noqa: E731
                                                         do_sample=False, pad_token_id=0)
    batched = generate(batch, CompressedCache(model, method), mask)
    for i, row in enumerate(rows):
        alone = generate(row, CompressedCache(model, method))
        assert batched[i, 64:].tolist() == alone[0, row.shape[1] :].tolist(), (name, i)


@pytest.mark.parametrize("name", ["keepkv", "cam", "d2o"])
def test_decoding_keeps_the_budget_in_a_model(name):
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(5))
    cache = CompressedCache(model, get_method(name, budget=16))
    model.generate(ids, past_key_values=cache, max_new_tokens=20, do_sample=False, pad_token_id=0)
    for layer in layers_of(cache):
        assert int(layer.head_lengths().max()) <= 16
    assert cache.merge_error is not None


@torch.inference_mode()
def test_both_sides_of_the_argument_on_the_embedded_model(embedded):
    """SmolLM2, 512 tokens of the built-in prose, budget 64: KeepKV is exact for q̄ with keys in the range of
    real keys; the paper's unbounded key rule is exact too but with keys far outside it; CaM and D2O sag."""
    from kvcompress.diagnose import text_ids

    model, tokenizer = embedded
    ids = torch.tensor([text_ids(tokenizer, None, 512)])
    full = CompressedCache(model, get_method("full"))
    model(ids, past_key_values=full)
    largest = max(float(layer.view().keys.float().norm(dim=-1).max()) for layer in layers_of(full))
    results = {}
    for label, name, options in [("keepkv", "keepkv", {}), ("paper", "keepkv", {"max_key_scale": float("inf")}),
                                 ("votes", "keepkv", {"key_rule": "votes"}), ("cam", "cam", {}), ("d2o", "d2o", {})]:
        cache = CompressedCache(model, get_method(name, budget=64, **options))
        model(ids, past_key_values=cache)
        fallbacks = cache.stats().get("merge_counts", {}).get("zip_fallbacks", 0)
        held = [layer.view().flat(layer.view().keys) for layer in layers_of(cache)]
        results[label] = (cache.merge_error, max(float(keys.float().norm(dim=-1).max()) for keys in held), fallbacks)
    assert results["keepkv"][0] <= 1e-4 and results["keepkv"][1] <= 1.25 * largest
    assert results["paper"][0] <= 1e-4 and results["paper"][1] > 10 * largest and results["paper"][2] == 0
    assert results["votes"][0] <= 1e-4 and results["votes"][1] <= largest + 1e-3 and results["votes"][2] == 0
    assert results["cam"][0] > 1e-2 and results["d2o"][0] > 1e-2
