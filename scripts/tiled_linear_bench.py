"""radixserve's three tiled weight kernels side by side, by row count: bf16 tiles
(bf16_linear.cpp), int8 and int4 tiles (quant_linear.cpp).

SmolLM2-135M's 30 layers of distinct random weights (qkv 960 x 576, o 576 x 576, gate_up
3072 x 576, down 576 x 1536: 212 MB in bf16, 120 MB in int8, 66 MB in int4, more than the
caches hold), each product of a layer once per pass, bf16 activations in and out; the kernels
take turns and each pass's time is kept, so the machine's drift cancels in the ratios. Needs a
CPU with AVX512-BF16 and AVX-512 VNNI (and radixserve's kernels, built on first use).

    python scripts/tiled_linear_bench.py [ROWS ...]      (default: 1 8 64 256)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from radixserve.layers.cpu_kernels import load_cpu_kernels
from radixserve.layers.linear import bf16_tiles
from radixserve.layers.quantization import (
    pack_q4,
    pack_q4_tiles,
    pack_q8_tiles,
    quantize_int4,
    quantize_q8,
)

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main(rows_list: list[int]) -> None:
    load_cpu_kernels()
    ops = torch.ops.radixserve
    if not (ops.bf16_tiled_supported() and ops.tiled_supported()):
        sys.exit("this CPU (or build) has no AVX512-BF16 and VNNI kernels")
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) * 0.05 for n, k in SHAPES] for _ in range(30)]

    def int4(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        codes, scale, minimum = quantize_int4(w)
        return (pack_q4_tiles(pack_q4(codes), scale, minimum),)

    kernels = {
        "bf16": (
            ops.bf16_tiled_linear,
            [[(bf16_tiles(w.bfloat16()),) for w in ws] for ws in weights],
        ),
        "int8": (
            ops.q8_tiled_linear,
            [[(pack_q8_tiles(*quantize_q8(w)),) for w in ws] for ws in weights],
        ),
        "int4": (ops.q4_tiled_linear, [[int4(w) for w in ws] for ws in weights]),
    }
    gbytes = {
        name: sum(t.numel() * t.element_size() for layer in tiles for w in layer for t in w) / 1e9
        for name, (_, tiles) in kernels.items()
    }
    for rows in rows_list:
        xs = [torch.randn(rows, k).bfloat16() for _, k in SHAPES]
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for i in range(20 if rows <= 64 else 6):
            order = list(kernels) if i % 2 else list(reversed(kernels))
            for name in order:
                op, tiles = kernels[name]
                start = time.perf_counter()
                for layer in tiles:
                    for x, w in zip(xs, layer, strict=True):
                        op(x, *w)
                times[name].append(time.perf_counter() - start)
        cells = []
        for name in kernels:
            t = statistics.median(times[name])
            ratio = statistics.median(
                b / a for a, b in zip(times[name], times["bf16"], strict=True)
            )
            cells.append(
                f"{name} {t * 1e3:.2f} ms ({gbytes[name] / t:.1f} GB/s, {ratio:.2f}x bf16)"
            )
        print(f"rows {rows}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 8, 64, 256])
