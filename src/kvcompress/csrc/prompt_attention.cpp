// A prompt's causal attention in float32 sums, blocked as a flash kernel is (no [q, L] matrix): the prefill's attention
// (read/sdpa.py's `prompt_attention` without a mask, and `chunk_attention`: a prompt's chunk after its held entries).
// F.scaled_dot_product_attention with the causal mask aligned to the last key is its reference.
//
//   causal_attention(query [B, Hq, c, d], keys, values [B, H, L, d], scaling), L ≥ c, Hq a multiple of H, all float32 or
//   all bfloat16, d a multiple of 64 → out [B, Hq, c, d] in the query's dtype: query t (of c) sits after the first L − c
//   entries and sees keys 0 … L − c + t; query head h·G + g reads KV head h.
//
// torch's CPU flash kernel runs a 2000-token prompt of SmolLM2 (9 query heads over 3 KV heads of 64 channels) at ~144
// GFLOP/s on two Zen 5 cores, a quarter of their float32 peak: half of a prefill's time. Here a task is one KV head's QUERIES
// consecutive queries of every query head of its group (G · QUERIES rows, the group folded); it walks the keys KEYS at a
// time, up to what its last query sees:
//   1. logits S = (q · scaling) · kᵀ over a block: four rows against 64 keys in sixteen registers, the keys laid out
//      channel-major once per head (kᵀ [d, L]) so a channel's 64 keys are four loads and a row's channel one broadcast;
//   2. keys past a row's last masked to −inf; each row's running max m and sum l updated (online softmax, float32), its
//      output scaled by exp(m_old − m_new);
//   3. O += P · V: four rows against the d channels (d / 16 registers a row, 64 at a time), a key's value row loaded once
//      for the four.
// The output is O / l. Every product and sum is float32 (bfloat16 inputs widened exactly); the sums run in another order
// than torch's kernel, so the two agree to float32 rounding. Tasks are taken heaviest first, dynamically, by the threads.
#include "kernels.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr bool HAS_AVX512 = true;
constexpr int64_t QUERIES = 16;  // queries of a task, each with its group's query heads
constexpr int64_t KEYS = 64;     // keys of a block
constexpr int64_t ROWS = 4;      // rows of a register tile

// Block `block` of a head's keys and values [length, d] into its layouts: keys channel-major a block at a time
// [padded / KEYS, d, KEYS] (a block's 16 KiB contiguous: rows of a [d, L] layout lie L floats apart, and at 2048 keys
// all fall in the same few L1 sets) and values [padded, d], float32, zero past the last key (a block's values past it
// are read, and weighed by 0).
template <typename scalar_t>
void pack_block(const scalar_t* keys, const scalar_t* values, int64_t length, int64_t d, int64_t block, float* keys_out, float* values_out) {
  float* tile = keys_out + block * d * KEYS;
  for (int64_t j = 0; j < KEYS; ++j) {
    const int64_t l = block * KEYS + j;
    float* value = values_out + l * d;
    if (l >= length) {
      for (int64_t c = 0; c < d; ++c) tile[c * KEYS + j] = value[c] = 0.f;
      continue;
    }
    for (int64_t c = 0; c < d; ++c) {
      tile[c * KEYS + j] = to_float(keys[l * d + c]);
      value[c] = to_float(values[l * d + c]);
    }
  }
}

// exp(x) of sixteen lanes as kernels.h's exp_float computes it (Cephes' polynomial, 2^n applied by VSCALEFPS); 0 below −87.
inline __m512 exp16(__m512 x) {
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(clamped, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __mmask16 above = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(above, _mm512_scalef_ps(e, n));
}

// logits[r, 0 .. KEYS) = rows[r] · keys_t[:, first .. first + KEYS) for r < count (a multiple of ROWS).
void block_logits(const float* rows, int64_t count, int64_t d, const float* keys_t, int64_t first, float* logits) {
  for (int64_t r0 = 0; r0 < count; r0 += ROWS) {
    __m512 acc[ROWS][4];
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; ++c) {
      const float* channel = keys_t + (first * d + c * KEYS);
      __m512 k[4];
      for (int64_t v = 0; v < 4; ++v) {
        k[v] = _mm512_loadu_ps(channel + 16 * v);
        asm("" : "+v"(k[v]));  // loaded once into a register (the compiler would fold a load into every multiply-add)
      }
      for (int64_t r = 0; r < ROWS; ++r) {
        const __m512 q = _mm512_set1_ps(rows[(r0 + r) * d + c]);
        for (int64_t v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(q, k[v], acc[r][v]);
      }
    }
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t v = 0; v < 4; ++v) _mm512_storeu_ps(logits + (r0 + r) * KEYS + 16 * v, acc[r][v]);
  }
}

