// bf16 linear layers on AVX512-BF16 (`vdpbf16ps`), or on AMX's tile unit where the CPU has it:
// one kernel for every row count, from a decode step's one row to a prefill's thousands.
//
// oneDNN's bf16 product through torch (a prepacked weight, mkldnn::_linear_pointwise) reads a
// decode step's weights at 24-30 GB/s at one row, where a plain sum of the same bytes reads
// 40-45 on two Zen 4 cores. The weight here is stored in tiles of 16 outputs (layers/
// linear.py's bf16_tiles), so that one vector load brings two adjacent inputs of each of 16
// outputs and one broadcast pair of activations multiplies them: a register-blocked GEMM of
// up to 4 rows by 4 tiles (16 accumulators; at one or two rows, 12 or 8 tiles). At few rows
// the tiles stream from memory once per call; at many, each thread's tiles multiply blocks of
// 256 rows, re-read from L2.
// SmolLM2-135M's 30 layers (2 Zen 4 threads, distinct weights, paired with oneDNN's prepacked
// product): 1.35x its rate at 1 row (the weights read at ≈ 42 GB/s), 1.27x at 8, 1.13x at
// 32-64, 1.02-1.05x from 256 rows (≈ 790 GFLOP/s at 1,024).
//
//   bf16_tiled_linear(x [M, K] bf16, wt [N/16, K/2, 32] bf16, bias [N] bf16 or None) -> [M, N]
//     bf16: wt's tile t, pair p, lane 2i + j holds weight[16 t + i, 2 p + j]; each output is
//     its bias (if any) plus its K products summed in fp32 in one fixed order (pairs in turn,
//     vdpbf16ps's two products per pair; with AMX and K a multiple of 32, the tile unit's
//     order over 32 products at a time, the bias added last), then rounded to nearest even. A
//     row's result does not depend on the other rows or their number.
//   bf16_tiled_silu_mul(x, wt) -> [M, N/2]: wt an MLP's [gate; up] weight in tiles; the
//     result silu_and_mul's (fused_ops.cpp) of the product, bitwise: silu(gate) * up with the
//     bf16 roundings silu_and_mul finds between the steps.
//   bf16_tiled_linear_lora(x, wt, bias, xa [M, RA] bf16, slots [M] int64, bt [G] of
//     [N/16, R_g/2, 32] bf16 or empty) and bf16_tiled_silu_mul_lora(x, wt, xa, slots, bt):
//     LoRA adapters' deltas inside the product. Row i of adapter g = slots[i] (-1: none) adds
//     xa[i, :R_g] times B_g (bt[g]: B_g [R_g, N], scaling included, in the weight's tile
//     layout, R_g a multiple of 32) into the same fp32 sums before the one rounding (and the
//     SiLU), so y is never re-read to add a delta. xa: bf16_tiled_lora_shrink's.
//   bf16_tiled_lora_shrink(x [M, K] bf16, a [G] of [R_g/16, K/2, 32] bf16 or empty, slots)
//     -> xa [M, max(32, R_g)] bf16: row i's x times A_g^T (A_g [R_g, K] in tiles), rounded
//     to bf16, zeros elsewhere.
//   bf16_tiled_supported() says whether this build has them; bf16_tiled_amx() whether their
//     products run on AMX here (this build has it and Linux granted the tile state).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define RADIXSERVE_BF16_TILES 1
#include <immintrin.h>

#include "vec_math.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RADIXSERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace {

#if defined(RADIXSERVE_BF16_TILES)
using radixserve_vec::round16;
using radixserve_vec::silu16;
using radixserve_vec::store16;
#endif

constexpr int64_t kTile = 16;  // outputs per tile, the 16 lanes of a vector
constexpr int kRows = 4;       // activation rows per pass
constexpr int kTilesMax = 4;   // tiles per pass: 16 accumulators at 4 rows
// At one or two rows a pass reads more tiles at once (12 and 8: 12 or 16 accumulators, with
// the tiles' vectors 24 registers), so that more of the weight's streams are in flight: a
// decode step of one row is bound by reading the weights (SmolLM2-135M's 30 layers at one row,
// paired: 1.02-1.2x from 4 tiles to 12, the fused MLP's gate and up from 4 to 12 streams, the
// gain smaller while the machine's memory is busy; a whole decode step 1.0-1.08x).
constexpr int kTilesOneRow = 12;
constexpr int kTilesTwoRows = 8;
constexpr int64_t kRowBlock = 256;  // rows whose activations a thread's tiles multiply in turn

#if defined(RADIXSERVE_BF16_TILES)
constexpr bool kTiles = true;

