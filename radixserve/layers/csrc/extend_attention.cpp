// Attention of many queries over one row of slots, for CPUs with AVX512-BF16: flash-attention
// tiles (a tile of query rows against a tile of keys at a time), scores and the
// probabilities-times-values product both on `vdpbf16ps` (bf16 pairs summed into fp32), an
// online softmax in fp32 (base 2) in between, the running output in fp32. The probabilities are
// rounded to bf16 for the second product, as flash-attention does on GPUs. K and V are read through
// the row's slots in the paged pool and packed once per call for the two products. On a CPU
// with AMX both products run on its tile unit instead (`tdpbf16ps`, from the same packed
// tiles), 16 query rows at a time over chunks of 512 keys, the softmax on the vector units:
// SmolLM2-135M's 1,024-token prefill attention 4x faster on a 2-core Xeon (docs/performance.md,
// "Prefill attention on AMX's tile unit").
//
// extend_attention(q [N, Hq, D] bf16, k_buf [S, Hkv, D], v_buf [S, Hkv, D] (bf16, or fp8
//                  e5m2 / e4m3fn widened to bf16 as they are packed), slots [L] int64, scale)
//   -> out [N, Hq, D] bf16
//   Prefill: a request's N new tokens (the row's last N) attend its cached prefix and,
//   causally, each other: query i sits at position L - N + i and sees keys 0 ..= L - N + i.
// cascade_prefix_attention(q [B, Hkv, G, D] bf16, k_buf, v_buf, members [M] int64,
//                          group_start [NG + 1] int64, prefix_rows [NG, Lmax] int64,
//                          prefix_lens [NG] int64, out [B, Hkv, G, D] fp32 (in/out),
//                          lse [B, Hkv, G] fp32 (in/out), scale)
//   A decode step's shared prefixes: group g's requests members[group_start[g] :
//   group_start[g + 1]] all attend prefix_rows[g, :prefix_lens[g]] (no mask), their G query
//   heads per KV head stacked as one tile's rows, so the prefix is read once per group; each
//   result is merged by log-sum-exp into (out, lse), which hold the requests' attention over
//   their private suffixes (decode_attention's output).
// D is 64 or 128; Hq a multiple of Hkv (GQA: query head h reads KV head h / (Hq / Hkv)).
// extend_attention_supported() says whether this build has the kernels (they need a CPU with
// AVX512-BF16; elsewhere callers keep torch's SDPA and decode_attention);
// extend_attention_amx() whether their products run on AMX here (built with it, the tile
// state granted, not switched off); set_attention_amx(on) switches that for the process and
// returns the previous setting (the tests run both paths on one machine).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define RADIXSERVE_EXTEND_BF16 1
#include <immintrin.h>

#include "vec_math.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RADIXSERVE_EXTEND_AMX 1
#endif
#endif

