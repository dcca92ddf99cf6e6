"""The model runner: one forward per engine step, decoding rows and prompt pieces packed together.

A step's forward is one row of tokens: the last token of every decoding request, then pieces of
prompts (a whole prompt, or a chunk of a long one: chunked prefill), each at its own positions.
The engine's own decoder forward (``engine/decoder.py``) runs it, and in each layer hands the row to
``_Step.attend``, which splits it: the decoding tokens write their keys and values where their requests' slot tables already
name them (``Session.begin_steps`` took and recorded every layer's slots before the forward, for every
request at once) and are read in one batched read over one joint view (heads padded to the longest), each
request's method acting on its own rows (only methods that select or act while decoding are called per
layer); each prompt piece is prefilled into its request's session (a first piece starts
the prompt, a later one attends the prompt so far), and the session compresses the layer when its
prompt's last piece is in. Requests keep their own positions, methods and budgets. A method that
needs its whole prompt in one forward (a replay of it, KVzip; statistics of its attention inputs,
GVote) is prefilled alone (``prefill``). In a step of decoding rows alone on the CPU, ``_Step`` (a ``decoder.InPlace``) hands each
layer's write and read to the decoder's compiled layer instead (one C++ call a layer, the same numbers), where no
method acts in the layer and nothing has to happen between its write and its read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..hf.cache import CompressedCache, hidden_statistics
from ..hf.replay import run_replay
from ..heap import keep_freed_buffers
from ..hugepages import move_parameters
from ..read import read
from ..read.paged import compiled_step
from ..session import Session
from ..store.slots import SlotPool, SlotTable, plain_tensors
from .decoder import Decoder
from .request import Request


@dataclass
class Piece:
    """Tokens ``start`` … ``start + count`` of a request's prompt, prefilled in a step (``final``: its last piece)."""

    request: Request
    start: int
    count: int

    @property
    def final(self) -> bool:
        return self.start + self.count == len(self.request.tokens)


