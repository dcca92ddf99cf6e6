"""One request or batch over the slot store: observe the prefill → plan → apply edits → decode hooks.

A ``Session`` is what the transformers adapter (``hf.CompressedCache``) and the engine share.
Per layer it holds a slot table (``store.LayerTable``), the summary of what left, the
method's per-layer state, what the prefill recorded for scoring, and notes.

* ``prefill(layer, ...)``: the prompt's causal attention (with its log-sum-exp and per-entry
  attention sums when a method needs them), the entries written to the pool, the
  observations kept. A method that plans layer by layer compresses each layer right away
  (peak memory stays one layer's prompt); one that plans across layers
  (``plans_globally``) is planned once the last layer is observed.
* ``decode(layer, ...)``: append the new entries in place, read, let the method act.
* ``fork(method)``: prefill once, compress many — a copy sharing every slot by reference
  count, compressed with another method; the original is untouched.

Methods never write storage: they return ``Edit``s, which ``apply`` hands to the store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .methods.base import Method, Needs
from .read import prompt_attention, prompt_column_sums, read
from .store.slots import LayerTable, SlotPool
from .store.view import UNCHANGED, Edit, KVView, LayerContext, LayerInput


@dataclass
class LayerState:
    """A layer of a session: its entries (``table``), the summary of what left, the method's state,
    what the prefill recorded, token counts (``seen`` columns incl. padding, ``tokens_seen`` [B] real)."""

    table: LayerTable
    scaling: float
    summary: Any = None
    state: dict = field(default_factory=dict)
    observations: dict = field(default_factory=dict)
    notes: set = field(default_factory=set)
    seen: int = 0
    tokens_seen: torch.Tensor | None = None

    def nbytes(self, pool: SlotPool) -> int:
        """Entries, metadata, the summary and any method state that knows its size (each object once)."""
        objects = {id(o): o for o in [self.summary, *self.state.values()] if o is not None and hasattr(o, "nbytes")}
        return self.table.nbytes(pool) + sum(o.nbytes() for o in objects.values())


class Session:
    """The compressed KV state of one request or batch (see the module docstring).

    Args:
        method: what compresses the cache.
        pool: where entries live (shared by forks; the engine's pool is shared by every request).
        num_layers, num_kv_heads: of the model.
        modules, rotary: the attention modules and rotary embedding (methods that project
            queries, such as GVote, use them); optional.
        observe: what to record at prefill (default: what ``method`` needs).
        compress_on_prefill: False keeps the full prefill so that ``fork`` can compress copies.
    """

    def __init__(self, method: Method, pool: SlotPool, *, num_layers: int, num_kv_heads: int, modules=None, rotary=None,
                 observe: Needs | None = None, compress_on_prefill: bool = True):
        self.method = method
        self.pool = pool
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.modules = modules
        self.rotary = rotary
        self.observe = method.needs() if observe is None else observe
        self.compress_on_prefill = compress_on_prefill
        self.layers: list[LayerState | None] = [None] * num_layers
        self.timings = {"compress_s": 0.0}

    # ----- the prefill -----------------------------------------------------------------------
    def prefill(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                scaling: float, *, mask: torch.Tensor | None = None, token_valid: torch.Tensor | None = None,
                hidden_stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Attend the prompt of one layer (queries [B, Hq, n, d], keys/values [B, H, n, d] at positions
        [B, n]), store its entries and record what the method scores with: output [B, Hq, n, d].

        ``mask`` is transformers' 4-D mask (padded batches) and ``token_valid`` [B, n] marks real tokens."""
        if self.layers[layer_idx] is not None:
            raise RuntimeError(f"layer {layer_idx} was already prefilled; a session holds one prompt (chunked prefill: engine)")
        batch, _, n, _ = query.shape
        out, lse = prompt_attention(query, key, value, scaling, mask, want_lse=self.observe.attention_sums)
        if layer_idx == 0:
            self._reserve(batch, n)
        layer = LayerState(LayerTable(batch, self.num_kv_heads, key.device), scaling)
        layer.table.append(self.pool, key, value, positions, token_valid)
        layer.seen = n
        layer.tokens_seen = torch.full((batch,), n, dtype=torch.long) if token_valid is None else token_valid.sum(1).cpu()
        layer.observations = self._observations(query, key, lse, positions, scaling, token_valid, hidden_stats)
        self.layers[layer_idx] = layer
        if self.compress_on_prefill:
            if not self.method.plans_globally:
                self._compress([layer_idx])
            elif layer_idx == self.num_layers - 1:
                self._compress(range(self.num_layers))
        return out

    def _reserve(self, batch: int, n: int) -> None:
        """Grow a private pool once for what the prefill will hold: every layer's prompt when nothing is
        compressed on the way, else one layer's (each layer is cut right after its prefill)."""
        if self.pool.fixed:
            return
        layers = self.num_layers if (not self.compress_on_prefill or self.method.plans_globally) else 1
        needed = batch * self.num_kv_heads * (n + 64) * layers
        self.pool.reserve(needed)

    def _observations(self, query, key, lse, positions, scaling, token_valid, hidden_stats) -> dict:
        """The last ``window`` queries, per-entry attention sums (in the table's layout), hidden statistics."""
        observe, obs = self.observe, {}
        w = min(observe.window, query.shape[2])
        if w > 0:
            obs["window_queries"] = query[:, :, -w:]
            obs["window_positions"] = positions[:, -w:]
        if observe.attention_sums:
            sums = prompt_column_sums(query, key, lse, scaling, token_valid)
            obs["attention_sums"] = sums if token_valid is None else _left_aligned(sums, token_valid)
        if observe.hidden_stats and hidden_stats is not None:
            obs["hidden_mean"], obs["hidden_std"] = hidden_stats
        return obs

    # ----- compression -----------------------------------------------------------------------
    def context(self, layer_idx: int, query: torch.Tensor | None = None, query_positions: torch.Tensor | None = None) -> LayerContext:
        layer = self.layers[layer_idx]
        module = self.modules[layer_idx] if self.modules is not None else None
        return LayerContext(layer_idx, self.num_layers, layer.scaling, layer.tokens_seen, layer.observations, layer.state,
                            module, self.rotary, query, query_positions, layer.notes)

    def view(self, layer_idx: int) -> KVView:
        layer = self.layers[layer_idx]
        return layer.table.view(self.pool, layer.summary)

    def _compress(self, indices) -> None:
        """Compress the given layers (a global plan first, when the method makes one); drop their observations."""
        start = time.perf_counter()
        indices = list(indices)
        sizes: list[torch.Tensor | None] = [None] * len(indices)
        if self.method.plans_globally:
            inputs = [LayerInput(self.context(i), lambda i=i: self.view(i)) for i in indices]
            sizes = self.method.plan(inputs)
        for i, layer_sizes in zip(indices, sizes):
            edit = self.method.compress(self.view(i), self.context(i), layer_sizes)
            if edit is not None:
                self.apply(i, edit)
            self.layers[i].observations = {}
        self.timings["compress_s"] += time.perf_counter() - start

    def apply(self, layer_idx: int, edit: Edit) -> None:
        """Carry out a method's edit on one layer: the store changes the entries, the session keeps the rest."""
        layer = self.layers[layer_idx]
        layer.table.apply(self.pool, edit)
        if edit.summary is not UNCHANGED:
            layer.summary = edit.summary
        if edit.state:
            layer.state = {**layer.state, **edit.state}  # replaced, never changed in place: forks share the old one

    # ----- decoding --------------------------------------------------------------------------
    def decode(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
               scaling: float | None = None) -> torch.Tensor:
        """Append a step's entries (keys/values [B, H, q, d] at positions [B, q]), read, let the method
        act: output [B, Hq, q, d]."""
        layer = self.layers[layer_idx]
        q = key.shape[2]
        layer.table.append(self.pool, key, value, positions)
        layer.seen += q
        layer.tokens_seen = layer.tokens_seen + q
        view = self.view(layer_idx)
        method = self.method
        if not method.acts_while_decoding:
            return read(query, positions, view, layer.scaling).out
        context = self.context(layer_idx, query, positions)
        result = read(query, positions, view, layer.scaling, col_sums=method.wants_col_sums(view, context))
        edit = method.decode_step(view, context, result.col_sums)
        if edit is not None:
            self.apply(layer_idx, edit)
        return result.out

    def probe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What ``decode`` would answer for these queries and entries, leaving the session as it is
        (no method acts): output [B, Hq, q, d]."""
        layer = self.layers[layer_idx]
        table = layer.table.share(self.pool)
        try:
            table.append(self.pool, key, value, positions)
            return read(query, positions, table.view(self.pool, layer.summary), layer.scaling).out
        finally:
            table.release(self.pool)

    # ----- prefill once, compress many ---------------------------------------------------------
    def fork(self, method: Method) -> Session:
        """A copy of this (uncompressed) session compressed with ``method``; this one is untouched."""
        if self.compress_on_prefill:
            raise ValueError("fork() needs a session built with compress_on_prefill=False.")
        needs = method.needs()
        if not self.observe.covers(needs):
            raise ValueError(
                f"{method.name} needs observation_window>={needs.window}, attention_sums={needs.attention_sums} and "
                f"hidden_stats={needs.hidden_stats}; build the shared prefill cache with those settings."
            )
        twin = Session(method, self.pool, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, modules=self.modules,
                       rotary=self.rotary, observe=self.observe, compress_on_prefill=True)
        for i, layer in enumerate(self.layers):
            twin.layers[i] = LayerState(layer.table.share(self.pool), layer.scaling, layer.summary, dict(layer.state),
                                        layer.observations, set(layer.notes), layer.seen, layer.tokens_seen)
        twin._compress(range(self.num_layers))
        return twin

    def release(self) -> None:
        """Give every slot back to the pool (the session holds nothing afterwards). A session on a shared
        pool (a fork, an engine request) should be released when done; a private pool goes with its session."""
        for i, layer in enumerate(self.layers):
            if layer is not None:
                layer.table.release(self.pool)
                self.layers[i] = None

    # ----- accounting ----------------------------------------------------------------------------
    def _present(self) -> list[LayerState]:
        return [layer for layer in self.layers if layer is not None]

    def kv_bytes(self) -> int:
        """Bytes of KV state really held over all layers."""
        return sum(layer.nbytes(self.pool) for layer in self._present())

    def kv_bytes_full(self) -> int:
        """Bytes a plain KV cache would hold for the same tokens (keys + values)."""
        per_token = 2 * self.num_kv_heads * self.pool.head_dim * torch.empty(0, dtype=self.pool.dtype).element_size()
        return sum(int(layer.tokens_seen.sum()) * per_token for layer in self._present())

    def stats(self) -> dict[str, Any]:
        """kr (bytes held ÷ full), cr (entries attended per step ÷ full), sizes, notes and the method's own statistics."""
        layers = self._present()
        full, held = self.kv_bytes_full(), self.kv_bytes()
        entries = sum(layer.table.num_entries for layer in layers)
        full_entries = sum(int(layer.tokens_seen.sum()) * self.num_kv_heads for layer in layers)
        heads = sum(layer.table.lengths.numel() for layer in layers)
        return {
            "kr": held / full if full else 1.0,
            "cr": entries / full_entries if full_entries else 1.0,
            "kv_bytes": held,
            "kv_bytes_full": full,
            "entries": entries,
            "entries_full": full_entries,
            "entries_per_head": entries / heads if heads else 0.0,  # mean realized budget per (layer, row, KV head)
            "notes": sorted(set().union(*(layer.notes for layer in layers))),
            **self.method.stats([layer.state for layer in layers]),
        }


def _left_aligned(x: torch.Tensor, token_valid: torch.Tensor) -> torch.Tensor:
    """[B, H, n] in the prompt's (left-padded) layout → the table's layout: each row's real tokens first."""
    order = torch.argsort((~token_valid).to(torch.int8), dim=-1, stable=True).to(x.device)
    return x.gather(-1, order[:, None, :].expand_as(x))[..., : int(token_valid.sum(1).max())]


__all__ = ["LayerState", "Session"]
