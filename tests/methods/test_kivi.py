"""KIVI as a method and as any policy's storage: exactness where nothing is coded, kr from the accounting
formula, composition with eviction, forks, bf16, and clear errors."""

import pytest
import torch

from common import layers_of, tiny_model
from kvcompress import CompressedCache, get_method
from kvcompress.store.slots import TIER_SHIFT

D, HEADS, LAYERS = 16, 2, 2  # tiny_model's head dim, KV heads and layers


def _generate(model, ids, cache, new=8):
    return model.generate(ids, past_key_values=cache, max_new_tokens=new, do_sample=False, pad_token_id=0)


def test_kivi_with_every_entry_in_its_residual_decodes_as_the_full_cache():
    model = tiny_model(seed=3)
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    reference = _generate(model, ids, CompressedCache(model, get_method("full")))
    cache = CompressedCache(model, get_method("kivi", residual=100))
    assert torch.equal(_generate(model, ids, cache), reference)
    assert cache.session.pool.tiers[0].num_used == 0  # nothing was coded


def _expected_bytes(coded: int, plain: int, bits: int, group: int) -> int:
    """KIVI's accounting for one head: whole blocks of codes with 16-bit zero points and scales (keys per
    channel per block, values per entry per channel group), plain fp32 entries, and the table's slot index
    and position per entry and length per head."""
    codes = 2 * group * D * bits // 8
    key_params = 2 * D * 2
    value_params = group * (D // min(group, D)) * 2 * 2
    block = codes + key_params + value_params
    return (coded // group) * block + plain * 2 * D * 4 + (coded + plain) * 8 + 8


@pytest.mark.parametrize("bits", [2, 4])
def test_kr_is_the_accounting_formula_over_full(bits):
    model = tiny_model(seed=1)
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    method = get_method("kivi", bits=bits, group_size=8, residual=20)
    cache = CompressedCache(model, method)
    with torch.no_grad():
        out = model(ids, past_key_values=cache).logits
    stats = cache.stats()
    full = LAYERS * 100 * 2 * HEADS * D * 4
    assert stats["kv_bytes_full"] == full
    assert stats["kv_bytes"] == LAYERS * HEADS * _expected_bytes(80, 20, bits, 8)  # 80 coded in 10 blocks, 20 plain
    assert stats["kr"] == stats["kv_bytes"] / full
    with torch.no_grad():  # 13 new tokens: one more block (the 8 after the oldest plain ones) is coded on the way
        for _ in range(13):
            out = model(out[:, -1:].argmax(-1), past_key_values=cache).logits
    assert cache.stats()["kv_bytes"] == LAYERS * HEADS * _expected_bytes(88, 25, bits, 8)


def test_snapkv_with_a_kivi_codec_keeps_what_snapkv_keeps_in_fewer_bytes():
    model = tiny_model(seed=2)
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(2))
    plain = CompressedCache(model, get_method("snapkv", ratio=0.5, window=8))
    coded = CompressedCache(model, get_method('snapkv:window=8+kivi:bits=4:group_size=8:residual=8', ratio=0.5))
    for cache in (plain, coded):
        with torch.no_grad():
            model(ids, past_key_values=cache)
    for a, b in zip(layers_of(plain), layers_of(coded)):
        assert torch.equal(a.view().positions, b.view().positions)
        ids_held = b.session.table.ids[b.session.rows(b.idx), :, :, 0]
        assert bool((ids_held >> TIER_SHIFT > 0).any())  # what snapkv keeps is coded
    assert coded.stats()["kr"] < 0.5 * plain.stats()["kr"]
    assert coded.session.method.label == "snapkv@0.5[window=8]+kivi[bits=4,group_size=8,residual=8]"


def test_a_kivi_fork_equals_kivi_directly_and_leaves_the_shared_prefill_plain():
    model = tiny_model(seed=4)
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(4))
    method = get_method("kivi", group_size=8, residual=16)
    direct = CompressedCache(model, method)
    shared = CompressedCache(model, compress_on_prefill=False)
    for cache in (direct, shared):
        with torch.no_grad():
            model(ids, past_key_values=cache)
    before = shared.stats()
    forked = shared.fork(method)
    for a, b in zip(layers_of(direct), layers_of(forked)):
        assert torch.equal(a.view().keys, b.view().keys) and torch.equal(a.view().values, b.view().values)
    assert shared.stats() == before
    assert bool((shared.session.table.ids[..., 0] >> TIER_SHIFT == 0).all())
    assert torch.equal(_generate(model, ids, forked), _generate(model, ids, direct))


