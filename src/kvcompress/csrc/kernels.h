// The CPU kernels (one extension module, bound in module.cpp); each file's header comment gives its contract.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__F16C__)
#include <immintrin.h>
#endif

// A stored number as float32 (exactly): bfloat16 by its bits (a shift the compiler vectorizes), float16 by F16C where the
// CPU has it.
inline float to_float(float x) { return x; }
inline float to_float(at::Half x) {
#if defined(__F16C__)
  return _cvtsh_ss(x.x);  // one instruction where the CPU has F16C
#else
  return static_cast<float>(x);
#endif
}
inline float to_float(at::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#if defined(__AVX2__) && defined(__F16C__)
// Eight stored numbers as float32 lanes (exactly): bfloat16 by its bits shifted up (float32's top half), float16 by F16C.
template <typename scalar_t>
inline __m256 load8(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}
#endif

// q · k over d numbers, float32 sums (k stored in any of the three dtypes).
template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t d) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < d; ++c) sum += q[c] * to_float(k[c]);
  return sum;
}

// acc += p · v over d numbers, float32.
template <typename scalar_t>
inline void axpy(float* acc, float p, const scalar_t* v, int64_t d) {
#pragma omp simd
  for (int64_t c = 0; c < d; ++c) acc[c] += p * to_float(v[c]);
}

// exp(x) in float32, vectorizable: 2^n · p(r) with r = x − n·ln 2 (Cephes' expf polynomial, relative error ~2e-7); 0 below
// −87 (and for −inf), +inf above 88.
inline float exp_float(float x) {
  const float clamped = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : (x > 88.0f ? std::numeric_limits<float>::infinity() : e * scale);
}

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// A decoding read's work, for paged_decode.cpp and deltakv_rebuild.cpp: every (row, KV head) rh of lengths [R·H] cut into
// chunks of `size` entries (one, even for an empty head); task t covers entries [begin(t), end(t)) of head owner[t], head
// rh's tasks are first[rh] .. first[rh + 1] - 1. The size is DECODE_CHUNK where the read is long, smaller where it is short
// (at least `per_thread` chunks for each thread, so that `for_each` can share the entries evenly), a multiple of
// CHUNK_ALIGN (a KIVI block's entries stay in one chunk). A chunk has its own fixed work (its buffers; a head of several
// chunks, a merge): the plain read takes 4 a thread (SnapKV's read at 8 rows × 3 heads × ~225 entries, bfloat16 on a Zen 5:
// 69 → 63 µs a layer against 16), DeltaKV's, whose entries cost more each, 16 (4 was 3 % slower).
constexpr int64_t DECODE_CHUNK = 512, CHUNK_ALIGN = 64;
struct DecodeTasks {
  const int64_t* length;
  int64_t size;
  std::vector<int64_t> first, owner;
  DecodeTasks(const int64_t* lengths, int64_t heads_total, int64_t per_thread) : length(lengths), first(heads_total + 1, 0) {
    const int64_t total = std::accumulate(lengths, lengths + heads_total, int64_t{0});
    const int64_t share = (total + per_thread * at::get_num_threads() - 1) / (per_thread * at::get_num_threads());
    size = std::clamp((share + CHUNK_ALIGN - 1) / CHUNK_ALIGN * CHUNK_ALIGN, CHUNK_ALIGN, DECODE_CHUNK);
    for (int64_t rh = 0; rh < heads_total; ++rh) first[rh + 1] = first[rh] + std::max<int64_t>(1, (length[rh] + size - 1) / size);
    owner.resize(first.back());
    for (int64_t rh = 0; rh < heads_total; ++rh) std::fill(owner.begin() + first[rh], owner.begin() + first[rh + 1], rh);
  }
  int64_t count() const { return first.back(); }
  int64_t chunks(int64_t rh) const { return first[rh + 1] - first[rh]; }
  int64_t begin(int64_t t) const { return (t - first[owner[t]]) * size; }
  int64_t end(int64_t t) const { return std::max(begin(t), std::min(length[owner[t]], begin(t) + size)); }

