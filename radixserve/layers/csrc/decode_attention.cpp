// Paged decode attention for the CPU: one query token per request, K and V read in place from
// the KV pool through each request's row of slots (no gathered copy of the context), the query
// heads of a GQA group attended together under their KV head, and long rows split into
// segments attended in parallel and merged by their log-sum-exp (flash-decoding).
//
// decode_attention(q [B, Hkv, G, D], k_buf [S, Hkv, D], v_buf [S, Hkv, D], kv_rows [B, L] int64,
//                  kv_start [B] int64, kv_end [B] int64, scale, split_tokens)
//   -> (out [B, Hkv, G, D] fp32, lse [B, Hkv, G] fp32)
// Request b attends slots kv_rows[b, kv_start[b] : kv_end[b]]. An empty range gives out = 0 and
// lse = -inf, so that callers can merge several ranges (the cascade's shared prefix and
// private suffix) exactly. split_tokens <= 0 picks the segment length from the thread count.
//
// Each segment is attended by one of three loops: a bf16 query over a bf16 or fp8 pool
// with D of 64 or 128, on a CPU with AVX512-BF16, by attend_bf16 (both products on
// vdpbf16ps, the probabilities rounded to bf16 for the second, as the torch-native backend and
// extend_attention.cpp round them); other queries and pools with D % 8 == 0 by attend_avx2
// (fp32 throughout, the pool's rows widened); the rest by the scalar attend.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec_math.h"

