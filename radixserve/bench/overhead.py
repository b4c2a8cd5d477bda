"""`python -m radixserve bench overhead`: what serving adds to each output token.

In one run, on the same dtype and thread settings: the pure batch-1 decode step straight
through ModelRunner (as `bench one-batch` measures it), and a server for each scheduler loop
(overlap, normal) measured by `bench serving`'s client with one request at a time, streaming.
The serving path's own cost per token is the served median TPOT minus the pure step. Shared
machines drift by more than that cost, so the parts are interleaved for several rounds and
each round's difference is paired. While the client runs, the CPU time of every server
process (scheduler, detokenizer, HTTP + TokenizerManager) and of the client is read from /proc
per output token: where serving spends the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import torch

from radixserve.args import ServerArgs
from radixserve.bench import OUTPUT_FILE, POSITIVE, SECONDS, int_at_least, kv_pool_tokens
from radixserve.bench.metrics import json_line
from radixserve.utils import free_port

HZ = os.sysconf("SC_CLK_TCK")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m radixserve bench overhead",
        description="What serving adds to each output token over the pure decode step.",
        epilog="Every other option is a server option (`serve --help`), used for both parts; "
        "the client sends the server's --api-key (else $OPENAI_API_KEY, if set).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--input-len", type=POSITIVE, default=200)
    p.add_argument(
        "--output-len",
        type=int_at_least(2, "TPOT, the time per token after the first, needs two"),
        default=128,
    )
    p.add_argument("--num-prompts", type=POSITIVE, default=2, help="Requests per loop and round.")
    p.add_argument("--rounds", type=POSITIVE, default=3)
    p.add_argument(
        "--backend",
        choices=["openai", "radixserve"],
        default="openai",
        help="openai: streaming /v1/completions; radixserve: streaming /generate.",
    )
    p.add_argument(
        "--loops", nargs="+", default=["overlap", "normal"], choices=["overlap", "normal"]
    )
    p.add_argument(
        "--output-file", type=OUTPUT_FILE, default=None, help="Append the result as a JSON line."
    )
    p.add_argument("--server-timeout", type=SECONDS, default=600.0, help="Seconds to start.")
    return p


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


# configure_child_process names the server's children twice: prctl sets the comm to
# "rs::<name>" (15 bytes at most), then setproctitle, where installed, rewrites the command
# line to "radixserve::<name>" and the comm to its first 15 bytes ("radixserve::sch").
PROC_TITLE = "radixserve::"
PROC_COMM = "rs::"


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return f"pid {pid}"
    return process_label(comm, cmd, pid)


def process_label(comm: str, cmd: str, pid: int) -> str:
    """What a server process is: a child's name from configure_child_process (scheduler,
    scheduler-tp1, detokenizer), the HTTP server, or its comm and pid."""
    if cmd.startswith(PROC_TITLE):  # setproctitle's title: the whole name
        return cmd[len(PROC_TITLE) :].split()[0]
    if comm.startswith(PROC_COMM):  # prctl's name, kept where setproctitle is not installed
        return comm[len(PROC_COMM) :]
    if "resource_tracker" in cmd:
        return "resource_tracker"
    return "http+tokenizer" if " serve " in cmd + " " else f"{comm} {pid}"


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ  # utime + stime, all threads


@contextmanager
def _server(server_argv: list[str], loop: str):
    port = free_port()
    argv = [sys.executable, "-m", "radixserve", "serve", *server_argv, "--port", str(port)]
    if loop == "normal":
        argv.append("--disable-overlap-schedule")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not start within {timeout:.0f} s")


def _served(
    url: str, pid: int, requests: list[Any], backend: str, api_key: str | None = None
) -> tuple[dict[str, Any], dict[str, float]]:
    """One client, one request at a time; returns the metrics and CPU seconds by process.
    `api_key`: the server's --api-key (else the client sends $OPENAI_API_KEY, if set)."""
    from radixserve.bench.client import ClientConfig
    from radixserve.bench.metrics import compute_metrics
    from radixserve.bench.serving import run_benchmark

    procs = {p: _name(p) for p in [pid, *_children(pid)]}
    cfg = ClientConfig(backend, url, model=None, ignore_eos=True, api_key=api_key)
    # The warm-up runs before the CPU snapshot: its tokens are not counted, nor its CPU time.
    asyncio.run(run_benchmark(cfg, requests[:1], warmup_requests=0, disable_tqdm=True))
    before = {p: _cpu_seconds(p) for p in procs}
    client_before = sum(os.times()[:2])
    records, duration, _ = asyncio.run(
        run_benchmark(cfg, requests, max_concurrency=1, warmup_requests=0, disable_tqdm=True)
    )
    cpu = {procs[p]: _cpu_seconds(p) - t for p, t in before.items()}
    cpu["bench client"] = sum(os.times()[:2]) - client_before
    metrics = compute_metrics(records, duration)
    if metrics["completed"] < len(requests):
        raise SystemExit(f"{len(requests) - metrics['completed']} requests failed")
    return metrics, cpu


