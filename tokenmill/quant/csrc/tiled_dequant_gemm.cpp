// Large-M path of the quantized linears on CPU (AVX2 + FMA): y[M, N] = x[M, K] @ W^T + bias
// with W[n, k] = v(q[n, k]) * scale[n, k / G] + offset[n, k / G], where
//   int4: v(q) = q, offset = -zero * scale;   int8: v(q) = q, one group per row, offset 0;
//   nf4:  v(q) = table[q] (the NF4 code book), scale = the block's absmax, offset 0.
//
// Dequantizing the whole weight and then calling one GEMM writes the full fp32 weight to memory
// and reads it back (4-8x the bytes of the codes). Here each thread dequantizes a tile of output
// rows into a buffer that stays in its L2 (fp32, or bf16 where the GEMM runs in bf16: decoded
// straight to bf16, no fp32 pass) and multiplies x with that tile right away (single-threaded
// BLAS inside the parallel region), so the codes are the only weight bytes that stream.
//
// Codes: int4: uint8 [N, K/2], column 2i in the LOW nibble of byte i, 2i+1 in the high one;
//        nf4:  uint8 [N, K/2], bitsandbytes' order: column 2i in the HIGH nibble;
//        int8: int8 [N, K] (viewed as uint8).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <optional>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "tiled_dequant_gemm needs AVX2 and FMA; the Python side falls back to dequantize + matmul"
#endif

#define TM_HAVE_TILED 1   // the decode stack (model/csrc/decode_stack.cpp) calls tiled_dequant_linear

namespace tokenmill::tiled {
enum class Format { INT4, INT8, NF4 };
}  // namespace tokenmill::tiled

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TM_TILED_AMX 1
#include "tiled_amx.h"
#endif

namespace tokenmill::tiled {

namespace {

// bf16 tiles: twice the rows (measured 58 vs 71 ms at M=32, SmolLM2 stack, EPYC avx512_bf16; on a
// Sapphire Rapids, tiles decoded straight to bf16: 29-32 ms at M=32 with 2x, 31-33 with 4x, 37-41 with 8x)
constexpr int64_t TILE_SCALE_BF16 = 2;
// Without the AMX kernel (tiled_amx.h; e.g. avx512_bf16 CPUs without AMX), from this many rows of
// bf16 x the whole weight (up to a size: a 152k-row quantized lm_head would need 0.5 GB) is decoded to bf16 first and multiplied in one multi-threaded GEMM: the
// per-tile single-threaded GEMM calls cost more than the transient buffer. SmolLM2's linears on a
// Sapphire Rapids, int4, ms tiled -> whole: 29.2 -> 24.7 at M=32, 33.6 -> 30.8 at 64, 85.3 -> 69.1 at 512.
constexpr int64_t WHOLE_WEIGHT_MIN_ROWS = 32;
constexpr int64_t WHOLE_WEIGHT_MAX_BYTES = 64 << 20;
constexpr int64_t TILE_BYTES = 384 * 1024;   // fp32 tile per thread: inside Zen 3's 512 KiB L2 (96-768 KiB measured: within noise)

// The NF4 code book as two 8-entry registers (codes 0-7 and 8-15).
struct Table {
  __m256 low, high;
};

inline void store8(float* dst, __m256 v) { _mm256_storeu_ps(dst, v); }

// fp32 -> bf16, round to nearest even (as torch's cast; weights hold no NaNs)
inline void store8(at::BFloat16* dst, __m256 v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(v)));
#else
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
#endif
}

// 32 weights starting at column k0 of one row, in natural column order, as fp32 or bf16.
template <Format F, typename Out>
inline void decode32(const uint8_t* row, int64_t k0, __m256 s, __m256 o, const Table& table, Out* dst) {
  __m128i a, b;
  if constexpr (F == Format::INT8) {
    a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0));
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 + 16));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 / 2));
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, nib);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nib);
    const __m128i even = F == Format::INT4 ? lo : hi;                    // columns 0, 2, .., 30
    const __m128i odd = F == Format::INT4 ? hi : lo;                     // columns 1, 3, .., 31
    a = _mm_unpacklo_epi8(even, odd);                                    // columns 0..15
    b = _mm_unpackhi_epi8(even, odd);                                    // columns 16..31
  }
  const __m128i parts[4] = {a, _mm_srli_si128(a, 8), b, _mm_srli_si128(b, 8)};
  for (int j = 0; j < 4; ++j) {
    __m256 v;
    if constexpr (F == Format::INT8) {
      v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[j]));
    } else if constexpr (F == Format::INT4) {
      v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
    } else {
      const __m256i idx = _mm256_cvtepu8_epi32(parts[j]);
      const __m256 upper = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7)));
      v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(table.low, idx),      // permute reads idx & 7
                           _mm256_permutevar8x32_ps(table.high, idx), upper);
    }
    store8(dst + 8 * j, _mm256_fmadd_ps(v, s, o));
  }
}