namespace {

#if defined(RADIXSERVE_EXTEND_BF16)

constexpr int64_t kBQ = 64;  // query rows of a tile
constexpr int64_t kBK = 64;  // keys of a tile: four vectors of 16 scores
constexpr int64_t kChunk = 512;  // AMX: keys per softmax pass of 16 rows (eight tiles)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// out[c] = column c of the 16 x 16 matrix of 32-bit words whose row r is in[r].
inline void transpose16(const __m512i in[16], __m512i out[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // within 128-bit lanes: 2 x 2 blocks of rows i, i + 1
    t[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c], lane L: column 4L + c of rows i .. i + 3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // gather lane L of the four row groups: column 4L + c
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    out[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    out[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    out[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    out[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// One KV head's keys and values, packed per tile of kBK keys for the two products (a 32-bit
// word holds a bf16 pair, the lower address in its low half, as vdpbf16ps pairs them):
//   kp[tile][i][j] = (K[j][2i], K[j][2i + 1])   [D/2][kBK]: a vector is 16 keys' pair i
//   vp[tile][j][d] = (V[2j][d], V[2j + 1][d])   [kBK/2][D]: a vector is 16 dims of keys 2j, 2j+1
// Keys past the row's end are zero. D is a multiple of 32. The pool's elements (kv_t) are bf16
// bits (uint16_t), or fp8 (e5m2 / e4m3fn) whose rows are first widened to bf16, exactly.
template <typename kv_t>
void pack_tile(const kv_t* k_buf, const kv_t* v_buf, const int64_t* slots, int64_t L,
               int64_t Hkv, int64_t D, int64_t h, int64_t tile, uint32_t* kp, uint32_t* vp) {
  constexpr bool widen = !std::is_same_v<kv_t, uint16_t>;
  const int64_t W = Hkv * D, j0 = tile * kBK, half = D / 2;
  thread_local std::vector<uint16_t> wide;  // an fp8 tile's K rows, then its V rows
  if (widen && static_cast<int64_t>(wide.size()) < 2 * kBK * D) wide.resize(2 * kBK * D);
  const radixserve_vec::Fp8ToBf16<std::conditional_t<widen, kv_t, c10::Float8_e5m2>> widen_row;
  const uint16_t* krow[kBK];
  const uint16_t* vrow[kBK];
  for (int64_t j = 0; j < kBK; ++j) {
    if (j0 + j >= L) {
      krow[j] = vrow[j] = nullptr;
      continue;
    }
    const kv_t* k = k_buf + slots[j0 + j] * W + h * D;
    const kv_t* v = v_buf + slots[j0 + j] * W + h * D;
    if constexpr (widen) {
      widen_row(k, wide.data() + j * D, D);
      widen_row(v, wide.data() + (kBK + j) * D, D);
      krow[j] = wide.data() + j * D;
      vrow[j] = wide.data() + (kBK + j) * D;
    } else {
      krow[j] = k;
      vrow[j] = v;
    }
  }
  const __m512i zero = _mm512_setzero_si512();
  __m512i in[16], out[16];
  for (int64_t jb = 0; jb < kBK; jb += 16) {  // 16 keys x 16 pairs at a time, transposed
    for (int64_t ib = 0; ib < half; ib += 16) {
      for (int r = 0; r < 16; ++r)
        in[r] = krow[jb + r] ? _mm512_loadu_si512(krow[jb + r] + 2 * ib) : zero;
      transpose16(in, out);
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(kp + (ib + c) * kBK + jb, out[c]);
    }
  }
  for (int64_t j = 0; j < kBK / 2; ++j) {  // interleave keys 2j and 2j + 1, 16 dims at a time
    const uint16_t *v0 = vrow[2 * j], *v1 = vrow[2 * j + 1];
    for (int64_t d = 0; d < D; d += 16) {
      const __m512i lo = v0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(v0 + d)))
                            : zero;
      const __m512i hi = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(v1 + d)))
                            : zero;
      _mm512_storeu_si512(vp + j * D + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// Scores of R query rows (bf16 pairs, [R][D/2]) against one tile's 64 keys (unscaled).
template <int R>
inline void score_rows(const uint32_t* q, int64_t half, const uint32_t* kp, float* s) {
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
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kBK + c * 16, acc[r][c]);
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

#if defined(RADIXSERVE_EXTEND_AMX)
// On a CPU with AMX both products run on the tile unit (`tdpbf16ps`), 16 query rows at a time,
// from the same packed tiles: pair i of 16 keys (a row of kp) is the B operand's row i for the
// scores, and keys 2j, 2j + 1 of 16 dimensions (a row of vp) its row j for the output. Tiles
// 0-3 hold fp32 results (16 rows x 16 keys, or x 16 dimensions), 4 the A operand (16 rows x 32
// bf16: queries, or probabilities), 6 and 7 the B operands in turn. The online softmax between
// the two products stays on the vector units, as does the rescaling of the running output.

// Whether extend attention runs on AMX: the build has it, Linux granted the tile state
// (bf16_tiled_amx), and set_attention_amx has not turned it off (tests compare both paths).
std::atomic<bool> g_attention_amx{true};

bool attention_amx() {
  static const bool granted = radixserve::bf16_tiled_amx();
  return granted && g_attention_amx.load(std::memory_order_relaxed);
}

// Every tile 16 rows of 64 bytes.
void configure_attention_tiles() {
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;  // palette 1
  for (int t = 0; t < 8; ++t) {
    cfg[16 + 2 * t] = 64;  // bytes per row (colsb, 16-bit little-endian)
    cfg[48 + t] = 16;      // rows
  }
  _tile_loadconfig(cfg);
}

// One B tile into tile 6 (even c) or 7 (odd c), then result tile c += A (tile 4) . B. (GCC's
// tile intrinsics are macros that paste their tile numbers into the assembly: literals only.)
#define RADIXSERVE_AMX_DOT(c, bt, b, stride) \
  do {                                       \
    _tile_loadd(bt, b, stride);              \
    _tile_dpbf16ps(c, 4, bt);                \
  } while (0)

#else
bool attention_amx() { return false; }
#endif

// Buffers the tile unit reads or writes start on a cache line, so that no tile row straddles
// two lines (malloc aligns to 16 bytes): the packed tiles and a tile's scratch.
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
};
template <typename T>
using Buffer = std::vector<T, LineAligned<T>>;

// A tile's query rows: row r's query vector (bf16, D values) and which keys it sees: those
// below limit0 + r when causal, below limit0 otherwise.
struct TileRows {
  const uint16_t* q[kBQ];
  int64_t rows;
  int64_t limit0;
  bool causal;
};

// Per-thread buffers of one tile.
struct TileScratch {
  Buffer<uint32_t> q, p;
  Buffer<float> s, o, m, l, lv, alpha;
  explicit TileScratch(int64_t D)
      : q(kBQ * D / 2), p(std::max(kBQ * kBK, 16 * kChunk) / 2),
        s(std::max(kBQ * kBK, 16 * kChunk)), o(kBQ * D), m(kBQ), l(kBQ),
        lv(kBQ * 16), alpha(kBQ) {}
};

#if defined(RADIXSERVE_EXTEND_AMX)
// Scores of 16 query rows (bf16 pairs, [16][D/2]) against one tile's 64 keys (unscaled), into
// the first 64 columns of s [16][kChunk].
template <int NV>
inline void score_rows_amx(const uint32_t* q, const uint32_t* kp, float* s) {
  constexpr int64_t half = NV * 8;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < half; i += 16) {  // 32 dimensions: 16 pairs
    _tile_loadd(4, q + i, half * 4);
    const uint32_t* k = kp + i * kBK;
    RADIXSERVE_AMX_DOT(0, 6, k, kBK * 4);
    RADIXSERVE_AMX_DOT(1, 7, k + 16, kBK * 4);
    RADIXSERVE_AMX_DOT(2, 6, k + 32, kBK * 4);
    RADIXSERVE_AMX_DOT(3, 7, k + 48, kBK * 4);
  }
  _tile_stored(0, s, kChunk * 4);
  _tile_stored(1, s + 16, kChunk * 4);
  _tile_stored(2, s + 32, kChunk * 4);
  _tile_stored(3, s + 48, kChunk * 4);
}

// o [16][D] += p . V for 16 rows over `pairs` pairs of keys (a multiple of 16; vp the first
// pair's packed values, the tiles of a chunk one after the other): p as bf16 pairs
// [16][kChunk/2]. The result tiles are loaded and stored once for the whole chunk.
template <int NV>
inline void accumulate_rows_amx(const uint32_t* p, const uint32_t* vp, int64_t pairs, float* o) {
  constexpr int64_t D = NV * 16;
  for (int64_t c0 = 0; c0 < D; c0 += 64) {  // 64 dimensions: four result tiles
    _tile_loadd(0, o + c0, D * 4);
    _tile_loadd(1, o + c0 + 16, D * 4);
    _tile_loadd(2, o + c0 + 32, D * 4);
    _tile_loadd(3, o + c0 + 48, D * 4);
    for (int64_t j = 0; j < pairs; j += 16) {  // 32 keys: 16 pairs
      _tile_loadd(4, p + j, kChunk / 2 * 4);
      const uint32_t* v = vp + j * D + c0;
      RADIXSERVE_AMX_DOT(0, 6, v, D * 4);
      RADIXSERVE_AMX_DOT(1, 7, v + 16, D * 4);
      RADIXSERVE_AMX_DOT(2, 6, v + 32, D * 4);
      RADIXSERVE_AMX_DOT(3, 7, v + 48, D * 4);
    }
    _tile_stored(0, o + c0, D * 4);
    _tile_stored(1, o + c0 + 16, D * 4);
    _tile_stored(2, o + c0 + 32, D * 4);
    _tile_stored(3, o + c0 + 48, D * 4);
  }
}

// attend_tile on the tile unit (the same results up to summation order and the bf16 rounding
// of the probabilities). Each 16 rows go on their own, through the keys the last of them sees
// (in a causal tile the first rows stop earlier), in chunks of up to kChunk keys: the chunk's
// scores (tile unit), then per row its maximum over them, the old output's factor and the
// probabilities (vector units), then the chunk's output product (tile unit) with the output
// tiles loaded and stored once per chunk. A row's keys past its limit get probability 0.
template <int NV>
void attend_tile_amx(const TileRows& tr, const uint32_t* kp, const uint32_t* vp, float scale,
                     TileScratch& w) {
  constexpr int64_t D = NV * 16, half = D / 2;
  const float scale2 = scale * 1.44269504088896341f;  // log2(e)
  const __m512 sc2 = _mm512_set1_ps(scale2);
  uint32_t* pt = w.p.data();
  float* s = w.s.data();
  for (int64_t g = 0; g < tr.rows; g += 16) {
    const int64_t n = std::min<int64_t>(16, tr.rows - g);  // rows past n: zero queries, dropped
    uint32_t* qt = w.q.data() + g * half;
    float* o = w.o.data() + g * D;
    for (int64_t r = 0; r < 16; ++r) {
      if (r < n)
        std::memcpy(qt + r * half, tr.q[g + r], D * sizeof(uint16_t));
      else
        std::memset(qt + r * half, 0, D * sizeof(uint16_t));
    }
    std::memset(o, 0, 16 * D * sizeof(float));
    int64_t limit[16];  // keys below limit[r] are row r's (padding rows: the last row's)
    float m[16], l[16];
    for (int64_t r = 0; r < 16; ++r) {
      limit[r] = tr.causal ? tr.limit0 + g + std::min(r, n - 1) : tr.limit0;
      m[r] = kNegInf;
      l[r] = 0.f;
    }
    const int64_t keys = limit[15];  // the most any row of the 16 sees
    for (int64_t k0 = 0; k0 < keys; k0 += kChunk) {
      const int64_t width = std::min(kChunk, keys - k0);
      const int64_t nt = (width + kBK - 1) / kBK;
      for (int64_t j = 0; j < nt; ++j)
        score_rows_amx<NV>(qt, kp + (k0 / kBK + j) * half * kBK, s + j * kBK);
      float alpha[16];
      for (int64_t r = 0; r < 16; ++r) {
        const float* sr = s + r * kChunk;
        uint32_t* pr = pt + r * (kChunk / 2);
        const int64_t seen = std::clamp<int64_t>(limit[r] - k0, 0, width);
        const int64_t full = seen / 16, vecs = nt * (kBK / 16);
        const __mmask16 tail = radixserve_vec::first(seen % 16);
        alpha[r] = 1.f;
        if (seen == 0) {  // none of this chunk's keys: probabilities 0
          std::memset(pr, 0, vecs * 16 * sizeof(uint16_t));
          continue;
        }
        __m512 mx = _mm512_set1_ps(kNegInf);
        for (int64_t c = 0; c < full; ++c) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + c * 16));
        if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_loadu_ps(sr + full * 16));
        const float mn = std::max(m[r], _mm512_reduce_max_ps(mx) * scale2);  // scale2 > 0
        if (mn != m[r]) {
          alpha[r] = m[r] == kNegInf ? 0.f : std::exp2(m[r] - mn);
          m[r] = mn;
        }
        const __m512 nm = _mm512_set1_ps(mn);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t c = 0; c < vecs; ++c) {
          const __mmask16 valid = c < full ? 0xFFFF : (c == full ? tail : 0);
          const __m512 p = radixserve_vec::exp2_16_masked(
              valid, _mm512_fmsub_ps(_mm512_loadu_ps(sr + c * 16), sc2, nm));
          sum = _mm512_add_ps(sum, p);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr) + c, (__m256i)_mm512_cvtneps_pbh(p));
        }
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
      }
      for (int64_t r = 0; r < 16; ++r) {  // the rows whose maximum moved
        if (alpha[r] == 1.f) continue;
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int64_t v = 0; v < NV; ++v)
          _mm512_storeu_ps(o + r * D + v * 16,
                           _mm512_mul_ps(_mm512_loadu_ps(o + r * D + v * 16), a));
      }
      accumulate_rows_amx<NV>(pt, vp + (k0 / 2) * D, nt * (kBK / 2), o);
    }
    for (int64_t r = 0; r < n; ++r) {
      w.m[g + r] = m[r];
      w.l[g + r] = l[r];
    }
  }
}
#endif

