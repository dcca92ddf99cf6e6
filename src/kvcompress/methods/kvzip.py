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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .parts import Needs, Scorer


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
