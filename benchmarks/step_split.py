"""Where one stream's decoding step goes, method by method: the step's time, the part of it inside the compiled reads,
and, with ``--floor``, how far DeltaKV's read could fall at best on this CPU.

    .venv/bin/python benchmarks/step_split.py --methods snapkv,full,deltakv,omnikv+deltakv --floor --out runs/step_split.json

Each method (a spec; those that take a size get ``--ratio``) prefills the same ``--context-tokens`` random tokens into
a ``CompressedCache``, as ``kvcompress bench`` does; then the methods decode greedy steps in turn, one step each, for
``--steps`` steps, so a load that comes and goes falls on each alike (``--rounds`` times, each from a fresh prefill).
Every call into the compiled CPU kernels (``kvcompress.kernels.cpu_kernels``, whoever calls it: the decoding reads,
Quest's pages, DeltaKV's rebuilds) is timed, so each step splits into the time inside them and the rest (the model's
layers, the cache's own work). Reported per method: the median step (and × the first method's), the median time
inside the kernels a step, and the reads' budget: what the time inside the kernels could be for the step to sit at
``--bar`` × the first method's (its rest unchanged).

``--floor`` adds, for each method whose read makes DeltaKV's keys from their 4-bit codes (``deltakv_decode`` with
8-bit key columns), the arithmetic floor of that product alone: one more step counts the coded entries the reads take,
each a d_c × d product of bytes, and divides by this CPU's peak rate of the byte products the read runs (AVX512-VNNI's
``dpbusd``, else AVX2's ``maddubs`` with a 16-bit add, in independent chains on weights in L1, on one thread:
``peak_byte_products``) times
``--threads``, as if every thread ran at that peak all the time. Where the floor exceeds the budget, no read that makes
each coded key from its codes at every step reaches the bar on this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import kvcompress.kernels
from kvcompress.bench import cpu_description
from kvcompress.cli import _method
from kvcompress.hf import CompressedCache
from kvcompress.kernels import FLAGS, _ninja_on_path, cpu_kernels
from kvcompress.models import cache_kwargs, load_model

PEAK_SOURCE = r"""
#include <torch/extension.h>
#include <chrono>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

// Byte products a nanosecond on one thread at the peak of the instruction the DeltaKV read takes them with, on weights
// loaded from L1 in independent chains: with AVX512-VNNI, dpbusd (64 unsigned codes x signed weights, fours summed into
// 32 bits); else with AVX2, maddubs (32 of them, pairs summed in 16 bits) added in 16 bits. 0 without either.
double peak_byte_products(int64_t rounds) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  constexpr int CHAINS = 16, LANES = 64;  // as many chains as the read's sums
  alignas(64) int8_t weights[CHAINS * LANES];
  for (int i = 0; i < CHAINS * LANES; ++i) weights[i] = static_cast<int8_t>(i % 7 - 3);
  __asm__ volatile("" : : "r"(weights) : "memory");  // the weights are not known when the loop is compiled
  __m512i codes = _mm512_set1_epi8(3), sums[CHAINS];
  for (int i = 0; i < CHAINS; ++i) sums[i] = _mm512_setzero_si512();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < rounds; ++r) {
    for (int i = 0; i < CHAINS; ++i) sums[i] = _mm512_dpbusd_epi32(sums[i], codes, _mm512_load_si512(weights + LANES * i));
    __asm__ volatile("" : "+v"(codes));  // the products are taken anew each round
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  for (int i = 0; i < CHAINS; ++i) __asm__ volatile("" : : "v"(sums[i]));  // the sums are used: every product is taken
  return static_cast<double>(LANES) * CHAINS * static_cast<double>(rounds) / ns;
#elif defined(__AVX2__)
  constexpr int CHAINS = 6, LANES = 32;  // with the codes and a product, within AVX2's 16 registers (no sum spilled)
  alignas(32) int8_t weights[CHAINS * LANES];
  for (int i = 0; i < CHAINS * LANES; ++i) weights[i] = static_cast<int8_t>(i % 7 - 3);
  __asm__ volatile("" : : "r"(weights) : "memory");
  __m256i codes = _mm256_set1_epi8(3), sums[CHAINS];
  for (int i = 0; i < CHAINS; ++i) sums[i] = _mm256_setzero_si256();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < rounds; ++r) {
    for (int i = 0; i < CHAINS; ++i)
      sums[i] = _mm256_add_epi16(sums[i], _mm256_maddubs_epi16(codes, _mm256_load_si256(reinterpret_cast<const __m256i*>(weights + LANES * i))));
    __asm__ volatile("" : "+x"(codes));
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  for (int i = 0; i < CHAINS; ++i) __asm__ volatile("" : : "x"(sums[i]));
  return static_cast<double>(LANES) * CHAINS * static_cast<double>(rounds) / ns;
#else
  return 0.0;
#endif
}
"""


class TimedKernels:
    """The compiled module, each function call's seconds added to ``spent``; with ``count_products`` on, each
    ``deltakv_decode`` call's byte products of its coded keys added to ``products`` (untimed)."""

    def __init__(self, module):
        self.module, self.spent, self.count_products, self.products = module, 0.0, False, 0

    def __getattr__(self, name):
        function = getattr(self.module, name)

        def timed(*args):
            if self.count_products and name == "deltakv_decode":
                self.products += coded_key_products(args)
            start = time.perf_counter()
            try:
                return function(*args)
            finally:
                self.spent += time.perf_counter() - start

        return timed


