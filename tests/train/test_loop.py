"""Training data: one source or a seeded mix of the built-in tasks and files, and clear errors for missing files."""

import pytest

from conftest import tiny_tokenizer
from kvcompress.train.loop import GENERATED, data_sources, training_sequences


def _take(stream, n):
    return [next(stream) for _ in range(n)]


def test_a_mix_draws_from_every_source_and_is_seeded(tmp_path):
    tokenizer = tiny_tokenizer()
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(" ".join(["w3"] * 400))
    b.write_text(" ".join(["w7"] * 400))
    mix = _take(training_sequences(tokenizer, 32, 0, f"{a},{b}"), 40)
    tokens = [set(seq) for seq in mix]
    only_a = set(tokenizer(" w3", add_special_tokens=False).input_ids)
    only_b = set(tokenizer(" w7", add_special_tokens=False).input_ids)
    from_a = sum(seq <= only_a for seq in tokens)
    from_b = sum(seq <= only_b for seq in tokens)
    assert from_a + from_b == 40 and 5 <= from_a <= 35  # each sequence from one source, both drawn
    assert mix == _take(training_sequences(tokenizer, 32, 0, f"{a},{b}"), 40)  # the same seed, the same stream
    assert mix != _take(training_sequences(tokenizer, 32, 1, f"{a},{b}"), 40)


def test_generated_alone_is_the_default_stream_and_mixes_with_a_file(tmp_path):
    tokenizer = tiny_tokenizer()
    assert _take(training_sequences(tokenizer, 600, 0, GENERATED), 3) == _take(training_sequences(tokenizer, 600, 0), 3)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(["w5"] * 400))
    assert data_sources(f"{GENERATED}, {text}") == [GENERATED, str(text)]
    word = set(tokenizer(" w5", add_special_tokens=False).input_ids)
    mixed = _take(training_sequences(tokenizer, 600, 0, f"{GENERATED},{text}"), 12)
    assert 0 < sum(set(seq) <= word for seq in mixed) < 12  # some from the file, the others generated


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file .*nope.txt"):
        data_sources(f"{GENERATED},{tmp_path / 'nope.txt'}")
    with pytest.raises(FileNotFoundError, match="none given"):
        data_sources(" , ")
