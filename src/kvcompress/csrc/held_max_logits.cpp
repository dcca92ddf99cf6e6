// KVzip's replay scores in bfloat16: each held entry's largest logit less the query's log-sum-exp, over every replay query
// of its KV head's group. The contract is read/sdpa.py's `held_max_weights` (the float32 product of the queries and the
// held keys, less each row's lse, its largest per key), which is also its reference.
//
//   held_max_logits(rows [B, H, R, d] bfloat16 (the GQA group folded into R), keys [B, H, L, d] bfloat16,
//                   lse [B, H, R] float32, scaling) → [B, H, L] float32: max over r of rows[r] · keys[l] · scaling − lse[r]
//
// Every product is exact in float32 (AVX512-BF16's VDPBF16PS) and summed in float32, so it differs from the float32
// matrix product only in the order of the sums. The keys are laid out a tile at a time as channel pairs of KEYS keys
// ([d/2][KEYS] pairs, what VDPBF16PS multiplies against one query's pair broadcast to every lane), so each register holds
// sixteen keys' sums and no sum is reduced across a register; ROWS queries against KEYS keys keep 24 sums in registers.
// The threads take tiles of KEYS keys (of every head) and run every query over each.
#include "kernels.h"

#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
constexpr bool HAS_BF16_DOTS = true;
constexpr int64_t LANES = 16;           // float32 sums in a register
constexpr int64_t VECTORS = 4;          // registers of keys in a tile
constexpr int64_t KEYS = LANES * VECTORS;
constexpr int64_t ROWS = 6;             // queries against a tile at once

// A tile's keys as channel pairs: tile[p · KEYS + k] = (key k's channels 2p, 2p + 1), zero past the last key.
void pack_tile(const at::BFloat16* keys, int64_t count, int64_t pairs, std::vector<int32_t>& tile) {
  std::fill(tile.begin(), tile.end(), 0);
  for (int64_t k = 0; k < count; ++k) {
    const int32_t* key = reinterpret_cast<const int32_t*>(keys + k * 2 * pairs);
    for (int64_t p = 0; p < pairs; ++p) tile[p * KEYS + k] = key[p];
  }
}

// best[k] = max over rows r of rows[r] · key k · scaling − lse[r], for the tile's KEYS keys, over `count_rows` rows.
void tile_max(const int32_t* rows, const float* lse, int64_t count_rows, int64_t pairs, const int32_t* tile, float scaling,
              float* best) {
  __m512 top[VECTORS];
  for (int64_t v = 0; v < VECTORS; ++v) top[v] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale = _mm512_set1_ps(scaling);
  for (int64_t r0 = 0; r0 < count_rows; r0 += ROWS) {
    const int64_t n = std::min(ROWS, count_rows - r0);
    __m512 acc[ROWS][VECTORS];
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_setzero_ps();
    const int32_t* row[ROWS];  // past the n real rows: the last one again (its sums are not used)
    for (int64_t r = 0; r < ROWS; ++r) row[r] = rows + (r0 + std::min(r, n - 1)) * pairs;
    for (int64_t p = 0; p < pairs; ++p) {
      __m512bh keys[VECTORS];
      for (int64_t v = 0; v < VECTORS; ++v) keys[v] = (__m512bh)_mm512_loadu_si512(tile + p * KEYS + v * LANES);
      for (int64_t r = 0; r < ROWS; ++r) {
        const __m512bh pair = (__m512bh)_mm512_set1_epi32(row[r][p]);
        for (int64_t v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pair, keys[v]);
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      const __m512 shift = _mm512_set1_ps(lse[r0 + r]);
      for (int64_t v = 0; v < VECTORS; ++v) top[v] = _mm512_max_ps(top[v], _mm512_fmsub_ps(acc[r][v], scale, shift));
    }
  }
  for (int64_t v = 0; v < VECTORS; ++v) _mm512_storeu_ps(best + v * LANES, top[v]);
}
#else
constexpr bool HAS_BF16_DOTS = false;
#endif

}  // namespace

bool held_max_logits_available() { return HAS_BF16_DOTS; }

at::Tensor held_max_logits(const at::Tensor& rows, const at::Tensor& keys, const at::Tensor& lse, double scaling) {
  TORCH_CHECK(HAS_BF16_DOTS, "held_max_logits: this CPU (or build) has no AVX512-BF16 instructions");
  TORCH_CHECK(rows.device().is_cpu() && rows.dim() == 4 && rows.scalar_type() == at::kBFloat16, "held_max_logits: rows, bfloat16 [B, H, R, d]");
  TORCH_CHECK(keys.device().is_cpu() && keys.dim() == 4 && keys.scalar_type() == at::kBFloat16, "held_max_logits: keys, bfloat16 [B, H, L, d]");
  TORCH_CHECK(keys.size(0) == rows.size(0) && keys.size(1) == rows.size(1) && keys.size(3) == rows.size(3),
              "held_max_logits: rows and keys of the same batch, heads and head dim");
  TORCH_CHECK(rows.size(3) % 2 == 0, "held_max_logits: an even head dim");
  TORCH_CHECK(lse.dim() == 3 && lse.scalar_type() == at::kFloat && lse.size(0) == rows.size(0) && lse.size(1) == rows.size(1) &&
                  lse.size(2) == rows.size(2),
              "held_max_logits: lse, float32 [B, H, R]");
  const int64_t batch = rows.size(0), heads = rows.size(1), count_rows = rows.size(2), length = keys.size(2);
  const int64_t pairs = rows.size(3) / 2;
  at::Tensor best = at::full({batch, heads, length}, -std::numeric_limits<float>::infinity(), lse.options());
#if defined(__AVX512BF16__)
  const at::Tensor q = rows.contiguous(), k = keys.contiguous(), shifts = lse.contiguous();
  const int64_t tiles = (length + KEYS - 1) / KEYS;
  const auto* q_data = reinterpret_cast<const int32_t*>(q.data_ptr<at::BFloat16>());
  const at::BFloat16* k_data = k.data_ptr<at::BFloat16>();
  const float* lse_data = shifts.data_ptr<float>();
  float* out = best.data_ptr<float>();
  if (count_rows > 0) {
    at::parallel_for(0, batch * heads * tiles, 1, [&](int64_t begin, int64_t end) {
      std::vector<int32_t> tile(pairs * KEYS);
      float top[KEYS];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t head = task / tiles, first = (task % tiles) * KEYS, count = std::min(KEYS, length - first);
        pack_tile(k_data + (head * length + first) * 2 * pairs, count, pairs, tile);
        tile_max(q_data + head * count_rows * pairs, lse_data + head * count_rows, count_rows, pairs, tile.data(),
                 static_cast<float>(scaling), top);
        std::copy(top, top + count, out + head * length + first);
      }
    });
  }
#endif
  return best;
}