namespace {

constexpr int64_t kBlock = 32;  // tokens scored before their softmax update
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Segment {
  int64_t b, t0, t1;
};

// The fp8 formats a KV pool may hold (--kv-cache-dtype fp8_e5m2 / fp8_e4m3; no scales).
template <typename T>
constexpr bool kFp8 = std::is_same_v<T, c10::Float8_e5m2> || std::is_same_v<T, c10::Float8_e4m3fn>;

// The row of one slot as floats: in place for fp32 pools, converted into `buf` otherwise.
template <typename kv_t>
inline const float* row_as_float(const kv_t* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<kv_t, float>) {
    return src;
#if defined(__AVX2__) && defined(__F16C__)
  } else if constexpr (kFp8<kv_t>) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(buf + i, radixserve_vec::fp8_to_ps8(src + i));
    for (; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
#endif
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

// The K and V rows (row_bytes each) of the next block's `count` slots, fetched into L2
// (prefetcht1) a few rows at a time while this block computes: the loops call issue() after
// each vector of scores, `calls` times a block, and each call fetches the next
// ceil(count / calls) slots' rows, so the fetches spread over the block's products. Issued
// all at the block's start, they filled the load queue and the products waited behind them
// (the op took 1.35-1.7x as long). Each call is a few scalar operations per slot plus the
// prefetches: spreading them line by line, a division and a branch per line, took 1/4 of
// the bf16 kernel's time with its rows in cache (from memory it waits on the reads either way).
struct SpreadPrefetch {
  const char* k;
  const char* v;
  const int64_t* slots;
  int64_t row_bytes, count, per_call;
  int64_t done = 0;
  SpreadPrefetch(const void* k_buf, const void* v_buf, const int64_t* s, int64_t n,
                 int64_t bytes, int64_t calls)
      : k(static_cast<const char*>(k_buf)),
        v(static_cast<const char*>(v_buf)),
        slots(s),
        row_bytes(bytes),
        count(n),
        per_call((n + calls - 1) / std::max<int64_t>(1, calls)) {}
  void issue() {
    const int64_t end = std::min(count, done + per_call);
    for (; done < end; ++done) {
      const char* kr = k + slots[done] * row_bytes;
      const char* vr = v + slots[done] * row_bytes;
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(kr + off, 0, 2);
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(vr + off, 0, 2);
    }
  }
};

// Online softmax over slots row[t0:t1] for all H * G queries of one request: each slot's K and
// V rows (every KV head, contiguous in the pool) are read once. m, l: [H * G]; acc: [H * G, D].
template <typename kv_t>
void attend(const float* q, int64_t H, int64_t G, int64_t D, const kv_t* k_buf, const kv_t* v_buf,
            const int64_t* row, int64_t t0, int64_t t1, float scale, float* m, float* l,
            float* acc) {
  const int64_t HG = H * G, W = H * D;
  std::vector<float> kf(W), vf(W), p(HG * kBlock);
  for (int64_t i = 0; i < HG; ++i) {
    m[i] = kNegInf;
    l[i] = 0.f;
  }
  std::fill(acc, acc + HG * D, 0.f);
  for (int64_t base = t0; base < t1; base += kBlock) {
    const int64_t n = std::min(kBlock, t1 - base);
    for (int64_t i = 0; i < n; ++i) {
      const float* k = row_as_float(k_buf + row[base + i] * W, kf.data(), W);
      for (int64_t hg = 0; hg < HG; ++hg) {
        const float* kh = k + (hg / G) * D;
        const float* qg = q + hg * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * kh[d];
        p[hg * kBlock + i] = dot * scale;
      }
    }
    for (int64_t hg = 0; hg < HG; ++hg) {
      float* ph = p.data() + hg * kBlock;
      float block_max = kNegInf;
      for (int64_t i = 0; i < n; ++i) block_max = std::max(block_max, ph[i]);
      const float new_m = std::max(m[hg], block_max);
      const float corr = std::exp(m[hg] - new_m);  // exp(-inf) = 0 on the first block
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        ph[i] = std::exp(ph[i] - new_m);
        sum += ph[i];
      }
      l[hg] = l[hg] * corr + sum;
      m[hg] = new_m;
      float* a = acc + hg * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] *= corr;
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* v = row_as_float(v_buf + row[base + i] * W, vf.data(), W);
      for (int64_t hg = 0; hg < HG; ++hg) {
        const float w = p[hg * kBlock + i];
        const float* vh = v + (hg / G) * D;
        float* a = acc + hg * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += w * vh[d];
      }
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// The 8 dot products q · k_j (j < 8) of D floats (D % 8 == 0), as one vector.
inline __m256 dot8(const float* q, const float* const* k, int64_t off, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
         a7 = a0;
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + off + d), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + off + d), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + off + d), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + off + d), a3);
    a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[4] + off + d), a4);
    a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[5] + off + d), a5);
    a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[6] + off + d), a6);
    a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[7] + off + d), a7);
  }
  // Horizontal sums of the eight accumulators, lane j holding a_j's.
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// acc[0 : 8 * NV] = acc * corr + sum_i w[i] * v_i[off : off + 8 * NV], in registers.
template <int NV>
inline void weigh_values(float* acc, float corr, const float* w, const float* const* v,
                         int64_t off, int64_t n) {
  __m256 r[NV];
  const __m256 c = _mm256_set1_ps(corr);
  for (int j = 0; j < NV; ++j) r[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * j), c);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 wi = _mm256_broadcast_ss(w + i);
    const float* vi = v[i] + off;
    for (int j = 0; j < NV; ++j) r[j] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(vi + 8 * j), r[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(acc + 8 * j, r[j]);
}

