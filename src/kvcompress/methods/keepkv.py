"""KeepKV (seeds/002: Tian et al. 2025, "KeepKV: Achieving Periodic Lossless KV Cache Compression
for Efficient LLM Inference", arXiv 2504.09936).

Entries that leave are merged, not forgotten, and without the "attention sag" of convex
merges (CaM, D2O): every entry carries an electoral vote count p_i ≥ 1 that the read path
adds to its logit as log p_i (the layer's per-entry log-weights), and a ZIP-merge folds a
candidate into its carrier so that the reference query's output is unchanged (METHODS.md,
"KeepKV"): with λ_i = τ·q̄ᵀk_i and log w_i = log p_i + λ_i,
v_r = Σ w_i v_i / Σ w_i, k_r = (Σ w_i k_i)·log(Σ w_i / Σ p_i) / Σ w_i λ_i, p_r = Σ p_i.

Protocol (Algorithm 1 of the paper; the ``keepkv`` preset: the EMA scorer of ``ema.py``, this fate, eviction
while decoding; the shared machinery is ``merging.Merge``):

* Prefill: importance = the bias-corrected EMA of the observation window's attention
  (mean over the GQA group; Alg. 1 step 4), SnapKV-pooled for the selection; sinks and the
  recent window are kept and never merged; the lowest-importance entries leave down to
  the budget; each goes to the retained key (outside sinks and the recent window) with
  the highest cosine similarity, all of a carrier's candidates in one exact group merge;
  the reference q̄ is the window's queries averaged over the group and the window. The
  reference's relative output error right after compression is ``state["merge_error"]``
  (≈ 1e-7 in float32; exactness holds for q̄ only, not for each query head of the group,
  and not after rounding merged keys to bf16/fp16).
* Decoding: the EMA is updated from each step's attention (votes included); when a head
  exceeds its budget (+ ``slack``), every head over its budget has its lowest-EMA entries
  ZIP-merged, with the current query averaged over its group as the reference.
* Periodic refresh (``refresh_every`` = T > 0): the original K/V of every token seen (the
  prompt, and each decoded token as it comes) and the last ``window`` queries are kept in
  CPU memory (``state["external_kv"]``, not counted in kr: its size is
  ``state["external_kv_bytes"]``); every T decoded tokens the layer is rebuilt from it —
  importance re-initialised over the last ``window`` queries, selection and merges redone
  against their mean — so the reference error returns to its post-compression level.
  The paper keeps the prompt's K/V only; keeping the decoded tokens too makes the rebuild
  complete (a decoded token merged into a prompt carrier would otherwise be lost).

Key rule (``key_rule``, see ``merging.zip_merge``): the paper's ZIP key k_r = k̄·T/λ̄ scales
the weighted mean key by a factor that is unbounded where λ̄ = τ·q̄ᵀk̄ is small. On SmolLM2 it
produced keys of norm 3600 (real keys: ≤ 27): exact for q̄, a disaster for every other query
(diagnose at 1536 tokens, budget 128: relative error 1.06 against CaM's 0.22). So by default
a group whose factor leaves [1/1.25, 1.25] falls back to the ``votes`` rule — the convex key,
with the sagged mass moved into the vote (also exact for q̄) — counted in
``stats()['merge_counts']['zip_fallbacks']`` and noted in the stats. ``max_key_scale=inf`` is the paper's rule;
``key_rule="votes"`` and ``"shift"`` (minimal key change along q̄) are the alternatives
measured in docs/results.md.

Defaults: sinks 4 (METHODS.md's s), window 32, recent window = the observation window
(capped at half of what the sinks leave of the budget, so carriers exist), EMA decay 0.9
(the paper's value is lost in the text; a memory of about 10 queries), no similarity
threshold (the authors' code uses 0.8: pass ``similarity_threshold=0.8`` to drop candidates
below it instead of merging them), slack 0 (merge at every step over budget, as the paper),
no refresh.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..store.view import Edit, KVView, edited_entries
from .ema import EMAImportance, window_query_valid
from .merging import KEY_RULES, Merge, Merged, log_votes_of, zip_merge

EXTERNAL = "external_kv"


@dataclass(frozen=True)
class ExternalKV:
    """Original K/V of every token seen, in CPU memory, plus the last queries (for refresh).

    Chunks [B, H, t, d] (positions and validity [B, t]) are appended, never written in place,
    so clones of a cache may share it. It has no ``nbytes``: kr counts what the accelerator
    holds; ``size_bytes`` is reported separately.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    positions: tuple[torch.Tensor, ...]
    valid: tuple[torch.Tensor, ...]
    queries: torch.Tensor  # [B, Hq, w, d]
    query_positions: torch.Tensor  # [B, w]
    query_valid: torch.Tensor  # [B, w]

    def size_bytes(self) -> int:
        tensors = [*self.keys, *self.values, *self.positions, *self.valid, self.queries, self.query_positions, self.query_valid]
        return sum(t.numel() * t.element_size() for t in tensors)

    def entries(self, device) -> tuple[torch.Tensor, ...]:
        """keys, values [B, H, T, d], positions [B, T], valid [B, T] on ``device``."""
        return tuple(torch.cat(chunks, dim=-2 if chunks is self.keys or chunks is self.values else -1).to(device)
                     for chunks in (self.keys, self.values, self.positions, self.valid))

    def with_step(self, keys, values, positions, queries, window: int) -> ExternalKV:
        """Append a decoding step's entries [B, H, q, d] at positions [B, q] and its queries [B, Hq, q, d]."""
        valid = torch.ones(positions.shape, dtype=torch.bool)
        return replace(
            self,
            keys=(*self.keys, keys.cpu()), values=(*self.values, values.cpu()),
            positions=(*self.positions, positions.long().cpu()), valid=(*self.valid, valid),
            queries=torch.cat([self.queries, queries.cpu()], dim=2)[:, :, -window:],
            query_positions=torch.cat([self.query_positions, positions.long().cpu()], dim=1)[:, -window:],
            query_valid=torch.cat([self.query_valid, valid], dim=1)[:, -window:],
        )


