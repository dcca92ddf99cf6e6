"""KeepKV against the convex merges (CaM, D2O) and eviction (H2O, SnapKV), with its key rules (issue: KeepKV).

    .venv/bin/python benchmarks/merging_diagnose.py --context-tokens 1536 --budgets 64 128 256 --out runs/merging

diagnose on the built-in prose: per-layer relative attention-output error of the continuation
(each layer fed the full run's queries), next-token KL, perplexity ratio, and the reference
query's error right after compression. KeepKV variants: the default (ZIP key, scale bounded
to [1/1.25, 1.25], out-of-range groups use the votes rule), the paper's unbounded ZIP key,
the votes rule alone, the shift rule, and a looser bound of 2. Writes diagnose-<n>.json / .md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import kvcompress as kvc
from kvcompress.diagnose import diagnose, diagnose_markdown
from kvcompress.eval.report import write_json

VARIANTS = {
    "keepkv": ("keepkv", {}),
    "keepkv paper (unbounded key)": ("keepkv", {"max_key_scale": float("inf")}),
    "keepkv scale ≤ 2": ("keepkv", {"max_key_scale": 2.0}),
    "keepkv votes rule": ("keepkv", {"key_rule": "votes"}),
    "keepkv shift rule": ("keepkv", {"key_rule": "shift"}),
    "cam": ("cam", {}),
    "d2o": ("d2o", {}),
    "h2o": ("h2o", {}),
    "snapkv": ("snapkv", {}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-tokens", type=int, nargs="+", default=[1536])
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--continuation-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("runs/merging"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = kvc.load_model()
    for tokens in args.context_tokens:
        methods, names = [], []
        for budget in args.budgets:
            for variant, (name, options) in VARIANTS.items():
                methods.append(kvc.get_method(name, budget=budget, **options))
                names.append(variant)
        rows = diagnose(model, tokenizer, methods, context_tokens=tokens, continuation_tokens=args.continuation_tokens)
        for row, variant in zip(rows[1:], names):
            row["variant"] = variant
        settings = {"context_tokens": tokens, "budgets": args.budgets, "variants": {k: v[1] for k, v in VARIANTS.items()}}
        write_json(args.out / f"diagnose-{tokens}.json", rows, model="smollm2-135m-instruct", seed=0, settings=settings)
        (args.out / f"diagnose-{tokens}.md").write_text(diagnose_markdown(rows, f"Merging methods, {tokens} context tokens"))
        print(f"\n## context {tokens} tokens\n")
        print("| budget | variant | kr | rel_error | kl | ppl_ratio | rel_error_at_merge | ZIP fallbacks / groups |")
        print("|---|---|---|---|---|---|---|---|")
        for budget in args.budgets:
            for r in (r for r in rows[1:] if r["budget"] == budget):
                counts = r.get("merge_counts")
                share = f"{counts['zip_fallbacks']} / {counts['merge_groups']}" if counts and r["method"] == "keepkv" else "—"
                at_merge = "—" if r["rel_error_at_merge"] is None else f"{r['rel_error_at_merge']:.1e}"
                print(f"| {budget} | {r['variant']} | {r['kr']:.3f} | {r['rel_error']:.4f} | {r['kl']:.4f} | "
                      f"{r['ppl_ratio']:.3f} | {at_merge} | {share} |")


if __name__ == "__main__":
    main()
