// OmniKV's choice at a filter layer of the tokens the next layers read, and a layer's columns holding them: the contracts
// are methods/omnikv.py's `choose` and `columns`; their PyTorch paths `chosen_tokens_torch` and `token_columns_torch` are
// the reference, and this gives the same (of tokens of equal score on the budget's edge, the first).
//
// A head holds lengths[b, h] entries, in columns 0 .. length - 1; an entry is protected (always read) among the first `sinks`
// columns or the last `recent` ones, and its token is positions[b, h, column] (positions past `tokens` are taken as the last
// token, as the reference clamps them).
//
// chosen_tokens(weights, positions, lengths, budget, sinks, recent, tokens) → bool [B, tokens]: an entry's score is its
// largest weight over its query group (weights: float32 [B, H, G, L], contiguous), +inf where protected; a token's score
// the largest over the entries holding it (-inf where none does); each row takes max(budget[b], its +inf tokens) tokens of
// the best scores (never one of -inf).
//
// token_columns(wanted, positions, lengths, sinks, recent) → int64 [B, H, k]: per head, in order, the columns holding a
// wanted token (wanted: bool [B, tokens], contiguous) or protected, -1 after them; k the most of any head, at least 1.
#include "kernels.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace {

struct Held {
  const int64_t* positions;
  int64_t stride_b, stride_h, stride_l;
  const int64_t* lengths;
  int64_t heads, width, sinks, recent;

  int64_t length(int64_t b, int64_t h) const { return lengths[b * heads + h]; }
  int64_t position(int64_t b, int64_t h, int64_t j) const { return positions[b * stride_b + h * stride_h + j * stride_l]; }
  bool is_protected(int64_t j, int64_t length) const { return j < sinks || j >= length - recent; }
};

Held held_entries(const char* who, const at::Tensor& positions, const at::Tensor& lengths, int64_t sinks, int64_t recent) {
  TORCH_CHECK(positions.dim() == 3 && positions.scalar_type() == at::kLong, who, ": positions int64 [B, H, L]");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.sizes() == positions.sizes().slice(0, 2),
              who, ": lengths int64 [B, H], contiguous");
  TORCH_CHECK(sinks >= 0 && recent >= 0, who, ": sinks and recent ≥ 0");
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (int64_t i = 0; i < lengths.numel(); ++i)
    TORCH_CHECK(length[i] >= 0 && length[i] <= positions.size(2), who, ": a head holds 0 to L entries");
  return {positions.data_ptr<int64_t>(), positions.stride(0), positions.stride(1), positions.stride(2), length, positions.size(1),
          positions.size(2), sinks, recent};
}

}  // namespace

at::Tensor chosen_tokens(const at::Tensor& weights, const at::Tensor& positions, const at::Tensor& lengths, const at::Tensor& budget,
                         int64_t sinks, int64_t recent, int64_t tokens) {
  const Held held = held_entries("chosen_tokens", positions, lengths, sinks, recent);
  const int64_t rows = positions.size(0), heads = held.heads, width = held.width;
  TORCH_CHECK(weights.dim() == 4 && weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.size(0) == rows &&
                  weights.size(1) == heads && weights.size(3) == width,
              "chosen_tokens: weights float32 [B, H, G, L], contiguous, as the positions");
  TORCH_CHECK(budget.dim() == 1 && budget.scalar_type() == at::kLong && budget.size(0) == rows, "chosen_tokens: budget int64 [B]");
  TORCH_CHECK(tokens >= 0, "chosen_tokens: tokens ≥ 0");
  const int64_t groups = weights.size(2);
  const float* weight = weights.data_ptr<float>();
  const at::Tensor budget_held = budget.contiguous();  // held: a temporary's data would be freed at the end of the line
  const int64_t* budgets = budget_held.data_ptr<int64_t>();
  auto wanted = at::zeros({rows, tokens}, positions.options().dtype(at::kBool));
  bool* take = wanted.data_ptr<bool>();
  constexpr float INF = std::numeric_limits<float>::infinity();
  std::vector<float> best(tokens);
  std::vector<int64_t> candidates;
  for (int64_t b = 0; b < rows; ++b) {
    std::fill(best.begin(), best.end(), -INF);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t length = held.length(b, h);
      const float* w = weight + (b * heads + h) * groups * width;
      for (int64_t j = 0; j < length; ++j) {
        const int64_t token = held.position(b, h, j);
        TORCH_CHECK(token >= 0, "chosen_tokens: an entry held at a negative position");
        if (token >= tokens) continue;  // past every token chosen from (the reference's spare column)
        float score = INF;
        if (!held.is_protected(j, length)) {
          score = w[j];
          for (int64_t g = 1; g < groups; ++g) score = std::max(score, w[g * width + j]);
        }
        best[token] = std::max(best[token], score);
      }
    }
    candidates.clear();
    int64_t protected_tokens = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      if (best[t] == -INF) continue;
      candidates.push_back(t);
      protected_tokens += best[t] == INF;
    }
    const int64_t count = std::min<int64_t>(std::max(budgets[b], protected_tokens), static_cast<int64_t>(candidates.size()));
    const auto better = [&](int64_t x, int64_t y) { return best[x] > best[y] || (best[x] == best[y] && x < y); };
    if (count < static_cast<int64_t>(candidates.size()))
      std::nth_element(candidates.begin(), candidates.begin() + count, candidates.end(), better);
    for (int64_t i = 0; i < count; ++i) take[b * tokens + candidates[i]] = true;
  }
  return wanted;
}

at::Tensor token_columns(const at::Tensor& wanted, const at::Tensor& positions, const at::Tensor& lengths, int64_t sinks, int64_t recent) {
  const Held held = held_entries("token_columns", positions, lengths, sinks, recent);
  const int64_t rows = positions.size(0), heads = held.heads;
  TORCH_CHECK(wanted.dim() == 2 && wanted.scalar_type() == at::kBool && wanted.is_contiguous() && wanted.size(0) == rows,
              "token_columns: wanted bool [B, tokens], contiguous");
  const int64_t tokens = wanted.size(1);
  const bool* want = wanted.data_ptr<bool>();
  const auto reads = [&](int64_t b, int64_t h, int64_t j, int64_t length) {
    if (held.is_protected(j, length)) return true;
    const int64_t token = held.position(b, h, j);
    TORCH_CHECK(token >= 0 && tokens > 0, "token_columns: an entry held at a negative position, or no token to choose from");
    return want[b * tokens + std::min(token, tokens - 1)];
  };
  std::vector<int64_t> counts(rows * heads, 0);
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0, length = held.length(b, h); j < length; ++j) counts[b * heads + h] += reads(b, h, j, length);
  const int64_t k = std::max<int64_t>(1, counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end()));
  auto columns = at::full({rows, heads, k}, -1, positions.options());
  int64_t* out = columns.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      int64_t* to = out + (b * heads + h) * k;
      for (int64_t j = 0, length = held.length(b, h); j < length; ++j)
        if (reads(b, h, j, length)) *to++ = j;
    }
  return columns;
}