@dataclass
class KeepKV(Merge):
    """Electoral votes + ZIP-merging, optional periodic refresh (see the module docstring).

    Options: key_rule ("zip", "votes" or "shift"), max_key_scale (the zip key's largest
    scale factor before the group falls back to the votes rule, 1.25; inf = the paper),
    refresh_every (T decoded tokens between refreshes, 0 = off; needs the EMA scorer), plus
    Merge's window and similarity_threshold.
    """

    key_rule: str = "zip"
    max_key_scale: float = 1.25
    refresh_every: int = 0

    name: ClassVar[str] = "keepkv"
    about: ClassVar[str] = "merge what leaves with electoral votes, exact for the reference query (KeepKV)"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.key_rule not in KEY_RULES:
            raise ValueError(f"unknown key_rule {self.key_rule!r}: use one of {', '.join(KEY_RULES)}")
        if not self.max_key_scale >= 1.0 or self.refresh_every < 0:
            raise ValueError("max_key_scale must be ≥ 1 (inf for the paper's unbounded rule) and refresh_every ≥ 0")

    def check(self, policy) -> None:
        if self.refresh_every and not isinstance(policy.score, EMAImportance):
            raise ValueError("keepkv: refresh_every rebuilds the EMA importance from the last queries: use it with the ema "
                             "scorer (the keepkv preset)")

    def merge_rule(self, view, plan, ref, scaling) -> Merged:
        return zip_merge(view.keys, view.values, log_votes_of(view), ref.logits(view.keys, scaling), plan, query=ref.query,
                         scaling=scaling, key_rule=self.key_rule, max_key_scale=self.max_key_scale)

    @property
    def decodes_all_layers(self) -> bool:
        return not self.refresh_every  # the refresh keeps each layer's own copy of its tokens

    def stats(self, states, counts) -> dict:
        out = super().stats(states, counts)
        offloaded = sum(int(state.get("external_kv_bytes", 0)) for state in states)
        if offloaded:  # the CPU copy for refresh: reported, not in kr
            out["offloaded_bytes"] = offloaded
        return out

    # ----- prefill ---------------------------------------------------------------------------
    @torch.no_grad()
    def evict(self, policy, view, context, ranking, per_head, budgets) -> Edit:
        edit = super().evict(policy, view, context, ranking, per_head, budgets)
        if self.refresh_every:
            edit.state.update(self._external_state(self._external(view, context)))
        return edit

    def _external(self, view, context) -> ExternalKV:
        """The uncompressed prefill and the last window queries, in CPU memory."""
        b, _, length = view.shape  # at prefill every head of a row holds the row's tokens
        valid = view.valid[:, 0] if view.valid is not None else torch.ones(b, length, dtype=torch.bool)
        queries = context.observations["window_queries"][:, :, -self.window :]
        return ExternalKV(
            keys=(view.keys.cpu(),), values=(view.values.cpu(),),
            positions=(view.positions[:, 0].masked_fill(~valid.to(view.positions.device), 0).cpu(),), valid=(valid.cpu(),),
            queries=queries.cpu(), query_positions=context.observations["window_positions"][:, -self.window :].long().cpu(),
            query_valid=window_query_valid(queries, context.tokens_seen).cpu(),
        )

    @staticmethod
    def _external_state(ext: ExternalKV) -> dict:
        return {EXTERNAL: ext, "external_kv_bytes": ext.size_bytes()}

    # ----- decoding --------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, policy, view, context, col_sums, budgets, slack) -> Edit | None:
        if not (self.refresh_every and EXTERNAL in context.state):
            return super().decode(policy, view, context, col_sums, budgets, slack)
        q = context.query.shape[2]
        ext = context.state[EXTERNAL].with_step(*self._new_entries(view, q), context.query_positions, context.query, self.window)
        before = context.state.get("decode_tokens", 0)
        state = {**self._external_state(ext), "decode_tokens": before + q}
        if (before + q) // self.refresh_every > before // self.refresh_every:
            edit = self.refresh(policy, view, context, ext, budgets)
            state["refreshes"] = context.state.get("refreshes", 0) + 1
        else:
            edit = super().decode(policy, view, context, col_sums, budgets, slack) or Edit()
        edit.state = {**edit.state, **state}
        return edit

    @staticmethod
    def _new_entries(view, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's q new keys and values [B, H, q, d]: the last q entries of every head."""
        device = view.keys.device
        index = view.lengths.to(device)[..., None] - q + torch.arange(q, device=device)
        index = index[..., None].expand(-1, -1, -1, view.keys.shape[-1])
        return view.keys.gather(2, index), view.values.gather(2, index)

    def refresh(self, policy, view, context, ext: ExternalKV, budgets: torch.Tensor) -> Edit:
        """Rebuild the layer from the external K/V: every token seen, votes 1, then compress as at prefill
        with the last ``window`` queries (current scores) to the current size."""
        device = view.keys.device
        keys, values, positions, valid = ext.entries(device)
        b, h, t, _ = keys.shape
        rebuilt = KVView.of(keys.to(view.keys.dtype), values.to(view.values.dtype), positions[:, None, :].expand(b, h, t),
                            valid[:, None, :].expand(b, h, t))
        window = (ext.queries.to(device), ext.query_positions.to(device), ext.query_valid.to(device))
        policy.score.start_from(rebuilt, *window, context.scaling)
        ranking = policy.score.ranking(rebuilt, context, budgets)
        per_head = policy.sizes.per_head(ranking.key, budgets, rebuilt, context)
        edit = self.merge_from_window(rebuilt, context, window, ranking, per_head)
        return Edit(replace=edited_entries(rebuilt, edit), state=edit.state)


__all__ = ["ExternalKV", "KeepKV"]
