// NF4 weight-only linear on CPU (AVX2 + FMA): y[M, N] = x[M, K] @ W^T + bias, with W held as
// 4-bit code-book indices and one fp32 absmax per block of B weights (B % 32 == 0, K % B == 0).
// The packed codes are streamed once per call; each 32-code chunk is decoded in registers and
// reused for a tile of up to MT_MAX activation rows. On 2 Zen3 cores the decode, not memory, is
// the limit (~5 GB/s of codes at M=1), still ~3x less time than streaming the fp32 weight.
//
// Packing (bitsandbytes order): the row-major weight flattened, element 2i in the HIGH nibble
// of byte i, element 2i+1 in the LOW nibble.
//
// Decode: the 16-entry fp32 code book is split into 4 byte planes, each looked up with one
// in-lane vpshufb over 32 codes, and the bytes are re-joined into floats by unpacks (12 shuffle
// ops per 32 weights, no lane crossing; 1.3x faster here than vpermps + blend). The decoded
// floats come out in a fixed permuted order within every 8 columns, [0 2 4 6 1 3 5 7]; instead of
// undoing it we reorder x once per call the same way (M*K floats, negligible).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cstring>
#include <optional>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "nf4_matmul needs AVX2 and FMA; the Python side falls back to dequantize + matmul"
#endif

namespace tokenmill::nf4 {

namespace {

constexpr int MT_MAX = 4;   // activation rows per register tile (2 accumulators each)

// Byte j of every code-book value, for codes 0..15, in both 128-bit lanes.
struct Planes {
  __m256i p[4];
  explicit Planes(const float* table) {
    alignas(32) uint8_t b[4][32];
    for (int v = 0; v < 16; ++v) {
      uint8_t f[4];
      std::memcpy(f, table + v, 4);
      for (int j = 0; j < 4; ++j) b[j][v] = b[j][v + 16] = f[j];
    }
    for (int j = 0; j < 4; ++j) p[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(b[j]));
  }
};

// Decodes 32 weights (16 bytes) scaled by `s`: w[q] holds columns 8q + [0 2 4 6 1 3 5 7].
inline void decode32(const uint8_t* ptr, const Planes& t, __m256 s, __m256 w[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ptr));
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m128i even = _mm_and_si128(_mm_srli_epi16(bytes, 4), nib);   // columns 0, 2, .., 30
  const __m128i odd = _mm_and_si128(bytes, nib);                        // columns 1, 3, .., 31
  const __m256i c = _mm256_inserti128_si256(_mm256_castsi128_si256(even), odd, 1);
  const __m256i b0 = _mm256_shuffle_epi8(t.p[0], c), b1 = _mm256_shuffle_epi8(t.p[1], c);
  const __m256i b2 = _mm256_shuffle_epi8(t.p[2], c), b3 = _mm256_shuffle_epi8(t.p[3], c);
  const __m256i l0 = _mm256_unpacklo_epi8(b0, b1), l1 = _mm256_unpackhi_epi8(b0, b1);   // low halves
  const __m256i h0 = _mm256_unpacklo_epi8(b2, b3), h1 = _mm256_unpackhi_epi8(b2, b3);   // high halves
  w[0] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(l0, h0)), s);
  w[1] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(l0, h0)), s);
  w[2] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(l1, h1)), s);
  w[3] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(l1, h1)), s);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Dot products of one weight row (codes `row`, absmax `amax`) with MT reordered x rows.
// A accumulators per row break the FMA dependency chain (latency 4 cycles, 2 issued a cycle):
// 4 for a lone row, 2 each when 2..4 rows already interleave independent chains.
template <int MT>
inline void row_dots(const uint8_t* row, const float* amax, const float* xp, int64_t K, int64_t B,
                     const Planes& t, float* dots) {
  constexpr int A = MT == 1 ? 4 : 2;
  __m256 acc[MT][A];
  for (int m = 0; m < MT; ++m)
    for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < K / B; ++blk) {
    const __m256 s = _mm256_set1_ps(amax[blk]);
    for (int64_t k0 = blk * B; k0 < (blk + 1) * B; k0 += 32) {
      __m256 w[4];
      decode32(row + k0 / 2, t, s, w);
      for (int m = 0; m < MT; ++m) {
        const float* xr = xp + m * K + k0;
        for (int j = 0; j < 4; ++j)
          acc[m][j % A] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * j), acc[m][j % A]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m256 sum = acc[m][0];
    for (int a = 1; a < A; ++a) sum = _mm256_add_ps(sum, acc[m][a]);
    dots[m] = hsum(sum);
  }
}

