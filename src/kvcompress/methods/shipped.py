"""Checkpoints shipped in the package for learned methods: one folder per model under ``data/<method>/``.

A learned method (``retention``, ``deltakv``) given no ``checkpoint=`` uses the folder shipped for the
model it runs on: the folder named like the model (the last part of ``config._name_or_path``, which
``load_model`` sets to the cached conversion, e.g. ``…/models/qwen2.5-coder-0.5b``), otherwise the one
shipped folder whose recorded shapes are the model's (a model loaded from another path or GGUF file).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")

DATA = Path(__file__).resolve().parents[1] / "data"


def check_checkpoint(method: str, checkpoint: str | None) -> None:
    """Refuse, before any work, a ``checkpoint=`` that is not a folder written by ``kvcompress train <method>``."""
    if checkpoint is None:
        return
    folder = Path(checkpoint).expanduser()
    if not folder.is_dir():
        raise ValueError(f"{method}: checkpoint {checkpoint!r} is not a folder; give the --out of `kvcompress train {method}`")
    missing = [name for name in ("model.safetensors", "config.json") if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{method}: checkpoint {checkpoint!r} has no {' or '.join(missing)}; give the --out of "
                         f"`kvcompress train {method}`, which writes both")


def shipped_folders(method: str) -> list[Path]:
    """The checkpoints shipped for ``method``, one per model, sorted by model name."""
    root = DATA / method
    return sorted(p for p in root.iterdir() if (p / "config.json").is_file()) if root.is_dir() else []


def shipped_checkpoint(method: str, config, shapes: dict[str, int]) -> Path:
    """The shipped folder of ``method`` for the model of ``config`` (its name first, else its ``shapes``).

    ``shapes`` are the entries of the checkpoint's config.json that must equal the model's (e.g.
    ``{"num_layers": 24, "num_kv_heads": 2, "hidden_size": 896}``). Raises ValueError naming the
    shipped models and the command that trains one when none fits."""
    folders = shipped_folders(method)
    name = Path(str(getattr(config, "_name_or_path", "") or "")).name.lower()
    for folder in folders:
        if folder.name == name:
            return folder
    fitting = [f for f in folders if all(json.loads((f / "config.json").read_text()).get(k) == v for k, v in shapes.items())]
    if len(fitting) == 1:
        return fitting[0]
    shipped = ", ".join(f.name for f in folders) or "none in this install"
    raise ValueError(f"{method}: no checkpoint is shipped for this model ({name or 'unnamed'}; shipped: {shipped}); "
                     f"train one with `kvcompress train {method} --model M --out DIR` and pass checkpoint=DIR")


@lru_cache(maxsize=8)
def load_shipped(load: Callable[[Path], T], folder: Path) -> T:
    """``load(folder)`` once per shipped folder: the weights are read-only and shared by every method
    object that runs on that model (the server checks a request's method against the model each time)."""
    return load(folder)


__all__ = ["load_shipped", "shipped_checkpoint", "shipped_folders"]
