"""Learned global retention ("Make Each Token Count: Towards Improving Long-Context Performance with KV
Cache Eviction", seed 001; METHODS.md, "Learned global retention").

A small gate per layer ℓ and KV head h reads each token's attention input x_i once, when the
token enters the cache: e = SiLU(W_ℓh x_i + b_ℓh), β_ℓh(x_i) = sigmoid(uᵀe + c), with u and c
shared by every layer and head (the weight tying that puts every score on one scale). An
entry's score at step t is s_i(t) = Σ_{k=1..H} β_i^{t−i+k} (horizon H; H = 1 is myopic), and
one budget M = budget × layers × KV heads keeps the M best entries over **all** layers and
heads at once, so layers and heads end with very different lengths. While decoding, the new
entries' β join the ranking and the cache is cut back to M whenever it holds more than
M + ``buffer``.

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

from ..store.view import Edit, KVView, LayerContext
from .base import PROTECTED_PRIORITY, Needs, ScoreMethod, global_sizes, plus_protected, top_per_head
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

    def log_beta(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """log β [B, H, n] (float32, ≤ 0) of the tokens whose attention input is ``hidden`` [B, n, D]."""
        x = hidden.to(self.weight.dtype)
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
    ratio = torch.expm1(horizon * lb) / torch.expm1(lb)
    return (age.double() + 1) * lb + torch.log(ratio)


@dataclass
class Retention(ScoreMethod):
    """Learned retention gates ranked over every layer and head under one budget (seed 001).

    Options: checkpoint (a folder from ``kvcompress train retention``; None = the one shipped for the
    model it runs on), horizon (H of the score; 1 = myopic), buffer (entries over the budget before a
    re-rank while decoding), plus ScoreMethod's: ``layer_budgets="global"`` by default (the paper's);
    "uniform" with ``head_budgets`` uniform or adaptive are the per-layer / per-head ablations.
    """

    checkpoint: str | None = None
    horizon: int = 1
    buffer: int = 128
    layer_budgets: str = "global"

    name: ClassVar[str] = "retention"
    paper: ClassVar[str] = "Make Each Token Count: Towards Improving Long-Context Performance with KV Cache Eviction"
    evict_while_decoding: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.horizon < 1 or self.buffer < 0:
            raise ValueError(f"retention: horizon must be ≥ 1 and buffer ≥ 0, got horizon={self.horizon}, buffer={self.buffer}")
        check_checkpoint("retention", self.checkpoint)

    def needs(self) -> Needs:
        return Needs(hidden_states=True)

    @cached_property
    def gates(self) -> RetentionGates:
        """The gates: ``checkpoint``'s, else those shipped for the model ``check_model`` saw (the embedded
        model's before it has seen one)."""
        return RetentionGates.load(Path(self.checkpoint).expanduser() if self.checkpoint else SHIPPED / EMBEDDED)

    def check_model(self, config) -> None:
        super().check_model(config)
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

    def log_beta(self, layer: int, num_layers: int, heads: int, hidden: torch.Tensor) -> torch.Tensor:
        """log β [B, H, n] of one layer's tokens (attention inputs ``hidden`` [B, n, D])."""
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

    def score(self, view: KVView, context: LayerContext) -> torch.Tensor:
        if LOG_BETA not in view.channels:
            view.channels[LOG_BETA] = self._prefill_log_beta(view, context)
        return log_retention_score(view.channels[LOG_BETA], _age(view), self.horizon)

    def compress(self, view: KVView, context: LayerContext, sizes: torch.Tensor | None = None) -> Edit:
        view.channels[LOG_BETA] = self._prefill_log_beta(view, context)
        edit = super().compress(view, context, sizes)
        edit.channels[LOG_BETA] = view.channels[LOG_BETA]
        return edit

    # ----- decoding ---------------------------------------------------------------------------------
    def decode_step(self, view: KVView, context: LayerContext, col_sums: torch.Tensor | None) -> Edit:
        """Every layer at once (rows l·B + b): record the new entries' log β, then cut back to the budget when
        a row holds more than budget + buffer (over all layers and heads for the global budget)."""
        view.channels[LOG_BETA] = self._with_new_entries(view, context)
        edit = Edit(channels={LOG_BETA: view.channels[LOG_BETA]})
        budgets = self.decode_budget(context)  # [R] entries per head
        if self.layer_budgets == "global" and context.layer_idx >= 0:
            return edit  # a step cut short before the last layer: the global re-rank waits for a whole step
        if self.layer_budgets != "global":
            if bool((view.lengths > budgets[:, None] + self.buffer).any()):
                edit.keep = self.select(view, context, budgets, self.head_budgets)
            return edit
        layers = context.num_layers
        rows = view.shape[0] // layers
        heads = view.shape[1] * layers
        totals = view.lengths.view(layers, rows, -1).sum(dim=(0, 2))  # [B] entries per batch row
        allowed = budgets.view(layers, rows)[0] * heads
        over = totals > allowed + self.buffer  # only these batch rows are cut back
        if not bool(over.any()):
            return edit
        key = self.ranking_key(view, context, budgets)
        protected = key >= PROTECTED_PRIORITY
        keys = list(key.split(rows))
        sizes = global_sizes(keys, torch.clamp(allowed - protected.view(layers, rows, -1).sum(dim=(0, 2)).cpu(), min=0))
        lengths = view.lengths.split(rows)
        keep = torch.cat([top_per_head(k, plus_protected(s, p, n)) for k, s, p, n in zip(keys, sizes, protected.split(rows), lengths)])
        held = torch.arange(view.shape[2], device=keep.device) < view.lengths.to(keep.device)[..., None]
        edit.keep = torch.where(over.repeat(layers).to(keep.device)[:, None, None], keep, held)
        return edit

    def _with_new_entries(self, view: KVView, context: LayerContext) -> torch.Tensor:
        """The log-β channel [R, H, L] with the step's new entries (each head's last q) filled in."""
        channel = view.channels.get(LOG_BETA)
        channel = torch.zeros(view.shape, device=view.positions.device) if channel is None else channel.clone()
        hidden = context.observations.get("step_hidden")
        if hidden is None:
            raise ValueError("retention needs each step's attention input (the session passes it as step_hidden)")
        layers, q = context.num_layers, hidden.shape[1]
        rows = view.shape[0] // layers if context.layer_idx < 0 else view.shape[0]
        index = [context.layer_idx] if context.layer_idx >= 0 else range(layers)
        new = torch.cat([self.log_beta(i, layers, view.shape[1], part) for i, part in zip(index, hidden.split(rows))])
        tail = (view.lengths.to(channel.device)[..., None] - q + torch.arange(q, device=channel.device)).clamp(min=0)
        return channel.scatter(-1, tail, new)


def _age(view: KVView) -> torch.Tensor:
    """t − i for every entry [B, H, L]: t is the row's newest position."""
    positions = view.positions if view.valid is None else view.positions.masked_fill(~view.valid, -1)
    newest = positions.amax(dim=(1, 2), keepdim=True)
    return (newest - view.positions).clamp(min=0)
