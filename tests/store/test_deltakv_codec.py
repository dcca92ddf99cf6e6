"""DeltaKV's codec: RoPE undone and redone, nearest references against a brute-force reference, references
stored exactly, coded tokens equal to a float32 re-computation of x̂ = f_d(z) + m, 4-bit codes within their
step, save → load exact, and no slot or reference leaked under random coding, forks and releases."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from common import tiny_model
from kvcompress.store.deltakv import (DeltaKVCodec, DeltaKVWeights, columns_in_8_bits, nearest_references, reference_mask, rope,
                                      split_vectors, token_vectors)
from kvcompress.read import read, read_reference
from kvcompress.read.paged import paged_decode, paged_decode_torch
from kvcompress.read.tables import select_pages
from kvcompress.store.slots import TIER_SHIFT, SlotPool, SlotTable
from kvcompress.store.view import DeltaKVBlocks

H, D = 2, 16


def _weights(seed: int = 0, **kw) -> DeltaKVWeights:
    model = tiny_model(layers=2)
    weights = DeltaKVWeights(2, H, D, model.model.rotary_emb.inv_freq, hidden=8, seed=seed, **kw)
    with torch.no_grad():
        weights.decoder.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))
        weights.scale.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(seed + 1))
        weights.w_linear.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed + 2))
    return weights.eval().requires_grad_(False)


def test_rope_matches_transformers_and_its_inverse_undoes_it():
    model = tiny_model(layers=1)
    keys = torch.randn(1, H, 12, D)
    positions = torch.arange(5, 17)[None]
    cos, sin = model.model.rotary_emb(keys, positions)
    _, expected = apply_rotary_pos_emb(keys, keys, cos, sin)
    ours = rope(keys, positions[:, None], model.model.rotary_emb.inv_freq)
    assert torch.allclose(ours, expected, atol=1e-5)
    assert torch.allclose(rope(ours, positions[:, None], model.model.rotary_emb.inv_freq, inverse=True), keys, atol=1e-5)
    x = token_vectors(ours, keys * 2, positions, model.model.rotary_emb.inv_freq)  # [1, 12, 2·H·D]
    assert x.shape == (1, 12, 2 * H * D) and torch.allclose(x[0, 3, :D], keys[0, 0, 3], atol=1e-5)
    back_keys, back_values = split_vectors(x, positions, H, model.model.rotary_emb.inv_freq)
    assert torch.allclose(back_keys, ours, atol=1e-5) and torch.equal(back_values, keys * 2)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 40), stride=st.integers(2, 9), sinks=st.integers(0, 4), k=st.integers(1, 5), seed=st.integers(0, 10**6))
def test_nearest_references_are_the_k_nearest_earlier_ones(n, stride, sinks, k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen)
    positions = torch.arange(n)
    is_ref = reference_mask(positions, stride, sinks)
    coded = (~is_ref).nonzero().squeeze(1)
    if coded.numel() == 0:
        return
    nearest = nearest_references(x[coded], x[is_ref], positions[is_ref], positions[coded], k)
    assert nearest.shape == (coded.numel(), k)
    ref_positions = positions[is_ref]
    for row, token in enumerate(coded.tolist()):
        earlier = [j for j in range(ref_positions.numel()) if ref_positions[j] < token]
        by_distance = sorted(earlier, key=lambda j: float((x[token] - x[is_ref][j]).pow(2).sum()))
        chosen = nearest[row].tolist()
        distance = [float((x[token] - x[is_ref][j]).pow(2).sum()) for j in chosen]
        want = [float((x[token] - x[is_ref][j]).pow(2).sum()) for j in by_distance[:k]]
        want += [want[0]] * (k - len(want))  # fewer than k: the nearest is repeated
        assert all(ref_positions[j] < token for j in chosen)
        assert sorted(distance) == pytest.approx(sorted(want), rel=1e-5, abs=1e-5)


def _coded_table(weights: DeltaKVWeights, n: int, recent: int = 0, bits=None, seed: int = 0):
    """A pool and a one-row table holding n random entries of layer 1, then coded."""
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, H, n, D, generator=gen), torch.randn(1, H, n, D, generator=gen)
    pool = SlotPool(D)
    table = SlotTable(1, H)
    table.append(pool, keys, values, torch.arange(n)[None])
    codec = DeltaKVCodec(weights, bits)
    tier = pool.tier(codec)
    coded = table.code(pool, tier, recent, slice(0, 1), layer=1)
    return pool, table, keys, values, coded


def _expected(weights: DeltaKVWeights, keys, values, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x̂ = f_d(f_c(x) − f_c(m)) + m for every non-reference token, recomputed by hand in float32."""
    positions = torch.arange(n)
    x = token_vectors(keys[0], values[0], positions, weights.inv_freq)  # [n, 2HD]
    is_ref = reference_mask(positions, weights.stride, weights.sinks)
    expected = x.clone()
    for i in (~is_ref).nonzero().squeeze(1).tolist():
        refs = [j for j in range(i) if is_ref[j]]
        distance = torch.stack([(x[i] - x[j]).pow(2).sum() for j in refs])
        nearest = [refs[j] for j in distance.argsort()[: weights.top_k].tolist()]
        nearest += [nearest[0]] * (weights.top_k - len(nearest))
        m = x[nearest].mean(0)
        s = weights.scale[1]

        def f_c(v):
            v = v / s
            return v @ weights.w_linear[1] + (torch.nn.functional.silu(v @ weights.w_gate[1]) * (v @ weights.w_up[1])) @ weights.w_down[1]

        expected[i] = (f_c(x[i]) - f_c(m)) @ weights.decoder[1] * s + m
    return split_vectors(expected, positions, H, weights.inv_freq)


