// The AVX2 half of the integer-dot linears (int_dot_linear.h), for CPUs without AVX512-VNNI.
//
// AVX2 has no 4-way byte dot product into int32; vpmaddubsw multiplies unsigned by signed bytes
// and adds neighbouring pairs into SATURATING int16, then vpmaddwd(., 1) widens pairs to int32.
// The pair sums must stay inside int16:
// - int4: weight codes 0..15 times x codes -127..127: a pair is at most 3810, so the two 32-byte
//   halves of a 64-column chunk are added in int16 (7620) before one vpmaddwd.
// - int8: both operands signed. The unsigned side is |w| (vpsignb w, w; at most 128) and x takes
//   w's sign (vpsignb x, w): |w| * sign(w) x = w x, a pair at most 2 * 128 * 127 = 32512 < 32767.
//   So x is quantized without the +128 offset the VNNI kernel uses and `code_sums` is unused.
// Fewer rows per register tile than with 32 zmm registers: 16 ymm registers hold R x MT int32
// block accumulators, as many fp32 accumulators, the unpacked weight and x.
#pragma once
#include <immintrin.h>

namespace tokenmill::int_dot {

constexpr int CHUNK = 64;                 // columns per chunk: two 32-byte vectors
constexpr int MT_MAX = 2;                 // activation rows per register tile
constexpr int RT = 2;                     // weight rows per tile: independent chains at M = 1
constexpr bool kOffsetInt8X = false;      // int8 weights meet signed x (sign trick above)
constexpr int64_t PREFETCH_BYTES = 8192;  // of the weight codes, into L2 (see int_dot_linear.h)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

// One row of x -> int8 codes (+128 when `offset`), per-block scales and sums; B % 32 == 0.
template <typename T>
void quantize_row(const T* row, int64_t K, int64_t B, bool offset, int8_t* codes, float* scales, float* sums) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i flip = _mm256_set1_epi8(offset ? char(0x80) : 0);   // int8 v ^ 0x80 == uint8 v + 128
  // the two packs below interleave 4-byte groups across the 128-bit lanes; this puts them back
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / B; ++b) {
    const T* xb = row + b * B;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t k = 0; k < B; k += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(load8(xb + k), abs_mask));
    const float m = hmax(amax);
    const float inv = m > 0.f ? 127.f / m : 0.f, scale = m / 127.f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i total = _mm256_setzero_si256();
    for (int64_t k = 0; k < B; k += 32) {
      __m256i q[4];
      for (int i = 0; i < 4; ++i) {
        q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xb + k + 8 * i), vinv));   // nearest even
        total = _mm256_add_epi32(total, q[i]);
      }
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * B + k),
                          _mm256_xor_si256(_mm256_permutevar8x32_epi32(bytes, order), flip));
    }
    scales[b] = scale;
    sums[b] = scale * static_cast<float>(hsum(total));
  }
}

// Dot products of R weight rows from n with MT activation rows from m, into dots[r][t].
template <int BITS, int R, int MT>
inline void tile_dots(const Weights& w, const Activations& a, int64_t n, int64_t m, float dots[RT][MT_MAX]) {
  const int64_t K = w.K, B = w.B, nb = K / B, row_bytes = BITS == 4 ? K / 2 : K;
  const __m256i ones = _mm256_set1_epi16(1), nib = _mm256_set1_epi8(0x0F);
  __m256 facc[R][MT];
  float offset_terms[R][MT] = {};   // int4: sum over blocks of offset * (sum of the dequantized x)
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < MT; ++t) facc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i acc[R][MT];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < MT; ++t) acc[r][t] = _mm256_setzero_si256();
    for (int64_t k = b * B; k < (b + 1) * B; k += CHUNK) {
      __m256i w0[R], w1[R];   // int4: columns k..k+31 and k+32..k+63; int8: the two 32-byte halves
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w.codes + (n + r) * row_bytes + (BITS == 4 ? k / 2 : k);
        _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES), _MM_HINT_T1);
        if constexpr (BITS == 4) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
          w0[r] = _mm256_and_si256(v, nib);
          w1[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        } else {
          w0[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
          w1[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
        }
      }
      for (int t = 0; t < MT; ++t) {
        const uint8_t* xp = a.codes + (m + t) * K + k;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32));
        for (int r = 0; r < R; ++r) {
          if constexpr (BITS == 4) {
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w0[r], x0), _mm256_maddubs_epi16(w1[r], x1));
            acc[r][t] = _mm256_add_epi32(acc[r][t], _mm256_madd_epi16(pairs, ones));
          } else {
            const __m256i p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(w0[r], w0[r]), _mm256_sign_epi8(x0, w0[r]));
            const __m256i p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(w1[r], w1[r]), _mm256_sign_epi8(x1, w1[r]));
            acc[r][t] = _mm256_add_epi32(acc[r][t],
                                         _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones)));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < MT; ++t) {
        const float sx = a.scales[(m + t) * nb + b];
        float s = sx;
        if constexpr (BITS == 4) {
          s *= static_cast<float>(w.scales[(n + r) * nb + b]);
          offset_terms[r][t] += static_cast<float>(w.offsets[(n + r) * nb + b]) * a.sums[(m + t) * nb + b];
        }
        facc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][t]), _mm256_set1_ps(s), facc[r][t]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < MT; ++t) {
      const float dot = hsum(facc[r][t]) + offset_terms[r][t];
      dots[r][t] = BITS == 4 ? dot : dot * w.row_scale[n + r];
    }
}

}  // namespace tokenmill::int_dot
