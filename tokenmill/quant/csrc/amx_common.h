// What every AMX kernel here shares (Sapphire Rapids and later; included only where the compiler
// targets AMX-TILE and AVX512-BF16): the OS permission, the tile configuration, a 16 x 16 dword
// transpose in registers, bf16 vector stores and 64-byte-aligned scratch buffers.
#pragma once
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <memory>

#include <c10/util/BFloat16.h>

namespace tokenmill::amx {

constexpr int TILE = 16;   // rows of a tile = 32-bit lanes of a vector

// Linux hands out AMX tile state only to processes that ask for it (once per process).
inline bool enabled() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Load `cfg` into the tile unit. gcc may treat the config stores as dead (seen: colsb dropped, and
// ldtilecfg faulting on rows without columns): make every byte reach memory first.
inline void load_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// 16 x 16 32-bit values in registers: r[i][j] -> r[j][i] (32-bit, 64-bit, then two 128-bit lane shuffles)
inline void transpose16(__m512 r[TILE]) {
  __m512 t[TILE], u[TILE];
  for (int i = 0; i < TILE; i += 2) {   // t[i], t[i+1]: rows i, i+1 interleaved per 32 bits
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < TILE; i += 4) {   // u[i + c], lane L: column 4L + c of rows i..i+3
    auto pd = [](__m512 v) { return _mm512_castps_pd(v); };
    u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[i]), pd(t[i + 2])));
    u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[i]), pd(t[i + 2])));
    u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[i + 1]), pd(t[i + 3])));
    u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[i + 1]), pd(t[i + 3])));
  }
  for (int c = 0; c < 4; ++c) {         // 4 x 4 transpose of the 128-bit lanes of u[c], u[4+c], u[8+c], u[12+c]
    const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44), v3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}

inline void store16(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
inline void store16(at::BFloat16* dst, __m512 v) {   // round to nearest even, as at::BFloat16 does
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// An uninitialized buffer of n bytes (every byte is written before it is read) and its first
// 64-byte-aligned address, for aligned tile and vector stores.
struct AlignedBytes {
  std::unique_ptr<uint8_t[]> storage;
  uint8_t* data;
  explicit AlignedBytes(int64_t n) : storage(new uint8_t[n + 64]) {
    data = storage.get() + (64 - reinterpret_cast<uintptr_t>(storage.get()) % 64) % 64;
  }
};

}  // namespace tokenmill::amx