def coded_key_products(args) -> int:
    """The byte products a ``deltakv_decode`` call's keys take where its key columns are 8-bit: every coded entry its
    tables name (within each head's length) × d_c × d (0 where the columns are float: another product)."""
    queries, tables, lengths, shift, code_tier, codes, key_codes = args[0], args[4], args[5], args[7], args[8], args[10], args[21]
    if key_codes.numel() == 0:
        return 0
    coded = 0
    for table, length in zip(tables, lengths):
        for head, ids in enumerate(table):
            coded += int(((ids[: int(length[head])] >> shift) == code_tier).sum())
    return coded * 2 * codes.shape[1] * queries.shape[2]


def peak_byte_products() -> float:
    """This CPU's byte products a nanosecond on one thread at the peak of the read's instruction (AVX512-VNNI's dpbusd,
    else AVX2's maddubs; 0 without either), the best of three."""
    from torch.utils.cpp_extension import load_inline

    _ninja_on_path()
    module = load_inline(name="kvcompress_step_split_peak", cpp_sources=[PEAK_SOURCE], functions=["peak_byte_products"],
                         extra_cflags=FLAGS, verbose=False)
    module.peak_byte_products(10_000_000)  # warm-up: the clock up to speed
    return max(module.peak_byte_products(50_000_000) for _ in range(3))


@torch.inference_mode()
def prefill(model, spec: str, ratio: float, ids: torch.Tensor) -> tuple[CompressedCache, torch.Tensor]:
    """A method's cache after a prefill of ``ids``, and its first new token."""
    cache = CompressedCache(model, _method(spec, default_ratio=ratio))  # a spec without a size gets ``ratio``, as on the command line
    return cache, model(ids, **cache_kwargs(cache), logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)


@torch.inference_mode()
def step(model, cache: CompressedCache, next_ids: torch.Tensor, kernels: TimedKernels) -> tuple[torch.Tensor, float, float]:
    """One greedy decoding step: the new token, the step's seconds and its seconds inside the kernels."""
    kernels.spent = 0.0
    start = time.perf_counter()
    next_ids = model(next_ids, **cache_kwargs(cache)).logits[:, -1].argmax(-1, keepdim=True)
    return next_ids, time.perf_counter() - start, kernels.spent


def interleaved_round(model, methods: list[str], ratio: float, ids: torch.Tensor, steps: int, kernels: TimedKernels,
                      walls: dict, inside: dict, products: dict | None) -> None:
    """Every method prefilled, then one step each in turn, ``steps`` times; with ``products``, one more step each
    counts its coded keys' byte products."""
    state = {spec: prefill(model, spec, ratio, ids) for spec in methods}
    for _ in range(steps):
        for spec in methods:
            cache, next_ids = state[spec]
            next_ids, wall, spent = step(model, cache, next_ids, kernels)
            state[spec] = (cache, next_ids)
            walls[spec].append(wall)
            inside[spec].append(spent)
    if products is not None:
        kernels.count_products = True
        for spec in methods:
            kernels.products = 0
            step(model, *state[spec], kernels)
            products[spec] = kernels.products
        kernels.count_products = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="snapkv,full,deltakv,omnikv+deltakv")
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--context-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bar", type=float, default=1.15, help="the step, × the first method's, the reads' budget is for")
    parser.add_argument("--floor", action="store_true", help="DeltaKV's key product's floor at this CPU's peak (see above)")
    parser.add_argument("--out", type=Path, default=Path("runs/step_split.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = cpu_kernels()
    if module is None:
        parser.error("the compiled CPU kernels are not built here: nothing to split the step by")
    peak = peak_byte_products() if args.floor else None
    if args.floor and not peak:
        parser.error("--floor measures AVX512-VNNI's or AVX2's byte products, and this CPU or compiler has neither")
    kernels = TimedKernels(module)
    kvcompress.kernels._built = kernels  # what ``cpu_kernels()`` hands every caller from now on (they look it up per call)
    model, _ = load_model()
    ids = torch.randint(100, model.config.vocab_size, (1, args.context_tokens), generator=torch.Generator().manual_seed(0))
    methods = args.methods.split(",")
    interleaved_round(model, methods, args.ratio, ids[:, :256], 2, kernels, {s: [] for s in methods}, {s: [] for s in methods},
                      None)  # warm-up
    walls: dict[str, list] = {spec: [] for spec in methods}
    inside: dict[str, list] = {spec: [] for spec in methods}
    products: dict[str, int] | None = {} if args.floor else None
    for _ in range(args.rounds):
        interleaved_round(model, methods, args.ratio, ids, args.steps, kernels, walls, inside, products)
    rows = [{"method": spec, "step_ms": 1e3 * statistics.median(walls[spec]), "inside_kernels_ms": 1e3 * statistics.median(inside[spec]),
             "mean_step_ms": 1e3 * statistics.mean(walls[spec])} for spec in methods]
    for row in rows:
        row["step_vs_first"] = row["step_ms"] / rows[0]["step_ms"]
        rest = row["step_ms"] - row["inside_kernels_ms"]
        row["reads_budget_ms"] = args.bar * rows[0]["step_ms"] - rest
        line = (f"{row['method']:>18}: step {row['step_ms']:6.1f} ms (× {row['step_vs_first']:.2f}), inside the kernels "
                f"{row['inside_kernels_ms']:5.1f} ms, the rest {rest:6.1f} ms; the reads' budget at {args.bar}× "
                f"{row['reads_budget_ms']:5.1f} ms")
        if products is not None and products[row["method"]]:
            row["coded_key_byte_products"] = products[row["method"]]
            row["key_product_floor_ms"] = products[row["method"]] / (peak * args.threads) / 1e6
            line += f"; its keys' product's floor {row['key_product_floor_ms']:5.1f} ms"
        print(line)
    if peak is not None:
        print(f"peak byte products: {peak:.1f} a ns on one thread")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "peak_byte_products_per_ns": peak, "args": vars(args), "cpu": cpu_description()},
                                   indent=1, default=str))


if __name__ == "__main__":
    main()
