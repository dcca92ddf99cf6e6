// Paged decode attention on the CPU: one query per request row attends to the entries its slot tables
// name, read where they live in the slot pool (no gathered copy). The contract is read/paged.py's
// `paged_decode`; read/reference.py is its oracle.
//
// Per (row r, KV head h): the entries j < lengths[r, h] of the slot table tables[r][h, :] (slot 0: a hole,
// skipped), each with an optional log-weight weights[r][h, j]. The G = Hq / H query heads of the group
// share every key and value they load. Work is split into chunks of at most DECODE_CHUNK entries (flash-decoding; smaller
// where the read is short, each thread a contiguous run of them holding an equal share), each chunk an online softmax over blocks of BLOCK entries with float32 accumulators; chunks are merged by
// log-sum-exp. Out: the attention output [R, Hq, d] and the log partition function [R, Hq] (float32,
// -inf where a head has no entry).
//
// A decoding step's reads of every layer (`PagedStep`, kernels.h; read/paged.py's `compiled_step`) take the same path:
// each row's tables of every layer [layers, H, L] and the lengths [layers, R, H] are checked and laid out as views once a
// step, and each layer's read (the engine's compiled layer, decode_layer.cpp) takes its layer's views.
//
// Plain keys' logits are computed sixteen keys at a time where the CPU has AVX-512 or AVX2 (dots16); a bfloat16 query over
// bfloat16 keys, where it also has AVX512-BF16, takes them from the bfloat16 values with VDPBF16PS (dots16_bf16: each
// product exact in float32), with no conversion of the keys per query.
//
// KIVI-coded entries are read in place too: an entry id with the KIVI tier's bits (tier << shift | block · G + offset)
// names an entry of a block of G entries of one head (read/paged.py's `KiviBlocks`). Its key is z + c · s per
// channel (z, s the block's per-channel zero point and scale), so q · k = q · z + (q ⊙ s) · c: q · z and q ⊙ s are
// made once per block, and a coded key costs one dot product over its codes (unpacked in registers). Its value is z + c · s per
// channel group of the entry: Σ p · v is taken as Σ p · z plus Σ (p · s) · c, the codes multiplied as they are unpacked
// (accumulate_coded_values), or, where a value group is no multiple of 16 channels, each value decoded into a float32 row first.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <vector>

namespace {

constexpr int64_t BLOCK = 64;

struct Table {
  const int32_t* slots;   // entry j of head h at slots[h * head_stride + j * entry_stride]
  int64_t head_stride, entry_stride;
  const float* weights;   // nullptr: no log-weights
  int64_t weight_head_stride, weight_entry_stride;
};

// Where KIVI-coded entries live: one tier's arrays (read/paged.py's `KiviBlocks`); tier 0 = no coded entries. An
// entry id is tier << shift | place in the tier (the store's layout, given by the caller).
enum class Param { f16, bf16, f32 };

struct Kivi {
  int64_t shift = 0, mask = 0;
  int64_t tier = 0, bits = 0, group = 0, channel_group = 0, blocks = 0, packed = 0, value_groups = 0, key_packed = 0;
  const uint8_t* key_codes = nullptr;    // [blocks, d, key_packed]: each channel's codes across the block's entries
  const uint8_t* value_codes = nullptr;  // [blocks, group, packed]
  const void* key_zero = nullptr;        // [blocks, d]
  const void* key_scale = nullptr;       // [blocks, d]
  const void* value_zero = nullptr;      // [blocks, group, value_groups]
  const void* value_scale = nullptr;     // [blocks, group, value_groups]
  Param param = Param::f16;
  int64_t group_shift = -1;  // log2(group) where the group is a power of two: blocks by a shift, not a division
  int64_t block_of(int64_t e) const { return group_shift >= 0 ? e >> group_shift : e / group; }
};

// n zero points or scales from base[offset...] (16-bit or 32-bit floats) → float32.
inline void params(const void* base, int64_t offset, int64_t n, Param type, float* out) {
  if (type == Param::f16) {
    const at::Half* p = static_cast<const at::Half*>(base) + offset;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load8(p + i));  // eight at a time (one scalar conversion each is slower)
#endif
    for (; i < n; ++i) out[i] = to_float(p[i]);
  } else if (type == Param::bf16) {
    const at::BFloat16* p = static_cast<const at::BFloat16*>(base) + offset;
    for (int64_t i = 0; i < n; ++i) out[i] = to_float(p[i]);
  } else {
    std::memcpy(out, static_cast<const float*>(base) + offset, n * sizeof(float));
  }
}

// d codes of BITS bits (packed 8 / BITS to a byte, the first in the lowest bits) → float32 codes [d]. Sixteen
// channels at a time come from one 32-bit (2 bits) or 64-bit (4 bits) word, shifted and masked in registers, and
// leave as one 64-byte store (smaller stores read back as one wide load would stall the dot product that follows).
template <int BITS>
inline void unpack_codes(const uint8_t* packed, float* codes, int64_t d) {
  using word_t = std::conditional_t<BITS == 2, uint32_t, uint64_t>;
  constexpr uint32_t MASK = (1u << BITS) - 1;
  const int64_t body = d - d % 16;
  for (int64_t c0 = 0; c0 < body; c0 += 16) {
    word_t word;
    std::memcpy(&word, packed + c0 * BITS / 8, sizeof(word));
#pragma omp simd
    for (int j = 0; j < 16; ++j) codes[c0 + j] = static_cast<float>(static_cast<uint32_t>(word >> (j * BITS)) & MASK);
  }
  for (int64_t c = body; c < d; ++c) codes[c] = static_cast<float>((packed[c * BITS / 8] >> ((c % (8 / BITS)) * BITS)) & MASK);
}

inline void unpack(const Kivi& kivi, const uint8_t* packed, float* codes, int64_t d) {
  if (kivi.bits == 2) unpack_codes<2>(packed, codes, d);
  else unpack_codes<4>(packed, codes, d);
}

