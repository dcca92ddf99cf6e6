"""``kvc.LLM``: the offline serving API — many prompts, one slot pool, continuous batching.

    llm = kvc.LLM(model=None, kv_memory="1GiB", max_num_seqs=64)
    outs = llm.generate(prompts, kvc.SamplingParams(max_tokens=64), method=kvc.get_method("snapkv", ratio=0.1))
    llm.stats()

The pool is a budget of ``kv_memory`` bytes: plain entries and coded ones (KIVI, DeltaKV) together
never hold more, and its arrays grow with the load up to it; nothing else grows with the
number of requests. Each step is one forward of at most ``max_num_batched_tokens`` tokens: a token of
every decoding request, then prompts of the requests admitted (whole, or a chunk of a long one, as
vLLM's chunked prefill), each compressed by its own method once its last chunk is in; a method that
needs its prompt in one forward (KVzip's replay, GVote's statistics) is prefilled alone. Requests
finish on their own (max_tokens, end of sequence, a stop string) and give their slots back.
``add_request`` / ``step`` / ``abort`` drive the same loop one step at a time (the server).

One request's failure is that request's alone: whatever raises while its prompt is prefilled or
compressed, its token sampled or its text decoded finishes it with ``finish_reason="error"`` and the
error's message, and frees its slots; a batched decoding step that raises is redone request by
request (each recomputed from its tokens, as after a preemption), so the request at fault fails
alone and the others go on.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from ..config import Config
from ..generate import eos_ids
from ..methods import Policy, get_method
from ..models import load_model, model_facts
from ..store.slots import PoolExhausted, SlotPool
from .detokenizer import IncrementalDetokenizer
from .request import Request, RequestOutput
from .runner import ModelRunner, Piece
from .sampling import SamplingParams, greedy_tokens, sample, token_logprob
from .scheduler import Scheduler


class LLM:
    """A serving engine over one model and one KV slot pool (see the module docstring).

    Args:
        model: checkpoint dir, ``.gguf`` file or hub id; None = the embedded default model.
        kv_memory: bytes (or "200MiB", "1GiB", ...) of the KV slot pool.
        max_num_seqs: requests decoded together at most.
        max_num_batched_tokens: tokens one step's forward takes at most (decoding tokens first, then prompts;
            a longer prompt is prefilled in chunks).
        dtype, device, seed, max_model_len: see ``kvcompress.config.Config``.
        model_and_tokenizer: an already loaded (model, tokenizer) pair instead of ``model``.
        pack_weights: on the CPU, run the model's linear layers in the engine's decoder over oneDNN-packed copies
            of their weights (``engine/packed.py``: about 2.4× faster products, one more copy of those weights' bytes,
            in ``packed_weight_bytes``; the model's own modules are left as they are); False: transformers' own.
    """

    def __init__(self, model: str | None = None, kv_memory: int | str = "1GiB", max_num_seqs: int = 64, *,
                 max_num_batched_tokens: int = 2048, dtype: str = "auto", device: str = "cpu", seed: int = 0,
                 max_model_len: int | None = None, model_and_tokenizer: tuple[Any, Any] | None = None, pack_weights: bool = True):
        self.config = Config(model=model, kv_memory=kv_memory, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                             max_num_batched_tokens=max_num_batched_tokens, dtype=dtype, device=device, seed=seed)
        if model_and_tokenizer is None:
            dtype_arg = torch.float32 if (dtype == "auto" and torch.device(device).type == "cpu") else dtype
            model_and_tokenizer = load_model(model, dtype=dtype_arg, device=device)
        self.model, self.tokenizer = model_and_tokenizer
        facts = model_facts(self.model)
        self.max_model_len = min(max_model_len or facts.max_positions, facts.max_positions)
        weight = next(self.model.parameters())
        probe = SlotPool(facts.head_dim, dtype=weight.dtype, device=weight.device, capacity=1)
        slots = self.config.kv_memory // probe.bytes_per_slot
        if slots < facts.num_layers * facts.num_kv_heads:
            raise ValueError(f"kv_memory={self.config.kv_memory} bytes holds {slots} KV slots: not even one token "
                             f"({facts.num_layers * facts.num_kv_heads} slots); give more kv_memory")
        self.pool = SlotPool(facts.head_dim, dtype=weight.dtype, device=weight.device, capacity=slots,
                             initial=max(slots // 8, facts.num_layers * facts.num_kv_heads))
        self.scheduler = Scheduler(self.pool, facts.num_layers, facts.num_kv_heads, max_num_seqs)
        self.runner = ModelRunner(self.model, self.pool, self.tokenizer, pack=pack_weights)
        self.packed_weight_bytes = self.runner.decoder.nbytes
        self._eos = eos_ids(self.model, self.tokenizer)
        self._ids = itertools.count()
        self._requests: dict[int, Request] = {}
        self._reset_stats()

    # ----- the offline API -------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]], sampling_params: SamplingParams | None = None,
                 method: Policy | str | Sequence[Policy | str] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt: a string (used as it is: apply the chat template yourself, or use
        ``chat``), a list of strings, or token-id lists. ``method`` is one method (or spec) for all, a list
        with one per prompt, or None (``full``). All prompts are checked before any is started; the outputs
        come in the prompts' order, ``n`` per prompt (``index`` 0 … n-1) when ``sampling_params.n`` > 1."""
        prompts = self._prompt_list(prompts)
        methods = self._methods(method, len(prompts))
        params = sampling_params or SamplingParams()
        checked = [self.check_prompt(prompt, params) for prompt in prompts]
        return self._run(checked, params, methods, use_tqdm)

    def chat(self, conversations: Sequence[dict] | Sequence[Sequence[dict]], sampling_params: SamplingParams | None = None,
             method: Policy | str | Sequence[Policy | str] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate a reply to each conversation (one conversation — a list of ``{"role", "content"}`` — or a
        list of them), each put through the tokenizer's chat template with the assistant's turn opened."""
        if isinstance(conversations, Sequence) and conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        if not isinstance(conversations, Sequence) or isinstance(conversations, str) or not conversations:
            raise ValueError("conversations must be a list of messages ({'role', 'content'}) or a list of such lists")
        methods = self._methods(method, len(conversations))
        params = sampling_params or SamplingParams()
        checked = [self.check_prompt(self.chat_prompt(conversation), params) for conversation in conversations]
        return self._run(checked, params, methods, use_tqdm)

    def _run(self, checked: list[list[int]], params: SamplingParams, methods: list[Policy], use_tqdm: bool) -> list[RequestOutput]:
        self._reset_stats()
        requests = [self._add(ids, params, m, index) for ids, m in zip(checked, methods) for index in range(params.n)]
        bar = tqdm(total=len(requests), desc="generate", disable=not use_tqdm, unit="request")
        while any(not r.finished for r in requests):
            done = sum(r.finished for r in requests)
            self.step()
            bar.update(sum(r.finished for r in requests) - done)
        bar.close()
        return [self._output(r) for r in requests]

    def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                    method: Policy | str | None = None, index: int = 0) -> int:
        """Queue one request (checked first); its id. ``step`` advances it, ``output`` reads it. ``index``
        numbers the answers of one prompt (``n`` > 1: a request each, seeded ``seed + index``)."""
        params = sampling_params or SamplingParams()
        ids = self.check_prompt(prompt, params)
        return self._add(ids, params, self._methods(method, 1)[0], index).id

    def request(self, request_id: int) -> Request | None:
        """A request the engine still knows (running, waiting, or finished and not yet read)."""
        return self._requests.get(request_id)

    def check_fits(self, prompt_ids: list[int], sampling_params: SamplingParams, method: Policy) -> None:
        """Refuse a request that could not fit in the pool even alone, or whose method cannot run on this model
        (a clear error, nothing queued)."""
        method.check_model(self.model.config)
        probe = Request(-1, list(prompt_ids), sampling_params, method)
        need = self.scheduler.peak(probe) + self.scheduler.growth(probe)
        if need > self.pool.capacity:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) and max_tokens ({sampling_params.max_tokens}) need {need} "
                             f"KV slots but the pool holds {self.pool.capacity}: shorten the prompt, lower max_tokens or keep less")

    def abort(self, request_id: int, reason: str = "abort", error: str | None = None) -> None:
        """Stop a request now (``reason`` "abort", or "error" with its message); its slots go back to the pool."""
        request = self._requests.get(request_id)
        if request is not None and not request.finished:
            self.scheduler.finish(request, reason, error)

    def output(self, request_id: int) -> RequestOutput:
        """A request's output so far (``finish_reason`` None while it runs); a finished one is forgotten."""
        request = self._requests[request_id]
        if request.finished:
            del self._requests[request_id]
        return request.output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----- one step ---------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Admit what fits, then one forward: a token for every decoding request and the pieces of prompts the
        step has room for; the requests that got a token (or finished) this step."""
        touched: list[Request] = []
        pieces = self._plan_prompts(touched)
        self._stats["max_concurrent"] = max(self._stats["max_concurrent"], len(self.scheduler.running))
        self.scheduler.make_room()
        running = self.scheduler.running
        pieces = [p for p in pieces if p.request in running]  # make_room may have preempted one
        decoding = [r for r in running if not r.to_prefill and r not in touched]
        batch = [r for r in decoding if not r.suspect]
        if batch or pieces:
            touched += self._forward(batch, pieces)
        for request in decoding:
            if request.suspect:  # in a step that failed: decoded alone until it shows it is not at fault
                touched += self._forward([request], [])
        if not self.scheduler.has_unfinished():
            self.pool.trim()  # idle: the pool's arrays give their memory back
        return touched

    def _plan_prompts(self, touched: list[Request]) -> list[Piece]:
        """The step's prompt pieces within its token budget: the next chunk of a prompt being chunked, then the
        waiting requests that fit, in arrival order (a request whose prompt must be prefilled in one forward is
        prefilled alone now, into ``touched``)."""
        running = self.scheduler.running
        budget = self.config.max_num_batched_tokens - sum(1 for r in running if not r.to_prefill)
        pieces = []
        for request in running:
            if request.to_prefill and request.session is not None:  # a prompt being chunked goes on
                pieces.append(Piece(request, request.prefilled, min(request.to_prefill, budget)))
                budget -= pieces[-1].count
        while budget > 0 and (request := self.scheduler.admit_next(budget, self.runner.packs)) is not None:
            if request.chunked or (len(request.tokens) <= budget and self.runner.packs(request)):
                pieces.append(Piece(request, 0, min(len(request.tokens), budget)))
                budget -= pieces[-1].count
            else:
                touched += self._prefill(request)
        return pieces

    def _forward(self, requests: list[Request], pieces: list[Piece]) -> list[Request]:
        """One forward for decoding ``requests`` and prompt ``pieces``; a forward that raises is redone request
        by request. A step with pieces counts as prefill time, one without as decoding time."""
        start = time.perf_counter()
        try:
            logits, finals = self.runner.step(requests, pieces)
        except PoolExhausted:
            if not pieces:
                raise  # make_room keeps a decoding step within the pool: running out here is the engine's bug
            return self._apart(requests, pieces)  # a prompt kept more than estimated
        except Exception as error:
            if len(requests) + len(pieces) == 1:  # alone, so at fault
                request = requests[0] if requests else pieces[0].request
                self._fail(request, "decoding" if requests else "prefill", error)
                return [request]
            return self._apart(requests, pieces)
        elapsed = time.perf_counter() - start
        self._stats["decode_tokens"] += len(requests)
        if pieces:
            self._stats["prefill_s"] += elapsed
            self._stats["prefill_tokens"] += sum(p.count for p in pieces)
        else:
            self._stats["decode_s"] += elapsed
            self._stats["decode_only_tokens"] += len(requests)
        logits = logits.float()  # every row checked, and greedy rows drawn, at once
        tokens, has_nan = greedy_tokens(logits, [r.params for r in requests])
        for request, row, nan, token in zip(requests, logits, has_nan, tokens):
            request.suspect = False
            self._accept(request, row, nan, token)
        done = list(requests)
        for piece, row in zip(pieces, finals):
            piece.request.to_prefill -= piece.count
            if row is not None:
                self._prompt_done(piece.request, row)
                done.append(piece.request)
        return done

    def _apart(self, requests: list[Request], pieces: list[Piece]) -> list[Request]:
        """After a step failed: each session it touched, left half-written, is dropped and its request recomputed
        alone from its tokens (a prefill gives the next-token logits the step would have); each decoding one then
        decodes alone (``suspect``) until a step of its own succeeds, so the one at fault fails alone."""
        touched = []
        for request in [*requests, *(p.request for p in pieces)]:
            if request.session is not None:
                request.session.release()
                request.session = None
            request.suspect, request.chunked = True, False
            if request in self.scheduler.running:
                touched += self._prefill(request)
        return touched

    def _prefill(self, request: Request) -> list[Request]:
        """Prefill a request's tokens alone, in one forward."""
        start = time.perf_counter()
        try:
            logits = self.runner.prefill(request)
        except PoolExhausted:  # kept more than estimated: wait for room (or fail if nothing else holds any)
            if len(self.scheduler.running) > 1:
                self.scheduler.preempt(request)
                return []
            self.scheduler.finish(request, "error", "the prompt does not fit in the KV pool once compressed: raise kv_memory")
            return [request]
        except Exception as error:  # this request's method, codec or prompt broke: it fails alone
            self._fail(request, "prefill", error)
            return [request]
        self._stats["prefill_s"] += time.perf_counter() - start
        self._stats["prefill_tokens"] += len(request.tokens)
        request.to_prefill = 0
        self._prompt_done(request, logits)
        return [request]

    def _prompt_done(self, request: Request, logits: torch.Tensor) -> None:
        """A request's prompt is in (compressed): its sizes recorded, its first token sampled."""
        stats = request.session.stats()
        request.stats.update(kv_bytes=stats["kv_bytes"], kv_bytes_full=stats["kv_bytes_full"], kr=stats["kr"], cr=stats["cr"])
        self._accept(request, logits)

    def _fail(self, request: Request, stage: str, error: BaseException) -> None:
        """Finish one request with an error (its slots freed); the engine goes on."""
        self.scheduler.finish(request, "error", f"{stage} failed for this request ({type(error).__name__}: {error})")

    def _accept(self, request: Request, logits: torch.Tensor, nan: bool | None = None, token: int | None = None) -> None:
        """Sample the next token, or fail this request alone if that raises (``nan``, ``token``: whether the logits
        hold NaN and the greedy token, where the step found them for all its rows)."""
        try:
            self._take(request, logits, nan, token)
        except Exception as error:
            self._fail(request, "sampling", error)

    def _take(self, request: Request, logits: torch.Tensor, nan: bool | None, token: int | None) -> None:
        """Sample the next token; finish the request on end of sequence, a stop string or max_tokens."""
        if nan if nan is not None else bool(torch.isnan(logits).any()):
            raise FloatingPointError("the model's next-token logits hold NaN (its compressed cache is broken)")
        params = request.params
        if token is None:
            token = sample(logits, params, request.generator, request.prompt_ids, request.output_ids)
        if params.logprobs is not None:
            request.logprobs.append(token_logprob(logits, token, params.logprobs))
        request.output_ids.append(token)
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        reason = "stop" if token in self._eos and not params.ignore_eos else None
        if self._extend_text(request):
            reason = "stop"
        elif len(request.output_ids) >= request.params.max_tokens or len(request.tokens) >= self.max_model_len:
            reason = reason or "length"
        if reason is not None:
            stats = request.session.stats()
            request.stats.update(kv_bytes_end=stats["kv_bytes"], kv_bytes_full_end=stats["kv_bytes_full"], kr_end=stats["kr"],
                                 cr=stats["cr"])  # entries read per decoding step ÷ full, over its steps
            self.scheduler.finish(request, reason)

    @staticmethod
    def _extend_text(request: Request) -> bool:
        """Add the text its newest token completes (``engine/detokenizer.py``); whether a stop string turned up,
        the text then cut before it. Only the new text (and the text held back after it) is searched, with the
        characters before it that a stop string begun there would span."""
        stops = request.params.stop
        start = max(len(request.text) - max((len(s) for s in stops), default=0) + 1, 0)
        request.text += request.detokenizer.step(request.output_ids)
        if not stops:
            return False
        searched = request.text[start:] + request.detokenizer.held
        at = next((found for found in (searched.find(s) for s in stops) if found >= 0), None)
        if at is None:
            return False
        request.text = (request.text + request.detokenizer.flush())[: start + at]
        return True

    # ----- checks -------------------------------------------------------------------------------
    @staticmethod
    def _prompt_list(prompts) -> list:
        """One prompt (a string or a list of token ids) or a list of them, as a list."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        if not isinstance(prompts, Sequence) or not prompts:
            raise ValueError(f"prompts must be a string, a list of token ids, or a non-empty list of them, got {prompts!r:.80}")
        return list(prompts)

    def _methods(self, method, count: int) -> list[Policy]:
        if method is None or isinstance(method, Policy | str):
            method = [method] * count
        methods = [get_method("full") if m is None else get_method(m) if isinstance(m, str) else m for m in method]
        if len(methods) != count:
            raise ValueError(f"{len(methods)} methods for {count} prompts: give one method, or one per prompt")
        for m in methods:
            if not isinstance(m, Policy):
                raise ValueError(f"method must be a method (kvc.get_method(...)), a spec such as 'snapkv:ratio=0.1', or None; got {m!r}")
            m.check_model(self.model.config)
        return methods

    def chat_prompt(self, messages: Sequence[dict]) -> list[int]:
        """A conversation's token ids through the tokenizer's chat template, the assistant's turn opened."""
        if not self.tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template: give prompts to generate() instead")
        if not isinstance(messages, Sequence) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages):
            raise ValueError(f"a conversation is a non-empty list of {{'role': str, 'content': str}} messages, got {messages!r:.80}")
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        _check_text(text, "the conversation")
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def check_prompt(self, prompt, params: SamplingParams) -> list[int]:
        """Token ids of a prompt, refused with a clear error when empty, not text, or too long."""
        if isinstance(prompt, str):
            _check_text(prompt, "the prompt")
            ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError(f"a prompt is a string or a list of token ids, got {prompt!r:.80}")
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        vocab = self.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}) for this model")
        needed = len(ids) + params.max_tokens
        if needed > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {needed} exceeds the model's "
                             f"{self.max_model_len} positions; shorten the prompt or lower max_tokens")
        return ids

    def _add(self, ids: list[int], params: SamplingParams, method: Policy, index: int = 0) -> Request:
        request = Request(next(self._ids), ids, params, method, index, detokenizer=IncrementalDetokenizer(self.tokenizer))
        seed = params.seed + index if params.seed is not None else self.config.seed * 1_000_003 + request.id
        request.generator = torch.Generator().manual_seed(seed)
        self._requests[request.id] = request
        self.scheduler.add(request)
        return request

    def _output(self, request: Request) -> RequestOutput:
        self._requests.pop(request.id, None)
        return request.output()

    # ----- statistics ---------------------------------------------------------------------------
    def _reset_stats(self) -> None:
        self._stats = {"prefill_s": 0.0, "prefill_tokens": 0, "decode_s": 0.0, "decode_tokens": 0, "decode_only_tokens": 0,
                       "max_concurrent": 0,
                       "preemptions_at_start": self.scheduler.preemptions}
        self.pool.peak_bytes, self.pool.peak_allocated = self.pool.used_bytes, self.pool.allocated_bytes

    def stats(self) -> dict[str, Any]:
        """Since the last ``generate``: max_concurrent, decode_tokens_per_s (over the steps that only decode),
        prefill_tokens_per_s (over the steps that prefill, decoding tokens riding along), preemptions,
        pool_capacity_bytes, pool_used_bytes (0 when nothing runs), pool_peak_bytes (held at most) and
        pool_allocated_bytes (the most the pool's arrays took, tiers included: plain and coded arrays each
        grow to their own peak, so with coded requests this may pass kv_memory while the bytes held stay within it)."""
        s = self._stats
        return {
            "max_concurrent": s["max_concurrent"],
            "decode_tokens_per_s": s["decode_only_tokens"] / s["decode_s"] if s["decode_s"] else 0.0,
            "prefill_tokens_per_s": s["prefill_tokens"] / s["prefill_s"] if s["prefill_s"] else 0.0,
            "decode_tokens": s["decode_tokens"],
            "prefill_tokens": s["prefill_tokens"],
            "preemptions": self.scheduler.preemptions - s["preemptions_at_start"],
            "pool_capacity_bytes": self.pool.capacity_bytes,
            "pool_used_bytes": self.pool.used_bytes,
            "pool_peak_bytes": self.pool.peak_bytes,
            "pool_allocated_bytes": self.pool.peak_allocated,
        }


def _check_text(text: str, what: str) -> None:
    """Refuse text the tokenizer cannot take (a lone surrogate such as "\\ud800" is not Unicode text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{what} is not valid Unicode text: {error.reason} at character {error.start} "
                         f"({text[error.start:error.end]!r}); remove it or send token ids") from None


__all__ = ["LLM"]