def test_references_come_back_exactly_and_coded_tokens_as_the_float32_reconstruction():
    weights = _weights()
    n = 47
    pool, table, keys, values, coded = _coded_table(weights, n)
    assert coded == H * n
    view = table.view(pool)
    is_ref = reference_mask(torch.arange(n), weights.stride, weights.sinks)
    assert torch.equal(view.keys[0][:, is_ref], keys[0][:, is_ref]) and torch.equal(view.values[0][:, is_ref], values[0][:, is_ref])
    want_keys, want_values = _expected(weights, keys, values, n)
    assert torch.allclose(view.keys[0], want_keys, atol=1e-4) and torch.allclose(view.values[0], want_values, atol=1e-4)
    assert not torch.allclose(view.keys[0][:, ~is_ref], keys[0][:, ~is_ref], atol=1e-2)  # codes are lossy


def test_four_bit_codes_stay_within_half_a_step_of_the_full_codes():
    weights = _weights(seed=3)
    n = 40
    pool, table, _, _, _ = _coded_table(weights, n, seed=3)
    pool4, table4, _, _, _ = _coded_table(weights, n, bits=4, seed=3)
    blocks = torch.arange(1, 1 + n - int(reference_mask(torch.arange(n), 10, 4).sum()))  # every coded token's block
    full_codes = pool.tiers[0].codec.codes(pool.tiers[0].arrays, blocks)
    store4 = pool4.tiers[0]
    quantized = store4.codec.codes(store4.arrays, blocks)
    step = store4.arrays["code_scale"][blocks].float()
    assert bool(((quantized - full_codes).abs() <= step / 2 + 1e-5).all())
    assert store4.bytes_per_slot < pool.tiers[0].bytes_per_slot


