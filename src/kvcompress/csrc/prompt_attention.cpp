// A prompt's causal attention in float32 sums, blocked as a flash kernel is (no [q, L] matrix): the prefill's attention
// (read/sdpa.py's `prompt_attention` without a mask, and `chunk_attention`: a prompt's chunk after its held entries).
// F.scaled_dot_product_attention with the causal mask aligned to the last key is its reference.
//
//   causal_attention(query [B, Hq, c, d], keys, values: lists of pieces [B, H, L_i, d] side by side along L (a chunk's
//   held entries, then its own: no concatenated copy), scaling), L = Σ L_i ≥ c, Hq a multiple of H, all float32 or all
//   bfloat16, d a multiple of 64, any strides with the channels contiguous → out [B, Hq, c, d] in the query's dtype, laid
//   out token-major ([B, c, Hq, d] permuted: a prompt's rows [c, Hq·d] for the output product without a copy): query t
//   (of c) sits after the first L − c entries and sees keys 0 … L − c + t; query head h·G + g reads KV head h.
//
// torch's CPU flash kernel runs a 2000-token prompt of SmolLM2 (9 query heads over 3 KV heads of 64 channels) at ~144
// GFLOP/s on two Zen 5 cores, a quarter of their float32 peak: half of a prefill's time. Here a task is one KV head's QUERIES
// consecutive queries of every query head of its group: G vectors of 16 rows, one per query head, the queries held
// channel-major (qᵀ [d, G·16]) and scaled by scaling · log2(e), so that the logits are in base 2. It walks the keys KEYS
// at a time, up to what its last query sees:
//   1. logits Sᵀ [KEYS, G·16] = k · qᵀ over a block: eight keys against three row vectors in 24 registers, a key's channel
//      one broadcast and a channel's rows three loads;
//   2. each row vector's running max m and sum l updated down the block's keys (online softmax, float32, lane by lane:
//      no reduction across lanes), keys past a row's last weighed 0, the weights 2^(s − m) by a degree-5 polynomial
//      (relative error 2.3e-7) and VSCALEFPS, the output's rescale 2^(m_old − m_new) one vector per 16 rows;
//   3. O += P · V: four rows against the d channels (d / 16 registers a row, 64 at a time), a key's value row loaded once
//      for the four, each row's weight one broadcast from Pᵀ.
// The output is O / l. Every product and sum is float32 (bfloat16 inputs widened exactly; where the CPU has AVX512-BF16,
// bfloat16 logits by VDPBF16PS, two channels an instruction, each product exact in float32); the sums run in another
// order than torch's kernel, so the two agree to float32 rounding. Tasks are taken heaviest first, dynamically, by the threads.
// At 2000 tokens on one Zen 5 core: 220 GFLOP/s (the logits' max and sum reduced across lanes row by row, and exp by
// Cody-Waite's reduction: 194); on two, 10.8 ms in float32 and 9.2-9.5 in bfloat16 (torch's flash kernel: 31).
#include "kernels.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr bool HAS_AVX512 = true;
constexpr int64_t QUERIES = 16;   // queries of a task: one vector of rows per query head of the group
constexpr int64_t KEYS = 64;      // keys of a block
constexpr int64_t TILE_KEYS = 8;  // keys of a logits register tile
constexpr int64_t ROWS = 4;       // rows of a values register tile
constexpr float LOG2E = 1.44269504088896341f;

// What a task's queries and its head's keys are held as: bfloat16 where the CPU has AVX512-BF16's dots and the inputs are
// bfloat16 (their products exact in float32, two channels an instruction), else float32.
#if defined(__AVX512BF16__)
template <typename scalar_t>
using held_t = std::conditional_t<std::is_same_v<scalar_t, at::BFloat16>, at::BFloat16, float>;
#else
template <typename scalar_t>
using held_t = float;
#endif
// Channels side by side in a held query row vector: pairs for the bfloat16 dots.
template <typename key_t>
constexpr int64_t PAIR = std::is_same_v<key_t, float> ? 1 : 2;

// An input number as it is held: widened to float32, or kept bfloat16 for the dots.
template <typename key_t, typename scalar_t>
inline key_t held(scalar_t x) {
  if constexpr (std::is_same_v<key_t, float>) return to_float(x);
  else return x;
}

