// The Python module of the CPU kernels (kvcompress/kernels.py builds it).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention over slot tables (CPU)");
  m.def("top_pages", &top_pages, "The best pages of each head by bound, as entry columns (CPU)");
  m.def("deltakv_rebuild", &deltakv_rebuild, "DeltaKV's coded tokens rebuilt: keys (RoPE applied) and values (CPU)");
}