def test_an_untrained_codec_round_trips_shapes_and_bytes_and_save_load_is_exact_to_its_stored_form(tmp_path):
    weights = _weights()
    weights.save(tmp_path / "codec", model="tiny")
    loaded = DeltaKVWeights.load(tmp_path / "codec")
    for name, tensor in weights.state_dict().items():
        if name in DeltaKVWeights.MATRICES:  # 8 bits per number: within half a step of its output channel
            step = tensor.abs().amax(1, keepdim=True) / 127
            assert bool(((loaded.state_dict()[name] - tensor).abs() <= step * 0.5001 + 1e-7).all()), name
        else:
            assert torch.equal(loaded.state_dict()[name], tensor if name == "inv_freq" else tensor.half().float()), name
    loaded.save(tmp_path / "again")  # what a checkpoint holds saves back exactly
    again = DeltaKVWeights.load(tmp_path / "again")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    n = 30
    pool, table, keys, _, _ = _coded_table(loaded, n, recent=5)
    view = table.view(pool)
    assert view.keys.shape == keys.shape and table.num_entries() == H * n
    refs = int(reference_mask(torch.arange(n - 5), 10, 4).sum())  # positions 0-3, 10, 20
    code_block = (2 * H * D // 4) * 4 + loaded.top_k * 4 + 4 + 2  # the code (fp32), reference ids, position, layer
    ref_block = 2 * H * D * 4 + 4
    plain = 5 * H * 2 * D * 4
    metadata = n * H * 8 + H * 8  # slot index and position per entry, a length per head
    assert table.nbytes(pool) == refs * ref_block + (n - 5 - refs) * code_block + plain + metadata


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["append", "code", "fork", "release"]), st.integers(1, 25)), min_size=1, max_size=12),
       seed=st.integers(0, 10**6))
def test_no_slot_or_reference_is_leaked_or_freed_early(ops, seed):
    """Random appends, coding passes, forks and releases: every table reads back what it read before the
    others changed, and once every table is released the pool and both tiers are empty."""
    weights = _weights()
    gen = torch.Generator().manual_seed(seed)
    pool = SlotPool(D)
    tier = pool.tier(DeltaKVCodec(weights))
    tables = [SlotTable(1, H)]
    for op, count in ops:
        live = [t for t in tables if t.num_entries() or t is tables[0]]
        table = live[count % len(live)]
        if op == "append":
            start = int(table.lengths[0, 0])
            table.append(pool, torch.randn(1, H, count, D, generator=gen), torch.randn(1, H, count, D, generator=gen),
                         torch.arange(start, start + count)[None])
        elif op == "code" and table.num_entries():
            table.code(pool, tier, count % 7, slice(0, 1), layer=count % 2)
        elif op == "fork" and table.num_entries():
            before = table.view(pool).keys.clone()
            twin = table.share(pool)
            table.code(pool, tier, 0, slice(0, 1), layer=0)
            assert torch.equal(twin.view(pool).keys, before)  # coding one table leaves its fork as it was
            tables.append(twin)
        elif op == "release" and len(tables) > 1:
            tables.pop(count % len(tables)).release(pool)
    for table in tables:
        if table.num_entries():
            assert bool(torch.isfinite(table.view(pool).keys).all())
        table.release(pool)
    assert pool.num_used == 0 and all(t.num_used == 0 for t in pool.tiers)


def test_a_token_is_coded_over_every_head_only_when_every_head_holds_it():
    weights = _weights()
    pool, table, _, _, _ = _coded_table(weights, 12, recent=12)
    keep = torch.ones(1, H, 12, dtype=torch.bool)
    keep[0, 0, 5] = False
    table.retain(pool, keep)
    with pytest.raises(ValueError, match="every head must hold the same"):
        table.code(pool, 1, 0, slice(0, 1), layer=1)
    assert math.isfinite(float(table.view(pool).keys.sum()))


def test_the_principal_start_is_the_best_linear_code_of_the_residuals():
    """x̂ − m is the projection of x − m on the residuals' top d_c principal directions (in scaled units):
    exact for residuals inside a d_c-dimensional space, and its error is the energy of the rest."""
    weights = _weights()
    width, d_c = 2 * H * D, weights.dims["code_width"]
    gen = torch.Generator().manual_seed(5)
    scale = weights.scale[0]
    basis = torch.linalg.qr(torch.randn(width, d_c, generator=gen))[0]
    inside = torch.randn(400, d_c, generator=gen) * torch.linspace(3, 1, d_c) @ basis.T  # residuals of rank d_c
    weights.fit_principal(0, inside)
    means = torch.randn(400, width, generator=gen)
    x = means + inside * scale
    assert torch.allclose(weights.reconstruct(0, weights.code(0, x, means), means), x, atol=1e-3)
    noisy = inside + 0.1 * torch.randn(400, width, generator=gen)
    weights.fit_principal(0, noisy)
    x = means + noisy * scale
    error = ((weights.reconstruct(0, weights.code(0, x, means), means) - x) / scale).pow(2).sum() / noisy.pow(2).sum()
    eigenvalues = torch.linalg.eigvalsh(noisy.T @ noisy)
    assert math.isclose(float(error), float(eigenvalues[:-d_c].sum() / eigenvalues.sum()), rel_tol=1e-3)
    other = DeltaKVWeights(2, H, D, weights.inv_freq, hidden=8).requires_grad_(False)
    with torch.no_grad():
        other.scale.copy_(weights.scale)
        other.w_linear[0], other.decoder[0], other.w_down[0] = basis, basis.T, 0.0  # a worse d_c-dimensional code
    worse = ((other.reconstruct(0, other.code(0, x, means), means) - x) / scale).pow(2).sum() / noisy.pow(2).sum()
    assert float(error) < float(worse)