// The tile's rows over every key they see (kp, vp: one KV head's packed tiles). Leaves the
// unnormalized output in w.o [rows, D], the maximum score in w.m and the sum in w.l. The
// softmax runs in base 2: scores are scaled by scale * log2(e), so w.m is the maximum in
// units of log2 (a row's log-sum-exp is w.m * ln 2 + log w.l) and each probability is one
// exp2_16_masked, whose 6e-6 error is far below the bf16 rounding the probabilities get.
// amx: both products on the tile unit (attention_amx), the calling thread's tiles configured.
template <int NV>
void attend_tile(const TileRows& tr, const uint32_t* kp, const uint32_t* vp, float scale,
                 bool amx, TileScratch& w) {
#if defined(RADIXSERVE_EXTEND_AMX)
  if (amx) return attend_tile_amx<NV>(tr, kp, vp, scale, w);
#endif
  constexpr int64_t D = NV * 16, half = D / 2;
  constexpr int RS = 4;        // rows per score micro-tile (16 accumulators)
  constexpr int RA = 16 / NV;  // rows per accumulate micro-tile (16 accumulators)
  static_assert(kBQ % RS == 0 && kBQ % RA == 0 && RS % RA == 0);
  uint32_t *qt = w.q.data(), *pt = w.p.data();
  float *s = w.s.data(), *o = w.o.data(), *m = w.m.data(), *l = w.l.data(), *lv = w.lv.data();
  float* alpha = w.alpha.data();
  const float scale2 = scale * 1.44269504088896341f;  // log2(e)
  const int64_t rows = tr.rows;
  const int64_t rows_up = (rows + RS - 1) / RS * RS;
  // Rows up to the micro-tile's end past the tile's rows are zero queries, their results
  // computed and dropped.
  for (int64_t r = 0; r < rows_up; ++r) {
    if (r < rows)
      std::memcpy(qt + r * half, tr.q[r], D * sizeof(uint16_t));
    else
      std::memset(qt + r * half, 0, D * sizeof(uint16_t));
    m[r] = kNegInf;
    _mm512_storeu_ps(lv + r * 16, _mm512_setzero_ps());  // the sum, 16 lanes until the end
  }
  std::memset(o, 0, rows_up * D * sizeof(float));
  const int64_t min_limit = tr.limit0;
  const int64_t max_limit = tr.causal ? tr.limit0 + rows - 1 : tr.limit0;
  const int64_t tiles = (max_limit + kBK - 1) / kBK;
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 sc2 = _mm512_set1_ps(scale2), ninf = _mm512_set1_ps(kNegInf);
  const __m512 one = _mm512_set1_ps(1.f);
  float new_m[kBQ];
  std::fill(new_m, new_m + kBQ, kNegInf);  // rows past rows_up: computed, never read
  __mmask16 masks[kBQ][4];
  for (int64_t t = 0; t < tiles; ++t) {
    const uint32_t* kt = kp + t * half * kBK;
    const uint32_t* vt = vp + t * (kBK / 2) * D;
    for (int64_t r = 0; r < rows_up; r += RS) score_rows<RS>(qt + r * half, half, kt, s + r * kBK);
    const int64_t k0 = t * kBK;
    const bool partial = k0 + kBK > min_limit;  // some row sees only part of this tile
    for (int64_t r = 0; r < rows_up; ++r) {  // each row's keys, and its new maximum
      __mmask16* valid = masks[r];
      for (int c = 0; c < 4; ++c) valid[c] = 0xFFFF;
      if (partial) {  // key k0 + 16c + lane is seen below the row's limit
        const int64_t limit = tr.causal ? tr.limit0 + r : tr.limit0;
        const __m512i lim = _mm512_set1_epi32(static_cast<int>(std::min(limit - k0, kBK)));
        for (int c = 0; c < 4; ++c)
          valid[c] =
              _mm512_cmplt_epi32_mask(_mm512_add_epi32(iota, _mm512_set1_epi32(16 * c)), lim);
      }
      const float* sr = s + r * kBK;
      __m512 mx = _mm512_set1_ps(kNegInf);
      for (int c = 0; c < 4; ++c)
        mx = _mm512_mask_max_ps(mx, valid[c], mx, _mm512_loadu_ps(sr + c * 16));
      new_m[r] = std::max(m[r], _mm512_reduce_max_ps(mx) * scale2);  // scale2 > 0
    }
    for (int64_t r = 0; r < rows_up; r += 16) {  // the old sums' factors, 16 rows at a time
      const __m512 mo = _mm512_loadu_ps(m + r), mn = _mm512_loadu_ps(new_m + r);
      // 0 where nothing was seen before; 1 where nothing is seen yet (a padding row)
      __m512 a = radixserve_vec::exp2_16_masked(_mm512_cmp_ps_mask(mo, ninf, _CMP_NEQ_OQ),
                                                _mm512_sub_ps(mo, mn));
      a = _mm512_mask_mov_ps(a, _mm512_cmp_ps_mask(mn, ninf, _CMP_EQ_OQ), one);
      _mm512_storeu_ps(alpha + r, a);
      _mm512_storeu_ps(m + r, mn);
    }
    for (int64_t r = 0; r < rows_up; ++r) {  // probabilities (bf16 pairs) and sums
      uint32_t* pr = pt + r * (kBK / 2);
      if (m[r] == kNegInf) {  // a padding row: keep it empty
        std::memset(pr, 0, kBK * sizeof(uint16_t));
        continue;
      }
      const float* sr = s + r * kBK;
      const __m512 nm = _mm512_set1_ps(m[r]);
      __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(lv + r * 16), _mm512_set1_ps(alpha[r]));
      for (int c = 0; c < 4; ++c) {
        const __m512 p = radixserve_vec::exp2_16_masked(
            masks[r][c], _mm512_fmsub_ps(_mm512_loadu_ps(sr + c * 16), sc2, nm));
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr) + c, (__m256i)_mm512_cvtneps_pbh(p));
      }
      _mm512_storeu_ps(lv + r * 16, sum);
    }
    const int64_t rows_a = (rows + RA - 1) / RA * RA;
    for (int64_t r = 0; r < rows_a; r += RA)
      accumulate_rows<RA, NV>(pt + r * (kBK / 2), vt, alpha + r, o + r * D, kBK / 2);
  }
  for (int64_t r = 0; r < rows; ++r) l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(lv + r * 16));
}

