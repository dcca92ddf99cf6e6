"""What a read and a method see of a layer, and what a method may ask the store to change.

* ``KVView``: one layer's entries for a batch, laid out [B, H, L, ...] (L = the longest KV
  head; shorter heads are padded and ``valid`` says where). Keys and values are
  materialized from the store only when first asked for, so a method that needs only
  positions (StreamingLLM) never copies them.
* ``Summary``: what a method keeps of entries that left (MomentKV's moments), merged into
  every read through log-sum-exp.
* ``LayerContext``: the facts about the layer and the step that are not entries.
* ``Edit``: what a method returns — keep, rewrite entries, set log-weights, per-entry
  channels, a summary, per-layer state. The store applies it; a method never writes
  storage.

Shapes: B batch rows, H KV heads, G query heads per KV head, L entries, d head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Summary(Protocol):
    """A per-head summary of evicted entries that contributes to attention (e.g. MomentKV), read as an
    affine map of the query.

    ``readout`` returns ``matrix`` [B, H, d + 1, d] and ``bias`` [B, H, d + 1], float32, such that
    ``matrix · q + bias`` is, for a query q of KV head h, the summary's output (its first d numbers) and
    its log partition function (the last; ``-inf`` = empty). The read merges it through log-sum-exp
    (``read.reference.summary_attend``).
    """

    def readout(self, scaling: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def nbytes(self) -> int: ...


@dataclass
class KiviBlocks:
    """A tier of KIVI-coded blocks, read in place: the entry id ``tier << TIER_SHIFT | block · group_size + offset``
    names entry ``offset`` of a block; ``arrays`` are the tier's per-block arrays as ``codec.fields`` names them."""

    tier: int
    codec: Any  # store.codecs.KiviCodec
    arrays: dict[str, torch.Tensor]


@dataclass
class DeltaKVBlocks:
    """DeltaKV's two tiers, read in place: ``tier`` holds its coded tokens (``arrays``, as ``codec.fields`` names them),
    ``reference_tier`` its raw reference tokens (``references``: keys and values [R, H, d], positions [R]); the entry id
    ``tier << TIER_SHIFT | token · H + head`` names one KV head of a token of either."""

    tier: int
    reference_tier: int
    codec: Any  # store.deltakv.DeltaKVCodec
    arrays: dict[str, torch.Tensor]
    references: dict[str, torch.Tensor]


@dataclass
class Pages:
    """Where a view's entries live, for a reader that reads them in place (``read/paged.py``).

    ``arrays()``: the pool's plain keys and values [S, d] as they are when read, and the coded entries the tables may
    name: one tier of KIVI blocks (``KiviBlocks``) or DeltaKV's pair of tiers (``DeltaKVBlocks``); None: every entry is plain. Per batch row, ``tables`` an int32 table of
    entry ids [H, ≥ L] (a view of the store's own table: nothing concatenated or copied; 0 = padding or a
    hole, skipped) and ``log_weights`` its float32 log-weights [H, ≥ L] (None: none). ``lengths`` int64
    [B, H]: the columns of each head to read. Only for entries at or before every query that reads
    them through the pages (a decoding step): the pages carry no positions. Every layer of a decoding step at once
    (``SlotTable.step_pages``): the tables and log-weights [layers, H, ≥ L], the lengths [layers, B, H].
    """

    arrays: Callable[[], tuple[torch.Tensor, torch.Tensor, KiviBlocks | DeltaKVBlocks | None]]
    tables: list[torch.Tensor]
    lengths: torch.Tensor
    log_weights: list[torch.Tensor | None]