// Rows [n0, n0 + nt) of W into dst [nt, K].
template <Format F, typename Out>
void decode_rows(const uint8_t* codes, const float* scale, const float* offset, const Table& table,
                 int64_t n0, int64_t nt, int64_t K, int64_t G, Out* dst) {
  const int64_t row_bytes = F == Format::INT8 ? K : K / 2, groups = K / G;
  for (int64_t r = 0; r < nt; ++r) {
    const int64_t n = n0 + r;
    const uint8_t* row = codes + n * row_bytes;
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 s = _mm256_set1_ps(scale[n * groups + g]);
      const __m256 o = _mm256_set1_ps(offset ? offset[n * groups + g] : 0.f);
      for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += 32) decode32<F>(row, k0, s, o, table, dst + r * K + k0);
    }
  }
}

// x [M, Kx] @ W^T (+ bias) with W [N, K] decoded tile by tile; returns [M, N] in x's dtype. Kx <= K:
// columns of W past x's width (a group-padded K) are decoded but never multiplied, so x needs no
// padding and the GEMM does no zero work (SmolLM2's K = 576 in groups of 128: 11 % fewer products).
// bf16 x multiplies bf16 tiles (fp32 accumulation inside the GEMM) when `bf16_gemm` says the CPU
// has native bf16 dot products (avx512_bf16 / AMX: there bf16 GEMM beats fp32 at the M this path
// serves); otherwise everything runs in fp32.
template <Format F>
torch::Tensor tiled_linear(const torch::Tensor& x, const torch::Tensor& codes, const float* scale, const float* offset,
                           const Table& table, const std::optional<torch::Tensor>& bias, int64_t K, int64_t G,
                           bool bf16_gemm) {
  const int64_t M = x.size(0), Kx = x.size(1), N = codes.size(0);
  const bool bf16 = bf16_gemm && x.scalar_type() == torch::kBFloat16;
  const auto xc = (bf16 ? x : x.to(torch::kFloat32)).contiguous();
  const uint8_t* c = static_cast<const uint8_t*>(codes.data_ptr());
#ifdef TM_TILED_AMX
  if (bf16 && amx::supports(xc, N)) {   // decode strip by strip into AMX tiles (tiled_amx.h)
    const torch::Tensor b = bias.has_value() ? bias->to(torch::kFloat32).contiguous() : torch::Tensor();
    const __m512 table512 = _mm512_insertf32x8(_mm512_castps256_ps512(table.low), table.high, 1);
    return amx::linear<F>(xc, c, scale, offset, table512, b.defined() ? b.data_ptr<float>() : nullptr, N, K, G);
  }
#endif
  auto out = torch::empty({M, N}, xc.options());
  if (bf16 && M >= WHOLE_WEIGHT_MIN_ROWS && N * K * 2 <= WHOLE_WEIGHT_MAX_BYTES) {
    // many rows: decode the whole weight once (in parallel), then one multi-threaded GEMM
    const auto w = torch::empty({N, K}, xc.options());
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      decode_rows<F>(c, scale, offset, table, begin, end - begin, K, G, w.data_ptr<at::BFloat16>() + begin * K);
    });
    at::mm_out(out, xc, w.narrow(1, 0, Kx).t());
    if (bias.has_value()) out.add_(bias->to(out.scalar_type()));
    return out;
  }
  const int64_t tile_bytes = bf16 ? TILE_SCALE_BF16 * TILE_BYTES : TILE_BYTES;
  const int64_t nt_max = std::max<int64_t>(16, tile_bytes / (K * 4) / 16 * 16);
  const int64_t tiles = (N + nt_max - 1) / nt_max;
  // InferenceMode is thread-local and parallel_for's workers do not inherit it: without this, the
  // in-place mm_out into an inference tensor `out` fails on every thread but the caller's.
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard(inference);
    const torch::Tensor tile = torch::empty({nt_max, K}, xc.options());   // bf16 tiles are decoded as bf16
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * nt_max, nt = std::min(nt_max, N - n0);
      if (bf16) decode_rows<F>(c, scale, offset, table, n0, nt, K, G, tile.data_ptr<at::BFloat16>());
      else decode_rows<F>(c, scale, offset, table, n0, nt, K, G, tile.data_ptr<float>());
      auto y = out.narrow(1, n0, nt);             // strides (N, 1): BLAS writes it in place
      at::mm_out(y, xc, tile.narrow(0, 0, nt).narrow(1, 0, Kx).t());
    }
  });
  if (bias.has_value()) out.add_(bias->to(out.scalar_type()));
  return x.scalar_type() == out.scalar_type() ? out : out.to(x.scalar_type());
}

