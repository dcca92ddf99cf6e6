"""``kvc.LLM``: the offline serving API — many prompts, one slot pool, continuous batching.

    llm = kvc.LLM(model=None, kv_memory="1GiB", max_num_seqs=64)
    outs = llm.generate(prompts, kvc.SamplingParams(max_tokens=64), method=kvc.get_method("snapkv", ratio=0.1))
    llm.stats()

The pool is a budget of ``kv_memory`` bytes: plain entries and coded ones (KIVI, DeltaKV) together
never hold more, and its arrays grow with the load up to it; nothing else grows with the
number of requests. Each step admits the waiting requests that fit (prefilled one by one, compressed by
their own method), then decodes every running request in one batched forward; requests
finish on their own (max_tokens, end of sequence, a stop string) and give their slots back.
``add_request`` / ``step`` / ``abort`` drive the same loop one step at a time (the server).
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
from ..methods import Method, get_method
from ..models import load_model, model_facts
from ..store.slots import PoolExhausted, SlotPool
from .request import Request, RequestOutput
from .runner import ModelRunner
from .sampling import SamplingParams, sample
from .scheduler import Scheduler


class LLM:
    """A serving engine over one model and one KV slot pool (see the module docstring).

    Args:
        model: checkpoint dir, ``.gguf`` file or hub id; None = the embedded default model.
        kv_memory: bytes (or "200MiB", "1GiB", ...) of the KV slot pool.
        max_num_seqs: requests decoded together at most.
        dtype, device, seed, max_model_len: see ``kvcompress.config.Config``.
        model_and_tokenizer: an already loaded (model, tokenizer) pair instead of ``model``.
    """

    def __init__(self, model: str | None = None, kv_memory: int | str = "1GiB", max_num_seqs: int = 64, *,
                 dtype: str = "auto", device: str = "cpu", seed: int = 0, max_model_len: int | None = None,
                 model_and_tokenizer: tuple[Any, Any] | None = None):
        self.config = Config(model=model, kv_memory=kv_memory, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                             dtype=dtype, device=device, seed=seed)
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
        self.runner = ModelRunner(self.model, self.pool)
        self._eos = eos_ids(self.model, self.tokenizer)
        self._ids = itertools.count()
        self._requests: dict[int, Request] = {}
        self._reset_stats()

    # ----- the offline API -------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]], sampling_params: SamplingParams | None = None,
                 method: Method | str | Sequence[Method] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (strings are used as they are: apply the chat template yourself; or
        token-id lists). ``method`` is one method for all, a list with one per prompt, or None (``full``).
        All prompts are checked before any is started; the outputs come in the prompts' order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        methods = self._methods(method, len(prompts))
        params = sampling_params or SamplingParams()
        checked = [self.check_prompt(prompt, params) for prompt in prompts]
        self._reset_stats()
        requests = [self._add(ids, params, m) for ids, m in zip(checked, methods)]
        bar = tqdm(total=len(requests), desc="generate", disable=not use_tqdm, unit="request")
        while any(not r.finished for r in requests):
            done = sum(r.finished for r in requests)
            self.step()
            bar.update(sum(r.finished for r in requests) - done)
        bar.close()
        return [self._output(r) for r in requests]

    def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                    method: Method | str | None = None) -> int:
        """Queue one request (checked first); its id. ``step`` advances it, ``output`` reads it."""
        params = sampling_params or SamplingParams()
        ids = self.check_prompt(prompt, params)
        return self._add(ids, params, self._methods(method, 1)[0]).id

    def request(self, request_id: int) -> Request | None:
        """A request the engine still knows (running, waiting, or finished and not yet read)."""
        return self._requests.get(request_id)

    def check_fits(self, prompt_ids: list[int], sampling_params: SamplingParams, method: Method) -> None:
        """Refuse a request that could not fit in the pool even alone, or whose method cannot run on this model
        (a clear error, nothing queued)."""
        method.check_model(self.model.config)
        probe = Request(-1, list(prompt_ids), sampling_params, method)
        need = self.scheduler.peak(probe) + self.scheduler.growth(probe)
        if need > self.pool.capacity:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) and max_tokens ({sampling_params.max_tokens}) need {need} "
                             f"KV slots but the pool holds {self.pool.capacity}: shorten the prompt, lower max_tokens or keep less")

    def abort(self, request_id: int) -> None:
        """Stop a request now; its slots go back to the pool."""
        request = self._requests.get(request_id)
        if request is not None and not request.finished:
            self.scheduler.finish(request, "abort")

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
        """Admit and prefill what fits, then one decoding step for every running request; the requests
        that got a token (or finished) this step."""
        touched = []
        while (request := self.scheduler.admit_next()) is not None:  # each prefill holds its real slots before the next
            touched += self._prefill(request)
        self._stats["max_concurrent"] = max(self._stats["max_concurrent"], len(self.scheduler.running))
        decoding = [r for r in self.scheduler.running if r not in touched]
        self.scheduler.make_room()
        decoding = [r for r in decoding if r in self.scheduler.running]
        if decoding:
            start = time.perf_counter()
            logits = self.runner.decode(decoding)
            self._stats["decode_s"] += time.perf_counter() - start
            self._stats["decode_tokens"] += len(decoding)
            for request, row in zip(decoding, logits):
                self._accept(request, row)
            touched += decoding
        if not self.scheduler.has_unfinished():
            self.pool.trim()  # idle: the pool's arrays give their memory back
        return touched

    def _prefill(self, request: Request) -> list[Request]:
        start = time.perf_counter()
        try:
            logits = self.runner.prefill(request)
        except PoolExhausted:  # kept more than estimated: wait for room (or fail if nothing else holds any)
            if len(self.scheduler.running) > 1:
                self.scheduler.preempt(request)
                return []
            self.scheduler.finish(request, "error", "the prompt does not fit in the KV pool once compressed: raise kv_memory")
            return [request]
        self._stats["prefill_s"] += time.perf_counter() - start
        self._stats["prefill_tokens"] += len(request.tokens)
        stats = request.session.stats()
        request.stats.update(kv_bytes=stats["kv_bytes"], kv_bytes_full=stats["kv_bytes_full"], kr=stats["kr"], cr=stats["cr"])
        self._accept(request, logits)
        return [request]

    def _accept(self, request: Request, logits: torch.Tensor) -> None:
        """Sample the next token; finish the request on end of sequence, a stop string or max_tokens."""
        token = sample(logits, request.params, request.generator)
        request.output_ids.append(token)
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        request.text = self.tokenizer.decode(request.output_ids, skip_special_tokens=True)
        reason = None
        if token in self._eos and not request.params.ignore_eos:
            reason = "stop"
        stop = next((s for s in request.params.stop if s in request.text), None)
        if stop is not None:
            request.text, reason = request.text[: request.text.index(stop)], "stop"
        elif len(request.output_ids) >= request.params.max_tokens or len(request.tokens) >= self.max_model_len:
            reason = reason or "length"
        if reason is not None:
            stats = request.session.stats()
            request.stats.update(kv_bytes_end=stats["kv_bytes"], kv_bytes_full_end=stats["kv_bytes_full"], kr_end=stats["kr"],
                                 cr=stats["cr"])  # entries read per decoding step ÷ full, over its steps
            self.scheduler.finish(request, reason)

    # ----- checks -------------------------------------------------------------------------------
    def _methods(self, method, count: int) -> list[Method]:
        if method is None or isinstance(method, Method | str):
            method = [method] * count
        methods = [get_method("full") if m is None else get_method(m) if isinstance(m, str) else m for m in method]
        if len(methods) != count:
            raise ValueError(f"{len(methods)} methods for {count} prompts: give one method, or one per prompt")
        for m in methods:
            m.check_model(self.model.config)
        return methods

    def check_prompt(self, prompt, params: SamplingParams) -> list[int]:
        """Token ids of a prompt, refused with a clear error when empty or too long."""
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
        else:
            ids = [int(t) for t in prompt]
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

    def _add(self, ids: list[int], params: SamplingParams, method: Method) -> Request:
        request = Request(next(self._ids), ids, params, method)
        seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + request.id
        request.generator = torch.Generator().manual_seed(seed)
        self._requests[request.id] = request
        self.scheduler.add(request)
        return request

    def _output(self, request: Request) -> RequestOutput:
        self._requests.pop(request.id, None)
        return request.output()

    # ----- statistics ---------------------------------------------------------------------------
    def _reset_stats(self) -> None:
        self._stats = {"prefill_s": 0.0, "prefill_tokens": 0, "decode_s": 0.0, "decode_tokens": 0, "max_concurrent": 0,
                       "preemptions_at_start": self.scheduler.preemptions}
        self.pool.peak_bytes, self.pool.peak_allocated = self.pool.used_bytes, self.pool.allocated_bytes

    def stats(self) -> dict[str, Any]:
        """Since the last ``generate``: max_concurrent, decode_tokens_per_s, prefill_tokens_per_s, preemptions,
        pool_capacity_bytes, pool_used_bytes (0 when nothing runs), pool_peak_bytes (held at most) and
        pool_allocated_bytes (the most the pool's arrays took, tiers included: plain and coded arrays each
        grow to their own peak, so with coded requests this may pass kv_memory while the bytes held stay within it)."""
        s = self._stats
        return {
            "max_concurrent": s["max_concurrent"],
            "decode_tokens_per_s": s["decode_tokens"] / s["decode_s"] if s["decode_s"] else 0.0,
            "prefill_tokens_per_s": s["prefill_tokens"] / s["prefill_s"] if s["prefill_s"] else 0.0,
            "decode_tokens": s["decode_tokens"],
            "prefill_tokens": s["prefill_tokens"],
            "preemptions": self.scheduler.preemptions - s["preemptions_at_start"],
            "pool_capacity_bytes": self.pool.capacity_bytes,
            "pool_used_bytes": self.pool.used_bytes,
            "pool_peak_bytes": self.pool.peak_bytes,
            "pool_allocated_bytes": self.pool.peak_allocated,
        }


__all__ = ["LLM"]