// Where one head's entries lie: the pieces of its keys and values along L (a prompt's chunk: its held entries, then its
// own), each with its first entry's address and its entries' stride (the channels contiguous).
template <typename scalar_t>
struct HeadEntries {
  std::vector<const scalar_t*> keys, values;
  std::vector<int64_t> key_stride, value_stride, end;  // end[p]: one past piece p's last entry
};

// Block `block` of a head's keys and values into float32 [padded, d], zero past the last key (a block's keys and values
// past it are read, and weighed by 0).
template <typename scalar_t, typename key_t>
void pack_block(const HeadEntries<scalar_t>& head, int64_t d, int64_t block, key_t* keys_out, float* values_out) {
  size_t piece = 0;
  for (int64_t j = 0; j < KEYS; ++j) {
    const int64_t l = block * KEYS + j;
    key_t* key = keys_out + l * d;
    float* value = values_out + l * d;
    while (piece < head.end.size() && l >= head.end[piece]) ++piece;
    if (piece == head.end.size()) {
      std::fill(key, key + d, key_t(0.f)), std::fill(value, value + d, 0.f);
      continue;
    }
    const int64_t at = l - (piece ? head.end[piece - 1] : 0);
    const scalar_t* k = head.keys[piece] + at * head.key_stride[piece];
    const scalar_t* v = head.values[piece] + at * head.value_stride[piece];
    for (int64_t c = 0; c < d; ++c) key[c] = held<key_t>(k[c]), value[c] = to_float(v[c]);
  }
}

// 2^y of sixteen lanes for finite y (0 below −150): y = n + f, |f| ≤ ½, 2^f by a degree-5 polynomial (relative error
// 2.3e-7 evaluated in float32), 2^n applied by VSCALEFPS.
inline __m512 exp2_16(__m512 y) {
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.327647129073739e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.675541892647743e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550713092088699e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022120237350464e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931469440460205e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_scalef_ps(p, n);
}

// logitsT[j, v·16 .. v·16+16) = keys[first + j] · rowsT[:, v·16 ..] for j < KEYS, v0 ≤ v < v0 + NV: rowsT [d, count] (the
// queries scaled).
template <int NV>
void tile_logits(const float* rows_t, int64_t count, int64_t d, const float* keys, int64_t first, int64_t v0, float* logits_t) {
  for (int64_t j0 = 0; j0 < KEYS; j0 += TILE_KEYS) {
    __m512 acc[TILE_KEYS][NV];
    for (int jj = 0; jj < TILE_KEYS; ++jj)
      for (int v = 0; v < NV; ++v) acc[jj][v] = _mm512_setzero_ps();
    const float* key = keys + (first + j0) * d;
    for (int64_t c = 0; c < d; ++c) {
      __m512 q[NV];
      for (int v = 0; v < NV; ++v) q[v] = _mm512_loadu_ps(rows_t + c * count + (v0 + v) * 16);
      for (int jj = 0; jj < TILE_KEYS; ++jj) {
        const __m512 k = _mm512_set1_ps(key[jj * d + c]);
        for (int v = 0; v < NV; ++v) acc[jj][v] = _mm512_fmadd_ps(k, q[v], acc[jj][v]);
      }
    }
    for (int jj = 0; jj < TILE_KEYS; ++jj)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(logits_t + (j0 + jj) * count + (v0 + v) * 16, acc[jj][v]);
  }
}

#if defined(__AVX512BF16__)
// The same over bfloat16 queries and keys, scaled once summed (`scale`: a query rounded to bfloat16 after scaling would
// lose its exactness): rowsT [d / 2, count, 2] (two channels of a row side by side), a key's two channels one 32-bit
// broadcast, VDPBF16PS adding both exact products to each row's float32 sum.
template <int NV>
void tile_logits(const at::BFloat16* rows_t, int64_t count, int64_t d, const at::BFloat16* keys, int64_t first, int64_t v0,
                 float scale, float* logits_t) {
  for (int64_t j0 = 0; j0 < KEYS; j0 += TILE_KEYS) {
    __m512 acc[TILE_KEYS][NV];
    for (int jj = 0; jj < TILE_KEYS; ++jj)
      for (int v = 0; v < NV; ++v) acc[jj][v] = _mm512_setzero_ps();
    const at::BFloat16* key = keys + (first + j0) * d;
    for (int64_t c = 0; c < d; c += 2) {
      __m512bh q[NV];
      for (int v = 0; v < NV; ++v) q[v] = (__m512bh)_mm512_loadu_si512(rows_t + (c * count + (v0 + v) * 32));
      for (int jj = 0; jj < TILE_KEYS; ++jj) {
        int32_t pair;
        std::memcpy(&pair, key + jj * d + c, sizeof(pair));
        const __m512bh k = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < NV; ++v) acc[jj][v] = _mm512_dpbf16_ps(acc[jj][v], k, q[v]);
      }
    }
    for (int jj = 0; jj < TILE_KEYS; ++jj)
      for (int v = 0; v < NV; ++v)
        _mm512_storeu_ps(logits_t + (j0 + jj) * count + (v0 + v) * 16, _mm512_mul_ps(acc[jj][v], _mm512_set1_ps(scale)));
  }
}
#endif

