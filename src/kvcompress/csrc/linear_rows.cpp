// A linear product over a few rows (a decoding step's): out = x · weightᵀ + bias, streaming the weight once from memory at
// the machine's read bandwidth. The contract is engine/packed.py's `PackedLinear`; F.linear is its reference.
//
//   linear_rows(x [M, K], weights: pieces [N_i, K] (each contiguous), bias [Σ N_i] or None), all float32 or all bfloat16
//     → out [M, Σ N_i] in x's dtype: the pieces' products side by side, as if their weights were stacked (a layer's query,
//     key and value products read from their own weights, with no stacked copy).
//
// Each output is Σ_k x[m, k] · weight[n, k] in float32 plus the bias, rounded to the dtype once; oneDNN's products (the
// engine's path for more rows) sum in another order, so the two may differ in the last bit. Three kernels:
//   * bfloat16 where the CPU has AVX512-BF16: VDPBF16PS, 32 channels a step (every product exact), weight rows two at a
//     time against eight rows of x (sixteen sums in registers), K a multiple of 32;
//   * float32 where the CPU has AVX-512 and K is a multiple of 16 up to WIDE_MAX_K: sixteen channels a step, weight rows
//     two at a time against eight rows of x (sixteen sums), x interleaved by steps first;
//   * otherwise (bfloat16 without AVX512-BF16, float32 on other K or where the CPU has AVX2 and FMA only): eight channels
//     a step (a bfloat16 number widened to float32 in registers: its bits shifted up), weight rows two at a time against
//     eight rows of x where the CPU has 32 vector registers, else four (sixteen or eight sums), K a multiple of 8.
// Where a row of x meets several weight rows, it is loaded into a register once a step: left to itself the compiler
// folds the load into each multiply-add, and the loads, not the multiply-adds, then bound the pass (on a Zen 5, 18
// against 30 GB/s a core with the weights in L1). With the weights in L2 the wide pass runs at 71-74 GB/s on two Zen 5
// cores and the two-row pass of eight channels at 50; from memory both run at what the memory gives (40-48 GB/s on a
// busy host).
// The threads each stream a contiguous run of weight rows, prefetched 8 KiB ahead (on the machines measured, the
// hardware's own prefetch leaves this at half the read bandwidth), non-temporally: timed alone, a step's products were
// no faster that way, but inside the engine's decoding step the rest of the step keeps its caches (on a Zen 5, the
// bfloat16 SnapKV step at 8 rows 9.46 → 8.97 ms, its Python 1.09 → 0.87 ms and its reads 83 → 73 µs a layer).
#include "kernels.h"

#include <ATen/Parallel.h>

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t AHEAD = 8192;  // bytes of weight prefetched ahead of the rows being read (16-64 KiB: no faster)

// A line of weight fetched ahead as a non-temporal stream (locality 0: PREFETCHNTA on x86): a decoding step reads each
// weight once, so its lines pass without evicting what the step reads again (its entries, the activations, the
// interpreter's own working set).
inline void stream_ahead(const char* line) { __builtin_prefetch(line, 0, 0); }

// A piece of the stacked weight: its rows are the output's [first, first + count), its groups of rows the tasks from
// first_group.
template <typename weight_t>
struct Piece {
  const weight_t* weight;
  int64_t first, count, first_group;
};

template <int64_t GROUP, typename weight_t>
std::vector<Piece<weight_t>> pieces_of(const std::vector<at::Tensor>& weights) {
  std::vector<Piece<weight_t>> pieces;
  int64_t first = 0, first_group = 0;
  for (const at::Tensor& weight : weights) {
    pieces.push_back({weight.data_ptr<weight_t>(), first, weight.size(0), first_group});
    first += weight.size(0);
    first_group += (weight.size(0) + GROUP - 1) / GROUP;
  }
  return pieces;
}

