// Every decoder layer of a pure-decode step in ONE call from Python.
//
// At decode batch sizes a layer's arithmetic is a few tens of microseconds of matmul; the eager
// path around it (module calls, views, ~12 op dispatches, the checks in each Python wrapper) cost
// ~1.7 ms of a 5.7 ms SmolLM2 int4 forward at batch 1. This file runs the same kernels in the same
// order on the same dtypes as tokenmill/model/llama.py's eager layers, so its output is the eager
// output bit for bit (tests hold it to that), and it releases the GIL while it runs, so the
// server's HTTP side can work during a step.
//
// A layer's linears are `Linear` objects built once from each module's own tensors: dense
// (at::linear, any dtype) or, on AVX512-VNNI / AVX2 CPUs, the integer-dot int4 / int8 kernels,
// which past their row limit hand over to the tiled dequantize + GEMM as the eager layers do.
#include <torch/extension.h>

#include <limits>
#include <vector>

#include "dense_small_m.h"
#include "fused_layer_ops.h"
#include "paged_decode_attention.h"
#include "../../quant/csrc/int_dot_linear.h"

namespace tokenmill::stack {

namespace {

namespace fused = tokenmill::fused;
namespace attention = tokenmill::attention;

struct Linear {
  enum class Kind { Dense, Int4, Int8 } kind = Kind::Dense;
  torch::Tensor weight, codes, scales, offsets, row_scale, code_sums;
  std::optional<torch::Tensor> bias, perm;
  int64_t block = 0;
  bool small_m = false;   // dense fp32: tokenmill::dense::small_m_linear up to its row limit
  int64_t max_rows = std::numeric_limits<int64_t>::max();   // rows this linear takes
#ifdef TM_HAVE_TILED
  // Rows past `int_dot_rows` take the tiled dequantize + GEMM on the layer's row-major codes, the
  // same call with the same tensors as the eager layer makes there (quant/int4.py, quant/int8.py).
  struct Tiled {
    torch::Tensor codes, scale;
    std::optional<torch::Tensor> offset, perm;
    int64_t bits = 0, group = 0;
    bool bf16_gemm = false;
  };
  std::optional<Tiled> tiled;
  int64_t int_dot_rows = 0;

  torch::Tensor tiled_forward(const torch::Tensor& x) const {
    const torch::Tensor xp = tiled->perm ? x.index_select(1, *tiled->perm) : x;
    const torch::Tensor y = tokenmill::tiled::tiled_dequant_linear(xp, tiled->codes, tiled->scale, tiled->offset,
                                                                   std::nullopt, tiled->bits, tiled->group,
                                                                   tiled->bf16_gemm);
    return bias.has_value() ? y + bias->to(y.scalar_type()) : y;
  }

  // This integer-dot linear, taking any number of rows: the tiled path past its own.
  Linear with_tiled(torch::Tensor codes, torch::Tensor scale, std::optional<torch::Tensor> offset,
                    std::optional<torch::Tensor> perm, int64_t bits, int64_t group, bool bf16_gemm) const {
    TORCH_CHECK(kind != Kind::Dense, "only integer-dot linears hand rows over to the tiled path");
    Linear l = *this;
    l.tiled = Tiled{codes, scale, offset, perm, bits, group, bf16_gemm};
    l.int_dot_rows = max_rows;
    l.max_rows = std::numeric_limits<int64_t>::max();
    return l;
  }
#endif

  torch::Tensor operator()(const torch::Tensor& x) const {
#ifdef TM_HAVE_TILED
    if (tiled.has_value() && x.size(0) > int_dot_rows) return tiled_forward(x);
#endif
    switch (kind) {
#ifdef TM_HAVE_INT_DOT
      case Kind::Int4:
        return tokenmill::int_dot::int4_dot_linear(x, codes, scales, offsets, bias, perm, block);
      case Kind::Int8:
        return tokenmill::int_dot::int8_dot_linear(x, codes, row_scale, code_sums, bias, block);
#endif
      default:
        // the same choice as tokenmill/model/layers.py's Linear, so the stack keeps the eager bits
        if (small_m && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.is_contiguous()) {
          if (x.size(0) >= 1 && x.size(0) <= tokenmill::dense::kMaxRows)
            return tokenmill::dense::small_m_linear(x, weight, bias);
          if (tokenmill::dense::chunked_pays(x.size(0), weight.size(0), weight.size(1)))
            return tokenmill::dense::small_m_linear_chunked(x, weight, bias);
        }
        return bias.has_value() ? at::linear(x, weight, *bias) : at::linear(x, weight);
    }
  }

