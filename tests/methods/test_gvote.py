"""GVote: top-p budgets, sampled future queries, the GQA × samples union, determinism, adaptive sizes."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from common import kept_positions, layers_of, left_padded_batch, random_layer, tiny_model, toy_task_file
from conftest import tiny_config, tiny_tokenizer
from kvcompress import CompressedCache, get_method
from kvcompress.eval.runner import EvalSettings, method_grid, run_eval
from kvcompress.methods import Policy
from kvcompress.methods.gvote import (
    STATE,
    GVote,
    Votes,
    generator_for,
    nucleus_budgets,
    project_queries,
    sample_hidden,
    union_votes,
)
from kvcompress.methods.momentkv import MOMENTS, moment_floats_per_head
from kvcompress.methods.rotary import apply_rotary, averaged_rotary


def sharp_model(kind="llama", scale=12.0, seed=0):
    """A tiny random model whose attention is peaked enough for top-p sets to be small (random init is near uniform)."""
    model = tiny_model(kind, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if getattr(attn, "q_norm", None) is not None:  # q/k-norm undoes any scaling of the projections
                attn.q_norm.weight.mul_(scale**0.5)
                attn.k_norm.weight.mul_(scale**0.5)
            else:
                attn.q_proj.weight.mul_(scale)
                attn.k_proj.weight.mul_(scale)
    return model


def _ids(length, seed=1, batch=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _shared(model, ids, mask=None):
    shared = CompressedCache(model, compress_on_prefill=False, observation_window=1, hidden_stats=True)
    positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers padded rows
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions, past_key_values=shared)
    return shared


class RealQueryVotes(GVote):
    """Every sample is the last real context query itself (acceptance property 1)."""

    def sampled_queries(self, view, context):
        q0 = context.observations["window_queries"][:, :, -1:]
        return q0.expand(-1, -1, self.samples, -1).float()


def reference_top_p(keys, valid, q0, scaling, p, group):
    """Loops: per (row, KV head), the union over its query heads of q0's top-p set (original positions)."""
    batch, heads, length, _ = keys.shape
    out = []
    for b in range(batch):
        row = []
        for h in range(heads):
            kept = set()
            idx = [j for j in range(length) if valid is None or bool(valid[b, h, j])]
            for g in range(group):
                q = q0[b, h * group + g].double()
                probs = torch.softmax(torch.stack([q @ keys[b, h, j].double() * scaling for j in idx]), 0)
                mass = 0.0
                for i in probs.argsort(descending=True).tolist():
                    kept.add(idx[i])
                    mass += float(probs[i])
                    if mass >= p:
                        break
            row.append(kept)
        out.append(row)
    return out


# ----- the pure steps ----------------------------------------------------------------------------
def test_nucleus_budgets_are_the_smallest_count_reaching_the_mass():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 5, 40, generator=gen) * 3, dim=-1)
    for p in (0.1, 0.5, 0.9, 0.95):
        budgets = nucleus_budgets(probs, p)
        for idx in torch.cartesian_prod(torch.arange(3), torch.arange(5)).tolist():
            ordered = probs[tuple(idx)].double().sort(descending=True).values
            count = next(k for k in range(1, 41) if float(ordered[:k].sum()) >= p)
            assert int(budgets[tuple(idx)]) == count
    assert bool((nucleus_budgets(probs, 1.0, cap=torch.tensor(40)) == 40).all())  # rounding never exceeds the entries
    assert int(nucleus_budgets(torch.tensor([0.9, 0.1, 0.0]), 0.5)) == 1


def test_gqa_union_matches_a_loop_reference():
    gen = torch.Generator().manual_seed(1)
    b, h, g, s, length = 2, 3, 4, 5, 30
    logits = torch.randn(b, h, g, s, length, generator=gen)
    logits[1, :, :, :, :7] = float("-inf")  # padding of a shorter row
    budgets = torch.randint(1, 24, (b, h, g), generator=gen)
    keep = union_votes(logits, budgets)
    for bi in range(b):
        for hi in range(h):
            expected = set()
            for gi in range(g):
                for si in range(s):
                    order = sorted(range(length), key=lambda j: -float(logits[bi, hi, gi, si, j]))
                    expected |= {j for j in order[: int(budgets[bi, hi, gi])] if j >= (7 if bi == 1 else 0)}
            assert set(keep[bi, hi].nonzero().flatten().tolist()) == expected


