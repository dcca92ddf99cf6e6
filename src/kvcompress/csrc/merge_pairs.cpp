// A decoding step's merge pairs (KeepKV, CaM, D2O, one entry leaving a head): per KV head, the entry that leaves and the
// retained key it folds into, read where the keys live. The contract is methods/merging.py's `leaving_pairs`; its PyTorch
// path `leaving_pairs_torch` (over the gathered keys) is the reference: this gives the same entries wherever no two
// similarities lie within float32 rounding of each other (the dot products and norms run in another order).
//
// merge_pairs(keys, tables, score, open) → (leaving, carrier, similarity): `keys` the pool's plain keys [S, d] (float32,
// bfloat16 or float16, rows contiguous); per row r, `tables[r]` an int32 [H, ≥ L] slot table (any strides: a view of the
// store's own); `score` float32 [R, H, L] and `open` bool [R, H, L] (both contiguous). Per (row r, head h):
// leaving = the open column of the lowest score (of equal scores the first; column 0 where none is open); carrier = the
// open column other than it whose key has the highest cosine similarity to the leaving key (the first of equal ones;
// column 0 where none), with similarity = k_c·k_l / (max(‖k_c‖, 1e-12) · max(‖k_l‖, 1e-12)) in float32 (-inf where
// none). Scores are never NaN.
#include "kernels.h"

namespace {

// ‖k‖² over d numbers, float32 sums.
template <typename scalar_t>
inline float squared_norm(const scalar_t* k, int64_t d) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < d; ++c) sum += to_float(k[c]) * to_float(k[c]);
  return sum;
}

constexpr float NORM_EPS = 1e-12f;  // F.normalize's

// The cosine similarity of a key to a unit vector: k·u / max(‖k‖, 1e-12), both sums in one pass over the key.
template <typename scalar_t>
inline float cosine_to(const float* unit, const scalar_t* k, int64_t d) {
  float product = 0.f, squared = 0.f;
#pragma omp simd reduction(+ : product, squared)
  for (int64_t c = 0; c < d; ++c) {
    const float x = to_float(k[c]);
    product += unit[c] * x;
    squared += x * x;
  }
  return product / std::max(std::sqrt(squared), NORM_EPS);
}

}  // namespace

std::vector<at::Tensor> merge_pairs(const at::Tensor& keys, const std::vector<at::Tensor>& tables, const at::Tensor& score,
                                    const at::Tensor& open) {
  TORCH_CHECK(keys.dim() == 2 && keys.stride(1) == 1, "keys: [S, d], rows contiguous");
  TORCH_CHECK(score.dim() == 3 && score.scalar_type() == at::kFloat && score.is_contiguous(), "score: float32 [R, H, L], contiguous");
  const int64_t rows = score.size(0), heads = score.size(1), length = score.size(2), d = keys.size(1);
  TORCH_CHECK(open.scalar_type() == at::kBool && open.is_contiguous() && open.sizes() == score.sizes(), "open: bool [R, H, L], contiguous");
  TORCH_CHECK(static_cast<int64_t>(tables.size()) == rows, "one slot table per row");
  for (const auto& table : tables) {
    TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kInt && table.size(0) == heads && table.size(1) >= length,
                "a slot table: int32 [H, ≥ L]");
  }
  const auto index_options = score.options().dtype(at::kLong);
  auto leaving = at::zeros({rows, heads}, index_options), carrier = at::zeros({rows, heads}, index_options);
  auto similarity = at::full({rows, heads}, NEG_INF, score.options());
  const float* scores = score.data_ptr<float>();
  const bool* is_open = open.data_ptr<bool>();
  int64_t* leaves = leaving.data_ptr<int64_t>();
  int64_t* carries = carrier.data_ptr<int64_t>();
  float* best = similarity.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys.scalar_type(), "merge_pairs", [&] {
    const scalar_t* all_keys = keys.data_ptr<scalar_t>();
    const int64_t stride = keys.stride(0);
    at::parallel_for(0, rows * heads, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> unit(d);
      for (int64_t head = begin; head < end; ++head) {
        const at::Tensor& table = tables[head / heads];
        const int32_t* slots = table.data_ptr<int32_t>() + (head % heads) * table.stride(0);
        const int64_t step = table.stride(1);
        const float* head_score = scores + head * length;
        const bool* head_open = is_open + head * length;
        int64_t out = -1;
        for (int64_t j = 0; j < length; ++j) {
          if (head_open[j] && (out < 0 || head_score[j] < head_score[out])) out = j;
        }
        if (out < 0) continue;
        leaves[head] = out;
        const scalar_t* key = all_keys + slots[out * step] * stride;
        const float inverse = 1.f / std::max(std::sqrt(squared_norm(key, d)), NORM_EPS);
        for (int64_t c = 0; c < d; ++c) unit[c] = to_float(key[c]) * inverse;
        float top = NEG_INF;
        int64_t into = 0;
        for (int64_t j = 0; j < length; ++j) {
          if (!head_open[j] || j == out) continue;
          const float cosine = cosine_to(unit.data(), all_keys + slots[j * step] * stride, d);
          if (cosine > top) {
            top = cosine;
            into = j;
          }
        }
        carries[head] = into;
        best[head] = top;
      }
    });
  });
  return {leaving, carrier, similarity};
}
