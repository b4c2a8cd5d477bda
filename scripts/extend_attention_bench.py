"""Prefill attention on AMX's tile unit against AVX512-BF16's dot products, on one machine:
docs/performance.md, "Prefill attention on AMX's tile unit". Two parts, each path in turn on the
same inputs (set_attention_amx switches the kernel's path for the process):
  1. the extend_attention op alone, one prompt of each length attending itself causally, for
     SmolLM2-135M's heads (9 query / 3 KV, head size 64) and a head size of 128;
  2. the default model's prefill of one prompt of each length (bf16), in process (bench
     one-batch's run_case), rounds alternating.
Usage (a CPU with AMX; elsewhere only the vdpbf16ps path runs and the ratios are not printed):
    .venv/bin/python scripts/extend_attention_bench.py [LEN ...]   # default 256 1024 4096
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from radixserve.layers.cpu_kernels import load_cpu_kernels

ROUNDS = 3


def paths() -> list[bool]:
    ops = torch.ops.radixserve
    ops.set_attention_amx(True)
    return [False, True] if ops.extend_attention_amx() else [False]


def op_times(lens: list[int], amx_paths: list[bool]) -> None:
    ops = torch.ops.radixserve
    print("| heads (q / kv / dim) | tokens | " + _header(amx_paths))
    print("|---|---:|" + "---:|" * (len(amx_paths) + len(amx_paths) - 1))
    for hq, hkv, d in [(9, 3, 64), (4, 4, 128)]:
        for n in lens:
            gen = torch.Generator().manual_seed(n)
            q = torch.randn(n, hq, d, generator=gen).bfloat16()
            k = torch.randn(n, hkv, d, generator=gen).bfloat16()
            v = torch.randn(n, hkv, d, generator=gen).bfloat16()
            slots = torch.arange(n)
            best = {}
            for amx in amx_paths:
                ops.set_attention_amx(amx)
                ops.extend_attention(q, k, v, slots, d**-0.5)  # warm
                runs = []
                for _ in range(5):
                    t = time.perf_counter()
                    ops.extend_attention(q, k, v, slots, d**-0.5)
                    runs.append(time.perf_counter() - t)
                best[amx] = min(runs)
            flops = 2 * 2 * hq * d * n * n / 2  # the causal half of both products
            cells = [f"{best[a] * 1e3:.2f} ms ({flops / best[a] / 1e9:.0f} GFLOP/s)" for a in best]
            ratio = f" {best[False] / best[True]:.2f}x |" if True in best else ""
            print(f"| {hq} / {hkv} / {d} | {n:,} | " + " | ".join(cells) + " |" + ratio)


def prefill_times(lens: list[int], amx_paths: list[bool]) -> None:
    from radixserve.args import ServerArgs
    from radixserve.bench.one_batch import run_case
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.model_loader.default_model import ensure_default_model

    ops = torch.ops.radixserve
    args = ServerArgs(
        model_path=ensure_default_model(),
        dtype="bfloat16",
        device="cpu",
        max_total_tokens=max(lens) + 64,
        max_running_requests=4,
    ).resolve()
    runner = ModelRunner(args)
    run_case(runner, 1, min(lens), 2)  # warm
    times: dict[tuple[int, bool], list[float]] = {}
    for rnd in range(ROUNDS):
        for amx in amx_paths:
            ops.set_attention_amx(amx)
            for n in lens:
                r = run_case(runner, 1, n, 2, seed=rnd)
                times.setdefault((n, amx), []).append(r["prefill_latency_s"])
    print("\n| prompt tokens | " + _header(amx_paths))
    print("|---:|" + "---:|" * (len(amx_paths) + len(amx_paths) - 1))
    for n in lens:
        med = {a: statistics.median(times[(n, a)]) for a in amx_paths}
        cells = [f"{med[a] * 1e3:,.0f} ms" for a in amx_paths]
        ratio = f" {med[False] / med[True]:.2f}x |" if True in med else ""
        print(f"| {n:,} | " + " | ".join(cells) + " |" + ratio)


def _header(amx_paths: list[bool]) -> str:
    names = ["AMX tiles" if a else "vdpbf16ps" for a in amx_paths]
    return " | ".join(names + (["ratio"] if len(amx_paths) > 1 else [])) + " |"


def main() -> None:
    lens = [int(a) for a in sys.argv[1:]] or [256, 1024, 4096]
    load_cpu_kernels()
    if not torch.ops.radixserve.extend_attention_supported():
        sys.exit("this CPU has no AVX512-BF16: the extend kernel is not built here")
    amx_paths = paths()
    try:
        op_times(lens, amx_paths)
        prefill_times(lens, amx_paths)
    finally:
        torch.ops.radixserve.set_attention_amx(True)


if __name__ == "__main__":
    main()
