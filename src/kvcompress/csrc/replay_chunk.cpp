// KVzip's replay chunk in bfloat16: each replay query's attention over every held entry (all real, all before the
// chunk) and, causally, the chunk's own entries, and each held entry's largest weight. The contract is read/sdpa.py's
// `replay_attention` after a prefill; its plain path (two flash calls merged by log-sum-exp, then the float32 product
// of the queries and the held keys) and the float32 oracle `read.attend_with_max_weights` are its references.
//
//   replay_chunk(rows [B, H, G·q, d] bfloat16 (row g · q + t: query head g of the group at the chunk's token t),
//                keys, values [B, H, L, d] bfloat16 (held), new_keys, new_values [B, H, q, d] bfloat16 (the chunk's), scaling)
//     → out [B, H, G·q, d] float32: row g · q + t's softmax over the held entries and the chunk's entries 0 … t, times
//       their values;
//       best [B, H, L] float32: max over rows of q · k_l · scaling − the row's log-sum-exp (the log of each held entry's
//       largest weight).
//
// The logits' products are exact in float32 and summed in float32 (AVX512-BF16's VDPBF16PS); the weights are rounded
// to bfloat16 for their product with the values, as the flash kernel does in bfloat16, and summed in float32. A task is
// ROWS rows of one head: their logits over every entry they see (the held and chunk keys laid out 64 at a time as
// channel pairs, so a register holds sixteen keys' sums; tiles past what any of the rows sees are skipped), kept in a
// buffer; each row's max, sum and log-sum-exp; the largest weights; then the weights times the values (laid out as
// pairs of consecutive entries per channel, so a register holds sixteen channels' sums). No [G·q, L + q] matrix exists;
// each thread keeps its own largest weights and merges them at its end.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <mutex>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t LANES = 16;           // float32 sums in a register
constexpr int64_t VECTORS = 4;          // registers of keys (or of channels) in a tile
constexpr int64_t KEYS = LANES * VECTORS;
constexpr int64_t ROWS = 6;             // queries in a task

#if defined(__AVX512BF16__)
constexpr bool HAS_BF16_DOTS = true;

inline int32_t pair_of(at::BFloat16 low, at::BFloat16 high) {
  return static_cast<int32_t>(static_cast<uint32_t>(low.x) | (static_cast<uint32_t>(high.x) << 16));
}

// Entry l of a head: held entry l, then the chunk's entry l − held.
struct Entries {
  const at::BFloat16 *held, *chunk;
  int64_t held_count, count, d;
  const at::BFloat16* row(int64_t l) const { return l < held_count ? held + l * d : chunk + (l - held_count) * d; }
};

// A head's keys as channel pairs, a tile of KEYS keys at a time: out[(tile · pairs + p) · KEYS + k] = key (tile · KEYS + k)'s
// channels 2p, 2p + 1 (zero past the last key); its values as entry pairs: out[j · d + c] = (value 2j's and 2j + 1's
// channel c), zero past the last value.
void pack_head(const Entries& keys, const Entries& values, int64_t padded, int32_t* key_pairs, int32_t* value_pairs) {
  const int64_t d = keys.d, pairs = d / 2;
  std::fill(key_pairs, key_pairs + padded * pairs, 0);
  for (int64_t l = 0; l < keys.count; ++l) {
    const int32_t* key = reinterpret_cast<const int32_t*>(keys.row(l));
    int32_t* tile = key_pairs + (l / KEYS) * pairs * KEYS + l % KEYS;
    for (int64_t p = 0; p < pairs; ++p) tile[p * KEYS] = key[p];
  }
  std::fill(value_pairs, value_pairs + padded / 2 * d, 0);
  const at::BFloat16 zero(0.f);
  for (int64_t j = 0; j < (values.count + 1) / 2; ++j) {
    const at::BFloat16* first = values.row(2 * j);
    const at::BFloat16* second = 2 * j + 1 < values.count ? values.row(2 * j + 1) : nullptr;
    for (int64_t c = 0; c < d; ++c) value_pairs[j * d + c] = pair_of(first[c], second ? second[c] : zero);
  }
}

