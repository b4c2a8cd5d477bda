// Prefill (extend) attention for one request on CPUs with AVX512-BF16: the request's new tokens
// attend its cached prefix and, causally, each other, K and V read through its row of slots in
// the paged pool. Flash-attention tiling: a tile of query rows against a tile of keys at a time,
// scores and the probabilities-times-values product both on `vdpbf16ps` (bf16 pairs summed into
// fp32), an online softmax in fp32 in between, the running output in fp32. The probabilities are
// rounded to bf16 for the second product, as flash-attention does on GPUs.
//
// extend_attention(q [N, Hq, D] bf16, k_buf [S, Hkv, D] bf16, v_buf [S, Hkv, D] bf16,
//                  slots [L] int64, scale) -> out [N, Hq, D] bf16
// N <= L; the new tokens are the row's last N: query i sits at position L - N + i and sees
// keys 0 ..= L - N + i. D is 64 or 128; Hq a multiple of Hkv (GQA: query head h reads KV head
// h / (Hq / Hkv)). extend_attention_supported() says whether this build has the kernel (it
// needs a CPU with AVX512-BF16; elsewhere callers keep torch's SDPA).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define RADIXSERVE_EXTEND_BF16 1
#include <immintrin.h>
#endif

namespace {

#if defined(RADIXSERVE_EXTEND_BF16)

constexpr int64_t kBQ = 64;  // query rows of a tile
constexpr int64_t kBK = 64;  // keys of a tile: four vectors of 16 scores
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for 16 floats: exp8's polynomial (vec_math.h) on 512-bit vectors, inputs clamped to
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

inline __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// One KV head's keys and values, packed per tile of kBK keys for the two products (a 32-bit
// word holds a bf16 pair, the lower address in its low half, as vdpbf16ps pairs them):
//   kp[tile][i][j] = (K[j][2i], K[j][2i + 1])   [D/2][kBK]: a vector is 16 keys' pair i
//   vp[tile][j][d] = (V[2j][d], V[2j + 1][d])   [kBK/2][D]: a vector is 16 dims of keys 2j, 2j+1
// Keys past the row's end are zero.
void pack_tile(const uint16_t* k_buf, const uint16_t* v_buf, const int64_t* slots, int64_t L,
               int64_t Hkv, int64_t D, int64_t h, int64_t tile, uint32_t* kp, uint32_t* vp) {
  const int64_t W = Hkv * D, j0 = tile * kBK, half = D / 2;
  for (int64_t j = 0; j < kBK; ++j) {
    const int64_t t = j0 + j;
    if (t < L) {
      const uint32_t* k = reinterpret_cast<const uint32_t*>(k_buf + slots[t] * W + h * D);
      for (int64_t i = 0; i < half; ++i) kp[i * kBK + j] = k[i];
    } else {
      for (int64_t i = 0; i < half; ++i) kp[i * kBK + j] = 0;
    }
  }
  for (int64_t j = 0; j < kBK / 2; ++j) {
    const int64_t t = j0 + 2 * j;
    const uint16_t* v0 = t < L ? v_buf + slots[t] * W + h * D : nullptr;
    const uint16_t* v1 = t + 1 < L ? v_buf + slots[t + 1] * W + h * D : nullptr;
    for (int64_t d = 0; d < D; ++d) {
      const uint32_t lo = v0 ? v0[d] : 0, hi = v1 ? v1[d] : 0;
      vp[j * D + d] = lo | (hi << 16);
    }
  }
}

// Scores of R query rows (bf16 pairs, [R][D/2]) against one tile's 64 keys, times `scale`.
template <int R>
inline void score_rows(const uint32_t* q, int64_t half, const uint32_t* kp, float scale,
                       float* s) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < half; ++i) {
    const uint32_t* k = kp + i * kBK;
    const __m512i k0 = _mm512_loadu_si512(k), k1 = _mm512_loadu_si512(k + 16);
    const __m512i k2 = _mm512_loadu_si512(k + 32), k3 = _mm512_loadu_si512(k + 48);
    for (int r = 0; r < R; ++r) {
      const __m512i qb = _mm512_set1_epi32(static_cast<int>(q[r * half + i]));
      acc[r][0] = dot_bf16(acc[r][0], qb, k0);
      acc[r][1] = dot_bf16(acc[r][1], qb, k1);
      acc[r][2] = dot_bf16(acc[r][2], qb, k2);
      acc[r][3] = dot_bf16(acc[r][3], qb, k3);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kBK + c * 16, _mm512_mul_ps(acc[r][c], sc));
}

