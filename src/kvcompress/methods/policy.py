"""``Policy``: a method, assembled from parts (parts.py) and a size (budget.py).

    Policy(score=SnapKV(), sizes=Adaptive(alpha=0.2), fate=Drop(), decoding=Static(), reads=None, storage=None,
           ratio=0.25)

The session calls a policy, never a part. After the prefill, per layer: the sizer and the scorer prepare what
they keep per entry, the scorer ranks the entries (its protected ones first), the sizer says how many each head
keeps (or a plan across layers did: ``plans_globally``), and the fate turns that into the ``Edit`` the store
applies (drop, merge, fold into moments). While decoding, a policy whose decoding rule evicts lets the scorer
see the step and the fate cut each head back to its size; a policy with a read rule chooses what each step
reads. The storage says how held entries are stored. A policy without a scorer keeps every entry.

Today's method names (``snapkv``, ``keepkv``, ``kvzip``...) are presets of parts (presets.py); the spec
grammar (spec.py) writes any policy in one line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..store.view import Edit, KVView, LayerContext, LayerInput
from .budget import Budget
from .decoding import Static
from .fates import Drop
from .parts import ROLES, Decoding, Fate, Needs, Ranking, Reads, Scorer, Sizer, Storage
from .selection import PROTECTED_PRIORITY, plus_protected
from .sizers import Uniform


@dataclass
class Policy:
    """A KV-cache policy: a scorer, a sizer, a fate, a decoding rule, a read rule and a storage, with a size.

    ``budget`` (entries per KV head on average) or ``ratio`` (the fraction of the context kept) sizes what the
    scorer ranks — or, without a scorer, what the read rule reads. A sizer that sizes itself (GVote) and a
    policy that keeps and reads everything take no size. ``preset`` names the preset the parts came from
    (its name heads the policy's label)."""

    score: Scorer | None = None
    sizes: Sizer = field(default_factory=Uniform)
    fate: Fate = field(default_factory=Drop)
    decoding: Decoding = field(default_factory=Static)
    reads: Reads | None = None
    storage: Storage | None = None
    budget: int | None = None
    ratio: float | None = None
    preset: str | None = None

    def __post_init__(self) -> None:
        for role, part in self.parts().items():
            wanted = _ROLE_BASES[role]
            if not isinstance(part, wanted):
                raise ValueError(f"{role}= takes a {wanted.__name__} part, got {part!r}")
        if not self.takes_size:
            if self.budget is not None or self.ratio is not None:
                raise ValueError(f"{self.name} takes no size: {self.why_no_size}; do not give budget= or ratio=")
            self.size: Budget | None = None
        else:
            self.size = Budget.check(self.name, self.budget, self.ratio)
            self.ratio = self.size.ratio
        if self.score is None:
            for role in ("sizes", "fate", "decoding"):
                part = getattr(self, role)
                if type(part) is not type(_DEFAULTS[role]):
                    raise ValueError(f"+{part.name} acts on what a scorer ranks, and {self.name} has none: give it a "
                                     "scorer (snapkv, kvzip, h2o...)")
        for part in self.parts().values():
            part.check(self)

    # ----- what the policy is ---------------------------------------------------------------------
    def parts(self) -> dict[str, Any]:
        """The parts present, by role."""
        return {role: getattr(self, role) for role in ROLES if getattr(self, role) is not None}

    @property
    def name(self) -> str:
        """The preset's name, else the parts' names joined by ``+`` (``kvzip+adaptive``)."""
        return self.preset or "+".join(part.name for part in self._differences()[1]) or "full"

    @property
    def evicts(self) -> bool:
        """Whether entries leave the cache (a scorer ranks them under a size)."""
        return self.score is not None

    @property
    def takes_size(self) -> bool:
        """Whether the policy is sized by a budget or a ratio."""
        return not self.why_no_size

    @property
    def why_no_size(self) -> str:
        """Why the policy takes no size ("" when it takes one)."""
        return no_size_reason(self.parts())

    @property
    def variant(self) -> str:
        """The name and every option changed from the preset's (or the parts') defaults: ``snapkv[window=16]``,
        ``kvzip+adaptive[alpha=0.3]``: the ``method`` of result rows, so that ablations stay apart."""
        return self._describe("")

    @property
    def label(self) -> str:
        """``variant`` with the size after the name: ``snapkv@0.25[window=16]+kivi[bits=4]``."""
        return self._describe(self.size.label if self.size is not None else "")

    def _describe(self, size: str) -> str:
        changed, added = self._differences()
        pieces = [self.preset + size + _options(changed)] if self.preset else []
        for part in added:
            pieces.append(part.name + ("" if pieces else size) + _options(part.changed_options()))
        return "+".join(pieces) or "full" + size

    def _differences(self) -> tuple[dict, list]:
        """Options changed within the preset's parts (the defaults' without a preset), and the other parts."""
        base = {**_DEFAULTS, **(PRESETS[self.preset].parts() if self.preset in PRESETS else {})}
        changed, added = {}, []
        for role in ROLES:
            part, ref = getattr(self, role), base.get(role)
            if part is None:
                continue
            if ref is not None and type(part) is type(ref):
                changed.update({f.name: getattr(part, f.name) for f in fields(part) if getattr(part, f.name) != getattr(ref, f.name)})
            else:
                added.append(part)
        return changed, added

    # ----- the contract the session calls ----------------------------------------------------------
    def needs(self) -> Needs:
        needs = Needs()
        for part in self.parts().values():
            needs = needs.union(part.needs())
        return needs

    def check_model(self, config) -> None:
        """Raise a ValueError naming the fix when a part cannot run on a model of ``config`` (a transformers
        config; learned parts check their checkpoint's shape). Called before any work."""
        for part in self.parts().values():
            part.check_model(config)

    def storage_for(self, dtype: torch.dtype, num_layers: int) -> tuple[Any, int] | None:
        """How held entries are stored for a model of ``dtype`` and ``num_layers`` layers: (the codec, each head's
        newest entries kept plain), or None for plain storage."""
        if self.storage is None:
            return None
        return self.storage.storage(dtype, self.reads.layers_read_whole(num_layers) if self.reads is not None else ())

    @property
    def always_kept(self) -> int:
        return 0 if self.score is None else self.score.always_kept

    def kept_per_head(self, context_tokens: int) -> int | None:
        """Entries per KV head (on average over layers) kept of a prompt of ``context_tokens`` — at most, for a
        threshold — or None when the policy cannot say before seeing the prompt (or keeps everything)."""
        if self.score is None or self.size is None:
            return None
        if context_tokens <= self.always_kept:
            return context_tokens
        return self.size.count(context_tokens)

    def row_budgets(self, context: LayerContext) -> torch.Tensor:
        """Entries per KV head for each row [B] (int64): the size, at most the row's tokens; the whole row when
        it holds no more than the scorer always keeps. Notes both cases."""
        tokens = context.tokens_seen
        if self.size is None:
            return tokens.clone()  # a sizer that sizes itself: the row is its bound
        budgets = self.size.entries(tokens)
        if bool((budgets >= tokens).any()):
            context.note("budget >= context length for some rows: everything kept there")
        short = tokens <= self.always_kept
        if bool(short.any()):
            context.note(f"{self.name} always keeps {self.always_kept} entries per head (sinks and window): a prompt no "
                         "longer than that is kept whole")
        return torch.where(short, tokens, torch.minimum(budgets, tokens))

    def decode_budgets(self, context: LayerContext) -> torch.Tensor:
        """Per-row entries per head allowed while decoding: the size of the tokens so far (everything while the
        row holds no more than the scorer always keeps)."""
        tokens = context.tokens_seen
        return torch.where(tokens <= self.always_kept, tokens, self.size.entries(tokens))

    def read_budgets(self, context: LayerContext) -> torch.Tensor:
        """Entries each row reads per KV head at a decoding step [B]: the read rule's own size, else the policy's."""
        size = self.reads.own_size if self.reads is not None and self.reads.has_own_size else self.size
        return size.entries(context.tokens_seen)

    def prepare(self, view: KVView, context: LayerContext) -> None:
        """Before a layer's prefill ranking: the sizer's and the scorer's channels."""
        self.sizes.prepare(view, context)
        self.score.prepare(view, context)

    def ranking(self, view: KVView, context: LayerContext, budgets: torch.Tensor) -> Ranking:
        """The scorer's ranking of a layer at the prefill, after the sizer and the scorer prepared their channels."""
        self.prepare(view, context)
        return self.score.ranking(view, context, budgets)

    @property
    def plans_globally(self) -> bool:
        return self.score is not None and self.sizes.plans_globally

    def plan(self, layers: Sequence[LayerInput]) -> list[torch.Tensor]:
        """Per layer, the entries [B, H] each head keeps beyond its protected ones (``plans_globally`` only)."""
        return self.sizes.plan(self, layers)

    def compress(self, view: KVView, context: LayerContext, sizes: torch.Tensor | None = None) -> Edit | None:
        """The edit of a layer right after its prefill (None: keep everything); ``sizes`` [B, H]: a global plan's
        entries per head beyond the protected ones."""
        if self.score is None:
            return None
        self.prepare(view, context)
        budgets = self.sizes.layer_budgets(self.row_budgets(context), view, context)
        ranking = self.score.ranking(view, context, budgets)
        if sizes is not None:
            per_head = plus_protected(sizes, ranking.key >= PROTECTED_PRIORITY, view.lengths)
        else:
            per_head = self.sizes.per_head(ranking.key, budgets, view, context)
        edit = self.fate.evict(self, view, context, ranking, per_head, budgets)
        self.sizes.record(edit, view, context)
        return self._with_channels(edit, view)

    @property
    def selects(self) -> bool:
        """True when the policy chooses, before each decoding read, which held entries to read."""
        return self.reads is not None

    def select(self, view: KVView, context: LayerContext) -> torch.Tensor | None:
        """Entries to read this step: indices [B, H, k] into the view's L (-1: none), or None for all."""
        return self.reads.select(self, view, context)

    def wants_read_weights(self, context: LayerContext) -> bool:
        """Whether the read rule takes this decoding read's per-entry weights (OmniKV's filter layers)."""
        return self.reads is not None and self.reads.wants_read_weights(self, context)

    def read_weights(self, view: KVView, context: LayerContext, weights: torch.Tensor) -> None:
        self.reads.read_weights(self, view, context, weights)

    @property
    def acts_while_decoding(self) -> bool:
        return self.score is not None and self.decoding.acts

    def wants_col_sums(self, context: LayerContext) -> bool:
        """Whether this decoding step's read should return per-entry column sums."""
        return self.score is not None and self.score.wants_col_sums(context)

    @property
    def decodes_all_layers(self) -> bool:
        """True when the decoding step works row by row, so the session may call it on every layer at once."""
        return self.fate.decodes_all_layers

    def decode_step(self, view: KVView, context: LayerContext, col_sums: torch.Tensor | None) -> Edit | None:
        """After a decoding step's read (the view includes the step's entries): the scorer sees the step, then
        heads over their size go back to it."""
        self.score.observe_step(view, context, col_sums)
        edit = self.fate.decode(self, view, context, col_sums, self.decode_budgets(context), self.decoding.slack)
        if edit is None and not self.score.channels:
            return None
        return self._with_channels(edit or Edit(), view)

    def _with_channels(self, edit: Edit | None, view: KVView) -> Edit | None:
        """The edit carrying the scorer's channels as the view holds them (unless the fate set them)."""
        if edit is None or edit.replace is not None or not self.score.channels:
            return edit  # a replaced layer carries its own channels
        for name in self.score.channels:
            edit.channels.setdefault(name, view.channels[name])
        return edit

    def stats(self, states: Sequence[Mapping[str, Any]], counts: Mapping[str, int]) -> dict:
        """Part-specific statistics from every layer's state and the tallies of the policy's edits."""
        out: dict = {}
        for part in self.parts().values():
            out.update(part.stats(states, counts))
        return out


def no_size_reason(parts: Mapping[str, Any]) -> str:
    """Why a policy of these parts (by role) takes no size: "" when a budget or ratio sizes it."""
    score, sizes, reads, storage = (parts.get(role) for role in ("score", "sizes", "reads", "storage"))
    if score is not None:
        return (sizes or _DEFAULTS["sizes"]).sizes_itself
    if reads is not None:
        return ""  # the size is what each step reads
    return storage.sizes_itself if storage is not None else "it keeps every entry"


def _options(options: dict) -> str:
    return f"[{','.join(f'{k}={v}' for k, v in options.items())}]" if options else ""


_ROLE_BASES = {"score": Scorer, "sizes": Sizer, "fate": Fate, "decoding": Decoding, "reads": Reads, "storage": Storage}
_DEFAULTS = {"sizes": Uniform(), "fate": Drop(), "decoding": Static()}
PRESETS: dict[str, Any] = {}  # method name -> its Preset (presets.py fills it)

__all__ = ["PRESETS", "Policy", "no_size_reason"]
