"""Which requests run: admission by compressed size, continuous batching, chunked prefill, preemption.

Memory is counted in pool slots (one slot = one plain entry of one KV head at one layer; coded
entries (KIVI, DeltaKV) count their bytes, in slots). A request is admitted when the pool
can hold its prefill — the prompt of the layer being compressed, plus what the method keeps of
every layer, coded if its method codes — on top of the decoding room reserved for the requests
already running; its own decoding room is reserved from then on. A method whose
size is unknown before it has seen the prompt (GVote, ``full``) reserves the whole prompt.
When a decoding step would not fit (a method kept more than expected), the newest running
request is preempted: its slots are freed and it waits again, to be recomputed from its
prompt and the tokens it already has. A prompt that cannot fit even in an empty pool
finishes with an error (that request alone).

A step holds ``max_num_batched_tokens`` tokens: one per decoding request, the rest for prompts. A
prompt that does not fit in what is left is prefilled in chunks over several steps (one such
prompt at a time, as vLLM's default): it then holds its whole prompt plain in every layer until its
last chunk is in and it is compressed, and its admission reserves that.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from ..store.slots import SlotPool
from .request import Request, Status


class Scheduler:
    """Waiting and running requests over one slot pool (nano-vllm's scheduler, sized in slots)."""

    def __init__(self, pool: SlotPool, num_layers: int, num_kv_heads: int, max_num_seqs: int):
        self.pool = pool
        self.num_layers = num_layers
        self.per_token = num_layers * num_kv_heads  # slots one token takes in every layer and head
        self.num_kv_heads = num_kv_heads
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    # ----- sizes ----------------------------------------------------------------------------------
    def kept(self, request: Request) -> int:
        """Entries per head and layer the method keeps of the request's tokens (all of them when unknown)."""
        n = len(request.tokens)
        kept = request.method.kept_per_head(n)
        return n if kept is None else min(n, kept)

    def held(self, request: Request, entries: int) -> int:
        """Slots' worth of pool bytes for ``entries`` per layer and head, stored as the request's method stores
        them: plain slots, or with a codec the newest (its recent window and up to two chunks not yet coded)
        plain and the rest at the codec's bytes per entry."""
        coded = self._coded(request)
        if coded is None:
            return entries * self.per_token
        chunk, entry_bytes, recent = coded
        plain = min(entries, recent + 2 * chunk)
        return plain * self.per_token + math.ceil(self.per_token * (entries - plain) * entry_bytes / self.pool.bytes_per_slot)

    def _coded(self, request: Request) -> tuple[int, float, int] | None:
        """(entries coded at once, bytes per coded entry, recent entries kept plain) of the request's codec;
        None: plain storage."""
        storage = request.method.storage_for(self.pool.dtype, self.num_layers)
        if storage is None:
            return None
        codec, recent = storage
        return max(codec.chunk, codec.block_size), codec.entry_bytes(self.pool.head_dim, self.pool.dtype), recent

    def peak(self, request: Request, chunked: bool | None = None) -> int:
        """Slots the request needs while its prompt is prefilled and compressed: one layer's prompt at a time
        beside what the layers before it kept (coded), or every layer's prompt for a method that plans over all
        layers before cutting any (a global budget) or keeps all of it plain (``full``), or prefilled in chunks
        (``chunked``; default: as the request was admitted), then cut layer by layer."""
        n, kept = len(request.tokens), self.kept(request)
        coded = self._coded(request)
        if request.method.plans_globally or (kept >= n and coded is None):
            return n * self.per_token
        rewritten = kept if kept < n else 0  # an eviction may rewrite what it keeps (a merge's carriers)
        if request.chunked if chunked is None else chunked:  # one layer's codes are written before its plain entries go
            codes = 0 if coded is None else self.held(request, kept) // self.num_layers + self.num_kv_heads
            return n * self.per_token + rewritten * self.num_kv_heads + codes
        return self.held(request, kept) + (n + rewritten) * self.num_kv_heads  # one layer's prompt at a time, plain

    def unheld(self, request: Request) -> int:
        """Slots a running request's prefill may still take beyond what it holds (0 once it decodes)."""
        if not request.to_prefill:
            return 0
        return max(0, self.peak(request) - request.prefilled * self.per_token)

    def growth(self, request: Request) -> int:
        """Slots the request may still take while decoding: a token per layer and head per step (coded in
        blocks as they fill, for a method that codes)."""
        kept = self.kept(request)
        return self.held(request, kept + request.params.max_tokens - len(request.output_ids)) - self.held(request, kept)

    def step_room(self, requests: list[Request]) -> int:
        """Slots a decoding step may take at once: a new entry and a rewritten one per layer and head, and the
        codes of a chunk per layer and head for a request that codes."""
        room = 2 * self.per_token * len(requests)
        for request in requests:
            coded = self._coded(request)
            if coded is not None:  # a chunk's codes are written before its plain entries go
                room += math.ceil(self.per_token * coded[0] * coded[1] / self.pool.bytes_per_slot)
        return room

    # ----- queues ---------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if self.peak(request) + self.growth(request) > self.pool.capacity:
            request.finish("error", f"the prompt ({len(request.prompt_ids)} tokens) and max_tokens "
                                    f"({request.params.max_tokens}) need {self.peak(request) + self.growth(request)} KV slots "
                                    f"but the pool holds {self.pool.capacity}: raise kv_memory, shorten the prompt, lower "
                                    f"max_tokens or keep less (a smaller budget or ratio)")
            return
        self.waiting.append(request)

    def admit_next(self, budget: int, packs: Callable[[Request], bool] = lambda request: True) -> Request | None:
        """The first waiting request, moved to running, if it fits beside the running ones (prefilled
        requests hold their real slots; their decoding room and what running prefills may still take are
        reserved); None otherwise. Arrival order: none overtakes a waiting one. ``budget``: the step's tokens
        left for prompts; a prompt longer than that is admitted to be prefilled in chunks when its method
        ``packs`` (the runner's ``packs``), no other prompt is being chunked and its whole plain prompt fits."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return None
        request = self.waiting[0]
        chunked = packs(request) and len(request.tokens) > budget and self._can_chunk(request)
        if chunked and any(r.chunked and r.to_prefill for r in self.running):
            return None  # one prompt in chunks at a time
        reserved = sum(self.growth(r) + self.unheld(r) for r in self.running) + self.step_room(self.running)
        if self.pool.num_free - reserved < self.peak(request, chunked) + self.step_room([request]):
            return None
        self.waiting.popleft()
        request.status = Status.RUNNING
        request.chunked, request.to_prefill = chunked, len(request.tokens)
        self.running.append(request)
        return request

    def _can_chunk(self, request: Request) -> bool:
        """Whether the pool could hold the request's whole prompt plain (a chunked prefill) and its answer; if
        not, it is prefilled alone, in one forward, compressed layer by layer."""
        return self.peak(request, chunked=True) + self.growth(request) <= self.pool.capacity

    def make_room(self) -> list[Request]:
        """Preempt the newest running requests until a step of the rest fits (their decoding and what their
        prefills may still take); returns them."""
        preempted = []
        while len(self.running) > 1 and self.pool.num_free < self.step_room(self.running) + sum(map(self.unheld, self.running)):
            preempted.append(self.preempt(self.running[-1]))
        return preempted

    def preempt(self, request: Request) -> Request:
        """Free a running request's slots and put it first in line again (it will be recomputed)."""
        self.running.remove(request)
        if request.session is not None:
            request.session.release()
            request.session = None
        request.status = Status.WAITING
        request.chunked, request.to_prefill = False, 0
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)
        return request

    def finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """A request is done: its slots go back to the pool."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.session is not None:
            request.session.release()
            request.session = None
        request.finish(reason, error)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)


__all__ = ["Scheduler"]
