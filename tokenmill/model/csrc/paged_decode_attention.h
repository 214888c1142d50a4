// Paged attention for decode rows on CPU: each query token attends to its sequence's
// K/V read straight from the block-paged cache, with no gather copy and no padding.
// Built with -ffast-math so that the exp/softmax loops vectorize (glibc's libmvec); the
// kernel never sees inf/NaN inputs by construction (only valid positions are read).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace tokenmill::attention {

template <typename T>
static inline float to_float(T x) { return static_cast<float>(x); }

// bf16 -> fp32 is a 16-bit shift; spelled out so the compiler vectorizes it inside the loops.
template <>
inline float to_float<at::BFloat16>(at::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// fp8 -> fp32 by table: c10's bit-twiddling conversion does not vectorize and made an fp8 cache
// 2-4x slower to read than int8. Built when the library loads (no guard in the hot loop).
template <typename F8>
std::array<float, 256> fp8_table() {
  std::array<float, 256> table{};
  for (int i = 0; i < 256; ++i) table[i] = static_cast<float>(F8(static_cast<uint8_t>(i), F8::from_bits()));
  return table;
}
inline const std::array<float, 256> kE4M3 = fp8_table<at::Float8_e4m3fn>();
inline const std::array<float, 256> kE5M2 = fp8_table<at::Float8_e5m2>();
template <>
inline float to_float<at::Float8_e4m3fn>(at::Float8_e4m3fn x) { return kE4M3[x.x]; }
template <>
inline float to_float<at::Float8_e5m2>(at::Float8_e5m2 x) { return kE5M2[x.x]; }

// Calls visit(t - first, row, slot) for the context's tokens t = first..len-1 in order, row pointing
// at token t's K (or V) row, slot its cache slot (block * block_size + offset: the index of its
// scales); walks block by block, so no division per token. Blocks before `first` (outside a
// sliding window; their table entries may name freed blocks) are never read.
template <typename T, typename F>
static inline void for_each_row(const T* cache, const int32_t* table, int64_t first, int64_t len,
                                int64_t block_size, int64_t row_len, F&& visit) {
  for (int64_t b = first / block_size, t = first; t < len; ++b) {
    const int64_t base = static_cast<int64_t>(table[b]) * block_size;
    const T* block = cache + base * row_len;
    for (int64_t i = t % block_size; i < block_size && t < len; ++i, ++t)
      visit(t - first, block + i * row_len, base + i);
  }
}

// Calls visit(t - first, rows, n) for runs of n <= 16 consecutive context tokens from `first`, rows
// pointing at the first one's K (or V) row (the run's rows follow at row_len): one run per 16 rows of
// a block.
// The next block is prefetched while one is visited: blocks sit anywhere in the cache, too short
// (16 tokens: 6 KiB of K for SmolLM2) for the hardware prefetchers to ramp up on their own.
template <typename T, typename F>
static inline void for_each_run(const T* cache, const int32_t* table, int64_t first, int64_t len,
                                int64_t block_size, int64_t row_len, F&& visit) {
  const int64_t block_bytes = block_size * row_len * static_cast<int64_t>(sizeof(T));
  const int64_t last = (len - 1) / block_size;
  for (int64_t b = first / block_size, t = first; t < len; ++b) {
    const T* block = cache + static_cast<int64_t>(table[b]) * block_size * row_len;
    if (b < last) {
      const char* next = reinterpret_cast<const char*>(cache + static_cast<int64_t>(table[b + 1]) * block_size * row_len);
      for (int64_t off = 0; off < block_bytes; off += 64) __builtin_prefetch(next + off, 0, 2);
    }
    for (int64_t i = t % block_size; i < block_size && t < len;) {
      const int64_t n = std::min<int64_t>({16, block_size - i, len - t});
      visit(t - first, block + i * row_len, n);
      i += n, t += n;
    }
  }
}

// Token rows of context a work item should hold before it is worth its own thread: below it
// (batch 1, short contexts) the whole call runs on the calling thread, an OpenMP fork costing
// more than the arithmetic.
constexpr int64_t TOKENS_PER_TASK = 1024;

#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lane i = the sum of d[i]'s 16 lanes, for 16 vectors at once: a transpose-and-add tree (45 ops for
// 16 sums, where a reduction per vector costs ~9 each).
static inline __m512 sum16(const __m512* d) {
  __m512 x[8], y[4];
  for (int k = 0; k < 8; ++k)   // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = d[2k], b = d[2k+1]
    x[k] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * k], d[2 * k + 1]), _mm512_unpackhi_ps(d[2 * k], d[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: that lane's sums of d[4k .. 4k+3]
    const __m512d a = _mm512_castps_pd(x[2 * k]), b = _mm512_castps_pd(x[2 * k + 1]);
    y[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // add the four 128-bit lanes: lane group k of the result = y[k]'s totals
  const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}
constexpr int64_t MAX_GROUP = 16;      // query heads per KV head the vector path takes
constexpr int64_t MAX_HEAD_VECS = 16;  // head_dim / 16 the vector path takes (head_dim <= 256)
#endif

// Softmax of `len` scores in place.
static inline void softmax_(float* sh, int64_t len) {
  const float mx = *std::max_element(sh, sh + len);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    sh[t] = std::exp(sh[t] - mx);
    sum += sh[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = 0; t < len; ++t) sh[t] *= inv;
}

#if defined(__AVX512F__)
// attend_heads for float caches on AVX-512 (arguments as there), NV = head_dim / 16 (0: not fixed).
// K: 16 tokens at a time, each K row converted once and held in registers for its `group` query
// heads, a head's 16 dot products summed together (sum16). V: a run of 16 rows converted to fp32
// once into an L1 buffer, then each query head's output slice accumulates in registers over the run.
template <int NV, typename T>
static void attend_heads_avx512(const float* qs, const T* k_cache, const T* v_cache, const int32_t* table,
                                int64_t first, int64_t end, int64_t block_size, int64_t row_len, int64_t h0,
                                int64_t h1, int64_t group, int64_t D, float* scores, float* acc) {
  const int64_t nv = NV > 0 ? NV : D / 16, len = end - first, heads = (h1 - h0) * group;
  constexpr int64_t MAX_NV = NV > 0 ? NV : MAX_HEAD_VECS;
  __m512 dots[MAX_GROUP][16];
  for_each_run(k_cache, table, first, end, block_size, row_len, [&](int64_t t, const T* rows, int64_t n) {
    for (int64_t h = h0; h < h1; ++h) {
      const float* q = qs + (h - h0) * group * D;
      for (int64_t i = 0; i < 16; ++i) {
        if (i >= n) {
          for (int64_t g = 0; g < group; ++g) dots[g][i] = _mm512_setzero_ps();
          continue;
        }
        const T* kh = rows + i * row_len + h * D;
        __m512 k[MAX_NV];
        for (int64_t j = 0; j < nv; ++j) k[j] = load16(kh + 16 * j);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q + g * D;
          __m512 d = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
          for (int64_t j = 1; j < nv; ++j) d = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j), k[j], d);
          dots[g][i] = d;
        }
      }
      for (int64_t g = 0; g < group; ++g)
        _mm512_mask_storeu_ps(scores + ((h - h0) * group + g) * len + t, __mmask16((1u << n) - 1), sum16(dots[g]));
    }
  });
  for (int64_t hq = 0; hq < heads; ++hq) softmax_(scores + hq * len, len);
  std::fill(acc, acc + heads * D, 0.f);
  alignas(64) float vconv[16 * 16 * MAX_HEAD_VECS];   // a run of 16 V rows of one head, as fp32
  for_each_run(v_cache, table, first, end, block_size, row_len, [&](int64_t t, const T* rows, int64_t n) {
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < nv; ++j) _mm512_store_ps(vconv + i * D + 16 * j, load16(rows + i * row_len + h * D + 16 * j));
      for (int64_t g = 0; g < group; ++g) {
        const int64_t hq = (h - h0) * group + g;
        float* out = acc + hq * D;
        const float* p = scores + hq * len + t;
        __m512 a[MAX_NV];
        for (int64_t j = 0; j < nv; ++j) a[j] = _mm512_loadu_ps(out + 16 * j);
        for (int64_t i = 0; i < n; ++i) {
          const __m512 pi = _mm512_set1_ps(p[i]);
          for (int64_t j = 0; j < nv; ++j) a[j] = _mm512_fmadd_ps(pi, _mm512_load_ps(vconv + i * D + 16 * j), a[j]);
        }
        for (int64_t j = 0; j < nv; ++j) _mm512_storeu_ps(out + 16 * j, a[j]);
      }
    }
  });
}
#endif