def test_a_codec_saved_before_the_linear_path_loads_with_it_at_zero(tmp_path):
    from safetensors.torch import load_file, save_file

    weights = _weights()
    weights.save(tmp_path / "codec", model="tiny")
    stored = load_file(str(tmp_path / "codec" / "model.safetensors"))
    save_file({k: v for k, v in stored.items() if not k.startswith("w_linear")}, str(tmp_path / "codec" / "model.safetensors"))
    loaded = DeltaKVWeights.load(tmp_path / "codec")
    assert torch.equal(loaded.w_linear, torch.zeros_like(weights.w_linear))


def test_a_linear_codec_has_no_swiglu_path_and_round_trips(tmp_path):
    """Hidden width 0: f_c is the linear path alone, nothing of the SwiGLU is stored, and it loads back."""
    model = tiny_model(layers=2)
    weights = DeltaKVWeights(2, H, D, model.model.rotary_emb.inv_freq, hidden=0).requires_grad_(False)
    weights.w_linear.normal_(0, 0.3, generator=torch.Generator().manual_seed(4))
    x = torch.randn(5, 2 * H * D, generator=torch.Generator().manual_seed(5))
    assert torch.allclose(weights.compress(1, x), x @ weights.w_linear[1])
    weights.save(tmp_path / "linear", model="tiny")
    from safetensors.torch import load_file

    assert not any(k.startswith(("w_gate", "w_up", "w_down")) for k in load_file(str(tmp_path / "linear" / "model.safetensors")))
    loaded = DeltaKVWeights.load(tmp_path / "linear")
    step = weights.w_linear.abs().amax(1, keepdim=True) / 127  # 8 bits per number, within half a step
    assert loaded.dims["hidden"] == 0 and bool(((loaded.w_linear - weights.w_linear).abs() <= step * 0.5001 + 1e-7).all())
    assert torch.allclose(loaded.compress(1, x), x @ loaded.w_linear[1])


@settings(max_examples=25, deadline=None)
@given(n=st.integers(12, 70), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), picks=st.integers(1, 200),
       seed=st.integers(0, 10**6))