def test_samples_are_nested_in_s_and_do_not_depend_on_the_batch():
    mean, std = torch.randn(3, 64), torch.rand(3, 64) + 0.5
    few = sample_hidden(mean, std, 3, torch.Generator().manual_seed(7))
    many = sample_hidden(mean, std, 9, torch.Generator().manual_seed(7))
    assert torch.equal(few, many[:, :3])
    alone = sample_hidden(mean[2:], std[2:], 9, torch.Generator().manual_seed(7))
    assert torch.equal(alone[0], many[2])
    draws = sample_hidden(mean[:1], std[:1], 4000, torch.Generator().manual_seed(0))[0]
    assert torch.allclose(draws.mean(0), mean[0], atol=0.15 * float(std.max()))
    assert torch.allclose(draws.std(0), std[0], rtol=0.1)


def test_averaged_rotary_is_the_mean_over_the_future_positions():
    model = tiny_model()
    rotary = model.model.rotary_emb
    like = torch.zeros(1)
    cos, sin = averaged_rotary(rotary, torch.tensor([10, 3]), 5, like)
    for row, start in enumerate((10, 3)):
        per = [rotary(like, torch.tensor([[pos]])) for pos in range(start, start + 5)]
        assert torch.allclose(cos[row], torch.stack([c[0, 0] for c, _ in per]).mean(0), atol=1e-6)
        assert torch.allclose(sin[row], torch.stack([s[0, 0] for _, s in per]).mean(0), atol=1e-6)
    q = torch.randn(2, 4, 3, 16)
    expected, _ = apply_rotary_pos_emb(q, q, cos[:, None], sin[:, None])  # transformers' RoPE, cos/sin [B, 1, d]
    assert torch.allclose(apply_rotary(q, cos, sin), expected, atol=1e-6)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_projection_reproduces_the_models_own_query(kind):
    """A sampled hidden state equal to the last token's, at its own position (n_f = 1), gives the model's query:
    q_proj with its bias (Qwen2), the per-head q-norm (Qwen3), RoPE."""
    model = tiny_model(kind)
    with torch.no_grad():  # non-trivial biases and norm weights, so that leaving one out shows
        for layer in model.model.layers:
            attn = layer.self_attn
            if attn.q_proj.bias is not None:
                attn.q_proj.bias.normal_()
            if getattr(attn, "q_norm", None) is not None:
                attn.q_norm.weight.uniform_(0.5, 2.0)
    inputs = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(lambda m, a, kw, i=i: inputs.__setitem__(i, kw["hidden_states"]), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)
    ]
    ids = _ids(30, batch=2)
    cache = _shared(model, ids)
    for h in hooks:
        h.remove()
    for i, layer in enumerate(model.model.layers):
        module = layer.self_attn
        q = project_queries(module, inputs[i][:, -1:], module.head_dim)
        cos, sin = averaged_rotary(model.model.rotary_emb, torch.tensor([29, 29]), 1, q)
        observed = layers_of(cache)[i].observations["window_queries"][:, :, -1:]
        assert torch.allclose(apply_rotary(q, cos, sin), observed.float(), atol=1e-5), i


def test_sampled_queries_start_after_each_rows_last_real_position():
    model = tiny_model("qwen3")
    ids = _ids(40, batch=2)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :15] = 0  # row 1: 25 real tokens, positions 0..24
    shared = _shared(model, ids, mask)
    method = get_method("gvote", samples=5, future=7, seed=3)
    for idx, layer in enumerate(layers_of(shared)):
        context = layer.context()
        obs = layer.observations
        hidden = sample_hidden(obs["hidden_mean"], obs["hidden_std"], 5, generator_for(3, idx))
        q = project_queries(context.module, hidden, 16)
        cos, sin = averaged_rotary(context.rotary, torch.tensor([40, 25]), 7, q)
        assert torch.allclose(method.sizes.sampled_queries(layer.view(), context), apply_rotary(q, cos, sin), atol=1e-6)


# ----- the acceptance properties ------------------------------------------------------------------
@pytest.mark.parametrize("p_nuc", [0.5, 0.9, 1.0])
def test_samples_equal_to_the_real_query_keep_its_top_p_set(p_nuc):
    layer, context, queries, _, _ = random_layer(batch=2, heads=2, group=3, length=64, window=8, seed=3, lengths=[64, 40])
    view = layer.view()
    keys, valid, positions = view.keys.clone(), view.valid.clone(), view.positions.clone()
    layer.compress(Policy(score=Votes(), sizes=RealQueryVotes(p_nuc=p_nuc, samples=4)))
    reference = reference_top_p(keys, valid, queries[:, :, -1], context.scaling, p_nuc, 3)
    for b, row in enumerate(kept_positions(layer)):
        for h, kept in enumerate(row):
            assert kept == sorted(int(positions[b, h, j]) for j in reference[b][h]), (b, h)