// One sequence, KV heads [h0, h1): query heads h0 * group .. h1 * group - 1, qs [(h1 - h0) * group,
// D] (already scaled), attend to the K/V rows of their KV head at context positions [first, end);
// out acc [same shape]. scores: [(h1 - h0) * group, end - first] scratch. k_scale / v_scale: the
// fp32 scale of each (slot, KV head) of quantized codes (int8 / fp8), or nullptr for float caches.
template <typename T>
static void attend_heads(const float* qs, const T* k_cache, const T* v_cache, const float* k_scale,
                         const float* v_scale, const int32_t* table, int64_t first, int64_t end, int64_t block_size,
                         int64_t row_len, int64_t h0, int64_t h1, int64_t group, int64_t D, int64_t G, float* scores,
                         float* acc) {
  const int64_t heads = (h1 - h0) * group;
  const int64_t len = end - first;
  const int64_t Hk = row_len / D;
#if defined(__AVX512F__)
  constexpr bool vector_dtype = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;
  const int64_t nv = D / 16;
  if constexpr (vector_dtype) if (D % 16 == 0 && nv <= MAX_HEAD_VECS && group <= MAX_GROUP && k_scale == nullptr) {
    // head_dim 64 / 128 / 256 with the vector count fixed at compile time (registers, unrolled loops)
    auto run = [&](auto nv_const) {
      attend_heads_avx512<decltype(nv_const)::value>(qs, k_cache, v_cache, table, first, end, block_size, row_len,
                                                     h0, h1, group, D, scores, acc);
    };
    switch (nv) {
      case 4: run(std::integral_constant<int, 4>{}); return;
      case 8: run(std::integral_constant<int, 8>{}); return;
      case 16: run(std::integral_constant<int, 16>{}); return;
      default: run(std::integral_constant<int, 0>{}); return;
    }
  }
#endif
  // A KV head's row is converted to fp32 once, its scales folded in (quantized codes: G scales per
  // row, one per D / G values), and used by all `group` query heads that share it (an fp32 row is
  // used in place).
  std::vector<float> conv(std::is_same_v<T, float> ? 0 : D);
  const int64_t sub = D / G;
  auto as_float = [&](const T* src, const float* sc) -> const float* {
    if constexpr (std::is_same_v<T, float>) {
      return src;
    } else {
      if (sc == nullptr) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) conv[d] = to_float(src[d]);
      } else {
        for (int64_t g = 0; g < G; ++g) {
          const float s = sc[g];
          const T* sg = src + g * sub;
          float* cg = conv.data() + g * sub;
#pragma omp simd
          for (int64_t d = 0; d < sub; ++d) cg[d] = to_float(sg[d]) * s;
        }
      }
      return conv.data();
    }
  };
  // several scales per row are folded into the converted row; a single one multiplies the dot
  // product / softmax weight instead (D times fewer multiplies)
  const bool fold = G > 1;
  auto scales_of = [&](const float* scale, int64_t slot, int64_t h) {
    return scale == nullptr || !fold ? nullptr : scale + (slot * Hk + h) * G;
  };
  auto row_scale = [&](const float* scale, int64_t slot, int64_t h) {
    return scale == nullptr || fold ? 1.f : scale[slot * Hk + h];
  };
  for_each_row(k_cache, table, first, end, block_size, row_len, [&](int64_t t, const T* krow, int64_t slot) {
    for (int64_t h = h0; h < h1; ++h) {
      const float* kh = as_float(krow + h * D, scales_of(k_scale, slot, h));
      const float ks = row_scale(k_scale, slot, h);
      for (int64_t hq = (h - h0) * group; hq < (h - h0 + 1) * group; ++hq) {
        const float* qh = qs + hq * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qh[d] * kh[d];
        scores[hq * len + t] = dot * ks;
      }
    }
  });
  for (int64_t hq = 0; hq < heads; ++hq) softmax_(scores + hq * len, len);
  std::fill(acc, acc + heads * D, 0.f);
  for_each_row(v_cache, table, first, end, block_size, row_len, [&](int64_t t, const T* vrow, int64_t slot) {
    for (int64_t h = h0; h < h1; ++h) {
      const float* vh = as_float(vrow + h * D, scales_of(v_scale, slot, h));
      const float vs = row_scale(v_scale, slot, h);
      for (int64_t hq = (h - h0) * group; hq < (h - h0 + 1) * group; ++hq) {
        const float p = scores[hq * len + t] * vs;
        float* ah = acc + hq * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ah[d] += p * vh[d];
      }
    }
  });
}

