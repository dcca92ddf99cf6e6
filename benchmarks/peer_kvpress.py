"""Peer check: kvcompress's methods against kvpress's presses on the same prompts.

kvpress pins its own transformers, so it runs in a separate virtual environment:

    python -m venv /tmp/kvpress-venv && /tmp/kvpress-venv/bin/pip install torch==2.13.0 kvpress
    .venv/bin/python benchmarks/peer_kvpress.py ours   --method snapkv --out runs/peer   # our answers + prompt ids
    /tmp/kvpress-venv/bin/python benchmarks/peer_kvpress.py kvpress --method snapkv --out runs/peer
    .venv/bin/python benchmarks/peer_kvpress.py compare --method snapkv --out runs/peer

Pairs (``--method``; files go to ``--out``/<method>/):

* snapkv ↔ SnapKVPress (avg pooling).
* streamingllm ↔ StreamingLLMPress (4 sinks; ours as streamingllm+static: kvpress compresses once at
  prefill, our default rolls the window while decoding).
* adakv ↔ AdaKVPress(SnapKVPress) (α = 0.2; the allocations differ: ours is the paper's
  b_h = α·B + (1 − α)·c_h, kvpress forces each head's top α·B entries, then prunes globally).
* kvzip ↔ KVzipPress (defaults on both sides: 4 sinks, one ranking over every layer and head
  (kvpress ``layerwise=False``), replay chunks of 2048 tokens). Known differences, by design:
  - the softmax of a replay query: kvpress takes it over a subsample of the keys only (the 4
    sinks, the current chunk's context entries and the replay's own keys, causally); ours over
    everything the query sees (every held entry + the replay so far), as the model's attention.
  - what is replayed: kvpress replays the context after the chat template's head (its
    ``prefix_length``: system turn + "<|im_start|>user\\n"), and the template head's entries keep
    the score 0 (the 4 sinks aside), so they are the first to go; ours replays the whole prefilled
    prefix, template head included, and scores it like the rest.
  - kvpress masks pruned entries (fake keys at ``masked_key_indices`` while decoding, whose
    logits are ≤ −3000 here: no leak) instead of freeing them; its kept count is computed from
    the ratio (``int(numel · compression_ratio)`` pruned over the score table, about 0.4 entries
    per head more than ours), ours ⌊r·n⌋ · layers · heads kept.
  Measured (20 samples, 1024 tokens, ratio 0.25): 15/20 identical answers, 83 % of kvpress's
  kept entries kept by ours. Nearly all of it is what is replayed: kvpress made to replay the
  whole prefix (``prefix_length = 0``; with one chunk its softmax is then over every key, as
  ours) keeps a superset of our entries (the rounding extras) and, with our kept count, exactly
  ours, with the same answers; the softmax subsample alone moves the overlap by < 0.5 point.
* expected_attention ↔ ExpectedAttentionPress (defaults on both sides: statistics of every
  prompt query but the 4 sinks, 512 future positions, covariance, value norms, ε = 0). The same
  computation: kvpress projects the hidden states (sinks dropped) through W_q, pre-RoPE; ours
  rotates the recorded post-RoPE queries back (the same vectors up to rounding); kvpress uses no
  padding mask (one unpadded row here, so nothing to leave out); both average RoPE over positions
  n … n + 511, leave the sinks out of the softmax and keep them, and keep ⌊r·n⌋ per head.
  Measured (20 samples, ratio 0.25): the same kept entries in every layer and head, 20/20
  identical answers.

Both sides get the same token ids (our query-agnostic split: the compressed prefix ends
where the question starts, then question + generation), the same model weights (our cached
checkpoint of the embedded model), the same options and kept ratio, and decode greedily.
``compare`` scores both sides with the task's metric (per task and average), counts identical
answers and, where both sides recorded them (kvzip, expected_attention), compares the kept
entries per layer and KV head right after compression (kvpress's from its masked indices or its
top-k scores).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METHODS = ("snapkv", "streamingllm", "adakv", "kvzip", "expected_attention")


def _kept_positions(session) -> list[list[list[int]]]:
    """Per layer, per KV head, the prompt positions the session holds (row 0)."""
    kept = []
    for layer in range(session.num_layers):
        view = session.view(layer)
        positions = view.positions[0]
        valid = view.valid[0] if view.valid is not None else None
        kept.append([sorted(int(p) for p in (positions[h][valid[h]] if valid is not None else positions[h]))
                     for h in range(positions.shape[0])])
    return kept


def run_ours(args) -> None:
    import kvcompress as kvc
    from kvcompress import CompressedCache
    from kvcompress.eval.tasks import BUILTIN_TASKS, MAX_NEW_TOKENS, make_task
    from kvcompress.generate import answer, build_prompt, prefill
    from kvcompress.models import embedded_checkpoint

    model, tokenizer = kvc.load_model()
    snap = {"window": args.window, "kernel": args.kernel, "pooling": "avg"}
    spec = {"streamingllm": "streamingllm+static"}.get(args.method, args.method)  # kvpress compresses once
    options = {"snapkv": snap, "adakv": {**snap, "alpha": 0.2}, "streamingllm": {"sinks": 4},
               "kvzip": {"sinks": 4, "chunk": 2048},  # the kvzip preset ranks once over layers and heads
               "expected_attention": {"window": None, "future": 512, "use_covariance": True, "use_vnorm": True,
                                      "epsilon": 0.0, "sinks": 4}}[args.method]
    method = kvc.get_method(spec, ratio=args.ratio, **options)
    record_kept = args.method in ("kvzip", "expected_attention")
    per_task = args.samples // len(BUILTIN_TASKS)
    rows = []
    for task in BUILTIN_TASKS:
        for sample in make_task(task, tokenizer, per_task, args.context_tokens, args.seed):
            prompt = build_prompt(tokenizer, sample.context, sample.question)
            cache = CompressedCache(model, method, tokenizer=tokenizer)
            logits, _ = prefill(model, cache, prompt, False)
            kept = [int(n) for n in cache.session.lengths(0)[0]]  # right after compression, as kvpress's
            kept_sets = _kept_positions(cache.session) if record_kept else None
            out = answer(model, tokenizer, cache, prompt, logits, max_new_tokens=MAX_NEW_TOKENS[task], query_aware=False)
            rows.append({"id": sample.id, "task": task, "metric": sample.metric, "prefix_ids": prompt.prefix_ids,
                         "suffix_ids": prompt.suffix_ids, "max_new_tokens": MAX_NEW_TOKENS[task],
                         "answers": sample.answers, "ours": out.text, "ours_ids": out.token_ids,
                         "ours_kept_layer0": kept, "ours_kept": kept_sets})
            print(sample.id, repr(out.text), kept, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"checkpoint": str(embedded_checkpoint()), "method": args.method, "ratio": args.ratio, "window": args.window,
            "kernel": args.kernel, "options": options}
    (args.out / "ours.json").write_text(json.dumps({"meta": meta, "rows": rows}))


def _capture_scores(press, scores: dict) -> None:
    """Record each layer's scores as the press computes them (a ScorerPress keeps their top-k per head)."""
    original = press.score

    def score(module, *args, **kwargs):
        result = original(module, *args, **kwargs)
        scores[int(module.layer_idx)] = result
        return result

    press.score = score


