"""The thin transformers adapter: ``CompressedCache`` and the registered ``kvcompress`` attention function."""

from .cache import ATTENTION_NAME, CompressedCache, use_kvcompress_attention, watch_attention_inputs

__all__ = ["ATTENTION_NAME", "CompressedCache", "use_kvcompress_attention", "watch_attention_inputs"]
