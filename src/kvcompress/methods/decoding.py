"""Decoding rules: what a policy does after each decoding step's read.

* ``Static``: nothing; the prompt is compressed once and every later token is kept (kvpress's presses);
* ``Evict``: the scorer sees each step (H2O's sums, the merging EMA, the gates' β of new tokens) and once a head
  holds more than its size + ``slack``, every head over its size goes back to it, what leaves meeting the policy's fate
  (StreamingLLM's rolling window, H2O, MomentKV, KeepKV, the retention gates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .parts import Decoding


@dataclass
class Static(Decoding):
    """Compress the prompt once; keep every token that comes after it."""

    name: ClassVar[str] = "static"
    about: ClassVar[str] = "compress the prompt once, keep every later token"


@dataclass
class Evict(Decoding):
    """Evict back to the size while decoding, once a head holds more than size + ``slack`` (0: every step): every
    head over its size then goes back to it."""

    slack: int = 0

    name: ClassVar[str] = "evict"
    about: ClassVar[str] = "evict back to the size while decoding (after slack more entries)"

    def __post_init__(self) -> None:
        if isinstance(self.slack, bool) or not isinstance(self.slack, int) or self.slack < 0:
            raise ValueError(f"evict: slack must be a whole number of entries ≥ 0, got {self.slack!r}")

    @property
    def acts(self) -> bool:
        return True


__all__ = ["Evict", "Static"]