// Every group of GROUP weight rows (a piece's last rows fewer where its count is not a multiple) handed to pass(group, rows
// of the group, its first output column), the groups split into contiguous runs, one a thread, each run's start prefetched.
template <int64_t GROUP, typename weight_t, typename Pass>
void stream_groups(const std::vector<Piece<weight_t>>& pieces, int64_t k_channels, Pass pass) {
  const auto groups_of = [](const Piece<weight_t>& piece) { return (piece.count + GROUP - 1) / GROUP; };
  const int64_t groups = pieces.back().first_group + groups_of(pieces.back());
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    size_t piece = 0;
    for (int64_t p = begin; p < end; ++p) {
      while (p >= pieces[piece].first_group + groups_of(pieces[piece])) ++piece;
      const Piece<weight_t>& at = pieces[piece];
      const int64_t local = GROUP * (p - at.first_group);  // the group's first row in its piece
      const weight_t* group = at.weight + local * k_channels;
      if (p == begin) {  // the run's start, before the loop's prefetches reach it
        for (int64_t offset = 0; offset < AHEAD; offset += 64) stream_ahead(reinterpret_cast<const char*>(group) + offset);
      }
      pass(group, std::min(GROUP, at.count - local), at.first + local);
    }
  });
}

#if defined(__AVX512BF16__)
constexpr bool HAS_BF16_DOTS = true;
constexpr int64_t ROWS = 8;  // rows of x per pass (a pass: two weight rows against them)

