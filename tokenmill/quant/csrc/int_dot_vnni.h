// The AVX512-VNNI half of the integer-dot linears (int_dot_linear.h): every 64-column chunk of
// a weight row meets the matching 64 bytes of x in one vpdpbusd (unsigned x signed bytes, four
// products summed into each int32 lane). The unsigned operand is the int4 weight code, or for
// int8 weights x + 128 (the `code_sums` table takes the 128 back out).
#pragma once
#include <immintrin.h>

namespace tokenmill::int_dot {

constexpr int CHUNK = 64;                 // columns per vpdpbusd
constexpr int MT_MAX = 4;                 // activation rows per register tile
constexpr int RT = 2;                     // weight rows per tile: independent chains at M = 1
constexpr bool kOffsetInt8X = true;   // int8 weights meet x + 128 (uint8)
constexpr int64_t PREFETCH_BYTES = 8192;  // of the weight codes, into L2 (see int_dot_linear.h)

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

// 64 int4 codes (32 bytes, layout in int_dot_linear.h) -> 64 bytes in column order.
inline __m512i unpack_int4(const uint8_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

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

}  // namespace tokenmill::int_dot