// Pack the tiles of `rows` rows of slots (one per KV head, or per group and KV head):
// row i reads slots[i / Hkv] up to len[i / Hkv], KV head i % Hkv. kp/vp: [rows][tiles][...].
template <typename kv_t>
void pack_rows(const kv_t* k_buf, const kv_t* v_buf, const int64_t* const* slots,
               const int64_t* lens, int64_t rows, int64_t tiles, int64_t Hkv, int64_t D,
               uint32_t* kp, uint32_t* vp) {
  const int64_t tile_words = kBK * D / 2;
  at::parallel_for(0, rows * tiles, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t row = i / tiles, tile = i % tiles, owner = row / Hkv;
      if (tile * kBK >= lens[owner]) continue;  // past this row's end: never read
      pack_tile(k_buf, v_buf, slots[owner], lens[owner], Hkv, D, row % Hkv, tile,
                kp + i * tile_words, vp + i * tile_words);
    }
  });
}

// Run items 0 .. items - 1 on the thread pool, handed out one at a time (tiles of unequal cost
// share the threads evenly), each thread with its own scratch, and its tiles configured where
// the products run on AMX (f's third argument).
template <typename F>
void for_each_item(int64_t items, int64_t D, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  const bool amx = attention_amx();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    TileScratch w(D);
#if defined(RADIXSERVE_EXTEND_AMX)
    if (amx) configure_attention_tiles();
#endif
    for (int64_t i = next++; i < items; i = next++) f(i, amx, w);
#if defined(RADIXSERVE_EXTEND_AMX)
    if (amx) _tile_release();
#endif
  });
}

