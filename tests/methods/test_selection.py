"""Dynamic selection (Quest, OmniKV): the read over a selection, Quest's page bounds, OmniKV's shared
token sets, cr as entries read per decoding step, compositions, and selection in the engine."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common import tiny_model
import kvcompress as kvc
from kvcompress.methods import get_method
from kvcompress.kernels import cpu_kernels
from kvcompress.methods.omnikv import STEP, chosen_tokens_torch, filter_layers, token_columns_torch
from kvcompress.methods.selection import true_columns
from kvcompress.read import attend_reference, attention_probs, group_queries, page_bounds_torch, read
from kvcompress.store.slots import SlotPool, SlotTable
from kvcompress.store.view import Edit


def ragged_table(lengths, dim=8, page_size=0, seed=0, dtype=torch.float32):
    """A one-row table whose heads hold the first ``lengths`` of random entries, and its pool."""
    gen = torch.Generator().manual_seed(seed)
    heads, longest = len(lengths), max(lengths)
    pool = SlotPool(dim, dtype=dtype)
    table = SlotTable(1, heads, page_size=page_size)
    keys = torch.randn(1, heads, longest, dim, generator=gen).to(dtype)
    values = torch.randn(1, heads, longest, dim, generator=gen).to(dtype)
    table.append(pool, keys, values, torch.arange(longest)[None])
    table.apply(pool, Edit(keep=torch.arange(longest)[None, None, :] < torch.tensor(lengths)[None, :, None]))
    return pool, table


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3), group=st.integers(1, 3), seed=st.integers(0, 10**6))
def test_selecting_every_entry_equals_the_plain_read_exactly(lengths, group, seed):
    pool, table = ragged_table(lengths, seed=seed)
    view = table.view(pool)
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(1, len(lengths) * group, 1, 8, generator=gen)
    position = torch.tensor([[max(lengths)]])
    span = torch.arange(view.shape[2])
    every = torch.where(span < view.lengths[..., None], span, -1)
    plain = read(query, position, view, 0.3, col_sums=True)
    selected = read(query, position, view, 0.3, select=every, col_sums=True)
    assert torch.equal(plain.out, selected.out) and torch.equal(plain.col_sums, selected.col_sums)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3), seed=st.integers(0, 10**6))
def test_a_selection_reads_exactly_the_selected_entries(lengths, seed):
    """Against the float32 oracle over the same view with every unselected entry masked out."""
    pool, table = ragged_table(lengths, seed=seed)
    view = table.view(pool)
    gen = torch.Generator().manual_seed(seed + 1)
    chosen = (torch.rand(view.shape, generator=gen) < 0.5) & view.valid_or_ones()
    chosen[..., 0] = True  # every head reads at least one entry
    k = int(chosen.sum(-1).max())
    order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)[..., :k]
    select = torch.where(chosen.gather(-1, order), order, -1)
    query = torch.randn(1, 2 * len(lengths), 1, 8, generator=gen)
    position = torch.tensor([[max(lengths)]])
    grouped = group_queries(query, len(lengths))
    out, _, probs = attend_reference(grouped, view.keys, view.values, 0.3, query_positions=position,
                                     key_positions=view.positions, key_valid=chosen, return_probs=True)
    got = read(query, position, view, 0.3, select=select, col_sums=True)
    torch.testing.assert_close(got.out, out.reshape(query.shape), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.col_sums, probs.sum(3).mean(2), atol=1e-6, rtol=1e-5)


# ----- Quest -------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=3), page_size=st.integers(1, 16), group=st.integers(1, 3),
       scale=st.floats(0.01, 100.0), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 10**6))
def test_quest_bound_is_at_least_every_logit_of_its_page(lengths, page_size, group, scale, dtype, seed):
    pool, table = ragged_table(lengths, page_size=page_size, seed=seed, dtype=dtype)
    view = table.view(pool)
    gen = torch.Generator().manual_seed(seed + 1)
    query = (torch.randn(1, len(lengths), group, 8, generator=gen) * scale).to(dtype)
    bound = page_bounds_torch(query, view.page_bounds)  # [1, H, G, pages]
    logits = torch.einsum("bhgd,bhld->bhgl", query.double(), view.keys.double())
    magnitude = torch.einsum("bhgd,bhld->bhgl", query.double().abs(), view.keys.double().abs())  # float32's rounding scale
    for h, n in enumerate(lengths):
        for page in range(-(-n // page_size)):
            columns = slice(page * page_size, min(n, (page + 1) * page_size))
            best, size = logits[0, h, :, columns].amax(-1), magnitude[0, h, :, columns].amax(-1)
            assert bool((bound[0, h, :, page].double() >= best - 1e-5 * (1 + size)).all())


def quest_select(method, lengths, seed=0, page_size=4, tokens=None):
    pool, table = ragged_table(lengths, page_size=page_size, seed=seed)
    view = table.view(pool)
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(1, 2 * len(lengths), 1, 8, generator=gen)
    seen = torch.tensor([tokens if tokens is not None else max(lengths)])
    context = type("Context", (), {"query": query, "tokens_seen": seen, "layer_idx": 2, "step": {}})()  # past the dense layers
    return view, query, method.select(view, context)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=3), budget=st.integers(1, 60),
       sinks=st.integers(0, 5), recent=st.integers(1, 12), seed=st.integers(0, 10**6))
def test_quest_reads_the_protected_entries_and_the_best_pages_within_budget(lengths, budget, sinks, recent, seed):
    size = 4
    method = get_method("quest", budget=budget, page_size=size, sinks=sinks, recent=recent)
    view, query, select = quest_select(method, lengths, seed, page_size=size)
    if select is None:
        assert all(n <= budget for n in lengths)
        return
    bound = page_bounds_torch(group_queries(query, len(lengths))[:, :, :, 0], view.page_bounds).amax(2)[0]
    for h, n in enumerate(lengths):
        read = select[0, h][select[0, h] >= 0].tolist()
        assert len(read) == len(set(read)) and all(0 <= i < n for i in read)
        protected = {i for i in range(n) if i < sinks or i >= min(n - recent, n // size * size)}  # the open page too
        assert protected <= set(read)
        assert len(read) <= max(budget, len(protected) + size)
        pages = sorted({i // size for i in set(read) - protected})
        others = [p for p in range(-(-n // size)) if not any(p * size <= i < (p + 1) * size for i in read)]
        if pages and others:  # a page read for its bound scores at least as high as every page left out
            assert float(bound[h, pages].min()) >= float(bound[h, others].max())


def test_quest_with_its_budget_at_the_context_reads_everything_and_decodes_as_the_full_cache():
    model = tiny_model(layers=3)
    ids = torch.randint(3, 128, (1, 50))
    full = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    cache = kvc.CompressedCache(model, get_method("quest", budget=64))
    assert torch.equal(model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False, pad_token_id=0), full)
    assert cache.stats()["cr"] == 1.0


# ----- OmniKV ------------------------------------------------------------------------------------
def test_omnikv_filter_layers_scale_with_depth():
    assert filter_layers(32) == (2, 8, 18)
    assert filter_layers(30) == (2, 8, 17)  # the embedded model
    assert filter_layers(24) == (2, 6, 14)
    with pytest.raises(ValueError, match="filters"):
        get_method("omnikv", budget=8, filters=())


def record_selections(method):
    """Wrap ``method.select`` to keep, per call, (layer, view, context, result)."""
    calls, original = [], method.select

    def select(view, context):
        result = original(view, context)
        calls.append((context.layer_idx, view, context, result))
        return result

    object.__setattr__(method, "select", select)
    return calls


def test_omnikv_layers_after_a_filter_layer_read_its_top_tokens():
    model = tiny_model(layers=5, seed=4)
    method = get_method("omnikv", budget=20, filters=(1, 3), sinks=2, recent=4)
    calls = record_selections(method)
    cache = kvc.CompressedCache(model, method)
    model.generate(torch.randint(3, 128, (1, 70)), past_key_values=cache, max_new_tokens=3, do_sample=False, pad_token_id=0)
    steps = [calls[i : i + 5] for i in range(0, len(calls), 5)]
    assert len(steps) == 2 and all([c[0] for c in step] == [0, 1, 2, 3, 4] for step in steps)
    for step in steps:
        assert step[0][3] is None and step[1][3] is None and step[3][3] is None  # before and at filter layers: all
        for filter_layer, readers in ((1, [2]), (3, [4])):
            _, view, context, _ = step[filter_layer]
            tokens = int(context.tokens_seen.max())
            query = group_queries(context.query, view.shape[1])
            probs = attention_probs(query, view.keys, context.scaling, context.query_positions, view.positions)
            score = probs[0, :, :, 0].amax(dim=(0, 1))  # every KV head holds every token: [tokens]
            protected = set(range(2)) | set(range(tokens - 4, tokens))
            rest = [j for j in score.argsort(descending=True).tolist() if j not in protected]
            expected = protected | set(rest[: 20 - len(protected)])
            for layer in readers:
                _, reader_view, _, select = step[layer]
                for h in range(reader_view.shape[1]):
                    index = select[0, h][select[0, h] >= 0]
                    assert set(reader_view.positions[0, h, index].tolist()) == expected


@pytest.mark.parametrize("spec", ["omnikv:budget=20:filters=[1]:sinks=2:recent=4",
                                  "snapkv:budget=40:window=8+omnikv:read_budget=20:filters=[1]:sinks=2:recent=4"])
def test_omnikv_layers_reading_one_choice_each_read_their_own_columns_of_it(spec):
    """The layers after a filter layer read the columns of its chosen tokens; where they hold the same tokens in the
    same columns (no eviction) they share them, where a compressed prompt left each layer others (SnapKV's) each has
    its own."""
    model = tiny_model(layers=5, seed=4)
    method = get_method(spec)
    calls = record_selections(method)
    cache = kvc.CompressedCache(model, method)
    model.generate(torch.randint(3, 128, (1, 70)), past_key_values=cache, max_new_tokens=3, do_sample=False, pad_token_id=0)
    readers = [(view, context, select) for layer, view, context, select in calls if layer >= 2]
    assert len(readers) == 6
    for view, context, select in readers:
        assert torch.equal(select, method.reads.columns(view, context.step[STEP]))
    steps = [readers[:3], readers[3:]]  # layers 2, 3 and 4 of each step
    different = [not torch.equal(a[0].positions, b[0].positions) for step in steps for a, b in zip(step, step[1:])]
    assert any(different) == spec.startswith("snapkv")


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 3), heads=st.integers(1, 3), groups=st.integers(1, 3), width=st.integers(1, 40),
       tokens=st.integers(1, 50), sinks=st.integers(0, 4), recent=st.integers(0, 6), seed=st.integers(0, 2**16))
def test_the_compiled_choice_and_columns_of_omnikv_equal_the_references(rows, heads, groups, width, tokens, sinks, recent, seed):
    """``csrc/omnikv_tokens.cpp`` against ``chosen_tokens_torch`` and ``token_columns_torch``: ragged heads (empty ones
    too), padding, entries past the tokens chosen from, budgets of none to more than every token, strided positions and
    budgets."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (rows, heads), generator=gen)
    spread = max(tokens + 3, width)  # some positions past ``tokens``: the reference's spare column
    held = torch.stack([torch.randperm(spread, generator=gen)[:width] for _ in range(rows * heads)]).view(rows, heads, width)
    store = torch.full((rows, heads, width, 2), 2**31 - 1, dtype=torch.long)
    store[..., 1] = torch.where(torch.arange(width) < lengths[..., None], held, 2**31 - 1)
    positions = store[..., 1]  # strided, as a view's may be
    weights = torch.rand(rows, heads, groups, width, generator=gen)
    budget = torch.randint(0, tokens + 3, (rows, 2), generator=gen)[:, 0]  # strided too
    kernel = cpu_kernels()
    wanted = chosen_tokens_torch(positions, lengths, budget, weights, sinks, recent, tokens)
    assert torch.equal(kernel.chosen_tokens(weights, positions, lengths, budget, sinks, recent, tokens), wanted)
    assert torch.equal(kernel.token_columns(wanted, positions, lengths, sinks, recent),
                       token_columns_torch(positions, lengths, wanted, sinks, recent))
    for b in range(rows):  # the reference itself: every protected token, then the best scores, up to the budget
        score, protected = {}, set()
        for h in range(heads):
            n = int(lengths[b, h])
            for j in range(n):
                token = int(positions[b, h, j])
                if token >= tokens:
                    continue
                if j < sinks or j >= n - recent:
                    protected.add(token)
                score[token] = max(score.get(token, -1.0), float(weights[b, h, :, j].max()))
        chosen = set(wanted[b].nonzero().flatten().tolist())
        assert protected <= chosen <= set(score) and len(chosen) == min(len(score), max(int(budget[b]), len(protected)))
        left = [score[t] for t in set(score) - chosen]
        assert not left or all(score[t] >= max(left) for t in chosen - protected)


def test_the_compiled_omnikv_choice_refuses_what_it_cannot_read():
    kernel = cpu_kernels()
    positions, lengths = torch.zeros(1, 2, 5, dtype=torch.long), torch.full((1, 2), 5)
    with pytest.raises(RuntimeError, match="weights float32"):
        kernel.chosen_tokens(torch.rand(1, 2, 1, 4), positions, lengths, torch.tensor([2]), 0, 1, 3)
    with pytest.raises(RuntimeError, match="a head holds 0 to L entries"):
        kernel.token_columns(torch.ones(1, 3, dtype=torch.bool), positions, torch.full((1, 2), 6), 0, 1)


def test_omnikv_reads_the_same_without_the_compiled_choice(monkeypatch):
    """Where the kernels cannot run, ``choose`` and ``columns`` take their PyTorch paths: the same tokens generated."""
    import kvcompress.methods.omnikv as omnikv

    model = tiny_model(layers=5, seed=4)
    prompt = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(2))
    outputs = []
    for kernels in (cpu_kernels, lambda: None):
        monkeypatch.setattr(omnikv, "cpu_kernels", kernels)
        cache = kvc.CompressedCache(model, get_method("omnikv:budget=20:filters=[1,3]:sinks=2:recent=4"))
        outputs.append(model.generate(prompt, past_key_values=cache, max_new_tokens=6, do_sample=False, pad_token_id=0))
    assert torch.equal(outputs[0], outputs[1])


