// The best pages of each KV head by their bound, as the entry columns a decoding read takes (Quest's choice). The
// contract is read/pages.py's `top_pages`; its PyTorch path is the reference, and this gives the same columns.
//
// Per (row b, head h): a page's score is the largest of its G query heads' bounds bound[b, h, :, p] where useful[b, h, p],
// else -inf; the pages are ranked by score, of equal scores the earlier page first (a stable descending sort), and
// the first `pages` of them are laid out page after page, page_size columns each: column p · page_size + t where the
// page is among the head's count[b, h] best, scores above -inf, and open[b, h, column], else -1. The head's
// protected columns come first, as given. Bounds are never NaN (they are sums of finite keys).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

at::Tensor top_pages(const at::Tensor& bound, const at::Tensor& useful, const at::Tensor& count, const at::Tensor& protected_columns,
                     const at::Tensor& open, int64_t page_size, int64_t pages) {
  TORCH_CHECK(bound.dim() == 4 && bound.scalar_type() == at::kFloat && bound.is_contiguous(), "bound: float32 [B, H, G, P], contiguous");
  const int64_t rows = bound.size(0), heads = bound.size(1), group = bound.size(2), total = bound.size(3);
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
  const float* bounds = bound.data_ptr<float>();
  const bool* is_useful = useful.data_ptr<bool>();
  const bool* is_open = open.data_ptr<bool>();
  const int64_t* counts = count.data_ptr<int64_t>();
  const int64_t* kept = protected_columns.data_ptr<int64_t>();
  int64_t* columns = out.data_ptr<int64_t>();
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(total);
    std::vector<int64_t> order(total);
    for (int64_t head = begin; head < end; ++head) {
      const float* head_bounds = bounds + head * group * total;
      for (int64_t p = 0; p < total; ++p) {
        float best = NEG_INF;
        if (is_useful[head * total + p]) {
          for (int64_t g = 0; g < group; ++g) best = std::max(best, head_bounds[g * total + p]);
        }
        score[p] = best;
      }
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
  return out;
}
