// A decoding read's summary of what left (MomentKV's moments) merged into its output in one pass. The contract is
// read/sdpa.py's `merge_summary` for one query a row; its PyTorch path (the summary's affine read, then `merge_lse`) is
// the reference: this gives its numbers but for the order of a sum.
//
// summary_merge(query [R, Hq, 1, d], out [R, Hq, 1, d] (both in the query's dtype, any strides over R and Hq, channels
// contiguous), lse [R, Hq, 1] float32, matrix [R, H, d + 1, d] float32, bias [R, H, d + 1] float32, the three contiguous)
// → (out [R, Hq, 1, d] in the query's dtype, lse [R, Hq, 1] float32). Query head j serves KV head j / (Hq / H). The summary's
// read of query q is s = matrix · q + bias in float32: its output s[0 : d] and its log partition function s[d]. Merged by
// log-sum-exp: lse' = logaddexp(lse, s[d]), out' = out · exp(lse − lse') + s[0 : d] · exp(s[d] − lse'); an empty side
// (−inf) weighs 0, and where both are empty out' = 0 and lse' = −inf.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <array>
#include <vector>

namespace {

// log(e^a + e^b) without overflow; −inf where both are.
inline float log_add_exp(float a, float b) {
  const float top = std::max(a, b);
  if (top == NEG_INF) return NEG_INF;
  return top + std::log1p(std::exp(std::min(a, b) - top));
}

template <typename scalar_t>
void merge_rows(const scalar_t* query, const scalar_t* out, const std::array<int64_t, 4>& strides, const float* lse,
                const float* matrix, const float* bias, int64_t rows, int64_t query_heads, int64_t heads, int64_t d,
                scalar_t* merged, float* merged_lse) {
  const int64_t group = query_heads / heads;
  at::parallel_for(0, rows * query_heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> q(d), read(d + 1);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / query_heads, j = i % query_heads, head = r * heads + j / group;
      const scalar_t* query_row = query + r * strides[0] + j * strides[1];
      for (int64_t c = 0; c < d; ++c) q[c] = to_float(query_row[c]);
      const float* rows_of = matrix + head * (d + 1) * d;
      for (int64_t e = 0; e <= d; ++e) read[e] = bias[head * (d + 1) + e] + dot(q.data(), rows_of + e * d, d);
      const float old_lse = lse[i], new_lse = log_add_exp(old_lse, read[d]);
      const float shift = new_lse == NEG_INF ? 0.f : new_lse;
      const float kept = std::exp(old_lse - shift), added = std::exp(read[d] - shift);  // 0 on an empty side
      const scalar_t* out_row = out + r * strides[2] + j * strides[3];
      scalar_t* merged_row = merged + i * d;
      for (int64_t c = 0; c < d; ++c) {
        const float before = to_float(out_row[c]);
        merged_row[c] = static_cast<scalar_t>((std::isnan(before) ? 0.f : before) * kept + read[c] * added);
      }
      merged_lse[i] = new_lse;
    }
  });
}

}  // namespace

std::vector<at::Tensor> summary_merge(const at::Tensor& query, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& matrix,
                                      const at::Tensor& bias) {
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 4 && query.size(2) == 1 && query.stride(3) == 1,
              "query: a CPU tensor [R, Hq, 1, d], channels contiguous");
  const int64_t rows = query.size(0), query_heads = query.size(1), d = query.size(3);
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() && out.stride(3) == 1,
              "out: [R, Hq, 1, d] in the query's dtype, channels contiguous");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.sizes() == at::IntArrayRef({rows, query_heads, 1}),
              "lse: float32 [R, Hq, 1], contiguous");
  TORCH_CHECK(matrix.scalar_type() == at::kFloat && matrix.is_contiguous() && matrix.dim() == 4 && matrix.size(0) == rows &&
                  matrix.size(2) == d + 1 && matrix.size(3) == d,
              "matrix: float32 [R, H, d + 1, d], contiguous");
  const int64_t heads = matrix.size(1);
  TORCH_CHECK(heads >= 1 && query_heads % heads == 0, "the query heads a multiple of the summary's heads");
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.sizes() == at::IntArrayRef({rows, heads, d + 1}),
              "bias: float32 [R, H, d + 1], contiguous");
  auto merged = at::empty({rows, query_heads, 1, d}, query.options());
  auto merged_lse = at::empty({rows, query_heads, 1}, lse.options());
  const std::array<int64_t, 4> strides{query.stride(0), query.stride(1), out.stride(0), out.stride(1)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "summary_merge", [&] {
    merge_rows<scalar_t>(query.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), strides, lse.data_ptr<float>(), matrix.data_ptr<float>(),
                         bias.data_ptr<float>(), rows, query_heads, heads, d, merged.data_ptr<scalar_t>(), merged_lse.data_ptr<float>());
  });
  return {merged, merged_lse};
}
