// The AMX half of the integer-dot linears (int_dot_linear.h), for CPUs with AMX-INT8 (Sapphire
// Rapids and later): the same integer math as the VNNI kernel, 16 x 16 x 64 byte products per
// tile instruction instead of 16 x 4 per vpdpbusd.
//
// The weight stays in the VNNI kernel's row-major layout (no second copy): a 16-row strip of
// weight codes is the tile instructions' A operand (rows = output columns n, 64 bytes of K), and
// x, already block-quantized, is repacked per call as the B operand (4 consecutive K bytes of each
// of 16 activation rows per tile row). The int32 tile C = W_strip . x^T is stored after every x
// block (its scale differs per block and row) and folded into fp32 accumulators, so the result is
// the VNNI kernel's up to fp32 summation order. Rows past the last whole strip (N % 16) take the
// VNNI kernel.
#pragma once
#include <algorithm>
#include <vector>

#include "amx_common.h"

namespace tokenmill::int_dot::amx {

using tokenmill::amx::AlignedBytes;
using tokenmill::amx::enabled;
using tokenmill::amx::store16;
using tokenmill::amx::TILE;            // weight rows per strip = activation rows per group
using tokenmill::amx::transpose16;
constexpr int TILE_BYTES = TILE * 64;
constexpr int64_t L1_BUDGET = 32 * 1024;   // bytes of weight strips + one activation group kept in L1

// Rows M from which a call takes the AMX kernel; below it the VNNI kernel, which streams the weight
// with fewer, prefetched row streams (all SmolLM2 linears on a 2-core Sapphire Rapids, ms VNNI / AMX:
// int8 2.6 / 3.6-6.2 at M = 1, 6.3 / 5.0 at 4, 9.1 / 4.4 at 8; int4 2.6 / 5.2-8.6 at 1, 5.5 / 6.6 at 4,
// 10.0 / 6.3 at 8). Benchmarks move it to compare paths.
template <int BITS>
inline int64_t& min_rows() {
  static int64_t rows = BITS == 8 ? 4 : 8;
  return rows;
}

// tmm0, tmm3: C (int32 [16 n][16 m], alternating by x block); tmm1: A (weight strip, 16 rows x 64
// bytes); tmm2: B (x, 16 K-quads x 16 rows)
inline void configure_tiles() {
  tokenmill::amx::TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.colsb[t] = 64, cfg.rows[t] = TILE;
  tokenmill::amx::load_config(cfg);
}

// x codes [M, K] (int8, never offset: AMX multiplies signed by signed) -> [groups][K/64][16 K-quads][16
// rows][4 bytes] (rows past M are zero): per 64-column chunk, the 16 rows' dwords transposed. Per-block
// scales and sums -> [groups][K/B][16] (the rows of a group side by side, one vector per block).
inline void pack_x(const Activations& a, int64_t M, int64_t K, int64_t nb, uint8_t* codes, float* scales,
                   float* sums) {
  const int64_t groups = (M + TILE - 1) / TILE, chunks = K / 64;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t rows = std::min<int64_t>(TILE, M - g * TILE);
      const uint8_t* x = a.codes + g * TILE * K;
      for (int64_t c = 0; c < chunks; ++c) {
        __m512 t[TILE];
        for (int i = 0; i < TILE; ++i)
          t[i] = i < rows ? _mm512_castsi512_ps(_mm512_loadu_si512(x + i * K + c * 64)) : _mm512_setzero_ps();
        transpose16(t);
        uint8_t* tile = codes + (g * chunks + c) * TILE_BYTES;
        for (int q = 0; q < TILE; ++q) _mm512_store_ps(reinterpret_cast<float*>(tile + q * 64), t[q]);
      }
      for (int64_t b = 0; b < nb; ++b)
        for (int i = 0; i < TILE; ++i) {
          scales[(g * nb + b) * TILE + i] = i < rows ? a.scales[(g * TILE + i) * nb + b] : 0.f;
          sums[(g * nb + b) * TILE + i] = i < rows ? a.sums[(g * TILE + i) * nb + b] : 0.f;
        }
    }
  });
}

// A strip's int4 group scales and offsets as fp32, [K/B][16 rows] (read once per strip, used by every
// activation group).
struct StripTables {
  std::vector<float> scales, offsets;
  void load(const Weights& w, int64_t n0) {
    const int64_t nb = w.K / w.B;
    scales.resize(nb * TILE);
    offsets.resize(nb * TILE);
    for (int r = 0; r < TILE; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        scales[b * TILE + r] = static_cast<float>(w.scales[(n0 + r) * nb + b]);
        offsets[b * TILE + r] = static_cast<float>(w.offsets[(n0 + r) * nb + b]);
      }
  }
};

