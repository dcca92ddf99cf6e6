"""Where one global budget goes: entries each layer and KV head keeps under learned retention.

    .venv/bin/python benchmarks/retention_layout.py --ratio 0.25 --samples 4 --out docs/figures/retention_layout.png

Compresses built-in task prompts (the context only, as the question-after-compression protocol
does) with ``retention`` at one ratio and draws the mean entries kept per layer and head as a
heat map, next to the kept share per layer; prints the per-layer shares (kr of each layer).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress import CompressedCache
from kvcompress.eval.report import plt
from kvcompress.eval.tasks import BUILTIN_TASKS, make_task
from kvcompress.generate import build_prompt, prefill


def kept_per_head(model, tokenizer, method, samples: int, context_tokens: int) -> tuple[torch.Tensor, int]:
    """Mean entries kept [layers, KV heads] over the samples, and the mean context length."""
    total, tokens, count = None, 0, 0
    for task in BUILTIN_TASKS:
        for sample in make_task(task, tokenizer, samples, context_tokens, seed=0):
            prompt = build_prompt(tokenizer, sample.context, sample.question)
            cache = CompressedCache(model, method)
            prefill(model, cache, prompt, query_aware=False)
            sizes = torch.stack([cache.session.lengths(i)[0] for i in range(len(cache.session.layers))]).double()
            total = sizes if total is None else total + sizes
            tokens += len(prompt.prefix_ids)
            count += 1
    return total / count, tokens // count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="retention", help="a method with a global budget (default: retention)")
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--samples", type=int, default=4, help="samples per built-in task")
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("runs/retention_layout.png"))
    args = parser.parse_args()
    model, tokenizer = kvc.load_model()
    sizes, tokens = kept_per_head(model, tokenizer, kvc.get_method(args.method, ratio=args.ratio), args.samples, args.context_tokens)
    share = sizes / tokens
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    image = left.imshow(share.T.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1)
    left.set_xlabel("layer")
    left.set_ylabel("KV head")
    left.set_yticks(range(share.shape[1]))
    left.set_title(f"{args.method} at ratio {args.ratio}: share of the context each head keeps", fontsize=9)
    fig.colorbar(image, ax=left)
    right.bar(range(share.shape[0]), share.mean(dim=1).numpy())
    right.axhline(args.ratio, color="black", linestyle="--", label=f"budget ({args.ratio})")
    right.set_xlabel("layer")
    right.set_ylabel("share kept (mean over heads)")
    right.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"context ≈ {tokens} tokens; share kept per layer: " + " ".join(f"{v:.2f}" for v in share.mean(dim=1).tolist()))
    print(f"per head (min / max over all): {float(share.min()):.3f} / {float(share.max()):.3f}; plot: {args.out}")


if __name__ == "__main__":
    main()
