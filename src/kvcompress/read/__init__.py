"""The read path: attention of new queries over a layer's view.

    read(q, q_pos, view, scaling, select=None, col_sums=False) -> ReadResult(out, lse, col_sums)

    select entries (optional, per KV head) → materialize them (the store's codec decodes only
    those) → attend with per-entry log-weights → merge the summary of what left through
    log-sum-exp → optional per-entry column sums

It takes a ``KVView`` and knows nothing of methods, the store's layout or transformers.
``reference.py`` is the float32 oracle; ``sdpa.py`` the fast path on torch's fused kernels
(exact SDPA for uniform heads, a masked flash kernel with the log-sum-exp otherwise); ``paged.py``
a decoding query's read where the entries live. Tests hold the fast paths to the reference. For
choosing what to read: ``decode_weights`` (each entry's weight for a decoding query, from the paged
read's logits; ``read(weights=True)`` hands them out with the read itself: OmniKV's filter layers), ``top_pages``
(each head's best pages by bound: Quest; ``page_bounds_torch`` the bounds themselves). Causality is decided by original token positions, so
entries appended behind an evicted prefix need no mask bookkeeping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..store.view import KVView, Pages
from .reference import (attend_reference, attend_with_max_weights, attention_probs, group_queries, masked_logits, merge_lse,
                        read_reference)
from .sdpa import chunk_attention, merge_summary, prompt_attention, prompt_attention_with_sums, read_exact, read_masked, replay_attention
from .paged import entry_weights, paged_decode
from .pages import page_bounds_torch, top_pages
from .tables import select_pages


@dataclass
class ReadResult:
    """``out`` [B, Hq, q, d] in the query's dtype; ``lse`` [B, Hq, q] float32 (None when the exact
    SDPA path ran and nobody asked for it); ``col_sums`` [B, H, L] float32: Σ over the queries of
    each entry's attention weight, mean over the GQA group, before the summary merge (zeros on
    entries a selection left out); ``weights`` [B, H, G, L] float32, asked for one decoding query per row: each
    entry's weight per query head (``decode_weights``), before the summary merge."""

    out: torch.Tensor
    lse: torch.Tensor | None = None
    col_sums: torch.Tensor | None = None
    weights: torch.Tensor | None = None


def read(query: torch.Tensor, query_positions: torch.Tensor, view: KVView, scaling: float, select: torch.Tensor | None = None,
         col_sums: bool = False, need_lse: bool = False, reference: bool = False, weights: bool = False) -> ReadResult:
    """Attend queries [B, Hq, q, d] at positions [B, q] to the view's entries.

    ``select`` [B, H, k] (int64): per KV head, the indices (into the view's L) of the entries to
    read, -1 for none; the rest are skipped (dynamic selection). ``reference=True`` runs the
    float32 oracle. ``weights``: each entry's weight too (one decoding query per row).
    """
    if weights and query.shape[2] != 1:
        raise ValueError("read: per-entry weights are for one decoding query per row")
    full_length = view.shape[2]
    if query.shape[2] == 1 and not reference and view.pages is not None:  # a decoding step: read in place
        out, lse, sums, per_entry = read_paged(query, view, scaling, col_sums, weights, select)
        return ReadResult(out, lse, _in_view(sums, select, full_length), _in_view(per_entry, select, full_length))
    if select is not None:
        view = view.select(select)
    if weights:  # not in place: the reference's weights, beside the read
        result = read(query, query_positions, view, scaling, col_sums=col_sums, need_lse=need_lse, reference=reference)
        per_entry = decode_weights(query, query_positions, view, scaling, reference)
        return ReadResult(result.out, result.lse, _in_view(result.col_sums, select, full_length), _in_view(per_entry, select, full_length))
    if reference:
        out, lse, sums = read_reference(query, query_positions, view, scaling, col_sums)
        out = out.to(query.dtype)
    elif select is None and view.uniform and view.log_weights is None and view.summary is None and not (col_sums or need_lse):
        return ReadResult(read_exact(query, query_positions, view, scaling))
    else:
        out, lse, sums = read_masked(query, query_positions, view, scaling, col_sums)
    return ReadResult(out, lse, _in_view(sums, select, full_length))