// One 16-row weight strip from n0 against one group of 16 activation rows: out rows m0.. (mt of them).
// strip_codes: the strip's weight codes as bytes, 16 rows of K at `stride` (int8: the weight itself;
// int4: unpacked once per strip into a scratch buffer, its fp32 tables in `tables`).
template <int BITS, typename Out>
inline void strip(const Weights& w, const uint8_t* strip_codes, int64_t stride, const StripTables& tables,
                  const uint8_t* xcodes, const float* xscales, const float* xsums, int64_t n0, int64_t g,
                  int64_t m0, int mt, int64_t N, Out* out) {
  const int64_t K = w.K, B = w.B, nb = K / B, chunks = K / 64;
  alignas(64) int32_t c_tile[2][TILE][TILE];   // two blocks in flight: one multiplying, one being folded
  __m512 acc[TILE];
#pragma GCC unroll 16
  for (int r = 0; r < TILE; ++r) acc[r] = _mm512_setzero_ps();
  // block b's products into tile C (tmm0 or tmm3, alternating by block; gcc's tile intrinsics take
  // register numbers as literals, hence a macro)
#define TM_AMX_MULTIPLY(C)                                                                         \
  do {                                                                                             \
    _tile_zero(C);                                                                                 \
    for (int64_t k = b * B; k < (b + 1) * B; k += 64) {                                            \
      _tile_loadd(1, strip_codes + k, stride);                                                     \
      _tile_loadd(2, xcodes + (g * chunks + k / 64) * TILE_BYTES, 64);                             \
      /* int8: signed weights x signed x (no + 128, no code-sum table); int4: unsigned x signed */ \
      if constexpr (BITS == 8) _tile_dpbssd(C, 1, 2); else _tile_dpbusd(C, 1, 2);                  \
    }                                                                                              \
  } while (0)
  for (int64_t b = 0; b <= nb; ++b) {
    // the tile instructions of block b run while the vector units fold block b - 1
    if (b < nb) {
      if (b & 1) TM_AMX_MULTIPLY(3); else TM_AMX_MULTIPLY(0);
    }
    if (b > 0) {   // acc += block f's int32 dots, scaled (one fold site, so acc stays in registers)
      const int64_t f = b - 1;
      const __m512 sx = _mm512_loadu_ps(xscales + (g * nb + f) * TILE);
#pragma GCC unroll 16
      for (int r = 0; r < TILE; ++r) {
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_load_si512(c_tile[f & 1][r]));
        if constexpr (BITS == 8) {   // x's block scale (the row scale comes last)
          acc[r] = _mm512_fmadd_ps(dots, sx, acc[r]);
        } else {                     // weight scale x x scale, + offset x the block's sum of x
          const __m512 s = _mm512_mul_ps(sx, _mm512_set1_ps(tables.scales[f * TILE + r]));
          acc[r] = _mm512_fmadd_ps(dots, s, acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(tables.offsets[f * TILE + r]),
                                   _mm512_loadu_ps(xsums + (g * nb + f) * TILE), acc[r]);
        }
      }
    }
    if (b < nb) {
      if (b & 1) _tile_stored(3, c_tile[1], 64); else _tile_stored(0, c_tile[0], 64);
    }
  }
#undef TM_AMX_MULTIPLY
  // a copy, so that acc's address never escapes and it can live in registers across the tile ops
  __m512 res[TILE];
#pragma GCC unroll 16
  for (int r = 0; r < TILE; ++r) res[r] = acc[r];
  transpose16(res);   // res[t]: activation row m0 + t's outputs n0..n0+15, stored as one vector
  const __m512 row_scale = BITS == 8 ? _mm512_loadu_ps(w.row_scale + n0) : _mm512_set1_ps(1.f);
  const __m512 bias = w.bias ? _mm512_loadu_ps(w.bias + n0) : _mm512_setzero_ps();
  for (int t = 0; t < mt; ++t) store16(out + (m0 + t) * N + n0, _mm512_add_ps(_mm512_mul_ps(res[t], row_scale), bias));
}

// The whole strips of y[M, N]; returns the first row n not written (N rounded down to 16).
template <int BITS, typename Out>
int64_t run_strips(const Weights& w, const Activations& a, int64_t M, int64_t N, Out* out) {
  const int64_t K = w.K, nb = K / w.B, groups = (M + TILE - 1) / TILE, strips = N / TILE;
  // pack_x writes every element of these: no zero fill
  const AlignedBytes xcodes(groups * (K / 64) * TILE_BYTES);
  const std::unique_ptr<float[]> xscales(new float[groups * nb * TILE]), xsums(new float[groups * nb * TILE]);
  uint8_t* xc = xcodes.data;
  pack_x(a, M, K, nb, xc, xscales.get(), xsums.get());
  // Strips are walked in runs of `run` whose codes stay in L1 together with one activation group, and
  // each group meets every strip of the run before the next group is read: x then streams from L2
  // once per run instead of once per strip (a tile product costs about as much as loading 1 KB of x
  // from L2).
  const int64_t strip_bytes = TILE * K;
  const int64_t run = std::clamp<int64_t>(std::min(L1_BUDGET / strip_bytes - 1, strips / at::get_num_threads()), 1,
                                          strips);   // and at least one run per thread
  at::parallel_for(0, (strips + run - 1) / run, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    const AlignedBytes scratch(BITS == 4 ? run * strip_bytes : 0);   // int4: the run's codes as bytes
    uint8_t* unpacked = scratch.data;
    std::vector<StripTables> tables(run);
    std::vector<const uint8_t*> codes(run);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t s0 = p * run, count = std::min(run, strips - s0);
      for (int64_t i = 0; i < count; ++i) {
        codes[i] = w.codes + (s0 + i) * TILE * (BITS == 4 ? K / 2 : K);
        if constexpr (BITS == 4) {
          uint8_t* dst = unpacked + i * strip_bytes;
          for (int64_t r = 0; r < TILE; ++r)
            for (int64_t c = 0; c < K / 64; ++c)
              _mm512_store_si512(dst + r * K + c * 64, unpack_int4(codes[i] + r * K / 2 + c * 32));
          codes[i] = dst;
          tables[i].load(w, (s0 + i) * TILE);
        }
      }
      asm volatile("" : : : "memory");   // gcc's tileloadd asm does not say it reads the unpacked codes
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t i = 0; i < count; ++i)
          strip<BITS>(w, codes[i], K, tables[i], xc, xscales.get(), xsums.get(), (s0 + i) * TILE, g, g * TILE,
                      static_cast<int>(std::min<int64_t>(TILE, M - g * TILE)), N, out);
    }
    _tile_release();
  });
  return strips * TILE;
}

}  // namespace tokenmill::int_dot::amx