class _Step:
    """One engine step over many sessions: decoding rows first, then prompt pieces, in one row of tokens."""

    def __init__(self, runner: ModelRunner, sessions: list[Session], slots: torch.Tensor | None, pieces: list[Piece]):
        self.runner, self.sessions, self.slots, self.pieces = runner, sessions, slots, pieces
        self.acting = [r for r, s in enumerate(sessions) if s.acts_per_layer]  # rows whose methods act in each layer
        self.following = [s for s in sessions if s.follows_writes]  # sessions with work after each layer's write
        self.tables = [s.table for s in sessions]
        fixed = sessions and not self.acting and not self.following  # no table changes but the writes begin_step recorded
        self.lengths = SlotTable.step_lengths(self.tables) if fixed else None  # every layer's lengths [L, R, H], read once
        # a step of decoding rows alone, no method acting in its layers: its reads in place for the compiled layers
        self.reads_in_place = bool(sessions) and not self.acting and not pieces and slots.device.type == "cpu"
        self._reads = None  # the reads in place of every layer once made (False: none can be), until ``attend`` runs a layer
        # the layers where a request merges a summary into its read (MomentKV's): none changes while no method acts
        self.summarized = {i for s in sessions for i, layer in enumerate(s.layers) if layer.summary is not None} if self.reads_in_place else ()

    def attend(self, layer_idx: int, query, key, value, positions, hidden, scaling: float) -> torch.Tensor:
        """Queries [T, Hq, d] and new keys/values [T, H, d] at ``positions`` [T] (attention inputs ``hidden``
        [T, D]) → output [T, Hq, d]."""
        rows, outs = len(self.sessions), []
        self._reads = None  # what the layer changes (coded entries, grown arrays), the next layers' reads must see
        if rows:
            decoding = (x[:rows, :, None] for x in (query, key, value))  # [R, H, 1, d] each
            out = self.decode_layer(layer_idx, *decoding, positions[:rows, None], scaling, hidden[:rows, None])
            if not self.pieces:
                return out[:, :, 0]
            outs.append(out[:, :, 0])
        offset = rows
        for piece in self.pieces:
            part = slice(offset, offset + piece.count)
            offset += piece.count
            session = piece.request.session
            observe = session.observe
            inputs = hidden[part][None]
            own_hidden = inputs if observe.hidden_states else None
            tokens = (*_rows(query[part], key[part], value[part]), positions[part][None])
            if piece.start == 0:  # statistics of the inputs are kept only by methods whose prompt is one piece (GVote)
                stats = hidden_statistics(inputs, None) if observe.hidden_stats else None
                out = session.prefill(layer_idx, *tokens, scaling, hidden_stats=stats, hidden=own_hidden, final=piece.final)
            else:
                out = session.prefill_more(layer_idx, *tokens, hidden=own_hidden, final=piece.final)
            outs.append(out[0].transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # one piece: its output as it is (token-major from the CPU kernel)

    def decode_layer(self, layer_idx: int, query, key, value, positions, scaling, hidden: torch.Tensor) -> torch.Tensor:
        """One layer of the decoding rows: each request's entries written where ``Session.begin_step`` recorded them
        (then ``Session.written`` for the ``following`` sessions), one batched read over the layer's joint view, then
        each method that acts per layer does (the ``acting`` rows; ``hidden`` [R, 1, D]: the step's attention inputs,
        for methods that gate them)."""
        sessions, acting, pool = self.sessions, self.acting, self.runner.pool
        dim = key.shape[-1]
        pool.write(self.slots[layer_idx].reshape(-1), key.reshape(-1, dim), value.reshape(-1, dim))
        for session in self.following:
            session.written(layer_idx)
        view = SlotTable.joint_view(pool, self.tables, layer_idx, [s.layers[layer_idx].summary for s in sessions],
                                    None if self.lengths is None else self.lengths[layer_idx])
        if not acting:  # every request reads all it holds, and no method acts
            return read(query, positions, view, scaling).out
        contexts = {r: sessions[r].context(layer_idx, query[r : r + 1], positions[r : r + 1]) for r in acting}  # one a row
        wants = {r: sessions[r].wants_col_sums(layer_idx, query[r : r + 1], positions[r : r + 1], contexts[r]) for r in acting}
        select = self.joint_select(layer_idx, query, positions, view.shape[2], contexts)
        weighing = [r for r in acting if sessions[r].wants_read_weights(layer_idx, query[r : r + 1], positions[r : r + 1], contexts[r])]
        result = read(query, positions, view, scaling, select=select, col_sums=any(wants.values()), weights=bool(weighing))
        for r in weighing:
            length = int(sessions[r].lengths(layer_idx).max())
            sessions[r].read_weights(layer_idx, None, query[r : r + 1], positions[r : r + 1], result.weights[r : r + 1, ..., :length],
                                     contexts[r])
        for r in acting:
            session = sessions[r]
            sums = None
            if wants[r]:
                sums = result.col_sums[r : r + 1, :, : int(session.lengths(layer_idx).max())]
            step_hidden = hidden[r : r + 1] if session.observe.hidden_states else None
            session.after_read(layer_idx, query[r : r + 1], positions[r : r + 1], sums, hidden=step_hidden)
        return result.out

    def __call__(self, layer_idx: int):
        """The decoding rows' reads in place as the compiled layers take them (``decoder.InPlace``: a ``PagedStep`` of every
        layer, made once and kept while no layer runs through ``attend``); None where layer ``layer_idx`` needs more than
        the compiled layer does (work between the layer's write and its read: page bounds, entries due for coding; a
        summary to merge; entries only another read covers: DeltaKV's), and ``attend`` runs instead."""
        if layer_idx in self.summarized or (self.following and any(s.work_after_write(layer_idx) for s in self.following)):
            return None
        if self._reads is None:
            pages = SlotTable.step_pages(self.runner.pool, self.tables, self.lengths)
            self._reads = False if pages is None else (compiled_step(pages, self.slots, self.runner.pool.head_dim) or False)
        return self._reads or None

    def every_layer(self):
        """The reads in place where every layer takes them (no summary to merge, no work between a layer's write and
        its read), else None (``decoder.InPlace``)."""
        if self.summarized or self.following:
            return None
        return self(0)

    def joint_select(self, layer_idx: int, query, positions, length: int, contexts: dict) -> torch.Tensor | None:
        """Each request's choice of entries to read (dynamic selection is per request; only the ``acting`` rows whose
        method selects choose, and have their reads counted: the others' were at ``begin_step``), as one index
        [R, H, k] into the joint view of ``length`` columns (-1: none); None when every request reads all.
        ``contexts``: each acting row's ``LayerContext`` of the layer."""
        sessions, device = self.sessions, self.runner.device
        chosen: list[torch.Tensor | None] = [None] * len(sessions)
        for r in self.acting:
            if sessions[r].method.selects:
                chosen[r] = sessions[r].select(layer_idx, None, query[r : r + 1], positions[r : r + 1], contexts[r])
        if all(c is None for c in chosen):
            return None
        rows = []
        for session, choice in zip(sessions, chosen):
            if choice is None:  # this request reads everything it holds
                lengths = session.lengths(layer_idx).to(device)[0]
                span = torch.arange(length, device=device)
                choice = torch.where(span < lengths[:, None], span, -1)[None]
            rows.append(choice)
        width = max(c.shape[-1] for c in rows)
        return torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[-1]), value=-1) for c in rows])


