"""DeltaKV as a method and as a selection method's codec: exact while nothing is coded, kr from the accounting
formula at the prefill and after chunks coded while decoding, hybrid layers, forks, bf16, selection that
rebuilds only what it reads, clear errors, and training that lowers its loss and resumes exactly."""

import json

import pytest
import torch

from common import layers_of, shipped_folder, tiny_codec, tiny_model
from conftest import tiny_tokenizer
from kvcompress import CompressedCache, get_method
from kvcompress.read import paged
from kvcompress.store.deltakv import DeltaKVWeights, reference_mask
from kvcompress.store.slots import ENTRY_MASK, TIER_SHIFT
from kvcompress.train.deltakv import DeltaKVTraining, train_deltakv

D, HEADS, LAYERS = 16, 2, 2  # tiny_model's head dim, KV heads and layers


def _generate(model, ids, cache, new=8):
    return model.generate(ids, past_key_values=cache, max_new_tokens=new, do_sample=False, pad_token_id=0)


def _deltakv(model, **options):
    return get_method("deltakv", checkpoint=tiny_codec(model), **options)


def test_deltakv_with_every_token_recent_decodes_as_the_full_cache():
    model = tiny_model(seed=3)
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    reference = _generate(model, ids, CompressedCache(model, get_method("full")))
    cache = CompressedCache(model, _deltakv(model, recent=100))
    assert torch.equal(_generate(model, ids, cache), reference)
    assert all(tier.num_used == 0 for tier in cache.session.pool.tiers)  # nothing was coded


def _layer_bytes(refs: int, codes: int, plain: int, bits: int | None = None) -> int:
    """DeltaKV's accounting for one layer of one row: a reference is a raw token over every head plus its
    position, a coded token a code of d_c = 2·H·d/4 numbers (fp32 here, or 4 bits each with a float16 zero
    point and scale), 4 reference ids, its position and layer; plain tokens are raw; every entry has a slot
    index and a position, every head a length."""
    ref_block = 2 * HEADS * D * 4 + 4
    code = (2 * HEADS * D // 4) * 4 if bits is None else (2 * HEADS * D // 4) // 2 + 2 + 2
    code_block = code + 4 * 4 + 4 + 2
    tokens = refs + codes + plain
    return refs * ref_block + codes * code_block + plain * 2 * HEADS * D * 4 + tokens * HEADS * 8 + HEADS * 8


@pytest.mark.parametrize("bits", [None, 4])
def test_kr_is_the_accounting_formula_over_full_at_the_prefill_and_while_decoding(bits):
    model = tiny_model(seed=1)
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    cache = CompressedCache(model, _deltakv(model, recent=20, chunk=8, full_layers=(0,), bits=bits))
    with torch.no_grad():
        out = model(ids, past_key_values=cache).logits
    refs = int(reference_mask(torch.arange(80), 10, 4).sum())  # positions 0–3, 10, …, 70
    full_layer = lambda n: n * 2 * HEADS * D * 4 + n * HEADS * 8 + HEADS * 8  # noqa: E731 — layer 0 stays plain
    stats = cache.stats()
    assert stats["kv_bytes_full"] == LAYERS * 100 * 2 * HEADS * D * 4
    assert stats["kv_bytes"] == full_layer(100) + _layer_bytes(refs, 80 - refs, 20, bits)
    assert stats["kr"] == stats["kv_bytes"] / stats["kv_bytes_full"]
    with torch.no_grad():  # the 8th new token codes positions 80–87 (position 80 a reference); 25 stay raw
        for _ in range(13):
            out = model(out[:, -1:].argmax(-1), past_key_values=cache).logits
    assert cache.stats()["kv_bytes"] == full_layer(113) + _layer_bytes(refs + 1, 80 - refs + 7, 25, bits)
    assert bool(torch.isfinite(out).all())


def test_the_paper_accounting_bounds_the_bytes_of_references_and_codes():
    """Appendix D.5: KR = L_full/L + (L_sparse/L)·(1/s + d_c/(2·H·d)) counts a reference and a code for every
    s tokens; the store holds s − 1 codes per reference, so its storage bytes (ids and table aside) fall just
    below the formula for a prompt whose references are exactly every s-th token."""
    model = tiny_model(seed=2)
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(2))
    folder = tiny_codec(model)
    weights = DeltaKVWeights.load(folder)
    weights.sinks = 0
    method = get_method("deltakv", checkpoint=folder, recent=0, bits=None)
    method.storage.__dict__["weights"] = weights  # the cached checkpoint, with no sinks: references at 0, 10, …, 90
    cache = CompressedCache(model, method)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    pool = cache.session.pool
    codes, refs = pool.tiers[0], pool.tiers[1]
    assert refs.num_used == LAYERS * 10 and codes.num_used == LAYERS * 90
    storage = LAYERS * (10 * 2 * HEADS * D + 90 * 2 * HEADS * D // 4) * 4
    full = cache.stats()["kv_bytes_full"]
    assert storage / full == pytest.approx(0.1 + 0.9 * 0.25) and storage / full < 0.1 + 0.25


def test_a_deltakv_fork_equals_deltakv_directly_and_leaves_the_shared_prefill_plain():
    model = tiny_model(seed=4)
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(4))
    method = _deltakv(model, recent=8)
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
    assert torch.equal(_generate(model, ids, forked), _generate(model, ids, direct))
    forked.session.release()
    shared.session.release()
    assert all(tier.num_used == 0 for tier in shared.session.pool.tiers)


