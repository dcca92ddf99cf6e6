"""``kvcompress train retention``: fit retention gates on a frozen model (seed 001; METHODS.md,
"Learned global retention").

The student is the model itself with retention-gated attention: logit ℓ_{t,i} + (t − i)·log β_i,
β from the gates of the layer and KV head (``methods/retention.py``). The teacher is the same model
with plain attention. Loss = KL(p_teacher ‖ p_student) over next-token distributions
+ ``next_token``·cross-entropy + ``capacity``·L_cap, with the global capacity term
L_cap = mean_t ReLU(Σ_{ℓ,h} Σ_{i≤t} β_i^{t−i} − M) / M, M = ``budget`` × layers × KV heads.
Only the gates learn (AdamW, linear warm-up then cosine decay).

Data, resuming and snapshots: ``train/loop.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..hf.cache import watch_attention_inputs
from ..methods.retention import RetentionGates
from ..models import attention_modules, model_facts
from .loop import GENERATED_DATA, fit, mean_tail, use_attention

GATED = "kvcompress_retention_train"


@dataclass
class RetentionTraining:
    """Hyperparameters of a run (stored in config.json); the defaults made the shipped checkpoint."""

    steps: int = 800
    seq_len: int = 512
    budget: int = 128  # entries per KV head on average in the capacity term
    width: int = 16
    lr: float = 2e-3
    warmup: float = 0.05
    capacity: float = 1.0
    next_token: float = 0.0
    c_init: float = 10.0
    seed: int = 0
    save_every: int = 100


class _Gating:
    """What the gated attention function reads during a student forward: the gates and where the
    capacity sums go (None: plain attention, the teacher)."""

    gates: RetentionGates | None = None
    occupancy: list[torch.Tensor] = []


def gated_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention with logits + (t − i)·log β_i (β of the layer's KV heads, shared by their query
    groups); adds Σ_{i≤t} β_i^{t−i} per head to ``_Gating.occupancy``. Plain SDPA for the teacher."""
    gates = _Gating.gates
    if gates is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    b, hq, n, d = query.shape
    heads = key.shape[1]
    log_beta = gates.log_beta(module.layer_idx, module._kvcompress_hidden)  # [B, H, n]
    age = torch.arange(n, device=query.device)
    age = (age[:, None] - age[None, :]).float()  # t − i
    causal = age >= 0
    bias = (age.clamp(min=0)[None, None] * log_beta[:, :, None, :]).masked_fill(~causal, float("-inf"))  # [B, H, n, n]
    _Gating.occupancy.append(bias.exp().sum(dim=-1).sum(dim=1))  # [B, n]: Σ_h Σ_{i≤t} β^{t−i}
    groups = hq // heads
    out = F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                         attn_mask=bias.repeat_interleave(groups, 1), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def losses(model, gates: RetentionGates, ids: torch.Tensor, settings: RetentionTraining, budget_total: int) -> dict:
    """KL(teacher ‖ student), next-token cross-entropy, capacity term and their weighted sum for one batch."""
    _Gating.gates = None
    with torch.no_grad():
        teacher = F.log_softmax(model(ids).logits.float(), dim=-1)
    _Gating.gates, _Gating.occupancy = gates, []
    try:
        student = F.log_softmax(model(ids).logits.float(), dim=-1)
        occupancy = torch.stack(_Gating.occupancy).sum(dim=0)  # [B, n], over every layer and head
    finally:
        _Gating.gates, _Gating.occupancy = None, []
    kl = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()
    ce = F.nll_loss(student[:, :-1].reshape(-1, student.shape[-1]), ids[:, 1:].reshape(-1))
    cap = (F.relu(occupancy - budget_total) / budget_total).mean()
    total = kl + settings.next_token * ce + settings.capacity * cap
    return {"loss": total, "kl": kl, "ce": ce, "capacity": cap}


def train_retention(model, tokenizer, out: Path | str, settings: RetentionTraining, *, data: str | None = None,
                    model_name: str = "", progress: bool = True) -> dict:
    """Train gates for ``model`` (frozen) and write ``out``/model.safetensors + config.json; returns the final
    losses. Resumes from ``out``/state.pt when a previous run left one."""
    out = Path(out)
    facts = model_facts(model)
    torch.manual_seed(settings.seed)
    gates = RetentionGates(facts.num_layers, facts.num_kv_heads, model.config.hidden_size, settings.width, settings.c_init,
                           seed=settings.seed)
    budget_total = settings.budget * facts.num_layers * facts.num_kv_heads
    restore = _use_gated_attention(model)
    try:
        history, seconds = fit(
            model, gates, lambda ids: losses(model, gates, ids, settings, budget_total), out, asdict(settings),
            tokenizer=tokenizer, data=data, steps=settings.steps, seq_len=settings.seq_len, seed=settings.seed,
            lr=settings.lr, warmup=settings.warmup, save_every=settings.save_every,
            save=lambda folder, about: gates.save(folder, model=model_name, **about), what="retention",
            shown=("kl", "capacity"), progress=progress)
    finally:
        restore()
    final = mean_tail(history)
    gates.save(out, model=model_name, settings=asdict(settings), data=data or GENERATED_DATA, final_losses=final,
               train_seconds=round(seconds, 1), history=history[:: max(1, len(history) // 100)])
    return final


def _use_gated_attention(model):
    """Switch ``model`` to the gated attention (and watch its attention inputs); returns the undo."""
    watch_attention_inputs(attention_modules(model))
    return use_attention(model, GATED, gated_attention)
