#include "dense_small_m.h"

namespace tokenmill::dense {

inline void bind(pybind11::module_ m) {
  m.def("small_m_linear", &tokenmill::dense::small_m_linear,
        "x W^T + b for fp32 x of at most 8 rows, one pass over W (CPU)");
  m.def("small_m_linear_int8", &tokenmill::dense::small_m_linear_int8,
        "x (codes * scale)^T + b for fp32 x of at most 8 rows and int8 codes with per-row scales (CPU)");
  m.def("small_m_linear_chunked", &tokenmill::dense::small_m_linear_chunked,
        "small_m_linear over chunks of max_rows rows, for any number of rows (CPU)");
  m.def("chunked_pays", &tokenmill::dense::chunked_pays, "rows, out_features, in_features -> use the chunked kernel");
  m.attr("max_rows") = tokenmill::dense::kMaxRows;
  m.attr("vectorized") = bool(TM_DENSE_VECTORIZED);   // without SIMD it is no faster than MKL
}

}  // namespace tokenmill::dense