// out[m, n0 + j] = x[m] · row0[j] + bias[n0 + j] for j < PAIR (2, or 1 where only one row is left) and m < rows, over K
// channels; x holds ROWS rows (the ones past `rows` zeros), so every loop has a fixed length and the sums stay in registers.
template <int64_t PAIR>
inline void rows_pass(const at::BFloat16* x, int64_t rows, int64_t k_channels, const at::BFloat16* row0, int64_t n0,
                      const at::BFloat16* bias, at::BFloat16* out, int64_t n_out) {
  __m512 acc[PAIR][ROWS];
  for (int64_t j = 0; j < PAIR; ++j)
    for (int64_t m = 0; m < ROWS; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_channels; k += 32) {
    stream_ahead(reinterpret_cast<const char*>(row0 + k) + AHEAD);
    if (PAIR == 2) stream_ahead(reinterpret_cast<const char*>(row0 + k_channels + k) + AHEAD);
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

void linear_rows_bf16(const at::BFloat16* x, int64_t rows, int64_t k_channels, const std::vector<Piece<at::BFloat16>>& pieces,
                      int64_t n_out, const at::BFloat16* bias, at::BFloat16* out) {
  stream_groups<2>(pieces, k_channels, [&](const at::BFloat16* pair, int64_t count, int64_t column) {
    for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
      const int64_t m = std::min(ROWS, rows - m0);
      if (count == 2) rows_pass<2>(x + m0 * k_channels, m, k_channels, pair, column, bias, out + m0 * n_out, n_out);
      else rows_pass<1>(x + m0 * k_channels, m, k_channels, pair, column, bias, out + m0 * n_out, n_out);
    }
  });
}
#else
constexpr bool HAS_BF16_DOTS = false;
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool HAS_FMA_SUMS = true;
// rows of x per pass, against two weight rows: sixteen sums in registers where the CPU has 32 vector registers (AVX-512VL),
// else eight. Eight sums are too few chains for two multiply-add units of four cycles' latency: on a Zen 5 a step's products
// over 8 rows took 14.4 ms as two passes of four rows, 12.2-12.4 as one pass of eight (and 12.1-12.7 over 1-4 rows, the
// pass padded: the read, not the sums, is what a row costs); AVX-512's 16-lane multiply-adds instead took 14.1 while the
// compiler loaded each row of x once a weight row (the `asm` below stops it), and are the wide pass where K allows.
#if defined(__AVX512VL__)
constexpr int64_t FMA_ROWS = 8;
#else
constexpr int64_t FMA_ROWS = 4;
#endif
constexpr int64_t FMA_GROUP = 2;

inline float sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

// out[m, n0 + j] = x[m] · row0[j] + bias[n0 + j] for j < PAIR and m < rows, x in float32 holding FMA_ROWS rows (the ones
// past `rows` zeros), weights and out in weight_t.
template <int64_t PAIR, typename weight_t>
inline void fma_pass(const float* x, int64_t rows, int64_t k_channels, const weight_t* row0, int64_t n0, const weight_t* bias,
                     weight_t* out, int64_t n_out) {
  __m256 acc[PAIR][FMA_ROWS];
  for (int64_t j = 0; j < PAIR; ++j)
    for (int64_t m = 0; m < FMA_ROWS; ++m) acc[j][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_channels; k += 8) {
    if (k % (64 / sizeof(weight_t)) == 0)
      for (int64_t j = 0; j < PAIR; ++j) stream_ahead(reinterpret_cast<const char*>(row0 + j * k_channels + k) + AHEAD);
    __m256 weights[PAIR];
    for (int64_t j = 0; j < PAIR; ++j) {
      weights[j] = load8(row0 + j * k_channels + k);
      asm("" : "+x"(weights[j]));  // loaded once into a register (the compiler would fold a load into every multiply-add)
    }
    for (int64_t m = 0; m < FMA_ROWS; ++m) {
      __m256 xs = _mm256_loadu_ps(x + m * k_channels + k);
      asm("" : "+v"(xs));  // one load for every weight row
      for (int64_t j = 0; j < PAIR; ++j) acc[j][m] = _mm256_fmadd_ps(xs, weights[j], acc[j][m]);
    }
  }
  float sums[PAIR][FMA_ROWS];  // every sum reduced at fixed indices first: a register array indexed by `rows` would live in memory
  for (int64_t j = 0; j < PAIR; ++j)
    for (int64_t m = 0; m < FMA_ROWS; ++m) sums[j][m] = sum8(acc[j][m]);
  for (int64_t j = 0; j < PAIR; ++j) {
    const float b = bias ? static_cast<float>(bias[n0 + j]) : 0.f;
    for (int64_t m = 0; m < rows; ++m) out[m * n_out + n0 + j] = static_cast<weight_t>(sums[j][m] + b);
  }
}

#if defined(__AVX512F__)
// The widest float32 pass, where the CPU has AVX-512 and x's FMA_ROWS rows fit in L1 beside the streamed weights (K at
// most WIDE_MAX_K, a multiple of 16): two weight rows against them, sixteen channels a step (sixteen sums). On a Zen 5,
// cold weights [N, 576], 30 layers' query-key-value, output and gate-up products over 8 rows, the two passes taken in
// turn in one process: 6.19-6.30 ms (50.5-51.4 GB/s) against 6.51-6.69 with one weight row a pass (an earlier run of
// three rows a pass against one, 32-42 against 36-47 GB/s, was not interleaved). Longer rows of x leave L1 (a row of
// [576, 1536]: two rows a pass 28 GB/s, one 18.5), and the two-row pass of eight channels runs there instead (42).
constexpr int64_t WIDE_MAX_K = 768;

// out[m, n + j] = x[m] · row_j + bias[n + j] for j < PAIR and m < rows, all float32 (row_j = row + j · K), x's FMA_ROWS
// rows interleaved by sixteen channels (`packed`: step s holds x[m, 16s .. 16s + 16) at (s · FMA_ROWS + m) · 16; zero rows
// past `rows`), read in order from one pointer, each step's load of a row of x used for both weight rows.
template <int64_t PAIR>
inline void wide_pass(const float* packed, int64_t rows, int64_t k_channels, const float* row, int64_t n, const float* bias,
                      float* out, int64_t n_out) {
  __m512 acc[PAIR][FMA_ROWS];
  for (int64_t j = 0; j < PAIR; ++j)
    for (int64_t m = 0; m < FMA_ROWS; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_channels; k += 16) {
    __m512 weights[PAIR];
    for (int64_t j = 0; j < PAIR; ++j) {
      stream_ahead(reinterpret_cast<const char*>(row + j * k_channels + k) + AHEAD);
      weights[j] = _mm512_loadu_ps(row + j * k_channels + k);
      asm("" : "+v"(weights[j]));  // loaded once into a register, as in fma_pass
    }
    const float* step = packed + k * FMA_ROWS;
    for (int64_t m = 0; m < FMA_ROWS; ++m) {
      __m512 xs = _mm512_loadu_ps(step + m * 16);
      asm("" : "+v"(xs));  // one load for both weight rows
      for (int64_t j = 0; j < PAIR; ++j) acc[j][m] = _mm512_fmadd_ps(xs, weights[j], acc[j][m]);
    }
  }
  float sums[PAIR][FMA_ROWS];  // reduced at fixed indices first, as fma_pass does
  for (int64_t j = 0; j < PAIR; ++j)
    for (int64_t m = 0; m < FMA_ROWS; ++m) sums[j][m] = _mm512_reduce_add_ps(acc[j][m]);
  for (int64_t j = 0; j < PAIR; ++j) {
    const float b = bias ? bias[n + j] : 0.f;
    for (int64_t m = 0; m < rows; ++m) out[m * n_out + n + j] = sums[j][m] + b;
  }
}

// x [rows, K] (any strides; K a multiple of 16, at most WIDE_MAX_K), the weights, bias and out float32.
void linear_rows_wide(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t rows = x.size(0), k_channels = x.size(1), n_out = out.size(1), steps = k_channels / 16;
  const int64_t passes = (rows + FMA_ROWS - 1) / FMA_ROWS, pass_floats = k_channels * FMA_ROWS;
  at::Tensor packed = at::empty({passes * pass_floats}, x.options());  // [passes, steps, FMA_ROWS, 16]
  float* xs = packed.data_ptr<float>();
  const auto rows_of_x = x.accessor<float, 2>();
  for (int64_t pass = 0; pass < passes; ++pass)
    for (int64_t step = 0; step < steps; ++step)
      for (int64_t m = 0; m < FMA_ROWS; ++m) {
        float* to = xs + pass * pass_floats + (step * FMA_ROWS + m) * 16;
        const int64_t row = pass * FMA_ROWS + m;
        for (int64_t c = 0; c < 16; ++c) to[c] = row < rows ? rows_of_x[row][step * 16 + c] : 0.f;
      }
  const float* bias_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* to_out = out.data_ptr<float>();
  stream_groups<2>(pieces_of<2, float>(weights), k_channels, [&](const float* pair, int64_t count, int64_t column) {
    for (int64_t pass = 0; pass < passes; ++pass) {
      const int64_t m = std::min(FMA_ROWS, rows - pass * FMA_ROWS);
      float* to = to_out + pass * FMA_ROWS * n_out;
      if (count == 2) wide_pass<2>(xs + pass * pass_floats, m, k_channels, pair, column, bias_data, to, n_out);
      else wide_pass<1>(xs + pass * pass_floats, m, k_channels, pair, column, bias_data, to, n_out);
    }
  });
}
#endif

// x: float32 [rows (padded to whole passes), K]; the weights, bias and out in weight_t.
template <typename weight_t>
void linear_rows_fma(const float* x, int64_t rows, const std::vector<at::Tensor>& weights, const std::optional<at::Tensor>& bias,
                     at::Tensor& out) {
  const int64_t k_channels = weights.front().size(1), n_out = out.size(1);
  const weight_t* bias_data = bias.has_value() ? bias->data_ptr<weight_t>() : nullptr;
  weight_t* to_out = out.data_ptr<weight_t>();
  stream_groups<FMA_GROUP>(pieces_of<FMA_GROUP, weight_t>(weights), k_channels, [&](const weight_t* group, int64_t count, int64_t column) {
    for (int64_t m0 = 0; m0 < rows; m0 += FMA_ROWS) {
      const int64_t m = std::min(FMA_ROWS, rows - m0);
      const float* xs = x + m0 * k_channels;
      weight_t* to = to_out + m0 * n_out;
      if (count == 2) fma_pass<2>(xs, m, k_channels, group, column, bias_data, to, n_out);
      else fma_pass<1>(xs, m, k_channels, group, column, bias_data, to, n_out);
    }
  });
}
#else
constexpr bool HAS_FMA_SUMS = false;
#endif

// What linear_rows runs for a dtype on this CPU: the bfloat16 dots, the float32 FMA sums, or nothing.
bool bf16_dots(at::ScalarType type) { return type == at::kBFloat16 && HAS_BF16_DOTS; }
bool runs(at::ScalarType type) { return bf16_dots(type) || ((type == at::kFloat || type == at::kBFloat16) && HAS_FMA_SUMS); }

}  // namespace