def test_kivi_on_a_bf16_model_stays_finite():
    model = tiny_model(seed=5).to(torch.bfloat16)
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(5))
    cache = CompressedCache(model, get_method("kivi", residual=0, group_size=8))
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits
        logits = model(logits[:, -1:].argmax(-1), past_key_values=cache).logits
    assert bool(torch.isfinite(logits).all())
    assert cache.session.pool.tiers[0].codec.param_dtype == torch.bfloat16


def test_bad_codecs_fail_clearly():
    with pytest.raises(ValueError, match="2 or 4 bits"):
        get_method("kivi", bits=3)
    with pytest.raises(ValueError, match="residual"):
        get_method("kivi", residual=-1)
    with pytest.raises(ValueError, match="group_size must be a multiple of 4, got 6"):  # 2-bit key codes: 4 to a byte
        get_method("kivi", group_size=6)
    assert get_method("kivi:bits=4", group_size=6).storage.group_size == 6  # 4-bit key codes: 2 to a byte
    with pytest.raises(ValueError, match="2 or 4 bits"):
        get_method("snapkv+kivi:bits=3", ratio=0.5)
    with pytest.raises(ValueError, match="option bits='four' must be a whole number"):
        get_method("snapkv+kivi:bits=four", ratio=0.5)
    with pytest.raises(ValueError, match="unknown part 'kiwi'"):
        get_method("snapkv+kiwi", ratio=0.5)
    with pytest.raises(ValueError, match="kivi has no option codec"):
        get_method("kivi", codec="kivi")


def test_selection_over_coded_storage_decodes_only_the_entries_it_reads(monkeypatch):
    """``omnikv+kivi``: layers 0 and 1 read every entry and the layers after the filter only the entries they select,
    dequantised in place by the decoding kernel; the filter layer chooses from its own read's weights (one read).
    Nothing is dequantised outside the kernel."""
    import kvcompress.read as read_module
    from kvcompress.store.codecs import KiviCodec

    decoded, paged = [], []
    original_decode, original_paged = KiviCodec.decode, read_module.paged_decode
    monkeypatch.setattr(KiviCodec, "decode", lambda self, arrays, entries: decoded.append(entries.numel()) or original_decode(self, arrays, entries))

    def spy(query, keys, values, tables, lengths, log_weights, scaling, kivi=None, scores=None, longest=None):
        named = sum(int((t[h, : int(lengths[r, h])] != 0).sum()) for r, t in enumerate(tables) for h in range(t.shape[0]))
        paged.append((named, kivi is not None))
        return original_paged(query, keys, values, tables, lengths, log_weights, scaling, kivi, scores, longest)

    monkeypatch.setattr(read_module, "paged_decode", spy)
    model = tiny_model(seed=6, layers=4)
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(6))
    method = get_method('omnikv:filters=(1,):recent=8:sinks=2+kivi:group_size=8:residual=8', budget=24)
    cache = CompressedCache(model, method)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits
        decoded.clear()
        model(logits[:, -1:].argmax(-1), past_key_values=cache)
    held = cache.stats()["entries"] // 4  # per layer (1 batch row × 2 KV heads)
    assert decoded == []
    assert len(paged) == 4 and all(coded for _, coded in paged)  # every layer reads coded entries in place, once
    assert paged[0][0] == paged[1][0] == held and all(named <= 2 * 24 < held for named, _ in paged[2:])  # all; then a selection