# ----- cr, compositions, the engine ---------------------------------------------------------------
def test_cr_is_the_entries_read_per_decoding_step_over_the_steps():
    model = tiny_model(layers=2)
    ids = torch.randint(3, 128, (1, 60))
    snap = kvc.CompressedCache(model, get_method("snapkv", budget=20, window=8))
    model.generate(ids, past_key_values=snap, max_new_tokens=5, do_sample=False, pad_token_id=0)
    # snapkv holds 20 (+ the tokens decoded) of 60 (+ those): four decoding steps read 21..24 of 61..64
    assert snap.stats()["cr"] == pytest.approx(sum(range(21, 25)) / sum(range(61, 65)))
    # H2O evicts back to 20 after each layer's read, so every step reads 21 (counted once, when the step begins)
    h2o = kvc.CompressedCache(model, get_method("h2o", budget=20))
    model.generate(ids, past_key_values=h2o, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert h2o.stats()["cr"] == pytest.approx(4 * 21 / sum(range(61, 65)))
    quest = get_method("quest", budget=24, page_size=4, sinks=2, recent=4, dense_layers=1)
    calls = record_selections(quest)
    cache = kvc.CompressedCache(model, quest)
    model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False, pad_token_id=0)
    read_entries = sum(view.num_entries if select is None else int((select >= 0).sum()) for _, view, _, select in calls)
    full_entries = sum(2 * int(context.tokens_seen.sum()) for _, _, context, _ in calls)
    assert cache.stats()["cr"] == pytest.approx(read_entries / full_entries) and cache.stats()["cr"] < 0.7
    assert [layer for layer, *_ in calls[:2]] == [0, 1] and calls[0][3] is None  # the dense first layer reads all
    assert cache.stats()["kr"] > 1.0  # it holds everything, plus its page bounds