// acc[g · d + c] += Σ_k probs[g · BLOCK + index[k]] · v_k[c] for `count` coded entries (entries[k]: the entry's place in
// its tier) and the G queries of a group, without decoding the value rows: v_k[c] = z_kj + c_kc · s_kj (j = c's value
// group), so the sum is Σ_k p_k z_kj, added once per value group, plus Σ_k (p_k s_kj) · c_kc, each code multiplied as it is
// unpacked in registers, sixteen channels at a time and four queries' sums held in registers (the channel group a multiple
// of 16). `work` holds count · value_groups · 7 floats. It spares decoding each row into a buffer and adding 64-channel
// tiles whose sums spill out of AVX2's sixteen registers (with the runs of logits in attend_chunk, a 2-bit read of an 8k
// layer on a Zen 3 took 0.72× its time: docs/results.md).
template <int BITS>
void accumulate_coded_values(const Kivi& kivi, float* acc, const float* probs, int64_t groups, const int64_t* entries, const int64_t* index,
                             int64_t count, int64_t d, float* work) {
  constexpr int64_t LANES = 16;
  const int64_t vg = kivi.value_groups, size = count * vg;
  float* zero = work;               // [vg, count]: each value group's zero points of the entries, and scales
  float* scale = work + size;       // [vg, count]
  float* weight = work + 2 * size;  // [4, vg, count]: p_k s_kj of four queries
  float* loaded = work + 6 * size;  // [count, vg]: the parameters as stored, of a run of entries that follow each other
  for (int64_t k0 = 0, run = 1; k0 < count; k0 += run, run = 1) {
    while (k0 + run < count && entries[k0 + run] == entries[k0] + run) ++run;
    for (int64_t part = 0; part < 2; ++part) {
      params(part ? kivi.value_scale : kivi.value_zero, entries[k0] * vg, run * vg, kivi.param, loaded);
      float* to = part ? scale : zero;
      for (int64_t k = 0; k < run; ++k)
        for (int64_t j = 0; j < vg; ++j) to[j * count + k0 + k] = loaded[k * vg + j];
    }
  }
  for (int64_t g0 = 0; g0 < groups; g0 += 4) {
    const int64_t n = std::min<int64_t>(4, groups - g0);
    for (int64_t g = 0; g < n; ++g) {
      float p[BLOCK];
      for (int64_t k = 0; k < count; ++k) p[k] = probs[(g0 + g) * BLOCK + index[k]];
      float* out = acc + (g0 + g) * d;
      for (int64_t j = 0; j < vg; ++j) {
        float shift = 0.f;  // Σ_k p_k z_kj
#pragma omp simd reduction(+ : shift)
        for (int64_t k = 0; k < count; ++k) shift += p[k] * zero[j * count + k];
#pragma omp simd
        for (int64_t k = 0; k < count; ++k) weight[(g * vg + j) * count + k] = p[k] * scale[j * count + k];
#pragma omp simd
        for (int64_t c = 0; c < kivi.channel_group; ++c) out[j * kivi.channel_group + c] += shift;
      }
    }
    for (int64_t c0 = 0; c0 < d; c0 += LANES) {
      const int64_t j = c0 / kivi.channel_group;
      float sums[4][LANES] = {};
      for (int64_t k = 0; k < count; ++k) {
        float codes[LANES];
        unpack_codes<BITS>(kivi.value_codes + entries[k] * kivi.packed + c0 * BITS / 8, codes, LANES);
        for (int64_t g = 0; g < n; ++g) {
          const float w = weight[(g * vg + j) * count + k];
#pragma omp simd
          for (int64_t c = 0; c < LANES; ++c) sums[g][c] += w * codes[c];
        }
      }
      for (int64_t g = 0; g < n; ++g) {
        float* out = acc + (g0 + g) * d + c0;
#pragma omp simd
        for (int64_t c = 0; c < LANES; ++c) out[c] += sums[g][c];
      }
    }
  }
}

// The value of coded entry e, decoded into `row` [d]: z + c · s per channel group.
inline void decode_value(const Kivi& kivi, int64_t e, float* row, int64_t d) {
  float zero[64], scale[64];  // value groups: d / channel group ≤ 64 for any head this reads (checked at entry)
  unpack(kivi, kivi.value_codes + e * kivi.packed, row, d);
  params(kivi.value_zero, e * kivi.value_groups, kivi.value_groups, kivi.param, zero);
  params(kivi.value_scale, e * kivi.value_groups, kivi.value_groups, kivi.param, scale);
  for (int64_t j = 0; j < kivi.value_groups; ++j) {
    float* part = row + j * kivi.channel_group;
#pragma omp simd
    for (int64_t c = 0; c < kivi.channel_group; ++c) part[c] = zero[j] + part[c] * scale[j];
  }
}

template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t d) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < d * static_cast<int64_t>(sizeof(scalar_t)); offset += 64) __builtin_prefetch(bytes + offset);
}

constexpr int64_t AHEAD = 16;  // entries
constexpr int64_t TASKS_PER_THREAD = 4;  // chunks a thread at least, where the read is short (DecodeTasks)

// A chunk's plain entries' key and value rows prefetched AHEAD entries before they are read: slots lie anywhere in the
// pool, so the hardware's own prefetch cannot guess the next row, and each row's wait would otherwise be a DRAM latency
// (on a Zen 3, a layer's read of 8 rows x 3 heads x 250 entries at random slots, caches flushed: 1.16 ms without, 0.69
// with; 8, 16, 32 or 48 entries ahead alike within the noise).
template <typename scalar_t>
struct RowsAhead {
  const Table& table;
  int64_t head, num_slots, d, end, next;
  const scalar_t *keys, *values;
  void upto(int64_t entry) {  // prefetch every entry before `entry + AHEAD` not yet prefetched
    const int64_t last = std::min(end, entry + AHEAD);
    for (; next < last; ++next) {
      const int64_t id = table.slots[head * table.head_stride + next * table.entry_stride];
      if (id <= 0 || id >= num_slots) continue;  // a hole or a coded entry
      prefetch_row(keys + id * d, d);
      prefetch_row(values + id * d, d);
    }
  }
};

// logits[g · BLOCK] = q_g · k + bias for the G queries of a group: 16 channels of k at a time for up to four
// queries, each with its own accumulators (no dependency chain across queries or channels).
template <typename scalar_t>
inline void group_dots(const float* q, int64_t groups, const scalar_t* k, int64_t d, float bias, float* logits) {
  constexpr int64_t LANES = 16;
  const int64_t body = d - d % LANES;
  for (int64_t g0 = 0; g0 < groups; g0 += 4) {
    const int64_t n = std::min<int64_t>(4, groups - g0);
    float acc[4][LANES] = {};
    for (int64_t c = 0; c < body; c += LANES) {
      for (int64_t g = 0; g < n; ++g) {  // the row's 16 numbers converted in registers (no buffer: no store-to-load stall)
        const float* qg = q + (g0 + g) * d + c;
#pragma omp simd
        for (int64_t j = 0; j < LANES; ++j) acc[g][j] += qg[j] * to_float(k[c + j]);
      }
    }
    for (int64_t g = 0; g < n; ++g) {
      float sum = bias;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < LANES; ++j) sum += acc[g][j];
      for (int64_t c = body; c < d; ++c) sum += q[(g0 + g) * d + c] * to_float(k[c]);
      logits[(g0 + g) * BLOCK] = sum;
    }
  }
}