// `attend` for D % 8 == 0 with AVX2: per block of slots, each query's scores come eight slots
// at a time (dot8), the softmax update runs on vectors, and each query's accumulator stays in
// registers while the block's V rows pass (at most 64 floats of it at a time).
template <typename kv_t>
void attend_avx2(const float* q, int64_t H, int64_t G, int64_t D, const kv_t* k_buf,
                 const kv_t* v_buf, const int64_t* row, int64_t t0, int64_t t1, float scale,
                 float* m, float* l, float* acc, const int64_t* next_slots, int64_t next_count) {
  const int64_t HG = H * G, W = H * D;
  constexpr bool in_place = std::is_same_v<kv_t, float>;
  std::vector<float> kt(in_place ? 0 : kBlock * W), vt(in_place ? 0 : kBlock * W);
  std::vector<float> zero(W, 0.f);
  alignas(32) float p[kBlock];
  const float* krow[kBlock];
  const float* vrow[kBlock];
  for (int64_t i = 0; i < HG; ++i) {
    m[i] = kNegInf;
    l[i] = 0.f;
  }
  std::fill(acc, acc + HG * D, 0.f);
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t base = t0; base < t1; base += kBlock) {
    const int64_t n = std::min(kBlock, t1 - base);
    // The slots are known ahead: the next block's rows (or the next segment's first) go to L2
    // while this one computes (two blocks would not fit L1).
    const bool last = base + n >= t1;
    const int64_t n8 = (n + 7) / 8 * 8;
    SpreadPrefetch spf(k_buf, v_buf, last ? next_slots : row + base + n,
                       std::min(kBlock, last ? next_count : t1 - base - n),
                       W * static_cast<int64_t>(sizeof(kv_t)), HG * n8 / 8);
    for (int64_t i = 0; i < kBlock; ++i) {
      if (i >= n) {  // a partial block scores the zero row (its lanes are dropped)
        krow[i] = vrow[i] = zero.data();
      } else if constexpr (in_place) {
        krow[i] = k_buf + row[base + i] * W;
        vrow[i] = v_buf + row[base + i] * W;
      } else {
        krow[i] = row_as_float(k_buf + row[base + i] * W, kt.data() + i * W, W);
        vrow[i] = row_as_float(v_buf + row[base + i] * W, vt.data() + i * W, W);
      }
    }
    for (int64_t hg = 0; hg < HG; ++hg) {
      const int64_t off = (hg / G) * D;
      const float* qh = q + hg * D;
      __m256 vmax = _mm256_set1_ps(kNegInf);
      for (int64_t i = 0; i < n8; i += 8) {
        __m256 sv = _mm256_mul_ps(dot8(qh, krow + i, off, D), vscale);
        if (i + 8 > n) {  // lanes past the block's end: -inf, so they weigh nothing
          const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
          const __m256 live = _mm256_castsi256_ps(
              _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - i)), lane));
          sv = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), sv, live);
        }
        _mm256_store_ps(p + i, sv);
        vmax = _mm256_max_ps(vmax, sv);
        spf.issue();
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float new_m = std::max(m[hg], _mm_cvtss_f32(m4));
      const float corr = std::exp(m[hg] - new_m);  // exp(-inf) = 0 on the first block
      const __m256 vm = _mm256_set1_ps(new_m);
      for (int64_t i = 0; i < n8; i += 8)
        _mm256_store_ps(p + i, radixserve_vec::exp8(_mm256_sub_ps(_mm256_load_ps(p + i), vm)));
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) sum += p[i];
      l[hg] = l[hg] * corr + sum;
      m[hg] = new_m;
      float* a = acc + hg * D;
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        switch (std::min<int64_t>(8, (D - d0) / 8)) {
          case 8: weigh_values<8>(a + d0, corr, p, vrow, off + d0, n); break;
          case 7: weigh_values<7>(a + d0, corr, p, vrow, off + d0, n); break;
          case 6: weigh_values<6>(a + d0, corr, p, vrow, off + d0, n); break;
          case 5: weigh_values<5>(a + d0, corr, p, vrow, off + d0, n); break;
          case 4: weigh_values<4>(a + d0, corr, p, vrow, off + d0, n); break;
          case 3: weigh_values<3>(a + d0, corr, p, vrow, off + d0, n); break;
          case 2: weigh_values<2>(a + d0, corr, p, vrow, off + d0, n); break;
          default: weigh_values<1>(a + d0, corr, p, vrow, off + d0, n); break;
        }
      }
    }
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define RADIXSERVE_DECODE_BF16 1
constexpr int64_t kBlock16 = 16;  // slots per vector of scores in the bf16 kernel

