// Python bindings of the fused decoder-layer ops (fused_layer_ops.h).
#include "fused_layer_ops.h"

namespace tokenmill::fused {

inline void bind(pybind11::module_ m) {
  m.def("rms_norm", &tokenmill::fused::rms_norm, "RMSNorm of fp32 rows, output in the weight's dtype (CPU)");
  m.def("add_rms_norm", &tokenmill::fused::add_rms_norm, "(x + delta, RMSNorm(x + delta)) in one pass (CPU)");
  m.def("rope_", &tokenmill::fused::rope_, "neox rotary embedding in place on [T, H, D] views of q and k (CPU)");
  m.def("write_kv_", &tokenmill::fused::write_kv_, "write a step's K/V rows into their paged-cache slots (CPU)");
  m.def("write_kv_quantized_", &tokenmill::fused::write_kv_quantized_,
        "quantize a step's K/V rows (per token and head) into 1-byte codes + fp32 scales at their slots (CPU)");
  m.def("silu_and_mul", &tokenmill::fused::silu_and_mul, "silu(gate) * up of a fused [T, 2I] gate_up (CPU)");
}

}  // namespace tokenmill::fused