// LoRA adapters' second products joined to a tiled product (bf16_tiled_linear_lora): row i
// adds xa[i, :R_g] times B_g, g = slots[i] (nothing where g is -1 or b[g] is null), into the
// accumulators of its base product, before the one rounding. B_g is [R_g, N] in the weight's
// tile layout ([N/16, R_g/2, 32]: tile t's pairs of ranks at b[g] + t * kp[g] * 32).
struct LoraExpand {
  const uint16_t* xa = nullptr;  // [M, ra] bf16: each row's first products (lora_shrink's)
  int64_t ra = 0;
  const int64_t* slots = nullptr;
  std::vector<const uint16_t*> b;  // per group: B's tiles, or null (the projection's own)
  std::vector<int64_t> kp;         // per group: R_g / 2
  int64_t up = 0;                  // silu_mul: tiles from a gate tile to its up tile
};

// One pass: rows r .. r + R - 1 (x: their activations as pairs, xs pairs apart) times C
// adjacent tiles (w: the first; ts elements from one to the next), KP pairs; y gets the
// R x 16C results, its rows ys apart. kSiluMul: the C tiles are gate tiles, each with its up
// tile `up` elements further, and y gets silu(gate) * up (R x 16C).
// kLora: rows row0 .. row0 + R - 1 add their adapters' products (lora; the pass's first tile
// is tile t0 of the weight).
template <int R, int C, bool kSiluMul, bool kLora = false>
__attribute__((noinline)) void tile_pass(const uint16_t* w, int64_t ts, int64_t up,
                                         const uint32_t* x, int64_t xs, int64_t KP,
                                         const float* bias, at::BFloat16* y, int64_t ys,
                                         const LoraExpand* lora = nullptr, int64_t row0 = 0,
                                         int64_t t0 = 0) {
  constexpr int W = kSiluMul ? 2 * C : C;  // weight tiles the pass reads
  __m512 acc[R][W];
  for (int c = 0; c < W; ++c) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + c * kTile) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][c] = b;
  }
  const uint16_t* wc[W];
  for (int c = 0; c < C; ++c) {
    wc[c] = w + c * ts;
    if constexpr (kSiluMul) wc[C + c] = w + c * ts + up;
  }
  for (int64_t p = 0; p < KP; ++p) {
    __m512bh wv[W];
    for (int c = 0; c < W; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(wc[c] + p * 2 * kTile);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * xs + p]));
      for (int c = 0; c < W; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], a);
    }
  }
  if constexpr (kLora) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t g = lora->slots[row0 + r];
      if (g < 0 || lora->b[g] == nullptr) continue;
      const int64_t kp = lora->kp[g];
      const uint16_t* bc[W];
      for (int c = 0; c < W; ++c) {
        bc[c] = lora->b[g] + (t0 + (c < C ? c : c - C + lora->up)) * kp * 2 * kTile;
      }
      const uint32_t* xr = reinterpret_cast<const uint32_t*>(lora->xa + (row0 + r) * lora->ra);
      for (int64_t p = 0; p < kp; ++p) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[p]));
#pragma GCC unroll 8
        for (int c = 0; c < W; ++c) {
          const __m512bh bv = (__m512bh)_mm512_loadu_si512(bc[c] + p * 2 * kTile);
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], bv, a);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      if constexpr (kSiluMul) {
        // silu_and_mul on the bf16 product: silu(gate) rounded to bf16, times up, rounded.
        const __m512 silu = round16<at::BFloat16>(silu16(round16<at::BFloat16>(acc[r][c])));
        const __m512 upv = round16<at::BFloat16>(acc[r][C + c]);
        store16(y + r * ys + c * kTile, _mm512_mul_ps(silu, upv));
      } else {
        store16(y + r * ys + c * kTile, acc[r][c]);
      }
    }
  }
}

// One pass of R rows over `count` (1 .. CMax) tiles: tile_pass<R, count>.
template <int R, int CMax, bool kSiluMul>
void pass_of(int64_t count, const uint16_t* w, int64_t ts, int64_t up, const uint32_t* x,
             int64_t KP, const float* bias, at::BFloat16* y, int64_t ys) {
  if constexpr (CMax > 0) {
    if (count == CMax) return tile_pass<R, CMax, kSiluMul>(w, ts, up, x, KP, KP, bias, y, ys);
    pass_of<R, CMax - 1, kSiluMul>(count, w, ts, up, x, KP, bias, y, ys);
  }
}