class KVView:
    """One layer's entries for a batch, padded to the longest head (see the module docstring).

    Args:
        positions: int64 [B, H, L], original token positions (padding holds a position after
            every real one, so causality alone hides it); or a function giving them on first use
            (then ``shape`` is required).
        lengths: int64 [B, H] on the CPU, entries per head; or a function giving them on first use.
        load: ``load(index)`` returns (keys, values) [B, H, L, d] — or, given an index [B, H, k],
            only those entries — on first access (None: give them directly).
        keys, values: the entries, when already materialized.
        log_weights: float32 [B, H, L] added to the logits (KeepKV's votes), None, or a function
            giving them (or None) on first use.
        channels: per-entry method state, float32 [B, H, L] each (H2O's scores, EMA).
        summary: what left, merged into every read.
        uniform: True when the caller knows every head holds L entries (skips the check).
        page_bounds: [B, H, pages, 2, d], each channel's min and max key over every full page of ``page_size``
            consecutive entries (a head's open page, not yet full, and pages past its length mean nothing),
            when the store keeps them.
        pages: where the entries live, when a decoding read may read them in place (``Pages``), or a
            function giving them (or None) on first use.
        shape: (B, H, L), given with lazy positions.
    """

    def __init__(
        self,
        positions: torch.Tensor | Callable[[], torch.Tensor],
        lengths: torch.Tensor | Callable[[], torch.Tensor],
        *,
        load: Callable[[torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]] | None = None,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        log_weights: torch.Tensor | None = None,
        channels: Mapping[str, torch.Tensor] | None = None,
        summary: Summary | None = None,
        uniform: bool | None = None,
        page_bounds: torch.Tensor | None = None,
        page_size: int = 0,
        pages: Pages | Callable[[], Pages | None] | None = None,
        shape: tuple[int, int, int] | None = None,
    ):
        if load is None and (keys is None or values is None):
            raise ValueError("a KVView needs its keys and values or a loader for them")
        if callable(positions) and shape is None:
            raise ValueError("a KVView with lazy positions needs its shape")
        self._positions = positions
        self._shape = tuple(shape) if shape is not None else tuple(positions.shape)  # type: ignore[union-attr]
        self._lengths = lengths
        self._log_weights = log_weights
        self._pages = pages
        self.channels = dict(channels or {})
        self.summary = summary
        self.page_bounds, self.page_size = page_bounds, page_size
        self._load = load
        self._kv = None if keys is None else (keys, values)
        self._valid: torch.Tensor | None | bool = None if uniform else False  # False = not computed yet

    @classmethod
    def of(cls, keys, values, positions, valid=None, log_weights=None, channels=None, summary=None) -> KVView:
        """A view over tensors already in [B, H, L, ...] layout (``valid`` None = every entry real)."""
        b, h, length = positions.shape
        lengths = valid.sum(-1).cpu() if valid is not None else torch.full((b, h), length, dtype=torch.long)
        positions = positions.long()
        if valid is not None:
            positions = positions.masked_fill(~valid, PAD_POSITION)
        return cls(positions, lengths, keys=keys, values=values, log_weights=log_weights, channels=channels, summary=summary)

    @property
    def positions(self) -> torch.Tensor:
        if callable(self._positions):
            self._positions = self._positions()
        return self._positions

    @property
    def lengths(self) -> torch.Tensor:
        if callable(self._lengths):
            self._lengths = self._lengths()
        return self._lengths

    @property
    def log_weights(self) -> torch.Tensor | None:
        if callable(self._log_weights):
            self._log_weights = self._log_weights()
        return self._log_weights

    @property
    def pages(self) -> Pages | None:
        if callable(self._pages):
            self._pages = self._pages()
        return self._pages

    # ----- shape ---------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, H, L)."""
        return self._shape  # type: ignore[return-value]

    @property
    def uniform(self) -> bool:
        """Every head holds L entries (no padding)."""
        return self.valid is None

    @property
    def valid(self) -> torch.Tensor | None:
        """bool [B, H, L], False on padding; None when every head holds L entries."""
        if self._valid is False:
            length = self._shape[-1]
            if bool((self.lengths == length).all()):
                self._valid = None
            else:
                span = torch.arange(length, device=self.positions.device)
                self._valid = span < self.lengths.to(self.positions.device)[..., None]
        return self._valid  # type: ignore[return-value]

    def valid_or_ones(self) -> torch.Tensor:
        valid = self.valid
        return valid if valid is not None else torch.ones(self.shape, dtype=torch.bool, device=self.positions.device)

    @property
    def num_entries(self) -> int:
        return int(self.lengths.sum())

    # ----- entries -------------------------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor:
        return self._materialized()[0]

    @property
    def values(self) -> torch.Tensor:
        return self._materialized()[1]

    def _materialized(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kv is None:
            self._kv = self._load(None)  # type: ignore[misc]
        return self._kv

    def select(self, index: torch.Tensor) -> KVView:
        """The entries at ``index`` [B, H, k] of each head (-1: nothing, a padding entry); only those are
        materialized."""
        hole = index < 0
        safe = index.clamp(min=0).long()
        pick = lambda t: None if t is None else t.gather(-1, safe)  # noqa: E731
        if self._kv is not None:
            wide = safe[..., None].expand(*safe.shape, self.keys.shape[-1])
            keys, values, load = self.keys.gather(2, wide), self.values.gather(2, wide), None
        else:
            keys = values = None
            load = lambda _: self._load(safe)  # noqa: E731
        positions = lambda: self.positions.gather(-1, safe).masked_fill(hole, PAD_POSITION)  # noqa: E731
        return KVView(positions, lambda: (~hole).sum(-1).cpu(), shape=index.shape, load=load,
                      keys=keys, values=values, log_weights=pick(self.log_weights),
                      channels={name: pick(c) for name, c in self.channels.items()}, summary=self.summary)

    def flat(self, padded: torch.Tensor) -> torch.Tensor:
        """[B, H, L, ...] → the real entries [N, ...], head after head."""
        valid = self.valid
        return padded[valid] if valid is not None else padded.reshape(-1, *padded.shape[3:])


PAD_POSITION = 2**31 - 1  # the position of padding entries: after every real token


@dataclass
class LayerContext:
    """What a method may know about the layer it compresses or decodes, beside its entries.

    ``tokens_seen`` [B]: real tokens each row has seen so far (the full cache's length).
    ``observations``: what the prefill recorded for scoring (``window_queries`` [B, Hq, w, d],
    ``window_positions`` [B, w], ``attention_sums`` [B, H, L] in the view's layout,
    ``hidden_mean``/``hidden_std`` [B, D], ``hidden_states`` [B, L, D]; while decoding,
    ``step_hidden`` [B, q, D], the step's attention input, for methods that need ``hidden_states``). ``state``: the method's per-layer state so far
    (read only: changes go in ``Edit.state``). While decoding, ``query`` [B, Hq, q, d]
    (after RoPE) and ``query_positions`` [B, q] are the step's queries. ``module`` is the
    layer's attention module and ``rotary`` the model's rotary embedding (GVote projects
    sampled hidden states through them). ``notes`` collects remarks for the stats; ``step`` is
    scratch shared by every layer of one decoding step (OmniKV's filter layer leaves its choice
    of tokens there for the layers after it).
    """

    layer_idx: int
    num_layers: int
    scaling: float
    tokens_seen: torch.Tensor
    observations: Mapping[str, Any] = field(default_factory=dict)
    state: Mapping[str, Any] = field(default_factory=dict)
    module: Any = None
    rotary: Any = None
    query: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    notes: set[str] = field(default_factory=set)
    step: dict[str, Any] = field(default_factory=dict)

    def note(self, message: str) -> None:
        self.notes.add(message)

    @property
    def batch_size(self) -> int:
        return int(self.tokens_seen.shape[0])


@dataclass
class LayerInput:
    """One layer as a cross-layer plan sees it: the context, and its view loaded on demand
    (so that a plan over every layer never holds every layer's keys at once)."""

    context: LayerContext
    load: Callable[[], KVView]

    @property
    def view(self) -> KVView:
        return self.load()


class _Unchanged:
    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Any = _Unchanged()


@dataclass
class Rewrite:
    """New keys and values for the (real) entries marked in ``mask`` [B, H, L] (a merge's carriers):
    ``keys``, ``values`` [N, d] hold them in the mask's order (``tensor[mask]``)."""

    mask: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor

    def applied(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys``, ``values`` [B, H, L, d] with the rewritten entries in place."""
        wide = self.mask[..., None].expand_as(keys)
        return (keys.masked_scatter(wide, self.keys.to(keys.dtype)), values.masked_scatter(wide, self.values.to(values.dtype)))


@dataclass
class Entries:
    """A whole new set of entries for a layer, [B, H, T, ...] with ``valid`` [B, H, T] (a rebuild
    from elsewhere: KeepKV's periodic refresh)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    log_weights: torch.Tensor | None = None
    channels: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Edit:
    """What a method asks the store to do to one layer, in the layout of the view it was given.

    Applied in this order: ``replace`` (a new set of entries; the rest of the edit then refers
    to it), ``rewrite``, ``log_weights`` (None removes them), ``channels``, then ``keep``
    (entries marked False leave; their slots are freed). ``summary`` replaces the layer's
    summary (None removes it), ``state`` updates the method's per-layer state (values with
    one row per batch row), ``counts`` are added to the session's tallies (merges, drops).
    """

    keep: torch.Tensor | None = None
    rewrite: Rewrite | None = None
    log_weights: Any = UNCHANGED
    channels: dict[str, torch.Tensor] = field(default_factory=dict)
    summary: Any = UNCHANGED
    state: dict[str, Any] = field(default_factory=dict)
    replace: Entries | None = None
    counts: dict[str, int] = field(default_factory=dict)


def edited_entries(view: KVView, edit: Edit) -> Entries:
    """The entries ``view`` would hold after ``edit`` (its ``rewrite``, ``log_weights``, ``channels``
    and ``keep``), as tensors: a layer rebuilt elsewhere becomes ``Edit(replace=...)``."""
    keys, values = view.keys, view.values
    if edit.rewrite is not None:
        keys, values = edit.rewrite.applied(keys, values)
    log_weights = view.log_weights if edit.log_weights is UNCHANGED else edit.log_weights
    valid = view.valid_or_ones() if edit.keep is None else edit.keep & view.valid_or_ones()
    return Entries(keys, values, view.positions, valid, log_weights, {**view.channels, **edit.channels})


__all__ = ["edited_entries", "PAD_POSITION", "UNCHANGED", "Edit", "Entries", "KVView", "KiviBlocks", "DeltaKVBlocks", "Pages", "LayerContext", "LayerInput", "Rewrite", "Summary"]
