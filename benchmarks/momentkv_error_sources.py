"""Where MomentKV's correction loses: the Jensen estimate of Z_E or the first-order direction ô_E (issue: MomentKV).

    .venv/bin/python benchmarks/momentkv_error_sources.py --context-tokens 1536 --budgets 64 128 256

For each layer of the embedded model, after MomentKV compresses the built-in prose, the full
run's continuation queries attend (i) the retained entries only (plain eviction), (ii) the
retained entries plus the moments (MomentKV as implemented: estimated log Ẑ_E and ô_E), and
(iii–v) the retained entries plus the evicted set E with one of the two terms exact:
exact Z_E with estimated ô_E, estimated Ẑ_E with exact o_E, both exact (= the full output).
Everything in float64 from the same tensors. Also reported: the Jensen gap
log Z_E − log Ẑ_E (≥ 0 in expectation) and the evicted share of the softmax mass.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress import CompressedCache
from kvcompress.read import group_queries
from kvcompress.diagnose import text_ids


def mix(lse_r, out_r, log_z, out_e):
    """Softmax-weighted mix of two parts given their log-partition functions."""
    total = torch.logaddexp(lse_r, log_z)
    return torch.exp(lse_r - total)[..., None] * out_r + torch.exp(log_z - total)[..., None] * out_e


def part(q, keys, values, mask, scaling):
    """Attention of q [H, G, T, d] over keys [H, L, d] where mask [H, G, T, L]: (out, lse)."""
    logits = torch.einsum("hgtd,hld->hgtl", q, keys) * scaling
    logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return torch.einsum("hgtl,hld->hgtd", probs, values), lse


def key_variance_term(q, keys, evicted):
    """qᵀΣ_k q [H, G, T] with Σ_k the covariance of the evicted keys of each head (the second-order
    term of log Z_E under a Gaussian key model; it would cost d² more floats per head)."""
    weight = evicted.double()[..., None]
    count = weight.sum(1).clamp(min=1.0)  # [H, 1]
    mean = (keys * weight).sum(1) / count
    centred = (keys - mean[:, None]) * weight
    cov = torch.einsum("hld,hle->hde", centred, centred) / count[..., None]
    return torch.einsum("hgtd,hde,hgte->hgt", q, cov, q)


def layer_sources(view, kept, moments, record, scaling):
    """Relative errors of the five outputs against the full one, the Jensen gap and the evicted mass share.
    ``view``: the layer uncompressed; ``kept``: compressed; ``moments``: what left."""
    query, key, value, positions, _ = record
    heads = view.shape[1]
    keys = torch.cat([view.keys[0], key[0]], dim=1).double()  # [H, L + T, d]
    values = torch.cat([view.values[0], value[0]], dim=1).double()
    all_pos = torch.cat([view.positions[0], positions[0][None].expand(heads, -1)], dim=1).long()  # [H, L + T]
    kept_pos = kept.positions[0].long().masked_fill(~kept.valid[0] if kept.valid is not None else torch.zeros_like(kept.positions[0], dtype=torch.bool), -1)
    context_len = view.positions.shape[-1]
    retained = torch.zeros(heads, keys.shape[1], dtype=torch.bool)
    retained[:, context_len:] = True  # the continuation is always held
    retained[:, :context_len] = (view.positions[0, :, :, None].long() == kept_pos[:, None, :]).any(-1)
    q = group_queries(query.double(), heads)[0]  # [H, G, T, d]
    causal = all_pos[:, None, None, :] <= positions[0][None, None, :, None].long()
    out_r, lse_r = part(q, keys, values, causal & retained[:, None, None, :], scaling)
    out_e, log_z = part(q, keys, values, causal & ~retained[:, None, None, :], scaling)
    full, _ = part(q, keys, values, causal, scaling)
    est_out, est_log_z = moments.attend(q[None].float(), scaling)
    est_out, est_log_z = est_out[0].double(), est_log_z[0].double()
    gaussian_log_z = est_log_z + 0.5 * scaling**2 * key_variance_term(q, keys[:, :context_len], ~retained[:, :context_len])
    outputs = {
        "eviction only": out_r,
        "momentkv (Ẑ_E, ô_E)": mix(lse_r, out_r, est_log_z, est_out),
        "exact Z_E, ô_E": mix(lse_r, out_r, log_z, est_out),
        "Ẑ_E, exact o_E": mix(lse_r, out_r, est_log_z, out_e),
        "exact Z_E, o_E": mix(lse_r, out_r, log_z, out_e),
        "Gaussian Ẑ_E (+½τ²qᵀΣ_k q), ô_E": mix(lse_r, out_r, gaussian_log_z, est_out),
    }
    errors = {name: float((o - full).norm() / full.norm()) for name, o in outputs.items()}
    share = torch.exp(log_z - torch.logaddexp(lse_r, log_z))
    est_share = torch.exp(est_log_z - torch.logaddexp(lse_r, est_log_z))
    return errors, float((log_z - est_log_z).mean()), float(share.mean()), float(est_share.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-tokens", type=int, default=1536)
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--continuation-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("runs/momentkv/error_sources.json"))
    args = parser.parse_args()
    model, tokenizer = kvc.load_model()
    ids = torch.tensor([text_ids(tokenizer, None, args.context_tokens + args.continuation_tokens)])
    context, continuation = ids[:, : args.context_tokens], ids[:, args.context_tokens :]
    results = []
    with torch.inference_mode():
        shared = CompressedCache(model, compress_on_prefill=False, observation_window=32)
        model(context, past_key_values=shared, use_cache=True, logits_to_keep=1)
        full = shared.fork(shared.method)
        full.recorder = {}
        model(continuation, past_key_values=full, use_cache=True)
        scaling = full.session.layers[0].scaling
        layers = range(shared.session.num_layers)
        for budget in args.budgets:
            compressed = shared.fork(kvc.get_method("momentkv", budget=budget))
            per_layer = [layer_sources(shared.session.view(i), compressed.session.view(i),
                                       compressed.session.layers[i].state["moments"], full.recorder[i], scaling) for i in layers]
            mean = {name: sum(p[0][name] for p in per_layer) / len(per_layer) for name in per_layer[0][0]}
            row = {"budget": budget, "rel_error": mean,
                   "jensen_gap": sum(p[1] for p in per_layer) / len(per_layer),
                   "evicted_share": sum(p[2] for p in per_layer) / len(per_layer),
                   "estimated_evicted_share": sum(p[3] for p in per_layer) / len(per_layer),
                   "per_layer": [{"rel_error": p[0], "jensen_gap": p[1], "evicted_share": p[2], "estimated_evicted_share": p[3]}
                                 for p in per_layer]}
            results.append(row)
            print(f"budget {budget}: " + ", ".join(f"{k} {v:.4f}" for k, v in mean.items())
                  + f" | Jensen gap {row['jensen_gap']:.3f} | evicted share {row['evicted_share']:.3f} "
                  f"(estimated {row['estimated_evicted_share']:.3f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"context_tokens": args.context_tokens, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
