// Python binding of the paged decode attention kernel (paged_decode_attention.h).
#include "paged_decode_attention.h"

namespace tokenmill::attention {

inline void bind(pybind11::module_ m) {
  m.def("paged_decode_attention", &tokenmill::attention::paged_decode_attention, "paged decode attention (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("window"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
}

}  // namespace tokenmill::attention
