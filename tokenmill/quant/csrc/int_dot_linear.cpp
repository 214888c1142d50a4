// Python bindings of the integer-dot linears (int_dot_linear.h).
#include "int_dot_linear.h"

namespace tokenmill::int_dot {

inline void bind(pybind11::module_ m) {
  m.def("available", &tokenmill::int_dot::available, "built with AVX512-VNNI or AVX2 (otherwise the module has no kernels)");
  m.def("has_amx", &tokenmill::int_dot::has_amx, "calls from amx_min_rows() rows run on AMX tiles");
  m.def("amx_min_rows", &tokenmill::int_dot::amx_min_rows, "(int4, int8) rows from which calls take AMX");
  m.def("set_amx_min_rows", &tokenmill::int_dot::set_amx_min_rows, "set (int4, int8) rows from which calls take AMX (benchmarks)");
  m.def("isa", &tokenmill::int_dot::isa, "the instruction set the kernels use: avx512_vnni, avx2 or empty");
#ifdef TM_HAVE_INT_DOT
  m.def("int4_dot_linear", &tokenmill::int_dot::int4_dot_linear, "group-wise int4 weights x block-quantized int8 x");
  m.def("int8_dot_linear", &tokenmill::int_dot::int8_dot_linear, "per-channel int8 weights x block-quantized int8 x");
#endif
}

}  // namespace tokenmill::int_dot
