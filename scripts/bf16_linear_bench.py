"""bf16 tiles (csrc/bf16_linear.cpp) against oneDNN's prepacked product, by row count.

SmolLM2-135M's 30 layers of distinct random weights (qkv 960 x 576, o 576 x 576, gate_up
3072 x 576, down 576 x 1536: 212 MB, more than the caches hold), each product of a layer once
per pass; the two kernels alternate and each pair's ratio is kept, so the machine's drift
cancels. Needs a CPU with AVX512-BF16 (and radixserve's kernels, built on first use).

    python scripts/bf16_linear_bench.py [ROWS ...]      (default: 1 8 32 64 256 1024)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from radixserve.layers.cpu_kernels import load_cpu_kernels
from radixserve.layers.linear import bf16_tiles

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main(rows_list: list[int]) -> None:
    load_cpu_kernels()
    if not torch.ops.radixserve.bf16_tiled_supported():
        sys.exit("this CPU (or build) has no AVX512-BF16 kernels")
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).bfloat16() for n, k in SHAPES] for _ in range(30)]
    onednn_w = [[torch.ops.mkldnn._reorder_linear_weight(w) for w in layer] for layer in weights]
    tiles_w = [[bf16_tiles(w) for w in layer] for layer in weights]
    gbytes = sum(w.numel() * 2 for layer in weights for w in layer) / 1e9
    for rows in rows_list:
        xs = [torch.randn(rows, k).bfloat16() for _, k in SHAPES]

        def onednn(xs: list[torch.Tensor] = xs) -> None:
            for layer in onednn_w:
                for x, w in zip(xs, layer, strict=True):
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        def tiles(xs: list[torch.Tensor] = xs) -> None:
            for layer in tiles_w:
                for x, w in zip(xs, layer, strict=True):
                    torch.ops.radixserve.bf16_tiled_linear(x, w)

        a, b = [], []
        for i in range(30 if rows <= 64 else 8):
            for fn, acc in ((onednn, a), (tiles, b)) if i % 2 else ((tiles, b), (onednn, a)):
                start = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - start)
        ratios = sorted(x / y for x, y in zip(a, b, strict=True))
        t = statistics.median(b)
        print(
            f"rows {rows}: oneDNN {statistics.median(a) * 1e3:.2f} ms, tiles {t * 1e3:.2f} ms "
            f"({gbytes / t:.1f} GB/s of weights, {rows * gbytes / t:.0f} GFLOP/s), paired "
            f"ratio {statistics.median(ratios):.2f} (quartiles {ratios[len(ratios) // 4]:.2f}-"
            f"{ratios[3 * len(ratios) // 4]:.2f})",
            flush=True,
        )


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 8, 32, 64, 256, 1024])
