// Integer-dot linears for x86 CPUs with AVX512-VNNI or AVX2: y[M, N] = x[M, K] @ W^T + bias, W stored as
// group-wise asymmetric int4 or per-output-channel int8.
//
// x is quantized per call to int8 in blocks of B columns with one fp32 scale per block (the
// scheme llama.cpp uses for its activations), and every 64-column chunk of a weight row meets
// the matching 64 bytes of x in byte dot products into int32 (one vpdpbusd with VNNI,
// int_dot_vnni.h; vpmaddubsw + vpmaddwd pairs on AVX2, int_dot_avx2.h). torch's weight-only kernels widen every
// weight to float before multiplying; here a weight costs its 4 (or 8) bits of memory traffic
// and a quarter of an instruction, which at small M is what decides the speed.
//
// The result is the product of the dequantized weight with the block-quantized x, up to fp32
// rounding: tests compare against exactly that, computed in torch.
//
// Layouts (built in tokenmill/quant/int_dot.py):
// - int4: codes [N, K/2] uint8; for each row and each 64-column chunk, 32 bytes where byte j
//   holds column j in its low nibble and column j + 32 in its high nibble (one AND and one
//   shift unpack a chunk in column order). w = q * scale[n, g] + offset[n, g] for the group g of
//   B columns (B = the weight group, a multiple of 64), scales and offsets in fp16 (4 bytes per
//   group instead of 8: 12% of the codes' traffic at B = 64, not 25%). The unsigned operand is
//   the weight; the offsets meet the per-block sums of the dequantized x.
// - int8: codes [N, K] int8 (the weight's own codes), w = q * scale[n]. The unsigned operand is
//   x + 128: sum((xq + 128) * q) = sum(xq * q) + 128 * sum(q), so a per-row, per-block table
//   `code_sums` = 128 * sum(q) is subtracted, scaled by the x block's scale.
//
// The weight codes are read with a software prefetch PREFETCH_BYTES ahead into L2 (the L1
// streamer takes it from there): each linear of a 135M model is only 0.3-1.8 MB, too short for
// the hardware prefetchers to ramp up. All SmolLM2 int8 linears + lm_head at M = 1: on a 2-core
// EPYC (Zen 4) 7.1 ms without prefetch, 5.2 ms with 1 KiB into L1; on a 2-core Sapphire Rapids
// 8.9 ms without, 5.9-7.3 ms with 1 KiB into L1, 4.2-5.0 ms with 8 KiB into L2 (int4: 3.0-3.6
// -> 2.9-3.1 ms); a pure read of the same bytes 2.6-3.2 ms.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <array>
#include <cstring>
#include <utility>
#include <optional>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TM_HAVE_INT_DOT 1
#define TM_INT_DOT_ISA "avx512_vnni"
#elif defined(__AVX2__) && defined(__FMA__)
#define TM_HAVE_INT_DOT 1
#define TM_INT_DOT_ISA "avx2"
#else
#define TM_INT_DOT_ISA ""
#endif

namespace tokenmill::int_dot {

#ifdef TM_HAVE_INT_DOT

// x after block quantization: codes [M, K] (int8, or uint8 = int8 + 128), per-block scales and
// sums of the dequantized block [M, K/B].
struct QuantizedX {
  torch::Tensor codes, scales, sums;
};

struct Weights {
  const uint8_t* codes;     // int4 packed / int8 codes
  const at::Half* scales;   // int4: [N, K/B]
  const at::Half* offsets;  // int4: [N, K/B]
  const float* row_scale;   // int8: [N]
  const float* code_sums;   // int8: [N, K/B] = 128 * sum of the block's codes
  const float* bias;        // [N] or nullptr
  int64_t K, B;
};

struct Activations {
  const uint8_t* codes;     // [M, K]
  const float* scales;      // [M, K/B]
  const float* sums;        // [M, K/B]
};

#endif  // TM_HAVE_INT_DOT

}  // namespace tokenmill::int_dot

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "int_dot_vnni.h"
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)   // every AMX CPU has AVX512-BF16
#define TM_HAVE_AMX 1
#include "int_dot_amx.h"
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include "int_dot_avx2.h"
#endif

