"""Runtime settings in one place: what the engine, the server and the command line read.

``Config`` is a plain dataclass (no configuration framework); ``parse_size`` reads memory
sizes written as people write them ("200MiB", "1.5GB", "4096").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(size: int | float | str) -> int:
    """Bytes from a number of bytes or a string such as ``"200MiB"``, ``"1.5GB"``, ``"512 KiB"``."""
    if isinstance(size, bool):
        raise ValueError(f"a memory size must be a number of bytes or a string like '1GiB', got {size!r}")
    if isinstance(size, int | float):
        value = float(size)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(size))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"cannot read memory size {size!r}: write e.g. 200MiB, 1.5GB or 4096 (bytes)")
        value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {size!r}")
    return int(value)


@dataclass
class Config:
    """Settings of a serving engine (``kvcompress.LLM``) and of the server built on it.

    Args:
        model: checkpoint dir, ``.gguf`` file, hub id or None (the embedded default model).
        kv_memory: bytes (or a size string) of the KV slot pool, allocated once.
        max_num_seqs: requests decoded together at most.
        max_num_batched_tokens: tokens one step's forward takes at most: a token per decoding request, the
            rest from prompts (a longer prompt is prefilled in chunks); at least ``max_num_seqs``.
        max_model_len: prompt + generated tokens per request at most (None: the model's positions).
        dtype: ``"auto"`` (the checkpoint's dtype on GPU, float32 on CPU) or a torch dtype name.
        device: ``"cpu"``, ``"cuda"``, ...
        seed: the default seed of sampling (a request's own ``seed`` wins).
    """

    model: str | None = None
    kv_memory: int | str = "1GiB"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        self.kv_memory = parse_size(self.kv_memory)
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a whole number ≥ 1, got {self.max_num_seqs!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens must be a whole number ≥ max_num_seqs ({self.max_num_seqs}): a step holds a "
                             f"token of every decoding request and room for prompts; got {self.max_num_batched_tokens!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be ≥ 2 tokens, got {self.max_model_len!r}")
        self.device = str(torch.device(self.device))


__all__ = ["Config", "parse_size"]