def test_samples_equal_to_the_real_query_on_a_model():
    model = sharp_model()
    shared = _shared(model, _ids(60))
    references = []
    for layer in layers_of(shared):
        view = layer.view()
        q0 = layer.observations["window_queries"][:, :, -1]
        references.append(reference_top_p(view.keys, view.valid, q0, layer.scaling, 0.9, 2))
    forked = shared.fork(Policy(score=Votes(), sizes=RealQueryVotes(p_nuc=0.9)))
    for layer, reference in zip(layers_of(forked), references):
        assert kept_positions(layer) == [[sorted(s) for s in row] for row in reference]
    assert forked.stats()["cr"] < 1.0


def test_include_current_adds_exactly_the_real_querys_top_p_set():
    model = sharp_model()
    shared = _shared(model, _ids(60))
    plain = shared.fork(get_method("gvote", p_nuc=0.9))
    voting = shared.fork(get_method("gvote", p_nuc=0.9, include_current=True))
    for layer, a, b in zip(layers_of(shared), layers_of(plain), layers_of(voting)):
        view = layer.view()
        top_p = reference_top_p(view.keys, view.valid, layer.observations["window_queries"][:, :, -1], layer.scaling, 0.9, 2)
        for h, (mine, theirs) in enumerate(zip(kept_positions(a)[0], kept_positions(b)[0])):
            assert set(theirs) == set(mine) | top_p[0][h]


def test_keep_set_grows_monotonically_with_samples():
    model = sharp_model()
    shared = _shared(model, _ids(80))
    previous, sizes = None, []
    for samples in (1, 2, 4, 8, 16, 32):
        kept = [kept_positions(layer) for layer in layers_of(shared.fork(get_method("gvote", samples=samples, seed=5)))]
        if previous is not None:
            for layer_prev, layer_now in zip(previous, kept):
                for row_prev, row_now in zip(layer_prev, layer_now):
                    for head_prev, head_now in zip(row_prev, row_now):
                        assert set(head_prev) <= set(head_now)
        previous = kept
        sizes.append(sum(len(h) for layer in kept for row in layer for h in row))
    assert sizes[-1] > sizes[0]


def test_keep_set_is_the_union_of_every_sample_and_query_heads_top_budget():
    model = sharp_model()
    shared = _shared(model, _ids(50))
    method = get_method("gvote", samples=3)
    for layer in layers_of(shared):
        context = layer.context()
        twin = layer.clone()
        budgets = method.sizes.step_budgets(twin.view(), context)
        sampled = method.sizes.sampled_queries(twin.view(), context)
        keys = twin.view().keys
        expected = []
        for h in range(2):
            kept = set()
            for g in range(2):
                for s in range(3):
                    logits = keys[0, h].float() @ sampled[0, h * 2 + g, s] * context.scaling
                    kept |= set(torch.topk(logits, int(budgets[0, h, g])).indices.tolist())
            expected.append(sorted(kept))
        twin.compress(method)
        assert kept_positions(twin)[0] == expected  # positions 0..49 are the indices


def test_same_seed_gives_identical_results_and_another_seed_differs():
    model = sharp_model()
    ids = _ids(70)

    def run(seed):
        cache = CompressedCache(model, get_method("gvote", seed=seed))
        model(ids, past_key_values=cache)
        return cache

    a, b, c = run(0), run(0), run(1)
    for la, lb in zip(layers_of(a), layers_of(b)):
        assert torch.equal(la.view().positions, lb.view().positions) and torch.equal(la.view().keys, lb.view().keys)
        assert torch.equal(la.head_lengths(), lb.head_lengths())
    assert any(not torch.equal(la.head_lengths(), lc.head_lengths()) or not torch.equal(la.view().positions, lc.view().positions)
               for la, lc in zip(layers_of(a), layers_of(c)))


