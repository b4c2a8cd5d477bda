// The LoRA adapters' deltas of a decode step in one call, whatever adapters its rows use
// (punica's BGMV: each row gathers its own adapter's matrices), for lora/manager.py.
//
// lora_delta(y [n, out], x [n, in], a [G] of [R_g, in], b [G] of [C, R_g, 64], slots [n] int64)
//     -> ()
//   For each row r with slots[r] = g >= 0: y[r] += (x[r] a[g]ᵀ) B[g], in place. a[g] is the
//   adapter's A ([R_g, in]: the fused parts' A stacked); B[g] ([R_g, out]) its scaled,
//   block-diagonal Bᵀ, stored in C = ceil(out / 64) column tiles, b[g][c] = B[g][:, 64c ..
//   64c + 64) (zeros past `out`), so that each tile is one contiguous read. An empty a[g] (the
//   adapter leaves this projection alone) or slots[r] = -1 (a base-model row) adds nothing.
//   x, y, a and b share one dtype (fp32, bf16 or fp16); both products accumulate in fp32 and y
//   is rounded once, y[r, j] = T(y[r, j] + Σ_w ...). bf16 on CPUs with AVX512-BF16 differs
//   (lora_delta_pairs(): vdpbf16ps, below): the first product's results are rounded to bf16,
//   and a rank must be even, B's tiles holding ranks in pairs.
//
// Why: a decode step's rows are few (≤ lora/manager.py's KERNEL_ROWS), and the ATen route of a
// step with G adapters is, per projection, G times a gather, two products and a scatter-add:
// at one row 120 projections × 5 calls for SmolLM2-135M, mostly per-call cost, growing with G.
// Here it is one call per projection for any G, reading each adapter's matrices once per block
// of four of its rows. The threads share one parallel region: each takes a share of the first
// product's ranks, then (after a barrier) a share of the output tiles; a call with little work
// runs on one thread. The sums run in a fixed order per build, whatever the other rows of the
// call (the C++ decode step and the Python layers call this same function: bitwise the same).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec_math.h"