  // task(t) for every task on ATen's threads, each thread one contiguous run of tasks holding an equal share of the entries
  // (contiguous: a thread streams through neighbouring entries; at::parallel_for's equal runs of tasks would leave a
  // thread waiting where heads end in short chunks).
  template <typename Task>
  void for_each(const Task& task) const {
    const int64_t n = count(), parts = std::min<int64_t>(at::get_num_threads(), n);
    std::vector<int64_t> before(n + 1, 0);  // the work of the tasks before t (an empty chunk counts one)
    for (int64_t t = 0; t < n; ++t) before[t + 1] = before[t] + std::max<int64_t>(1, end(t) - begin(t));
    at::parallel_for(0, parts, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t part = lo; part < hi; ++part) {  // the tasks whose work starts in this part's share
        const auto from = std::lower_bound(before.begin(), before.begin() + n, part * before[n] / parts) - before.begin();
        const auto to = std::lower_bound(before.begin(), before.begin() + n, (part + 1) * before[n] / parts) - before.begin();
        for (int64_t t = from; t < to; ++t) task(t);
      }
    });
  }
};

// Query g's chunks of head rh merged by log-sum-exp, from each chunk's max m and sum l [tasks, G]: add(t, factor) for every
// chunk that holds entries, factor = exp(m_t − top). Returns {top, Σ_t l_t · factor}; top is −inf where the head holds
// nothing (add is then never called).
template <typename Add>
std::pair<float, float> merge_chunks(const DecodeTasks& tasks, int64_t rh, const float* m, const float* l, int64_t groups, int64_t g,
                                     Add add) {
  float top = NEG_INF, total = 0.f;
  for (int64_t t = tasks.first[rh]; t < tasks.first[rh + 1]; ++t) top = std::max(top, m[t * groups + g]);
  if (top == NEG_INF) return {top, total};
  for (int64_t t = tasks.first[rh]; t < tasks.first[rh + 1]; ++t) {
    if (m[t * groups + g] == NEG_INF) continue;
    const float factor = std::exp(m[t * groups + g] - top);
    total += l[t * groups + g] * factor;
    add(t, factor);
  }
  return {top, total};
}

// A decoding query [R, Hq, d] in float32 times the scaling, and a float32 output back in the query's dtype: one pass each,
// no ATen operations (their dispatch costs more at these sizes); in paged_decode.cpp, for both decoding reads.
at::Tensor scaled_query(const at::Tensor& query, float scaling);
at::Tensor in_dtype(const at::Tensor& out, at::ScalarType dtype);

std::vector<at::Tensor> paged_decode(const at::Tensor& query, double scaling, const at::Tensor& keys, const at::Tensor& values,
                                     const std::vector<at::Tensor>& tables, const at::Tensor& lengths,
                                     const std::vector<at::Tensor>& weights, int64_t tier_shift, const std::vector<int64_t>& kivi_spec,
                                     const std::vector<at::Tensor>& kivi_arrays, at::Tensor scores);

