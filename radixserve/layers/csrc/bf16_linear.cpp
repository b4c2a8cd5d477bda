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
//   bf16_tiled_supported() says whether this build has them; bf16_tiled_amx() whether their
//     products run on AMX here (this build has it and Linux granted the tile state).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

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

// One pass: rows r .. r + R - 1 (x: their activations as pairs, xs pairs apart) times C
// adjacent tiles (w: the first; ts elements from one to the next), KP pairs; y gets the
// R x 16C results, its rows ys apart. kSiluMul: the C tiles are gate tiles, each with its up
// tile `up` elements further, and y gets silu(gate) * up (R x 16C).
template <int R, int C, bool kSiluMul>
__attribute__((noinline)) void tile_pass(const uint16_t* w, int64_t ts, int64_t up,
                                         const uint32_t* x, int64_t xs, int64_t KP,
                                         const float* bias, at::BFloat16* y, int64_t ys) {
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

// Every row of C tiles: passes of kRows rows, then one of the rows left.
template <int C, bool kSiluMul>
void tile_rows(const uint16_t* w, int64_t ts, int64_t up, const uint32_t* x, int64_t M,
               int64_t KP, const float* bias, at::BFloat16* y, int64_t ys) {
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows) {
    tile_pass<kRows, C, kSiluMul>(w, ts, up, x + r * KP, KP, KP, bias, y + r * ys, ys);
  }
  const uint32_t* xr = x + r * KP;
  at::BFloat16* yr = y + r * ys;
  switch (M - r) {
    case 3: tile_pass<3, C, kSiluMul>(w, ts, up, xr, KP, KP, bias, yr, ys); break;
    case 2: tile_pass<2, C, kSiluMul>(w, ts, up, xr, KP, KP, bias, yr, ys); break;
    case 1: tile_pass<1, C, kSiluMul>(w, ts, up, xr, KP, KP, bias, yr, ys); break;
    default: break;
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

// c [32, 32] fp32 = rows 0 .. 16 + (kTwo ? 16 : 0) of x (K bf16 a row) times the weight tiles
// at w0 (columns 0-15) and w1 (columns 16-31), KP pairs (a multiple of 16).
template <bool kTwo>
void amx_step(const uint16_t* x, int64_t K, const uint16_t* w0, const uint16_t* w1, int64_t KP,
              float* c) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwo) {
    _tile_zero(2);
    _tile_zero(3);
  }
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
  _tile_stored(0, c, 128);
  _tile_stored(1, c + kTile, 128);
  if constexpr (kTwo) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + kTile, 128);
  }
}

template <bool kSiluMul>
void amx_product(const at::Tensor& x, const at::Tensor& wt, const float* bp, at::Tensor& y) {
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
    for (int64_t r0 = 0; r0 < M; r0 += kRowBlock) {
      const int64_t block = std::min(kRowBlock, M - r0);
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
          if (a1) {
            amx_step<true>(xp + r * K, K, w0, w1, KP, c);
          } else {
            amx_step<false>(xp + r * K, K, w0, w1, KP, c);
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
                         const std::optional<at::Tensor>& bias_in) {
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
    amx_product<kSiluMul>(x, wt, bp, y);
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
    if (M <= 2) {  // passes over more tiles (kSiluMul: half of them gates, half up)
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
          if (t + 1 < hi) {
            tile_rows<2, true>(w, ts, items * ts, xb, rows, KP, nullptr, yb + t * kTile, n_out);
          } else {
            tile_rows<1, true>(w, ts, items * ts, xb, rows, KP, nullptr, yb + t * kTile, n_out);
          }
        }
      } else {
        for (int64_t t = lo; t < hi; t += kTilesMax) {
          const uint16_t* w = wp + t * ts;
          const float* b = bp ? bp + t * kTile : nullptr;
          at::BFloat16* yt = yb + t * kTile;
          switch (std::min<int64_t>(kTilesMax, hi - t)) {
            case 4: tile_rows<4, false>(w, ts, 0, xb, rows, KP, b, yt, N); break;
            case 3: tile_rows<3, false>(w, ts, 0, xb, rows, KP, b, yt, N); break;
            case 2: tile_rows<2, false>(w, ts, 0, xb, rows, KP, b, yt, N); break;
            default: tile_rows<1, false>(w, ts, 0, xb, rows, KP, b, yt, N); break;
          }
        }
      }
    }
  });
  return y;
}
#else
constexpr bool kTiles = false;
#endif

// x [M, K] bf16, wt [N/16, K/2, 32] bf16 contiguous, bias [N] bf16; kSiluMul: N/16 even.
template <bool kSiluMul>
at::Tensor tiled_op(const char* op, const at::Tensor& x, const at::Tensor& wt,
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
#if defined(RADIXSERVE_BF16_TILES)
  return tiled_product<kSiluMul>(x, wt, bias);
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

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, lib) {
  lib.def("bf16_tiled_linear(Tensor x, Tensor wt, Tensor? bias=None) -> Tensor");
  lib.def("bf16_tiled_silu_mul(Tensor x, Tensor wt) -> Tensor");
  lib.def("bf16_tiled_supported", &radixserve::bf16_tiled_supported);
  lib.def("bf16_tiled_amx", &radixserve::bf16_tiled_amx);
}

TORCH_LIBRARY_IMPL(radixserve, CPU, lib) {
  lib.impl("bf16_tiled_linear", &radixserve::bf16_tiled_linear);
  lib.impl("bf16_tiled_silu_mul", &radixserve::bf16_tiled_silu_mul);
}
