// The engine decoder's small per-layer operations, each one pass over its rows instead of the several ATen operations
// of its PyTorch form (engine/decoder.py; at a decoding step's few rows their dispatch costs more than their arithmetic).
// Each computes its PyTorch form's numbers: every product and sum that PyTorch rounds to the tensors' dtype is rounded here
// too (bfloat16 and float16: computed in float32, then rounded to nearest even), and no product is fused into a sum.
//
//   add_rms_norm(hidden [T, D], delta [T, D] or None, weight [D], eps) → (s, weight · rms_norm(s)) with s = hidden + delta
//     (or hidden): transformers' Llama-family RMSNorm, s in float32 times 1 / sqrt(mean(s²) + eps), rounded, times the weight.
//     The mean's float32 sum runs in another order than ATen's, so the norm may differ from it in the last bit.
//   rope(x [T, n, d] (any strides, channels contiguous), cos [T, 1, d], sin [T, 1, d]) → x · cos + roll(x, d / 2) · sin, a
//     new [T, n, d]: the rotate-half RoPE with sin's first half negated (decoder.py's `_Rotary`), bit for bit.
//   silu_mul(gate_up [T, 2I]) → silu(gate) · up [T, I], silu(g) = g / (1 + exp(−g)): its exp is kernels.h's (Cephes'
//     polynomial) where ATen's is SLEEF's, so it may differ from ATen's in the last bit.
#include "kernels.h"

#include <ATen/Parallel.h>

#pragma GCC optimize("fp-contract=off")  // a · b + c rounds the product, as PyTorch's separate operations do

namespace {

// x rounded to the dtype and back: what a PyTorch result in that dtype holds.
template <typename scalar_t>
inline float rounded(float x) {
  return static_cast<float>(static_cast<scalar_t>(x));
}

constexpr int64_t ROWS_PER_TASK = 16;  // rows below which a call stays on one thread

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
              name, ": a CPU tensor of float32, bfloat16 or float16");
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, name, ": its last dimension contiguous");
}

template <typename scalar_t>
void add_rms_norm_rows(const scalar_t* hidden, const scalar_t* delta, const scalar_t* weight, float eps, int64_t rows, int64_t width,
                       scalar_t* sum, scalar_t* normed) {
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* h = hidden + r * width;
      scalar_t* s = sum + r * width;
      float squares = 0.f;
      for (int64_t c = 0; c < width; ++c) {
        const float x = delta ? rounded<scalar_t>(to_float(h[c]) + to_float(delta[r * width + c])) : to_float(h[c]);
        s[c] = static_cast<scalar_t>(x);
        const float square = x * x;
        squares += square;
      }
      const float mean = squares / static_cast<float>(width);
      const float inverse = 1.f / std::sqrt(mean + eps);
      scalar_t* out = normed + r * width;
      for (int64_t c = 0; c < width; ++c) {
        const float scaled = rounded<scalar_t>(to_float(s[c]) * inverse);
        out[c] = static_cast<scalar_t>(to_float(weight[c]) * scaled);
      }
    }
  });
}

template <typename scalar_t>
void rope_rows(const scalar_t* x, int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride, int64_t head_stride,
               const scalar_t* cos, const scalar_t* sin, scalar_t* out) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens * heads, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads, h = i % heads;
      const scalar_t* row = x + t * token_stride + h * head_stride;
      const scalar_t* c = cos + t * dim;
      const scalar_t* s = sin + t * dim;
      scalar_t* o = out + i * dim;
      for (int64_t j = 0; j < dim; ++j) {
        const int64_t partner = j < half ? j + half : j - half;  // roll by half a head
        const float straight = rounded<scalar_t>(to_float(row[j]) * to_float(c[j]));
        const float rolled = rounded<scalar_t>(to_float(row[partner]) * to_float(s[j]));
        o[j] = static_cast<scalar_t>(straight + rolled);
      }
    }
  });
}

template <typename scalar_t>
void silu_mul_rows(const scalar_t* gate_up, int64_t rows, int64_t inner, int64_t row_stride, scalar_t* out) {
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = gate_up + r * row_stride;
      const scalar_t* up = gate + inner;
      scalar_t* o = out + r * inner;
      for (int64_t c = 0; c < inner; ++c) {
        const float g = to_float(gate[c]);
        const float silu = rounded<scalar_t>(g / (1.f + exp_float(-g)));
        o[c] = static_cast<scalar_t>(silu * to_float(up[c]));
      }
    }
  });
}

}  // namespace

std::vector<at::Tensor> add_rms_norm(const at::Tensor& hidden, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  check_rows(hidden, "add_rms_norm: hidden");
  const int64_t width = hidden.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == width && weight.is_contiguous() && weight.scalar_type() == hidden.scalar_type(),
              "add_rms_norm: a contiguous weight [D] of hidden's dtype");
  const bool adds = delta.has_value();
  TORCH_CHECK(!adds || (delta->sizes() == hidden.sizes() && delta->scalar_type() == hidden.scalar_type()),
              "add_rms_norm: delta of hidden's shape and dtype, or None");
  const at::Tensor h = hidden.contiguous();
  const at::Tensor d = adds ? delta->contiguous() : at::Tensor();
  at::Tensor sum = adds ? at::empty_like(h) : h;
  at::Tensor normed = at::empty_like(h);
  const int64_t rows = h.numel() / std::max<int64_t>(width, 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(h.data_ptr<scalar_t>(), adds ? d.data_ptr<scalar_t>() : nullptr, weight.data_ptr<scalar_t>(),
                                static_cast<float>(eps), rows, width, sum.data_ptr<scalar_t>(), normed.data_ptr<scalar_t>());
  });
  return {sum, normed};
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, "rope: x");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "rope: x [T, n, d] with d even");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->is_contiguous() && t->numel() == tokens * dim && t->size(-1) == dim && t->scalar_type() == x.scalar_type(),
                "rope: contiguous cos and sin [T, 1, d] of x's dtype");
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), tokens, heads, dim, x.stride(0), x.stride(1), cos.data_ptr<scalar_t>(),
                        sin.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul: gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up [T, 2I]");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inner}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), rows, inner, gate_up.stride(0), out.data_ptr<scalar_t>());
  });
  return out;
}
