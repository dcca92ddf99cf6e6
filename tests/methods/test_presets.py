"""Every method's answers and kept entries on the test models, held to a record made before methods/ changes.

The record (``presets.json``, beside this file) holds, per method, size and test model, the greedy tokens a
``CompressedCache`` generates, the entries each layer's heads hold afterwards and the share of entries read. A change to methods/ that
is meant to keep every preset's behaviour (a redesign) must leave them equal; a change that means to alter a
method re-records it, in the same commit, with a line in its message saying why:

    PYTHONPATH=tests .venv/bin/python tests/methods/test_presets.py --record
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from common import layers_of, tiny_method, tiny_model
from kvcompress import CompressedCache, available_methods
from kvcompress.methods import REGISTRY

RECORD = Path(__file__).with_name("presets.json")
KINDS = ("llama", "qwen2")
PROMPT_TOKENS, NEW_TOKENS = 90, 12


def _sizes(name: str) -> list[dict]:
    """The sizes each method is recorded at: a budget and a ratio (none for methods that size themselves)."""
    return [{"budget": 24}, {"ratio": 0.3}] if REGISTRY[name].needs_budget else [{}]


def _options(name: str, size: dict) -> dict:
    """Small windows so that the tiny prompts are compressed (the methods' defaults would keep them whole)."""
    small = {"snapkv": {"window": 8}, "pyramidkv": {"window": 8}, "adakv": {"window": 8}, "momentkv": {"window": 8},
             "keepkv": {"window": 8}, "cam": {"window": 8}, "d2o": {"window": 8}, "retention": {"slack": 4},
             "kivi": {"group_size": 16, "residual": 8}, "omnikv": {"recent": 8, "sinks": 2},
             "quest": {"page_size": 8, "recent": 8, "sinks": 2, "dense_layers": 0}, "kvzip_head": {"window": 2}}
    return {**small.get(name, {}), **size}


def run_preset(name: str, kind: str, size: dict) -> dict:
    model = tiny_model(kind, seed=11)
    ids = torch.randint(3, 128, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(12))
    cache = CompressedCache(model, tiny_method(name, model, **_options(name, size)))
    out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return {"tokens": out[0, PROMPT_TOKENS:].tolist(), "cr": round(cache.stats()["cr"], 6),
            "held": [layer.head_lengths()[0].tolist() for layer in layers_of(cache)]}


def _key(name: str, kind: str, size: dict) -> str:
    return ":".join([name, kind, *(f"{k}={v}" for k, v in size.items())])


def _cases() -> list[tuple[str, str, dict]]:
    return [(name, kind, size) for name in available_methods() for kind in KINDS for size in _sizes(name)]


@pytest.mark.parametrize(("name", "kind", "size"), _cases(), ids=[_key(*case) for case in _cases()])
def test_preset_answers_and_held_entries_are_as_recorded(name, kind, size):
    recorded = json.loads(RECORD.read_text())
    key = _key(name, kind, size)
    assert key in recorded, f"{key} has no record: run `PYTHONPATH=tests .venv/bin/python tests/methods/test_presets.py --record`"
    assert run_preset(name, kind, size) == recorded[key]


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    lines = [f"{json.dumps(_key(*case))}: {json.dumps(run_preset(*case))}" for case in _cases()]
    RECORD.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"recorded {len(_cases())} presets in {RECORD}")