// A decoding step's reads in place, every layer's, checked and laid out once a step (paged_decode.cpp): the pool's keys and
// values [S, d], the new entries' slots int64 [layers, R, H], per row its slot table of every layer int32 [layers, H, L] (any
// strides) and log-weights float32 [layers, H, L] (or an empty tensor), the lengths int64 [layers, R, H], then the tier shift
// and KIVI's spec and arrays as paged_decode takes them. `read(query, scaling, layer)` is paged_decode's output over the
// layer's tables; `slots(layer)` the layer's new entries' slots (R · H, row-major).
class PagedStep {
 public:
  PagedStep(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slots, const std::vector<at::Tensor>& tables,
            const at::Tensor& lengths, const std::vector<at::Tensor>& weights, int64_t tier_shift, const std::vector<int64_t>& kivi_spec,
            const std::vector<at::Tensor>& kivi_arrays);
  int64_t layers() const;
  int64_t rows() const;
  int64_t heads() const;
  const at::Tensor& keys() const;
  const at::Tensor& values() const;
  const int64_t* slots(int64_t layer) const;  // R · H of them
  at::Tensor read(const at::Tensor& query, double scaling, int64_t layer) const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

at::Tensor entry_weights(at::Tensor scores, const at::Tensor& lse, int64_t group, bool mean);

at::Tensor top_pages(const at::Tensor& query, const at::Tensor& bounds, const at::Tensor& useful, const at::Tensor& count,
                     const at::Tensor& protected_columns, const at::Tensor& open, int64_t page_size, int64_t pages);

std::vector<at::Tensor> select_tables(const std::vector<at::Tensor>& tables, const std::vector<at::Tensor>& weights,
                                      const at::Tensor& columns);

at::Tensor chosen_tokens(const at::Tensor& weights, const at::Tensor& positions, const at::Tensor& lengths, const at::Tensor& budget,
                         int64_t sinks, int64_t recent, int64_t tokens);
at::Tensor token_columns(const at::Tensor& wanted, const at::Tensor& positions, const at::Tensor& lengths, int64_t sinks, int64_t recent);

std::vector<at::Tensor> merge_pairs(const at::Tensor& keys, const std::vector<at::Tensor>& tables, const at::Tensor& score,
                                    const at::Tensor& open);

std::vector<at::Tensor> compact_tables(at::Tensor ids, at::Tensor weights, const at::Tensor& keep, const at::Tensor& lengths,
                                       int64_t pad_slot, int64_t pad_position);

std::tuple<std::vector<int64_t>, std::vector<bool>> greedy_rows(const at::Tensor& logits);

// prompt_attention.cpp
bool causal_attention_available();
at::Tensor causal_attention(const at::Tensor& query, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                            double scaling);

std::vector<bool> append_step(const std::vector<at::Tensor>& ids, const std::vector<at::Tensor>& lengths,
                              const std::vector<at::Tensor>& weights, const at::Tensor& slots, const std::vector<int64_t>& positions,
                              const std::vector<bool>& eligible);

std::vector<at::Tensor> summary_merge(const at::Tensor& query, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& matrix,
                                      const at::Tensor& bias);

std::vector<at::Tensor> deltakv_rebuild(const at::Tensor& entries, const at::Tensor& codes, const at::Tensor& code_zero,
                                        const at::Tensor& code_scale, const at::Tensor& refs, const at::Tensor& positions,
                                        const at::Tensor& layers, const at::Tensor& ref_keys, const at::Tensor& ref_values,
                                        const at::Tensor& ref_positions, const at::Tensor& decoder, const at::Tensor& scale,
                                        const at::Tensor& rotary);

std::vector<at::Tensor> deltakv_decode(const at::Tensor& queries, double scaling, const at::Tensor& keys, const at::Tensor& values,
                                       const std::vector<at::Tensor>& tables, const at::Tensor& lengths,
                                       const std::vector<at::Tensor>& weights, int64_t tier_shift, int64_t code_tier, int64_t reference_tier,
                                       const at::Tensor& codes, const at::Tensor& code_zero, const at::Tensor& code_scale,
                                       const at::Tensor& refs, const at::Tensor& positions, const at::Tensor& layers,
                                       const at::Tensor& ref_keys, const at::Tensor& ref_values, const at::Tensor& ref_positions,
                                       const at::Tensor& decoder, const at::Tensor& scale, const at::Tensor& key_codes,
                                       const at::Tensor& key_steps, const at::Tensor& key_sums, const at::Tensor& rotary, at::Tensor scores);

std::vector<at::Tensor> add_rms_norm(const at::Tensor& hidden, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps);

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

at::Tensor silu_mul(const at::Tensor& gate_up);

bool replay_chunk_available();

std::vector<at::Tensor> replay_chunk(const at::Tensor& rows, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& new_keys,
                                     const at::Tensor& new_values, double scaling);

std::vector<std::string> linear_rows_dtypes();

bool linear_rows_bf16_dots();

at::Tensor linear_rows(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::optional<at::Tensor>& bias);

// The DecodeLayer class (decode_layer.cpp), bound into the module.
void bind_decode_layer(pybind11::module_& m);
