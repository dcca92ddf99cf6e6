"""Incremental detokenization: token by token, the text only grows, and it ends as the whole output's decode
— on a byte-level BPE tokenizer (SmolLM2's, characters split over tokens) and a word-level one; stop strings
cut it where decoding the whole output after every token would."""

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TINY_VOCAB, tiny_tokenizer
import kvcompress as kvc
from kvcompress.engine import SamplingParams
from kvcompress.engine.detokenizer import IncrementalDetokenizer
from kvcompress.engine.request import Request


def check_token_by_token(tokenizer, ids):
    """Fed one token at a time, the emitted text is a prefix of the final decode and, with the held text, is the
    decode of the tokens so far; flushed at the end, it is the final decode."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    final = tokenizer.decode(ids, skip_special_tokens=True)
    text = ""
    for count in range(1, len(ids) + 1):
        text += detokenizer.step(ids[:count])
        assert final.startswith(text)
        assert text + detokenizer.held == tokenizer.decode(ids[:count], skip_special_tokens=True)
    assert text + detokenizer.flush() == final


@st.composite
def byte_level_ids(draw, tokenizer):
    """Token ids mixing special tokens, any vocabulary entry, and runs cut from encoded text in many scripts (a
    character's bytes over several tokens; cut ends leave incomplete characters and stray continuation bytes)."""
    text_run = st.text(st.characters(codec="utf-8"), max_size=12).map(
        lambda text: tokenizer.encode(text, add_special_tokens=False))
    cut_run = st.tuples(text_run, st.integers(0, 3), st.integers(0, 3)).map(lambda t: t[0][t[1] : len(t[0]) - t[2]])
    piece = st.one_of(st.sampled_from(tokenizer.all_special_ids).map(lambda i: [i]),
                      st.integers(0, len(tokenizer) - 1).map(lambda i: [i]), text_run, cut_run)
    return [i for run in draw(st.lists(piece, max_size=12)) for i in run]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_byte_level_text_grows_token_by_token_to_the_whole_decode(embedded, data):
    tokenizer = embedded[1]
    check_token_by_token(tokenizer, data.draw(byte_level_ids(tokenizer)))


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, TINY_VOCAB - 1), max_size=30))
def test_word_level_text_grows_token_by_token_to_the_whole_decode(ids):
    check_token_by_token(tiny_tokenizer(), ids)


def test_a_tokenizer_that_cleans_spaces_up_decodes_through_its_own_decode():
    """The backend is asked directly only where the tokenizer's decode adds nothing to it (no clean-up of spaces);
    a tokenizer that cleans up decodes through its own ``decode``, and the text still grows to the whole decode."""
    tokenizer = tiny_tokenizer()
    assert IncrementalDetokenizer(tokenizer)._decode_ids == tokenizer.backend_tokenizer.decode
    tokenizer.clean_up_tokenization_spaces = True
    assert IncrementalDetokenizer(tokenizer)._decode_ids == tokenizer.decode
    check_token_by_token(tokenizer, [5, 1, 7, 7, 0, 12, 1, 3])


def test_a_character_split_over_tokens_is_held_until_complete(embedded):
    tokenizer = embedded[1]
    ids = tokenizer.encode("a😀", add_special_tokens=False)
    assert len(ids) > 2  # the emoji's four bytes come in more than one token
    detokenizer = IncrementalDetokenizer(tokenizer)
    steps = [detokenizer.step(ids[:count]) for count in range(1, len(ids) + 1)]
    assert steps == ["a", *[""] * (len(ids) - 2), "😀"]
    assert detokenizer.step([*ids, tokenizer.encode("😀", add_special_tokens=False)[0]]) == ""
    assert detokenizer.flush() == "\ufffd"


def cut_by_whole_decodes(tokenizer, ids, stops):
    """The rule incremental search must keep: after each token the whole output decoded, cut before the first
    stop string (in the list's order) in it; (tokens taken, text)."""
    text = ""
    for count in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:count], skip_special_tokens=True)
        stop = next((s for s in stops if s in text), None)
        if stop is not None:
            return count, text[: text.index(stop)]
    return len(ids), text


def cut_by_engine(tokenizer, ids, stops):
    """The engine's rule: each token's new text searched (``LLM._extend_text``), flushed if no stop string came."""
    request = Request(0, [0], SamplingParams(stop=stops), kvc.get_method("full"), detokenizer=IncrementalDetokenizer(tokenizer))
    for token in ids:
        request.output_ids.append(token)
        if kvc.LLM._extend_text(request):
            break
    request.finish("stop")
    return len(request.output_ids), request.text


@st.composite
def stops_in(draw, text):
    """One to three stop strings, mostly pieces of ``text`` (so they span tokens), sometimes absent from it."""
    piece = st.tuples(st.integers(0, len(text)), st.integers(1, 6)).map(lambda t: text[t[0] : t[0] + t[1]])
    stops = draw(st.lists(st.one_of(piece, piece, st.text(min_size=1, max_size=3)), min_size=1, max_size=3))
    return [s for s in stops if s] or ["\x00never"]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_byte_level_stop_strings_cut_where_whole_decodes_would(embedded, data):
    tokenizer = embedded[1]
    ids = data.draw(byte_level_ids(tokenizer))
    stops = data.draw(stops_in(tokenizer.decode(ids, skip_special_tokens=True)))
    assert cut_by_engine(tokenizer, ids, stops) == cut_by_whole_decodes(tokenizer, ids, stops)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_word_level_stop_strings_cut_where_whole_decodes_would(data):
    tokenizer = tiny_tokenizer()
    ids = data.draw(st.lists(st.integers(0, TINY_VOCAB - 1), max_size=30))
    stops = data.draw(stops_in(tokenizer.decode(ids, skip_special_tokens=True)))
    assert cut_by_engine(tokenizer, ids, stops) == cut_by_whole_decodes(tokenizer, ids, stops)
