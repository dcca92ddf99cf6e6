"""Merging: fold the entries that leave into retained ones instead of forgetting them.

Shared by KeepKV (votes + ZIP-merging), CaM and D2O (convex merges without votes), so that
the three differ only in their merge rule (METHODS.md, "KeepKV" and "Merging baselines"):

    a scorer's ranking (the presets: ``ema.py``'s EMA of attention) → keep set under the size (its
    protected entries: sinks and the recent window) → candidates = the rest → carrier = the most cosine-similar retained key
    outside sinks and the recent window → optional similarity threshold (below: dropped)
    → merge rule on each group {carrier} ∪ {its candidates} → one ``Edit`` (carriers rewritten,
    votes and importance as channels, the rest dropped)

The pieces are plain tensor functions on the layer's padded view [B, H, L, ...]:

* ``nearest_carriers``: per candidate, the allowed carrier with the highest key cosine
  similarity (candidates × carriers only, in chunks, never L × L at once);
* ``leaving_pairs``: a decoding step's one entry leaving each head and its carrier, read where the
  keys live (``csrc/merge_pairs.cpp`` on the CPU; ``leaving_pairs_torch`` the reference);
* ``group_weights`` and ``group_mean``: per carrier, the weighted mean of its group and the log
  of the total weight, from per-entry log-weights, with a per-group shift so nothing
  overflows (float64): every merge rule is built from them;
* ``zip_merge`` (KeepKV), ``cam_merge``, ``d2o_merge``: the rules, computed at the carriers only
  (their results are the carriers' new entries, in ``tensor[plan.carriers]`` order);
* ``Merge``: the fate above, for prefill and decoding (merging when a head exceeds its size)
  and the relative error of the reference query right after compression (``merge_error``);
  ``KeepKV``, ``CaM`` and ``D2O`` (their files) give it a rule.

A merge is computed for one reference query per KV head (q̄: the observation window's
queries averaged over the GQA group and the window at prefill; the current query averaged
over its group while decoding). With GQA the other query heads of the group are not exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from ..kernels import cpu_kernels
from ..read import attend_reference, group_queries
from ..store.view import UNCHANGED, Edit, KVView, LayerContext, Rewrite
from .ema import EMA, EMA_NORM, EMAImportance, prefill_window
from .parts import Fate, Needs
from .selection import priority, top_per_head


# ----- references -------------------------------------------------------------------------------
@dataclass
class Reference:
    """One reference query per (batch row, KV head): ``query`` [B, H, d] float32 at ``position`` [B]."""

    query: torch.Tensor
    position: torch.Tensor

    def logits(self, keys: torch.Tensor, scaling: float) -> torch.Tensor:
        """λ_i = τ·q̄ᵀk_i for keys [B, H, L, d]: [B, H, L] float64."""
        return torch.einsum("bhd,bhld->bhl", self.query.double(), keys.double()) * scaling


def window_reference(view: KVView, queries: torch.Tensor, query_valid: torch.Tensor) -> Reference:
    """q̄ = mean over the GQA group and the (real) window queries [B, Hq, w, d]; placed after every entry."""
    grouped = group_queries(queries, view.shape[1]).float()  # [B, H, G, w, d]
    weight = query_valid.float().to(grouped.device)
    count = weight.sum(dim=1).clamp(min=1.0) * grouped.shape[2]  # [B]: real queries × group size
    mean = (grouped * weight[:, None, None, :, None]).sum(dim=(2, 3)) / count[:, None, None]
    return Reference(mean, last_position(view))


def query_reference(view: KVView, context: LayerContext) -> Reference:
    """The step's last query averaged over its GQA group, at its own position."""
    grouped = group_queries(context.query[:, :, -1:], view.shape[1]).float()  # [B, H, G, 1, d]
    return Reference(grouped.mean(dim=(2, 3)), context.query_positions[:, -1].long())


def last_position(view: KVView) -> torch.Tensor:
    """[B]: each row's newest entry position (a query there sees every entry)."""
    positions = view.positions if view.valid is None else view.positions.masked_fill(~view.valid, -1)
    return positions.amax(dim=(1, 2))


