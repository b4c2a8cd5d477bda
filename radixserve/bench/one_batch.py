"""`python -m radixserve bench one-batch`: a static batch straight through ModelRunner.

No server, no scheduler policy: for each (batch size, input length) it prefills the batch once,
then decodes `--output-len` steps with greedy sampling, and reports prefill latency and
throughput and the median decode step latency and throughput (SGLang's bench_one_batch). With
`--output-len 1` there is no decode step: its statistics are n/a (null in `--output-file`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from radixserve.args import ServerArgs
from radixserve.bench import NON_NEGATIVE, OUTPUT_FILE, POSITIVE, kv_pool_tokens
from radixserve.bench.metrics import json_line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench one-batch", description=__doc__)
    p.add_argument("--batch-size", type=POSITIVE, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=POSITIVE, nargs="+", default=[256])
    p.add_argument("--output-len", type=POSITIVE, default=32)
    p.add_argument("--warmup", type=NON_NEGATIVE, default=1, help="Warm-up runs of the first case.")
    p.add_argument(
        "--output-file", type=OUTPUT_FILE, default=None, help="Append one JSON line per case."
    )
    ServerArgs.add_cli_args(p)
    return p


def run_case(runner: Any, bs: int, input_len: int, output_len: int, seed: int = 0) -> dict:
    from radixserve.layers.sampler import SamplingBatchInfo
    from radixserve.managers.schedule_batch import Req, ScheduleBatch
    from radixserve.mem_cache.chunk_cache import ChunkCache
    from radixserve.sampling_params import SamplingParams

    vocab = runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    cache = ChunkCache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator)
    sp = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    reqs = [
        Req(f"b{i}", torch.randint(0, vocab, (input_len,), generator=gen).tolist(), sp)
        for i in range(bs)
    ]
    for r in reqs:
        r.init_next_round_input(cache)
    batch = ScheduleBatch(reqs, runner.req_to_token_pool, runner.token_to_kv_pool_allocator, cache)

    def step() -> None:
        fb = batch.get_forward_batch(runner.device)
        logits = runner.forward(fb).next_token_logits
        info = SamplingBatchInfo.from_reqs(reqs, vocab, runner.device)
        next_ids = runner.sample(logits, info).next_token_ids.tolist()
        for r, t in zip(reqs, next_ids, strict=True):
            r.output_ids.append(t)

    _sync(runner.device)
    t0 = time.perf_counter()
    batch.prepare_for_extend()
    step()
    _sync(runner.device)
    prefill = time.perf_counter() - t0
    decode_times = []
    for _ in range(output_len - 1):
        t0 = time.perf_counter()
        batch.prepare_for_decode()
        step()
        _sync(runner.device)
        decode_times.append(time.perf_counter() - t0)
    for r in reqs:
        cache.cache_finished_req(r)
    med = statistics.median(decode_times) if decode_times else None  # --output-len 1
    return {
        "batch_size": bs,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency_s": prefill,
        "prefill_throughput": bs * input_len / prefill,
        "median_decode_latency_s": med,
        "median_decode_throughput": bs / med if med else None,
        "total_latency_s": prefill + sum(decode_times),
    }


def _fixed(value: float | None, width: int, scale: float = 1.0, digits: int = 1) -> str:
    """A table cell; n/a for a statistic of nothing measured (no decode step)."""
    return f"{'n/a':>{width}}" if value is None else f"{value * scale:>{width}.{digits}f}"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> list[dict]:
    ns = build_parser().parse_args(argv)
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.utils import configure_logging

    configure_logging(ns.log_level)
    args = ServerArgs.from_cli_args(ns)
    need = kv_pool_tokens(
        max(ns.batch_size), max(ns.input_len) + ns.output_len, args.page_size
    )  # every request of the largest batch at once, in whole pages
    if args.max_total_tokens is None or args.max_total_tokens < need:
        import dataclasses

        args = dataclasses.replace(args, max_total_tokens=need)
    if args.max_running_requests is None or args.max_running_requests < max(ns.batch_size):
        import dataclasses

        args = dataclasses.replace(args, max_running_requests=max(ns.batch_size))
    runner = ModelRunner(args)
    longest = max(ns.input_len) + ns.output_len
    if longest > runner.context_len:  # (past it: a RuntimeError deep in the KV pool)
        raise ValueError(
            f"--input-len {max(ns.input_len)} + --output-len {ns.output_len} = {longest} "
            f"tokens exceeds the model's context length {runner.context_len}"
        )
    for _ in range(ns.warmup):
        run_case(runner, ns.batch_size[0], ns.input_len[0], min(ns.output_len, 4))
    results = []
    kv = runner.server_args.kv_cache_dtype
    print(
        f"dtype={args.dtype} kv_cache_dtype={kv} device={args.device} threads={torch.get_num_threads()}"
    )
    header = f"{'bs':>4} {'in':>6} {'out':>5} {'prefill s':>10} {'prefill tok/s':>14}"
    print(header + f" {'decode ms':>10} {'decode tok/s':>13}")
    for bs in ns.batch_size:
        for il in ns.input_len:
            res = run_case(runner, bs, il, ns.output_len)
            res["dtype"] = args.dtype
            res["kv_cache_dtype"] = kv
            results.append(res)
            print(
                f"{bs:>4} {il:>6} {ns.output_len:>5} {res['prefill_latency_s']:>10.3f} "
                f"{res['prefill_throughput']:>14.1f} "
                f"{_fixed(res['median_decode_latency_s'], 10, 1e3, 2)} "
                f"{_fixed(res['median_decode_throughput'], 13)}"
            )
            if ns.output_file:
                with open(ns.output_file, "a") as f:
                    f.write(json_line(res) + "\n")
    return results