// Every row of C tiles: passes of kRows rows, then one of the rows left (lora: the rows are
// rows row0 .. row0 + M - 1 of the product, the first tile tile t0).
template <int C, bool kSiluMul, bool kLora>
void tile_rows_of(const uint16_t* w, int64_t ts, int64_t up, const uint32_t* x, int64_t M,
                  int64_t KP, const float* bias, at::BFloat16* y, int64_t ys,
                  const LoraExpand* lora, int64_t row0, int64_t t0) {
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows) {
    tile_pass<kRows, C, kSiluMul, kLora>(w, ts, up, x + r * KP, KP, KP, bias, y + r * ys, ys,
                                         lora, row0 + r, t0);
  }
  const uint32_t* xr = x + r * KP;
  at::BFloat16* yr = y + r * ys;
  const int64_t rr = row0 + r;
  switch (M - r) {
    case 3:
      tile_pass<3, C, kSiluMul, kLora>(w, ts, up, xr, KP, KP, bias, yr, ys, lora, rr, t0);
      break;
    case 2:
      tile_pass<2, C, kSiluMul, kLora>(w, ts, up, xr, KP, KP, bias, yr, ys, lora, rr, t0);
      break;
    case 1:
      tile_pass<1, C, kSiluMul, kLora>(w, ts, up, xr, KP, KP, bias, yr, ys, lora, rr, t0);
      break;
    default:
      break;
  }
}

template <int C, bool kSiluMul>
void tile_rows(const uint16_t* w, int64_t ts, int64_t up, const uint32_t* x, int64_t M,
               int64_t KP, const float* bias, at::BFloat16* y, int64_t ys,
               const LoraExpand* lora = nullptr, int64_t row0 = 0, int64_t t0 = 0) {
  if (lora != nullptr) {
    tile_rows_of<C, kSiluMul, true>(w, ts, up, x, M, KP, bias, y, ys, lora, row0, t0);
  } else {
    tile_rows_of<C, kSiluMul, false>(w, ts, up, x, M, KP, bias, y, ys, nullptr, 0, 0);
  }
}

#if defined(RADIXSERVE_AMX)
// On a CPU with AMX the same tiles feed the tile unit: a tile's 16 pairs of K by 16 outputs
// (1 KB, 64 bytes a pair) is exactly the B operand `tdpbf16ps` reads, and 32 activations of
// up to 16 rows its A operand. One step multiplies up to 32 rows (two A tiles) by two weight
// tiles (linear: adjacent tiles; silu_mul: a gate tile and its up tile) into four fp32
// accumulator tiles, over K in chunks of 32. The products' sum order is the tile unit's, not
// vdpbf16ps's; like it, a row's result depends on that row alone, since every row count runs
// here.

// Linux lends a process the tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); where it refuses, the vdpbf16ps kernel runs.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: accumulators (rows tile a, weight tile c: 2a + c), 4-5: activations of rows
// 0-15 and 16-31, 6-7: the two weight tiles. rows1 == 0: one activation tile.
void configure_tiles(int rows0, int rows1) {
  TileConfig cfg;
  for (int a = 0; a < 2; ++a) {
    const int r = a ? rows1 : rows0;
    cfg.rows[2 * a] = cfg.rows[2 * a + 1] = cfg.rows[4 + a] = static_cast<uint8_t>(r);
    cfg.colsb[2 * a] = cfg.colsb[2 * a + 1] = cfg.colsb[4 + a] = r ? 64 : 0;
  }
  cfg.rows[6] = cfg.rows[7] = 16;
  cfg.colsb[6] = cfg.colsb[7] = 64;
  _tile_loadconfig(&cfg);
}

// The accumulators += rows 0 .. 16 + (kTwo ? 16 : 0) of x (K bf16 a row) times the weight
// tiles at w0 (columns 0-15) and w1 (columns 16-31), KP pairs (a multiple of 16).
template <bool kTwo>
inline void amx_products(const uint16_t* x, int64_t K, const uint16_t* w0, const uint16_t* w1,
                         int64_t KP) {
  const int64_t xstride = K * 2;
  for (int64_t p = 0; p < KP; p += 16) {
    _tile_loadd(6, w0 + p * 2 * kTile, 64);
    _tile_loadd(4, x + 2 * p, xstride);
    _tile_loadd(7, w1 + p * 2 * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwo) {
      _tile_loadd(5, x + 16 * K + 2 * p, xstride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// An adapter's second product for up to 32 rows of a step (amx_step): its rows' first products
// (xa, `stride` elements a row; the other rows' zeros) and its B in the weight's tile layout.
struct LoraOperand {
  const uint16_t* xa;
  int64_t stride;
  const uint16_t* b;
  int64_t kp;  // pairs of ranks: a multiple of 16
};

// c [32, 32] fp32 = rows 0 .. 16 + (kTwo ? 16 : 0) of x (K bf16 a row) times the weight tiles
// t0 (at w0: columns 0-15) and t1 (w1: columns 16-31), KP pairs (a multiple of 16); plus, for
// each of the `count` adapter operands, its rows' first products times its B's tiles t0, t1.
template <bool kTwo>
void amx_step(const uint16_t* x, int64_t K, const uint16_t* w0, const uint16_t* w1, int64_t KP,
              float* c, const LoraOperand* lora = nullptr, int count = 0, int64_t t0 = 0,
              int64_t t1 = 0) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwo) {
    _tile_zero(2);
    _tile_zero(3);
  }
  amx_products<kTwo>(x, K, w0, w1, KP);
  for (int i = 0; i < count; ++i) {
    const LoraOperand& o = lora[i];
    const int64_t ts = o.kp * 2 * kTile;
    amx_products<kTwo>(o.xa, o.stride, o.b + t0 * ts, o.b + t1 * ts, o.kp);
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + kTile, 128);
  if constexpr (kTwo) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + kTile, 128);
  }
}