#if defined(__AVX512F__)
constexpr bool WIDE_DOTS = true;  // sixteen keys' logits at once, summed across lanes together (below)

template <typename scalar_t>
inline __m512 load16(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {  // bfloat16 is float32's top half
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// The horizontal sums of sixteen vectors as one vector (lane e: the sum of v[e]): two rounds of pairwise sums inside
// 128-bit lanes, then one across them, 45 instructions where sixteen separate reductions take about 130.
inline __m512 sums16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // lane q: v[2i]'s two pair sums, then v[2i+1]'s
    pairs[i] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0x88), _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0xDD));
  for (int j = 0; j < 4; ++j)  // lane q: the 128-bit lane q's sum of v[4j], …, v[4j+3]
    quads[j] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], 0x88),
                             _mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], 0xDD));
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44), _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44), _mm512_shuffle_f32x4(quads[2], quads[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}

// Sixteen keys (rows; a zero row where there is none) against a GQA group's queries: logits[g * BLOCK + e] =
// q_g · k_e + bias[e]. Sixteen independent sums per query instead of one reduction chain per key; d a multiple of 16.
template <typename scalar_t>
inline void dots16(const float* q, int64_t groups, const scalar_t* const* rows, int64_t d, const float* bias, float* logits) {
  const __m512 offset = _mm512_loadu_ps(bias);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[16];
    for (int e = 0; e < 16; ++e) acc[e] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
      const __m512 qc = _mm512_loadu_ps(q + g * d + c);
      for (int e = 0; e < 16; ++e) acc[e] = _mm512_fmadd_ps(qc, load16(rows[e] + c), acc[e]);
    }
    _mm512_storeu_ps(logits + g * BLOCK, _mm512_add_ps(sums16(acc), offset));
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool WIDE_DOTS = true;  // on AVX2: the sixteen keys as two passes of eight, summed across lanes together

// The horizontal sums of eight vectors as one vector (lane e: the sum of v[e]): three rounds of pairwise sums.
inline __m256 sums8(const __m256* v) {
  const __m256 quads = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // v0..v3, per 128-bit half
  const __m256 others = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(quads, others, 0x20), _mm256_permute2f128_ps(quads, others, 0x31));
}

// dots16 (below, for AVX-512) with eight-lane registers: each half of the sixteen keys in its own pass, eight independent
// sums per query; d a multiple of 16.
template <typename scalar_t>
inline void dots16(const float* q, int64_t groups, const scalar_t* const* rows, int64_t d, const float* bias, float* logits) {
  for (int64_t half = 0; half < 16; half += 8) {
    const __m256 offset = _mm256_loadu_ps(bias + half);
    for (int64_t g = 0; g < groups; ++g) {
      __m256 acc[8];
      for (int e = 0; e < 8; ++e) acc[e] = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 qc = _mm256_loadu_ps(q + g * d + c);
        for (int e = 0; e < 8; ++e) acc[e] = _mm256_fmadd_ps(qc, load8(rows[half + e] + c), acc[e]);
      }
      _mm256_storeu_ps(logits + g * BLOCK + half, _mm256_add_ps(sums8(acc), offset));
    }
  }
}
#else
constexpr bool WIDE_DOTS = false;

template <typename scalar_t>
inline void dots16(const float*, int64_t, const scalar_t* const*, int64_t, const float*, float*) {}
#endif

#if defined(__AVX512BF16__)
constexpr bool BF16_DOTS = true;  // bfloat16 queries against bfloat16 keys with the CPU's bfloat16 dot products (below)

// dots16 for a bfloat16 query (unscaled, as the model made it) and bfloat16 keys: logits[g * BLOCK + e] =
// scaling · (q_g · k_e) + bias[e], with VDPBF16PS (32 channels a step, each product exact in float32, summed in float32)
// instead of converting every key to float32 once per query; d a multiple of 32.
inline void dots16_bf16(const at::BFloat16* q, float scaling, int64_t groups, const at::BFloat16* const* rows, int64_t d,
                        const float* bias, float* logits) {
  const __m512 offset = _mm512_loadu_ps(bias), scale = _mm512_set1_ps(scaling);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[16];
    for (int e = 0; e < 16; ++e) acc[e] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 32) {
      const __m512bh qc = (__m512bh)_mm512_loadu_si512(q + g * d + c);
      for (int e = 0; e < 16; ++e) acc[e] = _mm512_dpbf16_ps(acc[e], qc, (__m512bh)_mm512_loadu_si512(rows[e] + c));
    }
    _mm512_storeu_ps(logits + g * BLOCK, _mm512_fmadd_ps(sums16(acc), scale, offset));
  }
}
#else
constexpr bool BF16_DOTS = false;

inline void dots16_bf16(const at::BFloat16*, float, int64_t, const at::BFloat16* const*, int64_t, const float*, float*) {}
#endif

#if defined(__AVX512F__)
// accumulate_values for a group of G queries (G ≤ 4), d a multiple of 64: each value row's 64 channels of a tile widened to
// float32 once, in four registers, for all G queries (the generic loop below widens it once per query), and the G × 4 sums
// held in registers across the block's rows.
template <int64_t G, typename row_t>
inline void accumulate_values_fixed(float* acc, const float* probs, const row_t* const* rows, const int64_t* index, int64_t count,
                                    int64_t d) {
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    __m512 sums[G][4];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = 0; t < 4; ++t) sums[g][t] = _mm512_loadu_ps(acc + g * d + c0 + 16 * t);
    for (int64_t k = 0; k < count; ++k) {
      const row_t* v = rows[k] + c0;
      __m512 row[4];
      for (int64_t t = 0; t < 4; ++t) row[t] = load16(v + 16 * t);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(probs[g * BLOCK + index[k]]);
        for (int64_t t = 0; t < 4; ++t) sums[g][t] = _mm512_fmadd_ps(p, row[t], sums[g][t]);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = 0; t < 4; ++t) _mm512_storeu_ps(acc + g * d + c0 + 16 * t, sums[g][t]);
  }
}
#endif