template <int NV, typename kv_t>
void extend_bf16(const uint16_t* q, const kv_t* k_buf, const kv_t* v_buf,
                 const int64_t* slots, int64_t N, int64_t L, int64_t Hq, int64_t Hkv, float scale,
                 uint16_t* out) {
  constexpr int64_t D = NV * 16;
  const int64_t tiles = (L + kBK - 1) / kBK, prefix = L - N, G = Hq / Hkv;
  const int64_t head_words = tiles * kBK * D / 2;
  Buffer<uint32_t> kp(Hkv * head_words), vp(Hkv * head_words);
  const int64_t* rows[1] = {slots};
  pack_rows(k_buf, v_buf, rows, &L, Hkv, tiles, Hkv, D, kp.data(), vp.data());
  // Items: (query tile, query head), the costliest (last) query tiles first.
  const int64_t qtiles = (N + kBQ - 1) / kBQ;
  for_each_item(qtiles * Hq, D, [&](int64_t i, bool amx, TileScratch& w) {
    const int64_t q0 = (qtiles - 1 - i / Hq) * kBQ, h = i % Hq;
    TileRows tr;
    tr.rows = std::min(kBQ, N - q0);
    tr.limit0 = prefix + q0 + 1;
    tr.causal = true;
    for (int64_t r = 0; r < tr.rows; ++r) tr.q[r] = q + ((q0 + r) * Hq + h) * D;
    attend_tile<NV>(tr, kp.data() + (h / G) * head_words, vp.data() + (h / G) * head_words,
                    scale, amx, w);
    for (int64_t r = 0; r < tr.rows; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / w.l[r]);
      uint16_t* dst = out + ((q0 + r) * Hq + h) * D;
      for (int v = 0; v < NV; ++v) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + r * D + v * 16), inv);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst) + v, (__m256i)_mm512_cvtneps_pbh(x));
      }
    }
  });
}

