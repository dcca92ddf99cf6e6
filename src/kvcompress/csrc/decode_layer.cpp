// A decoding step's layer in one call: the engine decoder's layer (engine/decoder.py's `_Layer`) over rows that each decode
// one token and read their entries where they live, with no Python between its operations (at a step's few rows the
// interpreter's work around a layer's dozen operations costs about a third of the step on a 2-core CPU).
//
//   DecodeLayer(norms, eps, products, biases, query_heads, kv_heads, head_dim, scaling): the layer's RMSNorm weights [D] with
//     their epsilons (input, post-attention, then the query and key head norms where the model has them, Qwen3), its four
//     products' weights, each a list of pieces [N_i, K] side by side as linear_rows takes them (query-key-value, output,
//     gate-up, down), each with its bias or None, and its attention's scaling.
//   layer(hidden [R, D], delta [R, D] or None, cos, sin [R, 1, d] (decoder.py's `_Rotary`), step, index): the step's
//     reads in place (`PagedStep`, paged_decode.cpp: where each row's new keys and values go, the pool's plain arrays, every
//     layer's tables) at layer `index` → (the residual stream with delta and the attention added, the MLP's output to add
//     next): as `_Layer.__call__` with the runner's decoding read, each operation the same compiled function the Python
//     path calls, in the same order, so the two agree bit for bit.
//   decode_layers(layers, hidden, delta, cos, sin, step): every layer of the step in turn, as the decoder's loop calls
//     them one by one (a step's 30 calls from Python and the loop around them cost ~0.2 ms of a 9 ms step on a Zen 5).
#include "kernels.h"

#include <cstring>

namespace {

struct Norm {
  at::Tensor weight;
  double eps;
  std::vector<at::Tensor> operator()(const at::Tensor& x, const std::optional<at::Tensor>& delta) const {
    return add_rms_norm(x, delta, weight, eps);
  }
};

// SlotPool.write of one layer's new entries: row (r, h) of `rows` [R, H, d] (a view of the layer's product) into slot
// slot[r · H + h] of the pool's array [S, d]. Rows already in the pool's dtype are copied one by one where they lie;
// others take index_copy_ (which first makes them contiguous, in the pool's dtype: ~15 µs a layer). Every slot is checked
// before any is written.
void write_rows(const at::Tensor& pool, const int64_t* slot, const at::Tensor& rows) {
  const int64_t d = rows.size(2), count = rows.size(0) * rows.size(1), size = pool.size(0);
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(slot[i] >= 0 && slot[i] < size, "DecodeLayer: a new entry's slot outside the pool");
  if (rows.scalar_type() != pool.scalar_type() || !pool.is_contiguous() || rows.stride(2) != 1) {
    const at::Tensor index = at::from_blob(const_cast<int64_t*>(slot), {count}, at::kLong);
    pool.index_copy_(0, index, rows.reshape({-1, d}).to(pool.scalar_type()));
    return;
  }
  const int64_t bytes = d * rows.element_size(), heads = rows.size(1);
  const char* from = static_cast<const char*>(rows.data_ptr());
  char* to = static_cast<char*>(pool.data_ptr());
  for (int64_t i = 0; i < count; ++i)
    std::memcpy(to + slot[i] * bytes, from + ((i / heads) * rows.stride(0) + (i % heads) * rows.stride(1)) * rows.element_size(), bytes);
}

struct Product {
  std::vector<at::Tensor> weights;
  std::optional<at::Tensor> bias;
  at::Tensor operator()(const at::Tensor& x) const { return linear_rows(x, weights, bias); }
};

}  // namespace

class DecodeLayer {
 public:
  DecodeLayer(const std::vector<at::Tensor>& norms, const std::vector<double>& eps, const std::vector<std::vector<at::Tensor>>& products,
              const std::vector<std::optional<at::Tensor>>& biases, int64_t query_heads, int64_t kv_heads, int64_t head_dim, double scaling)
      : query_heads_(query_heads), kv_heads_(kv_heads), head_dim_(head_dim), scaling_(scaling) {
    TORCH_CHECK((norms.size() == 2 || norms.size() == 4) && eps.size() == norms.size(),
                "DecodeLayer: the input and post-attention norms (and the query and key head norms), each with its epsilon");
    TORCH_CHECK(products.size() == 4 && biases.size() == 4, "DecodeLayer: four products (query-key-value, output, gate-up, down) and their biases");
    TORCH_CHECK(query_heads > 0 && kv_heads > 0 && query_heads % kv_heads == 0 && head_dim > 0 && head_dim % 2 == 0,
                "DecodeLayer: query heads a multiple of the KV heads, an even head size");
    for (size_t i = 0; i < norms.size(); ++i) norms_.push_back({norms[i], eps[i]});
    for (size_t i = 0; i < products.size(); ++i) products_.push_back({products[i], biases[i]});
  }