// logits[r · stride + l] = rows[r] · key l · scaling for the task's rows (n real, ROWS computed: the last one repeated)
// over the first `tiles` key tiles; -inf from each row's `seen[r]` on.
void task_logits(const int32_t* const* row, int64_t n, int64_t pairs, const int32_t* key_pairs, int64_t tiles, const int64_t* seen,
                 float scaling, float* logits, int64_t stride) {
  const __m512 scale = _mm512_set1_ps(scaling);
  for (int64_t tile = 0; tile < tiles; ++tile) {
    __m512 acc[ROWS][VECTORS];
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_setzero_ps();
    const int32_t* keys = key_pairs + tile * pairs * KEYS;
    for (int64_t p = 0; p < pairs; ++p) {
      __m512bh k[VECTORS];
      for (int64_t v = 0; v < VECTORS; ++v) k[v] = (__m512bh)_mm512_loadu_si512(keys + p * KEYS + v * LANES);
      for (int64_t r = 0; r < ROWS; ++r) {
        const __m512bh q = (__m512bh)_mm512_set1_epi32(row[r][p]);
        for (int64_t v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], q, k[v]);
      }
    }
    for (int64_t r = 0; r < n; ++r)
      for (int64_t v = 0; v < VECTORS; ++v) _mm512_storeu_ps(logits + r * stride + tile * KEYS + v * LANES, _mm512_mul_ps(acc[r][v], scale));
  }
  for (int64_t r = 0; r < n; ++r) std::fill(logits + r * stride + seen[r], logits + r * stride + tiles * KEYS, NEG_INF);
}

// A row's weights exp(logit − max) rounded to bfloat16 into `weights` (zero past the keys, to an even count), their
// float32 sum returned; `top` its max.
float row_weights(const float* logits, int64_t padded, float top, at::BFloat16* weights) {
  float sum = 0.f;
  for (int64_t l = 0; l < padded; l += LANES) {
    float e[LANES];
#pragma omp simd
    for (int64_t i = 0; i < LANES; ++i) e[i] = exp_float(logits[l + i] - top);
    const __m512 ev = _mm512_loadu_ps(e);
    sum += _mm512_reduce_add_ps(ev);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + l), (__m256i)_mm512_cvtneps_pbh(ev));
  }
  return sum;
}

// out[r · d + c] = Σ_l weights[r][l] · value l, channel c, for the task's rows (weights as pairs of entries), over
// `pairs_of_entries` value pairs; each row divided by its sum.
void task_values(const int32_t* const* weights, int64_t n, int64_t pairs_of_entries, const int32_t* value_pairs, int64_t d,
                 const float* sums, float* out) {
  for (int64_t c0 = 0; c0 < d; c0 += KEYS) {
    __m512 acc[ROWS][VECTORS];
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs_of_entries; ++j) {
      __m512bh vals[VECTORS];
      for (int64_t v = 0; v < VECTORS; ++v) vals[v] = (__m512bh)_mm512_loadu_si512(value_pairs + j * d + c0 + v * LANES);
      for (int64_t r = 0; r < ROWS; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(weights[r][j]);
        for (int64_t v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w, vals[v]);
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      const __m512 inverse = _mm512_set1_ps(1.f / sums[r]);
      for (int64_t v = 0; v < VECTORS; ++v) _mm512_storeu_ps(out + r * d + c0 + v * LANES, _mm512_mul_ps(acc[r][v], inverse));
    }
  }
}

struct Head {
  const int32_t* rows;  // [G·q, d/2] pairs
  const int32_t* key_pairs;
  const int32_t* value_pairs;
  float* out;
};

// Rows [r0, r0 + n) of a head (row r sees the held entries and the chunk's up to token r mod q): their outputs, and their
// largest weights over the `held` entries maxed into `best` [held].
void run_task(const Head& head, int64_t r0, int64_t n, int64_t held, int64_t chunk, int64_t d, float scaling,
              std::vector<float>& logits, std::vector<at::BFloat16>& weights, float* best) {
  const int64_t pairs = d / 2, stride = (held + chunk + KEYS - 1) / KEYS * KEYS;
  int64_t seen[ROWS], most = 0;
  for (int64_t r = 0; r < n; ++r) most = std::max(most, seen[r] = held + (r0 + r) % chunk + 1);
  const int64_t tiles = (most + KEYS - 1) / KEYS;
  const int32_t* row[ROWS];
  const int32_t* weight_pairs[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) {
    row[r] = head.rows + (r0 + std::min(r, n - 1)) * pairs;
    weight_pairs[r] = reinterpret_cast<const int32_t*>(weights.data() + std::min(r, n - 1) * stride);
  }
  task_logits(row, n, pairs, head.key_pairs, tiles, seen, scaling, logits.data(), stride);
  float sums[ROWS];
  for (int64_t r = 0; r < n; ++r) {
    const float* s = logits.data() + r * stride;
    float top = NEG_INF;
#pragma omp simd reduction(max : top)
    for (int64_t l = 0; l < seen[r]; ++l) top = std::max(top, s[l]);
    sums[r] = row_weights(s, tiles * KEYS, top, weights.data() + r * stride);
    const float lse = top + std::log(sums[r]);
#pragma omp simd
    for (int64_t l = 0; l < held; ++l) best[l] = std::max(best[l], s[l] - lse);
  }
  task_values(weight_pairs, n, tiles * KEYS / 2, head.value_pairs, d, sums, head.out + r0 * d);
}
#else
constexpr bool HAS_BF16_DOTS = false;
#endif

}  // namespace

