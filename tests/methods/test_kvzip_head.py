"""KVzip's head-level, context-independent variant: heads chosen by calibrated scores, whole or sinks + window."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from common import layers_of, tiny_head_scores, tiny_model
from kvcompress import CompressedCache, get_method
from kvcompress.methods.kvzip import CALIBRATED, read_head_scores, write_head_scores
from kvcompress.train.kvzip_head import calibrate_head_scores, calibration_prompt

SINKS = 4  # the recency scorer's default


def _held(model, method, ids) -> torch.Tensor:
    """[layers, KV heads]: entries each head holds after the prefill of ``ids``."""
    cache = CompressedCache(model, method)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return torch.stack([layer.head_lengths()[0] for layer in layers_of(cache)])


def _prompt(seed: int, tokens: int = 80) -> torch.Tensor:
    return torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(seed))


def test_the_best_heads_keep_everything_and_the_others_their_sinks_and_window(tmp_path):
    model = tiny_model(seed=6, layers=3)  # 3 layers × 2 KV heads
    scores = torch.tensor([[0.1, 0.9], [0.5, 0.2], [0.8, 0.3]])
    path = write_head_scores(tmp_path / "heads.json", scores)
    tokens, window = 80, 8
    for whole in range(7):
        allowance = SINKS + window
        budget = allowance + -(-whole * (tokens - allowance) // 6)  # the least size that keeps `whole` heads
        held = _held(model, get_method("kvzip_head", budget=budget, window=window, scores=str(path)), _prompt(1))
        best = torch.zeros(6, dtype=torch.bool)
        best[scores.flatten().argsort(descending=True)[:whole]] = True
        expected = torch.where(best.view(3, 2), tokens, allowance)
        assert held.tolist() == expected.tolist(), whole
        assert int(held.sum()) <= budget * 6  # within the size


@settings(max_examples=20, deadline=None)
@given(budget=st.integers(1, 90), window=st.integers(0, 40), seed=st.integers(0, 1000))
def test_entries_held_stay_within_the_size_and_sinks_are_kept(tmp_path_factory, budget, window, seed):
    """For any size (below the sinks and window too) the heads hold at most size × heads (the scheduler's count),
    and every head keeps its sinks."""
    model = tiny_model(seed=6, layers=3)
    scores = torch.rand(3, 2, generator=torch.Generator().manual_seed(seed))
    path = write_head_scores(tmp_path_factory.mktemp("heads") / "heads.json", scores)
    method = get_method("kvzip_head", budget=budget, window=window, scores=str(path))
    held = _held(model, method, _prompt(seed))
    assert int(held.sum()) <= max(budget, SINKS) * 6
    assert bool((held >= min(SINKS, 80)).all())


def test_a_head_not_chosen_keeps_its_sinks_and_the_most_recent_entries(tmp_path):
    model = tiny_model(seed=6)
    path = write_head_scores(tmp_path / "heads.json", torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    cache = CompressedCache(model, get_method("kvzip_head", ratio=0.4, window=10, scores=str(path)))
    with torch.no_grad():
        model(_prompt(2), past_key_values=cache)
    first = layers_of(cache)[0].view()
    assert first.lengths[0].tolist() == [80, 14]
    assert sorted(first.positions[0, 1, :14].tolist()) == [0, 1, 2, 3, *range(70, 80)]


def test_ratio_one_keeps_every_head_and_answers_as_full():
    model = tiny_model(seed=3)
    ids = _prompt(4, 60)
    full = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    method = get_method("kvzip_head", ratio=1.0, scores=tiny_head_scores(model))
    cache = CompressedCache(model, method)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out, full)
    assert all(layer.head_lengths()[0].tolist() == [67, 67] for layer in layers_of(cache))  # 60 + 7 decoded


def test_the_heads_chosen_do_not_depend_on_the_prompt():
    """Two different prompts of one length: the same heads keep everything (no replay, nothing read from the
    prompt); KVzip's own per-entry sizes differ between the prompts."""
    model = tiny_model(seed=6, layers=3)
    method = get_method("kvzip_head", ratio=0.5, window=8, scores=tiny_head_scores(model))
    assert method.needs().replay == 0
    first, second = _held(model, method, _prompt(7)), _held(model, method, _prompt(8))
    assert torch.equal(first, second)
    assert set(first.flatten().tolist()) == {80, SINKS + 8}
    replayed = [_held(model, get_method("kvzip", ratio=0.5), _prompt(seed)) for seed in (7, 8)]
    assert not torch.equal(*replayed)


def test_calibration_scores_are_the_largest_kvzip_score_of_each_heads_text_entries():
    model = tiny_model(seed=4)
    tokenizer = AutoTokenizer.from_pretrained(model.config.name_or_path)
    text = " ".join(f"w{(7 * i) % 60}" for i in range(120))
    scores = calibrate_head_scores(model, tokenizer, text=text, tokens=90, chunk=32)
    ids, start = calibration_prompt(tokenizer, text, 90)
    assert len(ids) - start == 90
    replay = CompressedCache(model, compress_on_prefill=False, replay=32, tokenizer=tokenizer)
    with torch.no_grad():
        model(torch.tensor([ids]), past_key_values=replay)
    expected = torch.stack([layer.observations["replay_scores"][0, :, start:].amax(dim=-1) for layer in layers_of(replay)])
    torch.testing.assert_close(scores, expected.float())
    assert calibrate_head_scores(model, tokenizer, text=text, tokens=90, chunk=32) is scores  # computed once
    assert CALIBRATED[model.config.name_or_path] is scores
    method = get_method("kvzip_head", ratio=0.5)  # finds the model's calibration
    CompressedCache(model, method)
    assert method.sizes.head_scores is scores


def test_calibration_writes_a_file_the_scores_option_reads(tmp_path):
    model = tiny_model(seed=5)
    text = " ".join(f"w{i % 50}" for i in range(60))
    scores = calibrate_head_scores(model, text=text, tokens=40, path=tmp_path / "smol")
    assert (tmp_path / "smol" / "config.json").is_file()
    torch.testing.assert_close(read_head_scores(tmp_path / "smol"), scores)
    assert get_method("kvzip_head", ratio=0.5, scores=str(tmp_path / "smol")).sizes.head_scores.shape == (2, 2)


def test_spec_forms_build_the_same_parts():
    scores = tiny_head_scores(tiny_model())
    preset = get_method(f"kvzip_head:window=16:scores='{scores}'", ratio=0.25)
    parts = get_method(f"recency+kvzip_head:window=16:scores='{scores}'", ratio=0.25)
    assert type(preset.score) is type(parts.score) and preset.sizes == parts.sizes
    assert preset.label == f"kvzip_head@0.25[window=16,scores={scores}]"
    snap = get_method(f"snapkv:window=8+kvzip_head:scores='{scores}'", budget=32)  # SnapKV ranks what a head not chosen keeps
    assert snap.sizes.window == 64 and snap.score.window == 8


def test_bad_options_are_refused_with_the_fix(tmp_path):
    model = tiny_model(seed=1)
    scores = tiny_head_scores(model)
    with pytest.raises(ValueError, match="window"):
        get_method("kvzip_head", ratio=0.5, window=-1, scores=scores)
    with pytest.raises(ValueError, match="window=1.5 must be a whole number"):
        get_method("kvzip_head:window=1.5", ratio=0.5)
    with pytest.raises(ValueError, match="is not a file"):
        get_method("kvzip_head", ratio=0.5, scores=str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text('{"scores": "high"}')
    with pytest.raises(ValueError, match="holds no head scores"):
        get_method("kvzip_head", ratio=0.5, scores=str(tmp_path / "bad.json"))
    (tmp_path / "flat.json").write_text('{"scores": [0.5, 0.25]}')
    with pytest.raises(ValueError, match=r"a finite \[layers, KV heads\] table"):
        get_method("kvzip_head", ratio=0.5, scores=str(tmp_path / "flat.json"))
    with pytest.raises(ValueError, match="drop \\+evict"):
        get_method("kvzip_head+evict", ratio=0.5, scores=scores)
    three = write_head_scores(tmp_path / "three.json", torch.rand(3, 2))
    with pytest.raises(ValueError, match=r"\(3, 2\) .* \(2, 2\)"):
        CompressedCache(model, get_method("kvzip_head", ratio=0.5, scores=str(three)))
    model.config._name_or_path = str(tmp_path / "never-calibrated")
    with pytest.raises(ValueError, match="calibrate_head_scores"):
        CompressedCache(model, get_method("kvzip_head", ratio=0.5))
    with pytest.raises(ValueError, match="tokens must be"):
        calibrate_head_scores(model, text="w1 w2", tokens=0)
