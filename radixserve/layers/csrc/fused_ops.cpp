// The element-wise steps of a decoder layer fused into one pass each, for the CPU fast path:
// at decode a batch has a handful of rows, and each of these steps costs the reference
// (radixserve/layers/layernorm.py, rotary_embedding.py, llama.py's MLP) 5 to 14 eager ops.
//
// rms_norm(x [T, N], w [N], eps) -> out [T, N]
// add_rms_norm(x [T, N], residual [T, N], w [N], eps) -> ()
//     residual += x, then x = rms_norm(residual) (both in place)
// rotary_embedding(q [T, Hq, D], k [T, Hk, D], cos [T, D], sin [T, D]) -> ()
//     neox (rotate-half) layout, in place; q and k may be strided views (the qkv projection's)
// silu_and_mul(x [T, 2I]) -> out [T, I] = silu(x[:, :I]) * x[:, I:]
// argmax_rows(x [T, V]) -> out [T] int64: torch.argmax(x, dim=-1) (the greedy sampler's)
// store_kv(k_buf [S, Hkv, D], v_buf, loc [T] int64, k [T, Hkv, D], v [T, Hkv, D]) -> ()
//     k_buf[loc] = k, v_buf[loc] = v in the pool's dtype, converted as memory_pool.to_kv_dtype
//     converts; for an fp8 pool (saturated at its largest finite value, then rounded to
//     nearest even as torch's cast rounds: the same bytes, NaN as NaN) in one vectorized pass
//     where the Python store takes a clamp, a cast and an index_put_ for each buffer
//
// Each computes what the reference computes, rounding where it rounds: RMSNorm in fp32 and the
// weight applied in the input dtype, the residual added in the input dtype, the rotary's
// products rounded before their sum. In fp32 the results equal the reference's up to the order
// of the sum of squares and the exp of SiLU. Rows run in parallel only when there are enough of
// them to pay for waking the thread pool (decode steps run inline).

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels.h"
#include "vec_math.h"

namespace {

// Elements handled by one thread before another is worth waking.
constexpr int64_t kGrainElements = 1 << 15;

int64_t row_grain(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

// Rounds a float to scalar_t and back: the reference's intermediate rounding in that dtype.
template <typename scalar_t>
inline float rounded(float v) {
  return static_cast<float>(static_cast<scalar_t>(v));
}

template <typename scalar_t>
void norm_row(const scalar_t* in, const scalar_t* w, scalar_t* out, int64_t n, float eps) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(in[i]);
    sq += v * v;
  }
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    const float h = rounded<scalar_t>(static_cast<float>(in[i]) * inv);
    out[i] = static_cast<scalar_t>(static_cast<float>(w[i]) * h);
  }
}

// The index of a row's largest value, as torch.argmax picks it: the first of equal maxima,
// and a NaN counts as larger than everything (the first NaN wins). Two passes: the maximum of
// the non-NaN values and whether any NaN is there, then the first position that holds it
// (ATen's argmax carries an index through every comparison and runs ~3-10x slower).
template <typename scalar_t>
int64_t argmax_row_scalar(const scalar_t* x, int64_t n) {
  using T = at::opmath_type<scalar_t>;  // double stays double: no two values merged
  T m = -std::numeric_limits<T>::infinity();
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const T v = static_cast<T>(x[i]);
    m = v > m ? v : m;
    nan = nan || v != v;
  }
  for (int64_t i = 0; i < n; ++i) {
    const T v = static_cast<T>(x[i]);
    if (nan ? v != v : v == m) return i;
  }
  return 0;
}