// A thread's adapter operands for the 32-row groups of one block of rows (amx_product): per
// group of rows, one operand per adapter among them. Where the rows are all one adapter's,
// the operand reads xa in place; else a copy holds that adapter's rows and zeros for the
// others.
class LoraRows {
 public:
  void prepare(const LoraExpand& l, int64_t r0, int64_t rows) {
    uses_.clear();
    size_t copied = 0;
    for (int64_t lo = r0; lo < r0 + rows; lo += 32) {
      const int64_t n = std::min<int64_t>(32, r0 + rows - lo);
      int64_t seen[32];
      int count = 0;
      bool mixed = false;
      for (int64_t i = lo; i < lo + n; ++i) {
        const int64_t g = group(l, i);
        mixed |= g != group(l, lo);
        if (g < 0 || std::find(seen, seen + count, g) != seen + count) continue;
        seen[count++] = g;
      }
      for (int k = 0; k < count; ++k) {
        uses_.push_back({lo, n, seen[k], mixed});
        if (mixed) copied += 32 * 2 * l.kp[seen[k]];
      }
    }
    copies_.resize(copied);
    ops_.clear();
    begin_.assign(1, 0);
    uint16_t* next = copies_.data();
    int64_t group_lo = r0;
    for (const Use& u : uses_) {
      while (group_lo < u.lo) {
        begin_.push_back(static_cast<int>(ops_.size()));
        group_lo += 32;
      }
      const int64_t width = 2 * l.kp[u.g];
      if (!u.mixed) {
        ops_.push_back({l.xa + u.lo * l.ra, l.ra, l.b[u.g], l.kp[u.g]});
        continue;
      }
      std::fill(next, next + 32 * width, 0);
      for (int64_t i = 0; i < u.n; ++i) {
        if (group(l, u.lo + i) == u.g) {
          std::copy(l.xa + (u.lo + i) * l.ra, l.xa + (u.lo + i) * l.ra + width, next + i * width);
        }
      }
      ops_.push_back({next, width, l.b[u.g], l.kp[u.g]});
      next += 32 * width;
    }
    while (group_lo < r0 + rows) {
      begin_.push_back(static_cast<int>(ops_.size()));
      group_lo += 32;
    }
  }
  // The operands of the rows' `index`th group of 32 (from the block's first row).
  const LoraOperand* ops(int64_t index) const { return ops_.data() + begin_[index]; }
  int count(int64_t index) const { return begin_[index + 1] - begin_[index]; }

 private:
  struct Use {
    int64_t lo, n, g;
    bool mixed;
  };
  static int64_t group(const LoraExpand& l, int64_t row) {
    const int64_t g = l.slots[row];
    return g >= 0 && l.b[g] != nullptr ? g : -1;
  }
  std::vector<Use> uses_;
  std::vector<LoraOperand> ops_;
  std::vector<int> begin_;
  std::vector<uint16_t> copies_;
};

