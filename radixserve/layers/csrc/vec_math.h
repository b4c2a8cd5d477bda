// Vector math shared by the CPU kernels (AVX2 builds only; exp16 and the 16-element loads and
// stores with AVX-512 too).
#pragma once

#if defined(__AVX2__)
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace radixserve_vec {

// The sum of 8 floats, in a fixed order: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#if defined(__F16C__)
// 8 fp8 values of a KV pool (--kv-cache-dtype fp8_e5m2 / fp8_e4m3) widened to fp32, exactly,
// through vcvtph2ps: e5m2 is an fp16's high byte; e4m3's magnitude shifted into an fp16's
// place reads 2^-8 of its value (subnormals included), so the result is scaled back, and its
// NaN (magnitude 0x7F) is made NaN again.
inline __m256 fp8_to_ps8(const c10::Float8_e5m2* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
}
inline __m256 fp8_to_ps8(const c10::Float8_e4m3fn* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_and_si128(w, _mm_set1_epi16(0x7F));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7),
                                 _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8));
  const __m128i nan = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7F));
  return _mm256_blendv_ps(_mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f)),
                          _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                          _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan)));
}
#endif

#if defined(__FMA__)

// exp(x) for 8 floats, within 2 ulp of the correctly rounded value on [-87, 88] (Cephes'
// expf: x = n ln2 + r with ln2 split in two, a degree-6 polynomial in r, 2^n through the
// exponent bits). Inputs are clamped to that range: below it the result is about 1e-38
// instead of 0, above it about 1.7e38 instead of inf, which neither SiLU nor a softmax
// weighed against its maximum can tell apart. NaN passes through the clamps.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.f), _mm256_min_ps(_mm256_set1_ps(88.f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
// exp(x) for 16 floats: exp8's polynomial on 512-bit vectors, inputs clamped to
// [-87, 88]. Callers zero the lanes that must be exactly 0 (masked keys).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.f), _mm512_min_ps(_mm512_set1_ps(88.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// 2^x for 16 floats in zero-masked lanes (mask): x split as n + r, n = round(x), |r| <= 1/2,
// 2^r by a degree-4 polynomial (relative error <= 6e-6), scaled by 2^n with vscalefps (which
// gives 0 far below the float range: no clamp). For probabilities that are rounded to bf16
// afterwards (8 significant bits), where exp16's degree-6 polynomial buys nothing.
inline __m512 exp2_16_masked(__mmask16 mask, __m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.627114050090313e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.598684400320053e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.402331829071045e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.93108856678009e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(mask, p, n);
}

// silu(x) = x / (1 + exp(-x)) for 16 floats: the operations of fused_ops.cpp's 8-float SiLU,
// lane by lane.
inline __m512 silu16(__m512 x) {
  const __m512 neg = _mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(neg)));
}
#endif  // __AVX512F__
#endif  // __FMA__

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The element types load16 / store16 / round16 take.
template <typename T>
constexpr bool kVector16 = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> ||
                           std::is_same_v<T, c10::Half>;

// The first `count` lanes (all 16 from 16 on).
inline __mmask16 first(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

// 16 elements widened to fp32, exactly as static_cast<float> widens them (bf16: the bits
// shifted up; fp16: vcvtph2ps); the lanes outside `mask` read nothing and are 0.
inline __m512 load16(const float* p, __mmask16 mask = 0xFFFF) {
  return _mm512_maskz_loadu_ps(mask, p);
}
inline __m512 load16(const c10::BFloat16* p, __mmask16 mask = 0xFFFF) {
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 mask = 0xFFFF) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

// 16 floats narrowed to the element type as c10's conversions narrow them: bf16 rounded to
// nearest even by integer rounding of the bits, NaN as 0x7FC0; fp16 by vcvtps2ph (nearest
// even). Only the lanes of `mask` are written.
inline __m512i bf16_bits(__m512 v) {  // in the low 16 bits of each lane
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7FC0));
}
inline void store16(float* p, __m512 v, __mmask16 mask = 0xFFFF) {
  _mm512_mask_storeu_ps(p, mask, v);
}
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 mask = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(bf16_bits(v)));
}
inline void store16(c10::Half* p, __m512 v, __mmask16 mask = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, mask,
                           _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// v rounded to T and widened back: static_cast<float>(static_cast<T>(v)) per lane.
template <typename T>
inline __m512 round16(__m512 v);
template <>
inline __m512 round16<float>(__m512 v) {
  return v;
}
template <>
inline __m512 round16<c10::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}
template <>
inline __m512 round16<c10::Half>(__m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// An fp8 format's 128 magnitudes as bf16 bits (exact: e5m2's and e4m3's mantissas and
// exponent ranges fit bf16's, their subnormals as bf16 normals), split into high and low bytes
// for vpermi2b's two-register tables; e4m3fn's magnitude 0x7F (NaN) gives bf16's NaN.
struct Fp8Table {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
};
template <typename fp8_t>
inline const Fp8Table& fp8_table() {
  static const Fp8Table table = [] {
    Fp8Table t;
    for (int m = 0; m < 128; ++m) {
      const float f = static_cast<float>(fp8_t(static_cast<uint8_t>(m), fp8_t::from_bits()));
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      t.hi[m] = static_cast<uint8_t>(bits >> 24);
      t.lo[m] = static_cast<uint8_t>(bits >> 16);
    }
    return t;
  }();
  return table;
}

// fp8 values (e5m2 or e4m3fn) widened into bf16, exactly; built once per kernel call (it holds
// the tables in registers), then called per row. With AVX512-VBMI 64 values at a time: each
// byte's magnitude looks up its bf16's two bytes (vpermi2b), its sign is or-ed into the high
// one, and the bytes interleave into words (the quadwords first ordered so that the in-lane
// unpacks leave the words in order): six operations per 64 values, a third of vcvtph2ps's
// route (widen, shift, two conversions, narrow to bf16).
template <typename fp8_t>
struct Fp8ToBf16 {
  const Fp8Table& t = fp8_table<fp8_t>();
#if defined(__AVX512VBMI__)
  const __m512i h0 = _mm512_load_si512(t.hi), h1 = _mm512_load_si512(t.hi + 64);
  const __m512i l0 = _mm512_load_si512(t.lo), l1 = _mm512_load_si512(t.lo + 64);
  const __m512i order = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
#endif
  void operator()(const fp8_t* src, uint16_t* dst, int64_t n) const {
    const auto* s = reinterpret_cast<const uint8_t*>(src);
    int64_t i = 0;
#if defined(__AVX512VBMI__)
    for (; i + 64 <= n; i += 64) {
      const __m512i x = _mm512_permutexvar_epi64(order, _mm512_loadu_si512(s + i));
      const __m512i hi =  // hi | (x & 0x80)
          _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(h0, x, h1), x, sign, 0xF8);
      const __m512i lo = _mm512_permutex2var_epi8(l0, x, l1);
      _mm512_storeu_si512(dst + i, _mm512_unpacklo_epi8(lo, hi));
      _mm512_storeu_si512(dst + i + 32, _mm512_unpackhi_epi8(lo, hi));
    }
#endif
    for (; i < n; ++i) {
      const int m = s[i] & 0x7F;
      dst[i] = static_cast<uint16_t>(((t.hi[m] | (s[i] & 0x80)) << 8) | t.lo[m]);
    }
  }
};
#endif  // __AVX512F__ && __AVX512BW__ && __AVX512VL__

}  // namespace radixserve_vec

#endif
