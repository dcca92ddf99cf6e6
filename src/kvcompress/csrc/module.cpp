// The Python module of the CPU kernels (kvcompress/kernels.py builds it).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention over slot tables (CPU)");
  m.def("top_pages", &top_pages, "The best pages of each head by bound, as entry columns (CPU)");
  m.def("deltakv_rebuild", &deltakv_rebuild, "DeltaKV's coded tokens rebuilt: keys (RoPE applied) and values (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "A residual sum and its RMSNorm in one pass (CPU)");
  m.def("rope", &rope, "Rotate-half RoPE over heads (CPU)");
  m.def("linear_rows_available", &linear_rows_available, "Whether linear_rows runs on this CPU (AVX512-BF16)");
  m.def("linear_rows", &linear_rows, "A bfloat16 linear product over a few rows, the weight streamed once (CPU)");
  m.def("held_max_logits_available", &held_max_logits_available, "Whether held_max_logits runs on this CPU (AVX512-BF16)");
  m.def("held_max_logits", &held_max_logits, "Each held key's largest logit less the query's lse, over bfloat16 queries (CPU)");
  m.def("silu_mul", &silu_mul, "SiLU of the gate times the up product (CPU)");
}
