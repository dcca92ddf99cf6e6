// The Python module of the CPU kernels (kvcompress/kernels.py builds it).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention over slot tables (CPU)");
  m.def("entry_weights", &entry_weights, "Each entry's attention weight from a decoding read's logits, or their mean over the group (CPU)");
  m.def("top_pages", &top_pages, "The best pages of each head by their bound of q·k, as entry columns (CPU)");
  m.def("select_tables", &select_tables, "A decoding read's selected columns of the rows' slot and log-weight tables (CPU)");
  m.def("chosen_tokens", &chosen_tokens, "OmniKV's tokens for the layers after a filter layer, from its read's weights (CPU)");
  m.def("token_columns", &token_columns, "A layer's columns holding OmniKV's chosen tokens or protected entries (CPU)");
  m.def("merge_pairs", &merge_pairs, "Per KV head, the entry that leaves by score and its most cosine-similar open key (CPU)");
  m.def("compact_tables", &compact_tables, "Slot table rows keeping the entries a mask marks, in place (CPU)");
  m.def("greedy_rows", &greedy_rows, "Each row's first largest logit and whether it holds a NaN (CPU)");
  m.def("append_step", &append_step, "A decoding step's new entries recorded in its requests' slot tables, a slot per layer and head (CPU)");
  m.def("summary_merge", &summary_merge, "A decoding read's summary (an affine read of the query) merged into its output by log-sum-exp (CPU)");
  m.def("deltakv_rebuild", &deltakv_rebuild, "DeltaKV's coded tokens rebuilt: keys (RoPE applied) and values (CPU)");
  m.def("deltakv_decode", &deltakv_decode, "Decode attention over slot tables naming DeltaKV's coded tokens, read in place (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "A residual sum and its RMSNorm in one pass (CPU)");
  m.def("rope", &rope, "Rotate-half RoPE over heads (CPU)");
  m.def("linear_rows_dtypes", &linear_rows_dtypes, "The dtypes linear_rows runs on this CPU: float32, bfloat16 (AVX2 and FMA, or AVX512-BF16)");
  m.def("linear_rows_bf16_dots", &linear_rows_bf16_dots, "Whether linear_rows takes bfloat16 with AVX512-BF16's dot products");
  m.def("linear_rows", &linear_rows, "A float32 or bfloat16 linear product over a few rows, the weight streamed once (CPU)");
  m.def("replay_chunk_available", &replay_chunk_available, "Whether replay_chunk runs on this CPU (AVX512-BF16)");
  m.def("replay_chunk", &replay_chunk, "KVzip's replay chunk over held and its own bfloat16 entries: output and each held entry's largest log-weight (CPU)");
  m.def("silu_mul", &silu_mul, "SiLU of the gate times the up product (CPU)");
  m.def("causal_attention_available", &causal_attention_available, "Whether causal_attention runs on this CPU (AVX-512)");
  m.def("causal_attention", &causal_attention, "A prompt's causal attention (the queries the last keys'), float32 sums (CPU)");
  bind_decode_layer(m);
}
