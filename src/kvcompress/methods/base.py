"""What every method shares: the method contract, budgets, allocation over layers and heads, selection.

A method is a dataclass whose fields are its hyperparameters. It never writes storage: it
reads a ``KVView`` and a ``LayerContext`` and returns an ``Edit`` that the store applies.
The contract (all hooks optional):

* ``needs()``: what the prefill must record (window queries, attention sums, hidden stats);
* ``plan(layers)``: only for methods that plan across layers (``plans_globally``): sees
  every layer before any is cut and returns each layer's per-head sizes;
* ``compress(view, context, sizes=None)``: right after the prefill, an ``Edit``;
  ``sizes`` [B, H], when given, is how many entries each head keeps beyond the method's
  protected ones (a global plan's or another method's choice: GVote's ``select_with``);
* ``select(view, context)`` when ``selects``: before each decoding read, the entries to read
  (dynamic selection: Quest, OmniKV); the rest stay held but unread;
* ``wants_col_sums`` / ``decode_step(view, context, col_sums)``: while decoding, after
  each step's read (H2O and KeepKV accumulate attention, evictions keep the budget); a
  method whose step works row by row (``decodes_all_layers``) gets every layer at once;
* ``stats(states, counts)``: method-specific statistics from the layers' states and the
  tallies of its edits.

Score-based methods only implement ``score`` (and, if they want, ``protected``): turning
scores into a per-head keep set under a budget lives once, here, as small functions the
tests check against plain references:

    scores → chunk averaging (optional) → priority (protected entries first)
    → per-layer budget (uniform, pyramid, or one global budget over every layer and head)
    → per-head budgets (uniform or Ada-KV) → top entries per head → ``Edit(keep=...)``
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ..store.codecs import Codec
from ..store.view import Edit, KVView, LayerContext, LayerInput
from .spec import get_method

PROTECTED_PRIORITY = 1e15  # above any attention score; protected entries rank by recency above it
MAX_BUDGET = 2**31 - 1  # entries per KV head: a budget must fit the int32 slot tables


@dataclass(frozen=True)
class Needs:
    """What a method reads from the prefill: the last ``window`` queries, per-entry attention sums,
    the attention input's per-channel mean and std (``hidden_stats``), each token's attention input
    itself, at the prefill and at every decoding step (``hidden_states``: retention gates); the most
    attention any query of a replay of the context gives each entry, the context replayed after the
    prefill in chunks of ``replay`` tokens (KVzip; 0 = no replay); and what the store must keep as
    entries arrive: key bounds per page of ``key_pages`` entries (Quest; 0 = none)."""

    window: int = 0
    attention_sums: bool = False
    hidden_stats: bool = False
    key_pages: int = 0
    hidden_states: bool = False
    replay: int = 0

    def union(self, other: Needs) -> Needs:
        """What two methods need together (one shared prefill serving both; pages and replay chunks of the
        first size asked for — a fork wanting other pages rebuilds its own)."""
        return Needs(max(self.window, other.window), self.attention_sums or other.attention_sums,
                     self.hidden_stats or other.hidden_stats, self.key_pages or other.key_pages,
                     self.hidden_states or other.hidden_states, self.replay or other.replay)

    def covers(self, other: Needs) -> bool:
        """Whether a prefill that recorded this serves ``other`` (page bounds need no observation: a fork
        builds them from the keys held)."""
        return (self.window >= other.window and (self.attention_sums or not other.attention_sums)
                and (self.hidden_stats or not other.hidden_stats) and (self.hidden_states or not other.hidden_states)
                and other.replay in (0, self.replay))


@dataclass
class Method:
    """Base of every method: a budget (entries per KV head on average) or a ratio of the context.

    ``budget`` and ``ratio`` are exclusive. A budget at or above a row's context length keeps
    everything (nothing to compress) and the cache notes it in its stats. ``codec`` stores what
    the method holds as codes: a coding method's spec (``"kivi"``, ``"kivi:bits=4"``); None = plain.
    """

    budget: int | None = None
    ratio: float | None = None
    codec: str | None = None

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    needs_budget: ClassVar[bool] = True
    sizes_itself: ClassVar[str] = ""  # why a method without a budget takes no size (needs_budget False)
    acts_while_decoding: ClassVar[bool] = False  # decode_step is called after every decoding step
    keeps_every_entry: ClassVar[bool] = False  # nothing is ever evicted (selection and coding methods)

    def __post_init__(self) -> None:
        if self.codec is not None:
            self.coder()  # an unusable codec fails here, not at the first prefill
        if not self.needs_budget:
            if self.budget is not None or self.ratio is not None:
                raise ValueError(f"{self.name} takes no size: {self.sizes_itself}; do not give budget= or ratio=")
            return
        if (self.budget is None) == (self.ratio is None):
            raise ValueError(f"{self.name}: give exactly one of budget= (entries per KV head) or ratio= (fraction kept).")
        if self.budget is not None and (not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget <= 0):
            raise ValueError(f"{self.name}: budget must be a positive whole number of entries per KV head, got {self.budget!r}.")
        if self.budget is not None and self.budget > MAX_BUDGET:
            raise ValueError(f"{self.name}: budget={self.budget} is beyond any context ({MAX_BUDGET} entries per KV head at "
                             "most); to keep everything use ratio=1.0 or the full method.")
        if self.ratio is not None and not (0.0 < float(self.ratio) <= 1.0):
            raise ValueError(f"{self.name}: ratio must be in (0, 1] (the fraction of context entries kept), got {self.ratio!r}.")

    @property
    def label(self) -> str:
        """``name@budget`` or ``name@ratio`` for tables, then any option changed from its default."""
        size = f"@{self.budget}" if self.budget is not None else (f"@{self.ratio:g}" if self.ratio is not None else "")
        return self.name + size + self._options_suffix()

    @property
    def variant(self) -> str:
        """The name, then any option changed from its default (``keepkv[key_rule=votes]``): the
        ``method`` of result rows, so that ablations of one method stay apart."""
        return self.name + self._options_suffix()

    def _options_suffix(self) -> str:
        changed = self.changed_options()
        return f"[{','.join(f'{k}={v}' for k, v in changed.items())}]" if changed else ""

    def changed_options(self) -> dict:
        """Hyperparameters that differ from the method's defaults (budget and ratio aside)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("budget", "ratio") and getattr(self, f.name) != f.default
        }

    # ----- the contract -------------------------------------------------------------------------
    def storage(self, dtype: torch.dtype = torch.float32) -> tuple[Codec, int] | None:
        """How held entries are stored for a model of ``dtype``: (the codec, each head's newest entries kept
        plain), or None for plain storage (``codec``)."""
        coder = self.coder()
        return None if coder is None else coder.storage(dtype)

    def coder(self) -> Method | None:
        """The coding method named by ``codec`` (None: plain storage), checked; built once per method (a
        learned codec loads its checkpoint once, and every session of this method shares one pool tier)."""
        if self.codec is None:
            return None
        built = self.__dict__.get("_coder")
        if built is not None and built[0] == self.codec:
            return built[1]
        if not isinstance(self.codec, str):
            raise ValueError(f"codec must name a coding method such as \"kivi:bits=4\", got {self.codec!r}")
        coder = get_method(self.codec)
        if type(coder).storage is Method.storage:
            raise ValueError(f"codec={self.codec!r} is not a codec; coding methods: kivi, deltakv")
        if coder.name == "deltakv" and not self.keeps_every_entry:
            raise ValueError(f"{self.name} evicts entries head by head, and deltakv codes a token over every KV head at "
                             "once: use codec=\"kivi\" with it, or deltakv with a method that keeps every entry "
                             "(omnikv, quest)")
        self.__dict__["_coder"] = (self.codec, coder)
        return coder

    def needs(self) -> Needs:
        return Needs()

    def check_model(self, config) -> None:
        """Raise a ValueError naming the fix when this method cannot run on a model of ``config`` (a
        transformers config; learned methods check their checkpoint's shape). Called before any work."""
        coder = self.coder()
        if coder is not None:
            coder.check_model(config)

    @property
    def plans_globally(self) -> bool:
        """True when sizes are chosen across layers: the session calls ``plan`` once every layer is observed."""
        return False

    def plan(self, layers: Sequence[LayerInput]) -> list[torch.Tensor]:
        """Per layer, the entries [B, H] each head keeps beyond its protected ones (``plans_globally`` only)."""
        raise NotImplementedError(f"{self.name} plans layer by layer")

    def compress(self, view: KVView, context: LayerContext, sizes: torch.Tensor | None = None) -> Edit | None:
        """What to do to a layer right after its prefill (default: keep everything)."""
        return None

    @property
    def selects(self) -> bool:
        """True when the method chooses, before each decoding read, which held entries to read."""
        return False

    def select(self, view: KVView, context: LayerContext) -> torch.Tensor | None:
        """Entries to read this step: indices [B, H, k] into the view's L (-1: none), or None for all."""
        return None

    def wants_col_sums(self, context: LayerContext) -> bool:
        """Whether this decoding step's read (its queries in ``context``) should return per-entry column sums."""
        return False

    def decode_step(self, view: KVView, context: LayerContext, col_sums: torch.Tensor | None) -> Edit | None:
        """After each decoding step's read (``acts_while_decoding`` methods): the view includes the new entries."""
        return None

    @property
    def decodes_all_layers(self) -> bool:
        """True when ``decode_step`` works row by row (its state has a row per batch row), so the session
        may call it once per step on every layer at once instead of once per layer."""
        return False

    def stats(self, states: Sequence[Mapping[str, Any]], counts: Mapping[str, int]) -> dict:
        """Method-specific statistics from every layer's state (errors, bytes kept elsewhere) and the
        tallies of its edits (merges...)."""
        return {}

    # ----- budgets --------------------------------------------------------------------------
    @property
    def always_kept(self) -> int:
        """Entries per KV head the method keeps of any prompt whatever its size (sinks, an observation
        window): a prompt no longer than this is kept whole, since compressing it would only keep less
        than the method means to."""
        return 0

    def kept_per_head(self, context_tokens: int) -> int | None:
        """Entries per KV head (on average over layers) the method keeps of a prompt of ``context_tokens``,
        or None when it cannot say before seeing the prompt (it may keep everything)."""
        if not self.needs_budget:
            return None
        if context_tokens <= self.always_kept:
            return context_tokens
        if self.budget is not None:
            return min(self.budget, context_tokens)
        return max(1, int(context_tokens * self.ratio + 1e-9))

    def row_budgets(self, context: LayerContext) -> torch.Tensor:
        """Entries per KV head for each batch row [B] (int64): the budget, or ⌊ratio × real tokens⌋
        (floored, as kvpress does, so that both keep the same number of entries)."""
        tokens = context.tokens_seen
        if self.budget is not None:
            budgets = torch.full_like(tokens, self.budget)
        else:
            budgets = torch.clamp((tokens.double() * self.ratio + 1e-9).floor().long(), min=1)
        if bool((budgets >= tokens).any()):
            context.note("budget >= context length for some rows: everything kept there")
        short = tokens <= self.always_kept
        if bool(short.any()):
            context.note(f"{self.name} always keeps {self.always_kept} entries per head (sinks and window): a prompt no "
                         "longer than that is kept whole")
        return torch.where(short, tokens, torch.minimum(budgets, tokens))

    def decode_budget(self, context: LayerContext) -> torch.Tensor:
        """Per-row entries per head allowed while decoding: the budget, or ratio × tokens so far (everything while
        the row holds no more than the method always keeps)."""
        tokens = context.tokens_seen
        if self.budget is not None:
            budgets = torch.full_like(tokens, self.budget)
        else:
            budgets = torch.clamp((tokens.double() * self.ratio).ceil().long(), min=1)
        return torch.where(tokens <= self.always_kept, tokens, budgets)


