"""MomentKV (seeds/000: "MomentKV: Closing the Directional Gap in KV Cache Eviction").

Evicted entries are not forgotten: each KV head keeps four running sums of what left —
count m, key sum, value sum and value-key outer-product sum, in float32 (METHODS.md,
"MomentKV", eq. 25). At query time they give a first-order estimate of the evicted
sub-output ô_E(q) = μ_v + τ·C·q (eq. 9) and a Jensen estimate of its log partition function
log Ẑ_E = log m + τ·qᵀμ_k (eq. 11), merged with the retained attention through
log-sum-exp (eq. 12, 37): the normalization-corrected output. Eviction is moment-informed:
entry i scores a_i·‖r_i‖ with the moment residual r_i = v_i − ô_E(k_i) (eq. 10), so entries
the moments already explain leave first. Prefill eviction runs in rounds so residuals see
the moments; decoding evicts back to the budget when the cache overflows by ``slack``.

The ``momentkv`` preset follows the paper's protocol: SnapKV scores over a 32-query window, the
first token kept as a sink, chunks of 4, Ada-KV head-wise budgets, this fate, eviction while decoding
after 32 entries of slack. Ablations are options of the fate: ``correction=False`` (MI only),
``moment_eviction=False`` (NC only), ``order=0`` (ô_E = μ_v), ``centred_residual=True``
(r_i = v_i − μ_v − τ·C·(k_i − μ_k)); ``momentkv+static`` leaves decoding alone. As a fate it folds what
any scorer and sizer drop (``momentkv+gvote+static``: GVote's sizes, MomentKV's choice and moments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..store.view import Edit
from .parts import Fate
from .selection import chunk_average, priority, top_per_head

MOMENTS = "moments"


@dataclass
class Moments:
    """Running sums over the evicted entries of each (batch row, KV head), float32 (eq. 25).

    count [B, H], key_sum [B, H, d], value_sum [B, H, d], value_key_sum [B, H, d, d]: per head
    d² + 2d + 1 floats whatever the context length. Updates replace tensors (never in place),
    so clones of a cache may share them.
    """

    count: torch.Tensor
    key_sum: torch.Tensor
    value_sum: torch.Tensor
    value_key_sum: torch.Tensor
    order: int = 1

    @classmethod
    def empty(cls, batch: int, heads: int, dim: int, device, order: int = 1) -> Moments:
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float32, device=device)  # noqa: E731
        return cls(zeros(batch, heads), zeros(batch, heads, dim), zeros(batch, heads, dim), zeros(batch, heads, dim, dim), order)

    def add(self, keys: torch.Tensor, values: torch.Tensor, evicted: torch.Tensor) -> Moments:
        """Fold the entries marked in ``evicted`` [B, H, L] of keys/values [B, H, L, d] into the sums."""
        weight = evicted.float()
        k, v = keys.float(), values.float()
        row = weight[..., None, :]  # [B, H, 1, L]: sums as matrix products
        return Moments(
            count=self.count + weight.sum(-1),
            key_sum=self.key_sum + (row @ k)[..., 0, :],
            value_sum=self.value_sum + (row @ v)[..., 0, :],
            value_key_sum=self.value_key_sum + (v * weight[..., None]).transpose(-1, -2) @ k,
            order=self.order,
        )

    @classmethod
    def stack(cls, parts: list[Moments]) -> Moments:
        """The moments of several layers as one over their rows (a step of every layer at once)."""
        return cls(*(torch.cat([getattr(m, name) for m in parts]) for name in ("count", "key_sum", "value_sum", "value_key_sum")),
                   order=parts[0].order)

    def rows(self, rows: slice) -> Moments:
        return Moments(self.count[rows], self.key_sum[rows], self.value_sum[rows], self.value_key_sum[rows], self.order)

    def means(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """μ_k, μ_v [B, H, d] and C = S_vk/m − μ_v μ_kᵀ [B, H, d, d] (eq. 24); zeros where m = 0."""
        m = self.count.clamp(min=1.0)
        mu_k = self.key_sum / m[..., None]
        mu_v = self.value_sum / m[..., None]
        cov = self.value_key_sum / m[..., None, None] - mu_v[..., :, None] * mu_k[..., None, :]
        return mu_k, mu_v, cov

    def evicted_output(self, x: torch.Tensor, scaling: float) -> torch.Tensor:
        """ô_E(x) = μ_v + τ·C·x (eq. 9; order 0: μ_v) for x [B, H, ..., d]: one matrix product per head."""
        _, mu_v, cov = self.means()
        b, h, d = mu_v.shape
        mu_v = mu_v.view(b, h, *([1] * (x.dim() - 3)), d)
        if self.order == 0:
            return mu_v.expand_as(x)
        rows = x.float().reshape(b, h, -1, d) @ cov.transpose(-1, -2)  # (C·x)ᵀ = xᵀCᵀ for every x at once
        return mu_v + scaling * rows.view(x.shape)

    def readout(self, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The read as one affine map, computed once per Moments object (they are never changed in
        place): W [B, H, d + 1, d] = [τ·C; τ·μ_kᵀ] and b [B, H, d + 1] = [μ_v; log m], so that
        W·q + b = [ô_E(q); log Ẑ_E(q)] (C = 0 at order 0; log m = -inf where nothing was evicted)."""
        cached = self.__dict__.get("_readout")
        if cached is None or cached[0] != scaling:
            mu_k, mu_v, cov = self.means()
            if self.order == 0:
                cov = torch.zeros_like(cov)
            matrix = torch.cat([cov, mu_k[..., None, :]], dim=-2) * scaling
            bias = torch.cat([mu_v, torch.log(self.count)[..., None]], dim=-1)
            cached = self.__dict__["_readout"] = (scaling, matrix, bias)
        return cached[1], cached[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.count, self.key_sum, self.value_sum, self.value_key_sum))