// s[i] = the sum of the 16 lanes of P[i], for i < 16, as one vector (a transposing reduction:
// pairs of vectors within 128-bit lanes, then pairs of 64-bit halves, then 128-bit lanes).
inline __m512 reduce16(const __m512 P[16]) {
  __m512 a[8], b[4];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: [P2j(0)+P2j(2), P2j+1(0)+.., P2j(1)+.., ..]
    a[j] = _mm512_add_ps(_mm512_unpacklo_ps(P[2 * j], P[2 * j + 1]),
                         _mm512_unpackhi_ps(P[2 * j], P[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: tokens 4j .. 4j + 3, in order
    const __m512d x = _mm512_castps_pd(a[2 * j]), y = _mm512_castps_pd(a[2 * j + 1]);
    b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                  _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                  _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

inline __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// The values' pass of one head over a block for qc <= QC of its queries at once: o[g] =
// o[g] * corr[g] + the probabilities pw[g] (bf16 pairs) times the slot pairs' V rows, each
// pair's rows interleaved by vpunpck{l,h}wd once for all qc queries, the accumulators in
// registers (QC * 2 * NV of them, 12 or 16: enough independent chains to cover vdpbf16ps's
// latency). The dims stay in the interleaved order (vector 2c + h, lane 4L + e: dim
// 32c + 8L + 4h + e) until attend_bf16's end.
template <int NV, int QC>
inline void weigh_values_bf16(const c10::BFloat16* const* vrow, int64_t hD, int64_t pairs,
                              const uint32_t* pw, int64_t pw_stride, const float* corr,
                              float* a, int64_t qc) {
  constexpr int64_t D = 32 * NV;
  __m512 o[QC][2 * NV];
  for (int g = 0; g < QC; ++g) {
    if (g >= qc) break;
    const __m512 vc = _mm512_set1_ps(corr[g]);
    for (int k = 0; k < 2 * NV; ++k)
      o[g][k] = _mm512_mul_ps(_mm512_loadu_ps(a + g * D + 16 * k), vc);
  }
  for (int64_t j = 0; j < pairs; ++j) {
    const c10::BFloat16* r0 = vrow[2 * j] + hD;
    const c10::BFloat16* r1 = vrow[2 * j + 1] + hD;
    __m512i w[QC];
    for (int g = 0; g < QC; ++g)
      if (g < qc) w[g] = _mm512_set1_epi32(static_cast<int>(pw[g * pw_stride + j]));
    for (int c = 0; c < NV; ++c) {
      const __m512i x = _mm512_loadu_si512(r0 + 32 * c), y = _mm512_loadu_si512(r1 + 32 * c);
      const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
      for (int g = 0; g < QC; ++g) {
        if (g >= qc) break;
        o[g][2 * c] = dot_bf16(o[g][2 * c], w[g], lo);
        o[g][2 * c + 1] = dot_bf16(o[g][2 * c + 1], w[g], hi);
      }
    }
  }
  for (int g = 0; g < QC; ++g) {
    if (g >= qc) break;
    for (int k = 0; k < 2 * NV; ++k) _mm512_storeu_ps(a + g * D + 16 * k, o[g][k]);
  }
}

// `attend` for a bf16 query and a bf16 or fp8 pool, D = 32 * NV, on AVX512-BF16: both products
// on `vdpbf16ps`, as extend_attention.cpp's tiles. Per block of up to 64 slots and KV head
// (an fp8 pool's rows of the head first widened to bf16, exactly, into scratch that stays in
// L1; widening every head's at the block's start evicted them before their queries came): each
// query's scores are dot products of bf16 pairs summed in fp32 (16 at a time by reduce16) and
// its online softmax runs in fp32 once per block; then one pass over the block's V rows weighs
// them by up to three (D = 64) or two (D = 128) queries' probabilities, rounded to bf16, at
// once (weigh_values_bf16), so each V row is loaded and interleaved once per pass, not once
// per query.
template <int NV, typename kv_t>
void attend_bf16(const c10::BFloat16* q, int64_t H, int64_t G, const kv_t* k_buf,
                 const kv_t* v_buf, const int64_t* row, int64_t t0, int64_t t1, float scale,
                 float* m, float* l, float* acc, const int64_t* next_slots, int64_t next_count) {
  constexpr int64_t D = 32 * NV, kSlots = 4 * kBlock16;
  constexpr int QC = NV == 2 ? 3 : 2;  // queries per values' pass (accumulators in registers)
  constexpr bool widen = kFp8<kv_t>;
  static_assert(widen || std::is_same_v<kv_t, c10::BFloat16>, "a bf16 or fp8 pool");
  const int64_t HG = H * G, W = H * D;
  const std::vector<c10::BFloat16> zero(W, c10::BFloat16(0.f));
  // An fp8 pool's rows of one KV head in a block, widened (K, then V: 16 or 32 KB, in L1).
  std::vector<c10::BFloat16> wide(widen ? 2 * kSlots * D : 0);
  using wide_t = std::conditional_t<widen, kv_t, c10::Float8_e5m2>;
  const radixserve_vec::Fp8ToBf16<wide_t> widen_row;
  std::vector<float> acc_p(HG * D, 0.f);
  std::vector<uint32_t> pw(G * (kSlots / 2));  // each query's probabilities, as bf16 pairs
  std::vector<float> corr(G);
  const kv_t* krow[kSlots];  // the block's slots' rows in the pool (every KV head)
  const kv_t* vrow[kSlots];
  const c10::BFloat16* khead[kSlots];  // their rows of the KV head at hand, as bf16
  const c10::BFloat16* vhead[kSlots];
  for (int64_t i = 0; i < HG; ++i) {
    m[i] = kNegInf;
    l[i] = 0.f;
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t base = t0; base < t1; base += kSlots) {
    const int64_t n = std::min(kSlots, t1 - base);
    const int64_t groups = (n + kBlock16 - 1) / kBlock16, pairs = (n + 1) / 2;
    const bool last = base + n >= t1;
    SpreadPrefetch spf(k_buf, v_buf, last ? next_slots : row + base + n,
                       std::min(kSlots, last ? next_count : t1 - base - n),
                       W * static_cast<int64_t>(sizeof(kv_t)), H * G * groups);
    for (int64_t i = 0; i < n; ++i) {
      krow[i] = k_buf + row[base + i] * W;
      vrow[i] = v_buf + row[base + i] * W;
    }
    for (int64_t i = n; i < groups * kBlock16; ++i) khead[i] = vhead[i] = zero.data();
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < n; ++i) {
        if constexpr (widen) {
          c10::BFloat16* kd = wide.data() + i * D;
          c10::BFloat16* vd = wide.data() + (kSlots + i) * D;
          widen_row(krow[i] + h * D, reinterpret_cast<uint16_t*>(kd), D);
          widen_row(vrow[i] + h * D, reinterpret_cast<uint16_t*>(vd), D);
          khead[i] = kd;
          vhead[i] = vd;
        } else {
          khead[i] = krow[i] + h * D;
          vhead[i] = vrow[i] + h * D;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hg = h * G + g;
        __m512i qv[NV];
        for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_si512(q + hg * D + 32 * c);
        __m512 sv[kSlots / kBlock16];
        __m512 vmax = _mm512_set1_ps(kNegInf);
        for (int64_t v = 0; v < groups; ++v) {
          __m512 P[kBlock16];
          for (int64_t i = 0; i < kBlock16; ++i) {
            const c10::BFloat16* k = khead[v * kBlock16 + i];
            __m512 d = _mm512_setzero_ps();
            for (int c = 0; c < NV; ++c) d = dot_bf16(d, qv[c], _mm512_loadu_si512(k + 32 * c));
            P[i] = d;
          }
          sv[v] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf),
                                     radixserve_vec::first(n - v * kBlock16),
                                     _mm512_mul_ps(reduce16(P), vscale));
          vmax = _mm512_max_ps(vmax, sv[v]);
          spf.issue();
        }
        const float new_m = std::max(m[hg], _mm512_reduce_max_ps(vmax));
        corr[g] = std::exp(m[hg] - new_m);  // exp(-inf) = 0 on the first block
        const __m512 vm = _mm512_set1_ps(new_m);
        __m512 psum = _mm512_setzero_ps();
        uint32_t* pg = pw.data() + g * (kSlots / 2);
        for (int64_t v = 0; v < groups; ++v) {
          const __m512 p = _mm512_maskz_mov_ps(radixserve_vec::first(n - v * kBlock16),
                                               radixserve_vec::exp16(_mm512_sub_ps(sv[v], vm)));
          psum = _mm512_add_ps(psum, p);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pg + 8 * v),
                              (__m256i)_mm512_cvtneps_pbh(p));
        }
        l[hg] = l[hg] * corr[g] + _mm512_reduce_add_ps(psum);
        m[hg] = new_m;
      }
      for (int64_t g0 = 0; g0 < G; g0 += QC)
        weigh_values_bf16<NV, QC>(vhead, 0, pairs, pw.data() + g0 * (kSlots / 2), kSlots / 2,
                                  corr.data() + g0, acc_p.data() + (h * G + g0) * D,
                                  std::min<int64_t>(QC, G - g0));
    }
  }
  for (int64_t hg = 0; hg < HG; ++hg) {  // back to the dims' order
    const float* a = acc_p.data() + hg * D;
    float* out = acc + hg * D;
    for (int64_t v = 0; v < 2 * NV; ++v)
      for (int64_t lane = 0; lane < 16; ++lane)
        out[32 * (v / 2) + 8 * (lane / 4) + 4 * (v % 2) + lane % 4] = a[16 * v + lane];
  }
}
#endif

}  // namespace