template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (radixserve_vec::kVector16<scalar_t>) {
    using radixserve_vec::first;
    using radixserve_vec::load16;
    // vmaxps returns its second operand when either is NaN: max(v, m) skips NaN lanes.
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m512 a = load16(x + i), b = load16(x + i + 16), c = load16(x + i + 32),
                   d = load16(x + i + 48);
      nan |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, d, _CMP_UNORD_Q);
      m0 = _mm512_max_ps(a, m0);
      m1 = _mm512_max_ps(b, m1);
      m2 = _mm512_max_ps(c, m2);
      m3 = _mm512_max_ps(d, m3);
    }
    for (; i < n; i += 16) {
      const __mmask16 k = first(n - i);
      const __m512 a = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), k, load16(x + i, k));
      nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
      m0 = _mm512_max_ps(a, m0);
    }
    const float m =
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
    const __m512 mv = _mm512_set1_ps(m);
    for (i = 0; i < n; i += 16) {
      const __mmask16 k = first(n - i);
      const __m512 a = load16(x + i, k);
      const __mmask16 hit = nan ? _mm512_mask_cmp_ps_mask(k, a, a, _CMP_UNORD_Q)
                                : _mm512_mask_cmp_ps_mask(k, a, mv, _CMP_EQ_OQ);
      if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
    }
    return 0;  // not reached: the maximum is in the row
  }
#endif
  return argmax_row_scalar(x, n);
}

}  // namespace

namespace radixserve {

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": x must be [T, N] with unit stride");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), name,
              ": weight must be [N]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), name, ": weight and x differ in dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t T = x.size(0), N = x.size(1), stride = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(N), [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t)
        norm_row<scalar_t>(xp + t * stride, wp, op + t * N, N, static_cast<float>(eps));
    });
  });
  return out;
}

void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.stride(1) == 1,
              "add_rms_norm: residual must match x");
  const int64_t T = x.size(0), N = x.size(1);
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(N), [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        scalar_t* xr = xp + t * xs;
        scalar_t* rr = rp + t * rs;
        for (int64_t i = 0; i < N; ++i)
          rr[i] = static_cast<scalar_t>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
        norm_row<scalar_t>(rr, wp, xr, N, static_cast<float>(eps));
      }
    });
  });
}

template <typename scalar_t>
void rotate_heads(scalar_t* base, int64_t heads, int64_t head_stride, int64_t half,
                  const scalar_t* cos, const scalar_t* sin) {
  for (int64_t h = 0; h < heads; ++h) {
    scalar_t* x = base + h * head_stride;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if constexpr (radixserve_vec::kVector16<scalar_t>) {  // the loop below, 16 pairs at a time
      using radixserve_vec::load16, radixserve_vec::store16, radixserve_vec::round16;
      const __m512 sign = _mm512_set1_ps(-0.f);
      for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = radixserve_vec::first(half - i);
        const __m512 x1 = load16(x + i, m), x2 = load16(x + i + half, m);
        const __m512 a = round16<scalar_t>(_mm512_mul_ps(x1, load16(cos + i, m)));
        const __m512 b =
            round16<scalar_t>(_mm512_mul_ps(_mm512_xor_ps(x2, sign), load16(sin + i, m)));
        const __m512 c = round16<scalar_t>(_mm512_mul_ps(x2, load16(cos + i + half, m)));
        const __m512 d = round16<scalar_t>(_mm512_mul_ps(x1, load16(sin + i + half, m)));
        store16(x + i, _mm512_add_ps(a, b), m);
        store16(x + i + half, _mm512_add_ps(c, d), m);
      }
      continue;
    }
#endif
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
      // out = x * cos + rotate_half(x) * sin, each product rounded as the reference does.
      const float a = rounded<scalar_t>(x1 * static_cast<float>(cos[i]));
      const float b = rounded<scalar_t>(-x2 * static_cast<float>(sin[i]));
      const float c = rounded<scalar_t>(x2 * static_cast<float>(cos[i + half]));
      const float d = rounded<scalar_t>(x1 * static_cast<float>(sin[i + half]));
      x[i] = static_cast<scalar_t>(a + b);
      x[i + half] = static_cast<scalar_t>(c + d);
    }
  }
}

void check_heads(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, name, " must be [T, H, D] with unit stride");
}

