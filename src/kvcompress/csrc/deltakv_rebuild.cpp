// DeltaKV's coded entries rebuilt: a pass per token before and after one matrix product per layer; and, further down,
// `deltakv_decode`, the decoding read over slot tables that name them, in place. The contract is
// store/deltakv.py's `DeltaKVCodec.decode`; its PyTorch path (`decode_torch`) is the reference, and this gives the same keys
// and values to float32 rounding.
//
// For each entry e = entries[i] (of the codec's tier: token b = e / H, head e % H), the keys and values [d] of its head, each
// token rebuilt once (a block of the tier is one token of one layer over its H KV heads):
//   z = zero[b] + code[b] · scale[b]                  its 4-bit code (two per byte, the first in the low bits), float32;
//   m = mean over its k references r = refs[b] of    (keys rotated back from ref_positions[r], values), over the heads:
//       x_r = concat(pre-RoPE keys [H·d], values [H·d]);
//   x = (z · decoder[l]) ⊙ scale[l] + m                l = layers[b], the decoder [d_c, 2·H·d] and scale [2·H·d] float32;
//   keys[i] = head e % H of x's key half rotated to positions[b], values[i] = of its value half, each [d] float32.
// RoPE is transformers' rotate-half form: channel j < d/2 pairs with j + d/2 at angle position · inv_freq[j], its cosine
// and sine read from `rotary` [P, d]: row p holds cos(p · inv_freq) [d/2], then sin(p · inv_freq).
#include "kernels.h"

#include <ATen/Parallel.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <vector>

namespace {

// One head's row [d] turned by transformers' rotate-half RoPE, given its position's row of `rotary` (cosines [d/2], then
// sines): to the position (BACK false), out = x·cos + rotate_half(x)·sin; back from it (BACK true), out = x·cos −
// rotate_half(x)·sin, the same with the sines negated.
template <bool BACK, typename scalar_t>
inline void rotate(const scalar_t* x, const float* rotary_row, int64_t d, float* out) {
  const int64_t half = d / 2;
  const float* cosines = rotary_row;
  const float* sines = rotary_row + half;
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    const float first = to_float(x[j]), second = to_float(x[j + half]), sine = BACK ? -sines[j] : sines[j];
    out[j] = first * cosines[j] - second * sine;
    out[j + half] = second * cosines[j] + first * sine;
  }
}

// A token's 4-bit code [d_c / 2 bytes, the first of each pair in the low bits] as one byte per channel [d_c].
inline void unpack_nibbles(const uint8_t* packed, int64_t code_bytes, uint8_t* codes) {
  int64_t j = 0;
#if defined(__AVX2__)
  const __m128i low = _mm_set1_epi8(15);
  for (; j + 16 <= code_bytes; j += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + j));
    const __m128i first = _mm_and_si128(bytes, low), second = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 2 * j), _mm_unpacklo_epi8(first, second));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 2 * j + 16), _mm_unpackhi_epi8(first, second));
  }
#endif
  for (; j < code_bytes; ++j) {
    codes[2 * j] = packed[j] & 15;
    codes[2 * j + 1] = packed[j] >> 4;
  }
}

// A token's code z = zero + step · c [d_c] in floats, c its 4-bit integers (`codes`: scratch [d_c]).
inline void code_floats(const uint8_t* packed, int64_t code_bytes, float zero, float step, uint8_t* codes, float* z) {
  unpack_nibbles(packed, code_bytes, codes);
  for (int64_t j = 0; j < 2 * code_bytes; ++j) z[j] = zero + step * static_cast<float>(codes[j]);
}

// Pass 1, per token: its code z [d_c] and the sum of its references' vectors [2·H·d] (keys rotated back).
template <typename scalar_t>
void codes_and_reference_sums(const int64_t* blocks, int64_t n, const uint8_t* codes, int64_t code_bytes, const at::Half* zeros,
                              const at::Half* scales, const int32_t* refs, int64_t top_k, const scalar_t* ref_keys,
                              const scalar_t* ref_values, const int32_t* ref_positions, const float* rotary, int64_t heads,
                              int64_t head_dim, float* z, float* sums) {
  const int64_t width = 2 * heads * head_dim;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> unrotated(head_dim);
    std::vector<uint8_t> scratch(2 * code_bytes);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = blocks[i];
      code_floats(codes + b * code_bytes, code_bytes, to_float(zeros[b]), to_float(scales[b]), scratch.data(), z + i * 2 * code_bytes);
      float* sum = sums + i * width;
      std::fill(sum, sum + width, 0.0f);
      for (int64_t r = 0; r < top_k; ++r) {
        const int64_t ref = refs[b * top_k + r];
        const float* rotary_row = rotary + static_cast<int64_t>(ref_positions[ref]) * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* v = ref_values + (ref * heads + h) * head_dim;
          float* sk = sum + h * head_dim;
          float* sv = sum + (heads + h) * head_dim;
          rotate<true>(ref_keys + (ref * heads + h) * head_dim, rotary_row, head_dim, unrotated.data());
          for (int64_t j = 0; j < head_dim; ++j) sk[j] += unrotated[j];
          for (int64_t j = 0; j < head_dim; ++j) sv[j] += to_float(v[j]);
        }
      }
    }
  });
}

// Pass 2, per token: x = decoded ⊙ scale[l] + sums / k, its keys rotated to the token's position.
void finish(const int64_t* blocks, int64_t n, const float* decoded, const float* sums, int64_t top_k, const int32_t* positions,
            const int16_t* layers, const float* scale, const float* rotary, int64_t heads, int64_t head_dim, float* keys,
            float* values) {
  const int64_t width = 2 * heads * head_dim;
  const float count = static_cast<float>(top_k);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> x(width);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = blocks[i];
      const float* s = scale + static_cast<int64_t>(layers[b]) * width;
      for (int64_t j = 0; j < width; ++j) x[j] = decoded[i * width + j] * s[j] + sums[i * width + j] / count;
      const float* rotary_row = rotary + static_cast<int64_t>(positions[b]) * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        rotate<false>(x.data() + h * head_dim, rotary_row, head_dim, keys + (i * heads + h) * head_dim);
        std::copy(x.data() + (heads + h) * head_dim, x.data() + (heads + h + 1) * head_dim, values + (i * heads + h) * head_dim);
      }
    }
  });
}

