// The tiled path's large-M kernel on CPUs with AMX-BF16 (Sapphire Rapids and later), bf16 x only:
// y[M, N] = x[M, Kx] @ W^T (+ bias) with W decoded to bf16 one strip of 32 output columns at a time,
// straight into the tile unit's B layout, and multiplied on AMX tiles.
//
// Why not decode the whole weight and call one bf16 GEMM (the AVX2 path's large-M branch): at 512
// rows that GEMM already runs on AMX, so the decoded copy's round trip through memory (2 bytes per
// weight written, then read back) is pure overhead, ~10 % of SmolLM2's linears. Here a strip's
// decoded panel (Kx x 32 bf16: 36 KB at K = 576) stays in L1/L2 and meets every row of x before the
// next strip is decoded; the codes are the only weight bytes that cross memory, and the decode is
// amortized over M rows.
//
// Register blocking: 2 x 2 tiles of C (32 rows of x x 32 columns, fp32), 2 A tiles (16 rows x 32 K of
// x, loaded straight from x: bf16 rows are already the A layout) and 2 B tiles (16 K-pairs x 16
// columns of the panel) per 32-wide K step: 4 tile products per 4 tile loads.
#pragma once
#include <algorithm>

#include "amx_common.h"

namespace tokenmill::tiled::amx {

using tokenmill::amx::AlignedBytes;
using tokenmill::amx::TILE;

constexpr int64_t STRIP = 2 * TILE;                  // output columns per strip: 2 B tiles
constexpr int64_t BLOCK_ROWS = 2 * TILE;             // rows of x per block: 2 A tiles
constexpr int64_t KSTEP = 32;                        // K per tile product: 16 pairs of bf16
constexpr int64_t PANEL_STEP_BYTES = 2 * TILE * 64;  // one K step of a strip's panel: 2 B tiles

// Rows M from which bf16 x takes this kernel: any (the layers send it only rows past their small-M
// kernels' crossovers, quant/kernels.py); benchmarks move it to compare paths.
inline int64_t& min_rows() {
  static int64_t rows = 1;
  return rows;
}

// tmm0-3: C (rows 0-15 / 16-31 of a block x columns 0-15 / 16-31 of a strip); tmm4, tmm5: A; tmm6, tmm7: B
inline void configure_tiles() {
  tokenmill::amx::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = TILE;
  tokenmill::amx::load_config(cfg);
}

// 32 weights of one row from column k0 (one group: one scale and offset) as 32 bf16 in column order;
// UNSCALED: the codes themselves (int8 with one scale per column, applied to the result instead: exact
// in bf16, and two FMAs fewer per 32 weights).
template <Format F, bool UNSCALED = false>
inline __m512i decode32(const uint8_t* row, int64_t k0, __m512 s, __m512 o, __m512 table) {
  __m512i lo, hi;   // the codes of columns 0-15 and 16-31, one per 32-bit lane
  if constexpr (F == Format::INT8) {
    lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0)));
    hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 + 16)));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 / 2));
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m128i low_nibbles = _mm_and_si128(bytes, nib), high_nibbles = _mm_and_si128(_mm_srli_epi16(bytes, 4), nib);
    const __m128i even = F == Format::INT4 ? low_nibbles : high_nibbles;   // NF4: bitsandbytes' order
    const __m128i odd = F == Format::INT4 ? high_nibbles : low_nibbles;
    lo = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(even, odd));
    hi = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(even, odd));
  }
  __m512 vlo, vhi;
  if constexpr (F == Format::NF4) {
    vlo = _mm512_permutexvar_ps(lo, table);
    vhi = _mm512_permutexvar_ps(hi, table);
  } else {
    vlo = _mm512_cvtepi32_ps(lo);
    vhi = _mm512_cvtepi32_ps(hi);
  }
  if constexpr (UNSCALED) return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(vhi, vlo));
  // round to nearest even, as torch's cast
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(vhi, s, o), _mm512_fmadd_ps(vlo, s, o)));
}

// Columns [n0, n0 + 32) of W over the first Kx columns into the panel: per K step, 2 B tiles whose row j
// holds, for each of 16 columns, the bf16 pair at K offsets 2j, 2j + 1 (that is, dword j of the
// column's 32 decoded weights: a 16 x 16 dword transpose).
template <Format F, bool UNSCALED>
void decode_panel(const uint8_t* codes, const float* scale, const float* offset, __m512 table, int64_t n0,
                  int64_t K, int64_t Kx, int64_t G, uint8_t* panel) {
  const int64_t row_bytes = F == Format::INT8 ? K : K / 2, groups = K / G;
  for (int64_t k0 = 0; k0 < Kx; k0 += KSTEP) {
    const int64_t g = k0 / G;
    for (int64_t half = 0; half < 2; ++half) {
      __m512 cols[TILE];
      for (int c = 0; c < TILE; ++c) {
        const int64_t n = n0 + half * TILE + c;
        const __m512 s = _mm512_set1_ps(scale[n * groups + g]);
        const __m512 o = _mm512_set1_ps(offset ? offset[n * groups + g] : 0.f);
        cols[c] = _mm512_castsi512_ps(decode32<F, UNSCALED>(codes + n * row_bytes, k0, s, o, table));
      }
      tokenmill::amx::transpose16(cols);
      uint8_t* tile = panel + (k0 / KSTEP) * PANEL_STEP_BYTES + half * TILE * 64;
      for (int j = 0; j < TILE; ++j) _mm512_store_ps(reinterpret_cast<float*>(tile + j * 64), cols[j]);
    }
  }
}