# ----- adaptive sizes, stats, integration ----------------------------------------------------------
def test_budget_is_chosen_per_head_and_recorded():
    model = sharp_model()
    cache = CompressedCache(model, get_method("gvote"))
    model(_ids(90), past_key_values=cache)
    stats = cache.stats()
    sizes = [layer.head_lengths() for layer in layers_of(cache)]
    assert len({int(x) for s in sizes for x in s.flatten()}) > 1  # heads keep different numbers of entries
    assert stats["entries_per_head"] == pytest.approx(sum(int(s.sum()) for s in sizes) / (2 * 2))
    assert stats["cr"] == pytest.approx(stats["entries_per_head"] / 90)
    for layer in layers_of(cache):
        record = layer.state[STATE]
        assert torch.equal(record.kept, layer.head_lengths())
        assert record.step_budgets.shape == (1, 4)
        # the union holds at least the largest step budget of its group
        assert bool((record.kept >= record.step_budgets.view(1, 2, 2).amax(-1)).all())
    assert any("gvote" in note for note in stats["notes"])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_p_nuc_one_keeps_everything_and_reproduces_generate(kind):
    model = tiny_model(kind)
    ids = _ids(70)
    reference = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    cache = CompressedCache(model, get_method("gvote", p_nuc=1.0))
    out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out, reference)


def test_qwen3_qk_norm_path_compresses_and_decodes():
    model = sharp_model("qwen3", scale=16.0)
    cache = CompressedCache(model, get_method("gvote", p_nuc=0.9))
    out = model.generate(_ids(80), past_key_values=cache, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 86)
    assert layers_of(cache)[0].state[STATE].kept.sum() < 2 * 80


