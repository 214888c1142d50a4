// Python binding of the paged decode attention kernel (paged_decode_attention.h).
#include "paged_decode_attention.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &tokenmill::attention::paged_decode_attention, "paged decode attention (CPU)");
}
