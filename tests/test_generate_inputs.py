"""kvc.generate's argument checks: they run before any work, so no model is needed."""

import pytest

import kvcompress as kvc


@pytest.mark.parametrize("context,question,named,got", [
    (None, "q?", "context", "got None"),
    ("some text", None, "question", "got None"),
    (b"some text", "q?", "context", "got a bytes"),
    ("some text", ["q?"], "question", "got a list"),
])
def test_a_context_or_question_that_is_no_string_is_a_value_error_naming_it(context, question, named, got):
    with pytest.raises(ValueError, match=rf"^{named} must be a string, {got}: pass the text itself") as error:
        kvc.generate(None, None, context, question, "snapkv", ratio=0.5)  # no model: refused before any work
    assert "read_text()" in str(error.value)
