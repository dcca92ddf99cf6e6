"""KIVI against transformers' QuantizedCache (optimum-quanto backend): next-token KL and perplexity over a
teacher-forced continuation after a long context of the built-in prose (diagnose's text), both caches at
the same bits, group (32) and residual (128).

    pip install --no-deps optimum-quanto   # the peer's backend (not a kvcompress dependency)
    python benchmarks/kivi_peer.py --context-tokens 1536 --continuation 64

transformers' cache is KIVI-like but not KIVI: it quantizes keys and values along the same axis
with one group size, and when its residual fills it re-quantizes the whole cache; kvcompress's
`kivi` quantizes keys per channel over blocks of entries and values per entry, and codes each
entry once.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, QuantizedCache

import kvcompress as kvc
from kvcompress.demo import haystack_text


def continuation_logits(model, context, continuation, cache) -> torch.Tensor:
    """Logits [n, vocab] for each continuation token, fed one at a time after the context."""
    with torch.no_grad():
        out = model(context, past_key_values=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        for t in range(continuation.shape[1] - 1):
            out = model(continuation[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.cat(logits).float()


def scores(logits, reference, continuation) -> dict:
    logp, ref = F.log_softmax(logits, -1), F.log_softmax(reference, -1)
    kl = float((ref.exp() * (ref - logp)).sum(-1).mean())
    nll = F.nll_loss(logp, continuation[0])
    ref_nll = F.nll_loss(ref, continuation[0])
    return {"kl": kl, "ppl_ratio": float(torch.exp(nll - ref_nll))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context-tokens", type=int, default=1536)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--texts", type=int, default=4, help="windows of the built-in prose (diagnose's text), 512 tokens apart")
    args = parser.parse_args()
    model, tokenizer = kvc.load_model()
    model.config.use_cache = True
    prose = tokenizer(haystack_text(), add_special_tokens=False, return_tensors="pt").input_ids
    rows = []
    for i in range(args.texts):
        ids = prose[:, 512 * i :]
        context = ids[:, : args.context_tokens]
        continuation = ids[:, args.context_tokens : args.context_tokens + args.continuation]
        if continuation.shape[1] < args.continuation:
            raise SystemExit(f"the built-in prose is too short for window {i}: use fewer --texts or tokens")
        reference = continuation_logits(model, context, continuation, DynamicCache())
        for bits in (2, 4):
            ours = continuation_logits(model, context, continuation,
                                       kvc.CompressedCache(model, kvc.get_method("kivi", bits=bits)))
            peer = continuation_logits(model, context, continuation,
                                       QuantizedCache("quanto", model.config, nbits=bits, q_group_size=32, residual_length=128))
            rows.append({"text": i, "bits": bits, "kvcompress_kivi": scores(ours, reference, continuation),
                         "transformers_quantized": scores(peer, reference, continuation)})
            print(json.dumps(rows[-1]))
    for bits in (2, 4):
        mine = [r for r in rows if r["bits"] == bits]
        for name in ("kvcompress_kivi", "transformers_quantized"):
            kl = sum(r[name]["kl"] for r in mine) / len(mine)
            ppl = sum(r[name]["ppl_ratio"] for r in mine) / len(mine)
            print(f"{bits}-bit {name}: mean KL {kl:.4f}, mean ppl ratio {ppl:.3f}")


if __name__ == "__main__":
    main()