def pure_step_args(args: ServerArgs, input_len: int, output_len: int) -> ServerArgs:
    """The pure step's ModelRunner: one request of `input_len + output_len` tokens (8 to
    spare), its KV pool in whole pages (with --page-size > 1 the pool is rounded down to them)."""
    need = kv_pool_tokens(1, input_len + output_len + 8, args.page_size)
    return dataclasses.replace(args, max_total_tokens=need, max_running_requests=1)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    ns, server_argv = build_parser().parse_known_args(argv)
    server_parser = argparse.ArgumentParser(prog="server options")
    ServerArgs.add_cli_args(server_parser)
    args = ServerArgs.from_cli_args(server_parser.parse_args(server_argv))
    from radixserve.bench import datasets
    from radixserve.bench.one_batch import run_case
    from radixserve.bench.serving import build_parser as serving_parser
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.utils import configure_logging

    configure_logging(args.log_level)
    data_args = serving_parser().parse_args(
        ["--dataset-name", "random", "--random-range-ratio", "1.0",
         "--random-input-len", str(ns.input_len), "--random-output-len", str(ns.output_len),
         "--num-prompts", str(ns.num_prompts)]
        + (["--tokenizer", args.tokenizer_path or args.model_path] if args.model_path else [])
    )  # fmt: skip
    tokenizer = datasets.load_tokenizer(data_args.tokenizer)
    requests = datasets.build_dataset(data_args, tokenizer)
    runner = ModelRunner(pure_step_args(args, ns.input_len, ns.output_len))
    run_case(runner, 1, ns.input_len, 4)  # warm-up
    steps: list[float] = []
    tpot: dict[str, list[float]] = {loop: [] for loop in ns.loops}
    paired: dict[str, list[float]] = {loop: [] for loop in ns.loops}
    cpu: dict[str, dict[str, float]] = {loop: {} for loop in ns.loops}
    tokens: dict[str, int] = dict.fromkeys(ns.loops, 0)
    with ExitStack() as stack:
        servers = {loop: stack.enter_context(_server(server_argv, loop)) for loop in ns.loops}
        for proc, url in servers.values():
            _wait_healthy(url, proc, ns.server_timeout)
        for rnd in range(ns.rounds):
            step = run_case(runner, 1, ns.input_len, ns.output_len)["median_decode_latency_s"] * 1e3
            steps.append(step)
            line = [f"round {rnd + 1}: pure step {step:.2f} ms"]
            for loop, (proc, url) in servers.items():
                metrics, used = _served(url, proc.pid, requests, ns.backend, args.api_key)
                tpot[loop].append(metrics["median_tpot_ms"])
                paired[loop].append(metrics["median_tpot_ms"] - step)
                tokens[loop] += int(metrics["total_output_tokens"])
                for name, sec in used.items():
                    cpu[loop][name] = cpu[loop].get(name, 0.0) + sec
                line.append(f"{loop} TPOT {metrics['median_tpot_ms']:.2f} ms")
            print(", ".join(line), flush=True)
    med_step = statistics.median(steps)
    rows = []
    print(f"\n{'loop':<8} {'TPOT ms':>8} {'step ms':>8} {'serving ms/token (paired)':>26}")
    for loop in ns.loops:
        row = {
            "loop": loop,
            "median_tpot_ms": statistics.median(tpot[loop]),
            "serving_cost_ms": statistics.median(paired[loop]),
            "serving_cost_per_round_ms": paired[loop],
            "cpu_ms_per_token": {
                k: v * 1e3 / max(1, tokens[loop]) for k, v in sorted(cpu[loop].items())
            },
        }
        rows.append(row)
        print(f"{loop:<8} {row['median_tpot_ms']:>8.2f} {med_step:>8.2f} "
              f"{row['serving_cost_ms']:>26.2f}")  # fmt: skip
    print("\nCPU ms per output token, by process:")
    for row in rows:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in row["cpu_ms_per_token"].items())
        print(f"  {row['loop']}: {parts}")
    out = {
        "pure_step_ms": med_step,
        "pure_step_per_round_ms": steps,
        "dtype": runner.dtype.__repr__(),
        "threads": torch.get_num_threads(),
        "rows": rows,
        "timestamp": time.time(),
    }
    if ns.output_file:
        with open(ns.output_file, "a") as f:
            f.write(json_line(out) + "\n")
    return out
