// The engine's greedy tokens (engine/sampling.py's `greedy_tokens`; torch's argmax and isnan are its reference): per row of
// logits float32 [R, V] (each row contiguous), the first index of its largest value and whether the row holds a NaN
// (where it does, the index means nothing: the engine fails that request). Two passes a row, each vectorized: the largest
// value and any NaN, then the first column holding that value; rows are shared among ATen's threads. ATen's argmax over
// a step's logits (8 rows of 49152, in cache) took ~110 µs on 2 Zen 5 cores; this, ~10.
#include "kernels.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// The row's largest value (NaN or anything where the row holds a NaN) and whether it holds a NaN.
std::pair<float, bool> largest(const float* row, int64_t width) {
  float top = -std::numeric_limits<float>::infinity();
  bool unordered = false;
  int64_t v = 0;
#if defined(__AVX512F__)
  __m512 tops = _mm512_set1_ps(top);
  __mmask16 nan = 0;
  for (; v + 16 <= width; v += 16) {
    const __m512 x = _mm512_loadu_ps(row + v);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    tops = _mm512_max_ps(tops, x);
  }
  top = _mm512_reduce_max_ps(tops), unordered = nan != 0;
#elif defined(__AVX2__)
  __m256 tops = _mm256_set1_ps(top), nan = _mm256_setzero_ps();
  for (; v + 8 <= width; v += 8) {
    const __m256 x = _mm256_loadu_ps(row + v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    tops = _mm256_max_ps(tops, x);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, tops);
  for (float lane : lanes) top = lane > top ? lane : top;
  unordered = _mm256_movemask_ps(nan) != 0;
#endif
  for (; v < width; ++v) {
    unordered |= row[v] != row[v];
    top = row[v] > top ? row[v] : top;
  }
  return {top, unordered};
}

// The first column holding `top` (0 where none does: a row of NaN).
int64_t first_of(const float* row, int64_t width, float top) {
  int64_t v = 0;
#if defined(__AVX512F__)
  const __m512 tops = _mm512_set1_ps(top);
  for (; v + 16 <= width; v += 16) {
    const __mmask16 equal = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + v), tops, _CMP_EQ_OQ);
    if (equal) return v + __builtin_ctz(equal);
  }
#endif
  for (; v < width; ++v)
    if (row[v] == top) return v;
  return 0;
}

}  // namespace

std::tuple<std::vector<int64_t>, std::vector<bool>> greedy_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0 &&
                  logits.stride(1) == 1,
              "greedy_rows: logits float32 [R, V] on the CPU, V > 0, each row contiguous");
  const int64_t rows = logits.size(0), width = logits.size(1), stride = logits.stride(0);
  const float* values = logits.data_ptr<float>();
  std::vector<int64_t> best(rows, 0);
  std::vector<char> nan(rows, 0);  // not vector<bool>: threads write neighbouring rows
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto [top, unordered] = largest(values + r * stride, width);
      nan[r] = static_cast<char>(unordered);
      best[r] = unordered ? 0 : first_of(values + r * stride, width, top);
    }
  });
  return {best, std::vector<bool>(nan.begin(), nan.end())};
}