bool linear_rows_bf16_dots() { return HAS_BF16_DOTS; }

std::vector<std::string> linear_rows_dtypes() {
  std::vector<std::string> names;
  if (runs(at::kFloat)) names.push_back("float32");
  if (runs(at::kBFloat16)) names.push_back("bfloat16");
  return names;
}

at::Tensor linear_rows(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "linear_rows: x, a float32 or bfloat16 CPU matrix [M, K]");
  const at::ScalarType type = x.scalar_type();
  TORCH_CHECK(runs(type), "linear_rows: this CPU (or build) has no kernel for ", type, " (AVX512-BF16, or AVX2 and FMA)");
  const int64_t multiple = bf16_dots(type) ? 32 : 8;
  TORCH_CHECK(x.size(1) % multiple == 0, "linear_rows: K a multiple of ", multiple);
  TORCH_CHECK(!weights.empty(), "linear_rows: at least one weight");
  int64_t n_out = 0;
  for (const at::Tensor& weight : weights) {
    TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == type &&
                    weight.size(1) == x.size(1) && weight.size(0) > 0,
                "linear_rows: contiguous CPU weights [N, K] of x's dtype, K as x's");
    n_out += weight.size(0);
  }
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->is_contiguous() && bias->scalar_type() == type && bias->size(0) == n_out),
              "linear_rows: a contiguous bias [Σ N] of x's dtype, or None");
  at::Tensor out = at::empty({x.size(0), n_out}, x.options());