template <typename T, typename C>
static void decode_attention(const T* q, const C* k_cache, const C* v_cache, const float* k_scale,
                             const float* v_scale, const int32_t* block_tables,
                             const int32_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t scale_groups, int64_t block_size,
                             int64_t table_width, float scale, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t D = head_dim;
  const int64_t HD = num_heads * D;
  const int64_t row_len = num_kv_heads * D;   // one token's K (or V) for all heads: contiguous
  int64_t total_len = 0;
  // a sliding window (> 0) attends to the last `window` positions only
  auto first_of = [&](int64_t len) { return window > 0 ? std::max<int64_t>(0, len - window) : 0; };
  for (int64_t s = 0; s < num_seqs; ++s) total_len += context_lens[s] - first_of(context_lens[s]);
  // Work item = one sequence with all its heads (each K/V row read once, whole), or, when there
  // are too few sequences to keep the threads busy, one (sequence, KV head).
  const int64_t split = num_seqs >= 2 * at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t kv_per_item = num_kv_heads / split;
  const int64_t mean_len = std::max<int64_t>(1, total_len / std::max<int64_t>(num_seqs, 1));
  const int64_t grain = std::max<int64_t>(1, (TOKENS_PER_TASK + mean_len - 1) / mean_len);
  // Blocks are walked front to back, so memory access is sequential within a block (the
  // hardware prefetcher's favourite).
  at::parallel_for(0, num_seqs * split, grain, [&](int64_t begin, int64_t end) {
    const int64_t heads = kv_per_item * group;
    std::vector<float> qf(heads * D), acc(heads * D), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / split, h0 = (item % split) * kv_per_item;
      const int64_t len = context_lens[s], first = first_of(len);
      const T* qs = q + s * HD + h0 * group * D;
      scores.resize(heads * (len - first));
      for (int64_t i = 0; i < heads * D; ++i) qf[i] = to_float(qs[i]) * scale;
      attend_heads(qf.data(), k_cache, v_cache, k_scale, v_scale, block_tables + s * table_width, first, len,
                   block_size, row_len, h0,
                   h0 + kv_per_item, group, D, scale_groups, scores.data(), acc.data());
      T* o = out + s * HD + h0 * group * D;
      for (int64_t i = 0; i < heads * D; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

// q: [S, Hq, D]; k_cache/v_cache: [num_blocks, block_size, Hk, D] float (any of fp32/bf16/fp16), or int8 / fp8
// codes with k_scale/v_scale [num_blocks, block_size, Hk, G] fp32 (G scales per row, one per D / G values);
// block_tables: [S, W] int32;
// context_lens: [S] int32; window: attend to the last `window` positions only (0 = all).
// Returns [S, Hq, D] in q's dtype.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t window, std::optional<torch::Tensor> k_scale = std::nullopt,
                                     std::optional<torch::Tensor> v_scale = std::nullopt) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  const bool quantized = k_scale.has_value();
  TORCH_CHECK(quantized == v_scale.has_value(), "both scales or neither");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32,
              "block_tables and context_lens must be int32");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  auto out = torch::empty_like(q);
  const int64_t S = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hk = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hk == 0, "head shapes disagree");
  const float* ks = nullptr;
  const float* vs = nullptr;
  int64_t G = 1;
  if (quantized) {
    G = k_scale->dim() == 4 ? k_scale->size(3) : 0;
    TORCH_CHECK(k_scale->scalar_type() == torch::kFloat && v_scale->scalar_type() == torch::kFloat &&
                k_scale->is_contiguous() && v_scale->is_contiguous() && G > 0 && D % G == 0 &&
                k_scale->numel() == k_cache.numel() / D * G && v_scale->sizes() == k_scale->sizes(),
                "scales must be contiguous fp32 [blocks, block_size, Hk, G] with G dividing head_dim");
    ks = k_scale->data_ptr<float>();
    vs = v_scale->data_ptr<float>();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto* k, auto* v) {
      decode_attention(q.data_ptr<scalar_t>(), k, v, ks, vs, block_tables.data_ptr<int32_t>(),
                       context_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), S, Hq, Hk, D, G, bs,
                       block_tables.size(1), static_cast<float>(scale), window);
    };
    switch (k_cache.scalar_type()) {
      case at::kChar: run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>()); break;
      case at::kFloat8_e4m3fn:
        run(k_cache.data_ptr<at::Float8_e4m3fn>(), v_cache.data_ptr<at::Float8_e4m3fn>()); break;
      case at::kFloat8_e5m2: run(k_cache.data_ptr<at::Float8_e5m2>(), v_cache.data_ptr<at::Float8_e5m2>()); break;
      // float caches, in q's dtype or another (a bf16 cache under an fp32 model)
      case at::kBFloat16: run(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>()); break;
      case at::kHalf: run(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>()); break;
      case at::kFloat: run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>()); break;
      default: TORCH_CHECK(false, "unsupported KV cache dtype ", k_cache.scalar_type());
    }
    TORCH_CHECK(quantized == (k_cache.element_size() == 1), "1-byte KV codes need scales, float caches none");
  });
  return out;
}

}  // namespace tokenmill::attention
