"""``kvcompress bench``: speed and memory of each method against the full cache, in one run.

For a context length and batch size: prefill time, compression time, decode ms per token
(KeepKV's periodic refreshes included), KV bytes held, bytes kept off the accelerator
(KeepKV's CPU copy for refresh) and peak memory, each also as a ratio to ``full`` measured in the same run
(these machines are noisy; only same-run ratios are comparable). Peak memory is the
process's peak resident set size growth on CPU (sampled every millisecond from
/proc/self/statm) and ``torch.cuda.max_memory_allocated`` on GPU.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

import torch
from tqdm import tqdm

from transformers import DynamicCache

from .hf import CompressedCache
from .methods import Policy
from .models import cache_kwargs

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * _PAGE


@contextmanager
def peak_memory(device: torch.device):
    """Yields a dict whose ``peak_bytes`` is filled with the peak memory growth inside the block."""
    result = {"peak_bytes": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        return
    if not os.path.exists("/proc/self/statm"):
        yield result
        return
    base, peak, stop = _rss(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        result["peak_bytes"] = max(peak[0], _rss()) - base


def cpu_description() -> str:
    """This machine's CPU, its family and model numbers where the system gives them, and the vector instructions ATen
    picked for it ("AMD EPYC, family 26 model 2 (AVX512)"), for a result file: timings are comparable only between runs
    on the same kind of CPU, and a virtual machine's model name alone ("AMD EPYC") does not tell one generation from
    another."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if not key.strip():  # the first processor's block ends at its blank line
                    break
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name", "unknown CPU")
    if "cpu family" in fields and "model" in fields:
        name += f", family {fields['cpu family']} model {fields['model']}"
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _PlainCache(DynamicCache):
    """transformers' own DynamicCache with the stats bench reads: the overhead baseline for ``full``."""

    timings = {"compress_s": 0.0}

    def stats(self) -> dict:
        held = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in self.layers)
        return {"kv_bytes": held, "kv_bytes_full": held, "kr": 1.0, "cr": 1.0}


@torch.inference_mode()
def bench_one(model, method: Policy | None, input_ids: torch.Tensor, decode_tokens: int, tokenizer=None) -> dict:
    """Prefill ``input_ids`` [B, n], compress, decode ``decode_tokens`` greedy steps; timings and memory.

    ``method=None`` runs transformers' plain DynamicCache (row ``hf_dynamic_cache``); ``tokenizer``: for a method
    that replays the prompt (KVzip; default: the model's own).
    """
    device = input_ids.device
    with peak_memory(device) as memory:
        cache = CompressedCache(model, method, tokenizer=tokenizer) if method is not None else _PlainCache()
        _sync(device)
        start = time.perf_counter()
        logits = model(input_ids, **cache_kwargs(cache), logits_to_keep=1).logits
        _sync(device)
        prefill_wall = time.perf_counter() - start
        compressed = cache.stats()
        next_ids = logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(decode_tokens):
            logits = model(next_ids, **cache_kwargs(cache)).logits
            next_ids = logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        decode_wall = time.perf_counter() - start
        after_decode = cache.stats()
    return {
        "method": method.variant if method else "hf_dynamic_cache",
        "budget": method.budget if method else None,
        "ratio": method.ratio if method else None,
        "prefill_s": prefill_wall - cache.timings["compress_s"],
        "compress_s": cache.timings["compress_s"],
        "decode_ms_per_token": 1000 * decode_wall / max(decode_tokens, 1),
        "kv_bytes": compressed["kv_bytes"], "kv_bytes_full": compressed["kv_bytes_full"],
        "kr": compressed["kr"], "cr": after_decode["cr"],  # entries read per decoding step ÷ full
        "peak_bytes": memory["peak_bytes"],
        "offloaded_bytes": after_decode.get("offloaded_bytes", 0),  # held off the accelerator (KeepKV refresh)
    }


