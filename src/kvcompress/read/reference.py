"""The reference read: plain PyTorch in float32, the oracle every fast path is tested against.

    logits τ·qᵀk + log w (hidden where a key comes after the query, by original position)
    → softmax → output, log-sum-exp → merge a summary of what left through log-sum-exp

Shapes: B batch, H KV heads, G query heads per KV head (GQA group), q queries, L entries
per head, d head dim. Queries are grouped [B, H, G, q, d]: query head h·G + g serves KV
head h, as transformers' ``repeat_kv``.
"""

from __future__ import annotations

import torch

from ..store.view import KVView, Summary


def group_queries(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Hq, q, d] → [B, H, G, q, d] (query head h·G + g serves KV head h, as repeat_kv)."""
    b, hq, q, d = query.shape
    return query.view(b, num_kv_heads, hq // num_kv_heads, q, d)


def merge_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax attentions over disjoint entry sets (log domain).

    ``o = (e^{lse_a} o_a + e^{lse_b} o_b) / (e^{lse_a} + e^{lse_b})``: each side weighed by
    e^{lse_side − lse}, lse = log(e^{lse_a} + e^{lse_b}) taken by ``logaddexp`` (nothing overflows);
    an empty side (``lse = -inf``) contributes 0.
    """
    lse = torch.logaddexp(lse_a, lse_b)  # -inf where both sides are empty
    shift = lse.nan_to_num(neginf=0.0)
    w_a, w_b = torch.exp(lse_a - shift), torch.exp(lse_b - shift)  # each side's share; 0 on an empty side
    return torch.nan_to_num(out_a) * w_a[..., None] + torch.nan_to_num(out_b) * w_b[..., None], lse


def summary_attend(summary: Summary, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A summary's read of grouped queries [B, H, G, q, d]: (out [B, H, G, q, d], lse [B, H, G, q]) float32, from
    its affine map (``Summary.readout``)."""
    matrix, bias = summary.readout(scaling)
    both = torch.einsum("bhed,bhgqd->bhgqe", matrix, query.float()) + bias[:, :, None, None, :]
    return both[..., :-1], both[..., -1]


def masked_logits(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor | None = None,
    log_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 logits [B, H, G, q, L] = τ·qᵀk (+ log-weight), -inf where a key is hidden.

    A key is hidden from a query when it is padding or comes after it (by original position).
    """
    logits = torch.einsum("bhgqd,bhld->bhgql", query.float(), keys.float()) * scaling
    if log_weights is not None:
        logits = logits + log_weights.float()[:, :, None, None, :]
    visible = key_positions[:, :, None, None, :] <= query_positions[:, None, None, :, None]
    if key_valid is not None:
        visible = visible & key_valid[:, :, None, None, :]
    return logits.masked_fill(~visible, float("-inf"))


def attend_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    *,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor | None = None,
    log_weights: torch.Tensor | None = None,
    summary: Summary | None = None,
    return_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Attention of grouped queries over entries, in float32.

    Args:
        query: [B, H, G, q, d]. keys, values: [B, H, L, d].
        query_positions: [B, q]. key_positions: [B, H, L].
        key_valid: [B, H, L] bool, False on padding of ragged heads (None = all valid).
        log_weights: [B, H, L] float, added to the logits (KeepKV votes: log p).
        summary: merged through log-sum-exp after attending the entries.
    Returns:
        out [B, H, G, q, d] float32, lse [B, H, G, q] float32 and, if asked, the
        probabilities over the entries [B, H, G, q, L] (before the summary merge).
    """
    logits = masked_logits(query, keys, scaling, query_positions, key_positions, key_valid, log_weights)
    lse = torch.logsumexp(logits, dim=-1)
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(logits - safe_lse.unsqueeze(-1))  # exp(-inf) = 0 on hidden entries
    out = torch.einsum("bhgql,bhld->bhgqd", probs, values.float())
    if summary is not None:
        out_s, lse_s = summary_attend(summary, query, scaling)
        out, lse = merge_lse(out, lse, out_s, lse_s)
    return out, lse, (probs if return_probs else None)


def attention_probs(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax weights [B, H, G, q, L] (float32) of grouped queries over entries; 0 where hidden."""
    logits = masked_logits(query, keys, scaling, query_positions, key_positions, key_valid)
    return torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)


def read_reference(
    query: torch.Tensor, query_positions: torch.Tensor, view: KVView, scaling: float, col_sums: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The read over a view in float32: output [B, Hq, q, d], lse [B, Hq, q] and, if asked, the
    column sums [B, H, L] (Σ over the queries of each entry's weight, mean over the GQA group,
    before the summary merge)."""
    b, hq, q, d = query.shape
    heads = view.shape[1]
    out, lse, probs = attend_reference(
        group_queries(query, heads), view.keys, view.values, scaling,
        query_positions=query_positions, key_positions=view.positions, key_valid=view.valid,
        log_weights=view.log_weights, summary=view.summary, return_probs=col_sums,
    )
    sums = probs.sum(dim=3).mean(dim=2) if col_sums else None
    return out.reshape(b, hq, q, d), lse.reshape(b, hq, q), sums


def attend_with_max_weights(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor | None,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
    block: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New tokens attending to held entries and, causally, to themselves, in float32 (KVzip's replay).

    Args:
        query: [B, Hq, q, d] at ``query_positions`` [B, q]; ``new_keys``/``new_values`` [B, H, q, d] are
            theirs, at the same positions. keys, values: [B, H, L, d] held entries at ``key_positions``
            [B, H, L] (``key_valid`` [B, H, L], None = all real).
        block: queries per block (memory: B·Hq·block·(L + q) floats at a time).
    Returns:
        out [B, Hq, q, d] float32 (the attention output over held + new entries) and the largest
        weight any query of a KV head's group gives each held entry, [B, H, L] float32 (softmax over
        everything the query sees).
    """
    b, hq, q, d = query.shape
    heads = keys.shape[1]
    new_positions = query_positions[:, None, :].expand(b, heads, q)
    all_keys, all_values = torch.cat([keys, new_keys], dim=2), torch.cat([values, new_values], dim=2)
    all_positions = torch.cat([key_positions, new_positions], dim=2)
    all_valid = None
    if key_valid is not None:
        all_valid = torch.cat([key_valid, torch.ones_like(new_positions, dtype=torch.bool)], dim=2)
    grouped = group_queries(query, heads)
    outs, best = [], torch.zeros(b, heads, keys.shape[2], dtype=torch.float32, device=keys.device)
    for start in range(0, q, block):
        part = slice(start, start + block)
        logits = masked_logits(grouped[:, :, :, part], all_keys, scaling, query_positions[:, part], all_positions, all_valid)
        probs = torch.softmax(logits, dim=-1)  # every query sees itself, so no row is empty
        outs.append(torch.einsum("bhgql,bhld->bhgqd", probs, all_values.float()))
        best = torch.maximum(best, probs[..., : keys.shape[2]].amax(dim=(2, 3)))
    return torch.cat(outs, dim=3).reshape(b, hq, q, d), best


__all__ = ["attend_reference", "attend_with_max_weights", "attention_probs", "group_queries", "masked_logits", "merge_lse",
           "read_reference", "summary_attend"]