def test_the_compiled_rebuild_equals_its_pytorch_path(n, dtype, picks, seed):
    """``decode`` (4-bit codes on the CPU: csrc/deltakv_rebuild.cpp) against ``decode_torch``, over pool dtypes, tokens of
    two layers in one call, entries repeated and in any order."""
    gen = torch.Generator().manual_seed(seed)
    weights = _weights(seed=seed % 5)
    pool = SlotPool(D, dtype=dtype)
    codec = DeltaKVCodec(weights, bits=4)
    tier = pool.tier(codec)
    for layer in (0, 1):
        table = SlotTable(1, H)
        table.append(pool, torch.randn(1, H, n, D, generator=gen), torch.randn(1, H, n, D, generator=gen), torch.arange(n)[None])
        table.code(pool, tier, 0, slice(0, 1), layer=layer)
    store = pool.tiers[tier - 1]
    coded = (store.refs[1:] > 0).nonzero().squeeze(1) + 1  # every coded token's block
    entries = coded[torch.randint(coded.numel(), (picks,), generator=gen)] * H + torch.randint(H, (picks,), generator=gen)
    assert store.arrays["layer"][entries // H].unique().numel() <= 2
    keys, values = codec.decode(store.arrays, entries)
    want_keys, want_values = codec.decode_torch(store.arrays, entries)
    assert keys.dtype == values.dtype == torch.float32 and keys.shape == values.shape == (picks, D)
    assert torch.allclose(keys, want_keys, atol=1e-5, rtol=1e-5) and torch.allclose(values, want_values, atol=1e-5, rtol=1e-5)


def test_the_compiled_rebuild_refuses_an_entry_that_is_not_coded():
    weights = _weights()
    pool, table, _, _, _ = _coded_table(weights, 30, bits=4)
    store = pool.tiers[0]
    with pytest.raises(RuntimeError, match="is not of a coded token"):
        store.codec.decode(store.arrays, torch.tensor([store.arrays["code"].shape[0] * H]))


def _coded_rows(rows: int, n: int, recent: int, dtype: torch.dtype, seed: int, stored: bool = False):
    """A pool holding ``rows`` rows of n random entries of layer 1, coded in 4 bits but the ``recent`` newest; ``stored``:
    the decoder as a checkpoint stores it (8 bits per column: the compiled read's integer product)."""
    gen = torch.Generator().manual_seed(seed)
    pool, table = SlotPool(D, dtype=dtype), SlotTable(rows, H)
    weights = _weights(seed=seed % 5)
    if stored:
        codes, step = columns_in_8_bits(weights.decoder)
        weights.decoder.copy_(codes.float() * step)
    codec = DeltaKVCodec(weights, bits=4)
    assert (codec.stored_keys() is not None) == stored
    tier = pool.tier(codec)
    table.append(pool, torch.randn(rows, H, n, D, generator=gen), torch.randn(rows, H, n, D, generator=gen), torch.arange(n).expand(rows, n))
    table.code(pool, tier, recent, slice(0, rows), layer=1)
    return pool, table, gen


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 3), n=st.integers(12, 90), recent=st.integers(0, 8), groups=st.sampled_from([1, 3]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), chosen=st.integers(1, 120), weighted=st.booleans(), stored=st.booleans(),
       seed=st.integers(0, 10**6))
def test_the_in_place_read_of_deltakv_equals_its_pytorch_path(rows, n, recent, groups, dtype, chosen, weighted, stored, seed):
    """``paged_decode`` over tables naming plain slots, references and 4-bit codes (csrc/deltakv_rebuild.cpp's ``deltakv_decode``:
    keys rebuilt once per token, values summed as codes and projected) against the PyTorch read of every entry rebuilt by
    ``decode_torch``: out, lse and each entry's logit, over selections with holes and repeats, log-weights and GQA, with a
    decoder in float32 or as a checkpoint stores it (the keys' product in integers)."""
    pool, table, gen = _coded_rows(rows, n, recent, dtype, seed, stored)
    pages = table.view(pool).pages
    assert pages is not None and isinstance(pages.arrays()[2], DeltaKVBlocks)
    index = torch.randint(-1, n, (rows, H, chosen), generator=gen)
    pages = select_pages(pages, index)
    keys, values, blocks = pages.arrays()
    query = torch.randn(rows, H * groups, D, generator=gen).to(dtype)
    log_weights = [torch.randn(H, chosen, generator=gen) for _ in range(rows)] if weighted else None
    got_scores, want_scores = torch.zeros(rows, H * groups, chosen + 2), torch.zeros(rows, H * groups, chosen + 2)
    out, lse = paged_decode(query, keys, values, pages.tables, pages.lengths, log_weights, 0.3, blocks, got_scores)
    want, want_lse = paged_decode_torch(query, keys, values, pages.tables, pages.lengths, log_weights, 0.3, blocks, want_scores)
    # float32: sums in another order (the references' values weighed once each), errors scaled by the largest output;
    # bfloat16: the output's own rounding
    tolerance = 1e-5 * max(1.0, float(want.float().abs().max())) if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and torch.allclose(out.float(), want.float(), atol=tolerance, rtol=tolerance)
    assert torch.allclose(lse, want_lse, atol=1e-5, rtol=1e-5) and torch.allclose(got_scores, want_scores, atol=1e-5, rtol=1e-5)


