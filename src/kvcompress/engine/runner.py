"""The model runner: prefill one request into its session; decode every running request in one forward.

A prefill runs the transformers model over one prompt with a ``CompressedCache`` on the
engine's pool: the session compresses each layer as it goes (the method's plan). A decoding
step runs the model once over the last token of every running request; in each layer the
``kvcompress`` attention function hands the batch to ``_BatchCache.attend``, which appends
each request's new entries to its own slot tables, reads all of them in one batched read
over one joint view (their heads padded to the longest), and lets each request's method act
on its own rows. Requests keep their own positions, methods and budgets.
"""

from __future__ import annotations

import torch

from ..hf.cache import ATTENTION_NAME, CompressedCache
from ..hf.layers import HandOverCache, PositionsLayer
from ..models import attention_modules
from ..read import read
from ..session import Session
from ..store.slots import SlotPool, SlotTable
from .request import Request


class _BatchCache(HandOverCache):
    """One decoding step over many sessions (one per request, each with its own method)."""

    def __init__(self, runner: ModelRunner, sessions: list[Session]):
        self.runner, self.sessions, self.attention_modules = runner, sessions, runner.modules
        # each request's positions come with the step; the kvcompress attention ignores transformers' mask
        super().__init__(layers=[PositionsLayer(lambda: 0) for _ in range(runner.num_layers)])

    def attend(self, layer_idx, module, query, key, value, mask, scaling, position_ids, hidden=None) -> torch.Tensor:
        return self.runner.decode_layer(self.sessions, layer_idx, query, key, value, position_ids, scaling, hidden)


class ModelRunner:
    """Runs the model for the engine over one slot pool (``tokenizer``: for methods that replay a prompt, KVzip)."""

    def __init__(self, model, pool: SlotPool, tokenizer=None):
        self.model, self.pool, self.tokenizer = model, pool, tokenizer
        self.modules = attention_modules(model)
        self.num_layers = len(self.modules)
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def prefill(self, request: Request) -> torch.Tensor:
        """Prefill the request's tokens into a new session on the pool (compressed by its method); the
        next-token logits [V]."""
        cache = CompressedCache(self.model, request.method, pool=self.pool, tokenizer=self.tokenizer)
        ids = torch.tensor([request.tokens], device=self.device)
        try:
            logits = self.model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        except BaseException:
            cache.session.release()  # a prefill that did not fit leaves nothing behind
            raise
        request.session = cache.session
        return logits[0, -1]

    @torch.inference_mode()
    def decode(self, requests: list[Request]) -> torch.Tensor:
        """One token for every request (its last one in, at its own position): next-token logits [R, V]."""
        ids = torch.tensor([[r.output_ids[-1]] for r in requests], device=self.device)
        positions = torch.tensor([[len(r.tokens) - 1] for r in requests], device=self.device)
        cache = _BatchCache(self, [r.session for r in requests])
        if self.model.config._attn_implementation != ATTENTION_NAME:
            raise RuntimeError("the model left the kvcompress attention implementation")
        return self.model(ids, position_ids=positions, past_key_values=cache, use_cache=True).logits[:, -1]

    def decode_layer(self, sessions: list[Session], layer_idx: int, query, key, value, positions, scaling,
                     hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One layer of a decoding step: append each request's entries, one batched read, then each method acts
        (``hidden`` [R, 1, D]: the step's attention inputs, for methods that gate them)."""
        count, heads, q, dim = key.shape
        slots = self.pool.allocate(count * heads * q)  # every request's new entries written at once
        self.pool.write(slots, key.reshape(-1, dim), value.reshape(-1, dim))
        slots = slots.view(count, heads, q)
        for r, session in enumerate(sessions):
            session.append_step(layer_idx, key[r : r + 1], value[r : r + 1], positions[r : r + 1], slots[r : r + 1])
        parts = [(s.table, s.rows(layer_idx), s.layers[layer_idx].summary) for s in sessions]
        view = SlotTable.joint_view(self.pool, parts)
        wants = [s.wants_col_sums(layer_idx, query[r : r + 1], positions[r : r + 1]) for r, s in enumerate(sessions)]
        select = self.joint_select(sessions, layer_idx, query, positions, view.shape[2])
        result = read(query, positions, view, scaling, select=select, col_sums=any(wants))
        for r, session in enumerate(sessions):
            sums = None
            if wants[r]:
                sums = result.col_sums[r : r + 1, :, : int(session.lengths(layer_idx).max())]
            step_hidden = hidden[r : r + 1] if hidden is not None and session.observe.hidden_states else None
            session.after_read(layer_idx, query[r : r + 1], positions[r : r + 1], sums, hidden=step_hidden)
        return result.out

    def joint_select(self, sessions: list[Session], layer_idx: int, query, positions, length: int) -> torch.Tensor | None:
        """Each request's choice of entries to read (dynamic selection is per request), as one index
        [R, H, k] into the joint view of ``length`` columns (-1: none); None when every request reads all."""
        chosen = [s.select(layer_idx, None, query[r : r + 1], positions[r : r + 1]) for r, s in enumerate(sessions)]
        if all(c is None for c in chosen):
            return None
        rows = []
        for session, choice in zip(sessions, chosen):
            if choice is None:  # this request reads everything it holds
                lengths = session.lengths(layer_idx).to(self.device)[0]
                span = torch.arange(length, device=self.device)
                choice = torch.where(span < lengths[:, None], span, -1)[None]
            rows.append(choice)
        width = max(c.shape[-1] for c in rows)
        return torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[-1]), value=-1) for c in rows])


__all__ = ["ModelRunner"]