// o[r] = o[r] * alpha[r] + p[r] . V for R rows: p as bf16 pairs [R][kBK/2], o [R][NV * 16].
template <int R, int NV>
inline void accumulate_rows(const uint32_t* p, const uint32_t* vp, const float* alpha, float* o,
                            int64_t pairs) {
  constexpr int64_t D = NV * 16;
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + v * 16), a);
  }
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = _mm512_loadu_si512(vp + j * D + v * 16);
    for (int r = 0; r < R; ++r) {
      const __m512i pb = _mm512_set1_epi32(static_cast<int>(p[r * (kBK / 2) + j]));
      for (int v = 0; v < NV; ++v) acc[r][v] = dot_bf16(acc[r][v], pb, vv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + r * D + v * 16, acc[r][v]);
}

// One query head's tile of up to kBQ rows (query rows q0 .. q0 + rows - 1) over every key it
// sees. q: the request's queries [N, Hq, D]; out likewise.
template <int NV>
void attend_tile(const uint16_t* q, uint16_t* out, int64_t Hq, int64_t h, int64_t q0,
                 int64_t rows, int64_t prefix, const uint32_t* kp, const uint32_t* vp,
                 float scale, uint32_t* qt, float* s, uint32_t* pt, float* o, float* m, float* l,
                 float* alpha) {
  constexpr int64_t D = NV * 16, half = D / 2;
  constexpr int RS = 4;            // rows per score micro-tile (16 accumulators)
  constexpr int RA = 16 / NV;      // rows per accumulate micro-tile (16 accumulators)
  static_assert(kBQ % RS == 0 && kBQ % RA == 0);
  // Rows past the request's end are zero queries: their results are computed and dropped.
  for (int64_t r = 0; r < kBQ; ++r) {
    if (r < rows)
      std::memcpy(qt + r * half, q + ((q0 + r) * Hq + h) * D, D * sizeof(uint16_t));
    else
      std::memset(qt + r * half, 0, D * sizeof(uint16_t));
    m[r] = kNegInf;
    l[r] = 0.f;
  }
  std::memset(o, 0, kBQ * D * sizeof(float));
  const int64_t first_pos = prefix + q0, last_pos = prefix + q0 + rows - 1;
  const int64_t tiles = last_pos / kBK + 1;
  const int64_t rows_up = (rows + RS - 1) / RS * RS;
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t t = 0; t < tiles; ++t) {
    const uint32_t* kt = kp + t * half * kBK;
    const uint32_t* vt = vp + t * (kBK / 2) * D;
    for (int64_t r = 0; r < rows_up; r += RS)
      score_rows<RS>(qt + r * half, half, kt, scale, s + r * kBK);
    const int64_t k0 = t * kBK;
    const bool diagonal = k0 + kBK - 1 > first_pos;  // some row sees only part of this tile
    for (int64_t r = 0; r < rows_up; ++r) {
      float* sr = s + r * kBK;
      __mmask16 valid[4] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};
      if (diagonal) {  // key k0 + 16c + lane is seen by the row at position first_pos + r
        const __m512i lim = _mm512_set1_epi32(static_cast<int>(first_pos + r - k0));
        for (int c = 0; c < 4; ++c)
          valid[c] = _mm512_cmple_epi32_mask(_mm512_add_epi32(iota, _mm512_set1_epi32(16 * c)),
                                             lim);
      }
      __m512 mx = _mm512_set1_ps(kNegInf);
      for (int c = 0; c < 4; ++c)
        mx = _mm512_mask_max_ps(mx, valid[c], mx, _mm512_loadu_ps(sr + c * 16));
      const float tile_max = _mm512_reduce_max_ps(mx);
      const float new_m = std::max(m[r], tile_max);
      uint32_t* pr = pt + r * (kBK / 2);
      if (new_m == kNegInf) {  // nothing seen yet (a padding row): keep it empty
        alpha[r] = 1.f;
        std::memset(pr, 0, kBK * sizeof(uint16_t));
        continue;
      }
      alpha[r] = m[r] == kNegInf ? 0.f : std::exp(m[r] - new_m);
      m[r] = new_m;
      const __m512 nm = _mm512_set1_ps(new_m);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        const __m512 p = _mm512_maskz_mov_ps(
            valid[c], exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + c * 16), nm)));
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr) + c, (__m256i)_mm512_cvtneps_pbh(p));
      }
      l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    }
    const int64_t rows_a = (rows + RA - 1) / RA * RA;
    for (int64_t r = 0; r < rows_a; r += RA)
      accumulate_rows<RA, NV>(pt + r * (kBK / 2), vt, alpha + r, o + r * D, kBK / 2);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    uint16_t* dst = out + ((q0 + r) * Hq + h) * D;
    for (int v = 0; v < NV; ++v) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + v * 16), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst) + v, (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
}