namespace {

constexpr int64_t kGrainMacs = 1 << 12;  // multiply-adds worth waking another thread for
constexpr int64_t kRowBlock = 4;         // rows of one adapter that share each weight load
constexpr int64_t kRankBlock = 4;        // ranks of the first product per pass over x
constexpr int64_t kTile = 64;            // output columns per tile of B (lora/manager.py's)

// Rows of one adapter, consecutive in `rows` (sorted by adapter), at most kRowBlock.
struct RowBlock {
  int64_t first, count, group;
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
using radixserve_vec::first;
using radixserve_vec::load16;
using radixserve_vec::store16;

// Both block functions take the block's row count as a template argument and run their loops
// with fixed bounds, fully unrolled, so that the accumulators stay in registers (a short rank
// block repeats its last rank and keeps only its own results).

// The masks of a tile's four vectors for its first `width` columns.
constexpr int64_t kVecs = kTile / 16;
inline void tile_masks(int64_t width, __mmask16* mask) {
  for (int64_t c = 0; c < kVecs; ++c) mask[c] = width > 16 * c ? first(width - 16 * c) : 0;
}

// y[rows of the block, j0 ..] += acc (rounded once to y's dtype), the masked columns only.
template <int64_t kRows, typename T>
inline void add_to_rows(const __m512 (&acc)[kRows][kVecs], const __mmask16* mask,
                        const RowBlock& rb, const int64_t* rows, int64_t j0, T* y, int64_t ys) {
#pragma GCC unroll 4
  for (int64_t i = 0; i < kRows; ++i) {
    T* yr = y + rows[rb.first + i] * ys + j0;
#pragma GCC unroll 4
    for (int64_t c = 0; c < kVecs; ++c)
      store16(yr + 16 * c, _mm512_add_ps(load16(yr + 16 * c, mask[c]), acc[i][c]), mask[c]);
  }
}

// xa[i, w0 + w] = xf[i] · a[w] over `in`, for the block's rows i and w < nw; `next` (or null):
// the rows to prefetch meanwhile.
template <int64_t kRows, typename T>
void shrink_rows(const float* xf, int64_t in, const T* a, const RowBlock& rb, int64_t w0,
                 int64_t nw, float* xa, int64_t xa_stride, const T* next) {
  const T* ar[kRankBlock];
  for (int64_t w = 0; w < kRankBlock; ++w) ar[w] = a + std::min(w, nw - 1) * in;
  const float* xr = xf + rb.first * in;
  __m512 acc[kRows][kRankBlock];
#pragma GCC unroll 16
  for (int64_t e = 0; e < kRows * kRankBlock; ++e)
    acc[e / kRankBlock][e % kRankBlock] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; k += 16) {
    const __mmask16 mask = first(in - k);
    __m512 av[kRankBlock];
#pragma GCC unroll 4
    for (int64_t w = 0; w < kRankBlock; ++w) av[w] = load16(ar[w] + k, mask);
    if (next != nullptr) {
#pragma GCC unroll 4
      for (int64_t w = 0; w < kRankBlock; ++w) __builtin_prefetch(next + w * in + k, 0, 3);
    }
#pragma GCC unroll 4
    for (int64_t i = 0; i < kRows; ++i) {
      const __m512 xv = load16(xr + i * in + k, mask);
#pragma GCC unroll 4
      for (int64_t w = 0; w < kRankBlock; ++w) acc[i][w] = _mm512_fmadd_ps(xv, av[w], acc[i][w]);
    }
  }
#pragma GCC unroll 4
  for (int64_t i = 0; i < kRows; ++i) {
#pragma GCC unroll 4
    for (int64_t w = 0; w < kRankBlock; ++w) {
      if (w < nw) xa[(rb.first + i) * xa_stride + w0 + w] = _mm512_reduce_add_ps(acc[i][w]);
    }
  }
}

// y[rows, j0 .. j0 + width) += xa[rows] · tile for the block's rows; tile [rank, kTile];
// `next` (or null): the tile to prefetch meanwhile.
template <int64_t kRows, typename T>
void expand_rows(const float* xa, int64_t xa_stride, const T* tile, int64_t rank,
                 const RowBlock& rb, const int64_t* rows, int64_t j0, int64_t width, T* y,
                 int64_t ys, const T* next) {
  __mmask16 mask[kVecs];
  tile_masks(width, mask);
  const float* xr = xa + rb.first * xa_stride;
  __m512 acc[kRows][kVecs];
#pragma GCC unroll 16
  for (int64_t e = 0; e < kRows * kVecs; ++e) acc[e / kVecs][e % kVecs] = _mm512_setzero_ps();
  for (int64_t w = 0; w < rank; ++w) {
    if (next != nullptr) {
      const char* line = reinterpret_cast<const char*>(next + w * kTile);
      for (size_t off = 0; off < kTile * sizeof(T); off += 64) __builtin_prefetch(line + off, 0, 3);
    }
    __m512 bv[kVecs];
#pragma GCC unroll 4
    for (int64_t c = 0; c < kVecs; ++c) bv[c] = load16(tile + w * kTile + 16 * c);
#pragma GCC unroll 4
    for (int64_t i = 0; i < kRows; ++i) {
      const __m512 v = _mm512_set1_ps(xr[i * xa_stride + w]);
#pragma GCC unroll 4
      for (int64_t c = 0; c < kVecs; ++c) acc[i][c] = _mm512_fmadd_ps(v, bv[c], acc[i][c]);
    }
  }
  add_to_rows<kRows>(acc, mask, rb, rows, j0, y, ys);
}

template <typename T>
void shrink_block(const float* xf, int64_t in, const T* a, const RowBlock& rb, int64_t w0,
                  int64_t nw, float* xa, int64_t xa_stride, const T* next) {
  switch (rb.count) {
    case 1: return shrink_rows<1>(xf, in, a, rb, w0, nw, xa, xa_stride, next);
    case 2: return shrink_rows<2>(xf, in, a, rb, w0, nw, xa, xa_stride, next);
    case 3: return shrink_rows<3>(xf, in, a, rb, w0, nw, xa, xa_stride, next);
    default: return shrink_rows<kRowBlock>(xf, in, a, rb, w0, nw, xa, xa_stride, next);
  }
}

template <typename T>
void expand_block(const float* xa, int64_t xa_stride, const T* tile, int64_t rank,
                  const RowBlock& rb, const int64_t* rows, int64_t j0, int64_t width, T* y,
                  int64_t ys, const T* next) {
  switch (rb.count) {
    case 1: return expand_rows<1>(xa, xa_stride, tile, rank, rb, rows, j0, width, y, ys, next);
    case 2: return expand_rows<2>(xa, xa_stride, tile, rank, rb, rows, j0, width, y, ys, next);
    case 3: return expand_rows<3>(xa, xa_stride, tile, rank, rb, rows, j0, width, y, ys, next);
    default:
      return expand_rows<kRowBlock>(xa, xa_stride, tile, rank, rb, rows, j0, width, y, ys, next);
  }
}

#if defined(__AVX512BF16__)
#define RADIXSERVE_LORA_PAIRS 1
// bf16 adapters on AVX512-BF16 (vdpbf16ps: 32 products a call, two per fp32 lane). The first
// product reads x's and A's bf16 rows as they are; its results are rounded to bf16 (as a bf16
// GEMM's output would be: lora/manager.py's bf16 products round there too) and the
// second takes them in pairs of ranks against B stored as pairs: a tile [R / 2, kTile, 2]
// (R even), so one load holds ranks w and w + 1 of 16 columns.

// xa[i, w0 + w] = bf16(x[i] · a[w]) for the block's rows (xr: their bf16 rows) and w < nw.
template <int64_t kRows>
void shrink_pairs(const c10::BFloat16* const* xr, int64_t in, const c10::BFloat16* a,
                  int64_t first_row, int64_t w0, int64_t nw, uint16_t* xa, int64_t xa_stride,
                  const c10::BFloat16* next) {
  const c10::BFloat16* ar[kRankBlock];
  for (int64_t w = 0; w < kRankBlock; ++w) ar[w] = a + std::min(w, nw - 1) * in;
  __m512 acc[kRows][kRankBlock];
#pragma GCC unroll 16
  for (int64_t e = 0; e < kRows * kRankBlock; ++e)
    acc[e / kRankBlock][e % kRankBlock] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; k += 32) {
    const __mmask32 mask = in - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (in - k)) - 1;
    __m512bh av[kRankBlock];
#pragma GCC unroll 4
    for (int64_t w = 0; w < kRankBlock; ++w)
      av[w] = (__m512bh)_mm512_maskz_loadu_epi16(mask, ar[w] + k);
    if (next != nullptr) {
#pragma GCC unroll 4
      for (int64_t w = 0; w < kRankBlock; ++w) __builtin_prefetch(next + w * in + k, 0, 3);
    }
#pragma GCC unroll 4
    for (int64_t i = 0; i < kRows; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xr[i] + k);
#pragma GCC unroll 4
      for (int64_t w = 0; w < kRankBlock; ++w) acc[i][w] = _mm512_dpbf16_ps(acc[i][w], xv, av[w]);
    }
  }