  std::vector<at::Tensor> operator()(const at::Tensor& hidden, const std::optional<at::Tensor>& delta, const at::Tensor& cos,
                                     const at::Tensor& sin, const PagedStep& step, int64_t index) const {
    TORCH_CHECK(hidden.dim() == 2, "DecodeLayer: hidden [R, D], one decoding token per row");
    const int64_t rows = hidden.size(0), queries = query_heads_, heads = kv_heads_, d = head_dim_;
    TORCH_CHECK(step.rows() == rows && step.heads() == heads, "DecodeLayer: the step's rows and KV heads as the layer's");
    const int64_t* slots = step.slots(index);
    const auto [stream, inputs] = unpack2(norms_[0](hidden, delta));
    const at::Tensor projected = products_[0](inputs).view({rows, queries + 2 * heads, d});
    at::Tensor query, key;
    if (norms_.size() == 2) {  // the queries and keys rotated as one
      const at::Tensor rotated = rope(projected.narrow(1, 0, queries + heads), cos, sin);
      query = rotated.narrow(1, 0, queries), key = rotated.narrow(1, queries, heads);
    } else {  // Qwen3: per-head norms before RoPE
      query = rope(norms_[2](projected.narrow(1, 0, queries), std::nullopt)[1], cos, sin);
      key = rope(norms_[3](projected.narrow(1, queries, heads), std::nullopt)[1], cos, sin);
    }
    const at::Tensor value = projected.narrow(1, queries + heads, heads);
    write_rows(step.keys(), slots, key);  // SlotPool.write: the entries in the pool's dtype, in place
    write_rows(step.values(), slots, value);
    const at::Tensor out = step.read(query, scaling_, index);
    const auto [summed, normed] = unpack2(norms_[1](stream, products_[1](out.reshape({rows, -1}))));
    return {summed, products_[3](silu_mul(products_[2](normed)))};
  }

 private:
  static std::pair<at::Tensor, at::Tensor> unpack2(const std::vector<at::Tensor>& pair) { return {pair[0], pair[1]}; }

  std::vector<Norm> norms_;
  std::vector<Product> products_;
  int64_t query_heads_, kv_heads_, head_dim_;
  double scaling_;
};

// A decoding step's whole stack of layers in one call: layer i of `layers` over the step's reads of layer i, in turn, each
// taking the previous one's (stream, output) → the last one's. The same calls in the same order as the decoder's loop over
// the layers, without the interpreter between them.
std::vector<at::Tensor> decode_layers(const std::vector<const DecodeLayer*>& layers, const at::Tensor& hidden,
                                      const std::optional<at::Tensor>& delta, const at::Tensor& cos, const at::Tensor& sin,
                                      const PagedStep& step) {
  TORCH_CHECK(!layers.empty() && static_cast<int64_t>(layers.size()) == step.layers(), "decode_layers: a layer for each of the step's");
  std::vector<at::Tensor> state{hidden, delta.value_or(at::Tensor())};
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::optional<at::Tensor> added = state[1].defined() ? std::optional<at::Tensor>(state[1]) : std::nullopt;
    state = (*layers[i])(state[0], added, cos, sin, step, static_cast<int64_t>(i));
  }
  return state;
}

void bind_decode_layer(pybind11::module_& m) {
  pybind11::class_<DecodeLayer>(m, "DecodeLayer", "A decoding step's whole decoder layer in one call (CPU)")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::vector<double>&, const std::vector<std::vector<at::Tensor>>&,
                          const std::vector<std::optional<at::Tensor>>&, int64_t, int64_t, int64_t, double>())
      .def("__call__", &DecodeLayer::operator());
  pybind11::class_<PagedStep>(m, "PagedStep", "A decoding step's reads in place, every layer's, laid out once a step (CPU)")
      .def(pybind11::init<const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::vector<at::Tensor>&, const at::Tensor&,
                          const std::vector<at::Tensor>&, int64_t, const std::vector<int64_t>&, const std::vector<at::Tensor>&>())
      .def_property_readonly("layers", &PagedStep::layers)
      .def("read", &PagedStep::read, "paged_decode's output over a layer's tables");
  m.def("decode_layers", &decode_layers, "A decoding step's layers (DecodeLayer each) in turn over its reads in place (CPU)");
}