bool replay_chunk_available() { return HAS_BF16_DOTS; }

std::vector<at::Tensor> replay_chunk(const at::Tensor& rows, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& new_keys,
                                     const at::Tensor& new_values, double scaling) {
  TORCH_CHECK(HAS_BF16_DOTS, "replay_chunk: this CPU (or build) has no AVX512-BF16 instructions");
  TORCH_CHECK(rows.device().is_cpu() && rows.dim() == 4 && rows.scalar_type() == at::kBFloat16, "replay_chunk: rows, bfloat16 [B, H, G·q, d]");
  for (const at::Tensor* t : {&keys, &values, &new_keys, &new_values})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 4 && t->scalar_type() == at::kBFloat16 && t->size(0) == rows.size(0) &&
                    t->size(1) == rows.size(1) && t->size(3) == rows.size(3),
                "replay_chunk: keys, values, new_keys and new_values, bfloat16 [B, H, n, d] of the rows' batch, heads and head dim");
  TORCH_CHECK(values.size(2) == keys.size(2) && new_values.size(2) == new_keys.size(2), "replay_chunk: as many values as keys");
  const int64_t batch = rows.size(0), heads = rows.size(1), count = rows.size(2), held = keys.size(2), chunk = new_keys.size(2);
  const int64_t d = rows.size(3);
  TORCH_CHECK(chunk > 0 && count % chunk == 0, "replay_chunk: a chunk of at least one token and rows G·q for its q tokens");
  TORCH_CHECK(d % KEYS == 0, "replay_chunk: a head dim that is a multiple of 64");
  const auto f32 = rows.options().dtype(at::kFloat);
  at::Tensor out = at::empty({batch, heads, count, d}, f32);
  at::Tensor best = at::full({batch, heads, held}, NEG_INF, f32);
#if defined(__AVX512BF16__)
  const at::Tensor q = rows.contiguous(), k = keys.contiguous(), v = values.contiguous(), nk = new_keys.contiguous(),
                   nv = new_values.contiguous();
  const int64_t padded = (held + chunk + KEYS - 1) / KEYS * KEYS, key_size = padded * d / 2, value_size = padded / 2 * d;
  std::vector<int32_t> key_pairs(batch * heads * key_size), value_pairs(batch * heads * value_size);
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      const Entries head_keys{k.data_ptr<at::BFloat16>() + h * held * d, nk.data_ptr<at::BFloat16>() + h * chunk * d, held, held + chunk, d};
      const Entries head_values{v.data_ptr<at::BFloat16>() + h * held * d, nv.data_ptr<at::BFloat16>() + h * chunk * d, held, held + chunk, d};
      pack_head(head_keys, head_values, padded, key_pairs.data() + h * key_size, value_pairs.data() + h * value_size);
    }
  });
  const int64_t tasks_per_head = (count + ROWS - 1) / ROWS;
  std::mutex merging;
  float* best_data = best.data_ptr<float>();
  at::parallel_for(0, batch * heads * tasks_per_head, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> logits(ROWS * padded);
    std::vector<at::BFloat16> weights(ROWS * padded);
    const int64_t first_head = begin / tasks_per_head, last_head = (end - 1) / tasks_per_head;
    std::vector<float> own_best((last_head - first_head + 1) * held, NEG_INF);  // this thread's, merged at its end
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / tasks_per_head, r0 = (task % tasks_per_head) * ROWS;
      const Head head{reinterpret_cast<const int32_t*>(q.data_ptr<at::BFloat16>()) + h * count * d / 2, key_pairs.data() + h * key_size,
                      value_pairs.data() + h * value_size, out.data_ptr<float>() + h * count * d};
      run_task(head, r0, std::min(ROWS, count - r0), held, chunk, d, static_cast<float>(scaling), logits, weights,
               own_best.data() + (h - first_head) * held);
    }
    std::lock_guard<std::mutex> lock(merging);
    for (int64_t i = 0; i < static_cast<int64_t>(own_best.size()); ++i)
      best_data[first_head * held + i] = std::max(best_data[first_head * held + i], own_best[i]);
  });
#endif
  return {out, best};
}