template <bool kSiluMul>
void amx_product(const at::Tensor& x, const at::Tensor& wt, const float* bp, at::Tensor& y,
                 const LoraExpand* lora) {
  const int64_t M = x.size(0), K = x.size(1), tiles = wt.size(0), KP = wt.size(1);
  const int64_t ts = KP * 2 * kTile, n_out = y.size(1);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wt.data_ptr<at::BFloat16>());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // linear: items are pairs of adjacent tiles (the last may be alone); silu_mul: gate tiles,
  // each with its up tile `items` tiles further.
  const int64_t items = kSiluMul ? tiles / 2 : (tiles + 1) / 2;
  at::parallel_for(0, items, 1, [&](int64_t lo, int64_t hi) {
    alignas(64) float c[32 * 32];
    int rows0 = -1, rows1 = -1;
    LoraRows lora_rows;
    for (int64_t r0 = 0; r0 < M; r0 += kRowBlock) {
      const int64_t block = std::min(kRowBlock, M - r0);
      if (lora != nullptr) lora_rows.prepare(*lora, r0, block);
      for (int64_t it = lo; it < hi; ++it) {
        const int64_t t0 = kSiluMul ? it : 2 * it;
        const int64_t t1 = kSiluMul ? it + items : std::min(2 * it + 1, tiles - 1);
        const uint16_t* w0 = wp + t0 * ts;
        const uint16_t* w1 = wp + t1 * ts;
        for (int64_t r = r0; r < r0 + block; r += 32) {
          const int rows = static_cast<int>(std::min<int64_t>(32, r0 + block - r));
          const int a0 = std::min(rows, 16), a1 = rows - a0;
          if (a0 != rows0 || a1 != rows1) {
            configure_tiles(a0, a1);
            rows0 = a0;
            rows1 = a1;
          }
          const LoraOperand* ops = nullptr;
          int count = 0;
          if (lora != nullptr) {
            ops = lora_rows.ops((r - r0) / 32);
            count = lora_rows.count((r - r0) / 32);
          }
          if (a1) {
            amx_step<true>(xp + r * K, K, w0, w1, KP, c, ops, count, t0, t1);
          } else {
            amx_step<false>(xp + r * K, K, w0, w1, KP, c, ops, count, t0, t1);
          }
          for (int i = 0; i < rows; ++i) {
            const float* ci = c + i * 32;
            at::BFloat16* yi = yp + (r + i) * n_out;
            if constexpr (kSiluMul) {
              const __m512 gate = round16<at::BFloat16>(_mm512_loadu_ps(ci));
              const __m512 silu = round16<at::BFloat16>(silu16(gate));
              const __m512 upv = round16<at::BFloat16>(_mm512_loadu_ps(ci + kTile));
              store16(yi + t0 * kTile, _mm512_mul_ps(silu, upv));
            } else {
              for (int64_t t : {t0, t1}) {
                __m512 v = _mm512_loadu_ps(ci + (t == t0 ? 0 : kTile));
                if (bp) v = _mm512_add_ps(v, _mm512_loadu_ps(bp + t * kTile));
                store16(yi + t * kTile, v);
                if (t1 == t0) break;
              }
            }
          }
        }
      }
    }
    if (rows0 >= 0) _tile_release();
  });
}
#endif

template <bool kSiluMul>
at::Tensor tiled_product(const at::Tensor& x_in, const at::Tensor& wt,
                         const std::optional<at::Tensor>& bias_in,
                         const LoraExpand* lora = nullptr) {
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), tiles = wt.size(0), KP = wt.size(1), ts = KP * 2 * kTile;
  const int64_t N = tiles * kTile, n_out = kSiluMul ? N / 2 : N;
  at::Tensor y = at::empty({M, n_out}, x.options());
  if (M == 0) return y;
  at::Tensor bias;
  if (bias_in.has_value()) bias = bias_in->to(at::kFloat).contiguous();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
#if defined(RADIXSERVE_AMX)
  if (KP % 16 == 0 && amx_permitted()) {
    amx_product<kSiluMul>(x, wt, bp, y, lora);
    return y;
  }