def run_kvpress(args) -> None:
    import logging

    import torch
    from kvpress import AdaKVPress, ExpectedAttentionPress, KVzipPress, SnapKVPress, StreamingLLMPress
    from kvpress.utils import compute_n_kept
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    logging.getLogger("kvpress.presses.kvzip_press").setLevel(logging.ERROR)  # its cost warning, once per press
    data = json.loads((args.out / "ours.json").read_text())
    meta = data["meta"]
    model = AutoModelForCausalLM.from_pretrained(meta["checkpoint"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(meta["checkpoint"])
    ratio = 1 - meta["ratio"]
    name = meta.get("method", "snapkv")
    snap = lambda: SnapKVPress(compression_ratio=ratio, window_size=meta["window"], kernel_size=meta["kernel"])  # noqa: E731
    make = {"snapkv": snap, "adakv": lambda: AdaKVPress(snap(), alpha_safeguard=0.2),
            "streamingllm": lambda: StreamingLLMPress(compression_ratio=ratio, n_sink=4),
            # KVzipPress's defaults: layerwise=False, n_sink=4, chunk_size=2048
            "kvzip": lambda: KVzipPress(compression_ratio=ratio),
            # ExpectedAttentionPress's defaults: n_future_positions=512, n_sink=4, covariance, vnorm, epsilon=0
            "expected_attention": lambda: ExpectedAttentionPress(compression_ratio=ratio)}[name]
    layers = model.model.layers
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    results = []
    with torch.inference_mode():
        for row in data["rows"]:
            context = torch.tensor([row["prefix_ids"]])
            n = context.shape[1]
            cache = DynamicCache()
            press, scores = make(), {}
            if name == "expected_attention":
                _capture_scores(press, scores)
            with press(model):  # KVzipPress replays the context and masks what it prunes when the block ends
                model(input_ids=context, past_key_values=cache, logits_to_keep=1)
            kept_sets = None
            if name == "kvzip":
                kept_sets = []
                for layer in layers:
                    masked = getattr(layer.self_attn, "masked_key_indices", None)
                    heads = cache.layers[layer.self_attn.layer_idx].keys.shape[1]
                    pruned = [set() for _ in range(heads)]
                    if masked is not None:
                        for h, s in zip(masked[1].tolist(), masked[2].tolist()):
                            pruned[h].add(s)
                    kept_sets.append([[p for p in range(n) if p not in pruned[h]] for h in range(heads)])
            elif name == "expected_attention":
                n_kept = compute_n_kept(n, ratio)
                kept_sets = [[sorted(head) for head in scores[i][0].topk(n_kept, dim=-1).indices.tolist()]
                             for i in range(len(layers))]  # what ScorerPress.compress gathers
            if kept_sets is not None:
                kept = [len(h) for h in kept_sets[0]]
            else:  # AdaKVPress masks instead of removing: this is the full length
                kept = [cache.layers[0].keys.shape[2]] * cache.layers[0].keys.shape[1]
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
            results.append({"id": row["id"], "kvpress": text, "kvpress_ids": ids, "kvpress_kept_layer0": kept,
                            "kvpress_kept": kept_sets})
            print(row["id"], repr(text), kept, flush=True)
    (args.out / "kvpress.json").write_text(json.dumps(results))


def _kept_agreement(rows, theirs) -> list[str]:
    """Per layer: entries kept per head (ours / kvpress, mean over heads and samples) and the overlap of the kept
    sets (|ours ∩ kvpress| ÷ |kvpress|, and Jaccard), summed over heads and samples."""
    pairs = [(row.get("ours_kept"), theirs[row["id"]].get("kvpress_kept")) for row in rows]
    pairs = [(a, b) for a, b in pairs if a and b]
    if not pairs:
        return []
    num_layers = len(pairs[0][0])
    lines = ["| layer | kept/head ours | kept/head kvpress | ∩ ÷ kvpress's | Jaccard |", "|---|---|---|---|---|"]
    total = {"a": 0, "b": 0, "i": 0, "u": 0, "heads": 0}
    for layer in range(num_layers):
        a_n = b_n = inter = union = heads = 0
        for ours, other in pairs:
            for a, b in zip(ours[layer], other[layer]):
                a, b = set(a), set(b)
                a_n, b_n, heads = a_n + len(a), b_n + len(b), heads + 1
                inter, union = inter + len(a & b), union + len(a | b)
        for name, value in (("a", a_n), ("b", b_n), ("i", inter), ("u", union), ("heads", heads)):
            total[name] += value
        lines.append(f"| {layer} | {a_n / heads:.1f} | {b_n / heads:.1f} | {inter / max(b_n, 1):.3f} | "
                     f"{inter / max(union, 1):.3f} |")
    lines.append(f"| all | {total['a'] / total['heads']:.1f} | {total['b'] / total['heads']:.1f} | "
                 f"{total['i'] / max(total['b'], 1):.3f} | {total['i'] / max(total['u'], 1):.3f} |")
    return lines


def compare(args) -> None:
    from kvcompress.eval.metrics import score

    ours = json.loads((args.out / "ours.json").read_text())["rows"]
    theirs = {r["id"]: r for r in json.loads((args.out / "kvpress.json").read_text())}
    same = 0
    lines = ["| id | task | kept layer 0 (ours / kvpress) | kvcompress | kvpress |", "|---|---|---|---|---|"]
    tasks: dict[str, list[tuple[float, float]]] = {}
    for row in ours:
        other = theirs[row["id"]]
        equal = row["ours_ids"] == other["kvpress_ids"]
        same += equal
        metric = row.get("metric", "contains")
        tasks.setdefault(row["task"], []).append((score(row["ours"], row["answers"], metric),
                                                  score(other["kvpress"], row["answers"], metric)))
        if not equal:
            kept = other["kvpress_kept_layer0"]
            lines.append(f"| {row['id']} | {row['task']} | {row['ours_kept_layer0']} / {kept} | "
                         f"{row['ours']!r} | {other['kvpress']!r} |")
    table = ["| task | n | kvcompress | kvpress |", "|---|---|---|---|"]
    for task, pairs in tasks.items():
        table.append(f"| {task} | {len(pairs)} | {100 * sum(a for a, _ in pairs) / len(pairs):.1f} | "
                     f"{100 * sum(b for _, b in pairs) / len(pairs):.1f} |")
    means = [(sum(a for a, _ in p) / len(p), sum(b for _, b in p) / len(p)) for p in tasks.values()]
    table.append(f"| average | {len(ours)} | {100 * sum(a for a, _ in means) / len(means):.1f} | "
                 f"{100 * sum(b for _, b in means) / len(means):.1f} |")
    summary = f"identical answers: {same}/{len(ours)} ({100 * same / len(ours):.0f}%)"
    report = summary + "\n\nScores (task metric, %):\n\n" + "\n".join(table) + "\n"
    agreement = _kept_agreement(ours, theirs)
    if agreement:
        report += ("\nKept entries right after compression, per layer (entries per KV head: mean over heads and samples; "
                   "overlaps: summed over them):\n\n" + "\n".join(agreement) + "\n")
    report += "\nDifferences:\n\n" + "\n".join(lines) + "\n"
    (args.out / "peer_kvpress.md").write_text(report)
    print(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("side", choices=["ours", "kvpress", "compare"])
    parser.add_argument("--method", choices=METHODS, default="snapkv")
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
