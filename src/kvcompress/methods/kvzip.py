"""KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction").

Score of entry i of layer l and KV head h: S_{l,h,i} = the most attention any query of the head's GQA
group gives it while the model, with the prompt's cache as prefix, is made to repeat the prompt
(teacher-forced: r = ["Repeat the previous context exactly.", the turn to answer, the prompt]), the
softmax taken over everything the query sees (METHODS.md, "KVzip"). The score asks no question, so
one compressed prompt serves any later question. Long prompts are replayed in chunks of ``chunk``
tokens, each chunk's queries attending to the whole prompt and to the chunk (``hf/replay.py``): one
more pass over the prompt (measured here at 2.28× a prefill at 2k tokens: the flash kernel's
output and log-sum-exp, each entry's largest weight as exp of its largest logit less the lse). The lowest scores leave; the ``kvzip`` preset ranks once over
every layer and head (+global, the paper's non-uniform budgets: each head keeps its own share), ``sinks``
first tokens always kept.

The head-level, context-independent variant (``kvzip_head``, the paper's head-level eviction): each KV head's
importance is the largest of its entries' scores, s_{l,h} = max_i S_{l,h,i}, computed once per model from a
replay of a calibration text (``train/kvzip_head.py``: the project's own prose), never from the prompt being
compressed. At inference no replay runs (the cost is a prefill's): the heads with the highest s_{l,h} keep
the whole prompt and every other head keeps its sinks and a recent window (``KVzipHead``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from .parts import Needs, Scorer, Sizer
from .selection import PROTECTED_PRIORITY
from .shipped import shipped_checkpoint


@dataclass
class KVzip(Scorer):
    """Entries scored by the attention a replay of the prompt pays them.

    Options: chunk (prompt tokens per replay chunk, 2048 as kvpress), plus sinks (4) and chunk_size.
    """

    sinks: int = 4
    chunk: int = 2048

    name: ClassVar[str] = "kvzip"
    about: ClassVar[str] = "the most attention a replay of the prompt pays each entry (KVzip)"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk (prompt tokens per replay chunk) must be a whole number ≥ 1, got {self.chunk!r}")

    def needs(self) -> Needs:
        return Needs(replay=self.chunk)

    def score(self, view, context) -> torch.Tensor:
        scores = context.observations["replay_scores"]
        return scores[..., : view.shape[2]].to(view.positions.device)


CALIBRATED: dict[str, torch.Tensor] = {}  # model name_or_path -> head scores [layers, KV heads] (train/kvzip_head.py)
SCORES_FILE = "config.json"  # a shipped folder's file (methods/shipped.py); a ``scores=`` folder holds one too


def write_head_scores(path: str | Path, scores: torch.Tensor, **about) -> Path:
    """Write head scores [layers, KV heads] as JSON (with ``about``: the model, the calibration); returns the file.
    A path without a ``.json`` suffix is a folder that gets a ``config.json`` (the shipped layout)."""
    path = Path(path).expanduser()
    if path.suffix != ".json":
        path = path / SCORES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    layers, heads = scores.shape
    record = {"method": "kvzip_head", "num_layers": layers, "num_kv_heads": heads, **about,
              "scores": [[float(v) for v in row] for row in scores.tolist()]}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def read_head_scores(path: str | Path) -> torch.Tensor:
    """Head scores [layers, KV heads] float32 from a file (or a folder's ``config.json``) ``write_head_scores`` wrote."""
    path = Path(path).expanduser()
    file = path / SCORES_FILE if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"kvzip_head: scores {str(path)!r} is not a file (or a folder holding {SCORES_FILE}); give the "
                         "path= of kvcompress.train.kvzip_head.calibrate_head_scores")
    try:
        scores = torch.tensor(json.loads(file.read_text())["scores"], dtype=torch.float32)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"kvzip_head: {str(file)!r} holds no head scores ({error}); give a file written by "
                         "kvcompress.train.kvzip_head.calibrate_head_scores(..., path=FILE)") from None
    if scores.dim() != 2 or scores.numel() == 0 or not bool(torch.isfinite(scores).all()):
        raise ValueError(f"kvzip_head: {str(file)!r} must hold a finite [layers, KV heads] table of scores")
    return scores


