// Weight-only int4 and int8 linear layers for CPU decode. int4 quantizes the activations on the
// fly to int8 per group of 32 (llama.cpp's Q8 idea), so that each group's dot product is 32
// 8-bit products summed in integers (AVX-512 VNNI: vpdpbusd; AVX2: vpmaddubsw and vpmaddwd),
// then scaled in floats.
//
// int4, GGUF's Q4_1 form (groups of 32 weights: 16 bytes of 4-bit codes, a float scale d and
// minimum m; w = q * d + m); code layout per group as ggml's: byte j holds element j (low
// nibble) and j + 16:
//   q4_linear(x [M, K], qs [N, K/32, 16] uint8, d [N, K/32] fp32, m [N, K/32] fp32) -> [M, N] fp32
//   q4_dequantize(qs, d, m) -> [N, K] fp32 (the weight q4_dense multiplies, for tests)
// int8, GGUF's Q8_0 form (groups of 32 int8 codes and a float scale d; w = q * d), with the
// activations kept in floats (q8_rows says why):
//   q8_linear(x [M, K], qs [N, K] int8, d [N, K/32] fp32) -> [M, N] fp32
//   q8_dequantize(qs, d) -> [N, K] fp32 (likewise)
//
// From a dozen rows on (64 in fp32), a dense GEMM is faster than these kernels (their group scales
// cost a float multiply-add per 32 products, a GEMM none): q4_dense and q8_dense compute the
// same products through ATen's GEMM, in bf16 (fp32 accumulation) where `bf16` is set (a bf16
// model on a CPU with native bf16 matrix instructions) and in fp32 otherwise. The weight is
// dequantized in blocks of output rows small enough to stay in cache while the GEMM reads
// them, straight into the GEMM's dtype: a whole weight dequantized to fp32 went to memory
// and back twice (a 49,152-row output head is 113 MB in fp32).
//   q4_dense(x, qs, d, m, bf16) -> [M, N]: the activations rounded to the int8 grid of
//     q4_linear (quantize_row's float operations), then w = q * d + m;
//   q8_dense(x, qs, d, bf16) -> [M, N]: the activations as they are, w = q * d;
//   both in bf16 when `bf16`, else fp32.
//
// On CPUs with AVX-512 VNNI both weights are stored in tiles of 16 outputs instead (layers/
// quantization.py's pack_q4_tiles and pack_q8_tiles; the layout is described above
// tiled_rows), and one kernel each serves every row count, as a register-blocked GEMM in
// integers (tiled_rows says how); bf16 out for a bf16 x, else fp32:
//   q4_tiled_linear(x [M, K], wt [N/16, K/32, 320] uint8) -> [M, N]: q4_linear's function
//     (its scales and minimums are fp16 values, quantize_int4's, held in fp16 here);
//   q8_tiled_linear(x [M, K], wt [N/16, K/32, 576] uint8) -> [M, N]: the int8 weight times the
//     activations on q4_linear's int8 grid (llama.cpp's Q8_0 x Q8_0 product), not q8_linear's
//     float activations: a group's 32 products are then one exact integer sum, which is what
//     makes it fast (bf16's GEMM rate from 64 rows, twice q8_dense);
//   q4_tiled_silu_mul(x, wt) / q8_tiled_silu_mul(x, wt) -> [M, N/2]: an MLP's [gate; up]
//     weight, the result silu_and_mul's of the product (fused_ops.cpp), bitwise;
//   tiled_supported() says whether this build has them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "vec_math.h"

namespace {

constexpr int64_t kGroup = 32;

// Quantize one row of activations: per group, int8 codes, their scale, and the sum of the
// quantized values (scale * sum of codes), so that the minimum's term uses the same
// activations as the codes' term. QuantizedLinear's GEMM path quantizes its input the same
// way (same float operations), so both paths compute one function up to summation order.
void quantize_row(const float* x, int64_t groups, int8_t* xq, float* sx, float* xsum) {
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * kGroup;
    float amax = 0.f;
    for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(xg[j]));
    const float scale = amax / 127.f;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    int32_t codes = 0;
    for (int64_t j = 0; j < kGroup; ++j) {
      const int8_t c = static_cast<int8_t>(std::nearbyint(xg[j] * inv));
      xq[g * kGroup + j] = c;
      codes += c;
    }
    sx[g] = scale;
    xsum[g] = scale * static_cast<float>(codes);
  }
}

#if defined(__AVX2__)
constexpr int64_t kAhead = 2;  // blocks (q4) or rows (q8) of weight fetched ahead

// acc + the sums of four adjacent u8 * s8 products, in 32-bit integers: one instruction with
// AVX-512 VNNI, two with AVX2 (no 16-bit saturation here: codes are at most 15 and two
// products at most 3,810). Both give the same integers, so results do not depend on which.
inline __m256i dot_u8s8(__m256i acc, __m256i u8, __m256i s8) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u8, s8);
#else
  return _mm256_add_epi32(
      acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
#endif
}

// sum over g < G of a[g] * b[g]: eight lanes, then the tail, in a fixed order.
inline float dot_f32(const float* a, const float* b, int64_t G) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + g), _mm256_loadu_ps(b + g), acc);
  float sum = radixserve_vec::hsum8(acc);
  for (; g < G; ++g) sum += a[g] * b[g];
  return sum;
}

