"""Today's method names as presets: each is a policy's parts with the paper's defaults (DESIGN.md, "Methods").

A preset's options are its parts' (an option goes to every part of the preset that has it: ``keepkv:window=16``
sets the EMA scorer's window and the merge reference's); ``+part`` replaces a part (spec.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from .cam import CaM
from .d2o import D2O
from .decoding import Evict
from .deltakv import DeltaKV
from .ema import EMAImportance
from .expected_attention import ExpectedAttention
from .gvote import GVote, Votes
from .h2o import H2O
from .keepkv import KeepKV
from .kivi import KIVI
from .kvzip import KVzip, KVzipHead
from .momentkv import MomentKV
from .omnikv import OmniKV
from .parts import Part
from .policy import PRESETS, no_size_reason
from .quest import Quest
from .retention import Retention
from .sizers import Adaptive, Global, Pyramid
from .snapkv import SnapKV
from .streamingllm import Recency


@dataclass(frozen=True)
class Preset:
    """A method name: its paper and a function giving its parts (by role) with their default options."""

    name: str
    paper: str
    make: Callable[[], dict[str, Part]]

    def parts(self) -> dict[str, Part]:
        return self.make()

    @property
    def sizes_itself(self) -> str:
        """Why the preset takes no size ("" when it takes a budget or a ratio)."""
        return no_size_reason(self.parts())

    @property
    def needs_budget(self) -> bool:
        return not self.sizes_itself

    def options(self) -> list[str]:
        """Every option of its parts, then budget and ratio."""
        names = [f.name for part in self.parts().values() for f in fields(part)]
        return sorted(set(names)) + ["budget", "ratio"]


def _preset(name: str, paper: str, make: Callable[[], dict[str, Part]]) -> None:
    PRESETS[name] = Preset(name, paper, make)


_preset("full", "—", lambda: {})
_preset("streamingllm", "Xiao et al. 2023, Efficient Streaming Language Models with Attention Sinks",
        lambda: {"score": Recency(), "decoding": Evict()})
_preset("h2o", "Zhang et al. 2023, H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs",
        lambda: {"score": H2O(), "decoding": Evict()})
_preset("snapkv", "Li et al. 2024, SnapKV: LLM Knows What You are Looking for Before Generation",
        lambda: {"score": SnapKV()})
_preset("pyramidkv", "Cai et al. 2024, PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
        lambda: {"score": SnapKV(), "sizes": Pyramid()})
_preset("adakv", "Feng et al. 2024, Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation",
        lambda: {"score": SnapKV(), "sizes": Adaptive()})
_preset("momentkv", "MomentKV: Closing the Directional Gap in KV Cache Eviction (seeds/000)",
        lambda: {"score": SnapKV(sinks=1, chunk_size=4), "sizes": Adaptive(), "fate": MomentKV(), "decoding": Evict(slack=32)})
_preset("gvote", "GVote: adaptive KV-cache compression by Gaussian-sampled query voting (seeds/003)",
        lambda: {"score": Votes(), "sizes": GVote()})
_preset("keepkv", "Tian et al. 2025, KeepKV: Achieving Periodic Lossless KV Cache Compression for Efficient LLM Inference",
        lambda: {"score": EMAImportance(), "fate": KeepKV(), "decoding": Evict()})
_preset("cam", "Zhang et al. 2024, CaM: Cache Merging for Memory-efficient LLMs Inference (ICML)",
        lambda: {"score": EMAImportance(), "fate": CaM(), "decoding": Evict()})
_preset("d2o", "Wan et al. 2024, D2O: Dynamic Discriminative Operations for Efficient Generative Inference of LLMs",
        lambda: {"score": EMAImportance(), "fate": D2O(), "decoding": Evict()})
_preset("omnikv", "Hao et al. 2025, OmniKV: Dynamic Context Selection for Efficient Long-Context LLMs (seeds/004)",
        lambda: {"reads": OmniKV()})
_preset("quest", "Tang et al. 2024, Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
        lambda: {"reads": Quest()})
_preset("kivi", "Liu et al. 2024, KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
        lambda: {"storage": KIVI()})
_preset("deltakv", "DeltaKV: residual-based KV cache compression (with Sparse-vLLM, seeds/004)",
        lambda: {"storage": DeltaKV()})
_preset("retention", "Make Each Token Count: Towards Improving Long-Context Performance with KV Cache Eviction (seed 001)",
        lambda: {"score": Retention(), "sizes": Global(), "decoding": Evict(slack=128)})
_preset("expected_attention", "Devoto et al. 2025, Expected Attention: KV Cache Compression by Estimating Attention from "
        "Future Queries Distribution (kvpress's ExpectedAttentionPress)", lambda: {"score": ExpectedAttention()})
_preset("kvzip", "Kim et al. 2025, KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
        lambda: {"score": KVzip(), "sizes": Global()})
_preset("kvzip_head", "Kim et al. 2025, KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction "
        "(head-level, context-independent: head scores calibrated once per model)",
        lambda: {"score": Recency(), "sizes": KVzipHead()})

__all__ = ["Preset"]