template <int NV>
void extend_bf16(const uint16_t* q, const uint16_t* k_buf, const uint16_t* v_buf,
                 const int64_t* slots, int64_t N, int64_t L, int64_t Hq, int64_t Hkv, float scale,
                 uint16_t* out) {
  constexpr int64_t D = NV * 16, half = D / 2;
  const int64_t tiles = (L + kBK - 1) / kBK, prefix = L - N, G = Hq / Hkv;
  const int64_t tile_words = half * kBK;  // kBK * D / 2 words, for K and for V alike
  std::vector<uint32_t> kp(Hkv * tiles * tile_words), vp(Hkv * tiles * tile_words);
  at::parallel_for(0, Hkv * tiles, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      pack_tile(k_buf, v_buf, slots, L, Hkv, D, i / tiles, i % tiles,
                kp.data() + i * tile_words, vp.data() + i * tile_words);
  });
  // Work items: (query tile, query head), the costliest (last) query tiles first, handed out
  // one at a time so that the causal triangle's unequal tiles share the threads evenly.
  const int64_t qtiles = (N + kBQ - 1) / kBQ, items = qtiles * Hq;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    std::vector<uint32_t> qt(kBQ * half), pt(kBQ * kBK / 2);
    std::vector<float> s(kBQ * kBK), o(kBQ * D), m(kBQ), l(kBQ), alpha(kBQ);
    for (int64_t w = next++; w < items; w = next++) {
      const int64_t qtile = qtiles - 1 - w / Hq, h = w % Hq;
      const int64_t q0 = qtile * kBQ, rows = std::min(kBQ, N - q0);
      const int64_t kvh = h / G;
      attend_tile<NV>(q, out, Hq, h, q0, rows, prefix, kp.data() + kvh * tiles * tile_words,
                      vp.data() + kvh * tiles * tile_words, scale, qt.data(), s.data(),
                      pt.data(), o.data(), m.data(), l.data(), alpha.data());
    }
  });
}

#endif  // RADIXSERVE_EXTEND_BF16

}  // namespace

namespace radixserve {

bool extend_attention_supported() {
#if defined(RADIXSERVE_EXTEND_BF16)
  return true;
#else
  return false;
#endif
}

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& slots, double scale) {
  TORCH_CHECK(extend_attention_supported(),
              "extend_attention needs a CPU with AVX512-BF16 (this build has no such kernel)");
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.sizes() == k_buf.sizes(),
              "extend_attention: q [N, Hq, D], k_buf and v_buf [S, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_buf.scalar_type() == at::kBFloat16 &&
                  v_buf.scalar_type() == at::kBFloat16,
              "extend_attention runs on bf16 queries and a bf16 KV pool");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong, "slots: [L] int64");
  TORCH_CHECK(q.is_contiguous() && k_buf.is_contiguous() && v_buf.is_contiguous(),
              "extend_attention: contiguous inputs");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t S = k_buf.size(0), Hkv = k_buf.size(1), L = slots.size(0);
  TORCH_CHECK(k_buf.size(2) == D && (D == 64 || D == 128), "head_dim must be 64 or 128, got ", D);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(0 < N && N <= L, "extend_attention: 0 < new tokens <= slots");
  at::Tensor sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < L; ++t)
    TORCH_CHECK(0 <= sp[t] && sp[t] < S, "KV slot ", sp[t], " out of the pool (", S, ")");
  at::Tensor out = at::empty_like(q);
#if defined(RADIXSERVE_EXTEND_BF16)
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_buf.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_buf.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float fs = static_cast<float>(scale);
  if (D == 64)
    extend_bf16<4>(qp, kp, vp, sp, N, L, Hq, Hkv, fs, op);
  else
    extend_bf16<8>(qp, kp, vp, sp, N, L, Hq, Hkv, fs, op);
#endif
  return out;
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("extend_attention_supported", &radixserve::extend_attention_supported);
  m.def("extend_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("extend_attention", &radixserve::extend_attention);
}
