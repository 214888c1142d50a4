// Paged attention for decode rows on CPU: each query token attends to its sequence's
// K/V read straight from the block-paged cache, with no gather copy and no padding.
// One work item = one sequence; all its query heads share every K/V row load.
// Built with -ffast-math so that the exp/softmax loops vectorize (glibc's libmvec); the
// kernel never sees inf/NaN inputs by construction (only valid positions are read).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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

// Calls visit(t, row) for the context's tokens t = 0..len-1 in order, row pointing at token
// t's K (or V) row; walks block by block, so no division per token.
template <typename T, typename F>
static inline void for_each_row(const T* cache, const int32_t* table, int64_t len, int64_t block_size,
                                int64_t row_len, F&& visit) {
  for (int64_t b = 0, t = 0; t < len; ++b) {
    const T* block = cache + static_cast<int64_t>(table[b]) * block_size * row_len;
    for (int64_t i = 0; i < block_size && t < len; ++i, ++t) visit(t, block + i * row_len);
  }
}

template <typename T>
static void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                             const int32_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             int64_t table_width, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t D = head_dim;
  const int64_t HD = num_heads * D;
  const int64_t row_len = num_kv_heads * D;   // one token's K (or V) for all heads: contiguous
  // Each sequence walks its blocks front to back, reading whole token rows, so memory access
  // is sequential within a block (the hardware prefetcher's favourite).
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(HD), acc(HD), scores;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t len = context_lens[s];
      const int32_t* table = block_tables + s * table_width;
      scores.resize(num_heads * len);
      for (int64_t i = 0; i < HD; ++i) qf[i] = to_float(q[s * HD + i]) * scale;
      // pass 1: scores q.k for every cached token; query head hq uses KV head hq / group
      for_each_row(k_cache, table, len, block_size, row_len, [&](int64_t t, const T* krow) {
        for (int64_t hq = 0; hq < num_heads; ++hq) {
          const float* qh = qf.data() + hq * D;
          const T* kh = krow + (hq / group) * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * to_float(kh[d]);
          scores[hq * len + t] = dot;
        }
      });
      for (int64_t hq = 0; hq < num_heads; ++hq) {
        float* sh = scores.data() + hq * len;
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
      // pass 2: weighted sum of V
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row(v_cache, table, len, block_size, row_len, [&](int64_t t, const T* vrow) {
        for (int64_t hq = 0; hq < num_heads; ++hq) {
          const float p = scores[hq * len + t];
          const T* vh = vrow + (hq / group) * D;
          float* ah = acc.data() + hq * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ah[d] += p * to_float(vh[d]);
        }
      });
      T* o = out + s * HD;
      for (int64_t i = 0; i < HD; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

// q: [S, Hq, D]; k_cache/v_cache: [num_blocks, block_size, Hk, D]; block_tables: [S, W] int32;
// context_lens: [S] int32. Returns [S, Hq, D] in q's dtype.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the KV cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32,
              "block_tables and context_lens must be int32");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  auto out = torch::empty_like(q);
  const int64_t S = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hk = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hk == 0, "head shapes disagree");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                               block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
                               out.data_ptr<scalar_t>(), S, Hq, Hk, D, bs, block_tables.size(1),
                               static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