// The codec's arrays as both entry points take them, checked: codes [N, d_c / 2] with their zero points, scales, references,
// positions and layers; the reference tier's keys, values [R, H, d] and positions; the decoder, scale and RoPE table.
void check_codec_arrays(const at::Tensor& codes, const at::Tensor& code_zero, const at::Tensor& code_scale, const at::Tensor& refs,
                        const at::Tensor& positions, const at::Tensor& layers, const at::Tensor& ref_keys, const at::Tensor& ref_values,
                        const at::Tensor& ref_positions, const at::Tensor& decoder, const at::Tensor& scale, const at::Tensor& rotary) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes: uint8 [N, d_c / 2], contiguous");
  const int64_t total = codes.size(0), code_bytes = codes.size(1);
  TORCH_CHECK(code_zero.scalar_type() == at::kHalf && code_scale.scalar_type() == at::kHalf && code_zero.numel() == total &&
                  code_scale.numel() == total && code_zero.is_contiguous() && code_scale.is_contiguous(),
              "code_zero, code_scale: float16 [N, 1], contiguous");
  TORCH_CHECK(refs.dim() == 2 && refs.size(0) == total && refs.scalar_type() == at::kInt && refs.is_contiguous(),
              "refs: int32 [N, k], contiguous");
  TORCH_CHECK(positions.numel() == total && positions.scalar_type() == at::kInt && positions.is_contiguous(), "positions: int32 [N]");
  TORCH_CHECK(layers.numel() == total && layers.scalar_type() == at::kShort && layers.is_contiguous(), "layers: int16 [N]");
  TORCH_CHECK(ref_keys.dim() == 3 && ref_keys.sizes() == ref_values.sizes() && ref_keys.scalar_type() == ref_values.scalar_type() &&
                  ref_keys.is_contiguous() && ref_values.is_contiguous(),
              "ref_keys, ref_values: [R, H, d] of one dtype, contiguous");
  const int64_t heads = ref_keys.size(1), head_dim = ref_keys.size(2), width = 2 * heads * head_dim;
  TORCH_CHECK(head_dim % 2 == 0, "the head dim must be even (RoPE pairs channels)");
  TORCH_CHECK(ref_positions.numel() == ref_keys.size(0) && ref_positions.scalar_type() == at::kInt && ref_positions.is_contiguous(),
              "ref_positions: int32 [R]");
  TORCH_CHECK(decoder.dim() == 3 && decoder.size(1) == 2 * code_bytes && decoder.size(2) == width &&
                  decoder.scalar_type() == at::kFloat && decoder.is_contiguous(),
              "decoder: float32 [L, d_c, 2·H·d], contiguous");
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == decoder.size(0) && scale.size(1) == width && scale.scalar_type() == at::kFloat &&
                  scale.is_contiguous(),
              "scale: float32 [L, 2·H·d], contiguous");
  TORCH_CHECK(rotary.dim() == 2 && rotary.size(1) == head_dim && rotary.scalar_type() == at::kFloat && rotary.is_contiguous(),
              "rotary: float32 [P, d] (each position's cosines, then its sines), contiguous");
}

// A coded token's ids, checked before any work reads through them: its layer, its position (within the RoPE table of
// `table` rows) and the ids of its references.
void check_token(const char* who, int64_t b, const int16_t* layers, int64_t layer_count, const int32_t* positions,
                 const int32_t* refs, int64_t top_k, int64_t references, int64_t table) {
  TORCH_CHECK(layers[b] >= 0 && layers[b] < layer_count, who, ": block ", b, " names layer ", layers[b]);
  TORCH_CHECK(positions[b] >= 0 && positions[b] < table, who, ": position ", positions[b], " past the table");
  for (int64_t r = 0; r < top_k; ++r) {
    const int32_t ref = refs[b * top_k + r];
    TORCH_CHECK(ref >= 0 && ref < references, who, ": block ", b, " names reference ", ref, " of ", references);
  }
}

// A reference's position, within the RoPE table of `table` rows.
void check_reference(const char* who, int64_t ref, const int32_t* ref_positions, int64_t table) {
  TORCH_CHECK(ref_positions[ref] >= 0 && ref_positions[ref] < table, who, ": position ", ref_positions[ref], " past the table");
}

}  // namespace

