"""DeltaKV's claims about its codes, and what rebuilding them costs per decoding step.

Seed 004 claims that the residual codes z = f_c(x) − f_c(m) concentrate near zero (the shared
part of a token and its nearest references cancels). This prefills the built-in prose, reads
every coded token's z back from the pool and compares it with f_c(x) — the code the same
compressor would store without references — by spread and by a histogram
(docs/figures/deltakv_codes.png); it also times rebuilding every coded token of every layer
once (what each decoding step pays on the CPU, as the read touches every entry).

    python benchmarks/deltakv_codes.py --context-tokens 4096 8192 [--checkpoint DIR] [--model M]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import kvcompress as kvc  # noqa: E402
from kvcompress.demo import haystack_text  # noqa: E402
from kvcompress.store.deltakv import token_vectors  # noqa: E402


def coded_tokens(cache) -> tuple[object, object, torch.Tensor]:
    """(the code tier's pool, its codec, every coded block id) of a prefilled cache."""
    pool = cache.session.pool
    store = next(tier for tier in pool.tiers if tier.codec.name == "deltakv")
    used = (store.refs[1:] > 0).nonzero().squeeze(1) + 1
    return store, store.codec, used


def code_spread(store, codec, blocks: torch.Tensor) -> dict:
    """z and f_c(x) for every coded token (x rebuilt from the pool: pre-RoPE keys and values)."""
    z = codec.codes(store.arrays, blocks)
    keys, values = codec.reconstruct(store.arrays, blocks)  # [n, H, d]
    positions = store.arrays["position"].index_select(0, blocks)
    x = token_vectors(keys[:, :, None], values[:, :, None], positions[:, None], codec.weights.inv_freq)[:, 0]
    layers = store.arrays["layer"].index_select(0, blocks).long()
    plain = torch.empty_like(z)
    with torch.no_grad():
        for layer in torch.unique(layers).tolist():
            where = layers == layer
            plain[where] = codec.weights.compress(layer, x[where])
    return {"z": z, "f_c(x)": plain}


def rebuild_ms(store, codec, blocks: torch.Tensor, repeats: int = 3) -> float:
    """Milliseconds to rebuild every coded entry once, as a decoding read does (``decode``; median of ``repeats``)."""
    entries = (blocks[:, None] * codec.block_size + torch.arange(codec.block_size)).reshape(-1)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        codec.decode(store.arrays, entries)
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context-tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--plot", default="docs/figures/deltakv_codes.png")
    args = parser.parse_args()
    model, tokenizer = kvc.load_model(args.model)
    prose = tokenizer(haystack_text() * 4, add_special_tokens=False, return_tensors="pt").input_ids
    options = {"checkpoint": args.checkpoint} if args.checkpoint else {}
    rows, spread = [], None
    for n in args.context_tokens:
        cache = kvc.CompressedCache(model, kvc.get_method("deltakv", **options))
        start = time.perf_counter()
        with torch.no_grad():
            model(prose[:, :n], past_key_values=cache, use_cache=True)
        prefill_s = time.perf_counter() - start
        store, codec, blocks = coded_tokens(cache)
        values = code_spread(store, codec, blocks)
        if spread is None:
            spread = values
        row = {"context_tokens": n, "coded_tokens": int(blocks.numel()), "kr": round(cache.stats()["kr"], 4),
               "prefill_and_code_s": round(prefill_s, 2), "rebuild_all_ms": round(rebuild_ms(store, codec, blocks), 1)}
        for name, v in values.items():
            row[f"std {name}"] = round(float(v.std()), 4)
            row[f"mean |{name}|"] = round(float(v.abs().mean()), 4)
        row["share of |z| < 0.1·std f_c(x)"] = round(float((values["z"].abs() < 0.1 * values["f_c(x)"].std()).float().mean()), 4)
        rows.append(row)
        print(json.dumps(row))
    plot(spread, Path(args.plot))


def plot(values: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    everything = torch.cat([v.reshape(-1) for v in values.values()])
    sample = everything[:: max(1, everything.numel() // 1_000_000)]  # quantile takes at most 16 M numbers
    low, high = float(sample.quantile(0.001)), float(sample.quantile(0.999))
    for name, v in values.items():
        ax.hist(v.reshape(-1).clamp(low, high).numpy(), bins=120, range=(low, high), histtype="step", density=True,
                label=f"{name} (std {float(v.std()):.3f})")
    ax.set_yscale("log")
    ax.set_xlabel("code value")
    ax.set_ylabel("density")
    ax.set_title("DeltaKV: residual codes z = f_c(x) − f_c(m) against f_c(x)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"histogram: {path}")


if __name__ == "__main__":
    main()
