"""A decode step's time with LoRA adapters, straight through the ModelRunner (no server):
the base model, every row on one adapter, and the adapters in turn, at each batch size.
docs/performance.md, "Every adapter of a decode step in one call".

    .venv/bin/python scripts/lora_step_bench.py --adapters DIR_A DIR_B DIR_C DIR_D --rows 1 32

With --prefill, a prefill's time instead: `--rows` prompts of --prompt-len tokens in one
extend step, base / one adapter / the adapters in turn (one per prompt), and with
--compare-products the same with the deltas by the per-adapter products instead of inside
the bf16 tiled products (docs/performance.md, "LoRA prefills inside the tiled products"):

    .venv/bin/python scripts/lora_step_bench.py --adapters A B C D --prefill --rows 1 4 \
        --prompt-len 200 1024 --compare-products

(the adapters there: tests/lora/test_lora.py's write_adapter(dir, model, r=16, seed=3 + i,
scale=0.03); the default model in its default dtype; 200-token prompts, the median of 60
steps.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _runner(adapters: list[str], max_total_tokens: int) -> tuple[object, list[str]]:
    """The default model's ModelRunner with the adapters as l0, l1, ... (and their names)."""
    from radixserve.args import ServerArgs
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.model_loader.default_model import ensure_default_model

    names = [f"l{i}" for i in range(len(adapters))]
    args = ServerArgs(
        model_path=ensure_default_model(),
        device="cpu",
        max_total_tokens=max_total_tokens,
        lora_paths=tuple(f"{n}={d}" for n, d in zip(names, adapters, strict=True)),
    ).resolve()
    return ModelRunner(args), names


def _timed_forward(runner, batch) -> float:
    fb = batch.get_forward_batch(runner.device)
    start = time.perf_counter()
    runner.forward(fb)
    return time.perf_counter() - start


def _median_ms(times: list[float]) -> float:
    return sorted(times)[len(times) // 2] * 1e3


def _cases(n: int, names: list[str]) -> list[tuple[str, list[str | None]]]:
    """base, every row on the first adapter, the adapters in turn."""
    return [
        ("base", [None] * n),
        ("one", [names[0]] * n),
        ("mixed", [names[i % len(names)] for i in range(n)]),
    ]


def main() -> None:
    from rs_testing import prefill_batch

    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", nargs="+", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64, 128])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[200])
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--compare-products", action="store_true")
    a = ap.parse_args()
    if a.prefill:
        return prefill(a)
    length = a.prompt_len[0]
    runner, names = _runner(a.adapters, max(a.rows) * (length + a.steps + 8) + 1024)
    for n in a.rows:
        for label, loras in _cases(n, names):
            batch = prefill_batch(runner, [list(range(100, 100 + length))] * n)
            for req, lora in zip(batch.reqs, loras, strict=True):
                req.lora_id = lora
            runner.forward(batch.get_forward_batch(runner.device))
            times = []
            for _ in range(a.steps):
                for req in batch.reqs:
                    req.output_ids.append(5)
                batch.prepare_for_decode()
                times.append(_timed_forward(runner, batch))
            for req in batch.reqs:
                batch.tree_cache.cache_finished_req(req)
            print(f"rows {n} {label}: median step {_median_ms(times):.2f} ms", flush=True)


def prefill(a: argparse.Namespace) -> None:
    from rs_testing import prefill_batch

    from radixserve.lora.manager import LoRALinear

    runner, names = _runner(a.adapters, max(a.rows) * max(a.prompt_len) + 1024)
    wrapped = [m for m in runner.model.modules() if isinstance(m, LoRALinear)]
    paths = [("tiled", [m.tiled for m in wrapped]), ("products", [False] * len(wrapped))]
    g = torch.Generator().manual_seed(0)
    for length in a.prompt_len:
        for n in a.rows:
            prompts = [torch.randint(100, 40000, (length,), generator=g).tolist() for _ in range(n)]
            for path, flags in paths[: 2 if a.compare_products else 1]:
                for m, flag in zip(wrapped, flags, strict=True):
                    m.tiled = flag
                for label, loras in _cases(n, names):
                    if label == "base" and path != "tiled":
                        continue
                    times = []
                    for _ in range(a.steps):
                        batch = prefill_batch(runner, prompts)
                        for req, lora in zip(batch.reqs, loras, strict=True):
                            req.lora_id = lora
                        times.append(_timed_forward(runner, batch))
                        for req in batch.reqs:
                            batch.tree_cache.cache_finished_req(req)
                    print(
                        f"prefill {n} x {length}: {label} ({path}) median "
                        f"{_median_ms(times):.1f} ms",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