std::vector<at::Tensor> deltakv_rebuild(const at::Tensor& entries, const at::Tensor& codes, const at::Tensor& code_zero,
                                        const at::Tensor& code_scale, const at::Tensor& refs, const at::Tensor& positions,
                                        const at::Tensor& layers, const at::Tensor& ref_keys, const at::Tensor& ref_values,
                                        const at::Tensor& ref_positions, const at::Tensor& decoder, const at::Tensor& scale,
                                        const at::Tensor& rotary) {
  TORCH_CHECK(entries.dim() == 1 && entries.scalar_type() == at::kLong && entries.is_contiguous(), "entries: int64 [m], contiguous");
  check_codec_arrays(codes, code_zero, code_scale, refs, positions, layers, ref_keys, ref_values, ref_positions, decoder, scale, rotary);
  const int64_t total = codes.size(0), code_bytes = codes.size(1);
  const int64_t heads = ref_keys.size(1), head_dim = ref_keys.size(2), width = 2 * heads * head_dim;
  const int64_t table = rotary.size(0);
  const int64_t m = entries.size(0), references = ref_keys.size(0), top_k = refs.size(1), layer_count = decoder.size(0);
  const int64_t* entry_ids = entries.data_ptr<int64_t>();
  std::vector<int64_t> unique(m);  // the tokens named, each rebuilt once for all its heads
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(entry_ids[i] >= 0 && entry_ids[i] / heads < total, "deltakv_rebuild: entry ", entry_ids[i], " is not of a coded token (",
                total, " tokens of ", heads, " heads)");
    unique[i] = entry_ids[i] / heads;
  }
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  const int64_t n = static_cast<int64_t>(unique.size());
  const int64_t* block_ids = unique.data();
  const int32_t* ref_ids = refs.data_ptr<int32_t>();
  const int16_t* layer_ids = layers.data_ptr<int16_t>();
  const int32_t* position_ids = positions.data_ptr<int32_t>();
  const int32_t* ref_position_ids = ref_positions.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {  // ids out of range would read outside the arrays: checked before any work
    check_token("deltakv_rebuild", block_ids[i], layer_ids, layer_count, position_ids, ref_ids, top_k, references, table);
    for (int64_t r = 0; r < top_k; ++r) check_reference("deltakv_rebuild", ref_ids[block_ids[i] * top_k + r], ref_position_ids, table);
  }
  auto z = at::empty({n, 2 * code_bytes}, decoder.options());
  auto sums = at::empty({n, width}, decoder.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, ref_keys.scalar_type(), "deltakv_rebuild", [&] {
    codes_and_reference_sums<scalar_t>(block_ids, n, codes.data_ptr<uint8_t>(), code_bytes, code_zero.data_ptr<at::Half>(),
                                       code_scale.data_ptr<at::Half>(), ref_ids, top_k, ref_keys.data_ptr<scalar_t>(),
                                       ref_values.data_ptr<scalar_t>(), ref_positions.data_ptr<int32_t>(), rotary.data_ptr<float>(),
                                       heads, head_dim, z.data_ptr<float>(), sums.data_ptr<float>());
  });
  // z · decoder[l], one product per layer the tokens are of (a layer's read: one)
  std::vector<std::vector<int64_t>> rows_of(layer_count);
  for (int64_t i = 0; i < n; ++i) rows_of[layer_ids[block_ids[i]]].push_back(i);
  at::Tensor decoded;
  for (int64_t layer = 0; layer < layer_count; ++layer) {
    if (rows_of[layer].empty()) continue;
    if (static_cast<int64_t>(rows_of[layer].size()) == n) {
      decoded = at::mm(z, decoder[layer]);
      break;
    }
    if (!decoded.defined()) decoded = at::empty({n, width}, decoder.options());
    auto rows = at::tensor(rows_of[layer], entries.options());
    decoded.index_copy_(0, rows, at::mm(z.index_select(0, rows), decoder[layer]));
  }
  if (!decoded.defined()) decoded = at::empty({n, width}, decoder.options());
  auto keys = at::empty({n, heads, head_dim}, decoder.options());
  auto values = at::empty({n, heads, head_dim}, decoder.options());
  finish(block_ids, n, decoded.data_ptr<float>(), sums.data_ptr<float>(), top_k, positions.data_ptr<int32_t>(), layer_ids,
         scale.data_ptr<float>(), rotary.data_ptr<float>(), heads, head_dim, keys.data_ptr<float>(), values.data_ptr<float>());
  auto entry_keys = at::empty({m, head_dim}, decoder.options());
  auto entry_values = at::empty({m, head_dim}, decoder.options());
  const float* token_keys = keys.data_ptr<float>();
  const float* token_values = values.data_ptr<float>();
  float* out_keys = entry_keys.data_ptr<float>();
  float* out_values = entry_values.data_ptr<float>();
  at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // each entry: its token's row, its head's keys and values
      const int64_t token = std::lower_bound(unique.begin(), unique.end(), entry_ids[i] / heads) - unique.begin();
      const int64_t row = (token * heads + entry_ids[i] % heads) * head_dim;
      std::copy(token_keys + row, token_keys + row + head_dim, out_keys + i * head_dim);
      std::copy(token_values + row, token_values + row + head_dim, out_values + i * head_dim);
    }
  });
  return {entry_keys, entry_values};
}

