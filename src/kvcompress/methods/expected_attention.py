"""Expected Attention (Devoto, Jeblick and Jégou 2025, "Expected Attention: KV Cache Compression by
Estimating Attention from Future Queries Distribution"; kvpress's ``ExpectedAttentionPress``).

A query-agnostic scorer (METHODS.md, "Query-agnostic scorers and threshold sizing"): the next
queries of a query head are modelled as a Gaussian q ~ N(μ, Σ) and each entry is scored by the
attention they are expected to pay it. With the prompt's queries before RoPE, per query head:

1. μ, Σ: their mean and (population, ÷N) covariance;
2. R̄ = (1/n) Σ_{t=s+1…s+n} R_t, RoPE's rotation averaged over the next n = ``future`` positions
   after the last prompt position s; μ̄ = R̄ μ, Σ̄ = R̄ Σ R̄ᵀ;
3. the expected unnormalised weight of key k: E[exp(τ qᵀk)] = exp(τ μ̄ᵀk + τ² kᵀΣ̄k / 2), i.e.
   exp(μ̄·k/√d + kᵀΣ̄k/(2d)) for the usual τ = 1/√d (the model's own scaling is used);
4. normalised over each query head's keys (a softmax in the log domain, float32), averaged over
   the query heads of the KV head's GQA group;
5. weighted by the value's L2 norm, (a + ε)·‖v‖ (``use_vnorm``, ``epsilon``), as kvpress does.

RoPE convention. The held keys are post-RoPE, each rotated at its own position j. A query at a
future position t reads (R_t q)·(R_j k), so the mean query rotated to absolute future positions
and averaged, R̄ μ, is compared with the post-RoPE keys as they are: E_t[(R_t q)·k_j] = (R̄ q)·k_j.
The statistics must therefore be those of queries *before* RoPE (each recorded query was rotated
at its own position): the prefill records post-RoPE queries (``window_queries``), and each is
rotated back at its own position with the model's rotary embedding (``context.rotary``):
q = (q_rot·cos − rotate_half(q_rot)·sin) / (cos² + sin²), exact for transformers' layout (the
division undoes a rotary ``attention_scaling``). On Qwen3 these are the queries after the per-head
q-norm, as kvpress's. R̄ uses transformers' ``q·cos + rotate_half(q)·sin`` with cos and sin averaged
over the future positions (``rotary.py``, shared with GVote), which is kvpress's
averaged matrix cos·I + sin·P.

Checked against kvpress 0.5.4 (``kvpress/presses/expected_attention_press.py``), whose defaults
these are: ``n_future_positions=512`` (``future``), ``n_sink=4`` (``sinks``), ``use_covariance=True``,
``use_vnorm=True``, ``epsilon=0.0`` (kvpress's evaluation registry runs it as
``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))``: ``expected_attention:epsilon=0.01+adaptive`` here).
Where this differs from kvpress's code:

* kvpress projects every prompt hidden state but the first ``n_sink`` through W_q; this rotates
  back the recorded queries, the same vectors up to rounding. ``window=None`` (default) uses every
  prompt query but those at positions < ``sinks`` (kvpress's statistics); ``window=w`` only the
  last w (SnapKV's observation window). Padding queries of left-padded rows are left out.
* the future positions start after each row's last real position (kvpress: after ``q_len``, the
  same for an unpadded row).
* kvpress drops the ``n_sink`` first keys before the softmax and pads their scores with the
  maximum + 1; here they are protected (the scorer's ``sinks``) and likewise left out of the softmax.
* ``window=None`` asks the prefill to record every query (``Needs.window`` = MAX_BUDGET): a
  shared prefill (``CompressedCache.shared``) then records them for every method it serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers.models.llama.modeling_llama import rotate_half

from .budget import MAX_BUDGET
from .parts import Needs, Scorer
from .rotary import apply_rotary, averaged_rotary
from .selection import sink_mask

STATS_CHUNK = 2048  # queries rotated back at a time (bounds the float32 copies of a long prompt)


def unrotate_queries(queries: torch.Tensor, positions: torch.Tensor, rotary: torch.nn.Module) -> torch.Tensor:
    """Pre-RoPE queries [B, Hq, w, d] float32 from post-RoPE ``queries`` [B, Hq, w, d] at ``positions`` [B, w]:
    the inverse of transformers' ``q·cos + rotate_half(q)·sin`` at each query's own position."""
    q = queries.float()
    cos, sin = rotary(q, positions.long().to(q.device))  # [B, w, d]
    if cos.shape[-1] != q.shape[-1]:
        raise ValueError(f"expected_attention needs RoPE over the whole head ({q.shape[-1]} channels); this model rotates "
                         f"{cos.shape[-1]}")
    cos, sin = cos.float()[:, None], sin.float()[:, None]
    return (q * cos - rotate_half(q) * sin) / (cos * cos + sin * sin)


def query_statistics(queries: torch.Tensor, positions: torch.Tensor, use: torch.Tensor, rotary: torch.nn.Module,
                     covariance: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean [B, Hq, d] and population covariance [B, Hq, d, d] (float32; None unless ``covariance``) of the
    pre-RoPE queries marked in ``use`` [B, w] (two passes over chunks of the window: no w × d² buffer)."""
    b, hq, w, d = queries.shape
    weight = use.float().to(queries.device)
    count = weight.sum(-1).clamp(min=1.0)[:, None, None]  # a row with no query: μ = 0, Σ = 0 (uniform scores)
    chunks = [(s, min(w, s + STATS_CHUNK)) for s in range(0, w, STATS_CHUNK)]

    def pre_rope(s: int, e: int) -> torch.Tensor:
        return unrotate_queries(queries[:, :, s:e], positions[:, s:e], rotary) * weight[:, None, s:e, None]

    mean = torch.zeros(b, hq, d, dtype=torch.float32, device=queries.device)
    for s, e in chunks:
        mean += pre_rope(s, e).sum(dim=2)
    mean /= count
    if not covariance:
        return mean, None
    cov = torch.zeros(b, hq, d, d, dtype=torch.float32, device=queries.device)
    for s, e in chunks:
        centered = (pre_rope(s, e) - mean[:, :, None]) * weight[:, None, s:e, None]
        cov += centered.transpose(-1, -2) @ centered
    return mean, cov / count[..., None]