void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_heads(q, "rotary_embedding: q");
  check_heads(k, "rotary_embedding: k");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && D % 2 == 0,
              "rotary_embedding: q and k must share T and an even D");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && cos.size(0) == T && cos.size(1) == D &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "rotary_embedding: cos and sin must be contiguous [T, D]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(),
              "rotary_embedding: q, k, cos and sin must share a dtype");
  const int64_t Hq = q.size(1), Hk = k.size(1), half = D / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain((Hq + Hk) * D), [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        rotate_heads<scalar_t>(qp + t * q.stride(0), Hq, q.stride(1), half, cp + t * D, sp + t * D);
        rotate_heads<scalar_t>(kp + t * k.stride(0), Hk, k.stride(1), half, cp + t * D, sp + t * D);
      }
    });
  });
}

// out[i] = g[i] / (1 + exp(-g[i])), the reference's SiLU.
inline void silu(const float* g, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(g + i);
    const __m256 e = radixserve_vec::exp8(_mm256_xor_ps(v, sign));
    _mm256_storeu_ps(out + i, _mm256_div_ps(v, _mm256_add_ps(one, e)));
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i]));
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [T, 2I] with unit stride");
  const int64_t T = x.size(0), I = x.size(1) / 2, stride = x.stride(0);
  at::Tensor out = at::empty({T, I}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(2 * I), [&](int64_t lo, int64_t hi) {
      constexpr int64_t kChunk = 256;
      float g[kChunk], s[kChunk];
      for (int64_t t = lo; t < hi; ++t) {
        const scalar_t* gate = xp + t * stride;
        const scalar_t* up = gate + I;
        scalar_t* o = op + t * I;
        for (int64_t c = 0; c < I; c += kChunk) {
          const int64_t n = std::min(kChunk, I - c);
          for (int64_t i = 0; i < n; ++i) g[i] = static_cast<float>(gate[c + i]);
          silu(g, s, n);
          for (int64_t i = 0; i < n; ++i)
            o[c + i] = static_cast<scalar_t>(rounded<scalar_t>(s[i]) *
                                             static_cast<float>(up[c + i]));
        }
      }
    });
  });
  return out;
}

at::Tensor to_kv_dtype(const at::Tensor& x, at::ScalarType dtype) {
  if (!is_fp8(dtype)) return x.to(dtype);
  const double limit = fp8_max(dtype);
  return x.clamp(-limit, limit).to(dtype);
}

namespace {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 floats as fp8 bytes, exactly as torch's cast (c10's fp8e4m3fn / fp8e5m2_from_fp32_value)
// rounds them once saturated (M mantissa bits, exponent bias B, from fp8_t's limits). Normal
// results round by integer addition on the bits (to nearest even); those under the smallest
// normal by a float addition of a power of two that leaves them in the low mantissa bits; NaN
// stays NaN.
template <typename fp8_t>
inline __m128i fp8_bytes(__m512 x) {
  using limits = std::numeric_limits<fp8_t>;
  constexpr int M = limits::digits - 1, B = 2 - limits::min_exponent;  // e5m2: 2, 15; e4m3: 3, 7
  constexpr int S = 23 - M;
  const __m512 limit = _mm512_set1_ps(static_cast<float>(limits::max()));
  // saturate (operand order keeps NaN: max/min return their second operand for NaN)
  x = _mm512_min_ps(limit, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), limit), x));
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(INT32_MIN));
  const __m512i a = _mm512_xor_si512(bits, sign);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, S), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_set1_epi32(static_cast<int32_t>(
      static_cast<uint32_t>(B - 127) * (1u << 23) + (1u << (S - 1)) - 1));
  const __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, bias), odd), S);
  const __m512i denorm = _mm512_set1_epi32((127 - B + S + 1) << 23);
  const __m512i small = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(denorm))),
      denorm);
  __m512i r = _mm512_mask_mov_epi32(
      normal, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32((128 - B) << 23)), small);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000)),
                            _mm512_set1_epi32(0x7F));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(r, _mm512_srli_epi32(sign, 24)));
}