// ----- the decoding read in place ------------------------------------------------------------------------------------------
// `deltakv_decode`: read/paged.py's `paged_decode` contract over slot tables that name plain slots, DeltaKV's reference tier
// and its code tier (read/paged.py's `DeltaKVBlocks`), its PyTorch path (`paged_decode_torch`, every coded entry rebuilt by
// `decode_torch`) the reference. No coded entry's keys or values are written out whole:
//   1. the coded tokens the tables name, each once, and the references they name: each reference's keys rotated back to
//      no position (U_r); where the decoder is not as a checkpoint stores it, each token's code z = zero + step · c in
//      floats and the key half of the product z · W_K for every named token at once (float32);
//   2. per (row, KV head, chunk of its entries: DecodeTasks), a softmax in float32. A coded entry's key is made where its logit
//      is taken: RoPE_t(part ⊙ s_K + Σ_r U_r / k), its head's part of z · W_K taken there in exact integers where the
//      decoder is as a checkpoint stores it (int8 columns W = steps ⊙ codes): z · W = steps ⊙ (zero · Σ_c codes +
//      step · (c · codes)), c · codes over its 4-bit c in AVX512-VNNI's or AVX2's byte products (`key_product`). Its
//      value never is: values carry no RoPE, so
//        Σ p_i v̂_i = ((Σ p_i z_i) · W_V) ⊙ s_V + Σ_r (Σ_{i names r} p_i / k) v_r,
//      the chunk keeping Σ p z as Σ p·zero and Σ (p·step) c, and each reference's weight (a reference read as an entry
//      adds its p there too), its value read once per chunk. The merge projects Σ p z by the head's value columns once
//      per query head.
// Tables that name plain slots only (the layers DeltaKV leaves raw) go to `paged_decode` whole.
namespace {

// What one entry of a table is: a hole, a plain slot, a reference (raw, in the reference tier) or a coded token, and the
// row it reads (the entry's own head).
enum class Entry : uint8_t { hole, plain, reference, coded };

struct Tiers {
  int64_t shift, mask, code_tier, reference_tier, num_slots, references, codes, heads;
};

inline Entry entry_of(int64_t id, const Tiers& t, int64_t& row) {
  row = 0;
  if (id == 0) return Entry::hole;
  const int64_t tier = id >> t.shift, e = id & t.mask;
  if (tier == 0 && id < t.num_slots) {
    row = id;
    return Entry::plain;
  }
  if (tier == t.reference_tier && e / t.heads < t.references) {
    row = e;
    return Entry::reference;
  }
  if (tier == t.code_tier && e / t.heads >= 1 && e / t.heads < t.codes) {
    row = e;
    return Entry::coded;
  }
  return Entry::hole;
}

// A sparse set of ids below a bound, kept by the calling thread from call to call (its pages already in memory): `slot`
// needs no clearing, an id is in the set when the dense list names it back.
struct SparseSet {
  std::vector<int32_t> slot;
  std::vector<int64_t> ids;
  void reset(int64_t bound) {
    if (static_cast<int64_t>(slot.size()) < bound) slot.resize(bound);
    ids.clear();
  }
  int64_t find(int64_t id) const {
    const int32_t at = slot[id];
    return at >= 0 && at < static_cast<int64_t>(ids.size()) && ids[at] == id ? at : -1;
  }
  int64_t insert(int64_t id) {  // its index, added if new
    const int64_t at = find(id);
    if (at >= 0) return at;
    slot[id] = static_cast<int32_t>(ids.size());
    ids.push_back(id);
    return static_cast<int64_t>(ids.size()) - 1;
  }
};

// Phase 1's view of the named tokens, for phase 2: token i (the index the tables' coded entries map to) is block
// blocks[i], its 4-bit code packed[blocks[i] · d_c / 2 ..]; the key half of its product part [H·d] is
//   stored: steps ⊙ (zero_b · key_sums + step_b · (c · quads))   else: floats[i];
// its k references are the named references token_refs[i · k ..], each's keys rotated back at unrotated[r] [H·d] and its
// reference-tier row at references[r].
struct Coded {
  const int64_t* blocks;
  const uint8_t* packed;
  int64_t code_width;
  const at::Half* zeros;
  const at::Half* steps_of_token;
  const int8_t* quads;  // the layer's key columns in 8 bits, four code channels together: [d_c / 4, H·d, 4]
  const float* floats;
  const float* column_steps;
  const float* column_sums;
  const float* key_scale;  // the layer's s_K [H·d]
  const int32_t* token_refs;
  int64_t top_k;
  const int64_t* references;
  const float* unrotated;
  const int32_t* positions;
  const float* rotary;
};

// c · W for one head: Σ_c codes[c] · W[c, first + j] [d] int32, exact, of codes [d_c] (each 0-15) and the layer's int8 columns
// in quads [d_c / 4, columns, 4] (W[4q + i, j] at (q · columns + j) · 4 + i). With AVX512-VNNI, sixteen columns a register:
// four codes broadcast against each column's four weights, the four products summed into 32 bits in one instruction
// (`dpbusd`), the quads split over four chains of sums so that no instruction waits on the one before. With AVX2, eight
// columns a register: four codes broadcast against each column's four weights in one byte product (`maddubs`: a pair's
// products summed in 16 bits, |sum| ≤ 2 · 15 · 128), eight quads' pairs summed in 16 bits (≤ 30720: never saturated), then
// into 32 bits.
inline void key_product(const uint8_t* codes, int64_t code_width, const int8_t* quads, int64_t columns, int64_t first, int64_t d,
                        int32_t* out) {
  const int64_t quad_count = code_width / 4;
  int64_t j = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  constexpr int CHAINS = 4;
  const auto broadcast_codes = [&](int64_t q) {
    int32_t four;
    std::memcpy(&four, codes + 4 * q, 4);
    return _mm512_set1_epi32(four);
  };
  for (; j + 64 <= d; j += 64) {  // four registers of columns, each summed in CHAINS chains over the quads
    __m512i acc[CHAINS][4];
    for (int c = 0; c < CHAINS; ++c)
      for (int b = 0; b < 4; ++b) acc[c][b] = _mm512_setzero_si512();
    int64_t q = 0;
    for (; q + CHAINS <= quad_count; q += CHAINS)
      for (int c = 0; c < CHAINS; ++c) {
        const __m512i a = broadcast_codes(q + c);
        const int8_t* row = quads + ((q + c) * columns + first + j) * 4;
        for (int b = 0; b < 4; ++b) acc[c][b] = _mm512_dpbusd_epi32(acc[c][b], a, _mm512_loadu_si512(row + 64 * b));
      }
    for (; q < quad_count; ++q) {
      const __m512i a = broadcast_codes(q);
      const int8_t* row = quads + (q * columns + first + j) * 4;
      for (int b = 0; b < 4; ++b) acc[0][b] = _mm512_dpbusd_epi32(acc[0][b], a, _mm512_loadu_si512(row + 64 * b));
    }
    for (int b = 0; b < 4; ++b)
      _mm512_storeu_si512(out + j + 16 * b, _mm512_add_epi32(_mm512_add_epi32(acc[0][b], acc[1][b]), _mm512_add_epi32(acc[2][b], acc[3][b])));
  }
  for (; j + 16 <= d; j += 16) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t q = 0; q < quad_count; ++q)
      acc = _mm512_dpbusd_epi32(acc, broadcast_codes(q), _mm512_loadu_si512(quads + (q * columns + first + j) * 4));
    _mm512_storeu_si512(out + j, acc);
  }
#endif
#if defined(__AVX2__)
  constexpr int64_t QUADS_IN_16_BITS = 8;
  const __m256i ones = _mm256_set1_epi16(1);
  const auto four_codes = [&](int64_t q) {
    int32_t four;
    std::memcpy(&four, codes + 4 * q, 4);
    return _mm256_set1_epi32(four);
  };
  for (; j + 32 <= d; j += 32) {  // four registers of sums held across the code channels
    __m256i acc[4];
    for (int b = 0; b < 4; ++b) acc[b] = _mm256_setzero_si256();
    for (int64_t q0 = 0; q0 < quad_count; q0 += QUADS_IN_16_BITS) {
      __m256i pairs[4];
      for (int b = 0; b < 4; ++b) pairs[b] = _mm256_setzero_si256();
      for (int64_t q = q0; q < std::min(quad_count, q0 + QUADS_IN_16_BITS); ++q) {
        const __m256i a = four_codes(q);
        const int8_t* row = quads + (q * columns + first + j) * 4;
        for (int b = 0; b < 4; ++b)
          pairs[b] = _mm256_add_epi16(pairs[b], _mm256_maddubs_epi16(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * b))));
      }
      for (int b = 0; b < 4; ++b) acc[b] = _mm256_add_epi32(acc[b], _mm256_madd_epi16(pairs[b], ones));
    }
    for (int b = 0; b < 4; ++b) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j + 8 * b), acc[b]);
  }
  for (; j + 8 <= d; j += 8) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t q0 = 0; q0 < quad_count; q0 += QUADS_IN_16_BITS) {
      __m256i pairs = _mm256_setzero_si256();
      for (int64_t q = q0; q < std::min(quad_count, q0 + QUADS_IN_16_BITS); ++q)
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(four_codes(q), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                                                                   quads + (q * columns + first + j) * 4))));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), acc);
  }