class ModelRunner:
    """Runs the model for the engine over one slot pool (``tokenizer``: for methods that replay a prompt, KVzip)."""

    def __init__(self, model, pool: SlotPool, tokenizer=None, pack: bool = True):
        self.model, self.pool, self.tokenizer = model, pool, tokenizer
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":  # a decoding step streams every weight: on 2 MiB pages, fewer TLB misses
            move_parameters(model)
            keep_freed_buffers()  # a step's tens of MB of short-lived tensors reused, not faulted in again
        self.decoder = Decoder(model, pack)

    @torch.inference_mode()
    def prefill(self, request: Request) -> torch.Tensor:
        """Prefill the request's whole prompt alone into a new session on the pool, through the engine's decoder
        (with the statistics of each layer's attention inputs where the method keeps them, GVote), replay it where the
        method scores by a replay (KVzip), and let the session compress; the next-token logits [V]."""
        cache = self._cache_for(request)
        session = request.session = cache.session
        ids = torch.tensor(request.tokens, device=self.device)
        positions = torch.arange(len(request.tokens), device=self.device)
        try:
            logits = self.decoder(ids, positions, _Step(self, [], None, [Piece(request, 0, len(request.tokens))]).attend, positions[-1:])
            if session.replay_pending:
                run_replay(self._replay_forward(session), session, cache.replay_prompts, ids[None])
        except BaseException:
            session.release()  # a prefill that did not fit leaves nothing behind
            request.session = None
            raise
        return logits[0]

    def _replay_forward(self, session: Session):
        """A replay's chunk forward (``hf/replay.py``) through the engine's decoder: each layer attends by
        ``Session.replay_layer``, and nothing is kept."""
        nothing = torch.empty(0, dtype=torch.long, device=self.device)

        def attend(layer_idx, query, key, value, positions, hidden, scaling):
            return session.replay_layer(layer_idx, *_rows(query, key, value), positions[None])[0].transpose(0, 1)

        def forward(ids: torch.Tensor, positions: torch.Tensor) -> None:
            if ids.shape[0] != 1:
                raise ValueError("the engine replays one prompt at a time")
            self.decoder(ids[0], positions[0], attend, nothing)

        return forward

    def _cache_for(self, request: Request) -> CompressedCache:
        """A new cache on the engine's pool for the request's prompt, compressed by its method."""
        return CompressedCache(self.model, request.method, pool=self.pool, tokenizer=self.tokenizer)

    @staticmethod
    def packs(request: Request) -> bool:
        """Whether the request's prompt may be prefilled in pieces packed into a step (else alone, ``prefill``)."""
        needs = request.method.needs()
        return not (needs.replay or needs.hidden_stats)

    @torch.inference_mode()
    def step(self, requests: list[Request], pieces: list[Piece]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """One forward: a token for every decoding request (its last one in, at its own position) and the prompt
        pieces (a piece starting at 0 gets a new session on the pool). Returns the decoding requests' next-token
        logits [R, V] and, per piece, the next-token logits [V] after a final piece (None for the others)."""
        ids = [r.output_ids[-1] for r in requests]
        positions = [len(r.tokens) - 1 for r in requests]
        keep = list(range(len(requests)))
        for piece in pieces:
            request = piece.request
            if piece.start == 0:
                request.session = self._cache_for(request).session
            ids += request.tokens[piece.start : piece.start + piece.count]
            positions += range(piece.start, piece.start + piece.count)
            if piece.final:
                keep.append(len(ids) - 1)
        sessions = [r.session for r in requests]
        with plain_tensors():  # one switch of mode for every request's step
            slots = Session.begin_steps(sessions, positions[: len(sessions)]) if sessions else None  # [L, R, H]
        step = _Step(self, sessions, slots, pieces)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        logits = self.decoder(as_tensor(ids), as_tensor(positions), step.attend, as_tensor(keep),
                              step if step.reads_in_place else None)
        finals = iter(logits[len(requests):])
        return logits[: len(requests)], [next(finals) if piece.final else None for piece in pieces]


def _rows(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The decoder's [T, H, d] as a session's one row [1, H, T, d]."""
    return tuple(x.transpose(0, 1)[None] for x in tensors)


__all__ = ["ModelRunner", "Piece"]
