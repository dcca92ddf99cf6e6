"""Peer check: kvcompress's snapkv, streamingllm and adakv against kvpress's presses on the same prompts.

kvpress pins its own transformers, so it runs in a separate virtual environment:

    python -m venv /tmp/kvpress-venv && /tmp/kvpress-venv/bin/pip install torch==2.13.0 kvpress
    .venv/bin/python benchmarks/peer_kvpress.py ours   --method snapkv --out runs/peer   # our answers + prompt ids
    /tmp/kvpress-venv/bin/python benchmarks/peer_kvpress.py kvpress --method snapkv --out runs/peer
    .venv/bin/python benchmarks/peer_kvpress.py compare --method snapkv --out runs/peer

Pairs: snapkv ↔ SnapKVPress (avg pooling), streamingllm ↔ StreamingLLMPress (4 sinks; ours with
roll=False: kvpress compresses once at prefill, our default rolls the window while decoding),
adakv ↔ AdaKVPress(SnapKVPress) (α = 0.2; the allocations differ: ours is the paper's
b_h = α·B + (1 − α)·c_h, kvpress forces each head's top α·B entries, then prunes globally).
Files go to ``--out``/<method>/.

Both sides get the same token ids (our query-agnostic split: the compressed prefix ends
where the question starts), the same model weights (our cached checkpoint of the embedded
model), the same window, pooling kernel and kept ratio, and decode greedily.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def run_ours(args) -> None:
    import kvcompress as kvc
    from kvcompress import CompressedCache
    from kvcompress.eval.tasks import BUILTIN_TASKS, MAX_NEW_TOKENS, make_task
    from kvcompress.generate import answer, build_prompt, prefill
    from kvcompress.models import embedded_checkpoint

    model, tokenizer = kvc.load_model()
    snap = {"window": args.window, "kernel": args.kernel, "pooling": "avg"}
    options = {"snapkv": snap, "adakv": {**snap, "alpha": 0.2}, "streamingllm": {"sinks": 4, "roll": False}}[args.method]
    method = kvc.get_method(args.method, ratio=args.ratio, **options)
    per_task = args.samples // len(BUILTIN_TASKS)
    rows = []
    for task in BUILTIN_TASKS:
        for sample in make_task(task, tokenizer, per_task, args.context_tokens, args.seed):
            prompt = build_prompt(tokenizer, sample.context, sample.question)
            cache = CompressedCache(model, method)
            logits, _ = prefill(model, cache, prompt, False)
            out = answer(model, tokenizer, cache, prompt, logits, max_new_tokens=MAX_NEW_TOKENS[task], query_aware=False)
            kept = [int(n) for n in cache.session.lengths(0)[0]]
            rows.append({"id": sample.id, "task": task, "prefix_ids": prompt.prefix_ids, "suffix_ids": prompt.suffix_ids,
                         "max_new_tokens": MAX_NEW_TOKENS[task], "answers": sample.answers, "ours": out.text,
                         "ours_ids": out.token_ids, "ours_kept_layer0": kept})
            print(sample.id, repr(out.text), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"checkpoint": str(embedded_checkpoint()), "method": args.method, "ratio": args.ratio, "window": args.window,
            "kernel": args.kernel}
    (args.out / "ours.json").write_text(json.dumps({"meta": meta, "rows": rows}))


def run_kvpress(args) -> None:
    import torch
    from kvpress import AdaKVPress, SnapKVPress, StreamingLLMPress
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    data = json.loads((args.out / "ours.json").read_text())
    meta = data["meta"]
    model = AutoModelForCausalLM.from_pretrained(meta["checkpoint"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(meta["checkpoint"])
    ratio = 1 - meta["ratio"]
    snap = lambda: SnapKVPress(compression_ratio=ratio, window_size=meta["window"], kernel_size=meta["kernel"])  # noqa: E731
    press = {"snapkv": snap, "adakv": lambda: AdaKVPress(snap(), alpha_safeguard=0.2),
             "streamingllm": lambda: StreamingLLMPress(compression_ratio=ratio, n_sink=4)}[meta.get("method", "snapkv")]()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    results = []
    with torch.inference_mode():
        for row in data["rows"]:
            context = torch.tensor([row["prefix_ids"]])
            cache = DynamicCache()
            with press(model):
                model(input_ids=context, past_key_values=cache)
            kept = cache.layers[0].keys.shape[2]  # AdaKVPress masks instead of removing: this is the full length
            n = context.shape[1]
            positions = torch.arange(n, n + len(row["suffix_ids"])).unsqueeze(0)
            logits = model(input_ids=torch.tensor([row["suffix_ids"]]), past_key_values=cache, position_ids=positions,
                           logits_to_keep=1).logits
            ids = [int(logits[0, -1].argmax())]
            position = n + len(row["suffix_ids"])
            while len(ids) < row["max_new_tokens"] and ids[-1] not in eos:
                logits = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=cache,
                               position_ids=torch.tensor([[position]])).logits
                ids.append(int(logits[0, -1].argmax()))
                position += 1
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            results.append({"id": row["id"], "kvpress": text, "kvpress_ids": ids, "kvpress_kept_layer0": kept})
            print(row["id"], repr(text), flush=True)
    (args.out / "kvpress.json").write_text(json.dumps(results))


def compare(args) -> None:
    ours = json.loads((args.out / "ours.json").read_text())["rows"]
    theirs = {r["id"]: r for r in json.loads((args.out / "kvpress.json").read_text())}
    same = 0
    lines = ["| id | task | kept (ours / kvpress) | kvcompress | kvpress |", "|---|---|---|---|---|"]
    for row in ours:
        other = theirs[row["id"]]
        equal = row["ours_ids"] == other["kvpress_ids"]
        same += equal
        if not equal:
            lines.append(f"| {row['id']} | {row['task']} | {row['ours_kept_layer0'][0]} / {other['kvpress_kept_layer0']} | "
                         f"{row['ours']!r} | {other['kvpress']!r} |")
    summary = f"identical answers: {same}/{len(ours)} ({100 * same / len(ours):.0f}%)"
    report = summary + "\n\nDifferences:\n\n" + "\n".join(lines) + "\n"
    (args.out / "peer_kvpress.md").write_text(report)
    print(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("side", choices=["ours", "kvpress", "compare"])
    parser.add_argument("--method", choices=["snapkv", "streamingllm", "adakv"], default="snapkv")
    parser.add_argument("--out", type=Path, default=Path("runs/peer"))
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--kernel", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out = args.out / args.method
    {"ours": run_ours, "kvpress": run_kvpress, "compare": compare}[args.side](args)


if __name__ == "__main__":
    main()
