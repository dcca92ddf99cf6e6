"""One-call generation with a compressed cache, following DESIGN.md's evaluation protocol.

Query-agnostic by default: the context is prefilled and compressed before the question is
seen; the question and the answer are then decoded on the compressed cache. The prompt is
the model's chat template with one user turn holding the context, a blank line, then the
question; the compressed prefix ends where the question starts. ``query_aware=True`` puts
the question inside the compressed prefix instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .hf import CompressedCache
from .methods import Policy, get_method
from .models import cache_kwargs, model_facts

_SLOT = "\x00QUESTION\x00"


@dataclass
class GenerateOutput:
    """The answer and what it cost."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Prompt:
    """Token ids of the compressed prefix (template head + context) and the rest (question + tail)."""

    prefix_ids: list[int]
    suffix_ids: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prefix_ids + self.suffix_ids


def build_prompt(tokenizer, context: str, question: str) -> Prompt:
    """Split the chat-templated prompt at the start of the question (DESIGN.md, "Evaluation protocol")."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + "\n\n" + _SLOT}], tokenize=False, add_generation_prompt=True
        )
        head, tail = text.split(_SLOT)
        prefix = tokenizer(head, add_special_tokens=False).input_ids
    else:
        head, tail = context + "\n\n", "\n"
        prefix = tokenizer(head).input_ids
    suffix = tokenizer(question + tail, add_special_tokens=False).input_ids
    return Prompt(prefix, suffix)


def eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def check_inputs(model, context: str, prompt: Prompt, max_new_tokens: int) -> None:
    """Refuse inputs that cannot work, before any state is built."""
    if not context or not context.strip():
        raise ValueError("context is empty: give the text to compress (kvc.generate(..., context='...')).")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}.")
    limit = model_facts(model).max_positions
    needed = len(prompt.ids) + max_new_tokens
    if needed > limit:
        raise ValueError(
            f"prompt ({len(prompt.ids)} tokens) + max_new_tokens ({max_new_tokens}) = {needed} exceeds the model's "
            f"{limit} positions; shorten the context by at least {needed - limit} tokens or use a longer-context model."
        )


@torch.inference_mode()
def _resolve(method: Policy | str | None, budget: int | None, ratio: float | None) -> Policy:
    """The method to use: a spec with its size, or a ready method (which carries its own)."""
    sized = budget is not None or ratio is not None
    if isinstance(method, str):
        return get_method(method, budget=budget, ratio=ratio)
    if sized:
        raise ValueError("budget= and ratio= go with a method name (method=\"snapkv\", ratio=0.25); "
                         "a method object carries its own size")
    return method or get_method("full")


def generate(
    model,
    tokenizer,
    context: str,
    question: str,
    method: Policy | str | None = None,
    *,
    budget: int | None = None,
    ratio: float | None = None,
    max_new_tokens: int = 32,
    query_aware: bool = False,
) -> GenerateOutput:
    """Answer ``question`` about ``context`` greedily, with the context's KV cache compressed by ``method``
    (a ``Policy``, or a name or spec such as ``"snapkv:window=16"`` with its ``budget=`` or ``ratio=``).

    Returns the answer text, its token ids, the prompt ids (feed them to ``model.generate``
    to compare with an uncompressed run) and stats: kr, cr, kv_bytes, kv_bytes_full, entries_per_head (right
    after compressing, and ``*_end`` after generation), prefill_s, compress_s,
    decode_ms_per_token, token counts and notes.
    """
    _check_texts(context=context, question=question)
    method = _resolve(method, budget, ratio)
    prompt = build_prompt(tokenizer, context, question)
    check_inputs(model, context, prompt, max_new_tokens)
    cache = CompressedCache(model, method, tokenizer=tokenizer)
    logits, prefill_wall = prefill(model, cache, prompt, query_aware)
    out = answer(model, tokenizer, cache, prompt, logits, max_new_tokens=max_new_tokens, query_aware=query_aware)
    out.stats["prefill_s"] = prefill_wall - out.stats["compress_s"]
    return out


def _check_texts(**texts) -> None:
    """Refuse a context or question that is not a string (None, bytes, a list), naming it, before any work."""
    for name, value in texts.items():
        if not isinstance(value, str):
            got = "None" if value is None else f"a {type(value).__name__}"
            raise ValueError(f"{name} must be a string, got {got}: pass the text itself (kvc.generate(model, tokenizer, "
                             "context='...', question='...'); a file's text is Path(...).read_text()).")


def prefill(model, cache: CompressedCache, prompt: Prompt, query_aware: bool) -> tuple[torch.Tensor, float]:
    """Run the compressed prefix (the context, or context + question) into ``cache``: (last logits, wall s)."""
    ids = prompt.ids if query_aware else prompt.prefix_ids
    start = time.perf_counter()
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device), **cache_kwargs(cache), logits_to_keep=1).logits
    return logits, time.perf_counter() - start


@torch.inference_mode()
def answer(
    model, tokenizer, cache: CompressedCache, prompt: Prompt, prefill_logits: torch.Tensor, *,
    max_new_tokens: int, query_aware: bool,
) -> GenerateOutput:
    """Decode the answer on a cache that holds the (compressed) prefix; ``prefill_logits`` = its last logits."""
    compressed = cache.stats()
    start = time.perf_counter()
    logits = prefill_logits
    if not query_aware:
        logits = model(
            torch.tensor([prompt.suffix_ids], device=model.device), **cache_kwargs(cache), logits_to_keep=1
        ).logits
    question_s = time.perf_counter() - start
    token_ids, decode_s = _greedy(model, cache, logits, max_new_tokens, eos_ids(model, tokenizer))
    end = cache.stats()
    stats = {
        "method": cache.method.label,
        "kr": compressed["kr"],
        "cr": end["cr"],  # entries read per decoding step ÷ full, over the answer's steps
        "kv_bytes": compressed["kv_bytes"],
        "kv_bytes_full": compressed["kv_bytes_full"],
        "entries_per_head": compressed["entries_per_head"],
        "kr_end": end["kr"],
        "kv_bytes_end": end["kv_bytes"],
        "kv_bytes_full_end": end["kv_bytes_full"],
        "prefill_s": None,
        "compress_s": cache.timings["compress_s"],
        "question_s": question_s,
        "decode_ms_per_token": 1000 * decode_s / max(len(token_ids) - 1, 1),
        "context_tokens": len(prompt.prefix_ids),
        "prompt_tokens": len(prompt.ids),
        "new_tokens": len(token_ids),
        "query_aware": query_aware,
        "notes": end["notes"],
    }
    text = tokenizer.decode(token_ids, skip_special_tokens=True).strip()
    return GenerateOutput(text=text, token_ids=token_ids, prompt_ids=prompt.ids, stats=stats)


def _greedy(model, cache, logits, max_new_tokens, eos_ids) -> tuple[list[int], float]:
    """Greedy decoding on ``cache`` from the last logits; returns the ids and the decode wall time."""
    token_ids: list[int] = []
    start = time.perf_counter()
    for step in range(max_new_tokens):
        next_id = int(logits[0, -1].argmax())
        token_ids.append(next_id)
        if next_id in eos_ids or step == max_new_tokens - 1:
            break
        logits = model(torch.tensor([[next_id]], device=model.device), **cache_kwargs(cache)).logits
    return token_ids, time.perf_counter() - start
