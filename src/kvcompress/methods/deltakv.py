"""DeltaKV: every token kept, most of them as small residual codes against their nearest reference
tokens (Sparse-vLLM / DeltaKV, seed 004; METHODS.md "DeltaKV"; the codec is ``store/deltakv.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import ClassVar

import torch

from ..store.deltakv import DeltaKVCodec, DeltaKVWeights
from .parts import Storage
from .shipped import DATA, check_checkpoint, load_shipped, shipped_checkpoint

SHIPPED = DATA / "deltakv"  # one folder per model with a shipped checkpoint
EMBEDDED = "smollm2-135m-instruct"


@dataclass
class DeltaKV(Storage):
    """DeltaKV (seed 004): references every ``stride`` tokens and the sinks stay raw; every other token
    keeps z = f_c(x) − f_c(mean of its 4 nearest earlier references) (the shipped codecs: half the
    token's width in 4 bits; the paper's: a quarter in 16) and is rebuilt as f_d(z) + mean on read
    (RoPE re-applied); the newest tokens stay raw and are coded ``chunk`` at a time (METHODS.md
    "DeltaKV"). Nothing is evicted: kr falls with the stride and the code width, cr stays 1. As the
    storage of a policy that keeps every entry (``omnikv+deltakv``, ``quest+deltakv``), only the entries
    each step reads are rebuilt, and the layers whose steps read every entry (OmniKV's filter layers and the
    layers before them) stay raw, as the paper leaves its filter layers uncompressed ("hybrid layers").

    Options:
        checkpoint: a folder from ``kvcompress train deltakv`` (None: the one shipped for the model).
        bits: 4 (default) stores each token's code in 4 bits with a 16-bit zero point and scale, as the
            shipped codecs were trained; None keeps codes in the model's dtype (the paper's accounting).
        full_layers: layers left uncoded (None: the checkpoint's choice), besides those the read rule reads whole.
        recent: newest tokens per layer kept raw (32).
        chunk: new tokens between two coding passes while decoding (32).
    """

    checkpoint: str | None = None
    bits: int | None = 4
    full_layers: tuple[int, ...] | None = None
    recent: int = 32
    chunk: int = 32

    name: ClassVar[str] = "deltakv"
    about: ClassVar[str] = "learned residual codes against nearby reference tokens (DeltaKV)"
    sizes_itself: ClassVar[str] = "it keeps every token, and its stride and code width set the bytes held"
    codes_tokens: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.bits not in (None, 4):
            raise ValueError(f"deltakv: bits must be None (codes in the model's dtype) or 4, got {self.bits!r}")
        if self.recent < 0 or self.chunk < 1:
            raise ValueError(f"deltakv: recent must be ≥ 0 and chunk ≥ 1, got recent={self.recent}, chunk={self.chunk}")
        check_checkpoint("deltakv", self.checkpoint)

    @cached_property
    def weights(self) -> DeltaKVWeights:
        """The codec: ``checkpoint``'s, else the one shipped for the model ``check_model`` saw (the embedded
        model's before it has seen one)."""
        if self.checkpoint is None and not (SHIPPED / EMBEDDED).is_dir():
            raise ValueError("deltakv: no checkpoint shipped in this install; train one with `kvcompress train deltakv "
                             "--out DIR` and pass checkpoint=DIR")
        return DeltaKVWeights.load(Path(self.checkpoint).expanduser() if self.checkpoint else SHIPPED / EMBEDDED)

    def check_model(self, config) -> None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        ours = (config.num_hidden_layers, config.num_key_value_heads, head_dim)
        if self.checkpoint is None:
            folder = shipped_checkpoint("deltakv", config, dict(zip(("num_layers", "num_kv_heads", "head_dim"), ours)))
            self.__dict__["weights"] = load_shipped(DeltaKVWeights.load, folder)  # the cached_property's slot
        dims = self.weights.dims
        if (dims["num_layers"], dims["num_kv_heads"], dims["head_dim"]) != ours:
            where = self.checkpoint or "the shipped checkpoint"
            raise ValueError(f"deltakv: {where} codes {dims['num_layers']} layers × {dims['num_kv_heads']} KV heads × head dim "
                             f"{dims['head_dim']}, this model has {ours[0]} × {ours[1]} × {ours[2]}; train a codec for it with "
                             "`kvcompress train deltakv --model M --out DIR` and pass checkpoint=DIR")
        bad = [layer for layer in self.layers_left_full() if not 0 <= layer < ours[0]]
        if bad:
            raise ValueError(f"deltakv: full_layers {bad} are not layers of this {ours[0]}-layer model")

    def layers_left_full(self) -> tuple[int, ...]:
        return tuple(self.full_layers) if self.full_layers is not None else tuple(self.weights.about.get("full_layers", ()))

    def storage(self, dtype: torch.dtype, read_whole: tuple[int, ...] = ()) -> tuple[DeltaKVCodec, int]:
        """DeltaKV's codec and its raw recent tokens; the layers read whole stay raw (rebuilding every coded token
        at every step is what the paper's hybrid layers avoid)."""
        raw = tuple(sorted({*self.layers_left_full(), *read_whole}))
        return DeltaKVCodec(self.weights, self.bits, raw, self.chunk), self.recent
