// A slot table's rows keeping the entries marked in a mask, in place (the store's `SlotTable.retain`). The contract is
// store/slots.py's `compact_rows`; its PyTorch path `compact_rows_torch` is the reference: this gives the same.
//
// compact_tables(ids, weights, keep, lengths, pad_slot, pad_position) → (dropped, counts): `ids` int32 [R, H, L, 2] (slot, position; any
// strides over R, H and L, each pair contiguous: a view of the store's own table), `weights` float32 [R, H, L, C] likewise
// or an empty tensor, `keep` bool [R, H, L] (contiguous), `lengths` int64 [R, H] (contiguous) the entries each head holds,
// `pad_slot` and `pad_position` the (slot, position) of padding. Per (row r, head h), the entries at columns below its length marked in `keep`
// move to the head's first columns, in order, with their weights; every later column of the L becomes padding, weights
// 0. Returns the slots of the entries left out (int64 [n]: head after head, in column order) and each head's count of
// entries kept (int64 [R, H]).
#include "kernels.h"

std::vector<at::Tensor> compact_tables(at::Tensor ids, at::Tensor weights, const at::Tensor& keep, const at::Tensor& lengths,
                                       int64_t pad_slot, int64_t pad_position) {
  TORCH_CHECK(ids.dim() == 4 && ids.scalar_type() == at::kInt && ids.size(3) == 2 && ids.stride(3) == 1, "ids: int32 [R, H, L, 2]");
  const int64_t rows = ids.size(0), heads = ids.size(1), length = ids.size(2);
  TORCH_CHECK(keep.scalar_type() == at::kBool && keep.is_contiguous() && keep.sizes() == at::IntArrayRef({rows, heads, length}),
              "keep: bool [R, H, L], contiguous");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.sizes() == at::IntArrayRef({rows, heads}),
              "lengths: int64 [R, H], contiguous");
  const bool weighted = weights.numel() > 0;
  TORCH_CHECK(!weighted || (weights.dim() == 4 && weights.scalar_type() == at::kFloat && weights.size(0) == rows &&
                            weights.size(1) == heads && weights.size(2) == length && weights.stride(3) == 1),
              "weights: float32 [R, H, L, C], each entry's contiguous");
  const int64_t columns = weighted ? weights.size(3) : 0;
  const bool* kept = keep.data_ptr<bool>();
  const int64_t* held = lengths.data_ptr<int64_t>();
  auto counts = at::empty({rows, heads}, lengths.options());
  int64_t* count = counts.data_ptr<int64_t>();
  std::vector<int64_t> dropped;
  int32_t* table = ids.data_ptr<int32_t>();
  float* weight = weighted ? weights.data_ptr<float>() : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t head = r * heads + h;
      TORCH_CHECK(held[head] >= 0 && held[head] <= length, "lengths: each head's count of entries, at most L");
      int32_t* entry = table + r * ids.stride(0) + h * ids.stride(1);
      float* entry_weights = weighted ? weight + r * weights.stride(0) + h * weights.stride(1) : nullptr;
      int64_t to = 0;
      for (int64_t j = 0; j < held[head]; ++j) {
        int32_t* from = entry + j * ids.stride(2);
        if (!kept[head * length + j]) {
          dropped.push_back(from[0]);
          continue;
        }
        if (to != j) {
          int32_t* into = entry + to * ids.stride(2);
          into[0] = from[0];
          into[1] = from[1];
          if (weighted) {
            std::copy_n(entry_weights + j * weights.stride(2), columns, entry_weights + to * weights.stride(2));
          }
        }
        ++to;
      }
      count[head] = to;
      for (int64_t j = to; j < length; ++j) {
        int32_t* into = entry + j * ids.stride(2);
        into[0] = static_cast<int32_t>(pad_slot);
        into[1] = static_cast<int32_t>(pad_position);
        if (weighted) std::fill_n(entry_weights + j * weights.stride(2), columns, 0.f);
      }
    }
  }
  auto out = at::empty({static_cast<int64_t>(dropped.size())}, lengths.options());
  std::copy(dropped.begin(), dropped.end(), out.data_ptr<int64_t>());
  return {out, counts};
}