// acc[g · d + c] += Σ_k probs[g · BLOCK + index[k]] · rows[k][c] for the G queries of a group, over `count` value rows
// (d = 64 · tiles channels): per tile of 64 channels and four queries, the sums stay in registers while every row of
// the block is added (one load and store of acc per block, not per entry).
template <typename row_t>
inline void accumulate_values(float* acc, const float* probs, int64_t groups, const row_t* const* rows, const int64_t* index,
                              int64_t count, int64_t d) {
#if defined(__AVX512F__)
  switch (groups) {  // the usual GQA groups, each with its sums in registers
    case 1: return accumulate_values_fixed<1>(acc, probs, rows, index, count, d);
    case 2: return accumulate_values_fixed<2>(acc, probs, rows, index, count, d);
    case 3: return accumulate_values_fixed<3>(acc, probs, rows, index, count, d);
    case 4: return accumulate_values_fixed<4>(acc, probs, rows, index, count, d);
    default: break;
  }
#endif
  constexpr int64_t TILE = 64;
  for (int64_t c0 = 0; c0 < d; c0 += TILE) {
    for (int64_t g0 = 0; g0 < groups; g0 += 4) {
      const int64_t n = std::min<int64_t>(4, groups - g0);
      float sums[4][TILE];
      for (int64_t g = 0; g < n; ++g) std::memcpy(sums[g], acc + (g0 + g) * d + c0, sizeof(sums[g]));
      for (int64_t k = 0; k < count; ++k) {
        const row_t* v = rows[k] + c0;
        for (int64_t g = 0; g < n; ++g) {
          const float p = probs[(g0 + g) * BLOCK + index[k]];
#pragma omp simd
          for (int64_t j = 0; j < TILE; ++j) sums[g][j] += p * to_float(v[j]);
        }
      }
      for (int64_t g = 0; g < n; ++g) std::memcpy(acc + (g0 + g) * d + c0, sums[g], sizeof(sums[g]));
    }
  }
}

// dots[g · G + e] = Σ_c scaled[g · d + c] · code(e, c) for every entry e of a KIVI block and the G queries of a group:
// one pass over the channels, each channel's codes of the block's entries unpacked at once (the keys' codes are laid
// out channel by channel), the sums of four queries in registers; no horizontal sum per entry.
template <int64_t G>
void block_dots_fixed(const Kivi& kivi, const uint8_t* codes, const float* scaled, int64_t groups, int64_t d, float* dots) {
  float unpacked[G];
  for (int64_t g0 = 0; g0 < groups; g0 += 4) {
    const int64_t n = std::min<int64_t>(4, groups - g0);
    float sums[4][G] = {};
    for (int64_t c = 0; c < d; ++c) {
      unpack(kivi, codes + c * kivi.key_packed, unpacked, G);
      for (int64_t g = 0; g < n; ++g) {
        const float s = scaled[(g0 + g) * d + c];
#pragma omp simd
        for (int64_t e = 0; e < G; ++e) sums[g][e] += s * unpacked[e];
      }
    }
    for (int64_t g = 0; g < n; ++g) std::memcpy(dots + (g0 + g) * G, sums[g], sizeof(sums[g]));
  }
}

void block_dots(const Kivi& kivi, int64_t block, const float* scaled, int64_t groups, int64_t d, float* dots, float* unpacked) {
  const uint8_t* codes = kivi.key_codes + block * d * kivi.key_packed;
  if (kivi.group == 32) return block_dots_fixed<32>(kivi, codes, scaled, groups, d, dots);
  const int64_t size = kivi.group;
  std::fill(dots, dots + groups * size, 0.f);
  for (int64_t c = 0; c < d; ++c) {
    unpack(kivi, codes + c * kivi.key_packed, unpacked, size);
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scaled[g * d + c];
      float* out = dots + g * size;
#pragma omp simd
      for (int64_t e = 0; e < size; ++e) out[e] += s * unpacked[e];
    }
  }
}

// The entries of one block of a head, sorted out: kind 0 = a hole (skipped), 1 = a plain slot, 2 = a KIVI-coded
// entry; where = the slot, or the entry's place in its tier.
enum Kind : uint8_t { HOLE = 0, PLAIN = 1, CODED = 2 };

inline Kind classify(int64_t id, int64_t num_slots, const Kivi& kivi, int64_t& where, std::atomic<bool>& out_of_range) {
  where = 0;
  if (id == 0) return HOLE;
  const int64_t tier = id >> kivi.shift;
  if (tier == 0 && id < num_slots) {
    where = id;
    return PLAIN;
  }
  const int64_t e = id & kivi.mask;
  if (tier != 0 && tier == kivi.tier && kivi.block_of(e) > 0 && kivi.block_of(e) < kivi.blocks) {  // the block once the tier matches (no tier: group 0)
    where = e;
    return CODED;
  }
  out_of_range = true;
  return HOLE;
}