// out[r] = out[r] · rescale[r] + Σ_j weights[r, j] · values[first + j] for r < count, 64 channels at a time.
void block_values(const float* weights, const float* rescale, int64_t count, int64_t d, const float* values, int64_t first, float* out) {
  for (int64_t r0 = 0; r0 < count; r0 += ROWS)
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
      __m512 acc[ROWS][4];
      for (int64_t r = 0; r < ROWS; ++r) {
        const __m512 scale = _mm512_set1_ps(rescale[r0 + r]);
        for (int64_t v = 0; v < 4; ++v) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(out + (r0 + r) * d + c0 + 16 * v), scale);
      }
      for (int64_t j = 0; j < KEYS; ++j) {
        const float* value = values + (first + j) * d + c0;
        __m512 x[4];
        for (int64_t v = 0; v < 4; ++v) {
          x[v] = _mm512_loadu_ps(value + 16 * v);
          asm("" : "+v"(x[v]));  // as the keys' in block_logits
        }
        for (int64_t r = 0; r < ROWS; ++r) {
          const __m512 p = _mm512_set1_ps(weights[(r0 + r) * KEYS + j]);
          for (int64_t v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(p, x[v], acc[r][v]);
        }
      }
      for (int64_t r = 0; r < ROWS; ++r)
        for (int64_t v = 0; v < 4; ++v) _mm512_storeu_ps(out + (r0 + r) * d + c0 + 16 * v, acc[r][v]);
    }
}

// One task: queries t0 .. t0 + QUERIES (those below c) of every query head of one KV head's group, over that head's keys
// and values as pack_block lays them out.
template <typename scalar_t>
void attend_task(const scalar_t* query, scalar_t* out, const float* keys_t, const float* values, int64_t groups, int64_t c,
                 int64_t length, int64_t d, int64_t t0, float scaling) {
  const int64_t count = groups * QUERIES, visible_before = length - c;
  std::vector<float> rows(count * d, 0.f), acc(count * d, 0.f), logits(count * KEYS), rescale(count);
  std::vector<float> top(count, NEG_INF), total(count, 0.f);
  std::vector<int64_t> last(count);  // the last key row r sees
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t t = 0; t < QUERIES; ++t) {
      const int64_t r = g * QUERIES + t, token = std::min(t0 + t, c - 1);  // rows past c repeat the last query
      last[r] = visible_before + token;
      const scalar_t* q = query + (g * c + token) * d;
      for (int64_t ch = 0; ch < d; ++ch) rows[r * d + ch] = to_float(q[ch]) * scaling;
    }
  const int64_t end = visible_before + std::min(t0 + QUERIES, c);  // keys 0 .. end − 1 are seen by some row
  for (int64_t first = 0; first < end; first += KEYS) {
    block_logits(rows.data(), count, d, keys_t, first, logits.data());
    for (int64_t r = 0; r < count; ++r) {
      float* row = logits.data() + r * KEYS;
      const int64_t seen = std::clamp<int64_t>(last[r] - first + 1, 0, KEYS);  // none: the row's last key before the block
      __mmask16 lanes[4];
      __m512 x[4];
      __m512 block_top = _mm512_set1_ps(NEG_INF);
      for (int64_t v = 0; v < 4; ++v) {
        const int64_t in = std::clamp<int64_t>(seen - 16 * v, 0, 16);
        lanes[v] = static_cast<__mmask16>(in == 16 ? 0xFFFF : (1u << in) - 1);
        x[v] = _mm512_loadu_ps(row + 16 * v);
        block_top = _mm512_mask_max_ps(block_top, lanes[v], block_top, x[v]);
      }
      const float next = std::max(top[r], _mm512_reduce_max_ps(block_top));
      __m512 sum = _mm512_setzero_ps();
      const __m512 shift = _mm512_set1_ps(next);
      for (int64_t v = 0; v < 4; ++v) {
        const __m512 p = lanes[v] ? _mm512_maskz_mov_ps(lanes[v], exp16(_mm512_sub_ps(x[v], shift))) : _mm512_setzero_ps();
        _mm512_storeu_ps(row + 16 * v, p);
        sum = _mm512_add_ps(sum, p);
      }
      rescale[r] = top[r] == NEG_INF ? 0.f : exp_float(top[r] - next);
      total[r] = total[r] * rescale[r] + _mm512_reduce_add_ps(sum);
      top[r] = next;
    }
    block_values(logits.data(), rescale.data(), count, d, values, first, acc.data());
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t t = 0; t < QUERIES && t0 + t < c; ++t) {
      const int64_t r = g * QUERIES + t;
      const float inverse = 1.f / total[r];
      scalar_t* o = out + (g * c + t0 + t) * d;
      for (int64_t ch = 0; ch < d; ++ch) o[ch] = static_cast<scalar_t>(acc[r * d + ch] * inverse);
    }
}