// R activation rows times T outputs, accumulators in registers. One output for one row is
// sum over groups of d_g * sx_g * (codes . xq)_g, plus sum of m_g * xsum_g; every (output,
// row) pair sums its groups in the same order with the same operations whatever R, T and M,
// so a row's result does not depend on the other rows of the batch. A group's codes are
// unpacked once for the R rows, and the R * T chains of dependent FMAs interleave.
template <int R, int T>
void q4_block(const uint8_t* qp, const float* dp, const float* mp, int64_t n0, int64_t r0,
              const int8_t* xq, const float* sx, const float* xsum, int64_t G, float* y,
              int64_t N) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  // The weight is read once per call, from memory: fetch the bytes of the block kAhead
  // blocks on while this one computes (the rows of a block are contiguous; a cache line
  // holds 16 scales, the next 16 / T groups of the block's T rows, so those are fetched
  // every fourth group: once a line for T = 4).
  const uint8_t* next_q = qp + (n0 + kAhead * T) * G * 16;
  const float* next_d = dp + (n0 + kAhead * T) * G;
  const float* next_m = mp + (n0 + kAhead * T) * G;
  for (int64_t g = 0; g < G; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(next_q + g * T * 16), _MM_HINT_T0);
    if ((g & 3) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(next_d + g * T), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next_m + g * T), _MM_HINT_T0);
    }
    __m256i codes[T];
    float dg[T];
    for (int t = 0; t < T; ++t) {
      const int64_t ng = (n0 + t) * G + g;
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + ng * 16));
      codes[t] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
      dg[t] = dp[ng];
    }
    for (int r = 0; r < R; ++r) {
      const int64_t rg = (r0 + r) * G + g;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + rg * kGroup));
      const float s = sx[rg];
      for (int t = 0; t < T; ++t) {
        const __m256i p32 = dot_u8s8(_mm256_setzero_si256(), codes[t], xv);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(dg[t] * s), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      const int64_t n = n0 + t, row = r0 + r;
      y[row * N + n] = radixserve_vec::hsum8(acc[r][t]) + dot_f32(mp + n * G, xsum + row * G, G);
    }
  }
}

// Outputs [lo, hi) of every row, in blocks of up to 4 rows by 4 outputs (2 when there are
// more rows: the accumulators stay within the 16 vector registers).
void q4_outputs(const uint8_t* qp, const float* dp, const float* mp, int64_t lo, int64_t hi,
                const int8_t* xq, const float* sx, const float* xsum, int64_t M, int64_t G,
                float* y, int64_t N) {
  int64_t n = lo;
  for (; n + 4 <= hi && M == 1; n += 4) q4_block<1, 4>(qp, dp, mp, n, 0, xq, sx, xsum, G, y, N);
  for (; n + 2 <= hi; n += 2) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) q4_block<4, 2>(qp, dp, mp, n, r, xq, sx, xsum, G, y, N);
    for (; r < M; ++r) q4_block<1, 2>(qp, dp, mp, n, r, xq, sx, xsum, G, y, N);
  }
  for (; n < hi; ++n)
    for (int64_t r = 0; r < M; ++r) q4_block<1, 1>(qp, dp, mp, n, r, xq, sx, xsum, G, y, N);
}
#endif

// The rows [n0, n1) of a dequantized weight, in the GEMM's element type: float, or bf16
// rounded to nearest even (c10's conversion, for the finite values a weight has). A value is
// q * d (+ m), a multiply then an add in fp32, whichever of the two forms below runs.
inline void put(float* out, float v) { *out = v; }
inline void put(at::BFloat16* out, float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  u += 0x7FFF + ((u >> 16) & 1);
  const uint16_t bits = static_cast<uint16_t>(u >> 16);
  std::memcpy(out, &bits, sizeof(bits));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kVector512 = true;
using radixserve_vec::load16;
using radixserve_vec::store16;
using radixserve_vec::round16;
using radixserve_vec::silu16;

// One group of 32 activations (a, b) on quantize_row's int8 grid, with its float operations:
// scale = |x| max / 127, codes = x / scale rounded to nearest even (returned in *ca, *cb as
// integer-valued floats); returns the scale.
inline float round_group_512(__m512 a, __m512 b, __m512* ca, __m512* cb) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float scale = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
  *ca = _mm512_roundscale_ps(_mm512_mul_ps(a, inv), kNearest);
  *cb = _mm512_roundscale_ps(_mm512_mul_ps(b, inv), kNearest);
  return scale;
}
#else
constexpr bool kVector512 = false;
#endif

template <typename T>
void dequantize_q4_rows(const uint8_t* qp, const float* dp, const float* mp, int64_t n0,
                        int64_t n1, int64_t G, T* out) {
  for (int64_t i = n0 * G; i < n1 * G; ++i) {
    const uint8_t* q = qp + i * 16;
    T* o = out + (i - n0 * G) * kGroup;
    const float d = dp[i], m = mp[i];
    if constexpr (kVector512) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
      const __m128i low4 = _mm_set1_epi8(0x0F);
      const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low4)));
      const __m512 hi =
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
      store16(o, _mm512_add_ps(_mm512_mul_ps(lo, vd), vm));
      store16(o + 16, _mm512_add_ps(_mm512_mul_ps(hi, vd), vm));
