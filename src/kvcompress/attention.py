"""The attention read path over a compressed layer.

    select entries → materialize them → attend with per-entry log-weights
    → merge a summary of what left through log-sum-exp

Two implementations of the same function:

* ``attend_reference``: plain PyTorch, float32 accumulation, returns the log-sum-exp
  (and optionally the attention probabilities that scoring methods read). It handles
  everything: ragged heads (a validity mask), log-weights, a summary term.
* the fast path in ``read``: transformers' own SDPA call, used when the layer is
  uncompressed-looking (no log-weights, no summary, every head the same length), so that
  the ``full`` method (and any method at ratio 1.0) reproduces ``model.generate`` token for
  token. Methods that read the weights get them from ``attention_probs`` beside it. Tests
  check that the two paths agree.

Causality is decided by original token positions (a key is visible to a query when its
position is not after the query's), so new tokens appended behind an evicted prefix need
no mask bookkeeping.

Shapes: B batch, H KV heads, G query heads per KV head (GQA group), q new queries,
L entries per head (padded to the longest head only while attending), d head dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

if TYPE_CHECKING:
    from .cache import LayerCache


class Summary(Protocol):
    """A per-head summary of evicted entries that contributes to attention (e.g. MomentKV).

    ``attend`` returns the summary's output and log partition function for each query:
    ``out`` [B, H, G, q, d] float32 and ``lse`` [B, H, G, q] float32 (``-inf`` = empty).
    """

    def attend(self, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def nbytes(self) -> int: ...


def merge_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax attentions over disjoint entry sets (log domain).

    ``o = (e^{lse_a} o_a + e^{lse_b} o_b) / (e^{lse_a} + e^{lse_b})``, computed with the
    running max so that nothing overflows; an empty side (``lse = -inf``) contributes 0.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    w_a = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse)).unsqueeze(-1)
    w_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse)).unsqueeze(-1)
    out = w_a * torch.nan_to_num(out_a) + w_b * torch.nan_to_num(out_b)
    return out, lse


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
    """Attention of grouped queries over retained entries, in float32.

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
        out_s, lse_s = summary.attend(query.float(), scaling)
        out, lse = merge_lse(out, lse, out_s, lse_s)
    return out, lse, (probs if return_probs else None)


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


def group_queries(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Hq, q, d] → [B, H, G, q, d] (query head h·G + g serves KV head h, as repeat_kv)."""
    b, hq, q, d = query.shape
    return query.view(b, num_kv_heads, hq // num_kv_heads, q, d)


def read(
    module: torch.nn.Module,
    layer: LayerCache,
    query: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
    return_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attend new queries [B, Hq, q, d] to everything the layer holds.

    Returns the attention output in transformers' layout [B, q, Hq, d] and, if asked, the
    probabilities over the layer's entries [B, H, G, q, L] on the padded view.
    """
    view = layer.padded_view()
    grouped = group_queries(query, layer.num_kv_heads)
    if layer.log_weights is None and layer.summary is None and view.valid is None:
        out = _read_sdpa(module, query, query_positions, view.keys, view.values, view.positions, scaling)
        probs = None
        if return_probs:  # scoring methods read the weights; the output stays SDPA's (exactness of ratio 1.0)
            probs = attention_probs(grouped, view.keys, scaling, query_positions, view.positions)
        return out, probs
    out, _, probs = attend_reference(
        grouped,
        view.keys,
        view.values,
        scaling,
        query_positions=query_positions,
        key_positions=view.positions,
        key_valid=view.valid,
        log_weights=layer.padded(layer.log_weights) if layer.log_weights is not None else None,
        summary=layer.summary,
        return_probs=return_probs,
    )
    b, h, g, q, d = out.shape
    out = out.reshape(b, h * g, q, d).transpose(1, 2).to(query.dtype)
    return out, probs


def _read_sdpa(module, query, query_positions, keys, values, key_positions, scaling) -> torch.Tensor:
    """transformers' SDPA over a uniform layer; a causal mask only when several queries arrive."""
    mask = None
    if query.shape[2] > 1:
        # heads may hold different positions: a per-head mask, repeated over each GQA group
        mask = key_positions[:, :, None, :] <= query_positions[:, None, :, None]  # [B, H, q, L]
        mask = mask.repeat_interleave(query.shape[1] // keys.shape[1], dim=1)
    out, _ = sdpa_attention_forward(module, query, keys, values, mask, dropout=0.0, scaling=scaling)
    return out