def test_deltakv_on_a_bf16_model_stays_finite_with_four_bit_codes():
    model = tiny_model(seed=5).to(torch.bfloat16)
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(5))
    caches = [CompressedCache(model, _deltakv(model, recent=0, bits=bits)) for bits in (None, 4)]
    for cache in caches:
        with torch.no_grad():
            logits = model(ids, past_key_values=cache).logits
            logits = model(logits[:, -1:].argmax(-1), past_key_values=cache).logits
        assert bool(torch.isfinite(logits).all())
    assert caches[1].stats()["kr"] < caches[0].stats()["kr"] < 0.75


def test_selection_over_deltakv_rebuilds_only_the_entries_it_reads(monkeypatch):
    """``omnikv+deltakv``: the layers that read every entry (before the filter layer and the filter layer) stay raw, as
    the paper's hybrid layers; the layers after a filter layer read in place and rebuild only the tokens they select."""
    rebuilt = []
    original = paged._deltakv_decode

    def counting(query, keys, values, tables, lengths, *rest):
        named = torch.cat([t[h, : int(n)] for t, row in zip(tables, lengths) for h, n in enumerate(row)]).long()
        rebuilt.append(torch.unique((named[(named >> TIER_SHIFT) == rest[2].tier] & ENTRY_MASK) // HEADS).numel())
        return original(query, keys, values, tables, lengths, *rest)

    monkeypatch.setattr(paged, "_deltakv_decode", counting)
    model = tiny_model(seed=6, layers=4)
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(6))
    codec = f'deltakv:recent=8:checkpoint="{tiny_codec(model)}"'
    method = get_method(f"omnikv:filters=(1,):recent=8:sinks=2+{codec}", budget=24)
    assert method.storage_for(torch.float32, 4)[0].full_layers == {0, 1} | set(method.storage.layers_left_full())
    cache = CompressedCache(model, method)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits
        rebuilt.clear()
        model(logits[:, -1:].argmax(-1), past_key_values=cache)
    assert rebuilt[:2] == [0, 0] and 0 < rebuilt[2] <= 24 and 0 < rebuilt[3] <= 24  # layers 0, 1 raw; 2, 3 at most what they select
    kept_raw = get_method(f"quest+{codec}", budget=24).storage_for(torch.float32, 4)[0]
    assert kept_raw.full_layers == set(method.storage.layers_left_full())  # Quest reads pages in every layer: none kept raw


def test_bad_uses_fail_clearly(tmp_path):
    model = tiny_model(seed=7)
    with pytest.raises(ValueError, match="takes no size"):
        get_method("deltakv", budget=8)
    with pytest.raises(ValueError, match="deltakv has no option codec"):
        get_method("deltakv", codec="kivi")
    with pytest.raises(ValueError, match="bits must be None"):
        get_method("deltakv", bits=2)
    with pytest.raises(ValueError, match="evicts entries head by head"):
        get_method("snapkv+deltakv", ratio=0.5)
    with pytest.raises(ValueError, match="is not a folder"):
        get_method("deltakv", checkpoint=str(tmp_path / "missing"))
    other = tmp_path / "other"
    DeltaKVWeights(5, HEADS, D, model.model.rotary_emb.inv_freq, hidden=8).save(other)
    with pytest.raises(ValueError, match="train a codec for it"):
        CompressedCache(model, get_method("deltakv", checkpoint=str(other)))
    with pytest.raises(ValueError, match=r"full_layers \[7\]"):
        CompressedCache(model, _deltakv(model, full_layers=(7,)))


def test_training_lowers_the_error_and_resumes_exactly(tmp_path, monkeypatch):
    import kvcompress.train.deltakv as training

    model = tiny_model(layers=2)
    tokenizer = tiny_tokenizer()
    gen = torch.Generator().manual_seed(3)
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"w{int(x)}" for x in torch.randint(2, 60, (3000,), generator=gen)))
    run = DeltaKVTraining(steps=30, seq_len=48, hidden=16, save_every=10, lr=1e-2)
    first = train_deltakv(model, tokenizer, tmp_path / "a", run, data=str(text), progress=False)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["full_layers"] == [0] and set(first) >= {"mse", "kl"}
    random_start = DeltaKVTraining(steps=30, seq_len=48, hidden=16, save_every=10, lr=1e-2, principal=0)
    from_random = train_deltakv(model, tokenizer, tmp_path / "r", random_start, data=str(text), progress=False)
    random_history = json.loads((tmp_path / "r" / "config.json").read_text())["history"]
    assert from_random["mse"] < 0.9 * random_history[0]["mse"]  # training learns from a random start
    assert config["history"][0]["mse"] < 0.9 * random_history[0]["mse"]  # the principal start begins far ahead
    assert len(config["layer_kl"]) == 2 and min(config["layer_kl"]) >= 0  # each layer's cost when coded alone
    real_losses, calls = training.losses, []

    def stop_after_15(*args, **kwargs):
        calls.append(1)
        if len(calls) == 16:
            raise KeyboardInterrupt
        return real_losses(*args, **kwargs)

    monkeypatch.setattr(training, "losses", stop_after_15)
    with pytest.raises(KeyboardInterrupt):
        train_deltakv(model, tokenizer, tmp_path / "b", run, data=str(text), progress=False)
    monkeypatch.setattr(training, "losses", real_losses)
    train_deltakv(model, tokenizer, tmp_path / "b", run, data=str(text), progress=False)  # resumes from step 10
    a, b = DeltaKVWeights.load(tmp_path / "a"), DeltaKVWeights.load(tmp_path / "b")
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    ids = torch.randint(3, 60, (1, 50), generator=gen)
    cache = CompressedCache(model, get_method("deltakv", checkpoint=str(tmp_path / "a"), recent=4))
    assert bool(torch.isfinite(_generate(model, ids, cache, new=4)).all())


