"""Where entries live: the slot pool, slot tables, codecs, and what a read or a method sees of them.

Nothing here knows a method or transformers.
"""

from .codecs import Codec, PlainCodec
from .slots import PoolExhausted, SlotPool, SlotTable
from .view import Edit, Entries, KVView, LayerContext, LayerInput, Rewrite, Summary

__all__ = ["Codec", "Edit", "Entries", "KVView", "LayerContext", "LayerInput", "PlainCodec", "PoolExhausted",
           "Rewrite", "SlotPool", "SlotTable", "Summary"]