namespace radixserve {

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q_in, const at::Tensor& k_buf,
                                                    const at::Tensor& v_buf,
                                                    const at::Tensor& kv_rows_in,
                                                    const at::Tensor& kv_start_in,
                                                    const at::Tensor& kv_end_in, double scale,
                                                    int64_t split_tokens) {
  TORCH_CHECK(q_in.dim() == 4, "q must be [B, Hkv, G, D]");
  TORCH_CHECK(k_buf.dim() == 3 && v_buf.sizes() == k_buf.sizes(), "k_buf, v_buf: [S, Hkv, D]");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), "k_buf and v_buf dtypes differ");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "KV buffers must be contiguous");
  const int64_t B = q_in.size(0), H = q_in.size(1), G = q_in.size(2), D = q_in.size(3);
  TORCH_CHECK(k_buf.size(1) == H && k_buf.size(2) == D, "q and KV buffers disagree on heads/dim");
  TORCH_CHECK(kv_rows_in.dim() == 2 && kv_rows_in.size(0) == B, "kv_rows must be [B, L]");
  // A bf16 query over a bf16 or fp8 pool with D of 64 or 128 takes attend_bf16 (its products
  // on vdpbf16ps need the query in bf16 as it came: an fp32 query is not rounded for it); the
  // other loops take the query in fp32.