template <int NV, typename kv_t>
void cascade_bf16(const uint16_t* q, const kv_t* k_buf, const kv_t* v_buf,
                  const int64_t* members, const int64_t* group_start, const int64_t* prefix_rows,
                  const int64_t* prefix_lens, int64_t NG, int64_t Lmax, int64_t Hkv, int64_t G,
                  float scale, float* out, float* lse) {
  constexpr int64_t D = NV * 16;
  const int64_t tiles = (Lmax + kBK - 1) / kBK;
  const int64_t head_words = tiles * kBK * D / 2;
  Buffer<uint32_t> kp(NG * Hkv * head_words), vp(NG * Hkv * head_words);
  std::vector<const int64_t*> rows(NG);
  for (int64_t g = 0; g < NG; ++g) rows[g] = prefix_rows + g * Lmax;
  pack_rows(k_buf, v_buf, rows.data(), prefix_lens, NG * Hkv, tiles, Hkv, D, kp.data(),
            vp.data());
  // Items: (group, KV head, tile of the group's member x query-head rows).
  std::vector<int64_t> item_group, item_row0;
  for (int64_t g = 0; g < NG; ++g)
    for (int64_t r0 = 0; r0 < (group_start[g + 1] - group_start[g]) * G; r0 += kBQ) {
      item_group.push_back(g);
      item_row0.push_back(r0);
    }
  const int64_t per_head = static_cast<int64_t>(item_group.size());
  for_each_item(per_head * Hkv, D, [&](int64_t i, bool amx, TileScratch& w) {
    const int64_t g = item_group[i / Hkv], r0 = item_row0[i / Hkv], h = i % Hkv;
    const int64_t* mem = members + group_start[g];
    TileRows tr;
    tr.rows = std::min(kBQ, (group_start[g + 1] - group_start[g]) * G - r0);
    tr.limit0 = prefix_lens[g];
    tr.causal = false;
    for (int64_t r = 0; r < tr.rows; ++r) {
      const int64_t b = mem[(r0 + r) / G], gi = (r0 + r) % G;
      tr.q[r] = q + ((b * Hkv + h) * G + gi) * D;
    }
    attend_tile<NV>(tr, kp.data() + (g * Hkv + h) * head_words,
                    vp.data() + (g * Hkv + h) * head_words, scale, amx, w);
    for (int64_t r = 0; r < tr.rows; ++r) {  // merge with the suffix's (out, lse)
      const int64_t b = mem[(r0 + r) / G], gi = (r0 + r) % G;
      const int64_t at = (b * Hkv + h) * G + gi;
      const float lp = w.m[r] * 0.693147180559945309f + std::log(w.l[r]), ls = lse[at];
      const float mx = std::max(lp, ls);
      const float ws = ls == kNegInf ? 0.f : std::exp(ls - mx), wp = std::exp(lp - mx);
      const float total = ws + wp;
      const __m512 a = _mm512_set1_ps(ws / total), c = _mm512_set1_ps(wp / (total * w.l[r]));
      float* dst = out + at * D;
      for (int v = 0; v < NV; ++v) {
        const __m512 x = _mm512_fmadd_ps(
            _mm512_loadu_ps(dst + v * 16), a,
            _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + r * D + v * 16), c));
        _mm512_storeu_ps(dst + v * 16, x);
      }
      lse[at] = mx + std::log(total);
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

bool extend_attention_amx() {
#if defined(RADIXSERVE_EXTEND_BF16)
  return attention_amx();
#else
  return false;
#endif
}

bool set_attention_amx(bool on) {
#if defined(RADIXSERVE_EXTEND_AMX)
  return g_attention_amx.exchange(on);
#else
  (void)on;
  return false;
#endif
}

namespace {
void check_pool(const at::Tensor& k_buf, const at::Tensor& v_buf, int64_t D, const char* op) {
  TORCH_CHECK(radixserve::extend_attention_supported(), op,
              " needs a CPU with AVX512-BF16 (this build has no such kernel)");
  TORCH_CHECK(k_buf.dim() == 3 && v_buf.sizes() == k_buf.sizes(), op,
              ": k_buf and v_buf [S, Hkv, D]");
  const at::ScalarType t = k_buf.scalar_type();
  TORCH_CHECK(v_buf.scalar_type() == t && (t == at::kBFloat16 || radixserve::is_fp8(t)), op,
              " runs on bf16 queries and a bf16 or fp8 KV pool");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), op, ": contiguous KV buffers");
  TORCH_CHECK(k_buf.size(2) == D && (D == 64 || D == 128), "head_dim must be 64 or 128, got ",
              D);
}

#if defined(RADIXSERVE_EXTEND_BF16)
// f(k, v) over the pool's elements: bf16 bits (uint16_t) or an fp8 type.
template <typename F>
void with_pool(const at::Tensor& k_buf, const at::Tensor& v_buf, const F& f) {
  if (k_buf.scalar_type() == at::kFloat8_e5m2)
    f(k_buf.data_ptr<c10::Float8_e5m2>(), v_buf.data_ptr<c10::Float8_e5m2>());
  else if (k_buf.scalar_type() == at::kFloat8_e4m3fn)
    f(k_buf.data_ptr<c10::Float8_e4m3fn>(), v_buf.data_ptr<c10::Float8_e4m3fn>());
  else
    f(static_cast<const uint16_t*>(k_buf.data_ptr()),
      static_cast<const uint16_t*>(v_buf.data_ptr()));
}
#endif

void check_slots(const int64_t* sp, int64_t n, int64_t S) {
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(0 <= sp[t] && sp[t] < S, "KV slot ", sp[t], " out of the pool (", S, ")");
}
}  // namespace

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& slots, double scale) {
  TORCH_CHECK(q.dim() == 3, "extend_attention: q [N, Hq, D]");
  check_pool(k_buf, v_buf, q.size(2), "extend_attention");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16,
              "extend_attention runs on bf16 queries and a bf16 or fp8 KV pool");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong, "slots: [L] int64");
  const int64_t N = q.size(0), Hq = q.size(1);
  [[maybe_unused]] const int64_t D = q.size(2);  // read only where the kernels are built
  const int64_t Hkv = k_buf.size(1), L = slots.size(0);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(0 < N && N <= L, "extend_attention: 0 < new tokens <= slots");
  const at::Tensor qc = q.contiguous(), sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  check_slots(sp, L, k_buf.size(0));
  at::Tensor out = at::empty_like(qc);
