"""Incremental detokenization: a request's text grows by what each new token adds, at a cost that does not
grow with the output.

It follows vLLM's prefix-offset / read-offset scheme. Text has been emitted for the tokens before
``read_offset``; each step decodes only the window from ``prefix_offset`` (the few tokens before
``read_offset``, for context) twice — up to ``read_offset`` and to the end — and the difference is the new
text. Decoding the window with its context, not the new tokens alone, keeps what a tokenizer does at a
sequence's start (SentencePiece's and byte-level BPE's leading-space handling) out of the middle of the
text. New text ending in "\\ufffd" (an incomplete UTF-8 character, its bytes split over tokens) is held
back until a later token completes it, so the emitted text only ever grows; ``flush`` gives the held text up
at the end, as ``decode`` shows it. Special tokens are skipped, as ``decode(ids, skip_special_tokens=True)``
skips them: emitted plus held text always equals that decode of the whole output.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """One request's detokenization state: ``step`` after each new token, ``flush`` when the request ends."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        # a fast tokenizer that cleans no spaces up decodes as its backend (the Rust `tokenizers`) does: asked directly,
        # ~0.9 against ~2.4 µs a call, two calls a request each step
        backend = getattr(tokenizer, "backend_tokenizer", None)
        direct = backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
        self._decode_ids = backend.decode if direct else tokenizer.decode
        self.prefix_offset = 0  # first token of the window decoded for context
        self.read_offset = 0  # first token whose text is not emitted yet
        self.held = ""  # the text of the tokens from read_offset on, held back: it ends in an incomplete character

    def step(self, ids: list[int]) -> str:
        """The text that the tokens ``ids`` (the whole output so far, one token longer than at the last step)
        add for good; what they add that ends in an incomplete character is kept in ``held`` instead."""
        prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(ids[self.prefix_offset :])[len(prefix_text) :]
        if not new_text or new_text.endswith("\ufffd"):
            self.held = new_text
            return ""
        self.prefix_offset, self.read_offset, self.held = self.read_offset, len(ids), ""
        return new_text

    def flush(self) -> str:
        """The held text, given up for good when the output ends (an incomplete character as "\\ufffd")."""
        held, self.held = self.held, ""
        return held

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=True)


__all__ = ["IncrementalDetokenizer"]
