// DeltaKV's coded entries rebuilt: a pass per token before and after one matrix product per layer. The contract is
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

#include <algorithm>
#include <vector>

namespace {

// Pass 1, per token: its code z [d_c] and the sum of its references' vectors [2·H·d] (keys rotated back).
template <typename scalar_t>
void codes_and_reference_sums(const int64_t* blocks, int64_t n, const uint8_t* codes, int64_t code_bytes, const at::Half* zeros,
                              const at::Half* scales, const int32_t* refs, int64_t top_k, const scalar_t* ref_keys,
                              const scalar_t* ref_values, const int32_t* ref_positions, const float* rotary, int64_t heads,
                              int64_t head_dim, float* z, float* sums) {
  const int64_t half = head_dim / 2, width = 2 * heads * head_dim;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = blocks[i];
      const float zero = static_cast<float>(zeros[b]), step = static_cast<float>(scales[b]);
      const uint8_t* code = codes + b * code_bytes;
      float* zi = z + i * 2 * code_bytes;
      for (int64_t c = 0; c < code_bytes; ++c) {
        zi[2 * c] = zero + static_cast<float>(code[c] & 15) * step;
        zi[2 * c + 1] = zero + static_cast<float>(code[c] >> 4) * step;
      }
      float* sum = sums + i * width;
      std::fill(sum, sum + width, 0.0f);
      for (int64_t r = 0; r < top_k; ++r) {
        const int64_t ref = refs[b * top_k + r];
        const float* cosines = rotary + static_cast<int64_t>(ref_positions[ref]) * head_dim;
        const float* sines = cosines + half;
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* k = ref_keys + (ref * heads + h) * head_dim;
          const scalar_t* v = ref_values + (ref * heads + h) * head_dim;
          float* sk = sum + h * head_dim;
          float* sv = sum + (heads + h) * head_dim;
          for (int64_t j = 0; j < half; ++j) {  // rotated back: k·cos − rotate_half(k)·sin
            const float first = static_cast<float>(k[j]), second = static_cast<float>(k[j + half]);
            sk[j] += first * cosines[j] + second * sines[j];
            sk[j + half] += second * cosines[j] - first * sines[j];
          }
          for (int64_t j = 0; j < head_dim; ++j) sv[j] += static_cast<float>(v[j]);
        }
      }
    }
  });
}

// Pass 2, per token: x = decoded ⊙ scale[l] + sums / k, its keys rotated to the token's position.
void finish(const int64_t* blocks, int64_t n, const float* decoded, const float* sums, int64_t top_k, const int32_t* positions,
            const int16_t* layers, const float* scale, const float* rotary, int64_t heads, int64_t head_dim, float* keys,
            float* values) {
  const int64_t half = head_dim / 2, width = 2 * heads * head_dim;
  const float count = static_cast<float>(top_k);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> x(width);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = blocks[i];
      const float* s = scale + static_cast<int64_t>(layers[b]) * width;
      for (int64_t j = 0; j < width; ++j) x[j] = decoded[i * width + j] * s[j] + sums[i * width + j] / count;
      const float* cosines = rotary + static_cast<int64_t>(positions[b]) * head_dim;
      const float* sines = cosines + half;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xk = x.data() + h * head_dim;
        float* key = keys + (i * heads + h) * head_dim;
        for (int64_t j = 0; j < half; ++j) {  // rotated to its position: k·cos + rotate_half(k)·sin
          key[j] = xk[j] * cosines[j] - xk[j + half] * sines[j];
          key[j + half] = xk[j + half] * cosines[j] + xk[j] * sines[j];
        }
        std::copy(x.data() + (heads + h) * head_dim, x.data() + (heads + h + 1) * head_dim, values + (i * heads + h) * head_dim);
      }
    }
  });
}

}  // namespace

std::vector<at::Tensor> deltakv_rebuild(const at::Tensor& entries, const at::Tensor& codes, const at::Tensor& code_zero,
                                        const at::Tensor& code_scale, const at::Tensor& refs, const at::Tensor& positions,
                                        const at::Tensor& layers, const at::Tensor& ref_keys, const at::Tensor& ref_values,
                                        const at::Tensor& ref_positions, const at::Tensor& decoder, const at::Tensor& scale,
                                        const at::Tensor& rotary) {
  TORCH_CHECK(entries.dim() == 1 && entries.scalar_type() == at::kLong && entries.is_contiguous(), "entries: int64 [m], contiguous");
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
    const int64_t b = block_ids[i];
    TORCH_CHECK(layer_ids[b] >= 0 && layer_ids[b] < layer_count, "deltakv_rebuild: block ", b, " names layer ", layer_ids[b]);
    TORCH_CHECK(position_ids[b] >= 0 && position_ids[b] < table, "deltakv_rebuild: position ", position_ids[b], " past the table");
    for (int64_t r = 0; r < top_k; ++r) {
      const int32_t ref = ref_ids[b * top_k + r];
      TORCH_CHECK(ref >= 0 && ref < references, "deltakv_rebuild: block ", b, " names reference ", ref, " of ", references);
      TORCH_CHECK(ref_position_ids[ref] >= 0 && ref_position_ids[ref] < table, "deltakv_rebuild: position ", ref_position_ids[ref],
                  " past the table");
    }
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