#endif
    } else {
      for (int64_t j = 0; j < 16; ++j) {
        put(o + j, static_cast<float>(q[j] & 0x0F) * d + m);
        put(o + j + 16, static_cast<float>(q[j] >> 4) * d + m);
      }
    }
  }
}

template <typename T>
void dequantize_q8_rows(const int8_t* qp, const float* dp, int64_t n0, int64_t n1, int64_t G,
                        T* out) {
  for (int64_t i = n0 * G; i < n1 * G; ++i) {
    const int8_t* q = qp + i * kGroup;
    T* o = out + (i - n0 * G) * kGroup;
    const float d = dp[i];
    if constexpr (kVector512) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      const __m512 vd = _mm512_set1_ps(d);
      for (int h = 0; h < 2; ++h) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h));
        store16(o + 16 * h, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), vd));
      }
#endif
    } else {
      for (int64_t j = 0; j < kGroup; ++j) put(o + j, static_cast<float>(q[j]) * d);
    }
  }
}

// One row of activations on quantize_row's int8 grid, as values (code * scale, in fp32, then
// rounded to T): the same float operations as quantize_row, so the same codes and scales.
template <typename T>
void round_activations(const float* x, int64_t groups, T* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * kGroup;
    T* o = out + g * kGroup;
    if constexpr (kVector512) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      __m512 ca, cb;
      const __m512 vs =
          _mm512_set1_ps(round_group_512(_mm512_loadu_ps(xg), _mm512_loadu_ps(xg + 16), &ca, &cb));
      store16(o, _mm512_mul_ps(ca, vs));
      store16(o + 16, _mm512_mul_ps(cb, vs));
#endif
    } else {
      int8_t codes[kGroup];
      float scale, sum;
      quantize_row(xg, 1, codes, &scale, &sum);
      for (int64_t j = 0; j < kGroup; ++j) put(o + j, static_cast<float>(codes[j]) * scale);
    }
  }
}

// Bytes of dequantized weight per GEMM call: a block stays in cache (L2, or the L3 close
// by) between being written and being read by the GEMM. Blocks of 1-4 MB measured alike
// (SmolLM2's layers and 49,152-row head, 16-128 rows, 2 Zen 4 cores); at 512 KB the calls'
// own cost showed, and the whole head at once took 27 ms instead of 3 at one row (a fresh
// 56 MB buffer is page faults first).
constexpr int64_t kDenseBlockBytes = int64_t{2} << 20;

// x [M, K] (already in the GEMM's dtype) times the weight whose rows `fill(n0, n1, out)`
// writes, block by block: [M, N] in x's dtype.
template <typename Fill>
at::Tensor blocked_product(const at::Tensor& x, int64_t N, int64_t K, const Fill& fill) {
  const int64_t block =
      std::max<int64_t>(16, kDenseBlockBytes / (K * static_cast<int64_t>(x.element_size())) /
                                16 * 16);
  const int64_t rows = std::min(block, N);
  at::Tensor w = at::empty({rows, K}, x.options());
  auto dequantize = [&](int64_t n0, int64_t nb) {
    AT_DISPATCH_SWITCH(x.scalar_type(), "dequantize",
        AT_DISPATCH_CASE(at::kFloat, [&] {
          at::parallel_for(0, nb, 8, [&](int64_t lo, int64_t hi) {
            fill(n0 + lo, n0 + hi, w.data_ptr<scalar_t>() + lo * K);
          });
        })
        AT_DISPATCH_CASE(at::kBFloat16, [&] {
          at::parallel_for(0, nb, 8, [&](int64_t lo, int64_t hi) {
            fill(n0 + lo, n0 + hi, w.data_ptr<scalar_t>() + lo * K);
          });
        }));
  };
  // each block's product goes straight into its columns of y (a GEMM with y's row stride)
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t nb = std::min(rows, N - n0);
    const at::Tensor wb = w.narrow(0, 0, nb);
    dequantize(n0, nb);
    at::Tensor yb = y.narrow(1, n0, nb);
    at::mm_out(yb, x, wb.t());
  }
  return y;
}

