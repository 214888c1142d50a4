// Every hand-written CPU kernel in ONE extension module, one submodule per kernel family.
//
// Compiling a torch extension is dominated by parsing the torch headers (~40 s per translation
// unit on 2 cores, even for a one-line kernel); seven separate extensions cost ~290 s on a fresh
// machine, a third of the test suite's time. Included here as one translation unit, the headers
// are parsed once. Each family lives in its own namespace and binds itself with `bind(m)`.
#include <torch/extension.h>

#include "../model/csrc/fused_layer_ops.cpp"
#include "../model/csrc/dense_small_m.cpp"
#include "../model/csrc/paged_decode_attention.cpp"
#include "../quant/csrc/int_dot_linear.cpp"
// these two need AVX2 + FMA; without them the Python side finds no submodule and falls back
#if defined(__AVX2__) && defined(__FMA__)
#include "../quant/csrc/nf4_matmul.cpp"
#include "../quant/csrc/tiled_dequant_gemm.cpp"
#endif
#include "../model/csrc/decode_stack.cpp"   // after the tiled path: its quantized linears call it past their rows

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  tokenmill::fused::bind(m.def_submodule("fused_layer_ops"));
  tokenmill::dense::bind(m.def_submodule("dense_small_m"));
  tokenmill::attention::bind(m.def_submodule("paged_decode_attention"));
  tokenmill::int_dot::bind(m.def_submodule("int_dot_linear"));
  tokenmill::stack::bind(m.def_submodule("decode_stack"));
#if defined(__AVX2__) && defined(__FMA__)
  tokenmill::nf4::bind(m.def_submodule("nf4_matmul"));
  tokenmill::tiled::bind(m.def_submodule("tiled_dequant_gemm"));
#endif
}
