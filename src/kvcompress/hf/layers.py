"""What every kvcompress cache shows transformers: layers that hold nothing, and a hand-over of each layer.

A ``CompressedCache`` and KVzip's replay are ``HandOverCache``s (the engine's steps run its own forward): a
layer's ``update`` marks the layer's attention module as pending for this cache (``hand_over``), and the
kvcompress attention function takes it (``take_pending``) and lets the cache attend (``attend``), reading
and writing the slot store itself. transformers only asks a cache layer how many token positions it has
seen (new tokens' positions and mask sizes follow from it): ``PositionsLayer`` answers that from a
function, so each cache says where its count lives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

PENDING = "_kvcompress_pending"  # the attribute of an attention module that names the cache and layer it is handed to


def hand_over(module: torch.nn.Module, cache: HandOverCache, layer_idx: int) -> None:
    """Let the kvcompress attention function give ``module``'s next forward to ``cache`` as layer ``layer_idx``."""
    setattr(module, PENDING, (cache, layer_idx))


def take_pending(module: torch.nn.Module) -> tuple[HandOverCache, int] | None:
    """The (cache, layer) ``module``'s forward was handed to, once (None: a plain forward)."""
    return module.__dict__.pop(PENDING, None)


class HandOverCache(Cache):
    """A cache whose layers the kvcompress attention function attends: ``update`` hands the layer over (the
    entries are not given to transformers), ``attend`` is the layer's attention. ``attention_modules``: the
    model's attention module per layer."""

    attention_modules: Sequence[torch.nn.Module]

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):  # noqa: D102
        hand_over(self.attention_modules[layer_idx], self, layer_idx)
        return key_states, value_states

    def attend(self, layer_idx: int, module, query, key, value, mask, scaling: float, position_ids, hidden=None) -> torch.Tensor:
        """The layer's attention output [B, Hq, q, d] for queries and new keys/values [B, H, q, d]."""
        raise NotImplementedError


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


__all__ = ["HandOverCache", "PositionsLayer", "hand_over", "take_pending"]
