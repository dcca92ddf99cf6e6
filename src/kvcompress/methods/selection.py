"""Selection as plain tensor functions, tested against plain references: what the parts share.

    scores → chunk averaging (optional) → priority (protected entries first)
    → per-layer sizes (uniform, pyramid, or one global budget over every layer and head)
    → per-head sizes (uniform or Ada-KV) → top entries per head → a keep mask
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

PROTECTED_PRIORITY = 1e15  # above any attention score; protected entries rank by recency above it


def chunk_average(scores: torch.Tensor, valid: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """Replace each score [B, H, L] by the mean over its chunk of ``chunk`` adjacent entries.

    Selecting by chunk means keeps whole chunks (MomentKV's protocol, chunks of 4).
    """
    if chunk <= 1:
        return scores
    b, h, length = scores.shape
    pad = (-length) % chunk
    mask = torch.ones_like(scores) if valid is None else valid.float()
    padded = F.pad(scores * mask, (0, pad)).view(b, h, -1, chunk)
    counts = F.pad(mask, (0, pad)).view(b, h, -1, chunk).sum(-1, keepdim=True).clamp(min=1)
    means = (padded.sum(-1, keepdim=True) / counts).expand(-1, -1, -1, chunk)
    return means.reshape(b, h, -1)[..., :length]


def priority(
    scores: torch.Tensor, protected: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None
) -> torch.Tensor:
    """float64 ranking key: protected entries first (most recent first), then by score; padding last."""
    key = scores.double()
    key = torch.where(protected, PROTECTED_PRIORITY + positions.double(), key)
    if valid is not None:
        key = key.masked_fill(~valid, float("-inf"))
    return key


def plus_protected(sizes: torch.Tensor, protected: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, H]: sizes chosen elsewhere (a global plan, GVote) plus the entries this method always keeps
    (its window, sinks), capped at what each head holds (``lengths`` [B, H]). Without the addition a
    head that GVote sizes below the window would keep only the window and lose its attention sink."""
    return torch.minimum(sizes.to(protected.device) + protected.sum(dim=-1), lengths.to(protected.device))


def global_sizes(keys: Sequence[torch.Tensor], totals: torch.Tensor) -> list[torch.Tensor]:
    """One budget over every layer and head: per layer [B, H], how many of each head's unprotected
    entries are among the row's ``totals[b]`` best over all layers and heads.

    ``keys``: per layer the ranking key [B, H, L] (protected entries ≥ PROTECTED_PRIORITY, padding
    -inf); ``totals`` [B]: entries kept per row beyond the protected ones."""
    open_keys = [k.masked_fill(k >= PROTECTED_PRIORITY, float("-inf")) for k in keys]
    flat = torch.cat([k.reshape(k.shape[0], -1) for k in open_keys], dim=1)  # [B, Σ H·L]
    winners = torch.stack([_top_mask(row, int(total)) for row, total in zip(flat, totals)])
    sizes, start = [], 0
    for k in open_keys:
        count = k.shape[1] * k.shape[2]
        sizes.append(winners[:, start : start + count].view(k.shape).sum(dim=-1).cpu())
        start += count
    return sizes


def _top_mask(key: torch.Tensor, take: int) -> torch.Tensor:
    """bool mask of the ``take`` highest of ``key`` (1-D), never a -inf one (padding, protected). Where most of
    the finite keys win (a decoding step's re-rank drops a few), the losers are found instead: the smallest of n
    keys cost less to find than the largest."""
    finite = torch.isfinite(key).nonzero().squeeze(1)
    candidates = key[finite]
    take = min(take, finite.numel())
    mask = torch.zeros_like(key, dtype=torch.bool)
    if 2 * take <= finite.numel():
        return mask.index_fill_(0, finite[torch.topk(candidates, take).indices], True)
    losers = finite[torch.topk(candidates, finite.numel() - take, largest=False).indices]
    return mask.index_fill_(0, finite, True).index_fill_(0, losers, False)


def top_per_head(key: torch.Tensor, head_budgets: torch.Tensor) -> torch.Tensor:
    """Keep mask [B, H, L]: the ``head_budgets[b, h]`` entries with the highest key per head (of equal keys, the
    earlier ones), never a -inf one."""
    finite = torch.isfinite(key)
    drop = (finite.sum(-1) - head_budgets.to(key.device)).clamp(min=0)  # [B, H]
    most = int(drop.max()) if drop.numel() else 0
    if 8 * most <= key.shape[-1]:  # a decoding step's eviction drops a few entries per head: find those
        return finite & ~_lowest_per_head(key.masked_fill(~finite, math.inf), drop, most)
    order = key.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(key.shape[-1], device=key.device).expand_as(order))
    return (rank < head_budgets[..., None].to(rank.device)) & torch.isfinite(key)


def _lowest_per_head(key: torch.Tensor, drop: torch.Tensor, most: int) -> torch.Tensor:
    """Mask [B, H, L] of the ``drop[b, h]`` (≤ ``most``) lowest keys per head, of equal keys the later ones: what a
    stable descending sort ranks last."""
    if most == 0:
        return torch.zeros_like(key, dtype=torch.bool)
    lowest = key.topk(most, dim=-1, largest=False).values  # ascending
    threshold = lowest.gather(-1, (drop - 1).clamp(min=0)[..., None])  # the drop-th lowest
    below, tied = key < threshold, key == threshold
    from_tied = (drop - below.sum(-1))[..., None]  # how many of the tied ones go: the last of them
    tied_from_end = tied.flip(-1).cumsum(-1).flip(-1)
    return (below | (tied & (tied_from_end <= from_tied))) & (drop > 0)[..., None]