def bench(model, tokenizer, methods: list[Policy], *, context_tokens: int, batch_size: int = 1,
          decode_tokens: int = 32, repeats: int = 1, seed: int = 0, progress: bool = True) -> list[dict]:
    """One row per method (after transformers' plain DynamicCache as ``hf_dynamic_cache``), with
    ratios to ``full`` from the same run.

    The input is random token ids (the speed of attention does not depend on the text).
    Each configuration runs once to warm up, then ``repeats`` rounds run every configuration once each
    (interleaved, so the rows share whatever else the machine does); the median is kept.
    """
    limit = model.config.max_position_embeddings
    if context_tokens + decode_tokens > limit:
        raise ValueError(f"context_tokens + decode_tokens = {context_tokens + decode_tokens} exceeds the model's {limit} positions")
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    low = min(100, vocab // 2)  # skip the special tokens at the start of most vocabularies
    ids = torch.randint(low, vocab, (batch_size, context_tokens), generator=generator).to(model.device)
    configs = [None, *methods]
    for method in configs:
        bench_one(model, method, ids[:, : min(256, context_tokens)], 2, tokenizer)  # warm-up
    measured: list[list[dict]] = [[] for _ in configs]
    with tqdm(total=repeats * len(configs), desc=f"bench {context_tokens} tokens", disable=not progress) as bar:
        for _ in range(repeats):  # round-robin, so a load that comes and goes falls on every row alike
            for i, method in enumerate(configs):
                measured[i].append(bench_one(model, method, ids, decode_tokens, tokenizer))
                bar.update()
    rows = []
    for runs in measured:
        row = {}
        for key in runs[0]:
            values = [r[key] for r in runs]
            row[key] = sorted(values)[len(values) // 2] if isinstance(values[0], float) else values[0]
        row.update({"context_tokens": context_tokens, "batch_size": batch_size, "decode_tokens": decode_tokens})
        rows.append(row)
    full = next((r for r in rows if r["method"] == "full"), None)
    if full is not None:
        for r in rows:
            for key in ("prefill_s", "decode_ms_per_token", "kv_bytes", "peak_bytes"):
                r[f"{key}_vs_full"] = r[key] / full[key] if full[key] else None
            r["compress_vs_full_prefill"] = r["compress_s"] / full["prefill_s"] if full["prefill_s"] else None
    return rows


def bandwidth_bound(model, context_tokens: int, kr: float) -> float:
    """The decode speedup memory traffic allows one stream: (W + KV) / (W + kr·KV), W the weights' bytes
    and KV the full cache's bytes of ``context_tokens`` (a step reads both once)."""
    from .models import model_facts

    facts = model_facts(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    element = next(model.parameters()).element_size()
    kv = 2 * facts.num_layers * facts.num_kv_heads * facts.head_dim * element * context_tokens
    return (weights + kv) / (weights + kr * kv)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def bench_engine(llm, methods: list[Policy | None], *, requests: int, context_tokens: int, max_tokens: int, seed: int = 0,
                 progress: bool = True) -> list[dict]:
    """Serve ``requests`` prompts of ``context_tokens`` random tokens (``max_tokens`` new each, end of sequence
    ignored) with each method on one engine: concurrency, throughput, TTFT and time per output token, with
    ratios to ``full`` from the same run. ``None`` in ``methods`` is ``full``."""
    from .engine import SamplingParams

    limit = llm.max_model_len
    if context_tokens + max_tokens > limit:
        raise ValueError(f"context_tokens + max_tokens = {context_tokens + max_tokens} exceeds the model's {limit} positions")
    if requests < 1 or max_tokens < 1:
        raise ValueError("requests and max_tokens must be ≥ 1")
    vocab = llm.model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(min(100, vocab // 2), vocab, (requests, context_tokens), generator=generator).tolist()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for method in tqdm(methods, desc=f"engine {requests}×{context_tokens}", disable=not progress):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, method=method)
        wall = time.perf_counter() - start
        stats = llm.stats()
        errors = [o.error for o in outs if o.finish_reason == "error"]
        ttft = [o.stats["ttft_s"] for o in outs if "ttft_s" in o.stats]
        tpot = [o.stats["decode_ms_per_token"] for o in outs if "decode_ms_per_token" in o.stats]
        new_tokens = sum(len(o.token_ids) for o in outs)
        rows.append({
            "method": method.variant if method is not None else "full",
            "budget": getattr(method, "budget", None), "ratio": getattr(method, "ratio", None),
            "requests": requests, "context_tokens": context_tokens, "max_tokens": max_tokens,
            "kv_memory": stats["pool_capacity_bytes"],
            "max_concurrent": stats["max_concurrent"],
            "decode_tokens_per_s": stats["decode_tokens_per_s"],
            "prefill_tokens_per_s": stats["prefill_tokens_per_s"],
            "end_to_end_tokens_per_s": new_tokens / wall,
            "ttft_s_median": _percentile(ttft, 0.5), "ttft_s_p90": _percentile(ttft, 0.9),
            "tpot_ms_median": _percentile(tpot, 0.5), "tpot_ms_p90": _percentile(tpot, 0.9),
            "preemptions": stats["preemptions"], "pool_peak_bytes": stats["pool_peak_bytes"], "first_error": errors[0] if errors else None,
            "pool_allocated_bytes": stats["pool_allocated_bytes"],
            "pool_used_bytes_after": stats["pool_used_bytes"], "errors": len(errors), "wall_s": wall,
            "kr": sum(o.stats.get("kr", 1.0) for o in outs) / len(outs),
        })
    full = next((r for r in rows if r["method"] == "full"), None)
    if full is not None:
        for r in rows:
            for key in ("max_concurrent", "decode_tokens_per_s", "end_to_end_tokens_per_s", "ttft_s_median", "tpot_ms_median"):
                r[f"{key}_vs_full"] = r[key] / full[key] if full[key] else None
    return rows