#endif
  for (; j < d; ++j) {
    int32_t sum = 0;
    for (int64_t c = 0; c < code_width; ++c) sum += static_cast<int32_t>(codes[c]) * quads[((c / 4) * columns + first + j) * 4 + c % 4];
    out[j] = sum;
  }
}

constexpr int64_t MAX_TOP_K = 16;  // references a coded token may average (the codecs trained: 4)

// Coded token i's key of head h [d]: RoPE at its position of (part ⊙ s_K + Σ_r U_r / k). `codes` [d_c] and `product` [d]:
// scratch.
void coded_key(const Coded& c, int64_t i, int64_t h, int64_t d, int64_t heads, uint8_t* codes, int32_t* product, float* x,
               float* key) {
  const int64_t b = c.blocks[i], columns = heads * d, first = h * d;
  const float* scale = c.key_scale + first;
  if (c.quads != nullptr) {
    const float zero = to_float(c.zeros[b]), step = to_float(c.steps_of_token[b]);
    const float* steps = c.column_steps + first;
    const float* sums = c.column_sums + first;
    unpack_nibbles(c.packed + b * (c.code_width / 2), c.code_width / 2, codes);
    key_product(codes, c.code_width, c.quads, columns, first, d, product);
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) x[j] = steps[j] * (zero * sums[j] + step * static_cast<float>(product[j])) * scale[j];
  } else {
    const float* part = c.floats + i * columns + first;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) x[j] = part[j] * scale[j];
  }
  const float* u[MAX_TOP_K];  // its references' keys rotated back, this head's
  for (int64_t r = 0; r < c.top_k; ++r) u[r] = c.unrotated + c.token_refs[i * c.top_k + r] * columns + first;
  const float share = 1.f / static_cast<float>(c.top_k);
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 share8 = _mm256_set1_ps(share);
  for (; j + 8 <= d; j += 8) {  // + Σ_r U_r / k, the sum held in a register across the references
    __m256 sum = _mm256_loadu_ps(x + j);
    for (int64_t r = 0; r < c.top_k; ++r) sum = _mm256_fmadd_ps(_mm256_loadu_ps(u[r] + j), share8, sum);
    _mm256_storeu_ps(x + j, sum);
  }
#endif
  for (; j < d; ++j)
    for (int64_t r = 0; r < c.top_k; ++r) x[j] += u[r][j] * share;
  rotate<false>(x, c.rotary + static_cast<int64_t>(c.positions[b]) * d, d, key);
}

// One chunk's sums: acc [G, d] (Σ p v over plain entries and, at the end, over references by their weights), zero_sums [G]
// (Σ p·zero) and code_sums [G, d_c] (Σ (p·step) c) over coded entries, the max m [G] and sum l [G].
struct ChunkSums {
  float *acc, *zero_sums, *code_sums, *m, *l;
};

// Σ (p·step) c over a chunk's coded entries `at` (token index rows[i] of chunk entry i), for each query g of probabilities
// probs [G, n]: code_sums [G, d_c] += Σ_i probs[g, i] · step_i · c_i, CODES_AT_ONCE entries at a time (each channel's sum
// held across them, not stored back after every entry).
constexpr int64_t CODES_AT_ONCE = 8;
void accumulate_codes(const Coded& coded, const int64_t* rows, const std::vector<int64_t>& at, const float* probs, int64_t n,
                      int64_t groups, float* code_sums) {
  const int64_t width = coded.code_width;
  std::vector<float> batch(CODES_AT_ONCE * width, 0.f);  // the entries' codes as floats, a row each (unused rows: 0)
  std::vector<uint8_t> codes(width);
  float steps[CODES_AT_ONCE];
  const int64_t count = static_cast<int64_t>(at.size());
  for (int64_t first = 0; first < count; first += CODES_AT_ONCE) {
    const int64_t taken = std::min(CODES_AT_ONCE, count - first);
    for (int64_t e = 0; e < taken; ++e) {
      const int64_t b = coded.blocks[rows[at[first + e]]];
      steps[e] = to_float(coded.steps_of_token[b]);
      unpack_nibbles(coded.packed + b * (width / 2), width / 2, codes.data());
      float* row = batch.data() + e * width;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) row[j] = static_cast<float>(codes[j]);
    }
    for (int64_t g = 0; g < groups; ++g) {
      float w[CODES_AT_ONCE] = {};
      for (int64_t e = 0; e < taken; ++e) w[e] = probs[g * n + at[first + e]] * steps[e];
      float* sums = code_sums + g * width;
      const float* c = batch.data();
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        float sum = sums[j];
        for (int64_t e = 0; e < CODES_AT_ONCE; ++e) sum += w[e] * c[e * width + j];
        sums[j] = sum;
      }
    }
  }
}