def test_padded_batch_matches_per_sample_runs():
    model = sharp_model(seed=3)
    rows, batch, mask = left_padded_batch([64, 41], seed=2)
    method = get_method("gvote")
    cache = CompressedCache(model, method)
    batched = model.generate(batch, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False, pad_token_id=0)
    kept_batch = [kept_positions(layer) for layer in layers_of(cache)]
    sizes = set()
    for i, row in enumerate(rows):
        alone_cache = CompressedCache(model, method)
        alone = model.generate(row, past_key_values=alone_cache, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert batched[i, 64:].tolist() == alone[0, row.shape[1] :].tolist()
        for layer_b, layer_a in zip(kept_batch, (kept_positions(layer) for layer in layers_of(alone_cache))):
            assert layer_b[i] == layer_a[0]  # same keep-set: padding left out of the hidden statistics and the votes
            sizes |= {len(h) for h in layer_a[0]}
    assert len(sizes) > 2  # rows and heads keep different numbers of entries


def test_fork_equals_compressing_directly():
    model = sharp_model()
    ids = _ids(60)
    shared = CompressedCache(model, compress_on_prefill=False, observation_window=32, attention_sums=True, hidden_stats=True)
    model(ids, past_key_values=shared)
    for method in (get_method("gvote"), get_method("gvote", samples=3, p_nuc=0.8, future=4, seed=9)):
        direct = CompressedCache(model, method, attention_sums=True)  # the same prefill pass as the shared one's
        model(ids, past_key_values=direct)
        forked = shared.fork(method)
        for a, b in zip(layers_of(direct), layers_of(forked)):
            assert torch.equal(a.view().positions, b.view().positions) and torch.equal(a.view().keys, b.view().keys)
    no_stats = CompressedCache(model, compress_on_prefill=False, observation_window=32)
    model(ids, past_key_values=no_stats)
    with pytest.raises(ValueError, match="hidden_stats"):
        no_stats.fork(get_method("gvote"))


def test_budget_and_ratio_are_refused():
    for size in ({"budget": 16}, {"ratio": 0.5}):
        with pytest.raises(ValueError, match="gvote takes no size: it chooses its own budget"):
            get_method("gvote", **size)
    for bad in ({"p_nuc": 0.0}, {"p_nuc": 1.5}, {"samples": 0}, {"future": 0}):
        with pytest.raises(ValueError):
            get_method("gvote", **bad)
    assert get_method("gvote").needs().hidden_stats and get_method("gvote").needs().window == 1
    layer, context, _, _, _ = random_layer()
    with pytest.raises(ValueError, match="CompressedCache"):  # no module, rotary or hidden statistics
        layer.compress(get_method("gvote"))


def test_moment_correction_folds_exactly_the_dropped_entries():
    model = sharp_model()
    shared = _shared(model, _ids(70))
    plain = shared.fork(get_method("gvote"))
    corrected = shared.fork(get_method("gvote+momentkv"))
    for full, a, b in zip(layers_of(shared), layers_of(plain), layers_of(corrected)):
        assert torch.equal(a.view().positions, b.view().positions)  # the keep-set is GVote's either way
        assert a.summary is None and b.summary is b.state[MOMENTS]
        moments = b.state[MOMENTS]
        keys = full.view().keys
        for h, kept in enumerate(kept_positions(b)[0]):
            gone = sorted(set(range(70)) - set(kept))
            assert int(moments.count[0, h]) == len(gone)
            assert torch.allclose(moments.key_sum[0, h], keys[0, h, gone].sum(0), atol=1e-4)
        assert b.nbytes() == a.nbytes() + 2 * moment_floats_per_head(16) * 4
    assert corrected.stats()["kr"] > plain.stats()["kr"]


def _shared_for(model, ids, method):
    needs = method.needs()
    shared = CompressedCache(model, compress_on_prefill=False, observation_window=needs.window,
                             attention_sums=needs.attention_sums, hidden_stats=True)
    with torch.no_grad():
        model(ids, past_key_values=shared)
    return shared


@pytest.mark.parametrize("selector", ["snapkv", "h2o", "momentkv", "keepkv"])
def test_gvote_as_the_budget_source_of_another_method(selector):
    """``selector+gvote``: GVote's per-head sizes, the selector's choice of entries (and its moments or votes)."""
    model = sharp_model()
    method = get_method(f"{selector}+gvote" + ("+static" if selector != "snapkv" else ""))
    assert method.needs().window == max(1, get_method(selector, budget=8).needs().window)
    shared = _shared_for(model, _ids(90), method)
    own = shared.fork(get_method("gvote"))
    composed = shared.fork(method)
    for full, mine, theirs in zip(layers_of(shared), layers_of(own), layers_of(composed)):
        # GVote's sizes plus what the selector always keeps (its window and sinks)
        assert bool((theirs.head_lengths() >= mine.head_lengths()).all())
        if selector == "snapkv":
            assert torch.equal(theirs.head_lengths(), torch.clamp(mine.head_lengths() + 32, max=90))
        reference = full.clone()  # the selector at the largest union's size (its protected set follows it)
        reference.compress(get_method(selector, budget=int(mine.head_lengths().max())), sizes=mine.head_lengths())
        assert kept_positions(theirs) == kept_positions(reference)  # the selector's entries
    if selector == "momentkv":
        assert all(layer.summary is layer.state[MOMENTS] for layer in layers_of(composed) if layer.num_entries < 2 * 90)
    if selector == "keepkv":
        assert composed.merge_error is not None and composed.merge_error <= 1e-4
    out = model(_ids(3, seed=5), past_key_values=composed).logits  # decoding runs on the composed cache
    assert torch.isfinite(out).all()



def test_compositions_with_gvote_refuse_what_cannot_work():
    with pytest.raises(ValueError, match="reads the gvote sizer's votes"):
        get_method("snapkv+votes", ratio=0.5)
    with pytest.raises(ValueError, match="add \\+static"):
        get_method("h2o+gvote")
    with pytest.raises(ValueError, match="unknown part 'nope'"):
        get_method("gvote+nope")


def test_eval_runs_gvote_once_and_reports_its_realized_budget(tmp_path):
    grid = method_grid(EvalSettings(methods=["full", "gvote", "snapkv"], ratios=[0.1, 0.5]))
    assert [m.name for m in grid] == ["full", "gvote", "snapkv", "snapkv"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    model.generation_config.eos_token_id = None
    path = toy_task_file(tmp_path / "tasks.jsonl", samples=2)

    def settings(**kw):
        return EvalSettings(methods=["gvote", "snapkv"], budgets=[16], tasks=[], task_files=[str(path)], samples=2, max_new_tokens=4, **kw)

    rows, shared, _ = run_eval(model, tiny_tokenizer(), settings(), progress=False)
    _, alone, _ = run_eval(model, tiny_tokenizer(), settings(share_prefill=False), progress=False)
    assert [(p.method, p.answer, p.kr) for p in shared] == [(p.method, p.answer, p.kr) for p in alone]
    row = next(r for r in rows if r["method"] == "gvote")
    assert row["budget"] is None and row["ratio"] is None and row["n"] == 2
    assert 0 < row["entries_per_head"] <= 100 and all("entries_per_head" in r for r in rows)
    assert all(p.stats["entries_per_head"] > 0 for p in shared if p.method == "gvote")
