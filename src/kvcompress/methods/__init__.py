"""The methods: one file per method, one name per method, registered here in a fixed order.

``get_method(spec, budget=... | ratio=..., **options)`` builds a configured method from a name or a
spec with options (``"keepkv:key_rule=votes:refresh_every=16"``, read by ``MethodSpec``, the one
parser, in ``spec.py``); ``available_methods()`` lists the names.
"""

from __future__ import annotations

from .adakv import AdaKV
from .base import Method, Needs, ScoreMethod
from .cam import CaM
from .d2o import D2O
from .deltakv import DeltaKV
from .expected_attention import ExpectedAttention
from .full import Full
from .gvote import GVote
from .h2o import H2O
from .keepkv import KeepKV
from .kivi import KIVI
from .kvzip import KVzip
from .momentkv import MomentKV
from .omnikv import OmniKV
from .pyramidkv import PyramidKV
from .quest import Quest
from .retention import Retention
from .snapkv import SnapKV
from .spec import REGISTRY, MethodSpec, available_methods, get_method, split_method_list
from .streamingllm import StreamingLLM

REGISTRY.update({cls.name: cls for cls in (Full, StreamingLLM, H2O, SnapKV, PyramidKV, AdaKV, MomentKV, GVote, KeepKV, CaM, D2O,
                                           OmniKV, Quest, KIVI, DeltaKV, Retention, ExpectedAttention, KVzip)})

__all__ = ["REGISTRY", "Method", "MethodSpec", "Needs", "ScoreMethod", "available_methods", "get_method", "split_method_list"]
