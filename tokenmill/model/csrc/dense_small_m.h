// A dense fp32 linear for a few rows (decode batches, speculative verification): y = x W^T + b.
//
// At 2-8 rows MKL's sgemm runs at a third of memory bandwidth on a 2-core EPYC (a 9728x896
// weight: 1.6 ms for x @ W^T at 1 row, 4.7-5.9 ms at 5 rows), although the weight has to be read
// only once for all rows. Here each thread walks its share of W's rows once and keeps one vector
// accumulator per x row, so time stays near one pass over the weight for up to kMaxRows rows.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define TM_DENSE_VECTORIZED 1
#else
#define TM_DENSE_VECTORIZED 0
#endif

namespace tokenmill::dense {

constexpr int64_t kMaxRows = 8;

namespace detail {

// one SIMD register of floats (extension builds do not get ATen's CPU_CAPABILITY vectors)
#if defined(__AVX512F__)
constexpr int64_t V = 16;
using Reg = __m512;
inline Reg zero() { return _mm512_setzero_ps(); }
inline Reg load(const float* p) { return _mm512_loadu_ps(p); }
inline Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
inline float sum(Reg a) { return _mm512_reduce_add_ps(a); }
#elif TM_DENSE_VECTORIZED
constexpr int64_t V = 8;
using Reg = __m256;
inline Reg zero() { return _mm256_setzero_ps(); }
inline Reg load(const float* p) { return _mm256_loadu_ps(p); }
inline Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
inline float sum(Reg a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX512F__)
inline Reg load_w(const float* p) { return _mm512_loadu_ps(p); }
inline Reg load_w(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif TM_DENSE_VECTORIZED
inline Reg load_w(const float* p) { return _mm256_loadu_ps(p); }
inline Reg load_w(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// out[m, n] = scale[n] * sum_k x[m, k] * w[n, k] + bias[n] over rows n0..n1 (scale: null = 1);
// w is float or int8 codes (weight-only int8: one byte per weight streamed, widened in registers)
#if TM_DENSE_VECTORIZED
template <int M, typename W>
void rows(const float* x, const W* w, const float* scale, const float* bias, float* out, int64_t K, int64_t N,
          int64_t n0, int64_t n1) {
  const int64_t kv = K - K % V;
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    Reg acc[M];
    for (int m = 0; m < M; ++m) acc[m] = zero();
    for (int64_t k = 0; k < kv; k += V) {
      const Reg wv = load_w(wr + k);
      for (int m = 0; m < M; ++m) acc[m] = fma(load(x + m * K + k), wv, acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float s = sum(acc[m]);
      for (int64_t k = kv; k < K; ++k) s += x[m * K + k] * static_cast<float>(wr[k]);
      if (scale) s *= scale[n];
      out[m * N + n] = bias ? s + bias[n] : s;
    }
  }
}
#else
template <int M, typename W>
void rows(const float* x, const W* w, const float* scale, const float* bias, float* out, int64_t K, int64_t N,
          int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * static_cast<float>(w[n * K + k]);
      if (scale) s *= scale[n];
      out[m * N + n] = bias ? s + bias[n] : s;
    }
}
#endif

template <typename W>
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& weight, const float* scale,
                  const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "small_m_linear: shapes");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "small_m_linear: fp32 activations only");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "small_m_linear: 1..", kMaxRows, " rows");
  TORCH_CHECK(weight.is_contiguous(), "small_m_linear: contiguous weight");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const torch::Tensor xc = x.contiguous();
  std::optional<torch::Tensor> b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "small_m_linear: fp32 bias of N");
    b = bias->contiguous();
  }
  torch::Tensor out = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const W* wp = weight.data_ptr<W>();
  const float* bp = b.has_value() ? b->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // ~64 KiB of fp32 weight per task: small layers stay on one thread, big ones split evenly
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: rows<1>(xp, wp, scale, bp, op, K, N, n0, n1); break;
      case 2: rows<2>(xp, wp, scale, bp, op, K, N, n0, n1); break;
      case 3: rows<3>(xp, wp, scale, bp, op, K, N, n0, n1); break;
      case 4: rows<4>(xp, wp, scale, bp, op, K, N, n0, n1); break;
      case 5: rows<5>(xp, wp, scale, bp, op, K, N, n0, n1); break;
      case 6: rows<6>(xp, wp, scale, bp, op, K, N, n0, n1); break;
      case 7: rows<7>(xp, wp, scale, bp, op, K, N, n0, n1); break;
      default: rows<8>(xp, wp, scale, bp, op, K, N, n0, n1); break;
    }
  });
  return out;
}

}  // namespace detail

// x [M, K] fp32 with M <= kMaxRows, weight [N, K] fp32, bias [N] fp32 or none -> [M, N] fp32.
inline torch::Tensor small_m_linear(const torch::Tensor& x, const torch::Tensor& weight,
                                    const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "small_m_linear: fp32 weight");
  return detail::run<float>(x, weight, nullptr, bias);
}

// Past kMaxRows rows: kMaxRows-row chunks, one pass over W each. On a 2-core AVX2 EPYC, fp32, at
// 12 rows (ms, chunked vs MKL sgemm): 49152x576 lm_head 13.6 vs 29.2, 3072x576 gate_up 0.67 vs
// 1.19, 1728x576 qkv 0.38 vs 0.67, but 576x1536 down 0.57 vs 0.62 and at 16 rows 0.85 vs 0.70:
// the second pass only pays for layers at least as wide as they are deep (benchmarks/README.md).
constexpr int64_t kMaxChunkedRows = 2 * kMaxRows;

inline bool chunked_pays(int64_t rows, int64_t out_features, int64_t in_features) {
  return rows > kMaxRows && rows <= kMaxChunkedRows && out_features >= in_features;
}

// x [M, K] fp32 with any M: small_m_linear over row chunks (each row's bits as small_m_linear's).
inline torch::Tensor small_m_linear_chunked(const torch::Tensor& x, const torch::Tensor& weight,
                                           const std::optional<torch::Tensor>& bias) {
  std::vector<torch::Tensor> parts;
  for (int64_t i = 0; i < x.size(0); i += kMaxRows)
    parts.push_back(small_m_linear(x.narrow(0, i, std::min(kMaxRows, x.size(0) - i)), weight, bias));
  return at::cat(parts);
}

// Weight-only int8: codes [N, K] int8 with per-row fp32 scales [N]: x (codes * scale)^T + bias.
inline torch::Tensor small_m_linear_int8(const torch::Tensor& x, const torch::Tensor& codes,
                                         const torch::Tensor& scale, const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(codes.scalar_type() == at::kChar, "small_m_linear_int8: int8 codes");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == codes.size(0) && scale.is_contiguous(),
              "small_m_linear_int8: fp32 scale per row");
  return detail::run<int8_t>(x, codes, scale.data_ptr<float>(), bias);
}

}  // namespace tokenmill::dense
