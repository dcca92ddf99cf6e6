"""KVzip's head scores, computed once per model (the ``kvzip_head`` policy: methods/kvzip.py).

The calibration prefills a text the project ships (the filler prose of ``data/haystack.txt``, inside the
model's chat template as a user turn, cut to ``tokens`` tokens), replays it as KVzip does (``hf/replay.py``)
and keeps, per layer and KV head, the largest score of the text's entries: s_{l,h} = max_i S_{l,h,i}
(METHODS.md, "KVzip"; the template's own tokens are left out, as KVzip leaves out its system prompt). The
result depends on the model and the calibration text only, never on a prompt to compress.

``calibrate_head_scores`` keeps the result in memory for the model (``methods.kvzip.CALIBRATED``, by
``config.name_or_path``), where every ``kvzip_head`` policy then finds it; ``path=`` writes it to a file
for ``kvzip_head:scores=FILE`` in another process. Scores for SmolLM2-135M-Instruct and
Qwen2.5-Coder-0.5B-Instruct ship in ``data/kvzip_head/``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ..demo import haystack_text
from ..hf.cache import CompressedCache
from ..methods.kvzip import CALIBRATED, write_head_scores
from ..models import cache_kwargs, model_facts

CALIBRATION_TOKENS = 2048  # tokens of calibration text (the built-in tasks of the embedded model sit at 1-2k)
REPLAY_CHUNK = 2048  # KVzip's replay chunk (the kvzip scorer's default)
_DONE: dict[tuple, torch.Tensor] = {}  # (model name, text digest, tokens, chunk) -> scores


def calibration_prompt(tokenizer, text: str, tokens: int) -> tuple[list[int], int]:
    """(the prompt's token ids, where the text starts): the first ``tokens`` tokens of ``text`` as a user turn of
    the chat template (without one, the text after the tokenizer's own leading special tokens)."""
    text_ids = list(tokenizer(text, add_special_tokens=False).input_ids)[:tokens]
    if getattr(tokenizer, "chat_template", None):
        marker = "\u2063kvcompress-calibration\u2063"
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                                 add_generation_prompt=False)
        head = list(tokenizer(rendered.split(marker, 1)[0], add_special_tokens=False).input_ids)
    else:
        head = [i for i in tokenizer("").input_ids]  # a BOS the tokenizer adds, if any
    return head + text_ids, len(head)


@torch.inference_mode()
def calibrate_head_scores(model, tokenizer=None, *, text: str | None = None, tokens: int = CALIBRATION_TOKENS,
                          chunk: int = REPLAY_CHUNK, path: str | Path | None = None) -> torch.Tensor:
    """Head scores [layers, KV heads] float32 of ``model``: each head's largest KVzip score on the calibration text
    (``text``, default the project's prose), computed once per model and settings in this process.

    Kept for the model's ``name_or_path`` so that ``get_method("kvzip_head", ...)`` finds them; ``path`` also writes
    them (a ``.json`` file, or a folder that gets ``config.json``) for ``kvzip_head:scores=PATH``."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"calibrate_head_scores: tokens must be a whole number ≥ 1, got {tokens!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"calibrate_head_scores: chunk must be a whole number ≥ 1, got {chunk!r}")
    name = str(model.config.name_or_path or "")
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(name)
    source = "kvcompress/data/haystack.txt" if text is None else "given text"
    text = haystack_text() if text is None else text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    key = (name, digest, tokens, chunk)
    scores = _DONE.get(key) if name else None
    if scores is None:
        ids, start = calibration_prompt(tokenizer, text, tokens)
        if len(ids) == start:
            raise ValueError("calibrate_head_scores: the calibration text has no tokens; give a text to replay")
        limit = model_facts(model).max_positions
        if 2 * len(ids) + 64 > limit:  # the replay's positions follow the prompt's
            raise ValueError(f"calibrate_head_scores: a prompt of {len(ids)} tokens and its replay exceed the model's "
                             f"{limit} positions; give fewer tokens (tokens={max(1, (limit - 64) // 2 - start)} at most)")
        cache = CompressedCache(model, compress_on_prefill=False, replay=chunk, tokenizer=tokenizer)
        device = next(model.parameters()).device
        model(torch.tensor([ids], device=device), **cache_kwargs(cache), logits_to_keep=1)
        per_layer = [layer.observations["replay_scores"][0, :, start:len(ids)].amax(dim=-1) for layer in cache.session.layers]
        scores = torch.stack(per_layer).float().cpu()
        cache.release()
        if name:
            _DONE[key] = scores
    if name:
        CALIBRATED[name] = scores
    if path is not None:
        write_head_scores(path, scores, model=Path(name).name, calibration={
            "text": source, "sha256_16": digest, "tokens": tokens, "chunk": chunk})
    return scores


__all__ = ["CALIBRATION_TOKENS", "calibrate_head_scores", "calibration_prompt"]
