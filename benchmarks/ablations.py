"""diagnose over a method's variants and the methods it is compared with (issues: MomentKV, KeepKV).

    .venv/bin/python benchmarks/ablations.py momentkv --context-tokens 1536 4096 --out runs/momentkv
    .venv/bin/python benchmarks/ablations.py merging  --context-tokens 1536 --out runs/merging

For each context length: diagnose on the built-in prose (per-layer relative attention-output
error of the continuation with each layer fed the full run's queries, next-token KL,
perplexity ratio, the reference query's error right after compression) for every variant at
every budget. Writes diagnose-<n>.json / .md and prints the table.

* momentkv: snapkv, adakv, momentkv and the paper's ablations — MI only (moment-informed
  eviction, no correction), NC only (correction, Ada-KV's eviction), zeroth order, centred
  residual; with the ratio of each error to adakv's.
* merging: keepkv (ZIP key scale bounded to [1/1.25, 1.25], out-of-range groups use the
  votes rule), the paper's unbounded ZIP key, a bound of 2, the votes and shift rules alone,
  cam, d2o, h2o, snapkv; with the share of KeepKV's merge groups that fell back.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import kvcompress as kvc
from kvcompress.diagnose import diagnose, diagnose_markdown
from kvcompress.eval.report import write_json

STUDIES = {
    "momentkv": {
        "snapkv": ("snapkv", {}),
        "adakv": ("adakv", {}),
        "momentkv": ("momentkv", {}),
        "momentkv MI only": ("momentkv", {"correction": False}),
        "momentkv NC only": ("momentkv", {"moment_eviction": False}),
        "momentkv order 0": ("momentkv", {"order": 0}),
        "momentkv centred": ("momentkv", {"centred_residual": True}),
    },
    "merging": {
        "keepkv": ("keepkv", {}),
        "keepkv paper (unbounded key)": ("keepkv", {"max_key_scale": float("inf")}),
        "keepkv scale ≤ 2": ("keepkv", {"max_key_scale": 2.0}),
        "keepkv votes rule": ("keepkv", {"key_rule": "votes"}),
        "keepkv shift rule": ("keepkv", {"key_rule": "shift"}),
        "cam": ("cam", {}),
        "d2o": ("d2o", {}),
        "h2o": ("h2o", {}),
        "snapkv": ("snapkv", {}),
    },
}


def extra_column(study: str, row: dict, group: list[dict]) -> str:
    """momentkv: the error ÷ adakv's at the same budget; merging: KeepKV's ZIP fallbacks / merge groups."""
    if study == "momentkv":
        return f"{row['rel_error'] / next(r for r in group if r['variant'] == 'adakv')['rel_error']:.2f}"
    counts = row.get("merge_counts")
    return f"{counts['zip_fallbacks']} / {counts['merge_groups']}" if counts and row["method"].startswith("keepkv") else "—"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", choices=sorted(STUDIES))
    parser.add_argument("--context-tokens", type=int, nargs="+", default=[1536])
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--continuation-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="default: runs/<study>")
    args = parser.parse_args()
    out = args.out or Path("runs") / args.study
    out.mkdir(parents=True, exist_ok=True)
    variants = STUDIES[args.study]
    model, tokenizer = kvc.load_model()
    for tokens in args.context_tokens:
        methods, names = [], []
        for budget in args.budgets:
            for variant, (name, options) in variants.items():
                methods.append(kvc.get_method(name, budget=budget, **options))
                names.append(variant)
        rows = diagnose(model, tokenizer, methods, context_tokens=tokens, continuation_tokens=args.continuation_tokens)
        for row, variant in zip(rows[1:], names):
            row["variant"] = variant
        settings = {"context_tokens": tokens, "budgets": args.budgets, "variants": {k: v[1] for k, v in variants.items()}}
        write_json(out / f"diagnose-{tokens}.json", rows, model="smollm2-135m-instruct", seed=0, settings=settings)
        (out / f"diagnose-{tokens}.md").write_text(diagnose_markdown(rows, f"{args.study} ablations, {tokens} context tokens"))
        extra = "÷ adakv" if args.study == "momentkv" else "ZIP fallbacks / groups"
        print(f"\n## context {tokens} tokens\n")
        print(f"| budget | variant | kr | rel_error | kl | ppl_ratio | rel_error_at_merge | {extra} |")
        print("|---|---|---|---|---|---|---|---|")
        for budget in args.budgets:
            group = [r for r in rows[1:] if r["budget"] == budget]
            for r in group:
                at_merge = "—" if r["rel_error_at_merge"] is None else f"{r['rel_error_at_merge']:.1e}"
                print(f"| {budget} | {r['variant']} | {r['kr']:.3f} | {r['rel_error']:.4f} | {r['kl']:.4f} | "
                      f"{r['ppl_ratio']:.3f} | {at_merge} | {extra_column(args.study, r, group)} |")


if __name__ == "__main__":
    main()