@pytest.mark.parametrize("what,flags", [("deltakv", ["--hidden", "8", "--full-layers", "0,1"]), ("deltakv", ["--hidden", "0"]),
                                        ("retention", ["--width", "4"])])
def test_the_train_verb_writes_a_checkpoint_the_method_loads(what, flags, tiny_checkpoint, tmp_path, capsys):
    from kvcompress.cli import main as cli_main

    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"w{i % 50}" for i in range(2000)))
    out = tmp_path / what
    model = str(tiny_checkpoint())

    def argv(steps: int) -> list[str]:
        return ["train", what, "--model", model, "--out", str(out), "--steps", str(steps), "--seq-len", "32", "--data", str(text),
                "--save-every", "2", "--quiet", *flags]

    assert cli_main(argv(3)) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["method"] == what and config["settings"]["steps"] == 3 and (out / "steps" / "000002").is_dir()
    assert f"{what}:checkpoint=" in capsys.readouterr().out
    if what == "deltakv" and "--full-layers" in flags:
        assert config["full_layers"] == [0, 1] and get_method("deltakv", checkpoint=str(out)).storage.layers_left_full() == (0, 1)
    if "--hidden" in flags:
        assert config["hidden"] == int(flags[flags.index("--hidden") + 1])  # 0: a linear codec, trained as it ships
    weights = (out / "model.safetensors").read_bytes()
    assert cli_main(argv(3)) == 0 and (out / "model.safetensors").read_bytes() == weights  # a finished run: nothing to do
    capsys.readouterr()
    assert cli_main(argv(4)) == 2  # other settings: refused
    assert "other steps" in capsys.readouterr().err


def test_sessions_of_one_method_share_its_codec_tiers():
    model = tiny_model(seed=8, layers=2)
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(8))
    method = get_method(f"omnikv:filters=(1,)+deltakv:recent=4:checkpoint=\"{tiny_codec(model)}\"", budget=16)
    shared = CompressedCache(model, compress_on_prefill=False)
    with torch.no_grad():
        model(ids, past_key_values=shared)
    forks = [shared.fork(method) for _ in range(20)]  # more than a pool's 15 tiers, were each fork to make its own
    assert len(shared.session.pool.tiers) == 2   # codes and references
    assert all(torch.equal(f.session.view(1).keys, forks[0].session.view(1).keys) for f in forks)


@pytest.mark.parametrize("name, shapes", [("smollm2-135m-instruct", (30, 3, 64)), ("qwen2.5-coder-0.5b", (24, 2, 64))])
def test_codecs_ship_for_both_built_in_models(name, shapes):
    """The package ships a codec for the embedded model and the second one, found by name or by shape, trained
    for the method's default (codes in 4 bits) and leaving a layer of the model full."""
    weights = DeltaKVWeights.load(shipped_folder("deltakv", name, dict(zip(("num_layers", "num_kv_heads", "head_dim"), shapes))))
    assert (weights.dims["num_layers"], weights.dims["num_kv_heads"], weights.dims["head_dim"]) == shapes
    about = weights.about
    assert about["model"] == name and about["settings"]["bits"] == get_method("deltakv").storage.bits
    assert all(0 <= layer < shapes[0] for layer in about["full_layers"])
    assert bool(weights.w_linear.abs().sum() > 0)  # trained with the linear path (not an older codec)