// logitsT [KEYS, count] of the block from `first`, three row vectors at a time (`scale...`: bfloat16's, none for float32).
template <typename key_t, typename... Scale>
void block_logits(const key_t* rows_t, int64_t count, int64_t d, const key_t* keys, int64_t first, float* logits_t, Scale... scale) {
  const int64_t vectors = count / 16;
  int64_t v0 = 0;
  for (; v0 + 3 <= vectors; v0 += 3) tile_logits<3>(rows_t, count, d, keys, first, v0, scale..., logits_t);
  if (vectors - v0 == 2) tile_logits<2>(rows_t, count, d, keys, first, v0, scale..., logits_t);
  if (vectors - v0 == 1) tile_logits<1>(rows_t, count, d, keys, first, v0, scale..., logits_t);
}

// out[r] = out[r] · rescale[r] + Σ_j weightsT[j, r] · values[first + j] for r < count, 64 channels at a time.
void block_values(const float* weights_t, const float* rescale, int64_t count, int64_t d, const float* values, int64_t first, float* out) {
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
          asm("" : "+v"(x[v]));  // loaded once into a register (the compiler would fold a load into every multiply-add)
        }
        for (int64_t r = 0; r < ROWS; ++r) {
          const __m512 p = _mm512_set1_ps(weights_t[j * count + r0 + r]);
          for (int64_t v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(p, x[v], acc[r][v]);
        }
      }
      for (int64_t r = 0; r < ROWS; ++r)
        for (int64_t v = 0; v < 4; ++v) _mm512_storeu_ps(out + (r0 + r) * d + c0 + 16 * v, acc[r][v]);
    }
}

// The block's logits of 16 rows (vector v) turned into weights in place, their running max and sum updated, the rescale of
// their outputs stored: keys past a row's last (lanes past `last`, one per query of the task) weigh 0.
void block_softmax(float* logits_t, int64_t count, int64_t v, int64_t first, __m512i last, bool masked, float* top, float* total,
                   float* rescale) {
  const __m512 old_top = _mm512_loadu_ps(top + v * 16);
  __m512 block_top = _mm512_set1_ps(NEG_INF);
  for (int64_t j = 0; j < KEYS; ++j) {
    const __mmask16 seen = masked ? _mm512_cmp_epi32_mask(_mm512_set1_epi32(first + j), last, _MM_CMPINT_LE) : 0xFFFF;
    block_top = _mm512_mask_max_ps(block_top, seen, block_top, _mm512_loadu_ps(logits_t + j * count + v * 16));
  }
  const __m512 next = _mm512_max_ps(old_top, block_top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < KEYS; ++j) {
    const __mmask16 seen = masked ? _mm512_cmp_epi32_mask(_mm512_set1_epi32(first + j), last, _MM_CMPINT_LE) : 0xFFFF;
    float* at = logits_t + j * count + v * 16;
    const __m512 p = _mm512_maskz_mov_ps(seen, exp2_16(_mm512_sub_ps(_mm512_loadu_ps(at), next)));
    _mm512_storeu_ps(at, p);
    sum = _mm512_add_ps(sum, p);
  }
  // the outputs' rescale, 0 where the old max was −inf (clamped: 2^−200 is 0 in float32, and −inf − m would make NaN)
  const __m512 scale = exp2_16(_mm512_max_ps(_mm512_sub_ps(old_top, next), _mm512_set1_ps(-200.f)));
  _mm512_storeu_ps(rescale + v * 16, scale);
  _mm512_storeu_ps(total + v * 16, _mm512_fmadd_ps(_mm512_loadu_ps(total + v * 16), scale, sum));
  _mm512_storeu_ps(top + v * 16, next);
}

