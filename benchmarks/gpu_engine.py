"""kvcompress's engine end to end on a CUDA GPU, with random-init models (no weights reach the GPU machine).

    python benchmarks/gpu_engine.py [--out runs/gpu_engine.json] [--contexts 8192,32768] [--requests 8]

1. Exactness, small float32 Llama on the GPU: the engine's full cache gives ``model.generate``'s tokens, token for
   token, for prompts of mixed lengths decoded together; each method gives the same tokens batched as alone.
2. Speed at real size: a random-init model of Llama-3.1-8B's shape in bfloat16 (32 layers, hidden 4096, 32 query and
   8 KV heads, MLP 14336; a 32000-word vocabulary instead of 128256, which changes only the last product), served by
   ``kvc.LLM(device="cuda")`` through ``bench_engine`` (the ``kvcompress bench --engine`` measurement): prefill,
   decode and end-to-end tokens per second with full, SnapKV at a tenth and 2-bit KIVI, at each context. The decode
   step's bandwidth bound (weights + the cache a step reads, over the copy bandwidth) is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from gpu_kernels import copy_bandwidth  # beside this file
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from kvcompress.bench import bench_engine
from kvcompress.engine import LLM, SamplingParams
from kvcompress.methods import get_method

METHODS = ("snapkv:ratio=0.25", "adakv:ratio=0.25", "kivi:bits=2", "h2o:ratio=0.25", "streamingllm:ratio=0.25", "quest:ratio=0.25",
           "kvzip:ratio=0.25", "expected_attention:ratio=0.25")


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``vocab_size`` words (w0, w1, ...), id 1 the end of sequence."""
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(vocab_size - 2)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>", pad_token="</s>")
    tokenizer.padding_side = "left"
    return tokenizer


def random_model(config: LlamaConfig, dtype: torch.dtype, device: str):
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.generation_config.pad_token_id = 1
    return model


def exactness(device: str) -> dict:
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, bos_token_id=1, eos_token_id=1,
                         tie_word_embeddings=False)
    model, tokenizer = random_model(config, torch.float32, device), word_tokenizer(512)
    llm = LLM(model_and_tokenizer=(model, tokenizer), device=device, kv_memory="256MiB", max_num_seqs=8)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (int(n),), generator=generator).tolist() for n in (37, 300, 129, 700, 64, 1500)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = [o.token_ids for o in llm.generate(prompts, params)]
    same = 0
    for prompt, tokens in zip(prompts, engine):
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, min_new_tokens=24)
        same += out[0, len(prompt):].tolist() == tokens
    report = {"full_same_as_generate": f"{same}/{len(prompts)}", "methods": {}}
    print("full = model.generate:", report["full_same_as_generate"], flush=True)
    for spec in METHODS:
        try:
            batched = llm.generate(prompts, params, method=spec)
            alone = [llm.generate([p], params, method=spec)[0] for p in prompts]
            errors = [o.error for o in batched + alone if o.finish_reason == "error"]
            agree = sum(b.token_ids == a.token_ids for b, a in zip(batched, alone))
            report["methods"][spec] = {"batched_same_as_alone": f"{agree}/{len(prompts)}", "errors": errors[:2]}
        except Exception as error:
            report["methods"][spec] = {"exception": f"{type(error).__name__}: {error}"}
        print(spec, report["methods"][spec], flush=True)
    return report


def speed(device: str, contexts: list[int], requests: int, max_tokens: int) -> dict:
    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=500000.0, bos_token_id=1,
                         eos_token_id=1, tie_word_embeddings=False)
    start = time.perf_counter()
    model = random_model(config, torch.bfloat16, device)
    print(f"8B-shape model made in {time.perf_counter() - start:.1f} s", flush=True)
    llm = LLM(model_and_tokenizer=(model, word_tokenizer(32000)), device=device, kv_memory="40GiB", max_num_seqs=requests,
              max_num_batched_tokens=8192)
    copy = copy_bandwidth(torch.device(device))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for context in contexts:
        methods = [None, get_method("snapkv:ratio=0.1"), get_method("kivi:bits=2")]
        for row in bench_engine(llm, methods, requests=requests, context_tokens=context, max_tokens=max_tokens, progress=False):
            kv_bytes = requests * (context + max_tokens / 2) * 32 * 8 * 128 * 2 * 2 * row["kr"]
            row["decode_bound_tokens_per_s"] = requests / ((weight_bytes + kv_bytes) / copy)
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("method", "context_tokens", "prefill_tokens_per_s", "decode_tokens_per_s",
                                                  "end_to_end_tokens_per_s", "decode_bound_tokens_per_s", "errors", "first_error", "max_concurrent")}), flush=True)
    return {"copy_GBps": copy / 1e9, "weight_bytes": weight_bytes, "rows": rows,
            "profile": profile_steps(llm, contexts[0], requests)}


def profile_steps(llm: LLM, context: int, requests: int, steps: int = 6) -> dict:
    """Where a decoding step's time goes: the step's wall time, the GPU's busy time within it (the sum of its kernels'
    times) and the top operators by host time, from ``torch.profiler`` over ``steps`` decode-only steps."""
    generator = torch.Generator().manual_seed(2)
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    ids = [llm.add_request(torch.randint(100, 32000, (context,), generator=generator).tolist(), params) for _ in range(requests)]
    while any(not llm.request(i).output_ids for i in ids):
        llm.step()
    llm.step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    while any(not llm.request(i).finished for i in ids):
        llm.step()
    for i in ids:
        llm.output(i)
    events = prof.key_averages()
    gpu_busy = sum(e.self_device_time_total for e in events) / 1e3 / steps  # ms
    table = events.table(sort_by="self_cpu_time_total", row_limit=25)
    print(table, flush=True)
    print(f"decode step: {wall * 1e3:.1f} ms wall, GPU busy {gpu_busy:.1f} ms", flush=True)
    return {"step_ms": wall * 1e3, "gpu_busy_ms": gpu_busy, "table": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_engine.json"))
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skip-exactness", action="store_true")
    args = parser.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if not args.skip_exactness:
        report["exactness"] = exactness("cuda")
    report["speed"] = speed("cuda", [int(c) for c in args.contexts.split(",")], args.requests, args.max_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\n{report['device']}, copy {report['speed']['copy_GBps']:.0f} GB/s")
    print(f"{'method':14} {'ctx':>6} {'prefill tok/s':>13} {'decode tok/s':>12} {'bound':>8} {'e2e tok/s':>9} {'errors':>6}")
    for r in report["speed"]["rows"]:
        print(f"{r['method']:14} {r['context_tokens']:6} {r['prefill_tokens_per_s']:13.0f} {r['decode_tokens_per_s']:12.1f} "
              f"{r['decode_bound_tokens_per_s']:8.1f} {r['end_to_end_tokens_per_s']:9.1f} {r['errors']:6}")


if __name__ == "__main__":
    main()
