// The elementwise parts of a decoder layer as single CPU ops. In eager torch each of them is a
// chain of 5-15 small ops (RMSNorm: cast, pow, mean, add, rsqrt, mul, mul, cast; rope: two
// gathers, chunk, four muls, two adds, cat, cast, for q and for k) whose dispatch costs more than
// their arithmetic at decode batch sizes: ~60% of a batch-1 step that is not matmul.
// Math matches tokenmill/model/layers.py and rope.py (fp32 inside, results in the tensor's dtype).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

namespace tokenmill::fused {

namespace {

inline float load(float x) { return x; }
inline float load(at::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float load(at::Half x) { return static_cast<float>(x); }
template <typename T> inline T store(float x) { return static_cast<T>(x); }

// Rows worth of work below which the op runs on the calling thread (decode batches).
constexpr int64_t GRAIN_ELEMS = 1 << 15;
int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, GRAIN_ELEMS / std::max<int64_t>(row_elems, 1)); }

// out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w, with x optionally x + delta first (written to sum).
template <typename W, typename D>
void norm_rows(const float* x, const D* delta, float* sum, const W* w, W* out, int64_t T, int64_t H, double eps) {
  at::parallel_for(0, T, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = x + t * H;
      float* sr = sum ? sum + t * H : nullptr;
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        float v = xr[i];
        if (delta) v += load(delta[t * H + i]);
        if (sr) sr[i] = v;
        ss += v * v;
      }
      const float* src = sr ? sr : xr;
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      W* o = out + t * H;
      for (int64_t i = 0; i < H; ++i) o[i] = store<W>(src[i] * inv * load(w[i]));
    }
  });
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), name, " must be a contiguous CPU [T, H] tensor");
}

}  // namespace

// RMSNorm of fp32 x [T, H]; returns weight's dtype.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [H]");
  auto out = torch::empty(x.sizes(), x.options().dtype(weight.scalar_type()));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, weight.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t, float>(x.data_ptr<float>(), nullptr, nullptr, weight.data_ptr<scalar_t>(),
                               out.data_ptr<scalar_t>(), x.size(0), x.size(1), eps);
  });
  return out;
}

// (x + delta, RMSNorm(x + delta)): the residual add fused with the next norm. x fp32 [T, H] is
// not modified; delta [T, H] any float dtype; the sum is fp32, the norm in weight's dtype.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.sizes() == delta.sizes(), "x must be float32, delta x's shape");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [H]");
  auto sum = torch::empty_like(x);
  auto out = torch::empty(x.sizes(), x.options().dtype(weight.scalar_type()));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, weight.scalar_type(), "add_rms_norm_w", [&] {
    using W = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, delta.scalar_type(), "add_rms_norm_d", [&] {
      norm_rows<W, scalar_t>(x.data_ptr<float>(), delta.data_ptr<scalar_t>(), sum.data_ptr<float>(),
                             weight.data_ptr<W>(), out.data_ptr<W>(), x.size(0), x.size(1), eps);
    });
  });
  return {sum, out};
}

namespace {

void check_rope_view(const torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.device().is_cpu(), "q/k must be CPU [T, H, D] views with contiguous D");
  TORCH_CHECK(positions.numel() == x.size(0) && cos.size(1) * 2 == x.size(2), "positions / cos width do not match q/k");
}

template <typename scalar_t>
inline void rotate_row(scalar_t* r, const float* cr, const float* sr, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = load(r[i]), x2 = load(r[i + half]);
    r[i] = store<scalar_t>(x1 * cr[i] - x2 * sr[i]);
    r[i + half] = store<scalar_t>(x2 * cr[i] + x1 * sr[i]);
  }
}

}  // namespace

// Neox rotary embedding IN PLACE on q [T, Hq, D] and k [T, Hk, D] (any strides with a contiguous
// last dim, e.g. the q and k views of a fused qkv output): x1, x2 = halves;
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, cos/sin fp32 [max_pos, D/2] rows picked by
// positions [T] (int64). One call for both: half the dispatches of rotating them apart.
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous(), "positions must be int64 [T]");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
              sin.is_contiguous() && cos.sizes() == sin.sizes(), "cos/sin must be contiguous float32 [P, D/2]");
  check_rope_view(q, positions, cos);
  check_rope_view(k, positions, cos);
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must share a dtype");
  const int64_t T = q.size(0), Hq = q.size(1), Hk = k.size(1), half = q.size(2) / 2, P = cos.size(0);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " outside the rope table");
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rope_", [&] {
    scalar_t* qb = q.data_ptr<scalar_t>();
    scalar_t* kb = k.data_ptr<scalar_t>();
    at::parallel_for(0, T, grain_rows((Hq + Hk) * 2 * half), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cr = c + pos[t] * half;
        const float* sr = s + pos[t] * half;
        for (int64_t h = 0; h < Hq; ++h) rotate_row(qb + t * qs0 + h * qs1, cr, sr, half);
        for (int64_t h = 0; h < Hk; ++h) rotate_row(kb + t * ks0 + h * ks1, cr, sr, half);
      }
    });
  });
}