// The tiled kernels (q4_tiled_linear and q8_tiled_linear below): llama.cpp's layout for its
// repacked Q4 weights, on AVX-512 VNNI. 16 outputs sit in the 16 lanes of a vector, each lane four
// adjacent codes, so that one vpdpbusd adds four code * activation products to each of 16
// outputs and one activation dword, broadcast, serves all 16. A tile (16 outputs) holds, per
// group of 32, 8 such vectors of unsigned codes: int4's codes (packed two to a byte in memory,
// 4 vectors of 64 bytes, each split into its low and high nibbles in registers as a pass reads
// it), or int8's codes plus 128. Both are read in place. The tile multiplies every row, 8 rows
// per pass. Per group of 32 the dot product is exact in int32, then scaled in fp32: int4 as
// q4_linear scales it (d * sx, plus m * xsum), int8 after taking 128 times the activation
// codes' sum back off in integers (d * sx times the exact sum of code * activation code). So
// each is one function, its per-group sums exact and its groups summed in one fixed order, and
// a row's result does not depend on the other rows or their number.
//
// A tile's codes per group: int4's, 4 vectors of 64 bytes, vector q's lane t (bytes 4t ..
// 4t + 3) holding elements 4q .. 4q + 3 of output t in its low nibbles and 16 + 4q .. 16 + 4q +
// 3 in its high ones, i.e. dword q of that output's 16 bytes in qs's layout; int8's, 8 vectors
// of 64 bytes, vector q's lane t holding elements 4q .. 4q + 3 of output t, each code + 128
// (unpacked int4's order). Then one vector of the tile's 16 scales per group: int8's fp32;
// int4's fp16, then its 16 minimums in fp16 (GGUF's Q4_1 holds both in fp16; 17% fewer bytes
// than in fp32, int4 at one row 1.1x). 320 bytes per tile and group for int4, 576 for int8.
//
// The weight wt [T, G, bytes] holds T tiles in pairs, the pair read by one pass stored as one
// run of memory: with F = T / 2, pair i (i < F) holds tiles i and F + i, group after group
// (both tiles' codes, both tiles' scales, both tiles' minimums, their 64-byte vectors
// alternating: the order the pass loads them), and an odd last tile follows alone, likewise.
// So each thread reads its share of the weight as one sequential stream. (With each tile's
// codes, scales and minimums in three arrays, a pass read six short streams; int4 at one row
// took 1.15-1.2x less time in this layout, int8 the same; with the two tiles' codes one after
// the other instead of alternating, int8 took 1.15x more.) For an MLP's [gate; up] weight,
// pair i is gate tile i and its up tile.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
constexpr bool kTiled = true;
constexpr int kTile = 16;   // outputs per tile: a vector's lanes
constexpr int kRowsMax = 8;   // activation rows per pass over one tile (accumulators in registers)
constexpr int kRowsPair = 5;  // the same over a pair of tiles
constexpr int64_t kRowBlock = 256;  // rows multiplied by every tile before the next rows
constexpr int64_t kGroupBytes = 512;  // one tile's group of codes as bytes: 16 outputs x 32
constexpr int64_t kQ4GroupBytes = 256;  // the same packed as nibbles

// Activation rows [lo, hi) on quantize_row's grid (round_group_512: its codes, scales, sums, and
// the codes' integer sums). The input is fp32 or bf16 (widened exactly, as .to(float) would).
struct Activations {
  std::vector<int8_t> xq;     // [M, K] codes
  std::vector<float> sx;      // [M, G] scales
  std::vector<float> xsum;    // [M, G] scale * the codes' sum (int4's minimum term)
  std::vector<int32_t> offset;  // [M, G] -128 x the codes' sum (int8's offset, taken off)
};

template <typename T>
void quantize_rows_512(const T* x, int64_t lo, int64_t hi, int64_t G, Activations* a) {
  for (int64_t rg = lo * G; rg < hi * G; ++rg) {
    __m512 fa, fb;
    const float scale =
        round_group_512(load16(x + rg * kGroup), load16(x + rg * kGroup + 16), &fa, &fb);
    const __m512i ca = _mm512_cvtps_epi32(fa), cb = _mm512_cvtps_epi32(fb);
    int8_t* xq = a->xq.data() + rg * kGroup;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq), _mm512_cvtepi32_epi8(ca));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 16), _mm512_cvtepi32_epi8(cb));
    const int32_t codes = _mm512_reduce_add_epi32(_mm512_add_epi32(ca, cb));
    a->sx[rg] = scale;
    a->xsum[rg] = scale * static_cast<float>(codes);
    a->offset[rg] = -128 * codes;
  }
}

// The NT tiles a row pass reads (a stored pair, or a lone last tile): per tile, where its
// codes of group 0 start (int8: 8 vectors, int4: 4 packed ones) and its scales (int8: 16
// fp32; int4: 16 fp16 scales, then 16 fp16 minimums), and its first output column.
template <int NT>
struct Tiles {
  const uint8_t* codes[NT];   // group 0's first code vector
  const uint8_t* scales[NT];  // group 0's scales (and minimums)
  int64_t n0[NT];
  int64_t group_stride;   // bytes from one group's codes (or scales) to the next's
  int64_t vector_stride;  // bytes from one of a group's code vectors to the next
};

