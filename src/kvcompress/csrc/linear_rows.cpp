// A linear product over a few rows in bfloat16 (a decoding step's): out = x · weightᵀ + bias, streaming the weight once
// from memory at the machine's read bandwidth. The contract is engine/packed.py's `PackedLinear`; F.linear is its reference.
//
//   linear_rows(x [M, K] bfloat16, weights: pieces [N_i, K] bfloat16 (each contiguous), bias [Σ N_i] bfloat16 or None)
//     → out [M, Σ N_i] bfloat16: the pieces' products side by side, as if their weights were stacked (a layer's query,
//     key and value products read from their own weights, with no stacked copy).
//
// Each output is Σ_k x[m, k] · weight[n, k] in float32 (every product exact: AVX512-BF16's VDPBF16PS, 32 channels a step),
// plus the bias, rounded to bfloat16 once. oneDNN's products (the engine's path for more rows) sum in another order, so
// the two may differ in the last bit. Weight rows are taken two at a time against eight rows of x (sixteen sums in
// registers); the threads each stream a contiguous run of weight rows, prefetched 8 KiB ahead (on the machines measured,
// the hardware's own prefetch leaves this at half the read bandwidth).
#include "kernels.h"

#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t ROWS = 8;  // rows of x per pass (a pass: two weight rows against them)

#if defined(__AVX512BF16__)
constexpr bool HAS_BF16_DOTS = true;
constexpr int64_t AHEAD = 8192;  // bytes of weight prefetched ahead of the rows being read

// out[m, n0 + j] = x[m] · row0[j] + bias[n0 + j] for j < PAIR (2, or 1 where only one row is left) and m < rows, over K
// channels; x holds ROWS rows (the ones past `rows` zeros), so every loop has a fixed length and the sums stay in registers.
template <int64_t PAIR>
inline void rows_pass(const at::BFloat16* x, int64_t rows, int64_t k_channels, const at::BFloat16* row0, int64_t n0,
                      const at::BFloat16* bias, at::BFloat16* out, int64_t n_out) {
  __m512 acc[PAIR][ROWS];
  for (int64_t j = 0; j < PAIR; ++j)
    for (int64_t m = 0; m < ROWS; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_channels; k += 32) {
    __builtin_prefetch(reinterpret_cast<const char*>(row0 + k) + AHEAD);
    if (PAIR == 2) __builtin_prefetch(reinterpret_cast<const char*>(row0 + k_channels + k) + AHEAD);
    __m512bh weights[PAIR];
    for (int64_t j = 0; j < PAIR; ++j) weights[j] = (__m512bh)_mm512_loadu_si512(row0 + j * k_channels + k);
    for (int64_t m = 0; m < ROWS; ++m) {
      const __m512bh xs = (__m512bh)_mm512_loadu_si512(x + m * k_channels + k);
      for (int64_t j = 0; j < PAIR; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], xs, weights[j]);
    }
  }
  for (int64_t j = 0; j < PAIR; ++j) {
    const float b = bias ? static_cast<float>(bias[n0 + j]) : 0.f;
    for (int64_t m = 0; m < rows; ++m) out[m * n_out + n0 + j] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(acc[j][m]) + b);
  }
}

// A piece of the stacked weight: its rows are the output's [first, first + count), its pairs of rows the tasks from first_pair.
struct Piece {
  const at::BFloat16* weight;
  int64_t first, count, first_pair;
};

void linear_rows_bf16(const at::BFloat16* x, int64_t rows, int64_t k_channels, const std::vector<Piece>& pieces, int64_t n_out,
                      const at::BFloat16* bias, at::BFloat16* out) {
  const int64_t pairs = pieces.back().first_pair + (pieces.back().count + 1) / 2;
  at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
    size_t piece = 0;
    for (int64_t p = begin; p < end; ++p) {
      while (p >= pieces[piece].first_pair + (pieces[piece].count + 1) / 2) ++piece;
      const Piece& at = pieces[piece];
      const int64_t local = 2 * (p - at.first_pair);  // the pair's first row in its piece
      const at::BFloat16* pair = at.weight + local * k_channels;
      if (p == begin) {  // the run's start, before the loop's prefetches reach it
        for (int64_t offset = 0; offset < AHEAD; offset += 64) __builtin_prefetch(reinterpret_cast<const char*>(pair) + offset);
      }
      for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
        const int64_t m = std::min(ROWS, rows - m0);
        const at::BFloat16* xs = x + m0 * k_channels;
        at::BFloat16* to = out + m0 * n_out;
        if (local + 1 < at.count) rows_pass<2>(xs, m, k_channels, pair, at.first + local, bias, to, n_out);
        else rows_pass<1>(xs, m, k_channels, pair, at.first + local, bias, to, n_out);
      }
    }
  });
}
#else
constexpr bool HAS_BF16_DOTS = false;
#endif

}  // namespace

bool linear_rows_available() { return HAS_BF16_DOTS; }

at::Tensor linear_rows(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(HAS_BF16_DOTS, "linear_rows: this CPU (or build) has no AVX512-BF16 instructions");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_rows: x, a bfloat16 CPU matrix [M, K]");
  TORCH_CHECK(x.size(1) % 32 == 0, "linear_rows: K a multiple of 32");
  TORCH_CHECK(!weights.empty(), "linear_rows: at least one weight");
  int64_t n_out = 0;
  for (const at::Tensor& weight : weights) {
    TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16 &&
                    weight.size(1) == x.size(1) && weight.size(0) > 0,
                "linear_rows: contiguous bfloat16 CPU weights [N, K], K as x's");
    n_out += weight.size(0);
  }
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->is_contiguous() && bias->scalar_type() == at::kBFloat16 &&
                                    bias->size(0) == n_out),
              "linear_rows: a contiguous bfloat16 bias [Σ N], or None");
  at::Tensor rows = x;  // whole passes of ROWS rows: padded with zero rows where x is not
  if (!x.is_contiguous() || x.size(0) % ROWS != 0) {
    rows = at::zeros({(x.size(0) + ROWS - 1) / ROWS * ROWS, x.size(1)}, x.options());
    rows.narrow(0, 0, x.size(0)).copy_(x);
  }
  at::Tensor out = at::empty({x.size(0), n_out}, x.options());
#if defined(__AVX512BF16__)
  std::vector<Piece> pieces;
  int64_t first = 0, first_pair = 0;
  for (const at::Tensor& weight : weights) {
    pieces.push_back({weight.data_ptr<at::BFloat16>(), first, weight.size(0), first_pair});
    first += weight.size(0);
    first_pair += (weight.size(0) + 1) / 2;
  }
  linear_rows_bf16(rows.data_ptr<at::BFloat16>(), x.size(0), rows.size(1), pieces, n_out,
                   bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>());
#endif
  return out;
}
