"""Extend-step attention per layer, torch_native (padded) against cpu_paged (ragged), on one
pool: docs/performance.md, "Prefill without padding". Usage:
    .venv/bin/python scripts/ragged_extend.py [THREADS]
"""

from __future__ import annotations

import sys
import time

import torch

from radixserve.layers.attention.base import AttentionLayer
from radixserve.layers.attention.cpu_paged_backend import CpuPagedAttnBackend
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixserve.mem_cache.memory_pool import MHATokenToKVPool
from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M's attention
CASES = [
    ("one 1,024-token prompt", ForwardMode.EXTEND, [0], [1024]),
    ("prompts of 200, 200, 112", ForwardMode.EXTEND, [0, 0, 0], [200, 200, 112]),
    ("512-token chunk on a 512-token prefix", ForwardMode.EXTEND, [512], [512]),
    (
        "mixed: a 200-token chunk + 32 decode rows at 300",
        ForwardMode.MIXED,
        [0] + [300] * 32,
        [200] + [1] * 32,
    ),
    ("8 questions of 64 on a 1,024-token cached prefix", ForwardMode.EXTEND, [1024] * 8, [64] * 8),
]


def time_case(mode: ForwardMode, prefixes: list[int], ext: list[int]) -> list[float]:
    layer = AttentionLayer(0, HQ, HKV, D, D**-0.5)
    lens = [p + n for p, n in zip(prefixes, ext, strict=True)]
    rows = torch.zeros(len(lens), max(lens), dtype=torch.long)
    start = 0
    for i, n in enumerate(lens):
        rows[i, :n] = torch.arange(start, start + n)
        start += n
    out_loc = torch.cat([rows[i, p:n] for i, (p, n) in enumerate(zip(prefixes, lens, strict=True))])
    t = len(out_loc)
    q, k, v = torch.randn(t, HQ * D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    pool = MHATokenToKVPool(start + 16, 1, HKV, D, torch.float32, "cpu", 1)
    times = []
    for backend in (TorchNativeAttnBackend("cpu"), CpuPagedAttnBackend("cpu")):
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(lens),
            input_ids=torch.zeros(t, dtype=torch.long),
            positions=torch.cat([torch.arange(p, n) for p, n in zip(prefixes, lens, strict=True)]),
            req_pool_indices=torch.arange(len(lens)),
            seq_lens=torch.tensor(lens),
            out_cache_loc=out_loc,
            seq_lens_cpu=list(lens),
            extend_prefix_lens_cpu=list(prefixes),
            extend_seq_lens_cpu=list(ext),
            kv_rows=rows,
            token_to_kv_pool=pool,
        )
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            backend.init_forward_metadata(fb)
            for _ in range(3):
                backend.forward(q, k, v, layer, fb)
            best = min(best, (time.perf_counter() - t0) / 3)
        times.append(best * 1000)
    return times


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    print("| step | torch_native (padded) | cpu_paged (ragged) |")
    print("|---|---:|---:|")
    for name, mode, prefixes, ext in CASES:
        padded, ragged = time_case(mode, prefixes, ext)
        print(f"| {name} | {padded:.1f} ms | {ragged:.1f} ms |")


if __name__ == "__main__":
    main()