// Rows r0 .. r0 + R - 1 of NT tiles' outputs, stored as fp32 or rounded to bf16 at the tiles'
// columns. Two tiles at a time share each activation broadcast (half the loads per product);
// each output's sums are the same operations in the same order whichever pass computes it.
// (Not inlined: inside the driver's loops GCC spilled the accumulators of int4's passes, which
// then ran at half the rate.)
// kSiluMul (NT = 2, a gate tile and its up tile): stores silu(gate) * up instead, each
// rounded to T where silu_and_mul would find them rounded (so the result is bitwise that of
// the product followed by silu_and_mul), at the gate tile's column; N is y's row stride.
template <int R, int NT, bool kInt8, bool kSiluMul, typename T>
__attribute__((noinline)) void tiled_rows(const Tiles<NT>& w, const Activations& a, int64_t r0,
                                          int64_t G, T* y, int64_t N) {
  static_assert(!kSiluMul || NT == 2);
  const int64_t K = G * kGroup;
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    // int8: each group's sum starts at -128 x the activation codes' sum, so that the sum of
    // (c + 128) * x over the group ends at exactly sum c * x (|.| < 2^24).
    __m512i dot[R][NT];
    for (int r = 0; r < R; ++r) {
      const __m512i init =
          kInt8 ? _mm512_set1_epi32(a.offset[(r0 + r) * G + g]) : _mm512_setzero_si512();
      for (int t = 0; t < NT; ++t) dot[r][t] = init;
    }
    if constexpr (kInt8) {
      for (int q = 0; q < 8; ++q) {
        __m512i wv[NT];
        for (int t = 0; t < NT; ++t)
          wv[t] = _mm512_loadu_si512(w.codes[t] + g * w.group_stride + q * w.vector_stride);
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, a.xq.data() + (r0 + r) * K + g * kGroup + 4 * q, sizeof(four));
          const __m512i xb = _mm512_set1_epi32(four);
          for (int t = 0; t < NT; ++t) dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], wv[t], xb);
        }
      }
    } else {
      // Packed vector q: its low nibbles are the codes of elements 4q .. 4q + 3 of each
      // output, its high ones those of 16 + 4q .. 16 + 4q + 3.
      const __m512i low4 = _mm512_set1_epi8(0x0F);
      for (int q = 0; q < 4; ++q) {
        __m512i lo[NT], hi[NT];
        for (int t = 0; t < NT; ++t) {
          const __m512i raw =
              _mm512_loadu_si512(w.codes[t] + g * w.group_stride + q * w.vector_stride);
          lo[t] = _mm512_and_si512(raw, low4);
          hi[t] = _mm512_and_si512(_mm512_srli_epi32(raw, 4), low4);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = a.xq.data() + (r0 + r) * K + g * kGroup + 4 * q;
          int32_t four_lo, four_hi;
          std::memcpy(&four_lo, xq, sizeof(four_lo));
          std::memcpy(&four_hi, xq + 16, sizeof(four_hi));
          const __m512i xl = _mm512_set1_epi32(four_lo), xh = _mm512_set1_epi32(four_hi);
          for (int t = 0; t < NT; ++t) {
            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], lo[t], xl);
            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], hi[t], xh);
          }
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const uint8_t* sp = w.scales[t] + g * w.group_stride;
      __m512 dv, mv = _mm512_setzero_ps();
      if constexpr (kInt8) {
        dv = _mm512_loadu_ps(sp);
      } else {  // fp16, widened exactly
        dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)));
        mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + 32)));
      }
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (r0 + r) * G + g;
        const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(a.sx[rg]));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][t]), scale, acc[r][t]);
        if constexpr (!kInt8) {
          acc[r][t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.xsum[rg]), acc[r][t]);
        }
      }
    }
  }
  if constexpr (kSiluMul) {
    for (int r = 0; r < R; ++r) {
      const __m512 silu = round16<T>(silu16(round16<T>(acc[r][0])));
      store16(y + (r0 + r) * N + w.n0[0], _mm512_mul_ps(silu, round16<T>(acc[r][1])));
    }
  } else {
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) store16(y + (r0 + r) * N + w.n0[t], acc[r][t]);
  }
}

// Rows r0 .. r0 + rows - 1 (rows < R) of NT tiles: the pass after the R-row ones.
template <int R, int NT, bool kInt8, bool kSiluMul, typename T>
void tiled_tail(const Tiles<NT>& w, const Activations& a, int64_t r0, int64_t rows, int64_t G,
                T* y, int64_t N) {
  if constexpr (R > 0) {
    if (rows == R) return tiled_rows<R, NT, kInt8, kSiluMul>(w, a, r0, G, y, N);
    tiled_tail<R - 1, NT, kInt8, kSiluMul>(w, a, r0, rows, G, y, N);
  }
}

// Rows r0 .. r1 - 1 of NT tiles: passes of R rows, then one of the rows left.
template <int R, int NT, bool kInt8, bool kSiluMul, typename T>
void tiled_block(const Tiles<NT>& w, const Activations& a, int64_t r0, int64_t r1, int64_t G,
                 T* y, int64_t N) {
  int64_t r = r0;
  for (; r + R <= r1; r += R) tiled_rows<R, NT, kInt8, kSiluMul>(w, a, r, G, y, N);
  tiled_tail<R - 1, NT, kInt8, kSiluMul>(w, a, r, r1 - r, G, y, N);
}

