"""The cache layer transformers sees for every kvcompress cache: its length, never its entries.

A ``CompressedCache``, the engine's batched decoding step and KVzip's replay each hand every layer
to the kvcompress attention function, which reads and writes the slot store itself; transformers
only asks a cache layer how many token positions it has seen (new tokens' positions and mask sizes
follow from it). ``PositionsLayer`` answers that from a function, so each cache says where its
count lives.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers.cache_utils import CacheLayerMixin


class PositionsLayer(CacheLayerMixin):
    """A cache layer that holds nothing for transformers: ``seen()`` token positions came before."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, seen: Callable[[], int]):
        super().__init__()
        self._seen = seen

    def lazy_initialization(self, key_states, value_states) -> None:  # noqa: D102
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):  # noqa: D102
        raise RuntimeError("kvcompress cache layers are written by the kvcompress attention function, not by update().")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:  # noqa: D102
        return self._seen() + query_length, 0

    def get_seq_length(self) -> int:  # noqa: D102
        return self._seen()

    def get_max_length(self) -> int:  # noqa: D102
        return -1


__all__ = ["PositionsLayer"]
