// A decoding read's selection (Quest's pages, OmniKV's tokens) laid over the rows' slot tables, for the paged reads. The
// contract is read/tables.py's `select_pages`; its PyTorch path `select_tables_torch` is the reference: this gives the same.
//
// select_tables(tables, weights, columns) → R tables, then R weight tables, then the lengths: per row r, `tables[r]` an int32 [H, ≥ L] slot
// table (any strides), `weights[r]` its float32 [H, ≥ L] log-weights or an empty tensor, and `columns` int64 [R, H, k]
// (contiguous) the columns each head reads, -1 for none. The selected table is int32 [H, k]: at column j the slot at
// columns[r, h, j], or 0 (a hole) where it is -1; its log-weights float32 [H, k] likewise (0 on a hole), or an empty tensor
// where the row has none. The lengths, int64 [R, H]: the columns each head reads, up to its last chosen one (trailing
// holes left out, so that a selection of every entry reads as the plain read does).
#include "kernels.h"

#include <vector>

std::vector<at::Tensor> select_tables(const std::vector<at::Tensor>& tables, const std::vector<at::Tensor>& weights,
                                      const at::Tensor& columns) {
  TORCH_CHECK(columns.dim() == 3 && columns.scalar_type() == at::kLong && columns.is_contiguous(), "columns: int64 [R, H, k], contiguous");
  const int64_t rows = columns.size(0), heads = columns.size(1), k = columns.size(2);
  TORCH_CHECK(static_cast<int64_t>(tables.size()) == rows && weights.size() == tables.size(), "one table and one weight table per row");
  std::vector<at::Tensor> out(2 * rows + 1);
  const int64_t* chosen = columns.data_ptr<int64_t>();
  auto lengths = at::zeros({rows, heads}, columns.options());
  int64_t* length = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const at::Tensor& table = tables[r];
    TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kInt && table.size(0) == heads, "a slot table: int32 [H, L]");
    const at::Tensor& weight = weights[r];
    const bool weighted = weight.numel() > 0;
    TORCH_CHECK(!weighted || (weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.size(0) == heads),
                "a log-weight table: float32 [H, L]");
    auto selected = at::empty({heads, k}, table.options());
    auto selected_weights = weighted ? at::empty({heads, k}, weight.options()) : at::empty({0}, columns.options().dtype(at::kFloat));
    const int32_t* slots = table.data_ptr<int32_t>();
    const float* log_weights = weighted ? weight.data_ptr<float>() : nullptr;
    int32_t* to = selected.data_ptr<int32_t>();
    float* to_weights = weighted ? selected_weights.data_ptr<float>() : nullptr;
    const int64_t width = weighted ? std::min(table.size(1), weight.size(1)) : table.size(1);
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t column = chosen[(r * heads + h) * k + j];
        TORCH_CHECK(column >= -1 && column < width, "columns: each -1 or a column of its table (and of its log-weights)");
        to[h * k + j] = column < 0 ? 0 : slots[h * table.stride(0) + column * table.stride(1)];
        if (weighted) to_weights[h * k + j] = column < 0 ? 0.f : log_weights[h * weight.stride(0) + column * weight.stride(1)];
        if (column >= 0) length[r * heads + h] = j + 1;
      }
    }
    out[r] = selected;
    out[rows + r] = selected_weights;
  }
  out[2 * rows] = lengths;
  return out;
}
