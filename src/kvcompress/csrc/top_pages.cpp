// The best pages of each KV head by their bound, as the entry columns a decoding read takes (Quest's choice), in one
// pass from the step's query and the store's page bounds. The contract is read/pages.py's `top_pages`; its PyTorch path
// (`top_pages_torch` over `page_bounds_torch`) is the reference: this gives the same columns wherever no two pages'
// bounds lie within float32 rounding of each other (the bounds' sums run in another order), and exactly the same where
// the sums are exact (integer-valued queries and keys, as the tests hold it).
//
// The bound, per (row b, head h, query head g, page p): the upper bound of q·k over the page,
// Σ_c min(q_c, 0)·min_c + max(q_c, 0)·max_c, from query[b, h, g] (float32 [B, H, G, d]) and the page's per-channel
// minimum and maximum key bounds[b, h, p, 0 | 1] ([B, H, P, 2, d] in the keys' dtype, any strides over B, H and P: a view
// of the store's own bounds), summed in float32.
//
// Per (row b, head h): a page's score is the largest of its G query heads' bounds where useful[b, h, p], else -inf; the
// pages are ranked by score, of equal scores the earlier page first (a stable descending sort), and the first `pages` of
// them are laid out page after page, page_size columns each: column p · page_size + t where the page is among the head's
// count[b, h] best, scores above -inf, and open[b, h, column], else -1. The head's protected columns come first, as
// given. Bounds are never NaN (they are sums of finite keys).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <limits>
#include <numeric>
#include <vector>

namespace {

// One head's page scores: the largest of its G query heads' bounds over each page where useful, else -inf. q: the head's
// [G, d] queries split into their negative and positive parts; low: its first page's minimum keys, pages `stride` apart.
template <typename scalar_t>
void page_scores(const float* negative, const float* positive, const scalar_t* low, int64_t stride, const bool* useful, int64_t group,
                 int64_t total, int64_t d, float* score) {
  for (int64_t p = 0; p < total; ++p) {
    float best = NEG_INF;
    if (useful[p]) {
      const scalar_t* page_low = low + p * stride;
      const scalar_t* page_high = page_low + d;
      for (int64_t g = 0; g < group; ++g) {
        const float* neg = negative + g * d;
        const float* pos = positive + g * d;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < d; ++c) sum += neg[c] * to_float(page_low[c]) + pos[c] * to_float(page_high[c]);
        best = std::max(best, sum);
      }
    }
    score[p] = best;
  }
}

}  // namespace

at::Tensor top_pages(const at::Tensor& query, const at::Tensor& bounds, const at::Tensor& useful, const at::Tensor& count,
                     const at::Tensor& protected_columns, const at::Tensor& open, int64_t page_size, int64_t pages) {
  TORCH_CHECK(query.dim() == 4 && query.scalar_type() == at::kFloat && query.is_contiguous(), "query: float32 [B, H, G, d], contiguous");
  const int64_t rows = query.size(0), heads = query.size(1), group = query.size(2), d = query.size(3);
  TORCH_CHECK(bounds.dim() == 5 && bounds.size(0) == rows && bounds.size(1) == heads && bounds.size(3) == 2 && bounds.size(4) == d &&
                  bounds.stride(4) == 1 && bounds.stride(3) == d,
              "bounds: [B, H, P, 2, d], each page's minimum and maximum contiguous");
  const int64_t total = bounds.size(2);
  TORCH_CHECK(useful.scalar_type() == at::kBool && useful.is_contiguous() && useful.sizes() == at::IntArrayRef({rows, heads, total}),
              "useful: bool [B, H, P], contiguous");
  TORCH_CHECK(count.scalar_type() == at::kLong && count.is_contiguous() && count.sizes() == at::IntArrayRef({rows, heads}),
              "count: int64 [B, H], contiguous");
  TORCH_CHECK(protected_columns.scalar_type() == at::kLong && protected_columns.is_contiguous() && protected_columns.dim() == 3 &&
                  protected_columns.size(0) == rows && protected_columns.size(1) == heads,
              "protected columns: int64 [B, H, W], contiguous");
  TORCH_CHECK(open.scalar_type() == at::kBool && open.is_contiguous() && open.sizes() == at::IntArrayRef({rows, heads, total * page_size}),
              "open: bool [B, H, P · page_size], contiguous");
  TORCH_CHECK(page_size >= 1 && pages >= 0 && pages <= total, "page_size ≥ 1 and 0 ≤ pages ≤ P");
  const int64_t width = protected_columns.size(2), out_width = width + pages * page_size;
  auto out = at::empty({rows, heads, out_width}, count.options());
  const float* q = query.data_ptr<float>();
  const bool* is_useful = useful.data_ptr<bool>();
  const bool* is_open = open.data_ptr<bool>();
  const int64_t* counts = count.data_ptr<int64_t>();
  const int64_t* kept = protected_columns.data_ptr<int64_t>();
  int64_t* columns = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, bounds.scalar_type(), "top_pages", [&] {
    const scalar_t* all_bounds = bounds.data_ptr<scalar_t>();
    at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> negative(group * d), positive(group * d), score(total);
      std::vector<int64_t> order(total);
      for (int64_t head = begin; head < end; ++head) {
        const float* head_query = q + head * group * d;
        for (int64_t c = 0; c < group * d; ++c) {
          negative[c] = std::min(head_query[c], 0.f);
          positive[c] = std::max(head_query[c], 0.f);
        }
        const scalar_t* low = all_bounds + (head / heads) * bounds.stride(0) + (head % heads) * bounds.stride(1);
        page_scores<scalar_t>(negative.data(), positive.data(), low, bounds.stride(2), is_useful + head * total, group, total, d,
                              score.data());
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + pages, order.end(),
                          [&](int64_t a, int64_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); });
        int64_t* row = columns + head * out_width;
        std::copy(kept + head * width, kept + (head + 1) * width, row);
        const bool* head_open = is_open + head * total * page_size;
        for (int64_t j = 0; j < pages; ++j) {
          const int64_t page = order[j];
          const bool taken = j < counts[head] && score[page] > NEG_INF;
          for (int64_t t = 0; t < page_size; ++t) {
            const int64_t column = page * page_size + t;
            row[width + j * page_size + t] = taken && head_open[column] ? column : -1;
          }
        }
      }
    });
  });
  return out;
}