#pragma GCC unroll 4
  for (int64_t i = 0; i < kRows; ++i) {
#pragma GCC unroll 4
    for (int64_t w = 0; w < kRankBlock; ++w) {
      if (w < nw)
        xa[(first_row + i) * xa_stride + w0 + w] =
            c10::BFloat16(_mm512_reduce_add_ps(acc[i][w])).x;
    }
  }
}

// y[rows, j0 .. j0 + width) += xa[rows] · tile for the block's rows (tile: pairs, rank even).
template <int64_t kRows>
void expand_pairs(const uint16_t* xa, int64_t xa_stride, const c10::BFloat16* tile, int64_t rank,
                  const RowBlock& rb, const int64_t* rows, int64_t j0, int64_t width,
                  c10::BFloat16* y, int64_t ys, const c10::BFloat16* next) {
  __mmask16 mask[kVecs];
  tile_masks(width, mask);
  const uint16_t* xr = xa + rb.first * xa_stride;
  __m512 acc[kRows][kVecs];
#pragma GCC unroll 16
  for (int64_t e = 0; e < kRows * kVecs; ++e) acc[e / kVecs][e % kVecs] = _mm512_setzero_ps();
  for (int64_t p = 0; p < rank / 2; ++p) {
    const c10::BFloat16* tp = tile + p * 2 * kTile;
    if (next != nullptr) {
      const char* line = reinterpret_cast<const char*>(next + p * 2 * kTile);
      for (int64_t off = 0; off < 2 * kTile * 2; off += 64) __builtin_prefetch(line + off, 0, 3);
    }
    __m512bh bv[kVecs];
#pragma GCC unroll 4
    for (int64_t c = 0; c < kVecs; ++c) bv[c] = (__m512bh)_mm512_loadu_si512(tp + 32 * c);
#pragma GCC unroll 4
    for (int64_t i = 0; i < kRows; ++i) {
      uint32_t pair;
      std::memcpy(&pair, xr + i * xa_stride + 2 * p, sizeof(pair));
      const __m512bh v = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 4
      for (int64_t c = 0; c < kVecs; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], bv[c], v);
    }
  }
  add_to_rows<kRows>(acc, mask, rb, rows, j0, y, ys);
}