// One 32-row block of x (`a`, rows `a_stride` bytes apart: x itself, bf16 rows are the A layout) against
// one decoded panel: y rows [m0, m0 + rows) and columns [n0, n0 + 32). (Packing x so that each K step's
// A tiles are 2 KB in a row measured slower: the copy cost more than the tile loads gained.)
inline void block(const at::BFloat16* a, int64_t a_stride, const uint8_t* panel, int64_t Kx, const float* column_scale,
                  const float* bias, int64_t n0, int64_t m0, int64_t rows, int64_t N, at::BFloat16* out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const auto* a_bytes = reinterpret_cast<const uint8_t*>(a);
  for (int64_t k0 = 0; k0 < Kx; k0 += KSTEP) {
    const uint8_t* b = panel + (k0 / KSTEP) * PANEL_STEP_BYTES;
    _tile_loadd(4, a_bytes + k0 * 2, a_stride);
    _tile_loadd(5, a_bytes + TILE * a_stride + k0 * 2, a_stride);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + TILE * 64, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[BLOCK_ROWS][STRIP];
  _tile_stored(0, &c[0][0], STRIP * 4);
  _tile_stored(1, &c[0][TILE], STRIP * 4);
  _tile_stored(2, &c[TILE][0], STRIP * 4);
  _tile_stored(3, &c[TILE][TILE], STRIP * 4);
  const __m512 b0 = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + n0 + TILE) : _mm512_setzero_ps();
  const __m512 s0 = column_scale ? _mm512_loadu_ps(column_scale + n0) : _mm512_set1_ps(1.f);
  const __m512 s1 = column_scale ? _mm512_loadu_ps(column_scale + n0 + TILE) : _mm512_set1_ps(1.f);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_fmadd_ps(_mm512_load_ps(c[r]), s0, b0), hi = _mm512_fmadd_ps(_mm512_load_ps(c[r] + TILE), s1, b1);
    _mm512_storeu_si512(out + (m0 + r) * N + n0, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
}

// Whether this kernel serves x [M, Kx] against N output columns.
inline bool supports(const torch::Tensor& x, int64_t N) {
  return x.scalar_type() == torch::kBFloat16 && x.size(0) >= min_rows() && x.size(1) % KSTEP == 0 &&
         N % STRIP == 0 && tokenmill::amx::enabled();
}

template <Format F>
torch::Tensor linear(const torch::Tensor& x, const uint8_t* codes, const float* scale, const float* offset,
                     __m512 table, const float* bias, int64_t N, int64_t K, int64_t G) {
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), Kx = xc.size(1);
  const int64_t row_bytes = F == Format::INT8 ? K : K / 2;
  const bool unscaled = F == Format::INT8 && G == K && offset == nullptr;   // one scale per column
  auto out = torch::empty({M, N}, xc.options());
  const auto* xp = xc.data_ptr<at::BFloat16>();
  const int64_t full = M / BLOCK_ROWS * BLOCK_ROWS, blocks = (M + BLOCK_ROWS - 1) / BLOCK_ROWS;
  // the last partial block of rows, zero-padded to 32 once for all strips
  const AlignedBytes tail(M > full ? BLOCK_ROWS * Kx * 2 : 0);
  if (M > full) {
    std::fill_n(reinterpret_cast<at::BFloat16*>(tail.data), BLOCK_ROWS * Kx, at::BFloat16(0.f));
    std::copy_n(xp + full * Kx, (M - full) * Kx, reinterpret_cast<at::BFloat16*>(tail.data));
  }
  at::parallel_for(0, N / STRIP, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    const AlignedBytes panel(Kx / KSTEP * PANEL_STEP_BYTES);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t n0 = s * STRIP;
      if (unscaled) decode_panel<F, true>(codes, scale, offset, table, n0, K, Kx, G, panel.data);
      else decode_panel<F, false>(codes, scale, offset, table, n0, K, Kx, G, panel.data);
      asm volatile("" : : : "memory");   // gcc's tileloadd asm does not say it reads the panel
      // the next strip's codes into L2 while this one multiplies, a share per block of rows
      const int64_t lines = s + 1 < end ? STRIP * row_bytes / 64 : 0;
      const uint8_t* next = codes + (n0 + STRIP) * row_bytes;
      for (int64_t b = 0, i = 0; b < blocks; ++b) {
        for (const int64_t stop = std::min(lines, i + (lines + blocks - 1) / blocks); i < stop; ++i)
          _mm_prefetch(reinterpret_cast<const char*>(next + i * 64), _MM_HINT_T1);
        const int64_t m0 = b * BLOCK_ROWS;
        const bool whole = m0 < full;
        block(whole ? xp + m0 * Kx : reinterpret_cast<const at::BFloat16*>(tail.data), Kx * 2, panel.data, Kx,
              unscaled ? scale : nullptr, bias,
              n0, m0, whole ? BLOCK_ROWS : M - full, N, out.data_ptr<at::BFloat16>());
      }
    }
    _tile_release();
  });
  return out;
}

}  // namespace tokenmill::tiled::amx
