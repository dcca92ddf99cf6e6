// A decoding step's new entries recorded in its requests' slot tables before the forward writes their keys and values: a
// (slot, position) per (layer, KV head) of each table, after the head's last entry (store/slots.py's
// `SlotTable.append_step`; `SlotTable.append_slots`, table by table, is its reference: this gives the same tables).
//
// append_step(ids, lengths, weights, slots, positions, eligible) → appended: per table t, its (slot, position) array
// ids int32 [L, H, C, 2] (any strides over L, H and C, each pair contiguous), the entries of each head lengths int64
// [L, H] (contiguous) and the entries' weights float32 [L, H, C, W] (each entry's contiguous) or an empty tensor; slots
// int64 [T, L, H] (contiguous) and positions [T]. Entry (l, h) of an eligible table t goes at column lengths[l, h], its
// weights 0, and lengths[l, h] grows by one. A table not eligible, or without a free column for one of its heads, is left
// as it is (the caller appends it another way); returns whether each table was appended to. Shapes and values are checked
// for every table before any is written.
#include "kernels.h"

std::vector<bool> append_step(const std::vector<at::Tensor>& ids, const std::vector<at::Tensor>& lengths,
                              const std::vector<at::Tensor>& weights, const at::Tensor& slots, const std::vector<int64_t>& positions,
                              const std::vector<bool>& eligible) {
  const int64_t tables = static_cast<int64_t>(ids.size());
  TORCH_CHECK(lengths.size() == ids.size() && weights.size() == ids.size() && positions.size() == ids.size() && eligible.size() == ids.size(),
              "append_step: per table its ids, lengths, weights, position and whether to append");
  TORCH_CHECK(slots.dim() == 3 && slots.size(0) == tables && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "append_step: slots int64 [T, L, H], contiguous");
  const int64_t layers = slots.size(1), heads = slots.size(2), per_table = layers * heads;
  const int64_t* slot = slots.data_ptr<int64_t>();
  constexpr int64_t INT32_LIMIT = std::numeric_limits<int32_t>::max();
  for (int64_t i = 0; i < tables * per_table; ++i) TORCH_CHECK(slot[i] > 0 && slot[i] <= INT32_LIMIT, "append_step: a slot is an int32 id above 0");
  std::vector<bool> appended(tables, false);
  for (int64_t t = 0; t < tables; ++t) {
    const at::Tensor &id = ids[t], &length = lengths[t], &weight = weights[t];
    TORCH_CHECK(id.dim() == 4 && id.scalar_type() == at::kInt && id.size(0) == layers && id.size(1) == heads && id.size(3) == 2 &&
                    id.stride(3) == 1,
                "append_step: ids int32 [L, H, C, 2], each pair contiguous");
    TORCH_CHECK(length.scalar_type() == at::kLong && length.is_contiguous() && length.sizes() == at::IntArrayRef({layers, heads}),
                "append_step: lengths int64 [L, H], contiguous");
    TORCH_CHECK(weight.numel() == 0 || (weight.dim() == 4 && weight.scalar_type() == at::kFloat && weight.size(0) == layers &&
                                        weight.size(1) == heads && weight.size(2) == id.size(2) && weight.stride(3) == 1),
                "append_step: weights float32 [L, H, C, W], each entry's contiguous");
    TORCH_CHECK(positions[t] >= 0 && positions[t] <= INT32_LIMIT, "append_step: a position is an int32 at or above 0");
    const int64_t* held = length.data_ptr<int64_t>();
    appended[t] = eligible[t] && std::all_of(held, held + per_table, [&](int64_t n) { return n >= 0 && n < id.size(2); });
  }
  for (int64_t t = 0; t < tables; ++t) {
    if (!appended[t]) continue;
    const at::Tensor &id = ids[t], &weight = weights[t];
    int32_t* pairs = id.data_ptr<int32_t>();
    float* entry_weights = weight.numel() ? weight.data_ptr<float>() : nullptr;
    int64_t* held = lengths[t].data_ptr<int64_t>();
    for (int64_t l = 0; l < layers; ++l) {
      for (int64_t h = 0; h < heads; ++h) {
        int64_t& column = held[l * heads + h];
        int32_t* pair = pairs + l * id.stride(0) + h * id.stride(1) + column * id.stride(2);
        pair[0] = static_cast<int32_t>(slot[t * per_table + l * heads + h]), pair[1] = static_cast<int32_t>(positions[t]);
        if (entry_weights) {
          float* w = entry_weights + l * weight.stride(0) + h * weight.stride(1) + column * weight.stride(2);
          std::fill(w, w + weight.size(3), 0.f);
        }
        ++column;
      }
    }
  }
  return appended;
}