// x [M, K] times a tiled weight (kInt8: q8_tiled_linear's, else q4_tiled_linear's), checked by
// the callers; bf16 in, bf16 out (the fp32 result rounded to nearest even, as .to(bf16) rounds
// it): a prefill's [M, N] in fp32 is tens of megabytes written and read again to convert it.
// kSiluMul: the weight is an MLP's gate and up projections stacked ([gate; up], N = 2I), and
// the result is silu_and_mul's [M, I] of the product (the *_tiled_silu_mul ops).
template <bool kInt8, bool kSiluMul>
at::Tensor tiled_product(const at::Tensor& x_in, const at::Tensor& wt) {
  const int64_t M = x_in.size(0), T = wt.size(0), G = wt.size(1), K = G * kGroup;
  const int64_t N = T * kTile, n_out = kSiluMul ? N / 2 : N;
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  const at::Tensor x = bf16 ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, n_out}, x.options());
  if (M == 0) return y;
  Activations a{std::vector<int8_t>(M * K), std::vector<float>(M * G),
                std::vector<float>(M * G), std::vector<int32_t>(M * G)};
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    if (bf16) {
      quantize_rows_512(x.data_ptr<at::BFloat16>(), lo, hi, G, &a);
    } else {
      quantize_rows_512(x.data_ptr<float>(), lo, hi, G, &a);
    }
  });
  // A tile's bytes per group: its codes, then one vector of scales (and int4's minimums).
  const int64_t code_bytes = kInt8 ? kGroupBytes : kQ4GroupBytes;
  const int64_t tile_bytes = code_bytes + 64;
  const uint8_t* wp = wt.data_ptr<uint8_t>();
  const int64_t F = T / 2;  // stored pairs; an odd last tile follows them
  // The tiles of `count` (1 or 2) stored from `base` on, group after group, with output columns
  // n0s (kSiluMul: the gate tile's column in y).
  auto tiles_at = [&](auto& w, const uint8_t* base, int64_t count, const int64_t* n0s) {
    for (int64_t t = 0; t < count; ++t) {
      w.codes[t] = base + t * 64;
      w.scales[t] = base + count * code_bytes + t * 64;
      w.n0[t] = n0s[t];
    }
    w.group_stride = count * tile_bytes;
    w.vector_stride = count * 64;
  };
  auto run = [&](auto* yp) {
    // One parallel region over the stored pairs (and a lone last tile): each thread keeps its
    // tiles for every block of rows (the blocks' int8 activations stay in L2 while the
    // thread's tiles multiply them: a 4,096-row prefill's are megabytes) and reads them in
    // place, in the order they lie in memory (int4's nibbles split in registers: an unpacked
    // copy in L1 was more loads and stores than the split, at every row count; a software
    // prefetch of the next tile was slower, measured on the earlier three-array layout).
    at::parallel_for(0, F + T % 2, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t r0 = 0; r0 < M; r0 += kRowBlock) {
        const int64_t r1 = std::min(M, r0 + kRowBlock);
        for (int64_t i = lo; i < hi; ++i) {
          const uint8_t* base = wp + i * 2 * G * tile_bytes;
          if (i == F) {  // the odd last tile (never under kSiluMul: T is even there)
            Tiles<1> w;
            const int64_t n0s[1] = {(T - 1) * kTile};
            tiles_at(w, base, 1, n0s);
            tiled_block<kRowsMax, 1, kInt8, false>(w, a, r0, r1, G, yp, N);
          } else {
            Tiles<2> w;
            const int64_t n0s[2] = {i * kTile, (F + i) * kTile};
            tiles_at(w, base, 2, n0s);
            tiled_block<kRowsPair, 2, kInt8, kSiluMul>(w, a, r0, r1, G, yp, n_out);
          }
        }
      }
    });
  };
  if (bf16) {
    run(y.data_ptr<at::BFloat16>());
  } else {
    run(y.data_ptr<float>());
  }
  return y;
}
#else
constexpr bool kTiled = false;
#endif
}  // namespace

namespace radixserve {

at::Tensor q4_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                     const at::Tensor& m) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == 16 && qs.scalar_type() == at::kByte,
              "qs must be uint8 [N, K/32, 16]");
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous() && m.is_contiguous(),
              "weights must be contiguous");
  TORCH_CHECK(d.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat, "d, m: fp32");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = qs.size(0), G = qs.size(1);
  TORCH_CHECK(K == G * kGroup, "x has ", K, " columns, the weight ", G * kGroup);
  TORCH_CHECK(d.size(0) == N && d.size(1) == G && m.sizes() == d.sizes(), "d, m: [N, K/32]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  std::vector<int8_t> xq(M * K);
  std::vector<float> sx(M * G), xsum(M * G);
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)
    quantize_row(xp + r * K, G, xq.data() + r * K, sx.data() + r * G, xsum.data() + r * G);

  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
#if defined(__AVX2__)
    q4_outputs(qp, dp, mp, lo, hi, xq.data(), sx.data(), xsum.data(), M, G, yp, N);
#else
    for (int64_t n = lo; n < hi; ++n) {
      for (int64_t r = 0; r < M; ++r) {
        float acc = 0.f, acc_min = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* q = qp + (n * G + g) * 16;
          const int8_t* xg = xq.data() + (r * G + g) * kGroup;
          int32_t dot = 0;
          for (int64_t j = 0; j < 16; ++j) {
            dot += static_cast<int32_t>(q[j] & 0x0F) * xg[j] +
                   static_cast<int32_t>(q[j] >> 4) * xg[j + 16];
          }
          acc += dp[n * G + g] * sx[r * G + g] * static_cast<float>(dot);
          acc_min += mp[n * G + g] * xsum[r * G + g];
        }
        yp[r * N + n] = acc + acc_min;
      }
    }
#endif
  });
  return y;
}