  static Linear dense(torch::Tensor weight, std::optional<torch::Tensor> bias, bool small_m) {
    Linear l;
    l.weight = weight;
    l.bias = bias;
    l.small_m = small_m && TM_DENSE_VECTORIZED;
    return l;
  }
#ifdef TM_HAVE_INT_DOT
  static Linear int4(torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                     std::optional<torch::Tensor> bias, std::optional<torch::Tensor> perm, int64_t block,
                     int64_t max_rows) {
    Linear l;
    l.kind = Kind::Int4;
    l.codes = codes, l.scales = scales, l.offsets = offsets, l.bias = bias, l.perm = perm;
    l.block = block, l.max_rows = max_rows;
    return l;
  }
  static Linear int8(torch::Tensor codes, torch::Tensor row_scale, torch::Tensor code_sums,
                     std::optional<torch::Tensor> bias, int64_t block, int64_t max_rows) {
    Linear l;
    l.kind = Kind::Int8;
    l.codes = codes, l.row_scale = row_scale, l.code_sums = code_sums, l.bias = bias;
    l.block = block, l.max_rows = max_rows;
    return l;
  }
#endif
};

struct Layer {
  torch::Tensor input_norm, post_attention_norm;   // RMSNorm weights
  Linear qkv, o, gate_up, down;
};

class DecoderStack {
 public:
  DecoderStack(std::vector<Layer> layers, double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               double scale, torch::Tensor cos, torch::Tensor sin)
      : layers_(std::move(layers)), eps_(eps), hq_(num_heads), hk_(num_kv_heads), d_(head_dim), scale_(scale),
        cos_(cos), sin_(sin) {
    for (const Layer& l : layers_)
      for (const Linear* lin : {&l.qkv, &l.o, &l.gate_up, &l.down}) max_rows_ = std::min(max_rows_, lin->max_rows);
  }

  int64_t max_rows() const { return max_rows_; }

  // x: fp32 residual stream [T, H] of T decode tokens; returns it after every layer (the final
  // norm is the caller's). Caches: one (K, V) pair per layer; the rest as in AttentionMetadata.
  torch::Tensor decode(torch::Tensor x, const torch::Tensor& positions, const std::vector<torch::Tensor>& k_caches,
                       const std::vector<torch::Tensor>& v_caches, const torch::Tensor& slots,
                       const torch::Tensor& block_tables, const torch::Tensor& context_lens) const {
    const int64_t L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L && static_cast<int64_t>(v_caches.size()) == L,
                "one K and one V cache per layer");
    TORCH_CHECK(x.size(0) <= max_rows_, "more decode rows than the stack's kernels take");
    const int64_t T = x.size(0), q_size = hq_ * d_, kv_size = hk_ * d_;
    for (int64_t i = 0; i < L; ++i) {
      const Layer& l = layers_[i];
      const torch::Tensor h = fused::rms_norm(x, l.input_norm, eps_);
      const torch::Tensor qkv = l.qkv(h);
      const torch::Tensor q = qkv.narrow(1, 0, q_size).view({T, hq_, d_});
      const torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, hk_, d_});
      const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, hk_, d_});
      fused::rope_(q, k, positions, cos_, sin_);
      fused::write_kv_(k, v, k_caches[i], v_caches[i], slots);
      const torch::Tensor o = attention::paged_decode_attention(q, k_caches[i], v_caches[i], block_tables,
                                                                context_lens, scale_, /*window=*/0);
      std::vector<torch::Tensor> sum_norm = fused::add_rms_norm(x, l.o(o.view({T, q_size})), l.post_attention_norm, eps_);
      x = at::add(sum_norm[0], l.down(fused::silu_and_mul(l.gate_up(sum_norm[1]))));
    }
    return x;
  }

 private:
  std::vector<Layer> layers_;
  double eps_;
  int64_t hq_, hk_, d_;
  double scale_;
  torch::Tensor cos_, sin_;
  int64_t max_rows_ = std::numeric_limits<int64_t>::max();
};

}  // namespace

inline void bind(pybind11::module_ m) {
  namespace py = pybind11;
  py::class_<Linear>(m, "Linear")
      .def_static("dense", &Linear::dense, py::arg("weight"), py::arg("bias"), py::arg("small_m") = false)
#ifdef TM_HAVE_INT_DOT
      .def_static("int4", &Linear::int4, py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("bias"),
                  py::arg("perm"), py::arg("block"), py::arg("max_rows"))
      .def_static("int8", &Linear::int8, py::arg("codes"), py::arg("row_scale"), py::arg("code_sums"),
                  py::arg("bias"), py::arg("block"), py::arg("max_rows"))
#endif
#ifdef TM_HAVE_TILED
      .def("with_tiled", &Linear::with_tiled, py::arg("codes"), py::arg("scale"), py::arg("offset"), py::arg("perm"),
           py::arg("bits"), py::arg("group"), py::arg("bf16_gemm"))
#endif
      .def_readonly("max_rows", &Linear::max_rows);
  py::class_<Layer>(m, "Layer")
      .def(py::init<torch::Tensor, torch::Tensor, Linear, Linear, Linear, Linear>(), py::arg("input_norm"),
           py::arg("post_attention_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"));
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<Layer>, double, int64_t, int64_t, int64_t, double, torch::Tensor, torch::Tensor>(),
           py::arg("layers"), py::arg("eps"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("scale"), py::arg("cos"), py::arg("sin"))
      .def_property_readonly("max_rows", &DecoderStack::max_rows)
      .def("decode", &DecoderStack::decode, py::call_guard<py::gil_scoped_release>());
  m.def("has_int_dot", [] {
#ifdef TM_HAVE_INT_DOT
    return true;
#else
    return false;
#endif
  });
}

}  // namespace tokenmill::stack