#if defined(RADIXSERVE_EXTEND_BF16)
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float fs = static_cast<float>(scale);
  with_pool(k_buf, v_buf, [&](const auto* kp, const auto* vp) {
    if (D == 64)
      extend_bf16<4>(qp, kp, vp, sp, N, L, Hq, Hkv, fs, op);
    else
      extend_bf16<8>(qp, kp, vp, sp, N, L, Hq, Hkv, fs, op);
  });
#endif
  return out;
}

void cascade_prefix_attention(const at::Tensor& q, const at::Tensor& k_buf,
                              const at::Tensor& v_buf, const at::Tensor& members,
                              const at::Tensor& group_start, const at::Tensor& prefix_rows,
                              const at::Tensor& prefix_lens, at::Tensor& out, at::Tensor& lse,
                              double scale) {
  TORCH_CHECK(q.dim() == 4, "cascade_prefix_attention: q [B, Hkv, G, D]");
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), D = q.size(3);
  check_pool(k_buf, v_buf, D, "cascade_prefix_attention");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16,
              "cascade_prefix_attention runs on bf16 queries and a bf16 or fp8 KV pool");
  TORCH_CHECK(k_buf.size(1) == Hkv, "cascade_prefix_attention: q's KV heads are the pool's");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "out: [B, Hkv, G, D] fp32, contiguous");
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == B && lse.size(1) == Hkv && lse.size(2) == G &&
                  lse.scalar_type() == at::kFloat && lse.is_contiguous(),
              "lse: [B, Hkv, G] fp32, contiguous");
  TORCH_CHECK(members.scalar_type() == at::kLong && group_start.scalar_type() == at::kLong &&
                  prefix_rows.scalar_type() == at::kLong && prefix_lens.scalar_type() == at::kLong,
              "members, group_start, prefix_rows and prefix_lens are int64");
  TORCH_CHECK(prefix_rows.dim() == 2 && prefix_lens.dim() == 1 &&
                  prefix_lens.size(0) == prefix_rows.size(0) &&
                  group_start.numel() == prefix_rows.size(0) + 1,
              "prefix_rows [NG, L], prefix_lens [NG], group_start [NG + 1]");
  const int64_t NG = prefix_rows.size(0), Lmax = prefix_rows.size(1);
  const at::Tensor qc = q.contiguous(), mem = members.contiguous(), gs = group_start.contiguous();
  const at::Tensor rows = prefix_rows.contiguous(), lens = prefix_lens.contiguous();
  const int64_t *mp = mem.data_ptr<int64_t>(), *gp = gs.data_ptr<int64_t>();
  const int64_t *rp = rows.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
  TORCH_CHECK(NG == 0 || (gp[0] == 0 && gp[NG] == mem.numel()),
              "group_start runs from 0 to the number of members");
  for (int64_t g = 0; g < NG; ++g) {
    TORCH_CHECK(gp[g] < gp[g + 1], "group ", g, " has no members");
    TORCH_CHECK(0 < lp[g] && lp[g] <= Lmax, "group ", g, "'s prefix length out of its row");
    check_slots(rp + g * Lmax, lp[g], k_buf.size(0));
  }
  for (int64_t i = 0; i < mem.numel(); ++i)
    TORCH_CHECK(0 <= mp[i] && mp[i] < B, "member ", mp[i], " out of the batch (", B, ")");
  if (NG == 0) return;
#if defined(RADIXSERVE_EXTEND_BF16)
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  const float fs = static_cast<float>(scale);
  with_pool(k_buf, v_buf, [&](const auto* kp, const auto* vp) {
    if (D == 64)
      cascade_bf16<4>(qp, kp, vp, mp, gp, rp, lp, NG, Lmax, Hkv, G, fs, out.data_ptr<float>(),
                      lse.data_ptr<float>());
    else
      cascade_bf16<8>(qp, kp, vp, mp, gp, rp, lp, NG, Lmax, Hkv, G, fs, out.data_ptr<float>(),
                      lse.data_ptr<float>());
  });
#endif
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("extend_attention_supported", &radixserve::extend_attention_supported);
  m.def("extend_attention_amx", &radixserve::extend_attention_amx);
  m.def("set_attention_amx", &radixserve::set_attention_amx);
  m.def("extend_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, float scale) -> Tensor");
  m.def(
      "cascade_prefix_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor members, "
      "Tensor group_start, Tensor prefix_rows, Tensor prefix_lens, Tensor(a!) out, "
      "Tensor(b!) lse, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("extend_attention", &radixserve::extend_attention);
  m.impl("cascade_prefix_attention", &radixserve::cascade_prefix_attention);
}