// A group's query (or output) rows of one KV head: row t of query head g of the group at data + g · head + t · token.
template <typename T>
struct Rows {
  T* data;
  int64_t head, token;
  T* at(int64_t g, int64_t t) const { return data + g * head + t * token; }
};

// One task: queries t0 .. t0 + QUERIES (those below c; rows past c repeat the last query) of every query head of one KV
// head's group, over that head's keys and values as pack_block lays them out.
template <typename scalar_t, typename key_t>
void attend_task(const Rows<const scalar_t>& query, const Rows<scalar_t>& out, const key_t* keys, const float* values, int64_t groups,
                 int64_t c, int64_t length, int64_t d, int64_t t0, float scaling) {
  const int64_t count = groups * QUERIES, visible_before = length - c, pair = PAIR<key_t>;
  std::vector<key_t> rows_t(d * count);
  std::vector<float> acc(count * d, 0.f), logits_t(KEYS * count), rescale(count);
  std::vector<float> top(count, NEG_INF), total(count, 0.f);
  int32_t lasts[QUERIES];
  for (int64_t t = 0; t < QUERIES; ++t) lasts[t] = static_cast<int32_t>(visible_before + std::min(t0 + t, c - 1));
  const __m512i last = _mm512_loadu_si512(lasts);
  // float32 queries scaled first; bfloat16 ones held as they are (× 1, exact), their logits scaled once summed
  const float prescale = std::is_same_v<key_t, float> ? scaling * LOG2E : 1.f;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t t = 0; t < QUERIES; ++t) {
      const scalar_t* q = query.at(g, std::min(t0 + t, c - 1));
      for (int64_t ch = 0; ch < d; ++ch)
        rows_t[(ch / pair * count + g * QUERIES + t) * pair + ch % pair] = held<key_t>(to_float(q[ch]) * prescale);
    }
  const int64_t end = visible_before + std::min(t0 + QUERIES, c);
  for (int64_t first = 0; first < end; first += KEYS) {
    if constexpr (std::is_same_v<key_t, float>) block_logits(rows_t.data(), count, d, keys, first, logits_t.data());
    else block_logits(rows_t.data(), count, d, keys, first, logits_t.data(), scaling * LOG2E);
    const bool masked = first + KEYS - 1 > lasts[0];
    for (int64_t v = 0; v < groups; ++v)
      block_softmax(logits_t.data(), count, v, first, last, masked, top.data(), total.data(), rescale.data());
    block_values(logits_t.data(), rescale.data(), count, d, values, first, acc.data());
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t t = 0; t < QUERIES && t0 + t < c; ++t) {
      const int64_t r = g * QUERIES + t;
      const float inverse = 1.f / total[r];
      scalar_t* o = out.at(g, t0 + t);
      for (int64_t ch = 0; ch < d; ++ch) o[ch] = static_cast<scalar_t>(acc[r * d + ch] * inverse);
    }
}

// The channels of each of `tensors` (all [B, H, ·, d]) contiguous: each as it is where they are, else a contiguous copy.
std::vector<at::Tensor> channels_contiguous(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : tensors) out.push_back(t.stride(3) == 1 ? t : t.contiguous());
  return out;
}