#if defined(__AVX512BF16__)
  if (bf16_dots(type)) {
    at::Tensor rows = x;  // whole passes of ROWS rows: padded with zero rows where x is not
    if (!x.is_contiguous() || x.size(0) % ROWS != 0) {
      rows = at::zeros({(x.size(0) + ROWS - 1) / ROWS * ROWS, x.size(1)}, x.options());
      rows.narrow(0, 0, x.size(0)).copy_(x);
    }
    linear_rows_bf16(rows.data_ptr<at::BFloat16>(), x.size(0), rows.size(1), pieces_of<2, at::BFloat16>(weights), n_out,
                     bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>());
    return out;
  }
#endif
#if defined(__AVX512F__)
  if (type == at::kFloat && x.size(1) % 16 == 0 && x.size(1) <= WIDE_MAX_K) {
    linear_rows_wide(x, weights, bias, out);
    return out;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  at::Tensor rows = x;  // float32, whole passes of FMA_ROWS rows: a copy, padded with zero rows, where x is not
  if (type != at::kFloat || !x.is_contiguous() || x.size(0) % FMA_ROWS != 0) {
    rows = at::zeros({(x.size(0) + FMA_ROWS - 1) / FMA_ROWS * FMA_ROWS, x.size(1)}, x.options().dtype(at::kFloat));
    rows.narrow(0, 0, x.size(0)).copy_(x);
  }
  if (type == at::kFloat) linear_rows_fma<float>(rows.data_ptr<float>(), x.size(0), weights, bias, out);
  else linear_rows_fma<at::BFloat16>(rows.data_ptr<float>(), x.size(0), weights, bias, out);
#endif
  return out;
}
