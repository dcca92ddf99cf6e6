"""Which methods keep the needle: share of the answer's tokens each KV head still holds after compression.

    .venv/bin/python benchmarks/needle_retention.py --methods gvote,gvote:include_current=True,snapkv --ratio 0.35 --samples 4

For built-in niah_single samples (query-aware: the question is in the compressed prefix), finds
the positions of the needle's number in the prompt, compresses one shared prefill with each
method and reports the mean share of those positions kept per KV head, how many heads keep
all of them, and the share per layer. Task accuracy needs the needle's tokens in the heads
that retrieve; this shows where a method loses them.
"""

from __future__ import annotations

import argparse

import torch

import kvcompress as kvc
from kvcompress import CompressedCache
from kvcompress.eval.tasks import make_task
from kvcompress.generate import build_prompt, prefill
from kvcompress.methods import MethodSpec


def needle_positions(prompt_ids: list[int], answer_ids: list[int]) -> list[int]:
    """Positions of the first occurrence of the answer's tokens in the prompt."""
    n = len(answer_ids)
    start = next(i for i in range(len(prompt_ids) - n + 1) if prompt_ids[i : i + n] == answer_ids)
    return list(range(start, start + n))


def kept_share(view, positions: list[int]) -> list[float]:
    """Per KV head of batch row 0: the share of ``positions`` a layer's view still holds."""
    held = view.positions[0].long()
    if view.valid is not None:
        held = held.masked_fill(~view.valid[0], -1)
    wanted = torch.tensor(positions)
    return [float(torch.isin(wanted, held[h]).float().mean()) for h in range(view.shape[1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="gvote,gvote:include_current=True,snapkv,snapkv+gvote")
    parser.add_argument("--ratio", type=float, default=0.35, help="size of the methods that take one")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--context-tokens", type=int, default=1024)
    args = parser.parse_args()
    model, tokenizer = kvc.load_model()
    specs = args.methods.split(",")
    methods = [MethodSpec.parse(s).build(**({"ratio": args.ratio} if MethodSpec.parse(s).takes_size else {}))
               for s in specs]
    totals = {m.label: [] for m in methods}
    for sample in make_task("niah_single", tokenizer, args.samples, args.context_tokens, seed=0):
        prompt = build_prompt(tokenizer, sample.context, sample.question)
        positions = needle_positions(prompt.ids, tokenizer(sample.answers[0], add_special_tokens=False).input_ids)
        shared = CompressedCache.shared(model, methods)
        with torch.no_grad():
            prefill(model, shared, prompt, True)
            for method in methods:
                cache = shared.fork(method)
                views = [cache.session.view(i) for i in range(cache.session.num_layers)]
                totals[method.label].append((cache.stats()["kr"], [kept_share(view, positions) for view in views]))
                cache.release()
    print(f"niah_single, {args.samples} samples, {args.context_tokens} context tokens, query-aware\n")
    print("| method | kr | mean share of the needle kept per head | heads keeping all of it | share per layer (first → last) |")
    print("|---|---|---|---|---|")
    for label, runs in totals.items():
        kr = sum(k for k, _ in runs) / len(runs)
        heads = [share for _, layers in runs for layer in layers for share in layer]
        layers = len(runs[0][1])
        by_layer = [sum(sum(r[1][i]) / len(r[1][i]) for r in runs) / len(runs) for i in range(layers)]
        print(f"| {label} | {kr:.3f} | {sum(heads) / len(heads):.2f} | {sum(s == 1.0 for s in heads) / len(heads):.0%} | "
              + " ".join(f"{x:.1f}" for x in by_layer) + " |")


if __name__ == "__main__":
    main()