@dataclass
class MomentKV(Fate):
    """What leaves is folded into per-head moments, merged into every read; eviction moment-informed.

    Options: rounds (prefill eviction rounds, 4), correction (merge the moments into attention),
    moment_eviction (score a_i·‖r_i‖ instead of a_i), order (1 or 0), centred_residual.
    """

    rounds: int = 4
    correction: bool = True
    moment_eviction: bool = True
    order: int = 1
    centred_residual: bool = False

    name: ClassVar[str] = "momentkv"
    about: ClassVar[str] = "fold what leaves into per-head moments read with every query (MomentKV)"

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.order not in (0, 1):
            raise ValueError("rounds must be ≥ 1 and order 0 or 1")

    # ----- scoring --------------------------------------------------------------------------
    def residual_norms(self, keys: torch.Tensor, values: torch.Tensor, moments: Moments, scaling: float) -> torch.Tensor:
        """‖r_i‖ for entries [B, H, L, d] (eq. 10, or its centred variant): [B, H, L]."""
        keys, values = keys.float(), values.float()
        if self.centred_residual:
            mu_k, mu_v, cov = moments.means()
            predicted = mu_v[:, :, None] + scaling * ((keys - mu_k[:, :, None]) @ cov.transpose(-1, -2))
        else:
            predicted = moments.evicted_output(keys, scaling)
        return (values - predicted).norm(dim=-1)

    def eviction_key(self, view, attention: torch.Tensor, moments: Moments, protected, scaling, chunk: int) -> torch.Tensor:
        """Ranking key: a_i·‖r_i‖ (a_i alone while nothing has been evicted), chunk-averaged, protected first."""
        score = attention
        if self.moment_eviction and bool((moments.count > 0).any()):
            has_moments = (moments.count > 0)[..., None]
            score = torch.where(has_moments, attention * self.residual_norms(view.keys, view.values, moments, scaling), attention)
        return priority(chunk_average(score, view.valid, chunk), protected, view.positions, view.valid)

    # ----- prefill --------------------------------------------------------------------------
    def evict(self, policy, view, context, ranking, per_head, budgets) -> Edit:
        """Evict down to ``per_head`` [B, H] in ``rounds`` steps, folding each round's evictions into the moments."""
        b, h, _ = view.shape
        moments = context.state.get(MOMENTS) or Moments.empty(b, h, view.keys.shape[-1], view.keys.device, self.order)
        lengths = view.lengths
        keep = view.valid_or_ones().clone()
        for round_ in range(1, self.rounds + 1):
            target = lengths - torch.ceil((lengths - per_head).double() * round_ / self.rounds).long()
            key = self.eviction_key(view, ranking.scores, moments, ranking.protected, context.scaling, policy.score.chunk_size)
            kept = top_per_head(key.masked_fill(~keep, float("-inf")), target)
            moments = moments.add(view.keys, view.values, keep & ~kept)
            keep = kept
        return self._edit(keep, moments)

    def _edit(self, keep: torch.Tensor, moments: Moments) -> Edit:
        evicted = bool((moments.count > 0).any())  # with nothing evicted the read stays plain (and exact)
        return Edit(keep=keep, summary=moments if self.correction and evicted else None, state={MOMENTS: moments})

    # ----- decoding -------------------------------------------------------------------------
    def decode_evict(self, policy, view, context, col_sums, key, per_head, budgets) -> Edit:
        """The step's attention scores the eviction (computed only now: every ``slack`` steps), moment-informed."""
        attention = policy.score.decode_score(view, context, col_sums)
        protected = policy.score.decode_protected(view, context, budgets)
        moments = context.state[MOMENTS]
        key = self.eviction_key(view, attention, moments, protected, context.scaling, policy.score.chunk_size)
        kept = top_per_head(key, per_head)
        return self._edit(kept, moments.add(view.keys, view.values, view.valid_or_ones() & ~kept))


def moment_floats_per_head(head_dim: int) -> int:
    """d² + 2d + 1: the moments' size per KV head, independent of the context (METHODS.md)."""
    return head_dim * head_dim + 2 * head_dim + 1


__all__ = ["MomentKV", "Moments", "moment_floats_per_head"]
