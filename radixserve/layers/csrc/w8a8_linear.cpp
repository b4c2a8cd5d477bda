// W8A8 int8 linear layers (`--quantization w8a8_int8`, SGLang's method of that name): int8
// weights with one symmetric scale per output channel, activations quantized on the fly to
// int8 with one symmetric scale per row (token), the product summed in 32-bit integers.
//
// Where the weight-only layers (quant_linear.cpp) save bytes, this one saves arithmetic: from
// a few dozen rows on, a step's GEMMs are bound by multiply-adds, and an int8 product runs at
// twice the rate of a bf16 one (AVX-512 VNNI's vpdpbusd against AVX512-BF16's vdpbf16ps; on two
// Zen 4 cores ≈ 1,550 against ≈ 800 GOP/s at 256 rows and more). The integer GEMM is ATen's
// `_int_mm` (oneDNN on x86); this file adds the two cheap passes around it, so that one op
// serves every row count and the C++ decode step calls exactly what Python calls:
//
//   w8a8_linear(x [M, K] fp32/bf16/fp16, wq [N, K] int8, w_scale [N] fp32, bias [N]?) -> [M, N]
//     in x's dtype: y[m, n] = float(Σ_k xq[m, k] · wq[n, k]) · sx[m] · w_scale[n] (+ bias[n]),
//     with sx[m] = max_k |x[m, k]| / 127 and xq[m, k] = round(x[m, k] / sx[m]) (to nearest,
//     ties to even; a zero row gets sx = 0 and zero codes). The float operations are done in
//     this order, in fp32, and rounded once to x's dtype at the end.
//   w8a8_quantize_rows(x [M, K]) -> (xq [M, K] int8, sx [M] fp32): the first pass, for tests.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "vec_math.h"

namespace {

// Rows per integer GEMM call, so that its int32 output (512 × N) stays in cache for the pass
// that scales it: in one call of 4,096 rows, that pass ran from memory and oneDNN's int8
// product itself slowed down (≈ 1,550 → 620 GOP/s for a 3,072 × 576 weight).
constexpr int64_t kRowsPerProduct = 512;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
using radixserve_vec::first;
using radixserve_vec::load16;
using radixserve_vec::store16;

template <typename T>
void quantize_row(const T* row, int64_t K, int8_t* out, float* sx) {
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(row + k, first(K - k))));
  const float scale = _mm512_reduce_max_ps(vmax) / 127.f;
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = first(K - k);
    // vcvtps2dq rounds to nearest even (the default MXCSR mode), as nearbyint does.
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(row + k, mask), vinv));
    q = _mm512_min_epi32(hi, _mm512_max_epi32(lo, q));
    _mm_mask_storeu_epi8(out + k, mask, _mm512_cvtepi32_epi8(q));
  }
  *sx = scale;
}

template <typename T>
void dequantize_row(const int32_t* a, float s, const float* sw, const T* bias, int64_t N, T* out) {
  const __m512 vs = _mm512_set1_ps(s);
  for (int64_t n = 0; n < N; n += 16) {
    const __mmask16 mask = first(N - n);
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, a + n)), vs),
                             _mm512_maskz_loadu_ps(mask, sw + n));
    if (bias != nullptr) v = _mm512_add_ps(v, load16(bias + n, mask));
    store16(out + n, v, mask);
  }
}
#else  // the same operations one element at a time
inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(at::Half v) { return static_cast<float>(v); }

inline int8_t quantize_one(float v, float inv) {
  return static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(v * inv))));
}

template <typename T>
void quantize_row(const T* row, int64_t K, int8_t* out, float* sx) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(to_float(row[k])));
  const float scale = amax / 127.f;
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  for (int64_t k = 0; k < K; ++k) out[k] = quantize_one(to_float(row[k]), inv);
  *sx = scale;
}

template <typename T>
void dequantize_row(const int32_t* a, float s, const float* sw, const T* bias, int64_t N, T* out) {
  for (int64_t n = 0; n < N; ++n) {
    float v = static_cast<float>(a[n]) * s * sw[n];
    if (bias != nullptr) v += to_float(bias[n]);
    out[n] = static_cast<T>(v);
  }
}
#endif

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, float* sx) {
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1)),
                   [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) quantize_row(x + m * K, K, xq + m * K, sx + m);
  });
}

template <typename T>
void dequantize_rows(const int32_t* acc, const float* sx, const float* sw, const T* bias,
                     int64_t M, int64_t N, T* y) {
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / std::max<int64_t>(N, 1)),
                   [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) dequantize_row(acc + m * N, sx[m], sw, bias, N, y + m * N);
  });
}

// The activation dtypes (fp32, bf16, fp16), with scalar_t bound as ATen's dispatch macros do.
#define RADIXSERVE_DISPATCH_W8A8(TYPE, NAME, ...)                 \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                  \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

void check_input(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "w8a8: x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              "w8a8: x must be fp32, bf16 or fp16, got ", x.scalar_type());
}

}  // namespace

namespace radixserve {

std::tuple<at::Tensor, at::Tensor> w8a8_quantize_rows(const at::Tensor& x_in) {
  check_input(x_in);
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor sx = at::empty({M}, x.options().dtype(at::kFloat));
  RADIXSERVE_DISPATCH_W8A8(x.scalar_type(), "w8a8_quantize", [&] {
    quantize_rows(x.data_ptr<scalar_t>(), M, K, xq.data_ptr<int8_t>(), sx.data_ptr<float>());
  });
  return {xq, sx};
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& bias) {
  check_input(x);
  TORCH_CHECK(wq.dim() == 2 && wq.scalar_type() == at::kChar && wq.is_contiguous(),
              "w8a8_linear: wq must be a contiguous int8 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = wq.size(0);
  TORCH_CHECK(wq.size(1) == K, "w8a8_linear: x has ", K, " columns, the weight ", wq.size(1));
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == N &&
                  w_scale.is_contiguous(),
              "w8a8_linear: w_scale must be a contiguous fp32 [N]");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == N &&
                    bias->is_contiguous(),
                "w8a8_linear: bias must be a contiguous [N] of x's dtype");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto [xq, sx] = w8a8_quantize_rows(x);
  const at::Tensor wt = wq.t();
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerProduct) {
    const int64_t rows = std::min(kRowsPerProduct, M - m0);
    const at::Tensor acc = at::_int_mm(xq.slice(0, m0, m0 + rows), wt);
    RADIXSERVE_DISPATCH_W8A8(x.scalar_type(), "w8a8_linear", [&] {
      dequantize_rows(acc.data_ptr<int32_t>(), sx.data_ptr<float>() + m0,
                      w_scale.data_ptr<float>(),
                      bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr, rows, N,
                      y.data_ptr<scalar_t>() + m0 * N);
    });
  }
  return y;
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, lib) {
  lib.def("w8a8_linear(Tensor x, Tensor wq, Tensor w_scale, Tensor? bias=None) -> Tensor");
  lib.def("w8a8_quantize_rows(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, lib) {
  lib.impl("w8a8_linear", &radixserve::w8a8_linear);
  lib.impl("w8a8_quantize_rows", &radixserve::w8a8_quantize_rows);
}