using RowDots = void (*)(const uint8_t*, const float*, const float*, int64_t, int64_t, const Planes&, float*);
constexpr RowDots kRowDots[MT_MAX + 1] = {nullptr, row_dots<1>, row_dots<2>, row_dots<3>, row_dots<4>};

// x [M, K] (any float dtype) -> fp32 with every 8 columns in decode32's order [0 2 4 6 1 3 5 7].
torch::Tensor reorder_x(const torch::Tensor& x) {
  const auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  auto xp = torch::empty({M, K}, xf.options());
  const float* src = xf.data_ptr<float>();
  float* dst = xp.data_ptr<float>();
  for (int64_t r = 0; r < M * K; r += 8)
    for (int i = 0; i < 4; ++i) {
      dst[r + i] = src[r + 2 * i];
      dst[r + 4 + i] = src[r + 2 * i + 1];
    }
  return xp;
}

void check_weight(const torch::Tensor& codes, const torch::Tensor& absmax, const torch::Tensor& table,
                  int64_t K, int64_t B) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.size(1) * 2 == K,
              "codes must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(absmax.scalar_type() == torch::kFloat32 && absmax.is_contiguous() && absmax.size(1) * B == K,
              "absmax must be contiguous float32 [N, K/B]");
  TORCH_CHECK(table.scalar_type() == torch::kFloat32 && table.numel() == 16, "table must be float32 [16]");
  TORCH_CHECK(B % 32 == 0 && K % B == 0, "block size must be a multiple of 32 dividing K");
}

}  // namespace

// x: [M, K] float32 or bfloat16; codes: uint8 [N, K/2]; absmax: float32 [N, K/B]; table: the
// 16 code-book values; bias: optional [N]. Returns [M, N] in x's dtype (fp32 accumulation).
torch::Tensor nf4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor absmax, torch::Tensor table,
                         std::optional<torch::Tensor> bias, int64_t block_size) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), B = block_size;
  check_weight(codes, absmax, table, K, B);
  const auto xp = reorder_x(x);
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  torch::Tensor b32;
  if (bias.has_value()) {
    b32 = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(b32.numel() == N, "bias must be [N]");
  }
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* a = absmax.data_ptr<float>();
  const float* xpp = xp.data_ptr<float>();
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const Planes t(table.data_ptr<float>());
  // Parallel over output rows: each thread streams a disjoint slice of the codes exactly once.
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float dots[MT_MAX];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = c + n * (K / 2);
      const float* amax = a + n * (K / B);
      const float bn = bp ? bp[n] : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += MT_MAX) {
        const int mt = static_cast<int>(std::min<int64_t>(MT_MAX, M - m0));
        kRowDots[mt](row, amax, xpp + m0 * K, K, B, t, dots);
        for (int m = 0; m < mt; ++m) o[(m0 + m) * N + n] = dots[m] + bn;
      }
    }
  });
  return x.scalar_type() == torch::kFloat32 ? out : out.to(x.scalar_type());
}

// The float32 weight [N, K] (the large-M path multiplies it with a BLAS GEMM).
torch::Tensor nf4_dequantize(torch::Tensor codes, torch::Tensor absmax, torch::Tensor table, int64_t block_size) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2, B = block_size;
  check_weight(codes, absmax, table, K, B);
  auto w = torch::empty({N, K}, absmax.options());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* a = absmax.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  const Planes t(table.data_ptr<float>());
  const __m256i natural = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);   // undoes decode32's order
  at::parallel_for(0, N * (K / B), 64, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const __m256 s = _mm256_set1_ps(a[blk]);
      for (int64_t k = blk * B; k < (blk + 1) * B; k += 32) {
        __m256 v[4];
        decode32(c + k / 2, t, s, v);
        for (int q = 0; q < 4; ++q) _mm256_storeu_ps(wp + k + 8 * q, _mm256_permutevar8x32_ps(v[q], natural));
      }
    }
  });
  return w;
}

inline void bind(pybind11::module_ m) {
  m.def("nf4_linear", &nf4_linear, "NF4 weight x activations, few rows (CPU, AVX2)");
  m.def("nf4_dequantize", &nf4_dequantize, "NF4 codes + absmax -> float32 weight (CPU, AVX2)");
}

}  // namespace tokenmill::nf4