// One chunk [begin, end) of one head: the unnormalised output acc [G, d], its running max m [G] and sum l [G]; where
// `scores` is given ([G, stride] of this head's queries), each entry's logit (-inf on a hole) at its column.
template <typename scalar_t>
void attend_chunk(const float* q, const at::BFloat16* q_bf16, float scaling, int64_t groups, int64_t d, const scalar_t* keys,
                  const scalar_t* values, int64_t num_slots, const Kivi& kivi, const Table& table, int64_t head, int64_t begin,
                  int64_t end, float* acc, float* m, float* l, float* scores, int64_t scores_stride, std::atomic<bool>& out_of_range) {
  std::vector<float> logits(groups * BLOCK);
  const bool wide = WIDE_DOTS && d % 16 == 0;  // plain keys' logits sixteen at a time
  const std::vector<scalar_t> zeros(wide ? d : 0, scalar_t(0));  // the row a hole or coded entry reads among plain keys
  std::vector<float> scaled(kivi.tier ? groups * d : 0), offset(kivi.tier ? groups : 0), row(kivi.tier ? d : 0), zero(kivi.tier ? d : 0);
  std::vector<float> dots(kivi.tier ? groups * kivi.group : 0), unpacked(kivi.tier ? kivi.group : 0);  // a KIVI block's q · codes
  const bool coded_in_registers = kivi.tier && kivi.channel_group % 16 == 0;  // values by accumulate_coded_values
  std::vector<float> coded_work(coded_in_registers ? BLOCK * kivi.value_groups * 7 : 0);
  std::vector<float> decoded(kivi.tier && !coded_in_registers ? BLOCK * d : 0);  // a block's coded values, decoded
  int64_t where[BLOCK];
  Kind kind[BLOCK];
  int64_t coded_block = -1;  // the block whose q ⊙ s, q · z and (q ⊙ s) · codes are in `scaled`, `offset` and `dots`
  for (int64_t g = 0; g < groups; ++g) {
    m[g] = NEG_INF;
    l[g] = 0.f;
  }
  std::fill(acc, acc + groups * d, 0.f);
  RowsAhead<scalar_t> ahead{table, head, num_slots, d, end, begin, keys, values};
  for (int64_t start = begin; start < end; start += BLOCK) {
    const int64_t n = std::min(BLOCK, end - start);
    for (int64_t i = 0; i < n; ++i)
      kind[i] = classify(table.slots[head * table.head_stride + (start + i) * table.entry_stride], num_slots, kivi, where[i], out_of_range);
    const auto bias_of = [&](int64_t i) {  // entry i's log-weight (0 without a weight table)
      return table.weights ? table.weights[head * table.weight_head_stride + (start + i) * table.weight_entry_stride] : 0.f;
    };
    if (wide) {  // the plain keys sixteen at a time (holes and coded entries read the zero row, overwritten below)
      for (int64_t i0 = 0; i0 < n; i0 += 16) {
        ahead.upto(start + i0 + 16);
        const scalar_t* rows[16];
        float bias[16];
        bool any = false;
        for (int64_t e = 0; e < 16; ++e) {
          const int64_t i = i0 + e;
          const bool plain = i < n && kind[i] == PLAIN;
          any |= plain;
          rows[e] = plain ? keys + where[i] * d : zeros.data();
          bias[e] = plain ? bias_of(i) : 0.f;
        }
        if (!any) continue;
        if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
          if (q_bf16 != nullptr) {
            dots16_bf16(q_bf16, scaling, groups, rows, d, bias, logits.data() + i0);
            continue;
          }
        }
        dots16(q, groups, rows, d, bias, logits.data() + i0);
      }
    }
    for (int64_t i = 0; i < n;) {  // a key is loaded once for the group's queries
      if (kind[i] == CODED) {  // a run of entries that follow each other in one block: their logits at once
        const int64_t block = kivi.block_of(where[i]), entry = where[i] - block * kivi.group;
        int64_t run = 1;
        while (i + run < n && kind[i + run] == CODED && where[i + run] == where[i] + run && entry + run < kivi.group) ++run;
        if (!wide) ahead.upto(start + i + run);
        if (block != coded_block) {  // q · z, q ⊙ s and then (q ⊙ s) · codes of every entry of this block
          coded_block = block;
          params(kivi.key_zero, block * d, d, kivi.param, zero.data());
          params(kivi.key_scale, block * d, d, kivi.param, row.data());
          for (int64_t g = 0; g < groups; ++g) {
            offset[g] = dot(q + g * d, zero.data(), d);
#pragma omp simd
            for (int64_t c = 0; c < d; ++c) scaled[g * d + c] = q[g * d + c] * row[c];
          }
          block_dots(kivi, block, scaled.data(), groups, d, dots.data(), unpacked.data());
        }
        for (int64_t g = 0; g < groups; ++g) {
          float* out = logits.data() + g * BLOCK + i;
          const float* from = dots.data() + g * kivi.group + entry;
#pragma omp simd
          for (int64_t k = 0; k < run; ++k) out[k] = from[k] + offset[g];
          if (table.weights)
            for (int64_t k = 0; k < run; ++k) out[k] += bias_of(i + k);
        }
        i += run;
        continue;
      }
      if (!wide) ahead.upto(start + i + 1);
      if (kind[i] == PLAIN) {
        if (!wide) group_dots(q, groups, keys + where[i] * d, d, bias_of(i), logits.data() + i);
      } else {
        for (int64_t g = 0; g < groups; ++g) logits[g * BLOCK + i] = NEG_INF;
      }
      ++i;
    }
    if (scores)
      for (int64_t g = 0; g < groups; ++g) std::copy(logits.data() + g * BLOCK, logits.data() + g * BLOCK + n, scores + g * scores_stride + start);
    for (int64_t g = 0; g < groups; ++g) {
      float* probs = logits.data() + g * BLOCK;
      float peak = NEG_INF;
#pragma omp simd reduction(max : peak)
      for (int64_t i = 0; i < n; ++i) peak = probs[i] > peak ? probs[i] : peak;  // (a form the compiler vectorizes)
      if (peak == NEG_INF) {  // nothing seen in this block
        std::fill(probs, probs + n, 0.f);
        continue;
      }
      const float top = std::max(m[g], peak);
      const float rescale = m[g] == NEG_INF ? 0.f : std::exp(m[g] - top);
      float* out = acc + g * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) out[c] *= rescale;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) probs[i] = exp_float(probs[i] - top);  // holes and padding: 0
      std::fill(probs + n, probs + BLOCK, 0.f);
      // the sum in registers over the whole block, in one order whatever n is: a read whose holes pad a head (a selection
      // of every entry) sums exactly as the plain read (a sum into l[g] itself waited on a store each entry)
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < BLOCK; ++i) total += probs[i];
      l[g] = l[g] * rescale + total;
      m[g] = top;
    }
    if (d % 64 == 0) {  // the values in register tiles: plain rows where they live, coded ones on their codes (or decoded first)
      const scalar_t* plain_rows[BLOCK];
      const float* coded_rows[BLOCK];
      int64_t plain_index[BLOCK], coded_index[BLOCK], coded_entries[BLOCK], plain = 0, coded = 0;
      for (int64_t i = 0; i < n; ++i) {
        if (kind[i] == PLAIN) {
          plain_rows[plain] = values + where[i] * d;
          plain_index[plain++] = i;
        } else if (kind[i] == CODED) {
          if (!coded_in_registers) {
            decode_value(kivi, where[i], decoded.data() + coded * d, d);
            coded_rows[coded] = decoded.data() + coded * d;
          }
          coded_entries[coded] = where[i];
          coded_index[coded++] = i;
        }
      }
      accumulate_values(acc, logits.data(), groups, plain_rows, plain_index, plain, d);
      if (coded && coded_in_registers && kivi.bits == 2)
        accumulate_coded_values<2>(kivi, acc, logits.data(), groups, coded_entries, coded_index, coded, d, coded_work.data());
      else if (coded && coded_in_registers)
        accumulate_coded_values<4>(kivi, acc, logits.data(), groups, coded_entries, coded_index, coded, d, coded_work.data());
      else if (coded)
        accumulate_values(acc, logits.data(), groups, coded_rows, coded_index, coded, d);
      continue;
    }
    for (int64_t i = 0; i < n; ++i) {  // a value is loaded (or decoded) once for the group's queries
      if (kind[i] == HOLE) continue;
      if (kind[i] == CODED) decode_value(kivi, where[i], row.data(), d);
      for (int64_t g = 0; g < groups; ++g) {
        const float p = logits[g * BLOCK + i];
        if (kind[i] == PLAIN) axpy(acc + g * d, p, values + where[i] * d, d);
        else axpy(acc + g * d, p, row.data(), d);
      }
    }
  }
}

