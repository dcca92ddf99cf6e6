"""The ``kvcompress`` command line: one entry point, one function per verb."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from . import available_methods, generate, get_method, load_model
from .demo import needle_prompt
from .methods import REGISTRY


def _method(name: str, budget: int | None, ratio: float | None):
    if name == "full":
        return get_method("full")
    return get_method(name, budget=budget, ratio=ratio)


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def cmd_generate(args) -> int:
    """One context + question with one method: print the answer and its stats."""
    if args.context_file:
        path = Path(args.context_file)
        if not path.is_file():
            raise FileNotFoundError(f"context file not found: {path}")
        context = path.read_text()
    else:
        context = args.context
    model, tokenizer = load_model(args.model)
    method = _method(args.method, args.budget, args.ratio)
    out = generate(model, tokenizer, context, args.question, method,
                   max_new_tokens=args.max_new_tokens, query_aware=args.query_aware)
    if args.json:
        print(json.dumps({"answer": out.text, "token_ids": out.token_ids, "stats": out.stats}, indent=2))
    else:
        print(out.text)
        s = out.stats
        print(f"\n[{s['method']}] kr={s['kr']:.3f} cr={s['cr']:.3f} kv_bytes={s['kv_bytes']:,} of {s['kv_bytes_full']:,}  "
              f"prefill {s['prefill_s']:.2f}s  compress {s['compress_s']:.3f}s  decode {s['decode_ms_per_token']:.1f} ms/token"
              + (f"  notes: {'; '.join(s['notes'])}" if s["notes"] else ""), file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    """Every method on the built-in long prompt, in both protocols: answer, kept ratio, timings."""
    model, tokenizer = load_model(args.model)
    prompt = needle_prompt(tokenizer, context_tokens=args.context_tokens, seed=args.seed)
    methods = ["full"] + [m for m in args.methods.split(",") if m != "full"]
    runs = [(m, qa) for qa in (False, True) for m in methods]
    rows = []
    for name, query_aware in tqdm(runs, desc="demo", disable=args.quiet):
        out = generate(model, tokenizer, prompt.context, prompt.question, _method(name, None, args.ratio),
                       max_new_tokens=20, query_aware=query_aware)
        rows.append((name, query_aware, out))
    n = rows[0][2].stats["context_tokens"]
    print(f"\nBuilt-in prompt: a {n}-token context hides 'The secret code for the blue door is {prompt.answer}.'")
    print(f"Question: {prompt.question}\nMethods keep ratio={args.ratio} of the context's KV entries (full keeps all).\n")
    print(f"| {'method':12} | {'protocol':14} | {'kr':>5} | {'correct':7} | {'decode ms/tok':>13} | answer")
    print(f"|{'-' * 14}|{'-' * 16}|{'-' * 7}|{'-' * 9}|{'-' * 15}|{'-' * 30}")
    for name, query_aware, out in rows:
        protocol = "query-aware" if query_aware else "query-agnostic"
        ok = "yes" if prompt.answer in out.text else "no"
        answer = out.text.replace("\n", " ")[:60]
        print(f"| {name:12} | {protocol:14} | {out.stats['kr']:5.3f} | {ok:7} | {out.stats['decode_ms_per_token']:13.1f} | {answer}")
    print("\nkr = KV bytes really held ÷ bytes of the full cache for the same tokens (full carries 4 bytes of "
          "position per entry). query-agnostic: the context is compressed before the question is seen.")
    return 0


def cmd_methods(args) -> int:
    """List the registered methods with their papers."""
    for name in available_methods():
        print(f"{name:13} {REGISTRY[name].paper}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcompress", description="KV-cache compression for transformers LLMs.")
    sub = parser.add_subparsers(dest="verb", required=True)

    def common(p):
        p.add_argument("--model", default=None, help="checkpoint dir, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--quiet", action="store_true", help="no progress output")

    g = sub.add_parser("generate", help="answer one question about one context with one method")
    common(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--context", help="the context text")
    src.add_argument("--context-file", help="a file holding the context")
    g.add_argument("--question", required=True)
    g.add_argument("--method", default="snapkv", choices=available_methods())
    size = g.add_mutually_exclusive_group()
    size.add_argument("--budget", type=int, help="entries per KV head")
    size.add_argument("--ratio", type=float, help="fraction of context entries kept")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--query-aware", action="store_true", help="compress the question with the context")
    g.add_argument("--json", action="store_true", help="print answer and stats as JSON")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="compare every method on the built-in long prompt")
    common(d)
    d.add_argument("--methods", default=",".join(available_methods()))
    d.add_argument("--ratio", type=float, default=0.25)
    d.add_argument("--context-tokens", type=int, default=1200)
    d.set_defaults(func=cmd_demo)

    m = sub.add_parser("methods", help="list the methods")
    m.set_defaults(func=cmd_methods)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "quiet", False) or args.verb in ("demo", "generate"):
        _quiet_transformers()
    if args.verb == "generate" and args.method != "full" and args.budget is None and args.ratio is None:
        args.ratio = 0.25
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"kvcompress: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