def averaged_rotation(rotary: torch.nn.Module, start: torch.Tensor, count: int, like: torch.Tensor) -> torch.Tensor:
    """R̄ᵀ [B, 1, d, d] float32: the transpose of RoPE's rotation averaged over positions ``start[b] … start[b] + count − 1``
    (row i is R̄ e_i), so that μ @ R̄ᵀ = R̄ μ."""
    cos, sin = averaged_rotary(rotary, start, count, like)
    d = like.shape[-1]
    eye = torch.eye(d, dtype=torch.float32, device=like.device).expand(cos.shape[0], 1, d, d)
    return apply_rotary(eye, cos, sin)


def expected_log_weights(mean: torch.Tensor, cov: torch.Tensor | None, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """log E[exp(τ qᵀk)] = τ μᵀk + τ² kᵀΣk / 2 for grouped means [B, H, G, d], covariances [B, H, G, d, d] (or None)
    and keys [B, H, L, d]: [B, H, G, L] float32."""
    keys = keys.float()
    logits = torch.einsum("bhgd,bhld->bhgl", mean, keys) * scaling
    if cov is not None:
        quadratic = torch.stack([((keys @ cov[:, :, g]) * keys).sum(-1) for g in range(cov.shape[2])], dim=2)
        logits = logits + quadratic * (scaling * scaling / 2)
    return logits


@dataclass
class ExpectedAttention(Scorer):
    """Attention expected from future queries modelled as Gaussians (see the module docstring).

    Options: window (the last prompt queries whose statistics model the future ones; None = every
    prompt query but the sinks, kvpress's), future (positions whose RoPE rotation is averaged, 512),
    use_covariance (the τ²kᵀΣk/2 term), use_vnorm (weigh by the value's norm), epsilon (added to the
    attention before the value-norm weighting), plus sinks (4, kvpress's ``n_sink``: protected, and left
    out of the statistics and the normalisation) and chunk_size.
    """

    window: int | None = None
    future: int = 512
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    sinks: int = 4

    name: ClassVar[str] = "expected_attention"
    about: ClassVar[str] = "attention expected from future queries modelled as Gaussians (Expected Attention)"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be ≥ 1 (or None: every prompt query), got {self.window}")
        if self.future < 1:
            raise ValueError(f"future (positions whose rotation is averaged) must be ≥ 1, got {self.future}")
        if self.epsilon < 0:
            raise ValueError(f"epsilon must be ≥ 0, got {self.epsilon}")

    def needs(self) -> Needs:
        return Needs(window=MAX_BUDGET if self.window is None else self.window)

    @torch.no_grad()
    def future_query_stats(self, view, context) -> tuple[torch.Tensor, torch.Tensor | None]:
        """μ̄ = R̄ μ [B, Hq, d] and Σ̄ = R̄ Σ R̄ᵀ [B, Hq, d, d] (None without ``use_covariance``), float32."""
        obs, rotary = context.observations, context.rotary
        if rotary is None or "window_queries" not in obs:
            raise ValueError("expected_attention needs the prefill's queries and the model's rotary embedding: compress "
                             "through CompressedCache")
        queries, positions = obs["window_queries"], obs["window_positions"].to(obs["window_queries"].device)
        if self.window is not None:
            queries, positions = queries[:, :, -self.window :], positions[:, -self.window :]
        w = queries.shape[2]
        real = torch.arange(w, device=queries.device)[None, :] >= w - context.tokens_seen.to(queries.device)[:, None]
        use = real & (positions >= self.sinks)  # left padding comes first; sinks are outliers (kvpress)
        mean, cov = query_statistics(queries, positions, use, rotary, self.use_covariance)
        rotation_t = averaged_rotation(rotary, positions[:, -1] + 1, self.future, mean)  # R̄ᵀ [B, 1, d, d]
        mean = (mean[:, :, None] @ rotation_t)[:, :, 0]
        if cov is not None:
            cov = rotation_t.transpose(-1, -2) @ cov @ rotation_t
        return mean, cov

    def score(self, view, context) -> torch.Tensor:
        b, heads, length, d = view.keys.shape
        mean, cov = self.future_query_stats(view, context)
        groups = mean.shape[1] // heads
        mean = mean.to(view.keys.device).view(b, heads, groups, d)
        cov = None if cov is None else cov.to(view.keys.device).view(b, heads, groups, d, d)
        logits = expected_log_weights(mean, cov, view.keys, context.scaling)
        counted = ~sink_mask(view.positions, None, self.sinks)  # sinks are kept anyway: not in the normalisation
        if view.valid is not None:
            counted = counted & view.valid
        logits = logits.masked_fill(~counted[:, :, None, :], float("-inf"))
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0.0))  # 0 where not counted
        scores = probs.mean(dim=2)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * view.values.float().norm(dim=-1)
        return scores.masked_fill(~counted, 0.0)


__all__ = ["ExpectedAttention", "averaged_rotation", "expected_log_weights", "query_statistics", "unrotate_queries"]