template <typename scalar_t>
void run(const at::Tensor& query, const at::Tensor& query_bf16, float scaling, const at::Tensor& keys, const at::Tensor& values,
         const Kivi& kivi, const std::vector<Table>& tables, const int64_t* length, int64_t heads, at::Tensor& out, at::Tensor& lse,
         at::Tensor& scores) {
  const int64_t rows = query.size(0), hq = query.size(1), d = query.size(2);
  const int64_t groups = hq / heads;
  const int64_t num_slots = keys.size(0);
  const float* q = query.data_ptr<float>();
  const at::BFloat16* q_bf16 = query_bf16.defined() ? query_bf16.data_ptr<at::BFloat16>() : nullptr;
  const scalar_t* k = keys.data_ptr<scalar_t>();
  const scalar_t* v = values.data_ptr<scalar_t>();
  const DecodeTasks tasks(length, rows * heads, TASKS_PER_THREAD);
  std::vector<float> acc(tasks.count() * groups * d), m(tasks.count() * groups), l(tasks.count() * groups);
  std::atomic<bool> out_of_range{false};
  float* score = scores.numel() ? scores.data_ptr<float>() : nullptr;
  const int64_t score_stride = scores.numel() ? scores.size(2) : 0;
  float* o = out.data_ptr<float>();
  float* s = lse.data_ptr<float>();
  const auto merge = [&](int64_t rh) {  // head (r, h)'s chunks merged by log-sum-exp into its output and lse
    const int64_t r = rh / heads, h = rh % heads;
    for (int64_t g = 0; g < groups; ++g) {
      float* dst = o + (r * hq + h * groups + g) * d;
      std::fill(dst, dst + d, 0.f);
      const auto [top, total] = merge_chunks(tasks, rh, m.data(), l.data(), groups, g, [&](int64_t t, float factor) {
        axpy(dst, factor, acc.data() + (t * groups + g) * d, d);
      });
      s[r * hq + h * groups + g] = top;
      if (top == NEG_INF) continue;  // the head holds nothing: output 0, lse -inf
      for (int64_t c = 0; c < d; ++c) dst[c] /= total;
      s[r * hq + h * groups + g] = top + std::log(total);
    }
  };
  tasks.for_each([&](int64_t t) {
    const int64_t rh = tasks.owner[t], r = rh / heads, h = rh % heads;
    const int64_t offset = (r * hq + h * groups) * d;
    attend_chunk<scalar_t>(q + offset, q_bf16 ? q_bf16 + offset : nullptr, scaling, groups, d, k, v, num_slots, kivi, tables[r], h,
                           tasks.begin(t), tasks.end(t), acc.data() + t * groups * d, m.data() + t * groups, l.data() + t * groups,
                           score ? score + (r * hq + h * groups) * score_stride : nullptr, score_stride, out_of_range);
    if (tasks.chunks(rh) == 1) merge(rh);  // its only chunk: merged here, without a second parallel region
  });
  TORCH_CHECK(!out_of_range, "paged_decode: a slot table names a slot outside the pool, or a coded entry of a tier it was not given");
  if (tasks.count() > rows * heads) {  // heads of several chunks, merged once every chunk is done
    at::parallel_for(0, rows * heads, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t rh = lo; rh < hi; ++rh)
        if (tasks.chunks(rh) > 1) merge(rh);
    });
  }
}

Param param_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return Param::f16;
    case at::kBFloat16: return Param::bf16;
    case at::kFloat: return Param::f32;
    default: TORCH_CHECK(false, "KIVI's zero points and scales: float16, bfloat16 or float32");
  }
  return Param::f32;
}

// The KIVI tier's description, checked: the ids' tier shift, spec (tier, bits, group, channel group) and its six arrays.
Kivi kivi_tier(int64_t tier_shift, const std::vector<int64_t>& spec, const std::vector<at::Tensor>& arrays, int64_t d) {
  TORCH_CHECK(tier_shift > 0 && tier_shift < 31, "tier_shift: the bits of an entry id below its tier (1-30)");
  Kivi kivi;
  kivi.shift = tier_shift, kivi.mask = (int64_t{1} << tier_shift) - 1;
  if (spec.empty()) return kivi;
  TORCH_CHECK(spec.size() == 4 && arrays.size() == 6, "kivi: (tier, bits, group, channel group) and six arrays");
  kivi.tier = spec[0], kivi.bits = spec[1], kivi.group = spec[2], kivi.channel_group = spec[3];
  TORCH_CHECK(kivi.tier >= 1 && kivi.tier < 16 && (kivi.bits == 2 || kivi.bits == 4) && kivi.group >= 1 && kivi.channel_group >= 1 &&
                  d % kivi.channel_group == 0 && d * kivi.bits % 8 == 0,
              "kivi: a tier 1-15, 2 or 4 bits, a channel group dividing d");
  TORCH_CHECK(d / kivi.channel_group <= 64, "kivi: at most 64 value groups per head");
  const at::Tensor &key_codes = arrays[0], &key_zero = arrays[1], &key_scale = arrays[2];
  const at::Tensor &value_codes = arrays[3], &value_zero = arrays[4], &value_scale = arrays[5];
  kivi.blocks = key_codes.size(0), kivi.packed = d * kivi.bits / 8, kivi.value_groups = d / kivi.channel_group;
  for (const at::Tensor& t : arrays) TORCH_CHECK(t.is_contiguous() && t.size(0) == kivi.blocks, "kivi: contiguous arrays, a row per block");
  TORCH_CHECK(kivi.group * kivi.bits % 8 == 0, "kivi: a block's codes of a key channel fill whole bytes (group · bits a multiple of 8)");
  kivi.key_packed = kivi.group * kivi.bits / 8;
  if ((kivi.group & (kivi.group - 1)) == 0) kivi.group_shift = __builtin_ctzll(kivi.group);
  TORCH_CHECK(key_codes.scalar_type() == at::kByte && value_codes.scalar_type() == at::kByte &&
                  key_codes.sizes() == at::IntArrayRef({kivi.blocks, d, kivi.key_packed}) &&
                  value_codes.sizes() == at::IntArrayRef({kivi.blocks, kivi.group, kivi.packed}),
              "kivi: uint8 key codes [blocks, d, group * bits / 8] and value codes [blocks, group, d * bits / 8]");
  TORCH_CHECK(key_zero.sizes() == at::IntArrayRef({kivi.blocks, d}) && key_scale.sizes() == key_zero.sizes() &&
                  value_zero.sizes() == at::IntArrayRef({kivi.blocks, kivi.group, kivi.value_groups}) && value_scale.sizes() == value_zero.sizes(),
              "kivi: key zero points and scales [blocks, d], value ones [blocks, group, d / channel group]");
  kivi.param = param_type(key_zero);
  for (size_t i : {2, 4, 5}) TORCH_CHECK(arrays[i].scalar_type() == key_zero.scalar_type(), "kivi: zero points and scales of one dtype");
  kivi.key_codes = key_codes.data_ptr<uint8_t>(), kivi.value_codes = value_codes.data_ptr<uint8_t>();
  kivi.key_zero = key_zero.data_ptr(), kivi.key_scale = key_scale.data_ptr();
  kivi.value_zero = value_zero.data_ptr(), kivi.value_scale = value_scale.data_ptr();
  return kivi;
}

}  // namespace