// int8 rows against float activations: each group of 32 codes is widened to floats and scaled
// once per block of up to four rows, then multiplied into each row's accumulators.
// The activations stay in floats: the output head's logits decide the tokens, and a rounding
// of its input would turn float-order noise between two paths of one prompt (a prefill and
// a cache hit) into different tokens.
#if defined(__AVX2__)
// Rows r0 .. r0 + R - 1 of one output: four accumulators per row (one per quarter of a group),
// in registers, summed at the end in a fixed order, the same for every R: a row's result does
// not depend on M.
template <int R>
void q8_rows(const int8_t* wn, const float* dn, const float* x, int64_t r0, int64_t K,
             int64_t groups, float* y, int64_t y_stride) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // fetch the weight row kAhead rows on (as q4_block does): a cache line is two groups'
    // codes or sixteen groups' scales
    if ((g & 1) == 0)
      _mm_prefetch(reinterpret_cast<const char*>(wn + kAhead * K + g * kGroup), _MM_HINT_T0);
    if ((g & 15) == 0)
      _mm_prefetch(reinterpret_cast<const char*>(dn + kAhead * groups + g), _MM_HINT_T0);
    const __m256 dg = _mm256_set1_ps(dn[g]);
    const int8_t* wg = wn + g * kGroup;
    __m256 w[4];
    for (int q = 0; q < 4; ++q) {
      const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wg + 8 * q));
      w[q] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), dg);
    }
    for (int r = 0; r < R; ++r) {
      const float* xr = x + (r0 + r) * K + g * kGroup;
      for (int q = 0; q < 4; ++q)
        acc[r][q] = _mm256_fmadd_ps(w[q], _mm256_loadu_ps(xr + q * 8), acc[r][q]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 a = _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                                   _mm256_add_ps(acc[r][2], acc[r][3]));
    y[(r0 + r) * y_stride] = radixserve_vec::hsum8(a);
  }
}

// Every row of one output, four rows at a time.
void q8_output(const int8_t* wn, const float* dn, const float* x, int64_t M, int64_t K,
               int64_t groups, float* y, int64_t y_stride) {
  int64_t r = 0;
  for (; r + 4 <= M; r += 4) q8_rows<4>(wn, dn, x, r, K, groups, y, y_stride);
  for (; r < M; ++r) q8_rows<1>(wn, dn, x, r, K, groups, y, y_stride);
}
#else
void q8_output(const int8_t* wn, const float* dn, const float* x, int64_t M, int64_t K,
               int64_t groups, float* y, int64_t y_stride) {
  for (int64_t r = 0; r < M; ++r) {
    float acc = 0.f;
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t j = 0; j < kGroup; ++j)
        acc += static_cast<float>(wn[g * kGroup + j]) * dn[g] * x[r * K + g * kGroup + j];
    y[r * y_stride] = acc;
  }
}
#endif

void check_q8(const at::Tensor& qs, const at::Tensor& d) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kChar && qs.is_contiguous(),
              "qs must be contiguous int8 [N, K]");
  TORCH_CHECK(qs.size(1) % kGroup == 0, "K must be a multiple of ", kGroup);
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.dim() == 2 &&
                  d.size(0) == qs.size(0) && d.size(1) == qs.size(1) / kGroup,
              "d must be contiguous fp32 [N, K/32]");
}

at::Tensor q8_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  check_q8(qs, d);
  const int64_t M = x_in.size(0), K = x_in.size(1), N = qs.size(0), G = d.size(1);
  TORCH_CHECK(K == qs.size(1), "x has ", K, " columns, the weight ", qs.size(1));
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* qp = qs.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) q8_output(qp + n * K, dp + n * G, xp, M, K, G, yp + n, N);
  });
  return y;
}

at::Tensor q8_dequantize(const at::Tensor& qs, const at::Tensor& d) {
  check_q8(qs, d);
  const int64_t N = qs.size(0), K = qs.size(1), G = d.size(1);
  at::Tensor w = at::empty({N, K}, d.options());
  float* wp = w.data_ptr<float>();
  const int8_t* qp = qs.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  at::parallel_for(0, N, 8, [&](int64_t lo, int64_t hi) {
    dequantize_q8_rows(qp, dp, lo, hi, G, wp + lo * K);
  });
  return w;
}

at::Tensor q4_dequantize(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == 16 && qs.scalar_type() == at::kByte,
              "qs must be uint8 [N, K/32, 16]");
  const int64_t N = qs.size(0), G = qs.size(1), K = G * kGroup;
  at::Tensor w = at::empty({N, K}, d.options());
  float* wp = w.data_ptr<float>();
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  at::parallel_for(0, N, 8, [&](int64_t lo, int64_t hi) {
    dequantize_q4_rows(qp, dp, mp, lo, hi, G, wp + lo * K);
  });
  return w;
}

bool tiled_supported() { return kTiled; }