// Phase 2 for one chunk [begin, end) of head h of a row. `tokens` maps a coded block to its named index, `named_refs` a
// reference-tier token to its.
template <typename scalar_t>
void read_chunk(const float* q, int64_t groups, int64_t d, int64_t h, const Tiers& tiers, const int32_t* slots, int64_t entry_stride,
                const float* weights, int64_t weight_stride, int64_t begin, int64_t end, const scalar_t* keys, const scalar_t* values,
                const scalar_t* ref_keys, const scalar_t* ref_values, const Coded& coded, const SparseSet& tokens,
                const SparseSet& named_refs, ChunkSums out, float* scores, int64_t scores_stride) {
  const int64_t n = end - begin, heads = tiers.heads, width = coded.code_width, top_k = coded.top_k;
  std::vector<float> logits(groups * n), x(d), key(d);
  std::vector<uint8_t> codes(width);
  std::vector<int32_t> product(d);
  std::vector<int64_t> rows(n);  // a plain slot's row, else the chunk's index of its token or reference
  std::vector<int32_t> weighed(n * top_k);  // the chunk's index of each reference an entry weighs (a reference: itself)
  std::vector<Entry> kinds(n);
  thread_local SparseSet chunk_refs;  // the named references this chunk weighs
  chunk_refs.reset(static_cast<int64_t>(named_refs.ids.size()));
  for (int64_t i = 0; i < n; ++i) {
    int64_t row;
    const Entry kind = entry_of(slots[(begin + i) * entry_stride], tiers, row);
    kinds[i] = kind;
    rows[i] = row;
    const float bias = weights ? weights[(begin + i) * weight_stride] : 0.f;
    const float* k = nullptr;
    const scalar_t* stored_key = nullptr;
    if (kind == Entry::plain) stored_key = keys + row * d;
    else if (kind == Entry::reference) {
      stored_key = ref_keys + row * d;
      weighed[i * top_k] = static_cast<int32_t>(chunk_refs.insert(named_refs.find(row / heads)));
    } else if (kind == Entry::coded) {
      const int64_t token = tokens.find(row / heads);
      rows[i] = token;
      coded_key(coded, token, h, d, heads, codes.data(), product.data(), x.data(), key.data());
      k = key.data();
      for (int64_t r = 0; r < top_k; ++r) weighed[i * top_k + r] = static_cast<int32_t>(chunk_refs.insert(coded.token_refs[token * top_k + r]));
    }
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = q + g * d;
      logits[g * n + i] = stored_key ? dot(qg, stored_key, d) + bias : (k ? dot(qg, k, d) + bias : NEG_INF);
    }
  }
  if (scores)
    for (int64_t g = 0; g < groups; ++g) std::copy(logits.data() + g * n, logits.data() + (g + 1) * n, scores + g * scores_stride + begin);
  for (int64_t g = 0; g < groups; ++g) {  // each query's softmax numerators, in place of its logits
    float* p = logits.data() + g * n;
    float top = NEG_INF;
    for (int64_t i = 0; i < n; ++i) top = std::max(top, p[i]);
    out.m[g] = top;
    float total = 0.f;
    if (top != NEG_INF) {
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < n; ++i) {
        p[i] = exp_float(p[i] - top);  // holes: 0
        total += p[i];
      }
    } else {
      std::fill(p, p + n, 0.f);
    }
    out.l[g] = total;
  }
  std::fill(out.acc, out.acc + groups * d, 0.f);
  std::fill(out.code_sums, out.code_sums + groups * width, 0.f);
  std::vector<float> ref_weights(chunk_refs.ids.size() * groups, 0.f);  // [chunk's references, G]
  std::vector<float> zeros(n, 0.f);  // a coded entry's zero point, else 0
  std::vector<int64_t> coded_at;     // the chunk's coded entries
  const float share = 1.f / static_cast<float>(top_k);
  for (int64_t i = 0; i < n; ++i) {
    if (kinds[i] == Entry::plain) {
      for (int64_t g = 0; g < groups; ++g) axpy(out.acc + g * d, logits[g * n + i], values + rows[i] * d, d);
    } else if (kinds[i] == Entry::reference) {
      for (int64_t g = 0; g < groups; ++g) ref_weights[weighed[i * top_k] * groups + g] += logits[g * n + i];
    } else if (kinds[i] == Entry::coded) {
      zeros[i] = to_float(coded.zeros[coded.blocks[rows[i]]]);
      coded_at.push_back(i);
      for (int64_t r = 0; r < top_k; ++r)
        for (int64_t g = 0; g < groups; ++g) ref_weights[weighed[i * top_k + r] * groups + g] += logits[g * n + i] * share;
    }
  }
  for (int64_t g = 0; g < groups; ++g) {  // Σ p·zero
    const float* p = logits.data() + g * n;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += p[i] * zeros[i];
    out.zero_sums[g] = sum;
  }
  accumulate_codes(coded, rows.data(), coded_at, logits.data(), n, groups, out.code_sums);
  for (int64_t at = 0; at < static_cast<int64_t>(chunk_refs.ids.size()); ++at) {  // each reference's value, read once
    const scalar_t* v = ref_values + (coded.references[chunk_refs.ids[at]] * heads + h) * d;
    for (int64_t g = 0; g < groups; ++g)
      if (ref_weights[at * groups + g] != 0.f) axpy(out.acc + g * d, ref_weights[at * groups + g], v, d);
  }
}

// Every named reference's keys rotated back to no position [H·d] (U_r), float32.
template <typename scalar_t>
void unrotate_references(const std::vector<int64_t>& named, const scalar_t* ref_keys, const int32_t* ref_positions, const float* rotary,
                         int64_t heads, int64_t d, float* unrotated) {
  at::parallel_for(0, static_cast<int64_t>(named.size()), 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* rotary_row = rotary + static_cast<int64_t>(ref_positions[named[i]]) * d;
      for (int64_t h = 0; h < heads; ++h)
        rotate<true>(ref_keys + (named[i] * heads + h) * d, rotary_row, d, unrotated + (i * heads + h) * d);
    }
  });
}

// Every named token's code z = zero + step · c [n, d_c] in floats (c its 4-bit integers).
void unpack_codes(const std::vector<int64_t>& named, const uint8_t* codes, int64_t code_bytes, const at::Half* zeros,
                  const at::Half* steps, float* z) {
  at::parallel_for(0, static_cast<int64_t>(named.size()), 64, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch(2 * code_bytes);
    for (int64_t i = begin; i < end; ++i)
      code_floats(codes + named[i] * code_bytes, code_bytes, to_float(zeros[named[i]]), to_float(steps[named[i]]), scratch.data(),
                  z + i * 2 * code_bytes);
  });
}

// Whether the tables name no entry of a tier (every id a plain slot or a hole), read in one pass with no branch per
// entry: the layers DeltaKV leaves raw skip the first pass's lookups. Shapes and slots are checked by the read they go to.
bool names_plain_slots_only(const std::vector<at::Tensor>& tables, const int64_t* length, int64_t heads, int64_t tier_shift) {
  uint32_t tiers = 0;
  for (size_t r = 0; r < tables.size(); ++r) {
    const at::Tensor& t = tables[r];
    if (t.dim() != 2 || t.scalar_type() != at::kInt || t.size(0) != heads) return false;  // the first pass refuses it
    const int32_t* slots = t.data_ptr<int32_t>();
    for (int64_t h = 0; h < heads; ++h) {
      const int32_t* row = slots + h * t.stride(0);
      const int64_t n = std::min(length[r * heads + h], t.size(1)), stride = t.stride(1);
      for (int64_t j = 0; j < n; ++j) tiers |= static_cast<uint32_t>(row[j * stride]) >> tier_shift;
    }
  }
  return tiers == 0;
}

}  // namespace

