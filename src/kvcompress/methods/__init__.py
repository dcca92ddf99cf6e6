"""The method registry: one file per method, one name per method.

``get_method(name, budget=... | ratio=..., **options)`` builds a configured method;
``available_methods()`` lists the names.
"""

from __future__ import annotations

from dataclasses import fields

from .adakv import AdaKV
from .base import Method, Needs, ScoreMethod
from .cam import CaM
from .d2o import D2O
from .full import Full
from .gvote import GVote
from .h2o import H2O
from .keepkv import KeepKV
from .momentkv import MomentKV
from .pyramidkv import PyramidKV
from .snapkv import SnapKV
from .streamingllm import StreamingLLM

REGISTRY: dict[str, type[Method]] = {
    cls.name: cls for cls in (Full, StreamingLLM, H2O, SnapKV, PyramidKV, AdaKV, MomentKV, GVote, KeepKV, CaM, D2O)
}


def available_methods() -> list[str]:
    """Registry names of every implemented method."""
    return list(REGISTRY)


def get_method(name: str, **options) -> Method:
    """Build a method by registry name, e.g. ``get_method("snapkv", budget=128, window=32)``."""
    key = name.strip().lower()
    if key not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; available methods: {', '.join(available_methods())}")
    cls = REGISTRY[key]
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{key} has no option {', '.join(unknown)}; its options are: {', '.join(sorted(known))}")
    return cls(**options)


__all__ = ["REGISTRY", "Method", "Needs", "ScoreMethod", "available_methods", "get_method"]
