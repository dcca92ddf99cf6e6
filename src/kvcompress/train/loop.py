"""What every training run shares: its data, its schedule, and a resumable loop with snapshots.

Data: sequences the project generates — its built-in tasks (needles, variables, common words
hidden in its own prose) at seeds the evaluation never uses, with their answers — or files
(``--data``: JSONL task files or plain text cut into ``seq_len`` tokens, each document on its own where
form feeds separate documents as ``kvcompress corpus`` writes them; comma-separated, with
``generated`` for the tasks: a mix draws each sequence from one source at random). A run is
deterministic for a seed and resumable: ``--out`` keeps ``state.pt`` (parameters, optimizer, step,
losses) every ``save_every`` steps, a later call with the same folder and settings continues from there
(``run.json`` records them; other settings are refused), and the parameters of those steps stay in
``steps/NNNNNN/`` (a held-out score against training steps).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from .corpus import split_documents

TRAIN_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe")
FIRST_TRAIN_SEED = 1000  # eval samples use seeds 0..; training never sees them
GENERATED_DATA = ("generated: the built-in tasks niah_single, niah_multikey, niah_multivalue, vt, cwe in the project's own "
                  f"prose (kvcompress/data/haystack.txt) at seeds from {FIRST_TRAIN_SEED} on, with their answers; "
                  "contexts of seq_len/2 to seq_len−64 tokens")


GENERATED = "generated"  # in --data: the built-in task generators


def data_sources(data: str | None) -> list[str]:
    """The sources ``--data`` names: comma-separated files and ``generated`` (None: ``generated`` alone).
    Raises a clear error for a file that does not exist (before any model loads)."""
    sources = [part.strip() for part in (data or GENERATED).split(",") if part.strip()]
    missing = [part for part in sources if part != GENERATED and not Path(part).is_file()]
    if not sources or missing:
        raise FileNotFoundError(f"--data {data}: no such file {', '.join(missing) or '(none given)'}; give JSONL task "
                                f"files or plain text files, and '{GENERATED}' for the built-in tasks, comma-separated")
    return sources


def training_sequences(tokenizer, seq_len: int, seed: int, data: str | None = None) -> Iterator[list[int]]:
    """An endless, seeded stream of token id lists of at most ``seq_len`` tokens (see the module docstring).
    With several sources (``data_sources``) each sequence comes from one drawn at random, alike."""
    sources = data_sources(data)
    if len(sources) > 1:
        streams = [training_sequences(tokenizer, seq_len, seed + i, source) for i, source in enumerate(sources)]
        rng = random.Random(seed)
        while True:
            yield next(rng.choice(streams))
    if sources[0] != GENERATED:
        yield from _file_sequences(tokenizer, Path(sources[0]), seq_len, seed)
        return
    from ..eval.tasks import make_task

    rng = random.Random(seed)
    sample_seed = FIRST_TRAIN_SEED + seed * 100_000
    while True:
        task = rng.choice(TRAIN_TASKS)
        context_tokens = rng.randint(seq_len // 2, seq_len - 64)
        sample = make_task(task, tokenizer, 1, context_tokens, seed=sample_seed)[0]
        sample_seed += 1
        yield _sample_ids(tokenizer, sample, seq_len)


def _sample_ids(tokenizer, sample, seq_len: int) -> list[int]:
    """A task sample as one training sequence: its chat prompt (context, question), then its answers."""
    from ..generate import build_prompt

    answer = tokenizer(", ".join(sample.answers), add_special_tokens=False).input_ids
    return (build_prompt(tokenizer, sample.context, sample.question).ids + answer)[:seq_len]


def _file_sequences(tokenizer, path: Path, seq_len: int, seed: int) -> Iterator[list[int]]:
    if path.suffix == ".jsonl":
        from ..eval.tasks import load_task_file

        sequences = [_sample_ids(tokenizer, s, seq_len) for s in load_task_file(str(path))]
    else:
        sequences = _text_sequences(tokenizer, path.read_text(), seq_len)
    sequences = [s for s in sequences if len(s) >= 16]
    if not sequences:
        raise ValueError(f"--data {path}: no sequence of at least 16 tokens in it")
    rng = random.Random(seed)
    while True:
        yield rng.choice(sequences)


def _text_sequences(tokenizer, text: str, seq_len: int) -> list[list[int]]:
    """Plain text cut into sequences of ``seq_len`` tokens, each document (the parts between form feeds;
    a text without one is one document) on its own, so that no sequence spans two."""
    documents = split_documents(text)
    sequences = []
    for start in range(0, len(documents), 256):
        for ids in tokenizer([d for d in documents[start : start + 256] if d], add_special_tokens=False).input_ids:
            sequences += [ids[i : i + seq_len] for i in range(0, max(1, len(ids) - 16), seq_len)]
    return sequences


def warmup_cosine(steps: int, warmup: float) -> Callable[[int], float]:
    """The learning-rate factor: linear warm-up over ``warmup`` of the steps, then cosine decay to 0."""
    warm = max(1, int(steps * warmup))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, steps - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def fit(model, module: torch.nn.Module, losses: Callable[[torch.Tensor], dict], out: Path, settings: dict, *,
        tokenizer, data: str | None, steps: int, seq_len: int, seed: int, lr: float, warmup: float, save_every: int,
        save: Callable[[Path, dict], None], what: str, shown: tuple[str, ...], progress: bool = True,
        parameters: list | None = None) -> tuple[list[dict], float]:
    """Train ``module``'s parameters (or ``parameters``) on the frozen ``model`` with AdamW, minimizing
    ``losses(ids)["loss"]`` one sequence per step; ``save(folder, about)`` writes a snapshot every
    ``save_every`` steps. Resumes from ``out``/state.pt (``settings`` must equal the run's). Returns the
    loss history and the seconds the run trained (every resumed part of it: from the last saved state on,
    plus what the saved state had counted)."""
    out.mkdir(parents=True, exist_ok=True)
    params = parameters if parameters is not None else [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps, warmup))
    start, history, before = _resume(out, module, optimizer, schedule, {**settings, "data": data})
    stream = training_sequences(tokenizer, seq_len, seed, data)
    for _ in range(start):  # the same sequences as an uninterrupted run
        next(stream)
    model.requires_grad_(False).eval()
    began = time.perf_counter()
    bar = tqdm(range(start, steps), desc=f"train {what}", disable=not progress, initial=start, total=steps)
    for step in bar:
        ids = torch.tensor([next(stream)], device=model.device)
        parts = losses(ids)
        optimizer.zero_grad()
        parts["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        record = {k: round(float(v.detach()), 6) for k, v in parts.items()} | {"step": step + 1}
        history.append(record)
        bar.set_postfix({k: f"{record[k]:.4f}" for k in shown})
        if (step + 1) % save_every == 0 or step + 1 == steps:
            _save_state(out, module, optimizer, schedule, step + 1, history, before + time.perf_counter() - began)
            save(out / "steps" / f"{step + 1:06d}", {"step": step + 1})  # for a score-vs-steps curve
    return history, before + time.perf_counter() - began


def _save_state(out: Path, module, optimizer, schedule, step: int, history: list, seconds: float) -> None:
    state = {"module": module.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
             "step": step, "history": history, "seconds": seconds}
    tmp = out / ".state.partial.pt"
    torch.save(state, tmp)
    tmp.replace(out / "state.pt")


def _resume(out: Path, module, optimizer, schedule, ours: dict) -> tuple[int, list, float]:
    """(the step to start from, the losses so far, the seconds trained so far): 0 for a new run (``run.json``
    records its settings), else where ``state.pt`` left off — refused when the folder's run had other settings."""
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
        return 0, [], 0.0
    state = torch.load(path, weights_only=False)
    module.load_state_dict(state["module"])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    return state["step"], state["history"], state.get("seconds", 0.0)  # states saved before it was kept: 0


def use_attention(model, name: str, function) -> Callable[[], None]:
    """Register ``function`` as transformers' attention ``name`` (with SDPA's mask) and switch ``model`` to it;
    returns the undo."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    return lambda: model.set_attn_implementation(before)


def mean_tail(history: list, last: int = 20) -> dict:
    """The mean of every loss over the last ``last`` steps."""
    tail = history[-last:]
    keys = [k for k in (tail[0] if tail else {}) if k != "step"]
    return {k: round(sum(r[k] for r in tail) / len(tail), 6) for k in keys}


__all__ = ["FIRST_TRAIN_SEED", "GENERATED", "GENERATED_DATA", "TRAIN_TASKS", "data_sources", "fit",
           "mean_tail", "training_sequences", "use_attention", "warmup_cosine"]