// The query in float32, times the scaling (one pass, no ATen operations: their dispatch costs more at these sizes).
at::Tensor scaled_query(const at::Tensor& query, float scaling) {
  auto scaled = at::empty(query.sizes(), query.options().dtype(at::kFloat));
  float* out = scaled.data_ptr<float>();
  const at::Tensor q = query.contiguous();
  const int64_t n = q.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "scaled_query", [&] {
    const scalar_t* in = q.data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i) out[i] = to_float(in[i]) * scaling;
  });
  return scaled;
}

// The float32 output in the query's dtype.
at::Tensor in_dtype(const at::Tensor& out, at::ScalarType dtype) {
  if (dtype == at::kFloat) return out;
  auto cast = at::empty(out.sizes(), out.options().dtype(dtype));
  const float* in = out.data_ptr<float>();
  const int64_t n = out.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "in_dtype", [&] {
    scalar_t* to = cast.data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i) to[i] = static_cast<scalar_t>(in[i]);
  });
  return cast;
}

namespace {

// Row r's table as the read takes it: the int32 [H, L] `slots` (any strides) of `heads` heads, each at most `longest`
// entries, and its float32 [H, L] log-weights (or an empty tensor); `slot_offset`, `weight_offset`: elements past each
// tensor's start (a layer of a step's [layers, H, L] tables).
Table table_view(const at::Tensor& slots, const at::Tensor& weights, int64_t heads, int64_t longest, int64_t slot_offset = 0,
                 int64_t weight_offset = 0) {
  const int64_t dims = slots.dim();
  TORCH_CHECK(dims >= 2 && slots.scalar_type() == at::kInt && slots.size(dims - 2) == heads, "a slot table: int32 [H, L]");
  TORCH_CHECK(longest <= slots.size(dims - 1), "a head is longer than its slot table");
  Table view{slots.data_ptr<int32_t>() + slot_offset, slots.stride(dims - 2), slots.stride(dims - 1), nullptr, 0, 0};
  if (weights.numel() > 0) {
    TORCH_CHECK(weights.dim() == dims && weights.scalar_type() == at::kFloat && weights.size(dims - 2) == heads &&
                    weights.size(dims - 1) >= longest,
                "a log-weight table: float32 [H, L]");
    view.weights = weights.data_ptr<float>() + weight_offset;
    view.weight_head_stride = weights.stride(dims - 2);
    view.weight_entry_stride = weights.stride(dims - 1);
  }
  return view;
}

// The read over rows' table views (checked by table_view) and their lengths, `heads` a row: paged_decode's result.
std::vector<at::Tensor> decode_views(const at::Tensor& queries, double scaling, const at::Tensor& keys, const at::Tensor& values,
                                     const std::vector<Table>& views, const int64_t* length, int64_t heads, const Kivi& kivi,
                                     const at::Tensor& scores) {
  TORCH_CHECK(queries.dim() == 3 && at::isFloatingType(queries.scalar_type()), "query: [R, Hq, d], float32, bfloat16 or float16");
  const int64_t rows = static_cast<int64_t>(views.size());
  TORCH_CHECK(queries.size(0) == rows && queries.size(1) % heads == 0, "query: a row per table, its heads a multiple of the KV heads");
  const at::Tensor query = scaled_query(queries, static_cast<float>(scaling));
  if (scores.numel() > 0) {
    TORCH_CHECK(scores.dim() == 3 && scores.scalar_type() == at::kFloat && scores.is_contiguous() && scores.size(0) == query.size(0) &&
                    scores.size(1) == query.size(1) &&
                    (rows * heads == 0 || scores.size(2) >= *std::max_element(length, length + rows * heads)),
                "scores: float32 [R, Hq, L], contiguous, L at least every head's length");
  }
  auto out = at::empty(query.sizes(), query.options());
  auto lse = at::empty({query.size(0), query.size(1)}, query.options());
  // a bfloat16 query over bfloat16 keys: its plain keys' logits from the bfloat16 values themselves (dots16_bf16)
  const bool bf16_dots = BF16_DOTS && WIDE_DOTS && queries.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
                         query.size(2) % 32 == 0;
  const at::Tensor query_bf16 = bf16_dots ? queries.contiguous() : at::Tensor();
  at::Tensor filled = scores;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys.scalar_type(), "paged_decode", [&] {
    run<scalar_t>(query, query_bf16, static_cast<float>(scaling), keys, values, kivi, views, length, heads, out, lse, filled);
  });
  return {in_dtype(out, queries.scalar_type()), lse};
}

void check_pool(const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(keys.dim() == 2 && keys.is_contiguous() && values.is_contiguous() && keys.sizes() == values.sizes() &&
                  keys.scalar_type() == values.scalar_type() && at::isFloatingType(keys.scalar_type()),
              "keys and values: [S, d] of one dtype, contiguous");
}

}  // namespace

// query [R, Hq, d] (float32, bfloat16 or float16), scaled by `scaling` here; keys, values [S, d] (float32, bfloat16 or float16); tables: per row an int32
// [H, L_r] slot table (any strides); lengths [R, H] int64; weights: per row a float32 [H, L_r] log-weight table
// or an empty tensor; tier_shift: an entry id is tier << tier_shift | its place in the tier (0: a plain slot);
// kivi: (tier, bits, group, channel group) of the KIVI tier read in place and its arrays
// (key_codes, key_zero, key_scale, value_codes, value_zero, value_scale), or both empty; scores: float32 [R, Hq, L]
// (L at least every head's length), filled in place with each entry's logit (scaled, its log-weight added; -inf on
// holes; columns past a head's length untouched), or an empty tensor. Returns (out [R, Hq, d] in the query's dtype, lse [R, Hq]
// float32).
std::vector<at::Tensor> paged_decode(const at::Tensor& queries, double scaling, const at::Tensor& keys, const at::Tensor& values,
                                     const std::vector<at::Tensor>& tables, const at::Tensor& lengths,
                                     const std::vector<at::Tensor>& weights, int64_t tier_shift, const std::vector<int64_t>& kivi_spec,
                                     const std::vector<at::Tensor>& kivi_arrays, at::Tensor scores) {
  check_pool(keys, values);
  TORCH_CHECK(queries.dim() == 3 && keys.size(1) == queries.size(2), "query: [R, Hq, d], d as the keys'");
  TORCH_CHECK(lengths.dim() == 2 && lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.size(0) == queries.size(0),
              "lengths: int64 [R, H]");
  TORCH_CHECK(static_cast<int64_t>(tables.size()) == queries.size(0) && weights.size() == tables.size(), "one table and one weight table per row");
  std::vector<Table> views;
  const int64_t heads = lengths.size(1);
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (size_t r = 0; r < tables.size(); ++r)
    views.push_back(table_view(tables[r], weights[r], heads, *std::max_element(length + r * heads, length + (r + 1) * heads)));
  return decode_views(queries, scaling, keys, values, views, length, heads, kivi_tier(tier_shift, kivi_spec, kivi_arrays, queries.size(2)),
                      scores);
}