namespace tokenmill::int_dot {

#ifdef TM_HAVE_INT_DOT

template <typename T>
QuantizedX quantize_x(const torch::Tensor& x, int64_t B, bool offset, const std::optional<torch::Tensor>& perm) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedX q{torch::empty({M, K}, x.options().dtype(torch::kInt8)),
               torch::empty({M, K / B}, x.options().dtype(torch::kFloat32)),
               torch::empty({M, K / B}, x.options().dtype(torch::kFloat32))};
  const T* xp = x.data_ptr<T>();
  const int64_t* pp = perm.has_value() ? perm->data_ptr<int64_t>() : nullptr;
  int8_t* c = q.codes.data_ptr<int8_t>();
  float* s = q.scales.data_ptr<float>();
  float* u = q.sums.data_ptr<float>();
  auto rows = [&](int64_t begin, int64_t end) {
    std::vector<T> gathered(pp ? K : 0);
    for (int64_t m = begin; m < end; ++m) {
      const T* row = xp + m * K;
      if (pp) {   // act-order checkpoints: x's columns in the weight's group order
        for (int64_t k = 0; k < K; ++k) gathered[k] = row[pp[k]];
        row = gathered.data();
      }
      quantize_row(row, K, B, offset, c + m * K, s + m * (K / B), u + m * (K / B));
    }
  };
  if (M >= 16) at::parallel_for(0, M, 4, rows); else rows(0, M);
  return q;
}

QuantizedX quantize(const torch::Tensor& x, int64_t B, bool offset, const std::optional<torch::Tensor>& perm) {
  return x.scalar_type() == torch::kFloat32 ? quantize_x<float>(x, B, offset, perm)
                                            : quantize_x<at::BFloat16>(x, B, offset, perm);
}

template <int BITS, int R>
using TileFn = void (*)(const Weights&, const Activations&, int64_t, int64_t, float[RT][MT_MAX]);

// kTiles<BITS, R>[mt] = tile_dots<BITS, R, mt> for mt = 1..MT_MAX (index 0 unused)
template <int BITS, int R, size_t... I>
constexpr std::array<TileFn<BITS, R>, MT_MAX + 1> tile_table(std::index_sequence<I...>) {
  return {nullptr, tile_dots<BITS, R, static_cast<int>(I) + 1>...};
}
template <int BITS, int R>
constexpr auto kTiles = tile_table<BITS, R>(std::make_index_sequence<MT_MAX>{});

// Output columns n0.. of y[M, N].
template <int BITS, typename Out>
void run_tiles(const Weights& w, const Activations& a, int64_t M, int64_t N, Out* out, int64_t n0 = 0) {
  at::parallel_for(0, (N - n0 + RT - 1) / RT, 8, [&](int64_t begin, int64_t end) {
    float dots[RT][MT_MAX];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = n0 + p * RT;
      const int rows = static_cast<int>(std::min<int64_t>(RT, N - n));
      for (int64_t m = 0; m < M; m += MT_MAX) {
        const int mt = static_cast<int>(std::min<int64_t>(MT_MAX, M - m));
        if (rows == RT) kTiles<BITS, RT>[mt](w, a, n, m, dots);
        else kTiles<BITS, 1>[mt](w, a, n, m, dots);
        for (int r = 0; r < rows; ++r)
          for (int t = 0; t < mt; ++t)
            out[(m + t) * N + n + r] = static_cast<Out>(dots[r][t] + (w.bias ? w.bias[n + r] : 0.f));
      }
    }
  });
}

template <int BITS>
torch::Tensor run(const torch::Tensor& x, const Weights& w, int64_t N, const std::optional<torch::Tensor>& perm) {
  auto view = [](const QuantizedX& q) {
    return Activations{reinterpret_cast<const uint8_t*>(q.codes.data_ptr<int8_t>()), q.scales.data_ptr<float>(),
                       q.sums.data_ptr<float>()};
  };
  // int8 weights meet x + 128 on VNNI / AVX2, plain signed x on AMX (int4 weights: signed x on both)
  const bool vnni_offset = BITS == 8 && kOffsetInt8X;
  auto out = torch::empty({x.size(0), N}, x.options());
  auto compute = [&](auto* y) {
    int64_t n0 = 0;
    std::optional<QuantizedX> signed_x;
#ifdef TM_HAVE_AMX
    if (x.size(0) >= amx::min_rows<BITS>() && N >= amx::TILE && amx::enabled()) {
      signed_x = quantize(x, w.B, false, perm);
      n0 = amx::run_strips<BITS>(w, view(*signed_x), x.size(0), N, y);
    }
#endif
    if (n0 < N) {   // all of y, or the rows past AMX's last whole strip (x quantized once where it can)
      const QuantizedX q = signed_x && !vnni_offset ? *signed_x : quantize(x, w.B, vnni_offset, perm);
      run_tiles<BITS>(w, view(q), x.size(0), N, y, n0);
    }
  };
  if (x.scalar_type() == torch::kFloat32) compute(out.data_ptr<float>());
  else compute(out.data_ptr<at::BFloat16>());
  return out;
}

