"""The methods: policies assembled from parts (parts.py, policy.py), today's method names as presets of
them (presets.py), and the one parser that turns a spec into a policy (spec.py).

``get_method(spec, budget=... | ratio=..., **options)`` builds a policy from a name or a spec
(``"keepkv:key_rule=votes"``, ``"kvzip+adaptive+kivi:bits=4"``); ``available_methods()`` lists the
method names and ``available_parts()`` the parts.
"""

from __future__ import annotations

from . import presets  # noqa: F401  (fills PRESETS)
from .cam import CaM
from .d2o import D2O
from .decoding import Evict, Static
from .deltakv import DeltaKV
from .ema import EMAImportance
from .expected_attention import ExpectedAttention
from .fates import Drop
from .gvote import GVote, Votes
from .h2o import H2O
from .keepkv import KeepKV
from .kivi import KIVI
from .kvzip import KVzip, KVzipHead
from .momentkv import MomentKV
from .omnikv import OmniKV
from .parts import Decoding, Fate, Needs, Part, Reads, Scorer, Sizer, Storage
from .policy import Policy
from .quest import Quest
from .retention import Retention
from .sizers import Adaptive, Global, Pyramid, Threshold, Uniform
from .snapkv import SnapKV
from .spec import PARTS, REGISTRY, MethodSpec, available_methods, available_parts, get_method, split_method_list
from .streamingllm import Recency

PARTS.update({cls.name: cls for cls in (
    Recency, H2O, SnapKV, EMAImportance, Votes, KVzip, ExpectedAttention, Retention,  # scorers
    Uniform, Pyramid, Adaptive, Global, Threshold, KVzipHead, GVote,  # sizers
    Drop, KeepKV, CaM, D2O, MomentKV,  # fates
    Static, Evict,  # decoding rules
    Quest, OmniKV,  # read rules
    KIVI, DeltaKV,  # storage
)})

__all__ = ["PARTS", "REGISTRY", "Adaptive", "CaM", "D2O", "Decoding", "DeltaKV", "Drop", "EMAImportance", "Evict", "ExpectedAttention",
           "Fate", "GVote", "Global", "H2O", "KIVI", "KVzip", "KVzipHead", "KeepKV", "MethodSpec", "MomentKV", "Needs", "OmniKV", "Part", "Policy",
           "Pyramid", "Quest", "Reads", "Recency", "Retention", "Scorer", "Sizer", "SnapKV", "Static", "Storage", "Threshold",
           "Uniform", "Votes", "available_methods", "available_parts", "get_method", "split_method_list"]