void check_scale(const torch::Tensor& t, const char* name, int64_t n, int64_t groups) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == n * groups,
              name, " must be contiguous float32 [N, K/G]");
}

}  // namespace

// x: [M, Kx] float32/bfloat16, Kx <= K; codes as above; scale: float32 [N, K/G]; offset: float32
// [N, K/G] or None (zero); bias: optional [N]; bf16_gemm: see tiled_linear. Returns [M, N] in x's
// dtype (fp32 accumulation).
torch::Tensor tiled_dequant_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scale,
                                   std::optional<torch::Tensor> offset, std::optional<torch::Tensor> bias,
                                   int64_t bits, int64_t group_size, bool bf16_gemm) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(codes.is_contiguous() && codes.element_size() == 1 && codes.dim() == 2,
              "codes must be contiguous 1-byte [N, K/2] (4-bit) or [N, K] (8-bit)");
  const int64_t K = bits == 4 ? codes.size(1) * 2 : codes.size(1), N = codes.size(0), G = group_size;
  TORCH_CHECK(G % 32 == 0 && K % G == 0, "group size must be a multiple of 32 dividing K");
  TORCH_CHECK(x.size(1) <= K, "x has more columns than the weight");
  check_scale(scale, "scale", N, K / G);
  if (offset.has_value()) check_scale(*offset, "offset", N, K / G);
  const float* o = offset.has_value() ? offset->data_ptr<float>() : nullptr;
  const Table none{_mm256_setzero_ps(), _mm256_setzero_ps()};
  return bits == 4 ? tiled_linear<Format::INT4>(x, codes, scale.data_ptr<float>(), o, none, bias, K, G, bf16_gemm)
                   : tiled_linear<Format::INT8>(x, codes, scale.data_ptr<float>(), o, none, bias, K, G, bf16_gemm);
}

// NF4: codes uint8 [N, K/2] (bitsandbytes nibble order), absmax float32 [N, K/block], table the
// 16 code-book values.
torch::Tensor tiled_nf4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor absmax, torch::Tensor table,
                               std::optional<torch::Tensor> bias, int64_t block_size, bool bf16_gemm) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int64_t K = x.size(1), N = codes.size(0), B = block_size;
  TORCH_CHECK(B % 32 == 0 && K % B == 0, "block size must be a multiple of 32 dividing K");
  TORCH_CHECK(codes.is_contiguous() && codes.element_size() == 1 && codes.size(1) == K / 2,
              "codes must be contiguous uint8 [N, K/2]");
  check_scale(absmax, "absmax", N, K / B);
  TORCH_CHECK(table.scalar_type() == torch::kFloat32 && table.is_contiguous() && table.numel() == 16,
              "table must be 16 float32 values");
  const float* t = table.data_ptr<float>();
  const Table tab{_mm256_loadu_ps(t), _mm256_loadu_ps(t + 8)};
  return tiled_linear<Format::NF4>(x, codes, absmax.data_ptr<float>(), nullptr, tab, bias, K, B, bf16_gemm);
}

inline void bind(pybind11::module_ m) {
  m.def("tiled_dequant_linear", &tiled_dequant_linear,
        "integer weights (4/8-bit, per-group affine) x many activation rows, dequantized tile by tile (CPU, AVX2)");
  m.def("tiled_nf4_linear", &tiled_nf4_linear,
        "NF4 weights (block absmax) x many activation rows, dequantized tile by tile (CPU, AVX2)");
#ifdef TM_TILED_AMX
  // benchmarks move the AMX kernel's row threshold to compare it with the whole-weight decode + GEMM
  m.def("amx_min_rows", [] { return amx::min_rows(); }, "rows from which bf16 x is multiplied on AMX tiles");
  m.def("set_amx_min_rows", [](int64_t rows) { amx::min_rows() = rows; });
#endif
}

}  // namespace tokenmill::tiled