template <typename scalar_t>
void causal_attention_kernel(const at::Tensor& query, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                             double scaling, const at::Tensor& out) {
  const int64_t batch = query.size(0), query_heads = query.size(1), c = query.size(2), d = query.size(3);
  const int64_t heads = keys[0].size(1), groups = query_heads / heads;
  std::vector<HeadEntries<scalar_t>> entries(batch * heads);
  for (int64_t bh = 0; bh < batch * heads; ++bh) {
    const int64_t b = bh / heads, h = bh % heads;
    int64_t length = 0;
    for (size_t p = 0; p < keys.size(); ++p) {
      entries[bh].keys.push_back(keys[p].data_ptr<scalar_t>() + b * keys[p].stride(0) + h * keys[p].stride(1));
      entries[bh].values.push_back(values[p].data_ptr<scalar_t>() + b * values[p].stride(0) + h * values[p].stride(1));
      entries[bh].key_stride.push_back(keys[p].stride(2)), entries[bh].value_stride.push_back(values[p].stride(2));
      entries[bh].end.push_back(length += keys[p].size(2));
    }
  }
  const int64_t length = entries[0].end.back();
  const int64_t key_blocks = (length + KEYS - 1) / KEYS, head_floats = key_blocks * KEYS * d;
  std::vector<held_t<scalar_t>> keys_h(batch * heads * head_floats);
  std::vector<float> values_f(batch * heads * head_floats);
  at::parallel_for(0, batch * heads * key_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bh = i / key_blocks;
      pack_block(entries[bh], d, i % key_blocks, keys_h.data() + bh * head_floats, values_f.data() + bh * head_floats);
    }
  });
  const int64_t blocks = (c + QUERIES - 1) / QUERIES, tasks = batch * heads * blocks;
  const float scale = static_cast<float>(scaling);
  // task i: the heaviest first (the last query blocks see the most keys), taken one at a time by whichever thread is free
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t i = 0; i < tasks; ++i) {
    const int64_t block = blocks - 1 - i / (batch * heads), bh = i % (batch * heads), b = bh / heads, first_head = bh % heads * groups;
    const Rows<const scalar_t> rows{query.data_ptr<scalar_t>() + b * query.stride(0) + first_head * query.stride(1), query.stride(1),
                                    query.stride(2)};
    const Rows<scalar_t> outs{out.data_ptr<scalar_t>() + b * out.stride(0) + first_head * out.stride(1), out.stride(1), out.stride(2)};
    attend_task(rows, outs, keys_h.data() + bh * head_floats, values_f.data() + bh * head_floats, groups, c, length, d, block * QUERIES,
                scale);
  }
}
#else
constexpr bool HAS_AVX512 = false;
#endif

}  // namespace

bool causal_attention_available() { return HAS_AVX512; }

at::Tensor causal_attention(const at::Tensor& query, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                            double scaling) {
  TORCH_CHECK(HAS_AVX512, "causal_attention: this CPU (or build) has no AVX-512");
  TORCH_CHECK(!keys.empty() && keys.size() == values.size(), "causal_attention: the keys and values as as many pieces, at least one");
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 4 && (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16),
              "causal_attention: a CPU query [B, Hq, c, d], float32 or bfloat16");
  int64_t length = 0;
  for (size_t p = 0; p < keys.size(); ++p) {
    TORCH_CHECK(keys[p].device().is_cpu() && keys[p].dim() == 4 && values[p].sizes() == keys[p].sizes(),
                "causal_attention: each piece of keys and values [B, H, L_i, d] on the CPU, the keys' as the values'");
    TORCH_CHECK(keys[p].scalar_type() == query.scalar_type() && values[p].scalar_type() == query.scalar_type(),
                "causal_attention: query, keys and values all float32 or all bfloat16");
    TORCH_CHECK(keys[p].size(0) == query.size(0) && keys[p].size(1) == keys[0].size(1) && keys[p].size(3) == query.size(3),
                "causal_attention: every piece with the query's batch and head size and the first piece's heads");
    length += keys[p].size(2);
  }
  TORCH_CHECK(keys[0].size(1) > 0 && query.size(1) % keys[0].size(1) == 0, "causal_attention: the query heads a multiple of the KV heads");
  TORCH_CHECK(query.size(3) % 64 == 0, "causal_attention: a head size that is a multiple of 64");
  TORCH_CHECK(length >= query.size(2), "causal_attention: at least as many keys as queries (the queries are the last keys')");
  TORCH_CHECK(length < (int64_t{1} << 30), "causal_attention: fewer than 2^30 keys (their positions are 32-bit lanes)");
  const at::Tensor q = query.stride(3) == 1 ? query : query.contiguous();
  // token-major [B, c, Hq, d] seen as [B, Hq, c, d]: a prompt's [c, Hq·d] rows for the output product, with no copy
  const at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).permute({0, 2, 1, 3});
  if (q.size(2) == 0 || q.size(0) == 0) return out;
#if defined(__AVX512F__)
  const std::vector<at::Tensor> k = channels_contiguous(keys), v = channels_contiguous(values);
  if (q.scalar_type() == at::kFloat) causal_attention_kernel<float>(q, k, v, scaling, out);
  else causal_attention_kernel<at::BFloat16>(q, k, v, scaling, out);
#endif
  return out;
}