def round_preserving_sum(values: torch.Tensor, total: int, cap: torch.Tensor) -> torch.Tensor:
    """Integers close to ``values`` (float, 1-D) that sum to ``total`` and stay ≤ ``cap`` (largest remainder)."""
    base = torch.minimum(values.floor().long(), cap)
    remainder = values - values.floor()
    missing = int(total - base.sum())
    room = cap - base
    order = torch.argsort(remainder, descending=True, stable=True)
    while missing > 0 and bool((room > 0).any()):
        for i in order.tolist():
            if missing == 0:
                break
            if room[i] > 0:
                base[i] += 1
                room[i] -= 1
                missing -= 1
    return base


def adaptive_head_budgets(key: torch.Tensor, layer_budget: torch.Tensor, alpha: float, lengths: torch.Tensor) -> torch.Tensor:
    """Ada-KV's head-wise allocation inside a layer: [B, H] budgets summing to H × layer_budget[b].

    Flatten the heads' ranking keys, take the global top H·B, count winners per head c_h,
    and give each head b_h = α·B + (1 − α)·c_h (METHODS.md, "Ada-KV"), rounded so the sum is
    exact and no head gets more than it holds.
    """
    b, h, length = key.shape
    budgets = torch.zeros(b, h, dtype=torch.long)
    for row in range(b):
        total = int(layer_budget[row]) * h
        flat = key[row].reshape(-1)
        take = min(total, int(torch.isfinite(flat).sum()))
        winners = torch.topk(flat, take).indices // length
        counts = torch.bincount(winners.cpu(), minlength=h).double()
        share = alpha * float(layer_budget[row]) + (1 - alpha) * counts
        budgets[row] = round_preserving_sum(share, min(total, int(lengths[row].sum())), lengths[row].cpu())
    return budgets


def pyramid_layer_budgets(mean_budget: int, num_layers: int, first_to_last: float, cap: int) -> list[int]:
    """PyramidKV: budgets falling linearly from the first layer to the last, averaging ``mean_budget``.

    ``first_to_last`` is the ratio of the first layer's budget to the last's (default 4). Layers
    capped at ``cap`` (the context) hand their excess to the others so the mean is kept.
    """
    if num_layers == 1:
        return [min(mean_budget, cap)]
    last = 2 * mean_budget / (1 + first_to_last)
    first = first_to_last * last
    raw = torch.tensor([first + (last - first) * i / (num_layers - 1) for i in range(num_layers)], dtype=torch.float64)
    total = min(mean_budget * num_layers, cap * num_layers)
    capped = torch.full((num_layers,), cap, dtype=torch.long)
    for _ in range(num_layers):  # water-fill: pour what capped layers cannot hold into the rest
        over = raw > cap
        if not bool(over.any()):
            break
        excess = float((raw[over] - cap).sum())
        raw[over] = float(cap)
        free = raw < cap
        raw[free] += excess * raw[free] / raw[free].sum()
    return round_preserving_sum(raw, total, capped).tolist()


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """1-D pooling over positions of [..., L] scores (SnapKV's smoothing), same length out."""
    if kernel <= 1:
        return scores
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    if pooling == "max":
        out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    elif pooling == "avg":
        out = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)  # zero-padded, as SnapKV and kvpress
    else:
        raise ValueError(f"pooling must be 'max' or 'avg', got {pooling!r}")
    return out[..., : shape[-1]].reshape(shape)


def recent_mask(positions: torch.Tensor, valid: torch.Tensor | None, count: torch.Tensor) -> torch.Tensor:
    """True on each row's ``count[b]`` most recent tokens (by position), for every head: [B, H, L]."""
    pos = positions if valid is None else positions.masked_fill(~valid, -1)
    newest = pos.amax(dim=(1, 2))  # [B]
    threshold = newest - count.to(pos.device) + 1
    mask = pos >= threshold[:, None, None]
    return mask if valid is None else mask & valid


def sink_mask(positions: torch.Tensor, valid: torch.Tensor | None, sinks: int) -> torch.Tensor:
    """True on the first ``sinks`` positions of each row (attention sinks)."""
    mask = positions < sinks
    return mask if valid is None else mask & valid


def true_columns(mask: torch.Tensor) -> torch.Tensor:
    """Indices [..., k] of each row's True entries of ``mask`` [..., L], in order, -1 after them (k: the most True
    entries of any row, at least 1): a selection's read index. A running count places each entry (no sort)."""
    k = max(int(mask.sum(-1).max()) if mask.numel() else 0, 1)
    place = torch.where(mask, mask.cumsum(-1) - 1, k)  # unread entries all go to a spare column k, cut below
    columns = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    index = torch.full((*mask.shape[:-1], k + 1), -1, dtype=torch.long, device=mask.device)
    return index.scatter_(-1, place, columns)[..., :k]


__all__ = [
    "PROTECTED_PRIORITY",
    "adaptive_head_budgets",
    "chunk_average",
    "global_sizes",
    "plus_protected",
    "pool_scores",
    "priority",
    "pyramid_layer_budgets",
    "recent_mask",
    "round_preserving_sum",
    "sink_mask",
    "top_per_head",
    "true_columns",
]
