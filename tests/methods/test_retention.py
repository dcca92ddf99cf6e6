"""Learned global retention: the score's closed form, one budget over every layer and head (at prefill and
while decoding), gates that start from full attention, training that lowers its loss, resumes exactly
and saves what it loads."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcompress as kvc
from common import shipped_folder, tiny_model
from conftest import tiny_tokenizer
from kvcompress.methods.retention import LOG_BETA, RetentionGates, log_retention_score
from kvcompress.train.retention import RetentionTraining, losses, train_retention

LAYERS, HEADS, HIDDEN = 3, 2, 64


@pytest.fixture
def gates_dir(tmp_path):
    """Untrained gates for the 3-layer tiny model, with c low enough that β differ between tokens."""
    path = tmp_path / "gates"
    RetentionGates(LAYERS, HEADS, HIDDEN, width=8, c_init=2.0, seed=1).save(path, model="tiny")
    return path


@pytest.fixture(scope="module")
def model():
    return tiny_model(layers=LAYERS)


def _attention_inputs(model, layer, run) -> list:
    """The attention inputs [B, q, D] layer ``layer`` sees during ``run()``, one per forward."""
    seen = []
    handle = model.model.layers[layer].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["hidden_states"]), with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return seen


def _words(count, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(x)}" for x in torch.randint(2, 60, (count,), generator=gen))


@settings(max_examples=60, deadline=None)
@given(st.floats(1e-6, 1.0), st.integers(0, 300), st.integers(1, 8))
def test_horizon_score_equals_its_sum(beta, age, horizon):
    direct = sum(beta ** (age + k) for k in range(1, horizon + 1))
    got = float(log_retention_score(torch.tensor(math.log(beta), dtype=torch.float64), torch.tensor(age), horizon).exp())
    assert got == pytest.approx(direct, rel=1e-9, abs=1e-300)


def test_one_budget_over_every_layer_and_head(model, gates_dir):
    method = kvc.get_method("retention", budget=12, checkpoint=str(gates_dir))
    cache = kvc.CompressedCache(model, method)
    ids = tiny_tokenizer()(_words(80), return_tensors="pt").input_ids
    model(ids, past_key_values=cache, use_cache=True)
    sizes = torch.stack([cache.session.lengths(i)[0] for i in range(LAYERS)])  # [layers, heads]
    assert int(sizes.sum()) == 12 * LAYERS * HEADS  # exactly M entries held
    assert len(set(sizes.view(-1).tolist())) > 1  # layers and heads keep different numbers
    stats = cache.stats()
    assert stats["entries"] == 12 * LAYERS * HEADS == cache.session.pool.num_used
    # bytes held: each entry's fp32 key and value (d = 16), slot index, position and log β; each head's length
    assert stats["kv_bytes"] == 12 * LAYERS * HEADS * (2 * 16 * 4 + 4 + 4 + 4) + LAYERS * HEADS * 8
    # the kept entries are the M best by score over all layers and heads (scores recomputed from the gates)
    worst_kept = min(float(log_retention_score(cache.session.view(i).channels[LOG_BETA], 79 - cache.session.view(i).positions, 1).min())
                     for i in range(LAYERS))
    gates, every = RetentionGates.load(gates_dir), []
    for layer in range(LAYERS):
        with torch.no_grad():
            hidden = _attention_inputs(model, layer, lambda: model(ids))[0]
        every.append(log_retention_score(gates.log_beta(layer, hidden), 79 - torch.arange(80), 1).reshape(-1))
    threshold = float(torch.cat(every).topk(12 * LAYERS * HEADS).values.min())
    assert worst_kept >= threshold - 1e-9


def test_decoding_keeps_the_total_between_budget_and_budget_plus_slack(model, gates_dir):
    tokenizer = tiny_tokenizer()
    method = kvc.get_method("retention", budget=10, checkpoint=str(gates_dir), slack=5)
    out = kvc.generate(model, tokenizer, _words(60), "w3 w4", method, max_new_tokens=30)
    cache = kvc.CompressedCache(model, method)
    ids = tokenizer(_words(60), return_tensors="pt").input_ids
    model.generate(ids, past_key_values=cache, max_new_tokens=30, do_sample=False)
    total = sum(int(cache.session.lengths(i).sum()) for i in range(LAYERS))
    assert 10 * LAYERS * HEADS <= total <= 10 * LAYERS * HEADS + 5
    assert len(out.token_ids) == 30


def test_new_entries_carry_their_gates_beta(model, gates_dir):
    method = kvc.get_method("retention", budget=200, checkpoint=str(gates_dir))
    cache = kvc.CompressedCache(model, method)
    ids = tiny_tokenizer()(_words(40), return_tensors="pt").input_ids
    model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
    gates = RetentionGates.load(gates_dir)
    full = kvc.CompressedCache(model, kvc.get_method("full"))
    inputs = _attention_inputs(model, 1, lambda: model.generate(ids, past_key_values=full, max_new_tokens=3, do_sample=False))
    expected = gates.log_beta(1, torch.cat(inputs, dim=1))[0]  # the prompt's 40 tokens, then two decoded ones
    view = cache.session.view(1)
    assert view.shape[2] == 42 and torch.allclose(view.channels[LOG_BETA][0], expected, atol=1e-6)


def test_untrained_gates_start_from_full_attention(model, tmp_path):
    tokenizer = tiny_tokenizer()
    fresh = tmp_path / "fresh"
    RetentionGates(LAYERS, HEADS, HIDDEN, width=8).save(fresh)  # c = 10: β ≈ 1
    from kvcompress.train.retention import _use_gated_attention

    ids = tokenizer(_words(120), return_tensors="pt").input_ids
    restore = _use_gated_attention(model)
    try:
        parts = losses(model, RetentionGates.load(fresh), ids, RetentionTraining(), budget_total=10**6)
    finally:
        restore()
    assert float(parts["kl"].detach()) < 1e-3 and float(parts["capacity"].detach()) == 0.0
    context = _words(100)
    full = kvc.generate(model, tokenizer, context, "w5", "full", max_new_tokens=8)
    kept_all = kvc.generate(model, tokenizer, context, "w5", kvc.get_method("retention", budget=500, checkpoint=str(fresh)),
                            max_new_tokens=8)
    assert kept_all.token_ids == full.token_ids


def test_training_lowers_the_loss_is_deterministic_and_resumes_exactly(model, tmp_path, monkeypatch):
    import kvcompress.train.retention as training

    text = tmp_path / "words.txt"
    text.write_text(_words(3000, seed=3))
    tokenizer = tiny_tokenizer()
    run = RetentionTraining(steps=40, seq_len=48, budget=4, width=8, save_every=10, lr=1e-2, c_init=4.0)
    first = train_retention(model, tokenizer, tmp_path / "a", run, data=str(text), progress=False)
    history = json.loads((tmp_path / "a" / "config.json").read_text())["history"]
    assert first["loss"] < history[0]["loss"] * 0.9
    gates_a = RetentionGates.load(tmp_path / "a")

    real_losses, calls = training.losses, []

    def stop_after_25(*args, **kwargs):
        calls.append(1)
        if len(calls) == 26:
            raise KeyboardInterrupt
        return real_losses(*args, **kwargs)

    monkeypatch.setattr(training, "losses", stop_after_25)
    with pytest.raises(KeyboardInterrupt):
        train_retention(model, tokenizer, tmp_path / "b", run, data=str(text), progress=False)
    monkeypatch.setattr(training, "losses", real_losses)
    assert not (tmp_path / "b" / "model.safetensors").exists()
    first_part = torch.load(tmp_path / "b" / "state.pt", weights_only=False)["seconds"]
    assert first_part > 0
    train_retention(model, tokenizer, tmp_path / "b", run, data=str(text), progress=False)  # resumes from step 20
    resumed = json.loads((tmp_path / "b" / "config.json").read_text())
    assert resumed["train_seconds"] >= round(first_part, 1)  # the time before the interruption counts too
    gates_b = RetentionGates.load(tmp_path / "b")
    for name, tensor in gates_a.state_dict().items():
        assert torch.equal(tensor, gates_b.state_dict()[name]), name
    with pytest.raises(ValueError, match="other steps"):
        train_retention(model, tokenizer, tmp_path / "b", RetentionTraining(steps=41, seq_len=48, budget=4, width=8, save_every=10,
                                                                          lr=1e-2, c_init=4.0),
                        data=str(text), progress=False)


def test_save_load_round_trip_and_clear_errors(model, gates_dir, tmp_path):
    gates = RetentionGates(LAYERS, HEADS, HIDDEN, width=8, c_init=2.0, seed=1)
    loaded = RetentionGates.load(gates_dir)
    for name, tensor in gates.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name])
    other = tmp_path / "other"
    RetentionGates(5, HEADS, HIDDEN).save(other)
    with pytest.raises(ValueError, match="train gates for it"):
        kvc.generate(model, tiny_tokenizer(), _words(60), "w1", kvc.get_method("retention", budget=8, checkpoint=str(other)))
    from kvcompress.eval.runner import EvalSettings, run_eval

    text = tmp_path / "tasks.jsonl"
    text.write_text(json.dumps({"id": "a", "context": _words(60), "question": "w1", "answers": ["w2"], "task": "t",
                                "metric": "contains"}) + "\n")
    settings = EvalSettings(methods=[f'retention:checkpoint="{other}"'], budgets=[8], tasks=[], task_files=[str(text)])
    with pytest.raises(ValueError, match="train gates for it"):  # before the first sample runs
        run_eval(model, tiny_tokenizer(), settings, progress=False, on_prediction=lambda p: pytest.fail("a run started"))
    with pytest.raises(ValueError, match="is not a folder"):
        kvc.get_method("retention", budget=8, checkpoint=str(tmp_path / "missing"))


def test_the_shipped_checkpoint_is_chosen_by_the_model(model, tmp_path, monkeypatch):
    """No checkpoint=: the folder named like the model, else the one whose shapes fit, else a clear error."""
    from types import SimpleNamespace

    import kvcompress.methods.shipped as shipped

    monkeypatch.setattr(shipped, "DATA", tmp_path)
    RetentionGates(LAYERS, HEADS, HIDDEN, width=8, c_init=2.0, seed=1).save(tmp_path / "retention" / "tiny-a", model="tiny-a")
    RetentionGates(LAYERS, HEADS, HIDDEN, width=8, c_init=3.0, seed=2).save(tmp_path / "retention" / "tiny-b", model="tiny-b")
    RetentionGates(5, HEADS, HIDDEN, width=8).save(tmp_path / "retention" / "five-layers", model="five-layers")
    shapes = {"num_layers": LAYERS, "num_kv_heads": HEADS, "hidden_size": HIDDEN}

    named = SimpleNamespace(_name_or_path="/cache/models/TINY-B")
    assert shipped.shipped_checkpoint("retention", named, shapes).name == "tiny-b"
    with pytest.raises(ValueError, match="shipped: five-layers, tiny-a, tiny-b"):  # two fit: no guessing
        shipped.shipped_checkpoint("retention", SimpleNamespace(_name_or_path=""), shapes)
    assert shipped.shipped_checkpoint("retention", SimpleNamespace(), {**shapes, "num_layers": 5}).name == "five-layers"
    with pytest.raises(ValueError, match="train one with `kvcompress train deltakv"):
        shipped.shipped_checkpoint("deltakv", named, shapes)

    method = kvc.get_method("retention", budget=8)
    monkeypatch.setattr(model.config, "_name_or_path", "somewhere/tiny-a")
    method.check_model(model.config)
    assert method.score.gates.c.item() == 2.0
    monkeypatch.setattr(model.config, "_name_or_path", "somewhere/tiny-b")
    method.check_model(model.config)  # the same method object on another model takes that model's gates
    assert method.score.gates.c.item() == 3.0
    expected = RetentionGates.load(tmp_path / "retention" / "tiny-b")
    assert all(torch.equal(t, expected.state_dict()[n]) for n, t in method.score.gates.state_dict().items())
    out = kvc.generate(model, tiny_tokenizer(), _words(60), "w1", method, max_new_tokens=2)  # runs on them end to end
    assert 0 < out.stats["kr"] < 1.0


@pytest.mark.parametrize("name, shapes", [("smollm2-135m-instruct", (30, 3, 576)), ("qwen2.5-coder-0.5b", (24, 2, 896))])
def test_gates_ship_for_both_built_in_models(name, shapes):
    """The package ships gates for the embedded model and the second one, found by name or by shape."""
    by_name = shipped_folder("retention", name, dict(zip(("num_layers", "num_kv_heads", "hidden_size"), shapes)))
    gates = RetentionGates.load(by_name)
    assert (gates.dims["num_layers"], gates.dims["num_kv_heads"], gates.dims["hidden_size"]) == shapes
    assert json.loads((by_name / "config.json").read_text())["model"] == name


def test_every_layers_gates_at_once_equal_each_layers():
    gates = RetentionGates(LAYERS, HEADS, HIDDEN, width=8, c_init=2.0, seed=4)
    hidden = torch.randn(LAYERS, 2, 5, HIDDEN, generator=torch.Generator().manual_seed(4))
    each = torch.stack([gates.log_beta(layer, hidden[layer]) for layer in range(LAYERS)])
    assert each.shape == (LAYERS, 2, HEADS, 5)
    torch.testing.assert_close(gates.log_beta(None, hidden), each, rtol=0, atol=1e-6)