def test_an_in_place_read_of_plain_slots_only_goes_to_the_plain_read():
    """Tables naming only plain slots and holes (a layer DeltaKV leaves raw, or a selection of the newest entries): the
    same out and lse as the reference, and a slot outside the pool is still refused."""
    pool, table, gen = _coded_rows(2, 40, 6, torch.float32, 5, stored=True)
    pages = table.view(pool).pages
    keys, values, blocks = pages.arrays()
    plain = (pages.tables[0] >> TIER_SHIFT == 0) & (pages.tables[0] != 0)
    columns = plain[0].nonzero().flatten()
    index = torch.cat([columns, torch.tensor([-1])]).expand(2, H, -1).contiguous()
    selected = select_pages(pages, index)
    assert all(int((t >> TIER_SHIFT).max()) == 0 for t in selected.tables)
    query = torch.randn(2, H, D, generator=gen)
    out, lse = paged_decode(query, keys, values, selected.tables, selected.lengths, None, 0.3, blocks)
    want, want_lse = paged_decode_torch(query, keys, values, selected.tables, selected.lengths, None, 0.3, blocks)
    assert torch.allclose(out, want, atol=1e-5) and torch.allclose(lse, want_lse, atol=1e-5)
    selected.tables[0][0, 0] = keys.shape[0] + 3
    with pytest.raises(RuntimeError, match="outside the pool"):
        paged_decode(query, keys, values, selected.tables, selected.lengths, None, 0.3, blocks)


@pytest.mark.parametrize("named", ["by a coded token", "by the table"])
def test_the_in_place_read_refuses_a_reference_past_the_rope_table(named):
    """A reference whose position lies past the RoPE table is refused before any work reads through it, whether a coded
    token names it or a table names it as an entry of its own."""
    pool, table, gen = _coded_rows(1, 40, 4, torch.float32, 3, stored=True)
    pages = table.view(pool).pages
    keys, values, blocks = pages.arrays()
    tiers = pages.tables[0] >> TIER_SHIFT
    wanted = blocks.tier if named == "by a coded token" else blocks.reference_tier
    column = int((tiers[0] == wanted).nonzero()[0])
    selected = select_pages(pages, torch.full((1, H, 1), column))
    blocks.references["position"].fill_(blocks.codec.rotary.shape[0] + 5)
    with pytest.raises(RuntimeError, match="past the table"):
        paged_decode(torch.randn(1, H, D, generator=gen), keys, values, selected.tables, selected.lengths, None, 0.3, blocks)