def _in_view(values: torch.Tensor | None, select: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """A selection's per-entry values ([B, H, k] column sums, or [B, H, G, k] weights) back in the view's ``length``
    columns (0 on the others)."""
    if values is None or select is None:
        return values
    index = select if values.dim() == 3 else select[:, :, None].expand_as(values)
    return torch.zeros(*values.shape[:-1], length, dtype=values.dtype, device=values.device).scatter_add(
        -1, index.clamp(min=0), values.masked_fill(index < 0, 0.0))


def read_paged(query: torch.Tensor, view: KVView, scaling: float, col_sums: bool = False, weights: bool = False,
               select: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One decoding query per row [B, Hq, 1, d] over the entries where they live (``view.pages``; with ``select``
    [B, H, k], only those columns: ``select_pages``), the summary merged: (out [B, Hq, 1, d], lse [B, Hq, 1] float32,
    the column sums [B, H, L] if asked, each entry's weight [B, H, G, L] if asked), both before the summary merge and
    over the columns read (L = k with a selection): the sums are the weights' mean over the GQA group."""
    pages = view.pages if select is None else select_pages(view.pages, select)
    length = view.shape[2] if select is None else select.shape[2]
    out, lse, logits = _read_pages(query, pages, length, scaling, col_sums or weights)
    sums = per_head = None
    heads = view.shape[1]
    group = query.shape[1] // heads
    if weights:
        per_head = entry_weights(logits, lse, group, mean=False).view(query.shape[0], heads, group, length)
        sums = per_head.mean(dim=2) if col_sums else None
    elif col_sums:
        sums = entry_weights(logits, lse, group, mean=True)
    out, lse = out[:, :, None], lse[:, :, None]
    if view.summary is not None:
        out, lse = merge_summary(query, out, lse, view.summary, heads, scaling)
    return out, lse, sums, per_head


def _read_pages(query: torch.Tensor, pages: Pages, length: int, scaling: float, logits: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The paged read of one decoding query per row [B, Hq, 1, d] over ``length`` columns, without the summary: out
    [B, Hq, d], lse [B, Hq] float32 and, if asked, each entry's logit [B, Hq, L] as the read filled them in (-inf on
    holes and padding: ``entry_weights`` makes them weights)."""
    keys, values, coded = pages.arrays()
    rows, hq = query.shape[0], query.shape[1]
    scores = torch.full((rows, hq, length), -math.inf, device=query.device) if logits else None
    out, lse = paged_decode(query[:, :, 0], keys, values, pages.tables, pages.lengths, pages.log_weights, scaling, coded, scores, length)
    return out, lse, scores


def decode_weights(query: torch.Tensor, query_positions: torch.Tensor, view: KVView, scaling: float,
                   reference: bool = False) -> torch.Tensor:
    """Each entry's attention weight [B, H, G, L] (float32) for one decoding query per row [B, Hq, 1, d] at
    positions [B, 1], log-weights included, before the summary merge, 0 on padding: from the logits of the read
    in place where the view's entries live (``view.pages``), else (or ``reference``) from the float32 reference's."""
    b, hq, _, _ = query.shape
    heads, length = view.shape[1], view.shape[2]
    if view.pages is not None and not reference:
        _, lse, logits = _read_pages(query, view.pages, length, scaling, True)
        return entry_weights(logits, lse, hq // heads, mean=False).view(b, heads, hq // heads, length)
    logits = masked_logits(group_queries(query, heads), view.keys, scaling, query_positions, view.positions, view.valid,
                           view.log_weights)
    return torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)[:, :, :, 0]


__all__ = [
    "ReadResult",
    "attend_reference",
    "attend_with_max_weights",
    "attention_probs",
    "chunk_attention",
    "decode_weights",
    "group_queries",
    "merge_lse",
    "page_bounds_torch",
    "prompt_attention",
    "prompt_attention_with_sums",
    "read",
    "replay_attention",
    "top_pages",
]