std::vector<at::Tensor> deltakv_decode(const at::Tensor& queries, double scaling, const at::Tensor& keys, const at::Tensor& values,
                                       const std::vector<at::Tensor>& tables, const at::Tensor& lengths,
                                       const std::vector<at::Tensor>& weights, int64_t tier_shift, int64_t code_tier, int64_t reference_tier,
                                       const at::Tensor& codes, const at::Tensor& code_zero, const at::Tensor& code_scale,
                                       const at::Tensor& refs, const at::Tensor& positions, const at::Tensor& layers,
                                       const at::Tensor& ref_keys, const at::Tensor& ref_values, const at::Tensor& ref_positions,
                                       const at::Tensor& decoder, const at::Tensor& scale, const at::Tensor& key_codes,
                                       const at::Tensor& key_steps, const at::Tensor& key_sums, const at::Tensor& rotary, at::Tensor scores) {
  TORCH_CHECK(queries.dim() == 3 && at::isFloatingType(queries.scalar_type()), "query: [R, Hq, d], float32, bfloat16 or float16");
  const at::Tensor query = scaled_query(queries, static_cast<float>(scaling));
  const int64_t rows = query.size(0), hq = query.size(1), d = query.size(2);
  TORCH_CHECK(keys.dim() == 2 && keys.is_contiguous() && values.is_contiguous() && keys.sizes() == values.sizes() &&
                  keys.scalar_type() == values.scalar_type() && keys.size(1) == d,
              "keys and values: [S, d] of one dtype, contiguous, d as the query's");
  TORCH_CHECK(lengths.dim() == 2 && lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.size(0) == rows,
              "lengths: int64 [R, H]");
  const int64_t heads = lengths.size(1);
  TORCH_CHECK(heads > 0 && hq % heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(static_cast<int64_t>(tables.size()) == rows && weights.size() == tables.size(), "one table and one weight table per row");
  TORCH_CHECK(tier_shift > 0 && tier_shift < 31 && code_tier >= 1 && reference_tier >= 1 && code_tier != reference_tier,
              "tiers: the code tier and the reference tier, two tiers 1-15 of shift 1-30");
  check_codec_arrays(codes, code_zero, code_scale, refs, positions, layers, ref_keys, ref_values, ref_positions, decoder, scale, rotary);
  TORCH_CHECK(ref_keys.size(1) == heads && ref_keys.size(2) == d && ref_keys.scalar_type() == keys.scalar_type(),
              "ref_keys, ref_values: [R, H, d] in the pool's dtype, H and d the query's");
  const int64_t total = codes.size(0), code_width = 2 * codes.size(1), width = 2 * heads * d;
  const bool stored = key_codes.numel() > 0;
  TORCH_CHECK(!stored || (key_codes.dim() == 4 && key_codes.size(0) == decoder.size(0) && 4 * key_codes.size(1) == code_width &&
                          key_codes.size(2) == heads * d && key_codes.size(3) == 4 && key_codes.scalar_type() == at::kChar &&
                          key_codes.is_contiguous() &&
                          key_steps.sizes() == at::IntArrayRef({decoder.size(0), heads * d}) && key_sums.sizes() == key_steps.sizes() &&
                          key_steps.scalar_type() == at::kFloat && key_sums.scalar_type() == at::kFloat && key_steps.is_contiguous() &&
                          key_sums.is_contiguous()),
              "key_codes: int8 [L, d_c / 4, H·d, 4] (the decoder's key columns in 8 bits, four code channels together), key_steps and "
              "key_sums: float32 [L, H·d]; or empty");
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t longest = lengths.numel() ? *std::max_element(length, length + lengths.numel()) : 0;
  if (scores.numel() > 0)
    TORCH_CHECK(scores.dim() == 3 && scores.scalar_type() == at::kFloat && scores.is_contiguous() && scores.size(0) == rows &&
                    scores.size(1) == hq && scores.size(2) >= longest,
                "scores: float32 [R, Hq, L], contiguous, L at least every head's length");
  const Tiers tiers{tier_shift, (int64_t{1} << tier_shift) - 1, code_tier, reference_tier, keys.size(0), ref_keys.size(0), total, heads};

  if (names_plain_slots_only(tables, length, heads, tier_shift))  // a layer DeltaKV leaves raw: the plain read, with its vectorized paths
    return paged_decode(queries, scaling, keys, values, tables, lengths, weights, tier_shift, {}, {}, scores);

  // phase 1: the coded tokens named, each once, and the references they and the tables name, every id checked before any work
  thread_local SparseSet named_tokens, named_references;  // the calling thread's: the parallel regions below read them by reference
  SparseSet& tokens = named_tokens;
  SparseSet& references = named_references;
  std::vector<int32_t> token_refs;  // each named token's references, as their index among the named
  tokens.reset(total);
  references.reset(tiers.references);
  const int32_t* ref_ids = refs.data_ptr<int32_t>();
  const int16_t* layer_ids = layers.data_ptr<int16_t>();
  const int32_t* position_ids = positions.data_ptr<int32_t>();
  const int32_t* ref_position_ids = ref_positions.data_ptr<int32_t>();
  const int64_t top_k = refs.size(1), table_rows = rotary.size(0);
  TORCH_CHECK(top_k >= 1 && top_k <= MAX_TOP_K, "deltakv_decode: a coded token averages 1 to ", MAX_TOP_K, " references, not ", top_k);
  int64_t layer = -1;
  for (int64_t r = 0; r < rows; ++r) {
    const at::Tensor& t = tables[r];
    TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kInt && t.size(0) == heads, "a slot table: int32 [H, L]");
    TORCH_CHECK(*std::max_element(length + r * heads, length + (r + 1) * heads) <= t.size(1), "a head is longer than its slot table");
    const int32_t* slots = t.data_ptr<int32_t>();
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < length[r * heads + h]; ++j) {
        const int64_t id = slots[h * t.stride(0) + j * t.stride(1)];
        int64_t row;
        const Entry kind = entry_of(id, tiers, row);
        TORCH_CHECK(id == 0 || kind != Entry::hole, "deltakv_decode: a slot table names a slot outside the pool, or an entry of a tier "
                    "it was not given (", id, ")");
        if (kind == Entry::reference) references.insert(row / heads);
        if (kind != Entry::coded) continue;
        const int64_t b = row / heads;
        if (tokens.find(b) >= 0) continue;
        TORCH_CHECK(layer < 0 || layer_ids[b] == layer, "deltakv_decode: the tables name coded tokens of layers ", layer, " and ",
                    layer_ids[b], " (one read is one layer's)");
        check_token("deltakv_decode", b, layer_ids, decoder.size(0), position_ids, ref_ids, top_k, tiers.references, table_rows);
        layer = layer_ids[b];
        tokens.insert(b);
        for (int64_t k = 0; k < top_k; ++k) token_refs.push_back(static_cast<int32_t>(references.insert(ref_ids[b * top_k + k])));
      }
  }
  for (const int64_t ref : references.ids) check_reference("deltakv_decode", ref, ref_position_ids, table_rows);  // each once
  const int64_t n = static_cast<int64_t>(tokens.ids.size()), named_refs = static_cast<int64_t>(references.ids.size());
  auto unrotated = at::empty({named_refs, heads * d}, decoder.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys.scalar_type(), "deltakv_decode_references", [&] {
    unrotate_references<scalar_t>(references.ids, ref_keys.data_ptr<scalar_t>(), ref_position_ids, rotary.data_ptr<float>(), heads, d,
                                  unrotated.data_ptr<float>());
  });
  const int64_t key_layer = std::max<int64_t>(layer, 0);  // tables naming references and no coded token: no product is read
  at::Tensor product;  // z · W_K [n, H·d] in float32, where the columns are not stored in 8 bits (else taken per entry)
  if (n > 0 && !stored) {
    auto z = at::empty({n, code_width}, decoder.options());
    unpack_codes(tokens.ids, codes.data_ptr<uint8_t>(), codes.size(1), code_zero.data_ptr<at::Half>(), code_scale.data_ptr<at::Half>(),
                 z.data_ptr<float>());
    product = at::mm(z, decoder[key_layer].narrow(1, 0, heads * d));
  }
  const Coded coded{tokens.ids.data(), codes.data_ptr<uint8_t>(), code_width, code_zero.data_ptr<at::Half>(), code_scale.data_ptr<at::Half>(),
                    stored ? key_codes.data_ptr<int8_t>() + key_layer * code_width * heads * d : nullptr,
                    n > 0 && !stored ? product.data_ptr<float>() : nullptr,
                    stored ? key_steps.data_ptr<float>() + key_layer * heads * d : nullptr,
                    stored ? key_sums.data_ptr<float>() + key_layer * heads * d : nullptr, scale.data_ptr<float>() + key_layer * width,
                    token_refs.data(), top_k, references.ids.data(), unrotated.data_ptr<float>(), position_ids, rotary.data_ptr<float>()};

  // phase 2: every (row, head) in chunks, then merged by log-sum-exp, Σ p z projected by the head's value columns
  const int64_t groups = hq / heads;
  const DecodeTasks tasks(length, rows * heads, 16);  // more chunks than the plain read: its entries cost more each
  const int64_t count = tasks.count();
  std::vector<float> acc(count * groups * d), zero_sums(count * groups), code_sums(count * groups * code_width), m(count * groups),
      l(count * groups);
  float* score = scores.numel() ? scores.data_ptr<float>() : nullptr;
  const int64_t score_stride = scores.numel() ? scores.size(2) : 0;
  const float* q = query.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys.scalar_type(), "deltakv_decode", [&] {
    const scalar_t* k = keys.data_ptr<scalar_t>();
    const scalar_t* v = values.data_ptr<scalar_t>();
    const scalar_t* rk = ref_keys.data_ptr<scalar_t>();
    const scalar_t* rv = ref_values.data_ptr<scalar_t>();
    tasks.for_each([&](int64_t t) {
      const int64_t rh = tasks.owner[t], r = rh / heads, h = rh % heads;
      const at::Tensor& table = tables[r];
      const at::Tensor& w = weights[r];
      const float* wp = w.numel() ? w.data_ptr<float>() + h * w.stride(0) : nullptr;
      const ChunkSums sums{acc.data() + t * groups * d, zero_sums.data() + t * groups, code_sums.data() + t * groups * code_width,
                           m.data() + t * groups, l.data() + t * groups};
      read_chunk<scalar_t>(q + (r * hq + h * groups) * d, groups, d, h, tiers, table.data_ptr<int32_t>() + h * table.stride(0),
                           table.stride(1), wp, w.numel() ? w.stride(1) : 0, tasks.begin(t), tasks.end(t), k, v, rk, rv, coded, tokens,
                           references, sums, score ? score + (r * hq + h * groups) * score_stride : nullptr, score_stride);
    });
  });
  auto out = at::zeros({rows, hq, d}, query.options());
  auto lse = at::empty({rows, hq}, query.options());
  float* o = out.data_ptr<float>();
  float* s = lse.data_ptr<float>();
  const float* value_columns = decoder.data_ptr<float>() + key_layer * code_width * width + heads * d;
  const float* value_scale = scale.data_ptr<float>() + key_layer * width + heads * d;
  at::parallel_for(0, rows * heads, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> projected(d), merged(code_width);
    for (int64_t rh = lo; rh < hi; ++rh) {
      const int64_t r = rh / heads, h = rh % heads;
      for (int64_t g = 0; g < groups; ++g) {
        float* dst = o + (r * hq + h * groups + g) * d;
        float zero_sum = 0.f;
        std::fill(merged.begin(), merged.end(), 0.f);
        const auto [top, total] = merge_chunks(tasks, rh, m.data(), l.data(), groups, g, [&](int64_t t, float factor) {
          zero_sum += zero_sums[t * groups + g] * factor;
          axpy(dst, factor, acc.data() + (t * groups + g) * d, d);
          axpy(merged.data(), factor, code_sums.data() + (t * groups + g) * code_width, code_width);
        });
        s[r * hq + h * groups + g] = top;
        if (top == NEG_INF) continue;  // the head holds nothing: output 0, lse -inf
        if (layer >= 0) {  // (Σ p z) · W_V ⊙ s_V, Σ p z = Σ p·zero + Σ (p·step) c
          std::fill(projected.begin(), projected.end(), 0.f);
          for (int64_t c = 0; c < code_width; ++c) axpy(projected.data(), merged[c] + zero_sum, value_columns + c * width + h * d, d);
          for (int64_t j = 0; j < d; ++j) dst[j] += projected[j] * value_scale[h * d + j];
        }
        for (int64_t j = 0; j < d; ++j) dst[j] /= total;
        s[r * hq + h * groups + g] = top + std::log(total);
      }
    }
  });
  return {in_dtype(out, queries.scalar_type()), lse};
}