@pytest.mark.parametrize("stored", [False, True])
def test_an_in_place_read_of_heads_longer_than_a_chunk_equals_the_reference(stored):
    """Heads of 1100 entries, read in several chunks whose sums (Σ p v, Σ p·zero, Σ (p·step) c, the references' weights)
    merge by log-sum-exp: the same out and lse as the PyTorch read."""
    pool, table, gen = _coded_rows(2, 1100, 7, torch.float32, 11, stored)
    keys, values, blocks = table.view(pool).pages.arrays()
    pages = table.view(pool).pages
    query = torch.randn(2, 3 * H, D, generator=gen) * 3
    out, lse = paged_decode(query, keys, values, pages.tables, pages.lengths, None, 0.3, blocks)
    want, want_lse = paged_decode_torch(query, keys, values, pages.tables, pages.lengths, None, 0.3, blocks)
    # float32 sums over 1100 entries in another order, of outputs up to ~17: a few units in the last place of the largest
    assert torch.allclose(out, want, atol=2e-4, rtol=1e-5) and torch.allclose(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads, head_dim, code_width", [(3, 64, 192), (2, 72, 40), (2, 20, 12), (1, 96, 36)])
@pytest.mark.parametrize("extreme", [False, True])
def test_the_integer_key_product_at_model_shapes_equals_the_pytorch_read(heads, head_dim, code_width, extreme):
    """The compiled read's key product (4-bit codes against the decoder's key columns in 8 bits, ``key_product`` in
    csrc/deltakv_rebuild.cpp) against the PyTorch read: at SmolLM2's shape (3 KV heads of 64, d_c 192) and at shapes that take,
    with AVX512-VNNI, the 64- and 16-column paths with quads left after the four chains; with AVX2, the 32- and 8-column
    paths and a last run of fewer than eight quads of 16-bit sums; and the scalar tail.
    ``extreme``: every code 15 and every key weight ±127, the largest sums the 16-bit stage must hold."""
    gen = torch.Generator().manual_seed(head_dim + code_width)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    weights = DeltaKVWeights(2, heads, head_dim, inv_freq, hidden=0, code_width=code_width)
    with torch.no_grad():
        weights.decoder.normal_(0, 0.3, generator=gen)
        weights.scale.uniform_(0.5, 2.0, generator=gen)
        weights.w_linear.normal_(0, 0.3, generator=gen)
        if extreme:  # each key column ±0.05: its 8-bit codes ±127
            signs = torch.randint(0, 2, (2, code_width, heads * head_dim), generator=gen).float() * 2 - 1
            weights.decoder[:, :, : heads * head_dim] = 0.05 * signs
        codes, step = columns_in_8_bits(weights.decoder)
        weights.decoder.copy_(codes.float() * step)
    codec = DeltaKVCodec(weights, bits=4)
    assert codec.stored_keys() is not None
    n = 300
    pool, table = SlotPool(head_dim), SlotTable(1, heads)
    tier = pool.tier(codec)
    table.append(pool, torch.randn(1, heads, n, head_dim, generator=gen), torch.randn(1, heads, n, head_dim, generator=gen),
                 torch.arange(n)[None])
    table.code(pool, tier, 4, slice(0, 1), layer=1)
    if extreme:
        pool.tiers[tier - 1].arrays["code"].fill_(255)
        pool.tiers[tier - 1].arrays["code_scale"].fill_(0.01)
    pages = table.view(pool).pages
    keys, values, blocks = pages.arrays()
    query = torch.randn(1, 2 * heads, head_dim, generator=gen)
    got_scores, want_scores = torch.zeros(1, 2 * heads, n), torch.zeros(1, 2 * heads, n)
    out, lse = paged_decode(query, keys, values, pages.tables, pages.lengths, None, 0.05, blocks, got_scores)
    want, want_lse = paged_decode_torch(query, keys, values, pages.tables, pages.lengths, None, 0.05, blocks, want_scores)
    scale = max(1.0, float(want_scores.abs().max()))
    assert torch.allclose(got_scores, want_scores, atol=1e-5 * scale, rtol=1e-5)
    assert torch.allclose(lse, want_lse, atol=1e-5 * scale, rtol=1e-5)
    assert torch.allclose(out, want, atol=1e-4 * max(1.0, float(want.abs().max())), rtol=1e-4)


def test_a_decoding_read_of_deltakv_entries_in_place_equals_the_reference():
    """A coded table's view reads in place (pages naming DeltaKV's tiers), and ``read`` agrees with the float32 reference
    over the same entries gathered and rebuilt; a table naming an entry of no tier given is refused."""
    pool, table, gen = _coded_rows(2, 60, 5, torch.float32, 3)
    view = table.view(pool)
    query, positions = torch.randn(2, 2 * H, 1, D, generator=gen), torch.tensor([[60], [60]])
    paged = read(query, positions, view, 0.25, col_sums=True)
    reference, lse, sums = read_reference(query, positions, view, 0.25, col_sums=True)
    assert torch.allclose(paged.out, reference, atol=1e-5) and torch.allclose(paged.lse, lse, atol=1e-5)
    assert torch.allclose(paged.col_sums, sums, atol=1e-5)
    keys, values, blocks = view.pages.arrays()
    wrong = [t.clone() for t in view.pages.tables]
    wrong[0][0, 3] = (blocks.tier << TIER_SHIFT) | (blocks.arrays["code"].shape[0] * H)  # past the code tier
    with pytest.raises(RuntimeError, match="outside the pool"):
        paged_decode(query[:, :, 0], keys, values, wrong, view.pages.lengths, None, 0.25, blocks)