# ----- selection helpers (plain tensor code, tested against references) ------------------------
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
    winners = torch.zeros_like(flat, dtype=torch.bool)
    for row in range(flat.shape[0]):
        take = min(int(totals[row]), int(torch.isfinite(flat[row]).sum()))
        winners[row, torch.topk(flat[row], take).indices] = True
    sizes, start = [], 0
    for k in open_keys:
        count = k.shape[1] * k.shape[2]
        sizes.append(winners[:, start : start + count].view(k.shape).sum(dim=-1).cpu())
        start += count
    return sizes


def top_per_head(key: torch.Tensor, head_budgets: torch.Tensor) -> torch.Tensor:
    """Keep mask [B, H, L]: the ``head_budgets[b, h]`` entries with the highest key per head."""
    order = key.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(key.shape[-1], device=key.device).expand_as(order))
    return (rank < head_budgets[..., None].to(rank.device)) & torch.isfinite(key)


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


@dataclass
class ScoreMethod(Method):
    """Evict by score: subclasses implement ``score`` (and optionally ``protected``).

    Options shared by every score-based method:
        sinks: first tokens always kept.
        chunk_size: average scores over chunks of this many adjacent tokens and keep whole
            chunks (1 = off; MomentKV's protocol uses 4).
        head_budgets: "uniform" (every KV head gets the layer budget) or "adaptive" (Ada-KV).
        alpha: Ada-KV's floor (each head gets at least α·B).
        layer_budgets: "uniform", "pyramid" (PyramidKV) or "global": one budget
            (budget × layers × KV heads per row) over every layer and head at once, the
            unprotected entries ranked by score across layers (layers and heads then keep
            different numbers of entries; ``head_budgets`` does not apply).
        pyramid_ratio: first-layer budget ÷ last-layer budget for "pyramid".
        threshold: size by score instead (DMS-style, METHODS.md "Threshold sizing"): each head of each
            request keeps its protected entries and those scoring at least τ, up to the budget (or
            ratio), which becomes a cap (ratio=1.0: no cap); so the entries held follow the content.
            τ is on the method's own score scale (KVzip: the most attention a replay query pays an
            entry). The prompt only: an entry that arrives while decoding is kept.
    """

    sinks: int = 0
    chunk_size: int = 1
    head_budgets: str = "uniform"
    alpha: float = 0.2
    layer_budgets: str = "uniform"
    pyramid_ratio: float = 4.0
    threshold: float | None = None

    evict_while_decoding: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_budgets not in ("uniform", "adaptive"):
            raise ValueError(f"head_budgets must be 'uniform' or 'adaptive', got {self.head_budgets!r}")
        if self.layer_budgets not in ("uniform", "pyramid", "global"):
            raise ValueError(f"layer_budgets must be 'uniform', 'pyramid' or 'global', got {self.layer_budgets!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.chunk_size < 1 or self.sinks < 0:
            raise ValueError("chunk_size must be ≥ 1 and sinks ≥ 0")
        if not self.pyramid_ratio >= 1.0:
            raise ValueError(f"pyramid_ratio (the first layer's budget over the last's) must be ≥ 1, got {self.pyramid_ratio}")
        if self.threshold is not None:
            if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not math.isfinite(self.threshold):
                raise ValueError(f"threshold must be a finite number (the score an entry needs to stay), got {self.threshold!r}")
            if self.evict_while_decoding:
                raise ValueError(f"{self.name} evicts to its budget while decoding; threshold sizing is for methods that "
                                 "compress the prompt once (kvzip, snapkv, expected_attention...)")

    @property
    def acts_while_decoding(self) -> bool:  # type: ignore[override]
        return self.evict_while_decoding

    @property
    def always_kept(self) -> int:
        return self.sinks

    @property
    def decodes_all_layers(self) -> bool:
        return True  # eviction by score: row by row, nothing but channels carried

    def score(self, view: KVView, context: LayerContext) -> torch.Tensor:
        """Importance of each entry, [B, H, L] float32."""
        raise NotImplementedError

    def protected(self, view: KVView, context: LayerContext, budgets: torch.Tensor) -> torch.Tensor:
        """Entries kept whatever their score ([B, H, L] bool); default: the sinks."""
        return sink_mask(view.positions, view.valid, self.sinks)

    def layer_budget(self, context: LayerContext) -> torch.Tensor:
        """Entries per KV head for this layer and each row [B]."""
        budgets = self.row_budgets(context)
        if self.layer_budgets != "pyramid":
            return budgets
        per_row = [
            pyramid_layer_budgets(int(b), context.num_layers, self.pyramid_ratio, int(n))[context.layer_idx]
            for b, n in zip(budgets.tolist(), context.tokens_seen.tolist())
        ]
        return torch.tensor(per_row, dtype=torch.long)

    def ranking_key(self, view: KVView, context: LayerContext, budgets: torch.Tensor) -> torch.Tensor:
        """[B, H, L]: chunk-averaged scores, protected entries first (+inf), -inf on padding."""
        scores = chunk_average(self.score(view, context), view.valid, self.chunk_size)
        return priority(scores, self.protected(view, context, budgets), view.positions, view.valid)

    def select(self, view: KVView, context: LayerContext, budgets: torch.Tensor, head_budgets: str) -> torch.Tensor:
        """Keep mask [B, H, L] under per-row layer budgets [B]."""
        key = self.ranking_key(view, context, budgets)
        if head_budgets == "adaptive":
            per_head = adaptive_head_budgets(key, budgets, self.alpha, view.lengths)
        else:
            per_head = torch.minimum(budgets[:, None].expand(-1, view.shape[1]), view.lengths)
        return top_per_head(key, per_head)

    @property
    def plans_globally(self) -> bool:
        return self.layer_budgets == "global" and self.threshold is None

    def plan(self, layers: Sequence[LayerInput]) -> list[torch.Tensor]:
        """``layer_budgets="global"``: the row's budget × layers × KV heads, less what every layer
        protects, goes to the best-ranked unprotected entries over all layers and heads."""
        keys, protected = [], torch.zeros(layers[0].context.batch_size, dtype=torch.long)
        budgets = self.row_budgets(layers[0].context)
        for layer in layers:
            view, context = layer.view, layer.context
            key = self.ranking_key(view, context, budgets)
            keys.append(key)
            protected += (key >= PROTECTED_PRIORITY).sum(dim=(1, 2)).cpu()
        heads = sum(k.shape[1] for k in keys)
        return global_sizes(keys, torch.clamp(budgets * heads - protected, min=0))

    def compress(self, view: KVView, context: LayerContext, sizes: torch.Tensor | None = None) -> Edit:
        if sizes is None and self.threshold is not None:
            return Edit(keep=self.keep_above_threshold(view, context, self.layer_budget(context)))
        if sizes is None:
            return Edit(keep=self.select(view, context, self.layer_budget(context), self.head_budgets))
        budgets = self._sized_budgets(sizes, context)
        key = self.ranking_key(view, context, budgets)
        return Edit(keep=top_per_head(key, plus_protected(sizes, self.protected(view, context, budgets), view.lengths)))

    def keep_above_threshold(self, view: KVView, context: LayerContext, caps: torch.Tensor) -> torch.Tensor:
        """Keep mask [B, H, L]: per head, the protected entries and those scoring ≥ ``threshold``, at most
        ``caps[b]`` (never fewer than the protected ones), the best first."""
        key = self.ranking_key(view, context, caps)
        protected = (key >= PROTECTED_PRIORITY).sum(dim=-1)
        passing = (key >= self.threshold).sum(dim=-1)  # protected keys rank above any threshold
        counts = torch.minimum(passing, torch.maximum(caps[:, None].to(key.device), protected))
        return top_per_head(key, counts)

    def _sized_budgets(self, sizes: torch.Tensor, context: LayerContext) -> torch.Tensor:
        """The per-row budget that protected sets depend on, when sizes come from elsewhere: the
        method's own under a global plan, the largest size otherwise (GVote)."""
        return self.row_budgets(context) if self.plans_globally else sizes.amax(dim=-1)

    def decode_step(self, view: KVView, context: LayerContext, col_sums: torch.Tensor | None) -> Edit | None:
        budgets = self.decode_budget(context)
        if not bool((view.lengths > budgets[:, None]).any()):
            return None
        return Edit(keep=self.select(view, context, budgets, "uniform"))


__all__ = [
    "PROTECTED_PRIORITY",
    "global_sizes",
    "plus_protected",
    "Method",
    "Needs",
    "ScoreMethod",
    "adaptive_head_budgets",
    "chunk_average",
    "pool_scores",
    "priority",
    "pyramid_layer_budgets",
    "recent_mask",
    "round_preserving_sum",
    "sink_mask",
    "top_per_head",
]