void shrink_pairs_block(const c10::BFloat16* x, int64_t xs, const int64_t* rows, int64_t in,
                        const c10::BFloat16* a, const RowBlock& rb, int64_t w0, int64_t nw,
                        uint16_t* xa, int64_t xa_stride, const c10::BFloat16* next) {
  const c10::BFloat16* xr[kRowBlock];
  for (int64_t i = 0; i < rb.count; ++i) xr[i] = x + rows[rb.first + i] * xs;
  switch (rb.count) {
    case 1: return shrink_pairs<1>(xr, in, a, rb.first, w0, nw, xa, xa_stride, next);
    case 2: return shrink_pairs<2>(xr, in, a, rb.first, w0, nw, xa, xa_stride, next);
    case 3: return shrink_pairs<3>(xr, in, a, rb.first, w0, nw, xa, xa_stride, next);
    default: return shrink_pairs<kRowBlock>(xr, in, a, rb.first, w0, nw, xa, xa_stride, next);
  }
}

void expand_pairs_block(const uint16_t* xa, int64_t xa_stride, const c10::BFloat16* tile,
                        int64_t rank, const RowBlock& rb, const int64_t* rows, int64_t j0,
                        int64_t width, c10::BFloat16* y, int64_t ys, const c10::BFloat16* next) {
  switch (rb.count) {
    case 1: return expand_pairs<1>(xa, xa_stride, tile, rank, rb, rows, j0, width, y, ys, next);
    case 2: return expand_pairs<2>(xa, xa_stride, tile, rank, rb, rows, j0, width, y, ys, next);
    case 3: return expand_pairs<3>(xa, xa_stride, tile, rank, rb, rows, j0, width, y, ys, next);
    default:
      return expand_pairs<kRowBlock>(xa, xa_stride, tile, rank, rb, rows, j0, width, y, ys,
                                     next);
  }
}
#endif  // __AVX512BF16__
#else
template <typename T>
void shrink_block(const float* xf, int64_t in, const T* a, const RowBlock& rb, int64_t w0,
                  int64_t nw, float* xa, int64_t xa_stride, const T* /*next*/) {
  for (int64_t i = 0; i < rb.count; ++i) {
    const float* xi = xf + (rb.first + i) * in;
    for (int64_t w = 0; w < nw; ++w) {
      const T* aw = a + w * in;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < in; ++k) s += xi[k] * static_cast<float>(aw[k]);
      xa[(rb.first + i) * xa_stride + w0 + w] = s;
    }
  }
}

template <typename T>
void expand_block(const float* xa, int64_t xa_stride, const T* tile, int64_t rank,
                  const RowBlock& rb, const int64_t* rows, int64_t j0, int64_t width, T* y,
                  int64_t ys, const T* /*next*/) {
  float acc[kTile];
  for (int64_t i = 0; i < rb.count; ++i) {
    std::fill(acc, acc + kTile, 0.f);
    for (int64_t w = 0; w < rank; ++w) {
      const float v = xa[(rb.first + i) * xa_stride + w];
      const T* bw = tile + w * kTile;
#pragma omp simd
      for (int64_t j = 0; j < kTile; ++j) acc[j] += v * static_cast<float>(bw[j]);
    }
    T* yr = y + rows[rb.first + i] * ys + j0;
    for (int64_t j = 0; j < width; ++j) yr[j] = static_cast<T>(static_cast<float>(yr[j]) + acc[j]);
  }
}
#endif

