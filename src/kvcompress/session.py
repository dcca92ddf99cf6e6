"""One request or batch over the slot store: observe the prefill → plan → apply edits → decode hooks.

A ``Session`` is what the transformers adapter (``hf.CompressedCache``) and the engine share.
It keeps one slot table for all its layers (rows l·B + b: layer l, batch row b) and, per
layer, the summary of what left, the method's state, what the prefill recorded for scoring
and the token counts.

* ``prefill(layer, ...)``: the prompt's causal attention (with each entry's attention sums,
  from the same weights, when a method needs them), the entries written to the pool, the
  observations kept. A method that plans layer by layer compresses each layer right away
  (peak memory stays one layer's prompt); one that plans across layers
  (``plans_globally``) is planned once the last layer is observed. A method that scores by a
  replay of the prompt (``Needs.replay``: KVzip) waits for it: ``replay_layer`` takes each
  layer of each replay chunk, ``finish_replay`` compresses. A long prompt may come in chunks
  (the engine's chunked prefill): ``prefill(..., final=False)`` then ``prefill_more`` per chunk,
  each chunk attending the prompt so far; the observations grow as one prefill's would, and the
  layer is compressed after its last chunk.
* ``decode(layer, ...)``: append the new entries in place, read, let the method act. A
  method that decodes row by row (``decodes_all_layers``) acts once per step, after the
  last layer's read, on every layer at once (a layer's edit only matters to its next read,
  so this is the same as acting after each layer — at a thirtieth of the calls).
* ``fork(method)``: prefill once, compress many — a copy sharing every slot by reference
  count, compressed with another method; the original is untouched.

Methods never write storage: they return ``Edit``s, which ``apply`` hands to the store.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .methods import Needs, Policy
from .read import chunk_attention, prompt_attention, read, replay_attention
from .store.slots import SlotPool, SlotTable
from .store.view import UNCHANGED, Edit, KVView, LayerContext, LayerInput


@dataclass
class LayerState:
    """A layer of a session beside its entries: the summary of what left, the method's state, what the
    prefill recorded, token counts (``seen`` columns incl. padding; ``padding`` [B] of them each row's padding,
    fixed at the prefill: every later token is real)."""

    scaling: float
    summary: Any = None
    state: dict = field(default_factory=dict)
    observations: dict = field(default_factory=dict)
    seen: int = 0
    padding: torch.Tensor | None = None
    uncoded: int = 0  # entries appended per head since the layer was last coded (coded storage)
    prefilling: bool = False  # more chunks of the prompt follow (a chunked prefill): not compressed yet

    def __post_init__(self) -> None:
        self.padded = 0 if self.padding is None else int(self.padding.sum())  # every row's padding, summed

    @property
    def tokens_seen(self) -> torch.Tensor:
        """Real tokens each row has seen [B] (int64; made when asked: a decoding step only counts ``seen``)."""
        return self.seen - self.padding

    def count(self, tokens: int) -> None:
        """``tokens`` more real tokens in every row (a decoding step's, a prompt chunk's)."""
        self.seen += tokens
        self.uncoded += tokens


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

    def __init__(self, method: Policy, pool: SlotPool, *, num_layers: int, num_kv_heads: int, modules=None, rotary=None,
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
        self.table: SlotTable | None = None
        self.batch_size = 0
        self.notes: set[str] = set()
        self.counts: Counter = Counter()  # what the method tallied (merges, ...), over every layer
        self.timings = {"compress_s": 0.0}
        self._pending: dict[int, tuple] = {}  # this step's reads, for a method acting on every layer at once
        self._step: dict = {}  # scratch shared by the layers of one decoding step (LayerContext.step)
        self._step_slots: torch.Tensor | None = None  # a decoding step's slots [num_layers, H] begun at its first layer
        self._step_layer = 0  # the next layer of that step to write its entries
        self.replay_pending = False  # the prompt is prefilled and waits for its replay (KVzip) to be compressed
        self._prompt_edited = False  # the method changed the prompt's entries as it compressed them
        self.reads = [0, 0]  # entries the decoding steps read, and what a full cache would have read, over every layer
        self._counted: tuple[torch.Tensor | None, int] = (None, 0)  # the last selection counted, and its count
        storage = method.storage_for(pool.dtype, num_layers)
        self.code_tier = pool.tier(storage[0]) if storage else 0  # coded storage: the pool tier, 0 = plain
        self.code_recent = storage[1] if storage else 0  # newest entries per head kept plain

    def rows(self, layer_idx: int) -> slice:
        """The table rows of a layer."""
        return slice(layer_idx * self.batch_size, (layer_idx + 1) * self.batch_size)

    # ----- the prefill -----------------------------------------------------------------------
    def prefill(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                scaling: float, *, mask: torch.Tensor | None = None, token_valid: torch.Tensor | None = None,
                hidden_stats: tuple[torch.Tensor, torch.Tensor] | None = None, hidden: torch.Tensor | None = None,
                final: bool = True) -> torch.Tensor:
        """Attend the prompt of one layer (queries [B, Hq, n, d], keys/values [B, H, n, d] at positions
        [B, n]), store its entries and record what the method scores with: output [B, Hq, n, d].

        ``mask`` is transformers' 4-D mask (padded batches) and ``token_valid`` [B, n] marks real tokens;
        ``hidden`` [B, n, D] is the layer's attention input (kept when the method needs ``hidden_states``).
        ``final=False``: more of the prompt follows (a chunked prefill, ``prefill_more``); the layer is
        compressed only after its last chunk."""
        if self.layers[layer_idx] is not None:
            raise RuntimeError(f"layer {layer_idx} was already prefilled; a session holds one prompt (chunked prefill: engine)")
        batch, _, n, _ = query.shape
        if not final and token_valid is not None:
            raise ValueError("a prompt prefilled in chunks is one unpadded row: pass token_valid=None (or final=True)")
        if self.table is None:
            self.batch_size = batch
            self.table = SlotTable(self.num_layers * batch, self.num_kv_heads, key.device, page_size=self.observe.key_pages)
            self._reserve(batch, n)
        sums = None
        if self.observe.attention_sums:
            out, sums = prompt_attention(query, key, value, scaling, mask, col_sums=True, token_valid=token_valid)
        else:
            out, _ = prompt_attention(query, key, value, scaling, mask)
        self.table.append(self.pool, key, value, positions, token_valid, rows=self.rows(layer_idx))
        padding = torch.zeros(batch, dtype=torch.long) if token_valid is None else n - token_valid.sum(1).cpu()
        observations = self._observations(query, positions, sums, token_valid, hidden_stats, hidden)
        self.layers[layer_idx] = LayerState(scaling, seen=n, padding=padding, observations=observations, prefilling=True)
        if final:
            self._prompt_complete(layer_idx)
        return out

    def prefill_more(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                     *, hidden: torch.Tensor | None = None, final: bool = True) -> torch.Tensor:
        """The next chunk of a prompt whose layer was prefilled with ``final=False`` (queries [B, Hq, c, d], keys/values
        [B, H, c, d] at positions [B, c] after the held ones): attend the prompt so far and, causally, the chunk; store
        the chunk; extend what the method scores with (the window's queries, the entries' attention sums, the
        attention inputs) as one prefill of the whole prompt would have recorded it; compress after the last chunk
        (``final``). Output [B, Hq, c, d]."""
        layer = self.layers[layer_idx]
        if layer is None or not layer.prefilling:
            raise RuntimeError(f"layer {layer_idx} has no prompt being prefilled in chunks: start it with prefill(..., final=False)")
        if self.observe.hidden_stats or self.observe.replay:
            raise ValueError("a method that keeps statistics of the whole prompt's attention inputs (GVote) or replays the "
                             "prompt (KVzip) is prefilled in one piece, not in chunks")
        sums = None
        if self.observe.attention_sums:  # the entries' attention sums come from the masked read's weights
            self.table.append(self.pool, key, value, positions, rows=self.rows(layer_idx))
            result = read(query, positions, self.view(layer_idx), layer.scaling, col_sums=True)
            out, sums = result.out, result.col_sums
        else:  # a layer is not compressed before its last chunk: every head holds the prompt so far, plain
            held = self.view(layer_idx)
            out = chunk_attention(query, held.keys, held.values, key, value, layer.scaling)
            self.table.append(self.pool, key, value, positions, rows=self.rows(layer_idx))
        layer.observations = self._more_observations(layer.observations, query, positions, sums, hidden)
        layer.seen += key.shape[2]
        if final:
            self._prompt_complete(layer_idx)
        return out

    def _more_observations(self, obs: dict, query, positions, sums, hidden) -> dict:
        """A prefill's observations extended by one more chunk of the prompt (``prefill_more``)."""
        obs = dict(obs)
        w = self.observe.window
        if w > 0:
            obs["window_queries"] = torch.cat([obs["window_queries"], query], dim=2)[:, :, -w:]
            obs["window_positions"] = torch.cat([obs["window_positions"], positions], dim=1)[:, -w:]
        if sums is not None:  # the earlier queries gave the chunk's entries nothing
            obs["attention_sums"] = F.pad(obs["attention_sums"], (0, sums.shape[-1] - obs["attention_sums"].shape[-1])) + sums
        if self.observe.hidden_states and hidden is not None:
            obs["hidden_states"] = torch.cat([obs["hidden_states"], hidden], dim=1)
        return obs

    def _prompt_complete(self, layer_idx: int) -> None:
        """A layer has seen its whole prompt: compress it now (or, for a method that plans over every layer or
        waits for a replay, once the last layer has)."""
        self.layers[layer_idx].prefilling = False
        self.replay_pending = bool(self.observe.replay) and layer_idx == self.num_layers - 1
        if self.compress_on_prefill and not self.observe.replay:
            if not self.method.plans_globally:
                self._compress([layer_idx])
            elif layer_idx == self.num_layers - 1:
                self._compress(range(self.num_layers))

    # ----- the replay (KVzip): the prompt read again after the prefill, entries scored, nothing kept ------

    def replay_layer(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        """One layer of one replay chunk (queries [B, Hq, q, d], its keys/values [B, H, q, d] at positions [B, q],
        after the prompt's): attend the held entries and, causally, the chunk itself; keep, per entry, the most
        attention any of the chunk's queries gives it (the largest over chunks so far). Nothing is stored:
        output [B, Hq, q, d]."""
        layer, view = self.layers[layer_idx], self.view(layer_idx)
        out, best = replay_attention(query, view.keys, view.values, view.positions, view.valid, key, value, positions,
                                     layer.scaling)
        seen = layer.observations.get("replay_scores")
        layer.observations["replay_scores"] = best if seen is None else torch.maximum(seen, best)
        return out.to(query.dtype)

    def finish_replay(self) -> None:
        """The replay is over (each layer's ``replay_scores`` are complete): the prompt is compressed, unless this
        session keeps its prefill whole for forks."""
        self.replay_pending = False
        if self.compress_on_prefill:
            self._compress(range(self.num_layers))

    def _reserve(self, batch: int, n: int) -> None:
        """Grow a private pool once for what the prefill will hold: every layer's prompt when nothing is
        compressed on the way, else one layer's (each layer is cut right after its prefill)."""
        if self.pool.fixed:
            return
        whole = not self.compress_on_prefill or self.method.plans_globally or self.observe.replay
        layers = self.num_layers if whole else 1
        self.pool.reserve(batch * self.num_kv_heads * (n + 64) * layers)

    def _observations(self, query, positions, sums, token_valid, hidden_stats, hidden) -> dict:
        """The last ``window`` queries, per-entry attention sums and attention inputs (in the table's layout),
        hidden statistics."""
        observe, obs = self.observe, {}
        w = min(observe.window, query.shape[2])
        if w > 0:
            obs["window_queries"] = query[:, :, -w:]
            obs["window_positions"] = positions[:, -w:]
        if sums is not None:
            obs["attention_sums"] = sums if token_valid is None else _left_aligned(sums, token_valid)
        if observe.hidden_stats and hidden_stats is not None:
            obs["hidden_mean"], obs["hidden_std"] = hidden_stats
        if observe.hidden_states and hidden is not None:  # [B, L, D], each row's real tokens first
            obs["hidden_states"] = hidden if token_valid is None else _left_aligned(hidden.transpose(1, 2), token_valid).transpose(1, 2)
        return obs

    # ----- compression -----------------------------------------------------------------------
    def context(self, layer_idx: int, query: torch.Tensor | None = None, query_positions: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> LayerContext:
        layer = self.layers[layer_idx]
        module = self.modules[layer_idx] if self.modules is not None else None
        observations = layer.observations if hidden is None else {**layer.observations, "step_hidden": hidden}
        return LayerContext(layer_idx, self.num_layers, layer.scaling, layer.tokens_seen, observations, layer.state,
                            module, self.rotary, query, query_positions, self.notes, self._step)

    def _context_or_new(self, context: LayerContext | None, layer_idx: int, query: torch.Tensor,
                        positions: torch.Tensor) -> LayerContext:
        """``context`` where a caller made the layer's already, else a new one for the step's query."""
        return context if context is not None else self.context(layer_idx, query, positions)

    def view(self, layer_idx: int) -> KVView:
        return self.table.view(self.pool, self.rows(layer_idx), self.layers[layer_idx].summary)

    def lengths(self, layer_idx: int) -> torch.Tensor:
        """Entries each head of a layer holds [B, H]."""
        return self.table.lengths[self.rows(layer_idx)]

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
                self._prompt_edited = True
            self.layers[i].observations = {}
        for i in indices if self.code_tier else ():
            self.table.code(self.pool, self.code_tier, self.code_recent, self.rows(i), layer=i)
        if indices[-1] == self.num_layers - 1:  # the prompt is compressed
            if self._prompt_edited:  # what the method kept, spread over the pool, into ascending runs of slots
                self.table.relocate(self.pool)
                self._prompt_edited = False
            self.table.shrink()  # give back the table's room for the prompt
        self.timings["compress_s"] += time.perf_counter() - start

    def apply(self, layer_idx: int | None, edit: Edit) -> None:
        """Carry out a method's edit on one layer (None: on every layer at once, the edit in the layout
        of all rows): the store changes the entries, the session keeps the rest."""
        self.table.apply(self.pool, edit, None if layer_idx is None else self.rows(layer_idx))
        self.counts.update(edit.counts)
        for i in range(self.num_layers) if layer_idx is None else [layer_idx]:
            part = (lambda value: value) if layer_idx is not None else (lambda value: _rows_of(value, self.rows(i)))
            layer = self.layers[i]
            if edit.summary is not UNCHANGED:
                layer.summary = part(edit.summary)
            if edit.state:  # replaced, never changed in place: forks share the old one
                layer.state = {**layer.state, **{key: part(value) for key, value in edit.state.items()}}

    # ----- decoding --------------------------------------------------------------------------
    def decode(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
               scaling: float | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Put a step's entries (keys/values [B, H, q, d] at positions [B, q]) in place (``_write_step``), read, let
        the method act (``hidden`` [B, q, D]: the step's attention input, for methods that need ``hidden_states``):
        output [B, Hq, q, d]."""
        begun = self._write_step(layer_idx, key, value, positions)
        view = self.view(layer_idx)
        context = self.context(layer_idx, query, positions) if self.acts_per_layer else None
        # a step begun for every layer counted the reads of a method that does not choose them
        select = self.select(layer_idx, view, query, positions, context) if not begun or self.method.selects else None
        weights = self.wants_read_weights(layer_idx, query, positions, context)
        result = read(query, positions, view, self.layers[layer_idx].scaling, select=select,
                      col_sums=self.wants_col_sums(layer_idx, query, positions, context), weights=weights)
        if weights:
            self.read_weights(layer_idx, view, query, positions, result.weights, context)
        self.after_read(layer_idx, query, positions, result.col_sums, view, hidden)
        return result.out

    def select(self, layer_idx: int, view: KVView | None, query: torch.Tensor, positions: torch.Tensor,
               context: LayerContext | None = None) -> torch.Tensor | None:
        """The entries a layer reads at a decoding step of one token (the method's choice; None: all), counted
        for ``cr`` (``view``, ``context``: the layer's, if at hand; made only for a method that selects)."""
        if query.shape[2] != 1:
            return None  # a chunk of several tokens (a question after the prompt) is a prefill: it reads everything
        select = None
        if self.method.selects:
            select = self.method.select(view if view is not None else self.view(layer_idx),
                                        self._context_or_new(context, layer_idx, query, positions))
        self._count_reads(int(self.lengths(layer_idx).sum()) if select is None else self._selected(select), [layer_idx])
        return select

    def _selected(self, select: torch.Tensor) -> int:
        """The entries a selection names; the layers reading one choice (OmniKV's) share one tensor, counted once."""
        if select is not self._counted[0]:
            self._counted = (select, int((select >= 0).sum()))
        return self._counted[1]

    def wants_read_weights(self, layer_idx: int, query: torch.Tensor, positions: torch.Tensor,
                           context: LayerContext | None = None) -> bool:
        """Whether the method's read rule takes this decoding read's per-entry weights (OmniKV's filter layers;
        ``context``: the layer's, if at hand)."""
        return (query.shape[2] == 1 and self.method.selects
                and self.method.wants_read_weights(self._context_or_new(context, layer_idx, query, positions)))

    def read_weights(self, layer_idx: int, view: KVView | None, query: torch.Tensor, positions: torch.Tensor,
                     weights: torch.Tensor, context: LayerContext | None = None) -> None:
        """Hand the read rule a decoding read's per-entry weights [B, H, G, L] (``view``, ``context``: the layer's, if
        at hand)."""
        self.method.read_weights(view if view is not None else self.view(layer_idx),
                                 self._context_or_new(context, layer_idx, query, positions), weights)

    def _count_reads(self, read: int, layers: Iterable[int]) -> None:
        """A decoding step's ``read`` entries over ``layers``, beside what a full cache would have read there (``cr``)."""
        self.reads[0] += read
        self.reads[1] += self._tokens_seen(layers) * self.num_kv_heads

    def _write_step(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> bool:
        """Put a decoding layer's new entries (keys/values [B, H, q, d]) in place. A step of one token of one request
        is begun at its first layer for every layer at once (``begin_step``: one allocation, one record), then each
        layer only writes its keys and values where that recorded them (True); anything else appends layer by layer."""
        if self._step_slots is not None and layer_idx != self._step_layer:
            self._drop_unwritten()  # the forward that began the step stopped before reaching every layer
        if layer_idx == 0 and self.batch_size == 1 and key.shape[2] == 1:
            self._step_slots, self._step_layer = self.begin_step(int(positions[0, -1])), 0
        if self._step_slots is None:
            self.append_step(layer_idx, key, value, positions)
            return False
        self.pool.write(self._step_slots[layer_idx], key.reshape(-1, key.shape[-1]), value.reshape(-1, value.shape[-1]))
        self.written(layer_idx)
        self._step_layer += 1
        if self._step_layer == self.num_layers:
            self._step_slots = None
        return True

    def _drop_unwritten(self) -> None:
        """Take back what ``begin_step`` recorded in the layers a stopped forward never wrote."""
        for layer_idx in range(self._step_layer, self.num_layers):
            self.table.drop_last(self.pool, self.rows(layer_idx))
            self.layers[layer_idx].count(-1)
        self._step_slots = None

    def append_step(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> None:
        """Write a step's new entries (keys/values [B, H, q, d] at positions [B, q]) of one layer in place."""
        self._start_step(layer_idx)
        self.table.append(self.pool, key, value, positions, rows=self.rows(layer_idx))
        self.layers[layer_idx].count(key.shape[2])
        self.code_due(layer_idx)

    def begin_step(self, position: int) -> torch.Tensor:
        """The engine's decoding step of one token at ``position``, before its forward: a slot per (layer, KV head)
        taken and recorded in every layer at once, so that a layer's read only needs its keys and values written
        there (``SlotPool.write``), then ``written``. Returns the slots [num_layers, H]. A method that does not select
        has its reads counted here, for every layer: a layer reads all it holds now, since a method acting while
        decoding changes a layer only after that layer's read."""
        return Session.begin_steps([self], [position])[:, 0]

    @staticmethod
    def begin_steps(sessions: list[Session], positions: list[int]) -> torch.Tensor:
        """``begin_step`` for the sessions of many requests on one pool (an engine step's decoding rows), session r's
        token at ``positions[r]``: one allocation and one record for all (``SlotTable.append_step``). Returns the slots
        [num_layers, R, H]."""
        first = sessions[0]
        for session in sessions:
            if session.batch_size != 1:
                raise ValueError("begin_step: a session of one request (the engine's); decode a batch layer by layer")
            if session.pool is not first.pool or session.num_layers != first.num_layers or session.num_kv_heads != first.num_kv_heads:
                raise ValueError("begin_steps: sessions on one pool, of one model")
            session._start_step()
        shape = (len(sessions), first.num_layers, first.num_kv_heads)
        slots = first.pool.allocate(shape[0] * shape[1] * shape[2]).view(shape)
        try:
            SlotTable.append_step(first.pool, [s.table for s in sessions], slots, positions)
        except BaseException:
            first.pool.release(slots.reshape(-1))  # not recorded: nothing holds them
            raise
        for session in sessions:
            session._count_step()
        return slots.transpose(0, 1)

    def _count_step(self) -> None:
        """A decoding token in every layer; a method that does not select has every layer's reads counted."""
        for layer in self.layers:
            layer.count(1)
        if not self.method.selects:
            self._count_reads(self.table.num_entries(), range(self.num_layers))

    @property
    def acts_per_layer(self) -> bool:
        """Whether each decoding layer needs the method: it selects what to read, or acts after the read."""
        return self.method.selects or self.method.acts_while_decoding

    def _start_step(self, layer_idx: int = 0) -> None:
        """A decoding step reaching a layer (0: a new step); after an interrupted step, the method first acts on
        what that step read."""
        if self.replay_pending:
            raise RuntimeError("the prompt waits for its replay (KVzip) before it is compressed: prefill through "
                               "the model's forward with input_ids, which replays it as soon as the forward returns")
        if self._pending and layer_idx <= min(self._pending):
            self._act_on_all_layers()  # a step that did not reach the last layer (an interrupted forward)
        if layer_idx == 0:
            self._step = {}

    @property
    def follows_writes(self) -> bool:
        """Whether ``written`` has work after a decoding step writes a layer (page bounds, coding)."""
        return bool(self.table.page_size or self.code_tier)

    def written(self, layer_idx: int) -> None:
        """A decoding step's keys and values of a layer are in the pool where ``begin_step`` recorded them: the
        page bounds follow (Quest), then ``code_due``."""
        if self.table.page_size:
            self.table.written(self.pool, self.rows(layer_idx))
        self.code_due(layer_idx)

    def work_after_write(self, layer_idx: int) -> bool:
        """Whether ``written`` has work in this decoding step's layer (page bounds to follow, or entries due for coding):
        where it has none, a reader may skip the call."""
        return bool(self.table.page_size) or self._coding_due(layer_idx)

    def code_due(self, layer_idx: int) -> None:
        """Code a layer's oldest plain entries (coded storage) once a chunk's worth has come since the last time."""
        if self._coding_due(layer_idx):
            self.table.code(self.pool, self.code_tier, self.code_recent, self.rows(layer_idx), layer=layer_idx)
            self.layers[layer_idx].uncoded = 0

    def _coding_due(self, layer_idx: int) -> bool:
        return bool(self.code_tier) and self.layers[layer_idx].uncoded >= self.pool.tiers[self.code_tier - 1].codec.chunk

    def wants_col_sums(self, layer_idx: int, query: torch.Tensor, positions: torch.Tensor,
                       context: LayerContext | None = None) -> bool:
        """Whether the method needs this step's per-entry column sums from the read (``context``: the layer's, if at
        hand)."""
        method = self.method
        return method.acts_while_decoding and method.wants_col_sums(
            self._context_or_new(context, layer_idx, query, positions))

    def after_read(self, layer_idx: int, query: torch.Tensor, positions: torch.Tensor, col_sums: torch.Tensor | None,
                   view: KVView | None = None, hidden: torch.Tensor | None = None) -> None:
        """Let the method act on a layer after its read (now, or after the last layer's for a method that
        acts on every layer at once); ``view`` is the layer's view the read used, if at hand; ``hidden``
        the step's attention input (in the context's observations as ``step_hidden``)."""
        method = self.method
        if not method.acts_while_decoding:
            return
        if method.decodes_all_layers:
            self._pending[layer_idx] = (query, positions, col_sums, hidden)
            if layer_idx == self.num_layers - 1:
                self._act_on_all_layers()
            return
        edit = method.decode_step(view if view is not None else self.view(layer_idx),
                                  self.context(layer_idx, query, positions, hidden), col_sums)
        if edit is not None:
            self.apply(layer_idx, edit)

    def _act_on_all_layers(self) -> None:
        """The method's decoding step on every layer at once: one view of all rows, the step's queries
        and column sums stacked (layers that did not read this step leave theirs as they are)."""
        pending, self._pending = self._pending, {}
        if len(pending) < self.num_layers:
            for i, (query, positions, col_sums, hidden) in pending.items():  # a partial step: layer by layer
                view, context = self.view(i), self.context(i, query, positions, hidden)
                edit = self.method.decode_step(view, context, col_sums)
                if edit is not None:
                    self.apply(i, edit)
            return
        view = self.table.view(self.pool)
        length = view.shape[2]
        queries, positions, col_sums, hiddens = zip(*(pending[i] for i in range(self.num_layers)))
        sums = None
        if all(s is not None for s in col_sums):
            sums = torch.cat([s if s.shape[-1] == length else torch.nn.functional.pad(s, (0, length - s.shape[-1])) for s in col_sums])
        layers = self.layers
        step = {"step_hidden": torch.cat(hiddens)} if all(h is not None for h in hiddens) else {}
        seen = torch.tensor([layer.seen for layer in layers]).repeat_interleave(self.batch_size)  # each layer's tokens_seen
        context = LayerContext(
            -1, self.num_layers, layers[0].scaling, seen - torch.cat([layer.padding for layer in layers]), step,
            _stack_states([layer.state for layer in layers]), None, self.rotary, torch.cat(queries), torch.cat(positions),
            self.notes,
        )
        edit = self.method.decode_step(view, context, sums)
        if edit is not None:
            self.apply(None, edit)

    def probe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What ``decode`` would answer for these queries and entries, leaving the session as it is
        (no method acts): output [B, Hq, q, d]."""
        layer = self.layers[layer_idx]
        table = self.table.share(self.pool, self.rows(layer_idx))
        try:
            table.append(self.pool, key, value, positions)
            return read(query, positions, table.view(self.pool, summary=layer.summary), layer.scaling).out
        finally:
            table.release(self.pool)

    def probe_steps(self, steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """What decoding one token at a time would answer, with the method's selection, for every layer's
        queries, keys, values and positions of a continuation (``steps[layer]``: [B, Hq, q, d], [B, H, q, d]
        ×2, [B, q]), leaving the session as it is (the method reads but does not act): each layer's
        output [B, Hq, q, d]. Token-major, so a selection one layer makes for the next (OmniKV) holds."""
        tables = [self.table.share(self.pool, self.rows(i)) for i in range(self.num_layers)]
        outputs: list[list[torch.Tensor]] = [[] for _ in range(self.num_layers)]
        try:
            for t in range(steps[0][0].shape[2]):
                scratch: dict = {}  # one decoding step's, shared by its layers
                for i, (query, key, value, positions) in enumerate(steps):
                    layer, at = self.layers[i], slice(t, t + 1)
                    tables[i].append(self.pool, key[:, :, at], value[:, :, at], positions[:, at])
                    view = tables[i].view(self.pool, summary=layer.summary)
                    select, weights = None, False
                    if self.method.selects:
                        context = dataclasses.replace(self.context(i, query[:, :, at], positions[:, at]),
                                                      tokens_seen=layer.tokens_seen + t + 1, step=scratch)
                        select = self.method.select(view, context)
                        weights = self.method.wants_read_weights(context)
                    result = read(query[:, :, at], positions[:, at], view, layer.scaling, select=select, weights=weights)
                    if weights:
                        self.method.read_weights(view, context, result.weights)
                    outputs[i].append(result.out)
        finally:
            for table in tables:
                table.release(self.pool)
        return [torch.cat(parts, dim=2) for parts in outputs]

    # ----- prefill once, compress many ---------------------------------------------------------
    def fork(self, method: Policy) -> Session:
        """A copy of this (uncompressed) session compressed with ``method``; this one is untouched."""
        if self.compress_on_prefill:
            raise ValueError("fork() needs a session built with compress_on_prefill=False.")
        needs = method.needs()
        if not self.observe.covers(needs):
            raise ValueError(
                f"{method.name} needs a prefill that recorded {needs}, and this one recorded {self.observe}; build the "
                "shared prefill cache with what every method needs (CompressedCache.shared(model, methods) does)."
            )
        twin = Session(method, self.pool, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, modules=self.modules,
                       rotary=self.rotary, observe=self.observe, compress_on_prefill=True)
        twin.table = self.table.share(self.pool, page_size=needs.key_pages)
        twin.batch_size, twin.notes = self.batch_size, set(self.notes)
        if needs.replay:  # the shared prefill's replay is part of what compressing with this method costs
            twin.timings["compress_s"] = self.timings.get("replay_s", 0.0)
        twin.layers = [dataclasses.replace(layer, state=dict(layer.state)) for layer in self.layers]
        twin._compress(range(self.num_layers))
        return twin

    def release(self) -> None:
        """Give every slot back to the pool (the session holds nothing afterwards). A session on a shared
        pool (a fork, an engine request) should be released when done; a private pool goes with its session."""
        if self.table is not None:
            self.table.release(self.pool)
        self.layers = [None] * self.num_layers
        self._pending = {}

    # ----- accounting ----------------------------------------------------------------------------
    def _present(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer is not None]

    def layer_bytes(self, layer_idx: int) -> int:
        """Bytes held for a layer: entries, metadata, the summary and any method state that knows its size."""
        return self.table.nbytes(self.pool, self.rows(layer_idx)) + self._state_bytes(layer_idx)

    def _state_bytes(self, layer_idx: int) -> int:
        """Bytes of a layer's summary and method state (each object that knows its size, counted once)."""
        layer = self.layers[layer_idx]
        objects = {id(o): o for o in [layer.summary, *layer.state.values()] if o is not None and hasattr(o, "nbytes")}
        return sum(o.nbytes if isinstance(o, torch.Tensor) else o.nbytes() for o in objects.values())  # a tensor's is an attribute

    def kv_bytes(self) -> int:
        """Bytes of KV state really held over all layers (``layer_bytes`` summed; a plain pool's tables, whose bytes
        add up row by row, counted in one pass where every layer is present)."""
        present = self._present()
        if self.pool.tiers or len(present) < self.num_layers:
            return sum(self.layer_bytes(i) for i in present)
        return self.table.nbytes(self.pool) + sum(self._state_bytes(i) for i in present)

    def _tokens_seen(self, layers: Iterable[int]) -> int:
        """Real tokens seen, summed over the rows of ``layers`` (their ``tokens_seen`` summed, from the counts)."""
        return sum(self.layers[i].seen * self.batch_size - self.layers[i].padded for i in layers)

    def kv_bytes_full(self) -> int:
        """Bytes a plain KV cache would hold for the same tokens (keys + values)."""
        per_token = 2 * self.num_kv_heads * self.pool.head_dim * torch.empty(0, dtype=self.pool.dtype).element_size()
        return self._tokens_seen(self._present()) * per_token

    def stats(self) -> dict[str, Any]:
        """kr (bytes held ÷ full), cr (entries read per decoding step ÷ full, over the steps so far; before the
        first step, what is held), sizes, notes and the method's own statistics."""
        present = self._present()
        full, held = self.kv_bytes_full(), self.kv_bytes()
        everything = len(present) == self.num_layers
        entries = self.table.num_entries() if everything else sum(self.table.num_entries(self.rows(i)) for i in present)
        full_entries = self._tokens_seen(present) * self.num_kv_heads
        heads = len(present) * self.batch_size * self.num_kv_heads
        read, read_full = self.reads if self.reads[1] else (entries, full_entries)  # no step yet: a step reads what is held
        return {
            "kr": held / full if full else 1.0,
            "cr": read / read_full if read_full else 1.0,  # entries read per decoding step ÷ full, over the steps so far
            "kv_bytes": held,
            "kv_bytes_full": full,
            "entries": entries,
            "entries_full": full_entries,
            "entries_per_head": entries / heads if heads else 0.0,  # mean realized budget per (layer, row, KV head)
            "notes": sorted(self.notes),
            **self.method.stats([self.layers[i].state for i in present], dict(self.counts)),
        }


def _stack_states(states: list[dict]) -> dict:
    """Per-layer states as one over every layer's rows: tensors and per-row tuples concatenated,
    objects with ``stack`` stacked (``_rows_of`` takes a layer's part again)."""
    stacked = {}
    for key, first in states[0].items():
        if not all(key in state for state in states):
            continue
        values = [state[key] for state in states]
        if isinstance(first, torch.Tensor):
            stacked[key] = torch.cat(values)
        elif isinstance(first, tuple):
            stacked[key] = sum(values, ())
        elif hasattr(first, "stack"):
            stacked[key] = type(first).stack(values)
    return stacked


def _rows_of(value, rows: slice):
    """A layer's rows of a value stacked over every layer (tensors, per-row tuples, objects with ``rows``)."""
    if value is None or isinstance(value, torch.Tensor | tuple):
        return None if value is None else value[rows]
    return value.rows(rows)


def _left_aligned(x: torch.Tensor, token_valid: torch.Tensor) -> torch.Tensor:
    """[B, H, n] in the prompt's (left-padded) layout → the table's layout: each row's real tokens first."""
    order = torch.argsort((~token_valid).to(torch.int8), dim=-1, stable=True).to(x.device)
    return x.gather(-1, order[:, None, :].expand_as(x))[..., : int(token_valid.sum(1).max())]


__all__ = ["LayerState", "Session"]