#endif
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wt.data_ptr<at::BFloat16>());
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // The threads share out the tiles (kSiluMul: the gate tiles, each with its up tile) in one
  // parallel region; each takes its own in passes of up to kTilesMax adjacent ones (kSiluMul:
  // two gate tiles and their up tiles), over blocks of kRowBlock rows: a block's activations
  // stay in L2 while the thread's tiles multiply them.
  const int64_t items = kSiluMul ? tiles / 2 : tiles;
  at::parallel_for(0, items, 1, [&](int64_t lo, int64_t hi) {
    if (M <= 2 && lora == nullptr) {  // passes over more tiles (kSiluMul: half gates, half up)
      const int64_t per_pass = (M == 1 ? kTilesOneRow : kTilesTwoRows) / (kSiluMul ? 2 : 1);
      for (int64_t t = lo; t < hi; t += per_pass) {
        const int64_t count = std::min(per_pass, hi - t);
        const uint16_t* w = wp + t * ts;
        const float* b = bp ? bp + t * kTile : nullptr;
        const int64_t up = kSiluMul ? items * ts : 0;
        if (M == 1) {
          pass_of<1, kTilesOneRow / (kSiluMul ? 2 : 1), kSiluMul>(count, w, ts, up, xp, KP, b,
                                                                    yp + t * kTile, n_out);
        } else {
          pass_of<2, kTilesTwoRows / (kSiluMul ? 2 : 1), kSiluMul>(count, w, ts, up, xp, KP, b,
                                                                     yp + t * kTile, n_out);
        }
      }
      return;
    }
    for (int64_t r0 = 0; r0 < M; r0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, M - r0);
      const uint32_t* xb = xp + r0 * KP;
      at::BFloat16* yb = yp + r0 * n_out;
      if constexpr (kSiluMul) {
        for (int64_t t = lo; t < hi; t += 2) {
          // gate tiles t (and t + 1) with their up tiles, `items` tiles further
          const uint16_t* w = wp + t * ts;
          at::BFloat16* yt = yb + t * kTile;
          if (t + 1 < hi) {
            tile_rows<2, true>(w, ts, items * ts, xb, rows, KP, nullptr, yt, n_out, lora, r0, t);
          } else {
            tile_rows<1, true>(w, ts, items * ts, xb, rows, KP, nullptr, yt, n_out, lora, r0, t);
          }
        }
      } else {
        for (int64_t t = lo; t < hi; t += kTilesMax) {
          const uint16_t* w = wp + t * ts;
          const float* b = bp ? bp + t * kTile : nullptr;
          at::BFloat16* yt = yb + t * kTile;
          switch (std::min<int64_t>(kTilesMax, hi - t)) {
            case 4: tile_rows<4, false>(w, ts, 0, xb, rows, KP, b, yt, N, lora, r0, t); break;
            case 3: tile_rows<3, false>(w, ts, 0, xb, rows, KP, b, yt, N, lora, r0, t); break;
            case 2: tile_rows<2, false>(w, ts, 0, xb, rows, KP, b, yt, N, lora, r0, t); break;
            default: tile_rows<1, false>(w, ts, 0, xb, rows, KP, b, yt, N, lora, r0, t); break;
          }
        }
      }
    }
  });
  return y;
}

// xa [M, ra] (zeros) gets each adapter row's x times its A (at[g]: [R_g/16, K/2, 32] tiles,
// R_g a multiple of 32), rounded to bf16, in its first R_g columns.
void lora_shrink_into(const at::Tensor& x, const std::vector<const uint16_t*>& at_,
                      const std::vector<int64_t>& tiles, const int64_t* slots, at::Tensor& xa) {
  const int64_t M = x.size(0), K = x.size(1), KP = K / 2, ts = KP * 2 * kTile;
  const int64_t ra = xa.size(1);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  at::BFloat16* out = xa.data_ptr<at::BFloat16>();
  auto group = [&](int64_t row) {
    const int64_t g = slots[row];
    return g >= 0 && at_[g] != nullptr ? g : -1;
  };
  const int64_t blocks = (M + 31) / 32;
#if defined(RADIXSERVE_AMX)
  if (KP % 16 == 0 && amx_permitted()) {
    at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
      alignas(64) float c[32 * 32];
      int rows0 = -1, rows1 = -1;
      for (int64_t blk = lo; blk < hi; ++blk) {
        const int64_t r = blk * 32;
        const int rows = static_cast<int>(std::min<int64_t>(32, M - r));
        const int a0 = std::min(rows, 16), a1 = rows - a0;
        int64_t done[32];
        int count = 0;
        for (int i = 0; i < rows; ++i) {
          const int64_t g = group(r + i);
          if (g < 0 || std::find(done, done + count, g) != done + count) continue;
          done[count++] = g;
          if (a0 != rows0 || a1 != rows1) {
            configure_tiles(a0, a1);
            rows0 = a0;
            rows1 = a1;
          }
          for (int64_t j = 0; j < tiles[g]; j += 2) {
            const uint16_t* w0 = at_[g] + j * ts;
            if (a1) {
              amx_step<true>(xp + r * K, K, w0, w0 + ts, KP, c);
            } else {
              amx_step<false>(xp + r * K, K, w0, w0 + ts, KP, c);
            }
            for (int k = i; k < rows; ++k) {
              if (group(r + k) != g) continue;
              at::BFloat16* o = out + (r + k) * ra + j * kTile;
              store16(o, _mm512_loadu_ps(c + k * 32));
              store16(o + kTile, _mm512_loadu_ps(c + k * 32 + kTile));
            }
          }
        }
      }
      if (rows0 >= 0) _tile_release();
    });
    return;
  }
