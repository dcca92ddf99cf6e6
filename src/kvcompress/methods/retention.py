"""Learned global retention ("Make Each Token Count: Towards Improving Long-Context Performance with KV
Cache Eviction", seed 001; METHODS.md, "Learned global retention").

A small gate per layer ℓ and KV head h reads each token's attention input x_i once, when the
token enters the cache: e = SiLU(W_ℓh x_i + b_ℓh), β_ℓh(x_i) = sigmoid(uᵀe + c), with u and c
shared by every layer and head (the weight tying that puts every score on one scale). An
entry's score at step t is s_i(t) = Σ_{k=1..H} β_i^{t−i+k} (horizon H; H = 1 is myopic), and
one budget M = budget × layers × KV heads keeps the M best entries over **all** layers and
heads at once (+global), so layers and heads end with very different lengths. While decoding (the
``retention`` preset evicts), the new entries' β join the ranking and the cache is cut back to M whenever it
holds more than M + the decoding rule's ``slack`` (128). As a scorer it ranks under any sizer and fate
(``retention+keepkv``: the gates' choice, merged as KeepKV merges).

The gates are trained on the frozen model (``kvcompress train retention``, ``train/retention.py``);
``checkpoint=DIR`` loads them, and without it the checkpoint shipped for the model is used (``methods/shipped.py``:
SmolLM2-135M-Instruct's and Qwen2.5-Coder-0.5B-Instruct's ship).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..store.view import KVView, LayerContext
from .parts import Needs, Scorer
from .shipped import DATA, check_checkpoint, load_shipped, shipped_checkpoint

LOG_BETA = "retention_log_beta"
SHIPPED = DATA / "retention"  # one folder per model with a shipped checkpoint
EMBEDDED = "smollm2-135m-instruct"


class RetentionGates(nn.Module):
    """β for every layer and KV head from a token's attention input (METHODS.md's gate).

    ``weight`` [L, H, m, D] and ``bias`` [L, H, m] are per layer and head; ``u`` [m] and ``c`` are shared
    by all of them. ``c`` starts high (``c_init``, β ≈ 1: training starts from full attention)."""

    def __init__(self, num_layers: int, num_kv_heads: int, hidden_size: int, width: int = 16, c_init: float = 10.0,
                 seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(num_layers, num_kv_heads, width, hidden_size, generator=gen) / math.sqrt(hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_layers, num_kv_heads, width))
        self.u = nn.Parameter(torch.randn(width, generator=gen) / math.sqrt(width))
        self.c = nn.Parameter(torch.tensor(float(c_init)))

    @property
    def dims(self) -> dict:
        layers, heads, width, hidden = self.weight.shape
        return {"num_layers": layers, "num_kv_heads": heads, "hidden_size": hidden, "width": width}

    def log_beta(self, layer: int | None, hidden: torch.Tensor) -> torch.Tensor:
        """log β [B, H, n] (float32, ≤ 0) of one layer's tokens whose attention input is ``hidden`` [B, n, D];
        ``layer=None``: every layer at once, ``hidden`` [L, B, n, D] → [L, B, H, n]."""
        x = hidden.to(self.weight.dtype)
        if layer is None:
            e = F.silu(torch.einsum("lbnd,lhmd->lbhnm", x, self.weight) + self.bias[:, None, :, None, :])
        else:
            e = F.silu(torch.einsum("bnd,hmd->bhnm", x, self.weight[layer]) + self.bias[layer][None, :, None, :])
        return F.logsigmoid(e @ self.u + self.c).float()

    def save(self, directory: Path | str, **about) -> None:
        """``model.safetensors`` + ``config.json`` (the dims, and ``about``: base model, data, training)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps({"method": "retention", **self.dims, **about}, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path | str) -> RetentionGates:
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / "model.safetensors").is_file() or not (directory / "config.json").is_file():
            raise FileNotFoundError(f"retention checkpoint {directory}: needs model.safetensors and config.json "
                                    "(`kvcompress train retention --out DIR` writes them)")
        config = json.loads((directory / "config.json").read_text())
        gates = cls(config["num_layers"], config["num_kv_heads"], config["hidden_size"], config["width"])
        gates.load_state_dict({k: v.float() for k, v in load_file(str(directory / "model.safetensors")).items()})
        return gates.eval().requires_grad_(False)


def log_retention_score(log_beta: torch.Tensor, age: torch.Tensor, horizon: int) -> torch.Tensor:
    """log s_i(t) = log Σ_{k=1..H} β^{age+k} = (age + 1)·log β + log((1 − β^H) / (1 − β)), float64.

    ``age`` = t − i ≥ 0. The ratio (1 − β^H)/(1 − β) → H as β → 1; it is computed as
    expm1(H·log β)/expm1(log β), exact there too."""
    lb = log_beta.double().clamp(max=-1e-300)
    if horizon == 1:  # the ratio is 1
        return (age.double() + 1) * lb
    ratio = torch.expm1(horizon * lb) / torch.expm1(lb)
    return (age.double() + 1) * lb + torch.log(ratio)