template <typename T>
void lora_delta_impl(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& a,
                     const std::vector<at::Tensor>& b, const int64_t* slots) {
  const int64_t n = x.size(0), in = x.size(1), out = y.size(1);
  const int64_t xs = x.stride(0), ys = y.stride(0);
  const int64_t groups = static_cast<int64_t>(a.size());
  std::vector<const T*> ap(groups, nullptr), bp(groups, nullptr);
  std::vector<int64_t> rank(groups, 0);
  int64_t max_rank = 0;
  for (int64_t g = 0; g < groups; ++g) {
    if (a[g].numel() == 0) continue;
    ap[g] = a[g].data_ptr<T>();
    bp[g] = b[g].data_ptr<T>();
    rank[g] = a[g].size(0);
    max_rank = std::max(max_rank, rank[g]);
  }
  // The rows that take a delta here, by adapter, cut into blocks of one adapter's rows.
  std::vector<int64_t> rows;
  int64_t macs = 0;
  for (int64_t g = 0; g < groups; ++g) {
    if (ap[g] == nullptr) continue;
    for (int64_t r = 0; r < n; ++r) {
      if (slots[r] != g) continue;
      rows.push_back(r);
      macs += rank[g] * (in + out);
    }
  }
  if (rows.empty()) return;
  const int64_t m = static_cast<int64_t>(rows.size());
  std::vector<RowBlock> blocks;
  for (int64_t i = 0; i < m;) {
    const int64_t g = slots[rows[i]];
    int64_t count = 1;
    while (count < kRowBlock && i + count < m && slots[rows[i + count]] == g) ++count;
    blocks.push_back({i, count, g});
    i += count;
  }
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t rank_blocks = (max_rank + kRankBlock - 1) / kRankBlock;
  const int64_t tiles = (out + kTile - 1) / kTile;
#if defined(RADIXSERVE_LORA_PAIRS)
  constexpr bool kPaired = std::is_same_v<T, c10::BFloat16>;
#else
  constexpr bool kPaired = false;
#endif
  // The first product's results: fp32, or bf16 for the pairs; and x's rows in fp32 (in `rows`
  // order) where the first product takes fp32.
  std::vector<float> xf(kPaired ? 0 : m * in), xa(kPaired ? 0 : m * max_rank, 0.f);
  std::vector<uint16_t> xa16(kPaired ? m * max_rank : 0, 0);
  if constexpr (!kPaired) {
    for (int64_t i = 0; i < m; ++i) {
      const T* src = xp + rows[i] * xs;
      float* dst = xf.data() + i * in;
#pragma omp simd
      for (int64_t k = 0; k < in; ++k) dst[k] = static_cast<float>(src[k]);
    }
  }

  // Thread `tid` of `nt`: its share of the rank blocks, a barrier, its share of the tiles.
  auto work = [&](int64_t tid, int64_t nt, auto&& barrier) {
    // (each block prefetches the adapter's next block of this thread while it computes)
    const int64_t t_end = rank_blocks * (tid + 1) / nt;
    const int64_t c_begin = tiles * tid / nt, c_end = tiles * (tid + 1) / nt;
    for (int64_t g = 0; g < groups; ++g) {  // this thread's tiles of B, for after the barrier
      if (bp[g] == nullptr) continue;
      const char* p = reinterpret_cast<const char*>(bp[g] + c_begin * rank[g] * kTile);
      const int64_t bytes = (c_end - c_begin) * rank[g] * kTile * static_cast<int64_t>(sizeof(T));
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
    }
    for (int64_t t = rank_blocks * tid / nt; t < t_end; ++t) {
      const int64_t w0 = t * kRankBlock;
      for (const RowBlock& rb : blocks) {
        const int64_t nw = std::min(kRankBlock, rank[rb.group] - w0);
        if (nw <= 0) continue;
        const T* a_block = ap[rb.group] + w0 * in;
        const T* a_next =
            t + 1 < t_end && w0 + 2 * kRankBlock <= rank[rb.group] ? a_block + kRankBlock * in
                                                                   : nullptr;
#if defined(RADIXSERVE_LORA_PAIRS)
        if constexpr (kPaired) {
          shrink_pairs_block(xp, xs, rows.data(), in, a_block, rb, w0, nw, xa16.data(), max_rank,
                             a_next);
          continue;
        }
#endif
        if constexpr (!kPaired)
          shrink_block(xf.data(), in, a_block, rb, w0, nw, xa.data(), max_rank, a_next);
      }
    }
    barrier();
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int64_t j0 = c * kTile, width = std::min(kTile, out - j0);
      for (const RowBlock& rb : blocks) {
        const int64_t tile_size = rank[rb.group] * kTile;
        const T* tile = bp[rb.group] + c * tile_size;
        const T* next = c + 1 < c_end ? tile + tile_size : nullptr;
#if defined(RADIXSERVE_LORA_PAIRS)
        if constexpr (kPaired) {
          expand_pairs_block(xa16.data(), max_rank, tile, rank[rb.group], rb, rows.data(), j0,
                             width, yp, ys, next);
          continue;
        }
#endif
        if constexpr (!kPaired)
          expand_block(xa.data(), max_rank, tile, rank[rb.group], rb, rows.data(), j0, width, yp,
                       ys, next);
      }
    }
  };
  int64_t threads = 1;
