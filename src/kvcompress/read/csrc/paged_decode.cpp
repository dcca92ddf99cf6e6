// Paged decode attention on the CPU: one query per request row attends to the entries its slot tables
// name, read where they live in the slot pool (no gathered copy). The contract is read/paged.py's
// `paged_decode`; read/reference.py is its oracle.
//
// Per (row r, KV head h): the entries j < lengths[r, h] of the slot table tables[r][h, :] (slot 0: a hole,
// skipped), each with an optional log-weight weights[r][h, j]. The G = Hq / H query heads of the group
// share every key and value they load. Work is split into chunks of CHUNK entries (flash-decoding), each
// chunk an online softmax over blocks of BLOCK entries with float32 accumulators; chunks are merged by
// log-sum-exp. Out: the attention output [R, Hq, d] and the log partition function [R, Hq] (float32,
// -inf where a head has no entry).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t BLOCK = 64;
constexpr int64_t CHUNK = 512;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Table {
  const int32_t* slots;   // entry j of head h at slots[h * head_stride + j * entry_stride]
  int64_t head_stride, entry_stride;
  const float* weights;   // nullptr: no log-weights
  int64_t weight_head_stride, weight_entry_stride;
};

constexpr int64_t PREFETCH = 8;  // rows ahead: slots may lie anywhere in the pool

template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t d) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < d * static_cast<int64_t>(sizeof(scalar_t)); offset += 64) __builtin_prefetch(bytes + offset);
}

// exp(x) for x ≤ 0 (a logit minus its running max), vectorizable: 2^n · p(r) with r = x − n·ln 2 (Cephes' expf
// polynomial, relative error ~2e-7); 0 below −87 (and for −inf: holes and padding add nothing).
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.0f);
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
  return x < -87.0f ? 0.0f : e * scale;
}

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t d) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < d; ++c) sum += q[c] * static_cast<float>(k[c]);
  return sum;
}

template <typename scalar_t>
inline void axpy(float* acc, float p, const scalar_t* v, int64_t d) {
#pragma omp simd
  for (int64_t c = 0; c < d; ++c) acc[c] += p * static_cast<float>(v[c]);
}

// One chunk [begin, end) of one head: the unnormalised output acc [G, d], its running max m [G] and sum l [G].
template <typename scalar_t>
void attend_chunk(const float* q, int64_t groups, int64_t d, const scalar_t* keys, const scalar_t* values, int64_t num_slots,
                  const Table& table, int64_t head, int64_t begin, int64_t end, float* acc, float* m, float* l,
                  std::atomic<bool>& out_of_range) {
  std::vector<float> logits(groups * BLOCK);
  int64_t slots[BLOCK];
  for (int64_t g = 0; g < groups; ++g) {
    m[g] = NEG_INF;
    l[g] = 0.f;
  }
  std::fill(acc, acc + groups * d, 0.f);
  for (int64_t start = begin; start < end; start += BLOCK) {
    const int64_t n = std::min(BLOCK, end - start);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t slot = table.slots[head * table.head_stride + (start + i) * table.entry_stride];
      if (slot < 0 || slot >= num_slots) {
        out_of_range = true;
        slots[i] = 0;
      } else {
        slots[i] = slot;
      }
    }
    for (int64_t i = 0; i < n; ++i) {  // a key is loaded once for the group's queries
      if (i + PREFETCH < n) prefetch_row(keys + slots[i + PREFETCH] * d, d);
      prefetch_row(values + slots[i] * d, d);  // read after the block's softmax
      const float bias = table.weights ? table.weights[head * table.weight_head_stride + (start + i) * table.weight_entry_stride] : 0.f;
      const scalar_t* key = keys + slots[i] * d;
      for (int64_t g = 0; g < groups; ++g)
        logits[g * BLOCK + i] = slots[i] == 0 ? NEG_INF : dot(q + g * d, key, d) + bias;
    }
    for (int64_t g = 0; g < groups; ++g) {
      float* row = logits.data() + g * BLOCK;
      float peak = NEG_INF;
#pragma omp simd reduction(max : peak)
      for (int64_t i = 0; i < n; ++i) peak = std::max(peak, row[i]);
      if (peak == NEG_INF) {  // nothing seen in this block
        std::fill(row, row + n, 0.f);
        continue;
      }
      const float top = std::max(m[g], peak);
      const float rescale = m[g] == NEG_INF ? 0.f : std::exp(m[g] - top);
      l[g] *= rescale;
      float* out = acc + g * d;
      for (int64_t c = 0; c < d; ++c) out[c] *= rescale;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) row[i] = exp_nonpositive(row[i] - top);  // holes and padding: 0
      m[g] = top;
    }
    for (int64_t i = 0; i < n; ++i) {  // a value is loaded once for the group's queries
      if (slots[i] == 0) continue;
      const scalar_t* value = values + slots[i] * d;
      for (int64_t g = 0; g < groups; ++g) {
        const float p = logits[g * BLOCK + i];
        l[g] += p;
        axpy(acc + g * d, p, value, d);
      }
    }
  }
}

