"""`python -m radixserve bench overhead`: what serving adds to each output token.

In one run, on the same dtype and thread settings: the pure batch-1 decode step straight
through ModelRunner (`bench one-batch`), then a server started for each scheduler loop
(overlap, normal) and measured by `bench serving` with one client streaming. The serving
path's own cost per token is the served median TPOT minus the pure step. While the client
runs, the CPU time of every server process (scheduler, detokenizer, HTTP + TokenizerManager)
and of the client is read from /proc, per output token: the profile of where serving spends.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx

from radixserve.args import ServerArgs
from radixserve.utils import free_port

HZ = os.sysconf("SC_CLK_TCK")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m radixserve bench overhead",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument(
        "--loops", nargs="+", default=["overlap", "normal"], choices=["overlap", "normal"]
    )
    p.add_argument("--output-file", default=None, help="Append the result as a JSON line.")
    p.add_argument("--server-timeout", type=float, default=600.0, help="Seconds to start.")
    p.epilog = "Every other option is a server option (`serve --help`), used for both parts."
    return p


def pure_step_ms(args: ServerArgs, input_len: int, output_len: int) -> float:
    """Median batch-1 decode step (ms), as `bench one-batch` measures it."""
    import dataclasses

    from radixserve.bench.one_batch import run_case
    from radixserve.model_executor.model_runner import ModelRunner

    need = input_len + output_len + 8
    runner = ModelRunner(dataclasses.replace(args, max_total_tokens=need, max_running_requests=1))
    run_case(runner, 1, input_len, 4)  # warm-up
    res = run_case(runner, 1, input_len, output_len)
    return res["median_decode_latency_s"] * 1e3


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return "?"
    if "radixserve::" in comm or "radixserve::" in cmd:
        return (comm if "radixserve::" in comm else cmd).split("radixserve::")[1].split()[0]
    if "resource_tracker" in cmd:
        return "resource_tracker"
    return "http+tokenizer" if " serve" in cmd else comm


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ  # utime + stime, all threads


def _server_processes(root: int) -> dict[int, str]:
    procs = {root: _name(root)}
    for child in _children(root):
        procs[child] = _name(child)
    return procs


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


def serve_and_measure(ns: argparse.Namespace, server_argv: list[str], loop: str) -> dict[str, Any]:
    from radixserve.bench.serving import build_parser as serving_parser
    from radixserve.bench.serving import run as run_serving

    port = free_port()
    argv = [sys.executable, "-m", "radixserve", "serve", *server_argv, "--port", str(port)]
    if loop == "normal":
        argv.append("--disable-overlap-schedule")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, ns.server_timeout)
        procs = _server_processes(proc.pid)
        client_args = serving_parser().parse_args(
            [
                "--base-url", url,
                "--dataset-name", "random",
                "--random-input-len", str(ns.input_len),
                "--random-output-len", str(ns.output_len),
                "--random-range-ratio", "1.0",
                "--num-prompts", str(ns.num_prompts),
                "--max-concurrency", "1",
                "--disable-tqdm",
            ]
            + (["--tokenizer", ns.tokenizer_path or ns.model_path] if ns.model_path else [])
        )  # fmt: skip
        before = {pid: _cpu_seconds(pid) for pid in procs}
        client_before = sum(os.times()[:2])
        result = run_serving(client_args)
        cpu = {procs[pid]: _cpu_seconds(pid) - t for pid, t in before.items()}
        cpu["bench client"] = sum(os.times()[:2]) - client_before
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    tokens = max(1, int(result["total_output_tokens"]))
    return {
        "loop": loop,
        "median_tpot_ms": result["median_tpot_ms"],
        "median_itl_ms": result["median_itl_ms"],
        "output_throughput": result["output_throughput"],
        "cpu_ms_per_token": {k: v * 1e3 / tokens for k, v in sorted(cpu.items())},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    ns, server_argv = build_parser().parse_known_args(argv)
    server_parser = argparse.ArgumentParser(prog="server options")
    ServerArgs.add_cli_args(server_parser)
    args = ServerArgs.from_cli_args(server_parser.parse_args(server_argv))
    ns.model_path, ns.tokenizer_path = args.model_path, args.tokenizer_path
    from radixserve.utils import configure_logging

    configure_logging(args.log_level)
    step = pure_step_ms(args, ns.input_len, ns.output_len)
    print(f"pure batch-1 decode step (bench one-batch): {step:.2f} ms", flush=True)
    rows = [serve_and_measure(ns, server_argv, loop) for loop in ns.loops]
    print(f"\n{'loop':<8} {'TPOT ms':>8} {'step ms':>8} {'serving ms/token':>17}")
    for row in rows:
        row["serving_cost_ms"] = row["median_tpot_ms"] - step
        print(f"{row['loop']:<8} {row['median_tpot_ms']:>8.2f} {step:>8.2f} "
              f"{row['serving_cost_ms']:>17.2f}")  # fmt: skip
    print("\nCPU ms per output token, by process:")
    for row in rows:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in row["cpu_ms_per_token"].items())
        print(f"  {row['loop']}: {parts}")
    out = {"pure_step_ms": step, "dtype": args.dtype, "rows": rows, "timestamp": time.time()}
    if ns.output_file:
        with open(ns.output_file, "a") as f:
            f.write(json.dumps(out) + "\n")
    return out