def test_quest_over_a_snapkv_compressed_cache_holds_what_snapkv_keeps():
    model = tiny_model(layers=2)
    ids = torch.randint(3, 128, (1, 80))
    composed = get_method("snapkv:budget=32:window=8+quest:page_size=4:read_budget=12")
    assert composed.score.name == "snapkv" and composed.label == "snapkv@32[window=8]+quest[read_budget=12,page_size=4]"
    caches = {m: kvc.CompressedCache(model, method) for m, method in
              (("snapkv", get_method("snapkv", budget=32, window=8)), ("composed", composed))}
    for cache in caches.values():
        model(ids, past_key_values=cache)
    positions = [[layer.positions for layer in (c.session.view(i) for i in range(2))] for c in caches.values()]
    assert all(torch.equal(a, b) for a, b in zip(*positions))
    snap, both = caches["snapkv"].stats(), caches["composed"].stats()
    bounds = 2 * 2 * (32 // 4) * 2 * 16 * 4  # layers × heads × pages × (min, max) × head_dim × fp32
    assert both["kv_bytes"] == snap["kv_bytes"] + bounds


def test_bad_compositions_fail_clearly():
    with pytest.raises(ValueError, match="give quest its own read size"):
        get_method("snapkv+quest", budget=8)
    with pytest.raises(ValueError, match="for a policy that also evicts"):
        get_method("quest:read_budget=4", budget=8)
    with pytest.raises(ValueError, match="unknown part 'nothing'"):
        get_method("quest+nothing", budget=8)
    with pytest.raises(ValueError, match="close every quote"):
        get_method('quest:page_size="4', budget=8)
    with pytest.raises(ValueError, match="acts on what a scorer ranks"):
        get_method("quest+adaptive", budget=8)


def test_selection_in_the_engine_is_per_request_and_equals_the_single_request_cache():
    from engine.test_llm import make_llm, prompts_of, reference, sharp_model

    model = sharp_model(seed=2, layers=4)
    llm = make_llm(model)
    methods = [get_method("quest", budget=24, page_size=8, recent=8, sinks=2), get_method("omnikv", budget=24, filters=(1,), recent=8),
               get_method("full"), get_method("snapkv:budget=40:window=8+quest:read_budget=20:page_size=4:recent=4")]
    prompts = prompts_of([64, 90, 41, 120], seed=3)
    params = kvc.SamplingParams(max_tokens=10, ignore_eos=True)
    ids = [llm.add_request(p, params, m) for p, m in zip(prompts, methods)]
    while llm.has_unfinished():
        llm.step()
    for i, prompt, method in zip(ids, prompts, methods):
        out = llm.output(i)
        assert out.token_ids == reference(model, prompt, 10, method), method.label
        assert out.stats["cr"] < 1.0 or method.name == "full"
    assert llm.pool.num_used == 0


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 3), length=st.integers(0, 40), rate=st.floats(0.0, 1.0), seed=st.integers(0, 10**6))
def test_true_columns_lists_each_rows_true_entries_in_order(rows, length, rate, seed):
    mask = torch.rand(rows, 2, length, generator=torch.Generator().manual_seed(seed)) < rate
    index = true_columns(mask)
    assert index.shape[-1] == max(int(mask.sum(-1).max()) if mask.numel() else 0, 1)
    for row, chosen in zip(mask.reshape(rows * 2, length), index.reshape(rows * 2, index.shape[-1])):
        expected = row.nonzero().squeeze(1).tolist()
        assert chosen.tolist() == expected + [-1] * (len(chosen) - len(expected))
