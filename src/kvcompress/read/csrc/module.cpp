// The Python module of read/'s CPU kernels (read/paged.py builds it).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention over slot tables (CPU)");
  m.def("top_pages", &top_pages, "The best pages of each head by bound, as entry columns (CPU)");
}
