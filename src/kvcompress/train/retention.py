"""``kvcompress train retention``: fit retention gates on a frozen model (seed 001; METHODS.md,
"Learned global retention").

The student is the model itself with retention-gated attention: logit ℓ_{t,i} + (t − i)·log β_i,
β from the gates of the layer and KV head (``methods/retention.py``). The teacher is the same model
with plain attention. Loss = KL(p_teacher ‖ p_student) over next-token distributions
+ ``next_token``·cross-entropy + ``capacity``·L_cap, with the global capacity term
L_cap = mean_t ReLU(Σ_{ℓ,h} Σ_{i≤t} β_i^{t−i} − M) / M, M = ``budget`` × layers × KV heads.
Only the gates learn (AdamW, linear warm-up then cosine decay).

Data: sequences the project generates — its built-in tasks (needles, variables, common words
hidden in its own prose) at seeds the evaluation never uses, with their answers — or a file
(``--data``: a JSONL task file or plain text cut into ``seq_len`` tokens). The run is
deterministic for a seed and resumable: ``--out`` keeps ``state.pt`` (gates, optimizer, step)
every ``save_every`` steps, and a later call with the same folder continues from there; the gates
of those steps stay in ``steps/NNNNNN/`` (a held-out score against training steps).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..hf.cache import watch_attention_inputs
from ..methods.retention import RetentionGates
from ..models import attention_modules, model_facts

GATED = "kvcompress_retention_train"
TRAIN_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe")
FIRST_TRAIN_SEED = 1000  # eval samples use seeds 0..; training never sees them


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


def training_sequences(tokenizer, settings: RetentionTraining, data: str | None = None):
    """An endless, seeded stream of token id lists of at most ``seq_len`` tokens (see the module docstring)."""
    if data is not None:
        yield from _file_sequences(tokenizer, Path(data), settings)
        return
    from ..eval.tasks import make_task

    rng = random.Random(settings.seed)
    seed = FIRST_TRAIN_SEED + settings.seed * 100_000
    while True:
        task = rng.choice(TRAIN_TASKS)
        context_tokens = rng.randint(settings.seq_len // 2, settings.seq_len - 64)
        sample = make_task(task, tokenizer, 1, context_tokens, seed=seed)[0]
        seed += 1
        yield _sample_ids(tokenizer, sample, settings.seq_len)


def _sample_ids(tokenizer, sample, seq_len: int) -> list[int]:
    """A task sample as one training sequence: its chat prompt (context, question), then its answers."""
    from ..generate import build_prompt

    answer = tokenizer(", ".join(sample.answers), add_special_tokens=False).input_ids
    return (build_prompt(tokenizer, sample.context, sample.question).ids + answer)[:seq_len]


def _file_sequences(tokenizer, path: Path, settings: RetentionTraining):
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file (a JSONL task file or a plain text file)")
    if path.suffix == ".jsonl":
        from ..eval.tasks import load_task_file

        sequences = [_sample_ids(tokenizer, s, settings.seq_len) for s in load_task_file(str(path))]
    else:
        ids = tokenizer(path.read_text(), add_special_tokens=False).input_ids
        sequences = [ids[i : i + settings.seq_len] for i in range(0, max(1, len(ids) - 16), settings.seq_len)]
    sequences = [s for s in sequences if len(s) >= 16]
    if not sequences:
        raise ValueError(f"--data {path}: no sequence of at least 16 tokens in it")
    rng = random.Random(settings.seed)
    while True:
        yield rng.choice(sequences)


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
    out.mkdir(parents=True, exist_ok=True)
    facts = model_facts(model)
    torch.manual_seed(settings.seed)
    gates = RetentionGates(facts.num_layers, facts.num_kv_heads, model.config.hidden_size, settings.width, settings.c_init,
                           seed=settings.seed)
    optimizer = torch.optim.AdamW(gates.parameters(), lr=settings.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(settings))
    start, history = _resume(out, gates, optimizer, schedule, settings, data)
    stream = training_sequences(tokenizer, settings, data)
    for _ in range(start):  # the same sequences as an uninterrupted run
        next(stream)
    budget_total = settings.budget * facts.num_layers * facts.num_kv_heads
    model.requires_grad_(False).eval()
    restore = _use_gated_attention(model)
    began = time.perf_counter()
    try:
        bar = tqdm(range(start, settings.steps), desc="train retention", disable=not progress, initial=start, total=settings.steps)
        for step in bar:
            ids = torch.tensor([next(stream)], device=model.device)
            parts = losses(model, gates, ids, settings, budget_total)
            optimizer.zero_grad()
            parts["loss"].backward()
            torch.nn.utils.clip_grad_norm_(gates.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            record = {k: round(float(v.detach()), 6) for k, v in parts.items()} | {"step": step + 1}
            history.append(record)
            bar.set_postfix(kl=f"{record['kl']:.4f}", cap=f"{record['capacity']:.3f}")
            if (step + 1) % settings.save_every == 0 or step + 1 == settings.steps:
                _save_state(out, gates, optimizer, schedule, step + 1, history)
                gates.save(out / "steps" / f"{step + 1:06d}", model=model_name, step=step + 1)  # for a score-vs-steps curve
    finally:
        restore()
    final = _mean_tail(history)
    gates.save(out, model=model_name, settings=asdict(settings), data=data or _GENERATED_DATA, final_losses=final,
               train_seconds=round(time.perf_counter() - began, 1), history=history[:: max(1, len(history) // 100)])
    return final


_GENERATED_DATA = ("generated: the built-in tasks niah_single, niah_multikey, niah_multivalue, vt, cwe in the project's own "
                   f"prose (kvcompress/data/haystack.txt) at seeds from {FIRST_TRAIN_SEED} on, with their answers; "
                   "contexts of seq_len/2 to seq_len−64 tokens")


def _warmup_cosine(settings: RetentionTraining):
    warm = max(1, int(settings.steps * settings.warmup))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, settings.steps - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _use_gated_attention(model):
    """Switch ``model`` to the gated attention (and watch its attention inputs); returns the undo."""
    AttentionInterface.register(GATED, gated_attention)
    AttentionMaskInterface.register(GATED, sdpa_mask)
    watch_attention_inputs(attention_modules(model))
    before = model.config._attn_implementation
    model.set_attn_implementation(GATED)
    return lambda: model.set_attn_implementation(before)


def _save_state(out: Path, gates, optimizer, schedule, step: int, history: list) -> None:
    state = {"gates": gates.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
             "step": step, "history": history}
    tmp = out / ".state.partial.pt"
    torch.save(state, tmp)
    tmp.replace(out / "state.pt")


def _resume(out: Path, gates, optimizer, schedule, settings: RetentionTraining, data: str | None) -> tuple[int, list]:
    """(the step to start from, the losses so far): 0 for a new run (``run.json`` records its settings), else
    where ``state.pt`` left off — refused when the folder's run had other settings."""
    ours = {**asdict(settings), "data": data}
    run = out / "run.json"
    if run.is_file():
        saved = json.loads(run.read_text())
        differing = sorted(k for k in set(saved) | set(ours) if saved.get(k) != ours.get(k) and k != "save_every")
        if differing:
            raise ValueError(f"{out} holds a run with other {', '.join(differing)}; resume with the flags that made it, "
                             "or train into a new --out")
    else:
        run.write_text(json.dumps(ours, indent=2) + "\n")
    path = out / "state.pt"
    if not path.is_file():
        return 0, []
    state = torch.load(path, weights_only=False)
    gates.load_state_dict(state["gates"])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    return state["step"], state["history"]


def _mean_tail(history: list, last: int = 20) -> dict:
    tail = history[-last:]
    return {k: round(sum(r[k] for r in tail) / len(tail), 6) for k in ("loss", "kl", "ce", "capacity")} if tail else {}