#endif
  const uint32_t* xq = reinterpret_cast<const uint32_t*>(xp);
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo * 32; r < std::min(M, hi * 32);) {  // runs of one adapter's rows
      const int64_t g = group(r);
      int64_t e = r + 1;
      while (e < std::min(M, hi * 32) && group(e) == g) ++e;
      for (int64_t j = 0; g >= 0 && j < tiles[g]; j += 2) {
        tile_rows<2, false>(at_[g] + j * ts, ts, 0, xq + r * KP, e - r, KP, nullptr,
                            out + r * ra + j * kTile, ra);
      }
      r = e;
    }
  });
}
#else
constexpr bool kTiles = false;
#endif

// x [M, K] bf16, wt [N/16, K/2, 32] bf16 contiguous, bias [N] bf16; kSiluMul: N/16 even.
template <bool kSiluMul>
void check_tiled(const char* op, const at::Tensor& x, const at::Tensor& wt,
                 const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(kTiles, op, ": this build has no AVX512-BF16 kernels");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be [M, K] bf16");
  TORCH_CHECK(wt.dim() == 3 && wt.size(2) == 2 * kTile && wt.scalar_type() == at::kBFloat16 &&
                  wt.is_contiguous(),
              op, ": wt must be contiguous [N/16, K/2, 32] bf16");
  TORCH_CHECK(x.size(1) == 2 * wt.size(1), op, ": x has ", x.size(1), " columns, the weight ",
              2 * wt.size(1));
  TORCH_CHECK(!kSiluMul || wt.size(0) % 2 == 0, op, ": [gate; up] must be whole tiles each");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == wt.size(0) * kTile, op,
                ": bias must be [N]");
  }
}

template <bool kSiluMul>
at::Tensor tiled_op(const char* op, const at::Tensor& x, const at::Tensor& wt,
                    const std::optional<at::Tensor>& bias) {
  check_tiled<kSiluMul>(op, x, wt, bias);
#if defined(RADIXSERVE_BF16_TILES)
  return tiled_product<kSiluMul>(x, wt, bias);
#else
  return at::Tensor();
#endif
}

// The adapters' operands of bf16_tiled_*_lora and bf16_tiled_lora_shrink: each row's group
// (slots [M] int64, -1 or an index of `ws`) and each group's tiles (ws[g]: 3-d contiguous
// bf16 [., ., 32], or empty: the group leaves the projection alone).
void check_lora(const char* op, const at::Tensor& slots, const std::vector<at::Tensor>& ws,
                int64_t M) {
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == M && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              op, ": slots must be [M] int64");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t groups = static_cast<int64_t>(ws.size());
  for (int64_t i = 0; i < M; ++i) {
    TORCH_CHECK(sp[i] >= -1 && sp[i] < groups, op, ": slot ", sp[i], " of row ", i,
                " is not -1 or one of the ", groups, " groups");
  }
  for (const at::Tensor& w : ws) {
    if (w.numel() == 0) continue;
    TORCH_CHECK(w.dim() == 3 && w.size(2) == 2 * kTile && w.scalar_type() == at::kBFloat16 &&
                    w.is_contiguous(),
                op, ": each adapter's tiles must be contiguous [., ., 32] bf16");
  }
}

template <bool kSiluMul>
at::Tensor tiled_lora_op(const char* op, const at::Tensor& x, const at::Tensor& wt,
                         const std::optional<at::Tensor>& bias, const at::Tensor& xa,
                         const at::Tensor& slots, const std::vector<at::Tensor>& bt) {
  check_tiled<kSiluMul>(op, x, wt, bias);
  check_lora(op, slots, bt, x.size(0));
  TORCH_CHECK(xa.dim() == 2 && xa.size(0) == x.size(0) && xa.scalar_type() == at::kBFloat16 &&
                  xa.is_contiguous(),
              op, ": xa must be contiguous [M, R] bf16");
  for (const at::Tensor& b : bt) {
    if (b.numel() == 0) continue;
    TORCH_CHECK(b.size(0) == wt.size(0) && b.size(1) % 16 == 0, op,
                ": an adapter's B must be [N/16, R/2, 32], R a multiple of 32");
    TORCH_CHECK(2 * b.size(1) <= xa.size(1), op, ": an adapter's rank ", 2 * b.size(1),
                " exceeds xa's ", xa.size(1), " columns");
  }
#if defined(RADIXSERVE_BF16_TILES)
  LoraExpand lora;
  lora.xa = reinterpret_cast<const uint16_t*>(xa.data_ptr<at::BFloat16>());
  lora.ra = xa.size(1);
  lora.slots = slots.data_ptr<int64_t>();
  for (const at::Tensor& b : bt) {
    const bool used = b.numel() != 0;
    lora.b.push_back(used ? reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>())
                          : nullptr);
    lora.kp.push_back(used ? b.size(1) : 0);
  }
  lora.up = kSiluMul ? wt.size(0) / 2 : 0;
  return tiled_product<kSiluMul>(x, wt, bias, &lora);
