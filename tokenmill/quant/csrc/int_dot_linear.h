// Integer-dot linears for CPUs with AVX512-VNNI: y[M, N] = x[M, K] @ W^T + bias, W stored as
// group-wise asymmetric int4 or per-output-channel int8.
//
// x is quantized per call to int8 in blocks of B columns with one fp32 scale per block (the
// scheme llama.cpp uses for its activations), and every 64-column chunk of a weight row meets
// the matching 64 bytes of x in one vpdpbusd: unsigned weight codes times signed activation
// codes, four products summed into each int32 lane. torch's weight-only kernels widen every
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

#include <cstring>
#include <optional>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TM_HAVE_VNNI 1
#include <immintrin.h>
#endif

namespace tokenmill::int_dot {

#ifdef TM_HAVE_VNNI

constexpr int CHUNK = 64;                 // columns per vpdpbusd
constexpr int MT_MAX = 4;                 // activation rows per register tile
constexpr int RT = 2;                     // weight rows per tile: independent chains at M = 1
constexpr int64_t PREFETCH_BYTES = 8192;  // of the weight codes, into L2 (see the note at the top)

// x after block quantization: codes [M, K] (int8, or uint8 = int8 + 128), per-block scales and
// sums of the dequantized block [M, K/B].
struct QuantizedX {
  torch::Tensor codes, scales, sums;
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One row of x -> int8 codes (+128 when `offset`), per-block scales and sums.
template <typename T>
void quantize_row(const T* row, int64_t K, int64_t B, bool offset, int8_t* codes, float* scales, float* sums) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m128i flip = _mm_set1_epi8(offset ? char(0x80) : 0);   // int8 v ^ 0x80 == uint8 v + 128
  for (int64_t b = 0; b < K / B; ++b) {
    const T* xb = row + b * B;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < B; k += 16) amax = _mm512_max_ps(amax, _mm512_and_ps(load16(xb + k), abs_mask));
    const float m = _mm512_reduce_max_ps(amax);
    const float inv = m > 0.f ? 127.f / m : 0.f, scale = m / 127.f;
    const __m512 vinv = _mm512_set1_ps(inv);
    __m512i total = _mm512_setzero_si512();
    for (int64_t k = 0; k < B; k += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xb + k), vinv));   // nearest even
      total = _mm512_add_epi32(total, q);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + b * B + k), _mm_xor_si128(_mm512_cvtepi32_epi8(q), flip));
    }
    scales[b] = scale;
    sums[b] = scale * static_cast<float>(_mm512_reduce_add_epi32(total));
  }
}

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

// 64 int4 codes (32 bytes, layout above) -> 64 bytes in column order.
inline __m512i unpack_int4(const uint8_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

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

// Dot products of R weight rows from n with MT activation rows from m, into dots[r][t].
template <int BITS, int R, int MT>
inline void tile_dots(const Weights& w, const Activations& a, int64_t n, int64_t m, float dots[RT][MT_MAX]) {
  const int64_t K = w.K, B = w.B, nb = K / B, row_bytes = BITS == 4 ? K / 2 : K;
  __m512 facc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < MT; ++t) facc[r][t] = _mm512_setzero_ps();
  alignas(64) float block_scale[R][MT][16];   // x scale * weight scale of the 16 blocks from b0
  for (int64_t b = 0; b < nb; ++b) {
    if (b % 16 == 0) {   // 16 blocks' combined scales in a few vector ops, not per-block scalar math
      const __mmask16 mask = tail_mask(nb - b);
      for (int t = 0; t < MT; ++t) {
        const __m512 sx = _mm512_maskz_loadu_ps(mask, a.scales + (m + t) * nb + b);
        for (int r = 0; r < R; ++r) {
          const __m512 s = BITS == 4
              ? _mm512_mul_ps(sx, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w.scales + (n + r) * nb + b)))
              : sx;
          _mm512_store_ps(block_scale[r][t], s);
        }
      }
    }
    __m512i acc[R][MT];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < MT; ++t) acc[r][t] = _mm512_setzero_si512();
    for (int64_t k = b * B; k < (b + 1) * B; k += CHUNK) {
      __m512i wv[R];
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w.codes + (n + r) * row_bytes + (BITS == 4 ? k / 2 : k);
        _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES), _MM_HINT_T1);
        wv[r] = BITS == 4 ? unpack_int4(p) : _mm512_loadu_si512(p);
      }
      for (int t = 0; t < MT; ++t) {
        const __m512i xv = _mm512_loadu_si512(a.codes + (m + t) * K + k);
        for (int r = 0; r < R; ++r)   // first operand unsigned: int4 weight codes / int8 x + 128
          acc[r][t] = BITS == 4 ? _mm512_dpbusd_epi32(acc[r][t], wv[r], xv) : _mm512_dpbusd_epi32(acc[r][t], xv, wv[r]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < MT; ++t)
        facc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), _mm512_set1_ps(block_scale[r][t][b % 16]),
                                     facc[r][t]);
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < MT; ++t) {
      for (int64_t g = 0; g < nb; g += 16) {
        const __mmask16 mask = tail_mask(nb - g);
        if constexpr (BITS == 4) {   // + offset[g] * (sum of the dequantized x over block g)
          const __m512 off = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w.offsets + (n + r) * nb + g));
          facc[r][t] = _mm512_fmadd_ps(off, _mm512_maskz_loadu_ps(mask, a.sums + (m + t) * nb + g), facc[r][t]);
        } else {                     // - x scale[g] * 128 * sum of the codes of block g
          facc[r][t] = _mm512_fnmadd_ps(_mm512_maskz_loadu_ps(mask, w.code_sums + (n + r) * nb + g),
                                        _mm512_maskz_loadu_ps(mask, a.scales + (m + t) * nb + g), facc[r][t]);
        }
      }
      const float dot = _mm512_reduce_add_ps(facc[r][t]);
      dots[r][t] = BITS == 4 ? dot : dot * w.row_scale[n + r];
    }
}

template <int BITS, int R>
using TileFn = void (*)(const Weights&, const Activations&, int64_t, int64_t, float[RT][MT_MAX]);

template <int BITS, int R>
constexpr TileFn<BITS, R> kTiles[MT_MAX + 1] = {nullptr, tile_dots<BITS, R, 1>, tile_dots<BITS, R, 2>,
                                                tile_dots<BITS, R, 3>, tile_dots<BITS, R, 4>};

template <int BITS, typename Out>
void run_tiles(const Weights& w, const Activations& a, int64_t M, int64_t N, Out* out) {
  at::parallel_for(0, (N + RT - 1) / RT, 8, [&](int64_t begin, int64_t end) {
    float dots[RT][MT_MAX];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = p * RT;
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
  const QuantizedX q = quantize(x, w.B, BITS == 8, perm);
  const Activations a{reinterpret_cast<const uint8_t*>(q.codes.data_ptr<int8_t>()), q.scales.data_ptr<float>(),
                      q.sums.data_ptr<float>()};
  auto out = torch::empty({x.size(0), N}, x.options());
  if (x.scalar_type() == torch::kFloat32) run_tiles<BITS>(w, a, x.size(0), N, out.data_ptr<float>());
  else run_tiles<BITS>(w, a, x.size(0), N, out.data_ptr<at::BFloat16>());
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

#endif  // TM_HAVE_VNNI

bool available() {
#ifdef TM_HAVE_VNNI
  return true;
#else
  return false;
#endif
}

}  // namespace tokenmill::int_dot