@dataclass
class Retention(Scorer):
    """Learned retention gates (seed 001): an entry scores its log s_i(t) from the gate's β.

    Options: checkpoint (a folder from ``kvcompress train retention``; None = the one shipped for the
    model it runs on), horizon (H of the score; 1 = myopic), plus sinks and chunk_size. The paper ranks
    over every layer and head under one budget (the ``retention`` preset: +global, +evict:slack=128).
    """

    checkpoint: str | None = None
    horizon: int = 1

    name: ClassVar[str] = "retention"
    about: ClassVar[str] = "learned retention gates: β of each token's attention input (seed 001)"
    channels: ClassVar[tuple[str, ...]] = (LOG_BETA,)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.horizon < 1:
            raise ValueError(f"retention: horizon must be ≥ 1, got horizon={self.horizon}")
        check_checkpoint("retention", self.checkpoint)

    def needs(self) -> Needs:
        return Needs(hidden_states=True)

    @cached_property
    def gates(self) -> RetentionGates:
        """The gates: ``checkpoint``'s, else those shipped for the model ``check_model`` saw (the embedded
        model's before it has seen one)."""
        return RetentionGates.load(Path(self.checkpoint).expanduser() if self.checkpoint else SHIPPED / EMBEDDED)

    def check_model(self, config) -> None:
        if self.checkpoint is None:
            folder = shipped_checkpoint("retention", config, {"num_layers": config.num_hidden_layers,
                                                              "num_kv_heads": config.num_key_value_heads,
                                                              "hidden_size": config.hidden_size})
            self.__dict__["gates"] = load_shipped(RetentionGates.load, folder)  # the cached_property's slot
        self._gates_for(config.num_hidden_layers, config.num_key_value_heads, config.hidden_size)

    def _gates_for(self, layers: int, heads: int, hidden: int) -> RetentionGates:
        """The gates, checked against the model they score for."""
        if self.checkpoint is None and "gates" not in self.__dict__ and not (SHIPPED / EMBEDDED).is_dir():
            raise ValueError("retention: no checkpoint shipped in this install; train one with `kvcompress train retention "
                             "--out DIR` and pass checkpoint=DIR")
        gates = self.gates
        dims = gates.dims
        if (dims["num_layers"], dims["num_kv_heads"], dims["hidden_size"]) != (layers, heads, hidden):
            where = self.checkpoint or "the shipped checkpoint"
            raise ValueError(f"retention: {where} has gates for {dims['num_layers']} layers × {dims['num_kv_heads']} KV heads "
                             f"× hidden {dims['hidden_size']}, this model has {layers} × {heads} × {hidden}; train gates for it "
                             "with `kvcompress train retention --model M --out DIR` and pass checkpoint=DIR")
        return gates

    def log_beta(self, layer: int | None, num_layers: int, heads: int, hidden: torch.Tensor) -> torch.Tensor:
        """log β [B, H, n] of one layer's tokens (attention inputs ``hidden`` [B, n, D]); ``layer=None``: every
        layer's at once ([L, B, n, D] → [L, B, H, n])."""
        with torch.no_grad():
            return self._gates_for(num_layers, heads, hidden.shape[-1]).log_beta(layer, hidden).to(hidden.device)

    # ----- the prefill --------------------------------------------------------------------------
    def _prefill_log_beta(self, view: KVView, context: LayerContext) -> torch.Tensor:
        hidden = context.observations.get("hidden_states")
        if hidden is None:
            raise ValueError("retention needs each token's attention input; build the cache with hidden_states=True "
                             "(CompressedCache(model, method) and CompressedCache.shared(...) do)")
        b, h, length = view.shape
        log_beta = self.log_beta(context.layer_idx, context.num_layers, h, hidden[:, :length])
        return log_beta.masked_fill(~view.valid, 0.0) if view.valid is not None else log_beta

    def prepare(self, view: KVView, context: LayerContext) -> None:
        view.channels[LOG_BETA] = self._prefill_log_beta(view, context)

    def score(self, view: KVView, context: LayerContext) -> torch.Tensor:
        return log_retention_score(view.channels[LOG_BETA], _age(view), self.horizon)

    # ----- decoding ---------------------------------------------------------------------------------
    def observe_step(self, view: KVView, context: LayerContext, col_sums: torch.Tensor | None) -> None:
        """Record the step's new entries' log β (one layer, or every layer at once: rows l·B + b)."""
        view.channels[LOG_BETA] = self._with_new_entries(view, context)

    def _with_new_entries(self, view: KVView, context: LayerContext) -> torch.Tensor:
        """The log-β channel [R, H, L] with the step's new entries (each head's last q) filled in."""
        channel = view.channels.get(LOG_BETA)
        channel = torch.zeros(view.shape, device=view.positions.device) if channel is None else channel.clone()
        hidden = context.observations.get("step_hidden")
        if hidden is None:
            raise ValueError("retention needs each step's attention input (the session passes it as step_hidden)")
        layers, q, heads = context.num_layers, hidden.shape[1], view.shape[1]
        if context.layer_idx >= 0:
            new = self.log_beta(context.layer_idx, layers, heads, hidden)
        else:  # every layer's new entries (rows l·B + b) through their gates in one product
            new = self.log_beta(None, layers, heads, hidden.view(layers, -1, *hidden.shape[1:])).flatten(0, 1)
        tail = (view.lengths.to(channel.device)[..., None] - q + torch.arange(q, device=channel.device)).clamp(min=0)
        return channel.scatter(-1, tail, new)


def _age(view: KVView) -> torch.Tensor:
    """t − i for every entry [B, H, L]: t is the row's newest position."""
    positions = view.positions if view.valid is None else view.positions.masked_fill(~view.valid, -1)
    newest = positions.amax(dim=(1, 2), keepdim=True)
    return (newest - view.positions).clamp(min=0)
