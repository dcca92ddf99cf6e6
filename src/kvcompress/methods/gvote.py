"""GVote (seeds/003: "Procrustes' bed" / GVote — adaptive KV-cache compression by Gaussian voting).

No budget is given: the method decides how many entries each request and each KV head keeps
(METHODS.md, "GVote"; Algorithm 1 and the appendix A listing of the paper):

1. step budget: per query head, ``B_h`` = the smallest number of entries whose sorted
   attention mass, under the last real context query ``q_0``, reaches ``p_nuc`` (listing:
   ``sum(cumsum(sorted probs) < p_nuc) + 1``);
2. ``μ, σ`` = per-channel mean and standard deviation of the layer's attention-input hidden
   states over the prompt (after the input norm, padding excluded; recorded by the cache);
3. ``S`` samples ``h̃ ~ N(μ, σ²)``, ``q̃ = W_q h̃`` (+ bias, + per-head q-norm where the model
   has them), RoPE with cos/sin averaged over the next ``n_f`` positions;
4. each sample and query head votes for its top-``B_h`` keys by logit; the union over the
   samples and over the query heads of each GQA group is the keep-set of that KV head;
5. the budget is the union's size: it differs per request and per head. It is recorded in
   the layer's state (``"gvote"``) and shows in ``CompressedCache.stats()`` (``entries``, ``cr``,
   ``kr``, ``entries_per_head``).

Choices the paper leaves open (named options, see ``GVote``):

* ``future`` (n_f): the paper gives no value; 32 = the eval's default answer length and the
  observation window the other methods use. Averaging cos/sin over n_f positions damps the
  fast-rotating RoPE channels of the sampled queries (a low-pass over the future's phases).
* the future positions are ``last real position + 1 … + n_f`` of each row (the listing
  uses ``seq_len …``; with left padding the row's own positions are the right ones).
* RoPE is transformers' ``q·cos + rotate_half(q)·sin`` (the layout every supported
  architecture uses; the listing's interleaved rotation belongs to another layout).
* randomness: one generator per (seed, layer); sample ``s`` draws one standard normal vector
  ``z_s`` shared by the rows of a batch (``h̃_b,s = μ_b + σ_b·z_s``), so a request gets the
  same samples alone or in any batch, and the first S' samples do not depend on S (the
  keep-set grows monotonically with S for a fixed seed).
* the listing keeps no sinks or recent window: neither does this (the union is the keep-set).

Here GVote is a sizer (``GVote``: each head's size is its union's) and a scorer (``Votes``: an entry scores
1 when voted, so the union is what the head keeps); the ``gvote`` preset puts both together. Other
compositions: ``gvote+momentkv`` folds what GVote drops into MomentKV's moments, merged into every
read (seeds/000; their bytes count in kr); ``momentkv+gvote+static`` (or ``snapkv+gvote``,
``keepkv+gvote+static``...) lets another scorer choose the entries under GVote's per-head sizes (plus its
own protected window and sinks). A self-sized policy does not evict while decoding. ``include_current=True``
lets ``q_0`` vote beside the samples (not in the paper). On SmolLM2 GVote keeps too little of a needle for
the retrieval tasks; see docs/results.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..read import attention_probs, group_queries
from ..store.view import Edit
from .parts import Needs, Scorer, Sizer
from .rotary import apply_rotary, averaged_rotary
from .selection import PROTECTED_PRIORITY, plus_protected

STATE = "gvote"


@dataclass(frozen=True)
class GVoteAllocation:
    """What GVote decided for one layer (CPU int64): ``step_budgets`` [B, Hq] (B_h per query
    head from q_0) and ``kept`` [B, H] (the realized budget: the union's size per KV head).

    Diagnostic metadata, not needed to attend (not counted in the layer's bytes)."""

    step_budgets: torch.Tensor
    kept: torch.Tensor


# ----- the steps as plain functions (tested directly) --------------------------------------------
def nucleus_budgets(probs: torch.Tensor, p_nuc: float, cap: torch.Tensor | None = None) -> torch.Tensor:
    """Smallest number of entries whose sorted probability mass reaches ``p_nuc``: [...] int64 from probs [..., L].

    The mass is measured against the row's total (rounded float weights need not sum to 1), and
    ``p_nuc = 1`` counts every entry. ``cap`` (broadcastable to the result) bounds the count by
    the entries really there (padding has weight 0). Always at least 1.
    """
    ordered = probs.double().sort(dim=-1, descending=True).values
    cumulative = ordered.cumsum(dim=-1)
    if p_nuc >= 1.0:
        budgets = torch.full(probs.shape[:-1], probs.shape[-1], dtype=torch.long, device=probs.device)
    else:
        budgets = (cumulative < p_nuc * cumulative[..., -1:]).sum(dim=-1) + 1
    if cap is not None:
        budgets = torch.minimum(budgets, cap.to(budgets.device))
    return budgets.clamp(min=1)


def sample_hidden(mean: torch.Tensor, std: torch.Tensor, samples: int, generator: torch.Generator) -> torch.Tensor:
    """``h̃`` [B, S, D] float32: ``μ_b + σ_b·z_s``, one z_s ~ N(0, I) per sample drawn in order from ``generator``.

    Sample s is the same whatever S is and whatever else shares the batch.
    """
    noise = torch.stack([torch.randn(mean.shape[-1], generator=generator) for _ in range(samples)])  # [S, D]
    noise = noise.to(mean.device)
    return mean.float()[:, None, :] + std.float()[:, None, :] * noise[None]


def project_queries(module: torch.nn.Module, hidden: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Pre-RoPE queries [B, Hq, S, d] float32 from hidden states [B, S, D]: ``q_proj`` (its bias included),
    then the per-head ``q_norm`` where the module has one (Qwen3), as the attention module does."""
    weight = module.q_proj.weight
    q = module.q_proj(hidden.to(dtype=weight.dtype, device=weight.device))
    q = q.view(*hidden.shape[:2], -1, head_dim)  # [B, S, Hq, d]
    q_norm = getattr(module, "q_norm", None)
    if q_norm is not None:
        q = q_norm(q)
    return q.transpose(1, 2).float()


def union_votes(logits: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """Keep mask [B, H, L] from vote logits [B, H, G, S, L] (-inf = not an entry) and budgets [B, H, G].

    Every (query head, sample) votes for its ``budgets[b, h, g]`` highest logits; a KV head keeps
    the union of its group's votes over all samples.
    """
    b, h, g, s, length = logits.shape
    k = int(budgets.max()) if budgets.numel() else 0
    if k == 0:
        return torch.zeros(b, h, length, dtype=torch.bool, device=logits.device)
    top = logits.topk(min(k, length), dim=-1).indices  # [B, H, G, S, k], best first
    chosen = torch.arange(top.shape[-1], device=logits.device) < budgets.to(logits.device)[:, :, :, None, None]
    chosen = chosen.expand(top.shape)
    votes = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, top, chosen)
    return (votes & torch.isfinite(logits)).any(dim=3).any(dim=2)


def generator_for(seed: int, layer_idx: int) -> torch.Generator:
    """A CPU generator seeded from (seed, layer): each layer draws its own samples, reproducibly."""
    return torch.Generator().manual_seed((seed * 1_000_003 + layer_idx) % (2**63))


@dataclass
class GVote(Sizer):
    """Adaptive sizes by Gaussian-sampled future queries (see the module docstring).

    Options:
        p_nuc: nucleus mass that sets each query head's step budget from q_0 (0.95, the
            paper's recommendation).
        samples: S, sampled future queries per layer (8: the paper finds S ≥ 8 a good compromise).
        future: n_f, future positions whose RoPE cos/sin are averaged (32; the paper gives none).
        seed: seeds the samples (with the layer index); equal seeds give identical keep-sets.
        include_current: the last real query q_0 votes beside the samples, so its top-p set
            is kept (off = the paper: q_0 only sets the step budgets).

    A policy sized by GVote takes no budget or ratio.
    """

    p_nuc: float = 0.95
    samples: int = 8
    future: int = 32
    seed: int = 0
    include_current: bool = False

    name: ClassVar[str] = "gvote"
    about: ClassVar[str] = "each head keeps the union of Gaussian-sampled future queries' votes (GVote)"
    sizes_itself: ClassVar[str] = "it chooses its own budget per request and KV head"

    def __post_init__(self) -> None:
        if not 0.0 < float(self.p_nuc) <= 1.0:
            raise ValueError(f"p_nuc must be in (0, 1], got {self.p_nuc!r}")
        if self.samples < 1 or self.future < 1:
            raise ValueError(f"samples and future must be ≥ 1, got samples={self.samples}, future={self.future}")

    def check(self, policy) -> None:
        super().check(policy)
        if policy.decoding.acts:
            raise ValueError(f"{policy.name}: gvote sizes the prompt only, and the policy evicts while decoding; add "
                             "+static (the prompt compressed once, every later token kept)")

    def needs(self) -> Needs:
        return Needs(window=1, hidden_stats=True)

    # ----- the steps on a layer -------------------------------------------------------------
    def step_budgets(self, view, context) -> torch.Tensor:
        """B_h per query head [B, H, G] (int64, on the keys' device) from the last real context query."""
        query = context.observations["window_queries"][:, :, -1:]
        position = context.observations["window_positions"][:, -1:]
        probs = attention_probs(group_queries(query, view.shape[1]), view.keys, context.scaling, position, view.positions, view.valid)
        cap = view.lengths.to(probs.device)[:, :, None]
        return nucleus_budgets(probs[:, :, :, 0], self.p_nuc, cap)

    @torch.no_grad()  # the model's weights take part: never record autograd (forks run outside inference mode)
    def sampled_queries(self, view, context) -> torch.Tensor:
        """The S sampled future queries [B, Hq, S, d] float32, after q-norm and averaged RoPE."""
        module, rotary, obs = context.module, context.rotary, context.observations
        if module is None or rotary is None or "hidden_mean" not in obs:
            raise ValueError(
                "gvote needs the layer's attention module, the model's rotary embedding and the prefill's hidden "
                "statistics: compress through CompressedCache (hidden_stats=True when sharing a prefill)."
            )
        hidden = sample_hidden(obs["hidden_mean"], obs["hidden_std"], self.samples, generator_for(self.seed, context.layer_idx))
        q = project_queries(module, hidden, view.keys.shape[-1])
        start = obs["window_positions"][:, -1] + 1
        cos, sin = averaged_rotary(rotary, start, self.future, q)
        return apply_rotary(q, cos, sin)

    def keep_mask(self, view, context) -> tuple[torch.Tensor, torch.Tensor]:
        """(keep [B, H, L], step budgets [B, H, G])."""
        budgets = self.step_budgets(view, context)
        sampled = self.sampled_queries(view, context).to(view.keys.device)
        if self.include_current:  # q_0 votes too: its own top-p set is kept
            sampled = torch.cat([sampled, context.observations["window_queries"][:, :, -1:].float().to(sampled.device)], dim=2)
        queries = group_queries(sampled, view.shape[1])
        logits = torch.einsum("bhgsd,bhld->bhgsl", queries, view.keys.float()) * context.scaling
        if view.valid is not None:
            logits = logits.masked_fill(~view.valid[:, :, None, None, :], float("-inf"))
        return union_votes(logits, budgets), budgets

    @torch.no_grad()
    def prepare(self, view, context) -> None:
        """The union of votes of every head (``view.channels[VOTES]``, for the Votes scorer) and the step budgets."""
        if int(context.tokens_seen.max()) < 2:  # one token: no statistics to sample queries from, and nothing to gain
            context.note("gvote: a one-token prompt is kept whole")
            view.channels[VOTES] = view.valid_or_ones()
            view.channels[STEP_BUDGETS] = torch.zeros(view.shape[0], 0, dtype=torch.long)
            return
        keep, budgets = self.keep_mask(view, context)
        view.channels[VOTES] = keep
        view.channels[STEP_BUDGETS] = budgets.reshape(view.shape[0], -1).cpu()
        context.note("gvote: budget chosen per request and KV head (see entries_per_head)")

    def layer_budgets(self, budgets, view, context) -> torch.Tensor:
        """The largest union of each row (what a scorer's protected set may depend on)."""
        return view.channels[VOTES].sum(dim=-1).amax(dim=-1).cpu()

    def per_head(self, key, budgets, view, context) -> torch.Tensor:
        """Each head's union size, plus the scorer's protected entries."""
        return plus_protected(view.channels[VOTES].sum(dim=-1), key >= PROTECTED_PRIORITY, view.lengths)

    def record(self, edit: Edit, view, context) -> None:
        kept = (edit.keep & view.valid_or_ones()).sum(dim=-1).cpu() if edit.keep is not None else view.lengths.cpu()
        edit.state[STATE] = GVoteAllocation(step_budgets=view.channels[STEP_BUDGETS], kept=kept)


@dataclass
class Votes(Scorer):
    """An entry scores 1 when some sampled query voted for it, else 0 (the ``gvote`` sizer's union; no sinks)."""

    name: ClassVar[str] = "votes"
    about: ClassVar[str] = "1 for the entries GVote's sampled queries vote for (use with +gvote)"

    def check(self, policy) -> None:
        if not isinstance(policy.sizes, GVote):
            raise ValueError("the votes scorer reads the gvote sizer's votes: use it with +gvote")

    def score(self, view, context) -> torch.Tensor:
        return view.channels[VOTES].float()


VOTES, STEP_BUDGETS = "gvote_votes", "gvote_step_budgets"

__all__ = [
    "GVote",
    "GVoteAllocation",
    "Votes",
    "generator_for",
    "nucleus_budgets",
    "project_queries",
    "sample_hidden",
    "union_votes",
]