#if defined(RADIXSERVE_DECODE_BF16)
  const bool bf16_path =
      q_in.scalar_type() == at::kBFloat16 &&
      (k_buf.scalar_type() == at::kBFloat16 || radixserve::is_fp8(k_buf.scalar_type())) &&
      (D == 64 || D == 128);
#else
  constexpr bool bf16_path = false;
#endif
  const at::Tensor q = bf16_path ? q_in.contiguous() : q_in.to(at::kFloat).contiguous();
  const at::Tensor kv_rows = kv_rows_in.to(at::kLong).contiguous();
  const at::Tensor kv_start = kv_start_in.to(at::kLong).contiguous();
  const at::Tensor kv_end = kv_end_in.to(at::kLong).contiguous();
  const int64_t L = kv_rows.size(1), S = k_buf.size(0);
  const int64_t* starts = kv_start.data_ptr<int64_t>();
  const int64_t* ends = kv_end.data_ptr<int64_t>();
  const int64_t* rows = kv_rows.data_ptr<int64_t>();

  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 <= starts[b] && starts[b] <= ends[b] && ends[b] <= L,
                "kv range out of its row for request ", b);
    max_len = std::max(max_len, ends[b] - starts[b]);
    for (int64_t t = starts[b]; t < ends[b]; ++t) {
      const int64_t slot = rows[b * L + t];
      TORCH_CHECK(0 <= slot && slot < S, "KV slot ", slot, " out of the pool (", S, ")");
    }
  }
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += ends[b] - starts[b];
  // Under this many (slot, query head) pairs the work is smaller than starting the thread pool's
  // parallel region (a request of SmolLM2's 9 query heads: 114 slots). The decode step calls
  // this between two linear layers, with the pool's threads still spinning; and from a few
  // hundred slots on, a lone request's K and V come from memory (other layers' weights went
  // through the caches since this layer's last step) and one thread waits on them.
  const bool serial = total * H * G < 1024;
  if (split_tokens <= 0 && serial) {
    split_tokens = std::max<int64_t>(1, max_len);
  } else if (split_tokens <= 0) {
    // Enough segments for every thread; then, while segments stay at 128 slots or more, up to
    // four per thread, so that requests of unequal lengths still share the threads evenly.
    const int64_t threads = at::get_num_threads();
    int64_t splits = std::max<int64_t>(1, (threads + B - 1) / std::max<int64_t>(1, B));
    while (splits * B < 4 * threads && max_len / (2 * splits) >= 128) splits *= 2;
    split_tokens = std::max<int64_t>(kBlock, (max_len + splits - 1) / splits);
  }
  std::vector<Segment> segs;
  std::vector<int64_t> first(B + 1, 0);  // segments of request b: [first[b], first[b + 1])
  for (int64_t b = 0; b < B; ++b) {
    first[b] = static_cast<int64_t>(segs.size());
    for (int64_t t = starts[b]; t < ends[b]; t += split_tokens)
      segs.push_back({b, t, std::min(ends[b], t + split_tokens)});
  }
  first[B] = static_cast<int64_t>(segs.size());
  const int64_t n = static_cast<int64_t>(segs.size());
  const int64_t HG = H * G;
  std::vector<float> seg_m(n * HG), seg_l(n * HG), seg_acc(n * HG * D);

  const float* qp = bf16_path ? nullptr : q.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND4(at::kBFloat16, at::kHalf, at::kFloat8_e5m2, at::kFloat8_e4m3fn,
                                  k_buf.scalar_type(), "decode_attention", [&] {
    const scalar_t* kp = k_buf.data_ptr<scalar_t>();
    const scalar_t* vp = v_buf.data_ptr<scalar_t>();
    at::parallel_for(0, n, serial ? n + 1 : 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const Segment& s = segs[i];
        const int64_t* next_slots = nullptr;
        int64_t next_count = 0;
        if (i + 1 < hi) {
          next_slots = rows + segs[i + 1].b * L + segs[i + 1].t0;
          next_count = segs[i + 1].t1 - segs[i + 1].t0;
        }
#if defined(RADIXSERVE_DECODE_BF16)
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || kFp8<scalar_t>) {
          if (bf16_path) {
            const c10::BFloat16* qb = q.data_ptr<c10::BFloat16>() + s.b * HG * D;
            auto* const fn = D == 64 ? &attend_bf16<2, scalar_t> : &attend_bf16<4, scalar_t>;
            fn(qb, H, G, kp, vp, rows + s.b * L, s.t0, s.t1, fscale, seg_m.data() + i * HG,
               seg_l.data() + i * HG, seg_acc.data() + i * HG * D, next_slots, next_count);
            continue;
          }
        }
#endif
#if defined(__AVX2__) && defined(__FMA__)
        if (D % 8 == 0) {
          attend_avx2<scalar_t>(qp + s.b * HG * D, H, G, D, kp, vp, rows + s.b * L, s.t0, s.t1,
                                fscale, seg_m.data() + i * HG, seg_l.data() + i * HG,
                                seg_acc.data() + i * HG * D, next_slots, next_count);
          continue;
        }
#endif
        attend<scalar_t>(qp + s.b * HG * D, H, G, D, kp, vp, rows + s.b * L, s.t0, s.t1, fscale,
                         seg_m.data() + i * HG, seg_l.data() + i * HG, seg_acc.data() + i * HG * D);
      }
    });
  });

  const auto f32 = q_in.options().dtype(at::kFloat);
  at::Tensor out = at::zeros({B, H, G, D}, f32);
  at::Tensor lse = at::full({B, H, G}, kNegInf, f32);
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, B, serial ? B + 1 : 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t s0 = first[b], s1 = first[b + 1];
      if (s0 == s1) continue;  // empty range
      for (int64_t hg = 0; hg < HG; ++hg) {
        float mm = kNegInf;
        for (int64_t s = s0; s < s1; ++s) mm = std::max(mm, seg_m[s * HG + hg]);
        float total = 0.f;
        float* o = op + (b * HG + hg) * D;
        for (int64_t s = s0; s < s1; ++s) {
          const float w = std::exp(seg_m[s * HG + hg] - mm);
          total += seg_l[s * HG + hg] * w;
          const float* a = seg_acc.data() + (s * HG + hg) * D;
          for (int64_t d = 0; d < D; ++d) o[d] += a[d] * w;
        }
        for (int64_t d = 0; d < D; ++d) o[d] /= total;
        lp[b * HG + hg] = mm + std::log(total);
      }
    }
  });
  return {out, lse};
}

}  // namespace radixserve

TORCH_LIBRARY(radixserve, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor kv_rows, Tensor kv_start, "
      "Tensor kv_end, float scale, int split_tokens) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("decode_attention", &radixserve::decode_attention);
}
