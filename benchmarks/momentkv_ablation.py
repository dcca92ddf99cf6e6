"""MomentKV's fidelity against Ada-KV and SnapKV, with the paper's ablations (issue: MomentKV).

    .venv/bin/python benchmarks/momentkv_ablation.py --context-tokens 1536 4096 --budgets 64 128 256 --out runs/momentkv

For each context length: diagnose (per-layer relative attention-output error with each
layer fed the full run's queries, next-token KL, perplexity ratio) on the built-in prose
for snapkv, adakv, momentkv and its ablations — MI only (moment-informed eviction, no
correction), NC only (correction, Ada-KV's eviction), zeroth order, centred residual.
Writes diagnose-<n>.json / .md and prints the table with the ratio to adakv's error.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import kvcompress as kvc
from kvcompress.diagnose import diagnose, diagnose_markdown
from kvcompress.eval.report import write_json

VARIANTS = {
    "snapkv": {},
    "adakv": {},
    "momentkv": {},
    "momentkv MI only": {"correction": False},
    "momentkv NC only": {"moment_eviction": False},
    "momentkv order 0": {"order": 0},
    "momentkv centred": {"centred_residual": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-tokens", type=int, nargs="+", default=[1536, 4096])
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--continuation-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("runs/momentkv"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = kvc.load_model()
    for tokens in args.context_tokens:
        methods, names = [], []
        for budget in args.budgets:
            for name, options in VARIANTS.items():
                methods.append(kvc.get_method(name.split()[0], budget=budget, **options))
                names.append((name, budget))
        rows = diagnose(model, tokenizer, methods, context_tokens=tokens, continuation_tokens=args.continuation_tokens)
        for row, (name, budget) in zip(rows[1:], names):
            row["variant"] = name
        write_json(args.out / f"diagnose-{tokens}.json", rows, model="smollm2-135m-instruct", seed=0,
                   settings={"context_tokens": tokens, "budgets": args.budgets, "variants": VARIANTS})
        (args.out / f"diagnose-{tokens}.md").write_text(diagnose_markdown(rows, f"MomentKV ablations, {tokens} context tokens"))
        print(f"\n## context {tokens} tokens\n")
        print("| budget | variant | kr | rel_error | ÷ adakv | kl | ppl_ratio |\n|---|---|---|---|---|---|---|")
        for budget in args.budgets:
            group = [r for r in rows[1:] if r["budget"] == budget]
            ada = next(r for r in group if r["variant"] == "adakv")["rel_error"]
            for r in group:
                print(f"| {budget} | {r['variant']} | {r['kr']:.3f} | {r['rel_error']:.4f} | {r['rel_error'] / ada:.2f} | "
                      f"{r['kl']:.4f} | {r['ppl_ratio']:.3f} |")


if __name__ == "__main__":
    main()