template <typename scalar_t>
void causal_attention_kernel(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, double scaling, at::Tensor& out) {
  const int64_t batch = query.size(0), query_heads = query.size(1), c = query.size(2), d = query.size(3);
  const int64_t heads = keys.size(1), length = keys.size(2), groups = query_heads / heads;
  const scalar_t *q = query.data_ptr<scalar_t>(), *k = keys.data_ptr<scalar_t>(), *v = values.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t key_blocks = (length + KEYS - 1) / KEYS, head_floats = key_blocks * KEYS * d;
  std::vector<float> keys_t(batch * heads * head_floats), values_f(batch * heads * head_floats);
  at::parallel_for(0, batch * heads * key_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bh = i / key_blocks;
      pack_block(k + bh * length * d, v + bh * length * d, length, d, i % key_blocks, keys_t.data() + bh * head_floats,
                 values_f.data() + bh * head_floats);
    }
  });
  const int64_t blocks = (c + QUERIES - 1) / QUERIES, tasks = batch * heads * blocks;
  const float scale = static_cast<float>(scaling);
  // task i: the heaviest first (the last query blocks see the most keys), taken one at a time by whichever thread is free
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t i = 0; i < tasks; ++i) {
    const int64_t block = blocks - 1 - i / (batch * heads), bh = i % (batch * heads);
    const int64_t offset = bh * groups * c * d;  // KV head bh's group of query heads
    attend_task(q + offset, o + offset, keys_t.data() + bh * head_floats, values_f.data() + bh * head_floats, groups, c, length, d,
                block * QUERIES, scale);
  }
}
#else
constexpr bool HAS_AVX512 = false;
#endif

}  // namespace

bool causal_attention_available() { return HAS_AVX512; }

at::Tensor causal_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, double scaling) {
  TORCH_CHECK(HAS_AVX512, "causal_attention: this CPU (or build) has no AVX-512");
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "causal_attention: CPU query [B, Hq, c, d], keys and values [B, H, L, d]");
  TORCH_CHECK(query.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type() &&
                  (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16),
              "causal_attention: query, keys and values all float32 or all bfloat16");
  TORCH_CHECK(query.size(0) == keys.size(0) && query.size(3) == keys.size(3) && keys.size(1) > 0 && query.size(1) % keys.size(1) == 0,
              "causal_attention: the batch and head size as the keys', the query heads a multiple of the KV heads");
  TORCH_CHECK(query.size(3) % 64 == 0, "causal_attention: a head size that is a multiple of 64");
  TORCH_CHECK(keys.size(2) >= query.size(2), "causal_attention: at least as many keys as queries (the queries are the last keys')");
  const at::Tensor q = query.contiguous(), k = keys.contiguous(), v = values.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.size(2) == 0 || q.size(0) == 0) return out;
#if defined(__AVX512F__)
  if (q.scalar_type() == at::kFloat) causal_attention_kernel<float>(q, k, v, scaling, out);
  else causal_attention_kernel<at::BFloat16>(q, k, v, scaling, out);
#endif
  return out;
}