template <typename scalar_t>
void run(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const std::vector<Table>& tables,
         const at::Tensor& lengths, at::Tensor& out, at::Tensor& lse) {
  const int64_t rows = query.size(0), hq = query.size(1), d = query.size(2);
  const int64_t heads = lengths.size(1), groups = hq / heads;
  const int64_t num_slots = keys.size(0);
  const float* q = query.data_ptr<float>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const scalar_t* k = keys.data_ptr<scalar_t>();
  const scalar_t* v = values.data_ptr<scalar_t>();
  // every (row, head) cut into chunks: task t covers entries [begin, end) of head (r, h)
  std::vector<int64_t> first(rows * heads + 1, 0);
  for (int64_t rh = 0; rh < rows * heads; ++rh) first[rh + 1] = first[rh] + std::max<int64_t>(1, (length[rh] + CHUNK - 1) / CHUNK);
  const int64_t tasks = first.back();
  std::vector<float> acc(tasks * groups * d), m(tasks * groups), l(tasks * groups);
  std::vector<int64_t> owner(tasks);
  for (int64_t rh = 0; rh < rows * heads; ++rh)
    for (int64_t t = first[rh]; t < first[rh + 1]; ++t) owner[t] = rh;
  std::atomic<bool> out_of_range{false};
  at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t rh = owner[t], r = rh / heads, h = rh % heads;
      const int64_t begin = (t - first[rh]) * CHUNK, end = std::min(length[rh], begin + CHUNK);
      attend_chunk<scalar_t>(q + (r * hq + h * groups) * d, groups, d, k, v, num_slots, tables[r], h, begin, end,
                             acc.data() + t * groups * d, m.data() + t * groups, l.data() + t * groups, out_of_range);
    }
  });
  TORCH_CHECK(!out_of_range, "paged_decode: a slot table names a slot outside the pool (coded entries must be decoded first)");
  float* o = out.data_ptr<float>();
  float* s = lse.data_ptr<float>();
  at::parallel_for(0, rows * heads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t rh = lo; rh < hi; ++rh) {
      const int64_t r = rh / heads, h = rh % heads;
      for (int64_t g = 0; g < groups; ++g) {
        float top = NEG_INF;
        for (int64_t t = first[rh]; t < first[rh + 1]; ++t) top = std::max(top, m[t * groups + g]);
        float* dst = o + (r * hq + h * groups + g) * d;
        std::fill(dst, dst + d, 0.f);
        if (top == NEG_INF) {  // the head holds nothing: output 0, lse -inf
          s[r * hq + h * groups + g] = NEG_INF;
          continue;
        }
        float total = 0.f;
        for (int64_t t = first[rh]; t < first[rh + 1]; ++t) {
          if (m[t * groups + g] == NEG_INF) continue;
          const float scale = std::exp(m[t * groups + g] - top);
          total += l[t * groups + g] * scale;
          const float* part = acc.data() + (t * groups + g) * d;
          for (int64_t c = 0; c < d; ++c) dst[c] += part[c] * scale;
        }
        for (int64_t c = 0; c < d; ++c) dst[c] /= total;
        s[r * hq + h * groups + g] = top + std::log(total);
      }
    }
  });
}

}  // namespace

// query [R, Hq, d] float32 (scaled); keys, values [S, d] (float32, bfloat16 or float16); tables: per row an int32
// [H, L_r] slot table (any strides); lengths [R, H] int64; weights: per row a float32 [H, L_r] log-weight table
// or an empty tensor. Returns (out [R, Hq, d] float32, lse [R, Hq] float32).
std::vector<at::Tensor> paged_decode(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                                     const std::vector<at::Tensor>& tables, const at::Tensor& lengths,
                                     const std::vector<at::Tensor>& weights) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.is_contiguous(), "query: float32 [R, Hq, d], contiguous");
  TORCH_CHECK(keys.dim() == 2 && keys.is_contiguous() && values.is_contiguous() && keys.sizes() == values.sizes() &&
                  keys.scalar_type() == values.scalar_type() && keys.size(1) == query.size(2),
              "keys and values: [S, d] of one dtype, contiguous, d as the query's");
  TORCH_CHECK(lengths.dim() == 2 && lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.size(0) == query.size(0),
              "lengths: int64 [R, H]");
  TORCH_CHECK(query.size(1) % lengths.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(static_cast<int64_t>(tables.size()) == query.size(0) && weights.size() == tables.size(), "one table and one weight table per row");
  std::vector<Table> views;
  const int64_t heads = lengths.size(1);
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (size_t r = 0; r < tables.size(); ++r) {
    const at::Tensor& t = tables[r];
    TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kInt && t.size(0) == heads, "a slot table: int32 [H, L]");
    const int64_t longest = *std::max_element(length + r * heads, length + (r + 1) * heads);
    TORCH_CHECK(longest <= t.size(1), "a head is longer than its slot table");
    Table view{t.data_ptr<int32_t>(), t.stride(0), t.stride(1), nullptr, 0, 0};
    const at::Tensor& w = weights[r];
    if (w.numel() > 0) {
      TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.size(0) == t.size(0) && w.size(1) >= longest,
                  "a log-weight table: float32 [H, L]");
      view.weights = w.data_ptr<float>();
      view.weight_head_stride = w.stride(0);
      view.weight_entry_stride = w.stride(1);
    }
    views.push_back(view);
  }
  auto out = at::empty(query.sizes(), query.options());
  auto lse = at::empty({query.size(0), query.size(1)}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys.scalar_type(), "paged_decode",
                                  [&] { run<scalar_t>(query, keys, values, views, lengths, out, lse); });
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention over slot tables (CPU)");
}