void check_x(const torch::Tensor& x, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "x must be fp32 or bf16");
  TORCH_CHECK(block % CHUNK == 0 && x.size(1) % block == 0, "block must be a multiple of 64 dividing K");
}

void check_table(const torch::Tensor& t, torch::ScalarType dtype, int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.numel() == numel, what);
}

const float* bias_ptr(const std::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  check_table(*bias, torch::kFloat32, N, "bias must be float32 [N]");
  return bias->data_ptr<float>();
}

// x [M, K] fp32/bf16; codes uint8 [N, K/2] (chunk layout); scales, offsets fp16 [N, K/block];
// perm: optional int64 [K], x's columns in the weight's order. Returns [M, N] in x's dtype.
torch::Tensor int4_dot_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                              const torch::Tensor& offsets, const std::optional<torch::Tensor>& bias,
                              const std::optional<torch::Tensor>& perm, int64_t block) {
  check_x(x, block);
  const int64_t K = x.size(1), N = codes.size(0), nb = K / block;
  check_table(codes, torch::kUInt8, N * K / 2, "codes must be contiguous uint8 [N, K/2]");
  check_table(scales, torch::kHalf, N * nb, "scales must be float16 [N, K/block]");
  check_table(offsets, torch::kHalf, N * nb, "offsets must be float16 [N, K/block]");
  if (perm.has_value()) check_table(*perm, torch::kInt64, K, "perm must be int64 [K]");
  const Weights w{codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), offsets.data_ptr<at::Half>(), nullptr,
                  nullptr, bias_ptr(bias, N), K, block};
  return run<4>(x, w, N, perm);
}

// x [M, K]; codes int8 [N, K]; row_scale float32 [N]; code_sums float32 [N, K/block] = 128 * the
// sum of each block's codes. Returns [M, N] in x's dtype.
torch::Tensor int8_dot_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& row_scale,
                              const torch::Tensor& code_sums, const std::optional<torch::Tensor>& bias, int64_t block) {
  check_x(x, block);
  const int64_t K = x.size(1), N = codes.size(0);
  check_table(codes, torch::kInt8, N * K, "codes must be contiguous int8 [N, K]");
  check_table(row_scale, torch::kFloat32, N, "row_scale must be float32 [N]");
  check_table(code_sums, torch::kFloat32, N * (K / block), "code_sums must be float32 [N, K/block]");
  const Weights w{reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>()), nullptr, nullptr,
                  row_scale.data_ptr<float>(), code_sums.data_ptr<float>(), bias_ptr(bias, N), K, block};
  return run<8>(x, w, N, std::nullopt);
}

#endif  // TM_HAVE_INT_DOT

// The instruction set the kernels were built for ("" when none: the module then has no kernels).
const char* isa() { return TM_INT_DOT_ISA; }

// Whether calls of at least `amx_min_rows()` rows run on AMX tiles (built for and allowed by the OS).
bool has_amx() {
#ifdef TM_HAVE_AMX
  return amx::enabled();
#else
  return false;
#endif
}

// Rows from which int4 / int8 calls take AMX (0 without it).
std::pair<int64_t, int64_t> amx_min_rows() {
#ifdef TM_HAVE_AMX
  return {amx::min_rows<4>(), amx::min_rows<8>()};
#else
  return {0, 0};
#endif
}

void set_amx_min_rows(int64_t int4_rows, int64_t int8_rows) {
#ifdef TM_HAVE_AMX
  amx::min_rows<4>() = int4_rows;
  amx::min_rows<8>() = int8_rows;
#endif
}

bool available() {
#ifdef TM_HAVE_INT_DOT
  return true;
#else
  return false;
#endif
}

}  // namespace tokenmill::int_dot