template <typename src_t, typename dst_t>
void store_rows(const at::Tensor& buf, const at::Tensor& x, const int64_t* loc, int64_t T,
                int64_t W) {
  dst_t* out = buf.data_ptr<dst_t>();
  const src_t* in = x.data_ptr<src_t>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, T, row_grain(W), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const src_t* src = in + t * stride;
      dst_t* dst = out + loc[t] * W;
      for (int64_t i = 0; i < W; i += 16) {
        const __mmask16 m = radixserve_vec::first(W - i);
        const __m512 v = radixserve_vec::load16(src + i, m);
        _mm_mask_storeu_epi8(dst + i, m, fp8_bytes<dst_t>(v));
      }
    }
  });
}
#endif
}  // namespace

void store_kv(at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& loc, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(k_buf.dim() == 3 && v_buf.sizes() == k_buf.sizes() &&
                  v_buf.scalar_type() == k_buf.scalar_type() && k_buf.is_contiguous() &&
                  v_buf.is_contiguous(),
              "store_kv: k_buf and v_buf [S, Hkv, D], contiguous, one dtype");
  TORCH_CHECK(loc.dim() == 1 && (loc.scalar_type() == at::kLong || loc.scalar_type() == at::kInt),
              "store_kv: loc [T] int64 or int32");
  const int64_t T = loc.size(0), S = k_buf.size(0);
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->size(0) == T && x->size(1) == k_buf.size(1) &&
                    x->size(2) == k_buf.size(2) && x->scalar_type() == k.scalar_type(),
                "store_kv: k and v [T, Hkv, D] of the pool's heads, one dtype");
  const at::Tensor lc = loc.to(at::kLong).contiguous();
  const int64_t* lp = lc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(0 <= lp[t] && lp[t] < S, "store_kv: slot ", lp[t], " out of the pool (", S, ")");
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const int64_t W = k_buf.size(1) * k_buf.size(2);
  const at::ScalarType src = k.scalar_type(), dst = k_buf.scalar_type();
  const bool vector_src = src == at::kFloat || src == at::kBFloat16 || src == at::kHalf;
  // fp8 pools only: the others' index_put_ of a cast is already what this would be (and
  // keeps a NaN's bits where this would make bf16's one NaN of c10's rounding)
  if (vector_src && is_fp8(dst) && T > 0) {
    for (int i = 0; i < 2; ++i) {
      const at::Tensor& buf = i == 0 ? k_buf : v_buf;
      // rows of heads laid out contiguously (a view of the qkv projection's rows is)
      at::Tensor x = i == 0 ? k : v;
      if (x.stride(2) != 1 || x.stride(1) != x.size(2)) x = x.contiguous();
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src, "store_kv", [&] {
        using src_t = scalar_t;
        if constexpr (radixserve_vec::kVector16<src_t>) {
          if (dst == at::kFloat8_e5m2)
            store_rows<src_t, c10::Float8_e5m2>(buf, x, lp, T, W);
          else
            store_rows<src_t, c10::Float8_e4m3fn>(buf, x, lp, T, W);
        }
      });
    }
    return;
  }
#endif
  k_buf.index_put_({lc}, to_kv_dtype(k, k_buf.scalar_type()));
  v_buf.index_put_({lc}, to_kv_dtype(v, v_buf.scalar_type()));
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be [T, V] with V > 0 and unit stride");
  const int64_t T = x.size(0), V = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({T}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(V), [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) op[t] = argmax_row<scalar_t>(xp + t * stride, V);
    });
  });
  return out;
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, lib) {
  lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  lib.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  lib.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  lib.def("silu_and_mul(Tensor x) -> Tensor");
  lib.def("argmax_rows(Tensor x) -> Tensor");
  lib.def("store_kv(Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor loc, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, lib) {
  lib.impl("rms_norm", &radixserve::rms_norm);
  lib.impl("add_rms_norm", &radixserve::add_rms_norm);
  lib.impl("rotary_embedding", &radixserve::rotary_embedding);
  lib.impl("silu_and_mul", &radixserve::silu_and_mul);
  lib.impl("argmax_rows", &radixserve::argmax_rows);
  lib.impl("store_kv", &radixserve::store_kv);
}