// The four tiled ops: their arguments checked (x [M, K], wt [N/16, K/32, 320 or 576] uint8,
// contiguous; kSiluMul: [gate; up] in whole tiles), then the product.
template <bool kInt8, bool kSiluMul>
at::Tensor tiled_op(const char* op, const at::Tensor& x, const at::Tensor& wt) {
  TORCH_CHECK(kTiled, op, " needs a CPU with AVX-512 VNNI (tiled_supported())");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int64_t tile_bytes = kInt8 ? 576 : 320;
  TORCH_CHECK(wt.dim() == 3 && wt.size(2) == tile_bytes && wt.scalar_type() == at::kByte &&
                  wt.is_contiguous(),
              "wt must be contiguous uint8 [N/16, K/32, ", tile_bytes, "]");
  const int64_t K = x.size(1), G = wt.size(1);
  TORCH_CHECK(K == G * kGroup, "x has ", K, " columns, the weight ", G * kGroup);
  if (kSiluMul) {
    TORCH_CHECK(wt.size(0) % 2 == 0, op, ": [gate; up] in whole tiles (N % 32 == 0)");
  }
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
  return tiled_product<kInt8, kSiluMul>(x, wt);
#else
  return at::Tensor();
#endif
}

at::Tensor q4_tiled_linear(const at::Tensor& x, const at::Tensor& wt) {
  return tiled_op<false, false>("q4_tiled_linear", x, wt);
}

at::Tensor q8_tiled_linear(const at::Tensor& x, const at::Tensor& wt) {
  return tiled_op<true, false>("q8_tiled_linear", x, wt);
}

at::Tensor q4_tiled_silu_mul(const at::Tensor& x, const at::Tensor& wt) {
  return tiled_op<false, true>("q4_tiled_silu_mul", x, wt);
}

at::Tensor q8_tiled_silu_mul(const at::Tensor& x, const at::Tensor& wt) {
  return tiled_op<true, true>("q8_tiled_silu_mul", x, wt);
}

at::Tensor q4_dense(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                    const at::Tensor& m, bool bf16) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == 16 && qs.scalar_type() == at::kByte &&
                  qs.is_contiguous(),
              "qs must be contiguous uint8 [N, K/32, 16]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = qs.size(0), G = qs.size(1);
  TORCH_CHECK(K == G * kGroup, "x has ", K, " columns, the weight ", G * kGroup);
  TORCH_CHECK(d.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat &&
                  d.is_contiguous() && m.is_contiguous() && d.dim() == 2 && d.size(0) == N &&
                  d.size(1) == G && m.sizes() == d.sizes(),
              "d, m: contiguous fp32 [N, K/32]");
  // the activations on q4_linear's int8 grid, in the GEMM's dtype
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor xa = at::empty({M, K}, x.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      if (bf16) {
        round_activations(xp + r * K, G, xa.data_ptr<at::BFloat16>() + r * K);
      } else {
        round_activations(xp + r * K, G, xa.data_ptr<float>() + r * K);
      }
    }
  });
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  return blocked_product(xa, N, K, [&](int64_t n0, int64_t n1, auto* out) {
    dequantize_q4_rows(qp, dp, mp, n0, n1, G, out);
  });
}

at::Tensor q8_dense(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                    bool bf16) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  check_q8(qs, d);
  const int64_t K = x_in.size(1), N = qs.size(0), G = d.size(1);
  TORCH_CHECK(K == qs.size(1), "x has ", K, " columns, the weight ", qs.size(1));
  const at::Tensor x = x_in.to(bf16 ? at::kBFloat16 : at::kFloat).contiguous();
  const int8_t* qp = qs.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  return blocked_product(x, N, K, [&](int64_t n0, int64_t n1, auto* out) {
    dequantize_q8_rows(qp, dp, n0, n1, G, out);
  });
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, lib) {
  lib.def("q4_linear(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor");
  lib.def("q4_dequantize(Tensor qs, Tensor d, Tensor m) -> Tensor");
  lib.def("q8_linear(Tensor x, Tensor qs, Tensor d) -> Tensor");
  lib.def("q8_dequantize(Tensor qs, Tensor d) -> Tensor");
  lib.def("q4_dense(Tensor x, Tensor qs, Tensor d, Tensor m, bool bf16) -> Tensor");
  lib.def("q8_dense(Tensor x, Tensor qs, Tensor d, bool bf16) -> Tensor");
  lib.def("q4_tiled_linear(Tensor x, Tensor wt) -> Tensor");
  lib.def("q8_tiled_linear(Tensor x, Tensor wt) -> Tensor");
  lib.def("q4_tiled_silu_mul(Tensor x, Tensor wt) -> Tensor");
  lib.def("q8_tiled_silu_mul(Tensor x, Tensor wt) -> Tensor");
  lib.def("tiled_supported", &radixserve::tiled_supported);
}

TORCH_LIBRARY_IMPL(radixserve, CPU, lib) {
  lib.impl("q4_linear", &radixserve::q4_linear);
  lib.impl("q4_dequantize", &radixserve::q4_dequantize);
  lib.impl("q8_linear", &radixserve::q8_linear);
  lib.impl("q8_dequantize", &radixserve::q8_dequantize);
  lib.impl("q4_dense", &radixserve::q4_dense);
  lib.impl("q8_dense", &radixserve::q8_dense);
  lib.impl("q4_tiled_linear", &radixserve::q4_tiled_linear);
  lib.impl("q8_tiled_linear", &radixserve::q8_tiled_linear);
  lib.impl("q4_tiled_silu_mul", &radixserve::q4_tiled_silu_mul);
  lib.impl("q8_tiled_silu_mul", &radixserve::q8_tiled_silu_mul);
}