def reference_output(ref: Reference, keys, values, positions, valid, log_weights, scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [B, H, d] and log-sum-exp [B, H] of the reference query over entries [B, H, L, ...]."""
    out, lse, _ = attend_reference(
        ref.query[:, :, None, None, :], keys, values, scaling,
        query_positions=ref.position[:, None], key_positions=positions, key_valid=valid, log_weights=log_weights,
    )
    return out[:, :, 0, 0], lse[:, :, 0, 0]


def view_reference_output(ref: Reference, view: KVView, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference_output`` over what a view holds, votes included."""
    return reference_output(ref, view.keys, view.values, view.positions, view.valid, view.log_weights, scaling)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """‖o − o_ref‖ / ‖o_ref‖ over every row and head (METHODS.md, "Metrics")."""
    norm = float(expected.double().norm())
    return float((out.double() - expected.double()).norm()) / norm if norm > 0 else 0.0


# ----- carrier search ---------------------------------------------------------------------------
def _first(mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Indices [B, H, L] that bring each head's True entries first (in order), and the largest count."""
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)
    return order, int(mask.sum(dim=-1).max()) if mask.numel() else 0


def nearest_carriers(
    keys: torch.Tensor, candidates: torch.Tensor, carriers: torch.Tensor, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each candidate, the allowed carrier of its head whose key is the most cosine-similar.

    Args:
        keys: [B, H, L, d]. candidates, carriers: [B, H, L] bool (disjoint).
    Returns:
        similarity [B, H, L] float32 (-inf where not a candidate or the head has no carrier)
        and carrier index [B, H, L] long (into L; the entry itself where not a candidate).
    """
    b, h, length, d = keys.shape
    self_index = torch.arange(length, device=keys.device).expand(b, h, length)
    similarity = torch.full((b, h, length), float("-inf"), device=keys.device)
    index = self_index.clone()
    cand_order, n_cand = _first(candidates)
    carr_order, n_carr = _first(carriers)
    if n_cand == 0 or n_carr == 0:
        return similarity, index
    unit = F.normalize(keys.float(), dim=-1)
    carr_order = carr_order[..., :n_carr]
    carr_keys = unit.gather(2, carr_order[..., None].expand(-1, -1, -1, d))  # [B, H, P, d]
    carr_ok = carriers.gather(2, carr_order)
    for start in range(0, n_cand, chunk):
        rows = cand_order[..., start : min(start + chunk, n_cand)]  # [B, H, c]
        cand_keys = unit.gather(2, rows[..., None].expand(-1, -1, -1, d))
        sims = torch.einsum("bhcd,bhpd->bhcp", cand_keys, carr_keys).masked_fill(~carr_ok[:, :, None, :], float("-inf"))
        best, arg = sims.max(dim=-1)
        similarity = similarity.scatter(2, rows, best)
        index = index.scatter(2, rows, carr_order.gather(2, arg))
    similarity = similarity.masked_fill(~candidates, float("-inf"))
    index = torch.where(candidates & torch.isfinite(similarity), index, self_index)
    return similarity, index


def leaving_pairs(view: KVView, score: torch.Tensor, open_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per head of a view [B, H, L]: the ``open_`` entry of the lowest ``score`` (it leaves; of equal scores the first),
    the open entry other than it whose key is the most cosine-similar to its key (its carrier; the first of equal ones),
    and that similarity, float32 (-inf where there is none): three [B, H] tensors (index 0 where there is none).

    On the CPU, with the compiled kernels and every entry plain, one pass over the keys where they live
    (``csrc/merge_pairs.cpp``: nothing gathered); elsewhere ``leaving_pairs_torch``, the reference, over the view's keys.
    """
    kernel = cpu_kernels() if score.device.type == "cpu" else None
    pages = view.pages if kernel is not None else None
    if pages is not None:
        keys, _, coded = pages.arrays()
        if coded is None:
            leaving, carrier, similarity = kernel.merge_pairs(keys, pages.tables, score.float().contiguous(), open_.contiguous())
            return leaving, carrier, similarity
    return leaving_pairs_torch(view.keys, score, open_)


def leaving_pairs_torch(keys: torch.Tensor, score: torch.Tensor, open_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``leaving_pairs`` over keys [B, H, L, d] in plain PyTorch: the reference."""
    leaving = score.masked_fill(~open_, float("inf")).argmin(-1, keepdim=True)  # [B, H, 1]
    keys = keys.float()
    unit = F.normalize(keys.gather(2, leaving[..., None].expand(-1, -1, 1, keys.shape[-1])), dim=-1)  # [B, H, 1, d]
    norms = torch.linalg.vector_norm(keys, dim=-1).clamp_(min=1e-12)  # as F.normalize's, without a normalized copy
    similarity = (keys @ unit.transpose(-1, -2))[..., 0].div_(norms)
    best, carrier = similarity.masked_fill(~open_.scatter(-1, leaving, False), float("-inf")).max(-1)
    return leaving[..., 0], carrier, best


# ----- grouped merges ---------------------------------------------------------------------------
@dataclass
class MergePlan:
    """Who folds into whom, on the padded view [B, H, L].

    ``keep``: entries that stay (carriers included); ``merged``: candidates folded into
    ``target`` (the index of their carrier in the same head; ``target`` is the entry itself
    elsewhere); ``dropped``: candidates forgotten; ``similarity``: cosine similarity of a
    candidate to its carrier (-inf elsewhere).
    """

    keep: torch.Tensor
    merged: torch.Tensor
    dropped: torch.Tensor
    target: torch.Tensor
    similarity: torch.Tensor

    @cached_property
    def members(self) -> torch.Tensor:
        """Entries that end up in some retained entry: the kept ones and the merged candidates."""
        return self.keep | self.merged

    @cached_property
    def carriers(self) -> torch.Tensor:
        """Kept entries that receive at least one candidate."""
        received = torch.zeros_like(self.target).scatter_add(-1, self.target, self.merged.long())
        return received > 0


@dataclass
class GroupWeights:
    """Per entry its weight within its group, shifted by the group's largest log-weight (0 for entries
    in no group), and per group, at its carrier, the total shifted weight and the log of the true total."""

    weight: torch.Tensor
    total: torch.Tensor
    log_total: torch.Tensor


def group_weights(log_weight: torch.Tensor, plan: MergePlan) -> GroupWeights:
    """Weights w_i = exp(log_weight_i) [B, H, L] of each group (a carrier and its candidates), computed
    in float64 with a per-group shift so that huge logits neither overflow nor underflow."""
    target = plan.target
    lw = log_weight.double().masked_fill(~plan.members, float("-inf"))
    shift = torch.full_like(lw, float("-inf")).scatter_reduce(-1, target, lw, reduce="amax", include_self=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    weight = torch.exp(lw - shift.gather(-1, target))  # 0 for non-members
    total = torch.zeros_like(weight).scatter_add(-1, target, weight)
    return GroupWeights(weight, total, torch.log(total) + shift)


def group_mean(x: torch.Tensor, weights: GroupWeights, plan: MergePlan, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Σ w_i x_i / Σ w_i of each group, for its carrier: x [B, H, L, ...] → [N, ...] in ``dtype``, the
    carriers in ``tensor[plan.carriers]`` order (the shifted weights lie in (0, 1]: float32 is enough
    for keys and values)."""
    b, h, length = plan.target.shape
    rows = (weights.weight.to(dtype)[..., None] * x.to(dtype).reshape(b, h, length, -1)).reshape(b * h * length, -1)
    heads = torch.arange(b * h, device=rows.device).view(b, h, 1) * length
    summed = torch.zeros_like(rows).index_add_(0, (plan.target + heads).reshape(-1), rows)  # each row into its carrier's
    carriers = plan.carriers.reshape(-1)
    total = weights.total.reshape(-1)[carriers].clamp(min=1e-300).to(dtype)
    return (summed[carriers] / total[:, None]).reshape(-1, *x.shape[3:])


@dataclass
class Merged:
    """A merge rule's result: the carriers' new keys and values [N, d] (``tensor[plan.carriers]``
    order), their votes (log p, [N]) or None, and how many groups fell back to another key rule."""

    keys: torch.Tensor
    values: torch.Tensor
    log_votes: torch.Tensor | None = None
    fallbacks: int = 0


KEY_RULES = ("zip", "votes", "shift")
PAPER_EPS = 1e-3  # the paper's guard: |Σ w λ| ≤ eps·Σ w |λ| counts as a zero denominator


def zip_merge(
    keys: torch.Tensor, values: torch.Tensor, log_votes: torch.Tensor, logits: torch.Tensor, plan: MergePlan, *,
    query: torch.Tensor, scaling: float, key_rule: str = "zip", max_key_scale: float = 1.25,
) -> Merged:
    """KeepKV's ZIP-merge of each group at once (METHODS.md, "KeepKV"), exact for the reference query.

    With λ_i = τ·q̄ᵀk_i and log w_i = log p_i + λ_i over a group {carrier} ∪ {candidates}, the
    merged entry must satisfy p_r·e^{τ q̄ᵀk_r} = Σ w_i (the group's share of the softmax numerator
    and denominator is unchanged) with v_r = Σ w_i v_i / Σ w_i. Write k̄ = Σ w_i k_i / Σ w_i
    (so τ q̄ᵀk̄ = λ̄ = Σ w_i λ_i / Σ w_i) and T = log(Σ w_i / Σ p_i). The key rules:

    * ``zip`` (the paper): k_r = k̄·T/λ̄, p_r = Σ p_i, so τ q̄ᵀk_r = T. The factor T/λ̄ is
      unbounded: where λ̄ is small against T it scales the key far beyond any real key
      (on SmolLM2, norms of 3600 against 22), which is exact for q̄ and ruins every other
      query. Where T/λ̄ ∉ [1/max_key_scale, max_key_scale] (or is negative or not finite)
      the merge falls back to ``votes`` for that group (exact too; counted in ``fallbacks``).
      ``max_key_scale=inf`` is the paper's rule and guard: any factor, sign flips included,
      unless |Σ w λ| ≤ 1e-3·Σ w |λ| (the denominator near zero).
    * ``votes``: k_r = k̄ and log p_r = log Σ w_i − λ̄: the mass that the convex key loses
      (attention sag) goes into the vote. log p_r = H(w̃) + E_w̃[log p] with w̃ = w/Σw, so
      1 ≤ p_r ≤ Σ p_i: the vote becomes the group's effective number of tokens for q̄.
    * ``shift``: k_r = k̄ + (T − λ̄)/τ · q̄/‖q̄‖², p_r = Σ p_i: the smallest change of k̄ that
      meets the constraint.

    ``query`` is q̄ [B, H, d] and ``scaling`` τ; ``logits`` [B, H, L] are τ·q̄ᵀk_i. The common scale
    of the w_i cancels, so the weights come from shifted logits in float64; the mean keys and values
    are float32 and λ̄ is taken as τ·q̄ᵀk̄ of the mean key itself, so the constraint holds for the
    key as it is stored.
    """
    if key_rule not in KEY_RULES:
        raise ValueError(f"unknown key_rule {key_rule!r}: use one of {', '.join(KEY_RULES)}")
    carriers = plan.carriers
    log_w = log_votes.double() + logits
    weights = group_weights(log_w, plan)
    log_total = weights.log_total[carriers]
    k_mean = group_mean(keys, weights, plan, torch.float32)
    v_mean = group_mean(values, weights, plan, torch.float32)
    q_bar = query.double()[:, :, None, :].expand(*carriers.shape, -1)[carriers]  # each carrier's reference query
    lam_bar = (q_bar * k_mean.double()).sum(-1) * scaling  # λ̄ = τ·q̄ᵀk̄, from the mean key as it will be stored
    log_p = group_weights(log_votes, plan).log_total[carriers]  # log Σ p
    target = log_total - log_p  # T: the logit the merged entry needs with Σ p votes
    sag_votes = log_total - lam_bar  # log p_r of the ``votes`` rule
    fallbacks = 0
    if key_rule == "zip":
        scale = target / lam_bar
        if math.isinf(max_key_scale):  # the paper's guard only: Σ w λ near 0 against Σ w |λ|
            lam_abs = group_mean(logits.abs()[..., None], weights, plan)[:, 0]
            in_range = torch.isfinite(scale) & (lam_bar.abs() > PAPER_EPS * lam_abs)
        else:
            in_range = torch.isfinite(scale) & (scale >= 1.0 / max_key_scale) & (scale <= max_key_scale)
        k_new = torch.where(in_range[:, None], k_mean * torch.where(in_range, scale, 1.0)[:, None], k_mean)
        log_p_new = torch.where(in_range, log_p, sag_votes)
        fallbacks = int((~in_range).sum())
    elif key_rule == "votes":
        k_new, log_p_new = k_mean, sag_votes
    else:
        step = (target - lam_bar) / scaling / (q_bar * q_bar).sum(-1).clamp(min=1e-30)
        k_new, log_p_new = k_mean.double() + step[:, None] * q_bar, log_p
    return Merged(keys=k_new.to(keys.dtype), values=v_mean.to(values.dtype), log_votes=log_p_new.float(), fallbacks=fallbacks)


def cam_merge(keys: torch.Tensor, values: torch.Tensor, logits: torch.Tensor, plan: MergePlan) -> Merged:
    """CaM-style: the carrier keeps its key; values are averaged with the reference attention e^{λ_i}."""
    v_mean = group_mean(values, group_weights(logits, plan), plan)
    return Merged(keys=keys[plan.carriers], values=v_mean.to(values.dtype))


def d2o_merge(keys: torch.Tensor, values: torch.Tensor, plan: MergePlan) -> Merged:
    """D2O-style: keys and values averaged with weights softmax(u) over the group, u = cosine similarity
    to the carrier (1 for the carrier itself): w_e = e^{u_e} / (Σ e^{u} + e), w_c = e / (Σ e^{u} + e)."""
    u = torch.where(plan.merged, plan.similarity.double(), torch.ones_like(plan.similarity, dtype=torch.float64))
    u = torch.where(torch.isfinite(u), u, torch.ones_like(u))
    d = keys.shape[-1]
    means = group_mean(torch.cat([keys, values], dim=-1), group_weights(u, plan), plan)
    return Merged(keys=means[:, :d].to(keys.dtype), values=means[:, d:].to(values.dtype))


# ----- the fate ----------------------------------------------------------------------------------
@dataclass
class Merge(Fate):
    """Fold what leaves into the most similar retained key (see the module docstring); the rule is the subclass's.

    Options:
        window: the prefill's last queries whose mean is the reference query q̄ of the merges (32).
        similarity_threshold: candidates whose best cosine similarity is below it are
            dropped instead of merged (None: always merge).

    With the EMA scorer (the presets), a carrier's importance becomes its group's; with another scorer (the
    retention gates, KVzip...) the carriers keep their scores.
    """

    window: int = 32
    similarity_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"{self.name}: window must be ≥ 1, got {self.window}")
        if self.similarity_threshold is not None and not -1.0 <= self.similarity_threshold <= 1.0:
            raise ValueError(f"similarity_threshold is a key cosine: it must be in [-1, 1], got {self.similarity_threshold}")

    def needs(self) -> Needs:
        return Needs(window=self.window)

    def stats(self, states, counts) -> dict:
        merges = {name: int(counts.get(name, 0)) for name in MERGE_COUNTS}
        errors = [state["merge_error"] for state in states if "merge_error" in state]
        out = {"merge_counts": merges} if any(merges.values()) else {}
        if errors:  # the reference query's error right after compression, mean over layers
            out["merge_error"] = sum(errors) / len(errors)
        return out

    # ----- the prefill -----------------------------------------------------------------------
    @torch.no_grad()  # forks compress outside inference mode: never record autograd
    def evict(self, policy, view, context, ranking, per_head, budgets) -> Edit:
        return self.merge_from_window(view, context, prefill_window(context, self.window), ranking, per_head)

    def merge_from_window(self, view, context, window, ranking, per_head) -> Edit:
        """Keep each head's ``per_head`` best by ``ranking``, merge the rest against the window's mean query.

        The edit's state records ``merge_error``: the reference query's relative output error
        right after compression (before: every entry, votes included; after: what is held).
        """
        ref = window_reference(view, *window[::2])
        edit = self.merge(view, context, top_per_head(ranking.key, per_head), ranking.protected, ref)
        edit.state["merge_error"] = self._merge_error(view, edit, ref, context.scaling)
        return edit

    @staticmethod
    def _merge_error(view: KVView, edit: Edit, ref: Reference, scaling: float) -> float:
        """q̄'s relative output error after the edit against before it (0 when nothing left)."""
        valid = view.valid_or_ones()
        held = valid if edit.keep is None else edit.keep & valid
        if edit.rewrite is None and bool((held == valid).all()):
            return 0.0
        expected, _ = view_reference_output(ref, view, scaling)
        count = int(held.sum(-1).max())
        order = torch.argsort((~held).to(torch.int8), dim=-1, stable=True)[..., :count]  # what is held, in order
        pick = lambda t: t.gather(2, order[..., None].expand(*order.shape, t.shape[-1]))  # noqa: E731
        keys, values = pick(view.keys), pick(view.values)
        if edit.rewrite is not None:
            keys, values = Rewrite(edit.rewrite.mask.gather(-1, order), edit.rewrite.keys, edit.rewrite.values).applied(keys, values)
        log_weights = view.log_weights if edit.log_weights is UNCHANGED else edit.log_weights
        log_weights = None if log_weights is None else log_weights.gather(-1, order)
        out, _ = reference_output(ref, keys, values, view.positions.gather(-1, order), held.gather(-1, order), log_weights, scaling)
        return relative_error(out, expected)

    def carrier_pool(self, context, keep: torch.Tensor, candidates: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        """Retained entries that may carry: outside sinks and the recent window (``protected``), or all
        retained ones in a head where none is left outside them."""
        pool = keep & ~protected
        empty = ~pool.any(dim=-1, keepdim=True)
        if bool((empty & candidates.any(dim=-1, keepdim=True)).any()):
            context.note(f"{self.name}: budget leaves no carrier outside sinks and the recent window; protected entries carry")
        return torch.where(empty, keep, pool)

    def accept(self, context, similarity: torch.Tensor, candidates: torch.Tensor, state: dict) -> torch.Tensor:
        """Which candidates merge (the rest are dropped): all, or those at or above the threshold.
        ``state`` collects updates of the method's per-layer state."""
        if self.similarity_threshold is None:
            return candidates
        return candidates & (similarity >= self.similarity_threshold)

    def merge(self, view, context, keep: torch.Tensor, protected: torch.Tensor, ref: Reference) -> Edit:
        """Fold every valid entry outside ``keep`` [B, H, L] into its carrier (or drop it): the edit.
        ``protected``: the entries that never merge and never carry (sinks, the recent window)."""
        valid = view.valid_or_ones()
        keep = keep & valid
        candidates = valid & ~keep
        if not bool(candidates.any()):
            return Edit(keep=keep)
        similarity, carrier = nearest_carriers(view.keys, candidates, self.carrier_pool(context, keep, candidates, protected))
        state: dict = {}
        merged = self.accept(context, similarity, candidates, state) & torch.isfinite(similarity)
        target = torch.where(merged, carrier, torch.arange(keep.shape[-1], device=keep.device).expand_as(carrier))
        plan = MergePlan(keep=keep, merged=merged, dropped=candidates & ~merged, target=target, similarity=similarity)
        result = self.merge_rule(view, plan, ref, context.scaling)
        channels = self._merged_importance(view, plan)
        carriers = plan.carriers
        edit = Edit(keep=plan.keep, rewrite=Rewrite(carriers, result.keys, result.values), channels=channels, state=state,
                    counts=self._count(context, plan, result))
        if result.log_votes is not None:
            edit.log_weights = log_votes_of(view).masked_scatter(carriers, result.log_votes)
        return edit

    def merge_rule(self, view, plan: MergePlan, ref: Reference, scaling: float) -> Merged:
        raise NotImplementedError

    @staticmethod
    def _merged_importance(view, plan: MergePlan) -> dict[str, torch.Tensor]:
        """With EMA channels: a carrier's importance becomes the sum of its group's (the attention it will
        receive); its bias correction the largest of the group's. Other scorers' channels are left as they are."""
        if EMA not in view.channels:
            return {}
        s_hat = EMAImportance.importance(view).masked_fill(~plan.members, 0.0)
        norm = view.channels[EMA_NORM].masked_fill(~plan.members, 0.0)
        summed = torch.zeros_like(s_hat).scatter_add(-1, plan.target, s_hat)
        largest = torch.zeros_like(norm).scatter_reduce(-1, plan.target, norm, reduce="amax", include_self=True)
        carriers = plan.carriers
        return {
            EMA: torch.where(carriers, summed * largest, view.channels[EMA]),
            EMA_NORM: torch.where(carriers, largest, view.channels[EMA_NORM]),
        }

    def _count(self, context, plan: MergePlan, result: Merged) -> dict:
        """This edit's tallies: entries merged, groups (carriers), entries dropped, key-rule fallbacks."""
        counts = {"merged": int(plan.merged.sum()), "merge_groups": int(plan.carriers.sum()), "dropped": int(plan.dropped.sum())}
        if result.fallbacks:
            counts["zip_fallbacks"] = result.fallbacks
            context.note(f"{self.name}: ZIP key scales out of range fell back to the votes rule "
                         "(count: stats['merge_counts']['zip_fallbacks'])")
        return counts

    # ----- decoding --------------------------------------------------------------------------
    @torch.no_grad()
    def decode_evict(self, policy, view, context, col_sums, key, per_head, budgets) -> Edit:
        """Heads holding more than ``per_head`` merge their lowest entries (outside the protected ones) back to it,
        against the current query."""
        protected = policy.score.decode_protected(view, context, budgets)
        lengths = view.lengths.to(per_head.device)
        excess = lengths - per_head
        if int(excess.max()) == 1 and bool(((view.valid_or_ones() & ~protected).sum(-1) >= 2).all()):
            return self.merge_one(policy, view, context, excess > 0, protected, col_sums)  # the decoding steady state
        key = priority(policy.score.decode_score(view, context, col_sums), protected, view.positions, view.valid)
        return self.merge(view, context, top_per_head(key, per_head), protected, query_reference(view, context))

    def merge_one(self, policy, view, context, over: torch.Tensor, protected: torch.Tensor, col_sums) -> Edit:
        """One entry leaves each head in ``over`` [B, H] — its lowest-scoring unprotected entry — folded
        into its most similar unprotected retained key against the current query: ``merge`` with one
        group per head, computed on the two entries of each group only (the per-step cost of decoding)."""
        device = view.positions.device
        valid = view.valid_or_ones()
        over = over.to(device)
        open_ = valid & ~protected
        candidate, carrier, best = (t[..., None] for t in leaving_pairs(view, policy.score.decode_score(view, context, col_sums), open_))
        candidates = torch.zeros_like(valid).scatter(-1, candidate, over[..., None])
        state: dict = {}
        merged = self.accept(context, torch.full(valid.shape, float("-inf"), device=device).scatter(-1, candidate, best), candidates, state)
        merged_head = merged.any(-1, keepdim=True)  # [B, H, 1]: the candidate merges (else it is dropped)
        pair = view.select(torch.cat([carrier, candidate], dim=-1))  # [B, H, 2]: the carrier, then the candidate
        plan = MergePlan(
            keep=torch.tensor([True, False], device=device).expand(*candidate.shape[:2], 2),
            merged=torch.cat([torch.zeros_like(merged_head), merged_head], dim=-1),
            dropped=torch.cat([torch.zeros_like(merged_head), over[..., None] & ~merged_head], dim=-1),
            target=torch.cat([torch.zeros_like(carrier), torch.where(merged_head, 0, 1)], dim=-1),
            similarity=torch.cat([torch.full_like(best, float("-inf")), best], dim=-1),
        )
        result = self.merge_rule(pair, plan, query_reference(view, context), context.scaling)
        rewritten = torch.zeros_like(valid).scatter(-1, carrier, merged_head)  # the carriers, in (row, head) order
        edit = Edit(keep=valid & ~candidates, rewrite=Rewrite(rewritten, result.keys, result.values), state=state,
                    counts=self._count(context, plan, result))
        if result.log_votes is not None:
            edit.log_weights = log_votes_of(view).masked_scatter(rewritten, result.log_votes)
        importance = self._merged_importance(pair, plan)
        edit.channels = {name: view.channels[name].scatter(-1, carrier, torch.where(merged_head, merged[..., :1],
                                                                                    view.channels[name].gather(-1, carrier)))
                         for name, merged in importance.items()}
        return edit


MERGE_COUNTS = ("merged", "merge_groups", "dropped", "zip_fallbacks")


def log_votes_of(view: KVView) -> torch.Tensor:
    """log p [B, H, L] (0 where the layer holds no votes)."""
    if view.log_weights is None:
        return torch.zeros(view.shape, dtype=torch.float32, device=view.positions.device)
    return view.log_weights


__all__ = [
    "KEY_RULES",
    "Merge",
    "MergePlan",
    "Merged",
    "Reference",
    "cam_merge",
    "d2o_merge",
    "group_mean",
    "group_weights",
    "nearest_carriers",
    "query_reference",
    "reference_output",
    "relative_error",
    "view_reference_output",
    "zip_merge",
]