@dataclass
class KVzipHead(Sizer):
    """KVzip's head-level, context-independent sizes (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression
    with Context Reconstruction"; METHODS.md, "KVzip"): head h of layer l scores s_{l,h} = max_i S_{l,h,i}, the
    largest KVzip score of its entries on a calibration text (once per model); the best heads over every layer keep
    the whole prompt, the others their protected entries (the scorer's sinks) and ``window`` more (the most recent,
    with the ``recency`` scorer of the ``kvzip_head`` preset).

    How many heads keep everything follows the size: n = ⌊N·(B − a) / (T − a)⌋ of the N = layers × KV heads, T the
    prompt's tokens, B the size (entries per KV head), a = sinks + window, so that the entries held
    (n·T + (N − n)·a) stay within B·N (ratio 1.0: every head). The choice of heads depends on the model, never on
    the prompt: no replay at inference. Options: window (recent entries a head not chosen keeps, 64), scores (a file
    of head scores; default: those calibrated in this process for the model, else those shipped for it).
    """

    window: int = 64
    scores: str | None = None

    name: ClassVar[str] = "kvzip_head"
    about: ClassVar[str] = "KVzip's best heads (scored once per model) keep everything, the rest sinks + a recent window"

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"kvzip_head: window (recent entries a head not chosen keeps) must be a whole number ≥ 0, "
                             f"got {self.window!r}")
        self._head_scores = read_head_scores(self.scores) if self.scores is not None else None

    def check(self, policy) -> None:
        super().check(policy)
        if policy.decoding.acts:
            raise ValueError(f"{policy.label} evicts to its size while decoding; kvzip_head chooses heads once, at the "
                             "prompt: drop +evict (the question and answer are kept in every head)")

    def check_model(self, config) -> None:
        """The head scores for this model: ``scores``'s, else calibrated in this process, else shipped; their shape
        checked against the model's layers and KV heads."""
        name = str(getattr(config, "_name_or_path", "") or "")
        layers = config.num_hidden_layers
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        scores = self._head_scores
        if scores is None:
            scores = CALIBRATED.get(name)
        if scores is None:
            try:
                scores = read_head_scores(shipped_checkpoint("kvzip_head", config, {"num_layers": layers, "num_kv_heads": heads}))
            except ValueError:
                raise ValueError(f"kvzip_head: no head scores for this model ({Path(name).name or 'unnamed'}): compute them "
                                 "once with kvcompress.train.kvzip_head.calibrate_head_scores(model, tokenizer, path=FILE) "
                                 "(kept in memory for the model) and pass scores=FILE in another process") from None
        if tuple(scores.shape) != (layers, heads):
            raise ValueError(f"kvzip_head: the head scores are {tuple(scores.shape)} (layers, KV heads) and the model has "
                             f"({layers}, {heads}): calibrate them for this model")
        self._head_scores = scores

    @property
    def head_scores(self) -> torch.Tensor:
        """[layers, KV heads]: the scores in use (known once ``check_model`` has seen the model, or from ``scores``)."""
        if self._head_scores is None:
            raise ValueError("kvzip_head: no head scores yet: the policy's check_model(config) finds them for the model "
                             "(CompressedCache and generate call it), or give scores=FILE")
        return self._head_scores

    def full_heads(self, budgets: torch.Tensor, tokens: torch.Tensor, allowance: torch.Tensor) -> torch.Tensor:
        """[B]: how many heads of every layer keep everything, rows of ``tokens`` [B] with sizes ``budgets`` [B] and
        ``allowance`` [B] entries per head kept by the others (the class docstring's n)."""
        total = self.head_scores.numel()
        room = tokens - allowance
        spare = (budgets - allowance).clamp(min=0)
        return torch.where(room > 0, torch.div(spare * total, room.clamp(min=1), rounding_mode="floor"), total).clamp(max=total)

    def per_head(self, key, budgets, view, context) -> torch.Tensor:
        scores = self.head_scores
        if tuple(scores.shape) != (context.num_layers, view.shape[1]):
            raise ValueError(f"kvzip_head: the head scores are {tuple(scores.shape)} (layers, KV heads), the model has "
                             f"({context.num_layers}, {view.shape[1]})")
        device = key.device
        order = torch.argsort(scores.flatten(), descending=True, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        rank = rank.view(scores.shape)[context.layer_idx].to(device)  # [H]: 0 for the best head of every layer
        lengths = view.lengths.to(device)
        protected = (key >= PROTECTED_PRIORITY).sum(dim=-1)
        tokens = context.tokens_seen.to(device)
        budgets = budgets.to(device)
        # a head not chosen keeps its sinks and window, cut to the size when the size is smaller (never its sinks)
        kept = torch.maximum(protected, torch.minimum(protected + self.window, budgets[:, None]))
        allowance = torch.minimum(tokens, kept.amax(dim=1))
        full = rank[None, :] < self.full_heads(budgets, tokens, allowance)[:, None]
        return torch.where(full, lengths, torch.minimum(lengths, kept))


__all__ = ["CALIBRATED", "KVzip", "KVzipHead", "read_head_scores", "write_head_scores"]