#ifdef _OPENMP
  if (!at::in_parallel_region()) {
    threads = std::min<int64_t>({at::get_num_threads(), std::max<int64_t>(1, macs / kGrainMacs),
                                 std::max(rank_blocks, tiles)});
  }
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    work(omp_get_thread_num(), omp_get_num_threads(), [] {
#pragma omp barrier
    });
    return;
  }
#endif
  work(0, 1, [] {});
}

}  // namespace

namespace radixserve {

bool lora_delta_pairs() {
#if defined(RADIXSERVE_LORA_PAIRS)
  return true;
#else
  return false;
#endif
}

void lora_delta(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& a,
                const std::vector<at::Tensor>& b, const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0),
              "lora_delta: x [n, in] and y [n, out]");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "lora_delta: x and y need unit column stride");
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "lora_delta: x and y in one dtype");
  TORCH_CHECK(a.size() == b.size(), "lora_delta: one b per a");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == x.size(0),
              "lora_delta: slots [n] int64");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < slots.numel(); ++r) {
    TORCH_CHECK(sp[r] >= -1 && sp[r] < static_cast<int64_t>(a.size()),
                "lora_delta: a slot out of range");
  }
  const int64_t tiles = (y.size(1) + kTile - 1) / kTile;
  for (size_t g = 0; g < a.size(); ++g) {
    if (a[g].numel() == 0) continue;
    TORCH_CHECK(a[g].is_contiguous() && b[g].is_contiguous() && a[g].dim() == 2 &&
                    b[g].dim() == 3 && a[g].size(1) == x.size(1) && b[g].size(0) == tiles &&
                    b[g].size(1) == a[g].size(0) && b[g].size(2) == kTile,
                "lora_delta: a[g] [R, in] and b[g] [ceil(out / 64), R, 64], contiguous");
    TORCH_CHECK(a[g].scalar_type() == x.scalar_type() && b[g].scalar_type() == x.scalar_type(),
                "lora_delta: the adapter's matrices in x's dtype");
    TORCH_CHECK(!(lora_delta_pairs() && x.scalar_type() == at::kBFloat16) || a[g].size(0) % 2 == 0,
                "lora_delta: bf16 adapters in pairs of ranks (an even rank, B's tiles as pairs)");
  }
  switch (x.scalar_type()) {
    case at::kFloat:
      return lora_delta_impl<float>(y, x, a, b, sp);
    case at::kBFloat16:
      return lora_delta_impl<c10::BFloat16>(y, x, a, b, sp);
    case at::kHalf:
      return lora_delta_impl<c10::Half>(y, x, a, b, sp);
    default:
      TORCH_CHECK(false, "lora_delta: fp32, bf16 or fp16, not ", x.scalar_type());
  }
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, lib) {
  lib.def("lora_delta(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] b, Tensor slots) -> ()");
  lib.def("lora_delta_pairs", &radixserve::lora_delta_pairs);
}

TORCH_LIBRARY_IMPL(radixserve, CPU, lib) { lib.impl("lora_delta", &radixserve::lora_delta); }
