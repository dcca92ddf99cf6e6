"""The parts a policy is assembled from, one base per role (../shared/DESIGN.md, "Methods"):

* a **scorer** (``Scorer``): what each entry is worth, and which entries are kept whatever they score;
* a **sizer** (``Sizer``): how many entries each head, layer or request keeps;
* a **fate** (``Fate``): what happens to the entries that leave (dropped, merged, folded into moments);
* a **decoding rule** (``Decoding``): what happens while decoding (nothing, or evict back to the size);
* a **read rule** (``Reads``): which held entries each decoding step reads (all, or Quest's / OmniKV's choice);
* a **storage** (``Storage``): how held entries are stored (plain, KIVI codes, DeltaKV codes).

A part is a dataclass whose fields are its options; it never writes storage. ``Policy`` (policy.py) calls
the parts; the spec grammar (spec.py) names them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from ..store.view import Edit, KVView, LayerContext, LayerInput
from .budget import Budget
from .selection import chunk_average, priority, sink_mask



def capped(budgets: torch.Tensor, view: KVView) -> torch.Tensor:
    """[B, H]: each row's size [B], at most what each head holds."""
    return torch.minimum(budgets[:, None].expand(-1, view.shape[1]).to(view.lengths.device), view.lengths)


@dataclass(frozen=True)
class Needs:
    """What a policy reads from the prefill: the last ``window`` queries, per-entry attention sums,
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
        """What two needs ask together (one shared prefill serving both; pages and replay chunks of the
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


@dataclass(frozen=True)
class Ranking:
    """A layer's scores [B, H, L] float32, its protected entries [B, H, L] bool and the ranking key [B, H, L]
    float64 built from both (chunk-averaged scores, protected entries first, -inf on padding)."""

    scores: torch.Tensor
    protected: torch.Tensor
    key: torch.Tensor


@dataclass
class Part:
    """A piece of a policy: its dataclass fields are its options, ``name`` its name in a spec."""

    name: ClassVar[str] = ""
    role: ClassVar[str] = ""
    about: ClassVar[str] = ""  # one line for `kvcompress methods`

    def needs(self) -> Needs:
        return Needs()

    def check_model(self, config) -> None:
        """Raise a ValueError naming the fix when this part cannot run on a model of ``config``."""

    def check(self, policy) -> None:
        """Raise a ValueError naming the fix when this part cannot work with the policy's other parts."""

    def changed_options(self) -> dict:
        """Options that differ from this part's defaults."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    def stats(self, states: Sequence[Mapping[str, Any]], counts: Mapping[str, int]) -> dict:
        """Statistics from every layer's state and the tallies of the policy's edits."""
        return {}


@dataclass
class Scorer(Part):
    """What each entry is worth ([B, H, L] float32, higher is kept first) and what is kept whatever it scores.

    Options every scorer has: ``sinks`` (first tokens always kept) and ``chunk_size`` (rank chunks of this many
    adjacent entries by their mean score and keep them whole; 1 = off, MomentKV's protocol uses 4)."""

    sinks: int = 0
    chunk_size: int = 1

    role: ClassVar[str] = "score"
    channels: ClassVar[tuple[str, ...]] = ()  # per-entry channels the scorer carries from step to step

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.sinks < 0:
            raise ValueError(f"{self.name}: chunk_size must be ≥ 1 and sinks ≥ 0")

    @property
    def always_kept(self) -> int:
        """Entries per KV head kept of any prompt (sinks, an observation window): a prompt no longer is kept whole."""
        return self.sinks

    def prepare(self, view: KVView, context: LayerContext) -> None:
        """Before a prefill's scores: put the scorer's channels in ``view.channels`` (their first values)."""

    def score(self, view: KVView, context: LayerContext) -> torch.Tensor:
        raise NotImplementedError

    def protected(self, view: KVView, context: LayerContext, budgets: torch.Tensor) -> torch.Tensor:
        """Entries kept whatever their score [B, H, L] bool under per-row sizes ``budgets`` [B]; default: the sinks."""
        return sink_mask(view.positions, view.valid, self.sinks)

    def ranking(self, view: KVView, context: LayerContext, budgets: torch.Tensor) -> Ranking:
        """Scores, protected entries and the ranking key under per-row sizes ``budgets`` [B]."""
        scores = self.score(view, context)
        protected = self.protected(view, context, budgets)
        key = priority(chunk_average(scores, view.valid, self.chunk_size), protected, view.positions, view.valid)
        return Ranking(scores, protected, key)

    # ----- while decoding -----------------------------------------------------------------------
    def wants_col_sums(self, context: LayerContext) -> bool:
        """Whether a decoding step's read should return per-entry column sums for ``observe_step``."""
        return False

    def observe_step(self, view: KVView, context: LayerContext, col_sums: torch.Tensor | None) -> None:
        """After a decoding step's read: update the scorer's channels in ``view.channels``."""

    def decode_score(self, view: KVView, context: LayerContext, col_sums: torch.Tensor | None) -> torch.Tensor:
        """Scores when a decoding step evicts (default: ``score``)."""
        return self.score(view, context)

    def decode_protected(self, view: KVView, context: LayerContext, budgets: torch.Tensor) -> torch.Tensor:
        """Entries a decoding step never evicts (default: ``protected``)."""
        return self.protected(view, context, budgets)

    def decode_key(self, view: KVView, context: LayerContext, col_sums: torch.Tensor | None, budgets: torch.Tensor) -> torch.Tensor:
        scores = chunk_average(self.decode_score(view, context, col_sums), view.valid, self.chunk_size)
        return priority(scores, self.decode_protected(view, context, budgets), view.positions, view.valid)


@dataclass
class Sizer(Part):
    """How many entries each KV head keeps beyond and including its protected ones."""

    role: ClassVar[str] = "sizes"
    sizes_itself: ClassVar[str] = ""  # why a policy with this sizer takes no size ("" = it takes one)

    @property
    def plans_globally(self) -> bool:
        """True when sizes are chosen across layers: ``plan`` runs once every layer is observed."""
        return False

    def prepare(self, view: KVView, context: LayerContext) -> None:
        """Before the prefill's scores (GVote records its votes for its scorer)."""

    def record(self, edit: Edit, view: KVView, context: LayerContext) -> None:
        """After the fate's edit: what the sizer decided, in the edit's state (GVote's allocation)."""

    def plan(self, policy, layers: Sequence[LayerInput]) -> list[torch.Tensor]:
        raise NotImplementedError(f"{self.name} sizes layer by layer")

    def layer_budgets(self, budgets: torch.Tensor, view: KVView, context: LayerContext) -> torch.Tensor:
        """This layer's entries per KV head for each row [B] from the rows' sizes [B] (default: the same)."""
        return budgets

    def per_head(self, key: torch.Tensor, budgets: torch.Tensor, view: KVView, context: LayerContext) -> torch.Tensor:
        """Entries each KV head keeps [B, H], protected ones included, from the ranking key [B, H, L] and the
        layer's per-row budgets [B] (default: the layer's size, at most what each head holds)."""
        return capped(budgets, view)

    def decode_per_head(self, policy, view: KVView, context: LayerContext, key: Callable[[], torch.Tensor],
                        budgets: torch.Tensor, slack: int) -> torch.Tensor | None:
        """While decoding, [B, H]: once a head holds more than its size + ``slack``, every head over its size goes back
        to it (the others as they are), so that the heads cross again together, ``slack`` steps on, where heads of
        different sizes (Ada-KV's) would otherwise cross one by one, an eviction almost every step; None when no head
        holds more than size + ``slack``. ``key()``: the scorer's decoding key [B, H, L] (made once, on first use)."""
        lengths = view.lengths
        sizes = budgets[:, None].to(lengths.device)
        if not bool((lengths > sizes + slack).any()):
            return None
        return torch.where(lengths > sizes, capped(budgets, view), lengths)


@dataclass
class Fate(Part):
    """What becomes of the entries that leave: the edit that keeps ``per_head`` [B, H] entries per head."""

    role: ClassVar[str] = "fate"

    def evict(self, policy, view: KVView, context: LayerContext, ranking: Ranking, per_head: torch.Tensor,
              budgets: torch.Tensor) -> Edit:
        """At the prefill: keep ``per_head`` [B, H] entries per head by ``ranking``; ``budgets`` [B] the layer's sizes."""
        raise NotImplementedError

    @property
    def decodes_all_layers(self) -> bool:
        """True when the fate's decoding work goes row by row (the session may pass every layer at once)."""
        return True

    def decode(self, policy, view: KVView, context: LayerContext, col_sums: torch.Tensor | None,
               budgets: torch.Tensor, slack: int) -> Edit | None:
        """After a decoding step's read, for a policy that evicts: back to ``budgets`` [B] where a head holds more
        than size + ``slack`` (the sizer says where)."""
        key = functools.cache(functools.partial(policy.score.decode_key, view, context, col_sums, budgets))
        per_head = policy.sizes.decode_per_head(policy, view, context, key, budgets, slack)
        return None if per_head is None else self.decode_evict(policy, view, context, col_sums, key, per_head, budgets)

    def decode_evict(self, policy, view: KVView, context: LayerContext, col_sums: torch.Tensor | None,
                     key: Callable[[], torch.Tensor], per_head: torch.Tensor, budgets: torch.Tensor) -> Edit:
        """While decoding: keep ``per_head`` [B, H] entries per head (fewer than it holds where it holds more than
        its size), the rows' sizes being ``budgets`` [B]; ``key()`` the scorer's decoding key (made once, when asked)."""
        raise NotImplementedError


@dataclass
class Decoding(Part):
    """What a policy does after each decoding step's read."""

    role: ClassVar[str] = "decoding"

    @property
    def acts(self) -> bool:
        return False


@dataclass
class Reads(Part):
    """Which held entries each decoding step reads; its size is the policy's (or its own ``read_budget``)."""

    read_budget: int | None = None
    read_ratio: float | None = None

    role: ClassVar[str] = "reads"

    def __post_init__(self) -> None:
        if self.has_own_size:
            _ = self.own_size  # checked here, not at the first step

    @property
    def has_own_size(self) -> bool:
        return self.read_budget is not None or self.read_ratio is not None

    @functools.cached_property
    def own_size(self) -> Budget:
        """The entries read per step and KV head when the policy's size is what its scorer keeps (checked once)."""
        return Budget.check(f"{self.name} (read_budget or read_ratio)", self.read_budget, self.read_ratio)

    def check(self, policy) -> None:
        if policy.score is not None and not self.has_own_size:
            raise ValueError(f"{policy.name}: the policy's size is what its scorer keeps; give {self.name} its own read "
                             f"size (+{self.name}:read_ratio=0.1 or read_budget=N): the entries each step reads")
        if policy.score is None and self.has_own_size:
            raise ValueError(f"{self.name}: read_budget/read_ratio are for a policy that also evicts; without a scorer the "
                             "policy's budget= or ratio= is the entries each step reads")

    def select(self, policy, view: KVView, context: LayerContext) -> torch.Tensor | None:
        """Entries to read this step: indices [B, H, k] into the view's L (-1: none), or None for all."""
        raise NotImplementedError

    def wants_read_weights(self, policy, context: LayerContext) -> bool:
        """Whether this layer's decoding read should hand each entry's weight to ``read_weights`` (after ``select``)."""
        return False

    def read_weights(self, policy, view: KVView, context: LayerContext, weights: torch.Tensor) -> None:
        """After a decoding read that ``wants_read_weights``: each entry's weight [B, H, G, L] for the step's query."""

    def layers_read_whole(self, num_layers: int) -> tuple[int, ...]:
        """Layers whose decoding steps read every held entry (a storage that rebuilds what it reads keeps them plain)."""
        return ()


@dataclass
class Storage(Part):
    """How held entries are stored: a codec and each head's newest entries kept plain."""

    role: ClassVar[str] = "storage"
    codes_tokens: ClassVar[bool] = False  # a token is coded over every KV head at once (DeltaKV)
    sizes_itself: ClassVar[str] = "it keeps every entry, and its codes set the bytes held"

    def check(self, policy) -> None:
        if self.codes_tokens and policy.evicts:
            raise ValueError(f"{policy.label} evicts entries head by head, and {self.name} codes a token over every KV "
                             "head at once: use +kivi with it, or deltakv with a policy that keeps every entry "
                             "(omnikv, quest)")

    def storage(self, dtype: torch.dtype, read_whole: tuple[int, ...] = ()) -> tuple[Any, int]:
        """(the codec, each head's newest entries kept plain) for a model of ``dtype``; ``read_whole``: the layers
        whose every entry each decoding step reads (``Reads.layers_read_whole``)."""
        raise NotImplementedError


ROLES = ("score", "sizes", "fate", "decoding", "reads", "storage")

__all__ = ["ROLES", "Decoding", "Fate", "Needs", "Part", "Ranking", "Reads", "Scorer", "Sizer", "Storage", "capped"]