#else
  return at::Tensor();
#endif
}

}  // namespace

namespace radixserve {

bool bf16_tiled_supported() { return kTiles; }

bool bf16_tiled_amx() {
#if defined(RADIXSERVE_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor bf16_tiled_linear(const at::Tensor& x, const at::Tensor& wt,
                             const std::optional<at::Tensor>& bias) {
  return tiled_op<false>("bf16_tiled_linear", x, wt, bias);
}

at::Tensor bf16_tiled_silu_mul(const at::Tensor& x, const at::Tensor& wt) {
  return tiled_op<true>("bf16_tiled_silu_mul", x, wt, std::nullopt);
}

at::Tensor bf16_tiled_linear_lora(const at::Tensor& x, const at::Tensor& wt,
                                  const std::optional<at::Tensor>& bias, const at::Tensor& xa,
                                  const at::Tensor& slots, const std::vector<at::Tensor>& bt) {
  return tiled_lora_op<false>("bf16_tiled_linear_lora", x, wt, bias, xa, slots, bt);
}

at::Tensor bf16_tiled_silu_mul_lora(const at::Tensor& x, const at::Tensor& wt,
                                    const at::Tensor& xa, const at::Tensor& slots,
                                    const std::vector<at::Tensor>& bt) {
  return tiled_lora_op<true>("bf16_tiled_silu_mul_lora", x, wt, std::nullopt, xa, slots, bt);
}

at::Tensor bf16_tiled_lora_shrink(const at::Tensor& x_in, const std::vector<at::Tensor>& a,
                                  const at::Tensor& slots) {
  const char* op = "bf16_tiled_lora_shrink";
  TORCH_CHECK(kTiles, op, ": this build has no AVX512-BF16 kernels");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.size(1) % 2 == 0,
              op, ": x must be [M, K] bf16, K even");
  const at::Tensor x = x_in.contiguous();
  check_lora(op, slots, a, x.size(0));
  int64_t ra = 32;
  for (const at::Tensor& w : a) {
    if (w.numel() == 0) continue;
    TORCH_CHECK(w.size(0) % 2 == 0, op, ": an adapter's A must be [R/16, K/2, 32], R a "
                "multiple of 32");
    TORCH_CHECK(w.size(1) * 2 == x.size(1), op, ": an adapter's A has ", w.size(1) * 2,
                " columns, x ", x.size(1));
    ra = std::max(ra, w.size(0) * kTile);
  }
  at::Tensor xa = at::zeros({x.size(0), ra}, x.options());
#if defined(RADIXSERVE_BF16_TILES)
  std::vector<const uint16_t*> ptrs;
  std::vector<int64_t> tiles;
  for (const at::Tensor& w : a) {
    const bool used = w.numel() != 0;
    ptrs.push_back(used ? reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>())
                        : nullptr);
    tiles.push_back(used ? w.size(0) : 0);
  }
  if (x.size(0) > 0) lora_shrink_into(x, ptrs, tiles, slots.data_ptr<int64_t>(), xa);
#endif
  return xa;
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, lib) {
  lib.def("bf16_tiled_linear(Tensor x, Tensor wt, Tensor? bias=None) -> Tensor");
  lib.def("bf16_tiled_silu_mul(Tensor x, Tensor wt) -> Tensor");
  lib.def(
      "bf16_tiled_linear_lora(Tensor x, Tensor wt, Tensor? bias, Tensor xa, Tensor slots, "
      "Tensor[] bt) -> Tensor");
  lib.def(
      "bf16_tiled_silu_mul_lora(Tensor x, Tensor wt, Tensor xa, Tensor slots, Tensor[] bt) -> "
      "Tensor");
  lib.def("bf16_tiled_lora_shrink(Tensor x, Tensor[] a, Tensor slots) -> Tensor");
  lib.def("bf16_tiled_supported", &radixserve::bf16_tiled_supported);
  lib.def("bf16_tiled_amx", &radixserve::bf16_tiled_amx);
}

TORCH_LIBRARY_IMPL(radixserve, CPU, lib) {
  lib.impl("bf16_tiled_linear", &radixserve::bf16_tiled_linear);
  lib.impl("bf16_tiled_silu_mul", &radixserve::bf16_tiled_silu_mul);
  lib.impl("bf16_tiled_linear_lora", &radixserve::bf16_tiled_linear_lora);
  lib.impl("bf16_tiled_silu_mul_lora", &radixserve::bf16_tiled_silu_mul_lora);
  lib.impl("bf16_tiled_lora_shrink", &radixserve::bf16_tiled_lora_shrink);
}