// K/V rows of this step into their cache slots: k, v [T, Hk, D] (strided views of the qkv output
// are fine), caches [num_blocks, block_size, Hk, D] contiguous of the same dtype, slots [T] int64.
// One call instead of two casts and two index_copy_ dispatches per layer.
void write_kv_(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1, "k/v must be [T, Hk, D] with contiguous D");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "caches must be contiguous [blocks, block_size, Hk, D]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "k/v and the caches must share a dtype");
  TORCH_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2), "cache heads/dims do not match k");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == k.size(0), "slots must be int64 [T]");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2), row = H * D;
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < capacity, "slot ", sl[t], " outside the cache");
  const int64_t elem = k.element_size();
  auto copy_rows = [&](const torch::Tensor& src, torch::Tensor& cache) {
    const char* base = static_cast<const char*>(src.data_ptr());
    char* dst = static_cast<char*>(cache.data_ptr());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(dst + (sl[t] * row + h * D) * elem, base + (t * src.stride(0) + h * src.stride(1)) * elem, D * elem);
  };
  copy_rows(k, k_cache);
  copy_rows(v, v_cache);
}

// Quantize a step's K/V rows [T, Hk, D] (fp32) per (token, head, group of D / G values) into 1-byte
// codes and fp32 scales [.., G] at their slots: scale = max(absmax, 1e-12) * (1 / qmax); code =
// round-half-even(x * (1 / scale)) for int8, the fp8 cast of x * (1 / scale) otherwise: the same
// arithmetic, bit for bit, as tokenmill/quant/kv_cache.py's torch reference.
template <typename C>
static void quantize_rows(const torch::Tensor& src, torch::Tensor& codes, torch::Tensor& scales, const int64_t* sl,
                          float inv_qmax) {
  const int64_t T = src.size(0), H = src.size(1), D = src.size(2), G = scales.size(3), sub = D / G;
  const float* x = src.data_ptr<float>();
  C* dst = reinterpret_cast<C*>(codes.data_ptr());
  float* sc = scales.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t g = 0; g < G; ++g) {
        const float* row = x + t * src.stride(0) + h * src.stride(1) + g * sub;
        float amax = 0.f;
        for (int64_t d = 0; d < sub; ++d) amax = std::max(amax, std::fabs(row[d]));
        const float s = std::max(amax, 1e-12f) * inv_qmax;
        const float inv = 1.f / s;
        C* out = dst + (sl[t] * H + h) * D + g * sub;
        for (int64_t d = 0; d < sub; ++d) {
          const float y = row[d] * inv;
          if constexpr (std::is_same_v<C, int8_t>)
            out[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(y))));
          else
            out[d] = static_cast<C>(y);
        }
        sc[(sl[t] * H + h) * G + g] = s;
      }
}

void write_kv_quantized_(torch::Tensor k, torch::Tensor v, torch::Tensor k_codes, torch::Tensor v_codes,
                         torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor slots, double qmax) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
              k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat, "k/v must be fp32 [T, Hk, D]");
  TORCH_CHECK(k_codes.is_contiguous() && v_codes.is_contiguous() && k_codes.dim() == 4 &&
              v_codes.sizes() == k_codes.sizes() && k_codes.scalar_type() == v_codes.scalar_type(),
              "codes must be contiguous [blocks, block_size, Hk, D]");
  TORCH_CHECK(k_scale.is_contiguous() && v_scale.is_contiguous() && k_scale.scalar_type() == torch::kFloat &&
              k_scale.dim() == 4 && k_scale.size(3) > 0 && k.size(2) % k_scale.size(3) == 0 &&
              k_scale.numel() * (k.size(2) / k_scale.size(3)) == k_codes.numel() && v_scale.sizes() == k_scale.sizes(),
              "scales must be contiguous fp32 [blocks, block_size, Hk, G] with G dividing head_dim");
  TORCH_CHECK(k_codes.size(2) == k.size(1) && k_codes.size(3) == k.size(2), "cache heads/dims do not match k");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == k.size(0), "slots must be int64 [T]");
  const int64_t capacity = k_codes.size(0) * k_codes.size(1);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < capacity, "slot ", sl[t], " outside the cache");
  auto run = [&](auto tag) {
    using C = decltype(tag);
    const float inv_qmax = static_cast<float>(1.0 / qmax);
    quantize_rows<C>(k, k_codes, k_scale, sl, inv_qmax);
    quantize_rows<C>(v, v_codes, v_scale, sl, inv_qmax);
  };
  switch (k_codes.scalar_type()) {
    case at::kChar: run(int8_t{}); break;
    case at::kFloat8_e4m3fn: run(at::Float8_e4m3fn{}); break;
    case at::kFloat8_e5m2: run(at::Float8_e5m2{}); break;
    default: TORCH_CHECK(false, "codes must be int8 or fp8, got ", k_codes.scalar_type());
  }
}

// silu(gate) * up for gate_up [T, 2I] (gate first, as the fused projection lays it out) -> [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I, "gate_up width must be even");
  auto out = torch::empty({T, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = in + t * 2 * I;
        const scalar_t* u = g + I;
        scalar_t* r = o + t * I;
        for (int64_t i = 0; i < I; ++i) {
          const float gv = load(g[i]);
          r[i] = store<scalar_t>(gv / (1.f + std::exp(-gv)) * load(u[i]));
        }
      }
    });
  });
  return out;
}

}  // namespace tokenmill::fused