struct PagedStep::State {
  at::Tensor keys, values, lengths;
  at::Tensor slots;  // int64 [layers, R · H], contiguous
  std::vector<at::Tensor> tables, weights, kivi_arrays;  // kept alive: the views point into them
  int64_t rows = 0, heads = 0;
  std::vector<std::vector<Table>> views;  // [layer][row]
  Kivi kivi;
};

PagedStep::PagedStep(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slots, const std::vector<at::Tensor>& tables,
                     const at::Tensor& lengths, const std::vector<at::Tensor>& weights, int64_t tier_shift,
                     const std::vector<int64_t>& kivi_spec, const std::vector<at::Tensor>& kivi_arrays)
    : state_(std::make_shared<State>()) {
  check_pool(keys, values);
  TORCH_CHECK(lengths.dim() == 3 && lengths.scalar_type() == at::kLong && lengths.is_contiguous(), "lengths: int64 [layers, R, H]");
  const int64_t layers = lengths.size(0), rows = lengths.size(1), heads = lengths.size(2);
  TORCH_CHECK(slots.dim() == 3 && slots.size(0) == layers && slots.size(1) == rows && slots.size(2) == heads,
              "slots: the new entries' slots [layers, R, H]");
  TORCH_CHECK(static_cast<int64_t>(tables.size()) == rows && weights.size() == tables.size(), "one table and one weight table per row");
  State& state = *state_;
  state.keys = keys, state.values = values, state.lengths = lengths, state.tables = tables, state.weights = weights;
  state.kivi_arrays = kivi_arrays;
  state.kivi = kivi_tier(tier_shift, kivi_spec, kivi_arrays, keys.size(1));
  state.slots = slots.to(at::kLong).reshape({layers, rows * heads}).contiguous();
  state.rows = rows, state.heads = heads;
  const int64_t* length = lengths.data_ptr<int64_t>();
  state.views.resize(layers);
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t r = 0; r < rows; ++r) {
      const at::Tensor &table = tables[r], &weight = weights[r];
      TORCH_CHECK(table.dim() == 3 && table.size(0) == layers && (weight.numel() == 0 || weight.size(0) == layers),
                  "a step's slot and log-weight tables: [layers, H, L]");
      const int64_t* row = length + (l * rows + r) * heads;
      state.views[l].push_back(table_view(table, weight, heads, *std::max_element(row, row + heads), l * table.stride(0),
                                          weight.numel() ? l * weight.stride(0) : 0));
    }
  }
}

int64_t PagedStep::layers() const { return static_cast<int64_t>(state_->views.size()); }
int64_t PagedStep::rows() const { return state_->rows; }
int64_t PagedStep::heads() const { return state_->heads; }
const at::Tensor& PagedStep::keys() const { return state_->keys; }
const at::Tensor& PagedStep::values() const { return state_->values; }

const int64_t* PagedStep::slots(int64_t layer) const {
  TORCH_CHECK(layer >= 0 && layer < layers(), "PagedStep: no such layer");
  return state_->slots.data_ptr<int64_t>() + layer * state_->rows * state_->heads;
}

at::Tensor PagedStep::read(const at::Tensor& query, double scaling, int64_t layer) const {
  TORCH_CHECK(layer >= 0 && layer < layers(), "PagedStep: no such layer");
  TORCH_CHECK(query.dim() == 3 && query.size(2) == state_->keys.size(1), "query: [R, Hq, d], d as the keys'");
  const State& state = *state_;
  return decode_views(query, scaling, state.keys, state.values, state.views[layer],
                      state.lengths.data_ptr<int64_t>() + layer * state.rows * state.heads, state.heads, state.kivi, at::Tensor())[0];
}

// Each entry's attention weight from a decoding read's logits (read/paged.py's `entry_weights`; `entry_weights_torch` the
// reference): scores float32 [R, Hq, L] (contiguous; -inf on holes and past a head's length) and lse float32 [R, Hq] →
// exp(logit − lse), 0 where the query head read nothing (lse = -inf), by exp_float; with `mean`, their mean over each KV
// head's `group` query heads, a new float32 [R, Hq / group, L] (what column sums take); else the weights in `scores`
// itself, which is returned.
at::Tensor entry_weights(at::Tensor scores, const at::Tensor& lse, int64_t group, bool mean) {
  TORCH_CHECK(scores.dim() == 3 && scores.scalar_type() == at::kFloat && scores.is_contiguous(), "scores: float32 [R, Hq, L], contiguous");
  const int64_t rows = scores.size(0), query_heads = scores.size(1), length = scores.size(2);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.sizes() == at::IntArrayRef({rows, query_heads}),
              "lse: float32 [R, Hq], contiguous");
  TORCH_CHECK(group >= 1 && query_heads % group == 0, "group: a divisor of the query heads");
  float* logits = scores.data_ptr<float>();
  const float* log_total = lse.data_ptr<float>();
  auto sums = mean ? at::zeros({rows, query_heads / group, length}, scores.options()) : scores;
  float* to = sums.data_ptr<float>();
  const float share = 1.f / static_cast<float>(group);
  for (int64_t rq = 0; rq < rows * query_heads; ++rq) {
    const float offset = log_total[rq] == NEG_INF ? 0.f : log_total[rq];  // nothing read: every logit is -inf, every weight 0
    float* logit = logits + rq * length;
    if (mean) {
      float* sum = to + (rq / group) * length;
#pragma omp simd
      for (int64_t j = 0; j < length; ++j) sum[j] += exp_float(logit[j] - offset) * share;
    } else {
#pragma omp simd
      for (int64_t j = 0; j < length; ++j) logit[j] = exp_float(logit[j] - offset);
    }
  }
  return sums;
}
