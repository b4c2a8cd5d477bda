"""`python -m radixserve bench soak`: a bounded saturation run against a live server.

`--concurrency` workers each loop until the deadline, picking a seeded random action from
`bench.soak_actions` (streaming chat, completions, native /generate, aborts, client disconnects,
bad input, grammar requests). The run has two phases: a warm-up, after which the workload drains
and the server's RSS is sampled (server process, scheduler, detokenizer: pids from /server_info),
then the soak itself, after which the workload drains again, RSS is sampled again and
/server_info must show every KV slot free or evictable, no radix node locked and every request
row free. The report counts outcomes per kind; the run fails (exit 1) when an invariant breaks:
a 5xx other than 503, a lost or unacknowledged abort, an invalid response, a timeout, a leaked
slot, lock or row, or RSS growth above `--max-rss-growth`. Driven by `scripts/soak.sh`.

Example:
    python -m radixserve bench soak --port 30000 --duration 600 --concurrency 32 --output soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from radixserve.bench import NON_NEGATIVE, OUTPUT_FILE, PORT, POSITIVE, SECONDS, float_in
from radixserve.bench.client import (
    AuthError,
    ClientConfig,
    add_api_key_arg,
    discover_model,
    make_client,
    raise_for_auth,
)
from radixserve.bench.metrics import json_line, percentile
from radixserve.bench.soak_actions import (
    ACTIONS,
    DEFAULT_MIX,
    FAILURES,
    HTTP_503,
    OK,
    RESULTS,
    ActionContext,
    Outcome,
    run_action,
)
from radixserve.bench.soak_inputs import WORDS
from radixserve.bench.soak_report import evaluate, print_report, rows_key

MAX_FAILURE_EXAMPLES = 50
RETRY_AFTER_S = 1.0  # a worker's pause after a 503


@dataclass(frozen=True)
class SoakConfig:
    base_url: str
    duration: float = 600.0
    warmup: float = 15.0
    concurrency: int = 32
    seed: int = 0
    max_new_tokens: int = 64
    abort_new_tokens: int = 256
    max_prompt_tokens: int = 1024
    abort_delay_max: float = 2.0
    abort_grace: float = 5.0
    request_timeout: float = 600.0
    drain_timeout: float = 60.0
    max_rss_growth: float = 0.05
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    pids: tuple[int, ...] = ()
    model: str | None = None
    progress_interval: float = 30.0
    api_key: str | None = field(default=None, repr=False)  # None: $OPENAI_API_KEY, if set


class Tally:
    """Outcome counts per kind, and the first failures with what was sent."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter[str]] = {kind: Counter() for kind in ACTIONS}
        self.latencies: dict[str, list[float]] = {kind: [] for kind in ACTIONS}
        self.failures: list[dict[str, Any]] = []

    def add(self, outcome: Outcome) -> None:
        self.counts[outcome.kind][outcome.result] += 1
        if outcome.result == OK:
            self.latencies[outcome.kind].append(outcome.latency)
        if outcome.result in FAILURES and len(self.failures) < MAX_FAILURE_EXAMPLES:
            self.failures.append(asdict(outcome))

    def latency_summary(self) -> dict[str, dict[str, float]]:
        """Seconds per request served normally: p50, p99 and max per kind."""
        out = {}
        for kind, values in self.latencies.items():
            if values:
                v = sorted(values)
                out[kind] = {"p50": percentile(v, 50), "p99": percentile(v, 99), "max": v[-1]}
        return out

    def totals(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for counts in self.counts.values():
            total.update(counts)
        return total


# -- server state ----------------------------------------------------------------------------------
async def server_info(client: httpx.AsyncClient) -> dict[str, Any]:
    resp = await client.get("/server_info")
    raise_for_auth(resp)
    resp.raise_for_status()
    return resp.json()


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def server_pids(info: dict[str, Any], extra: tuple[int, ...] = ()) -> list[int]:
    """The HTTP server (the scheduler's parent), the scheduler, the detokenizer, and `extra`."""
    pids = [info.get("scheduler_pid"), info.get("detokenizer_pid")]
    if info.get("scheduler_pid"):
        parent = _ppid(int(info["scheduler_pid"]))
        pids.insert(0, parent if parent not in (None, 0, 1, os.getpid()) else None)
    out = [int(p) for p in (*pids, *extra) if p]
    return list(dict.fromkeys(out))


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except Exception:  # no psutil, another machine, or the process is gone
        return None


def sample_rss(pids: list[int]) -> dict[str, int | None]:
    return {str(pid): rss_bytes(pid) for pid in pids}


def is_drained(info: dict[str, Any]) -> bool:
    free = info["available_tokens"] + info["evictable_tokens"]
    return (
        info.get("running") == 0
        and info.get("queued") == 0
        and free == info["max_total_num_tokens"]
        and info.get("protected_tokens", 0) == 0
        and info.get("free_request_rows") == info.get(rows_key(info))
    )


async def wait_drained(client: httpx.AsyncClient, timeout: float) -> tuple[dict[str, Any], bool]:
    """Poll /server_info until the workload has drained; (last info, whether it drained).
    A server that does not answer gives ({"error": ...}, False)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = await server_info(client)
        except (httpx.HTTPError, ValueError) as e:
            return {"error": f"/server_info failed: {type(e).__name__}: {e}"}, False
        if is_drained(info):
            return info, True
        if time.monotonic() > deadline:
            return info, False
        await asyncio.sleep(0.25)


async def health(client: httpx.AsyncClient) -> int:
    try:
        return (await client.get("/health")).status_code
    except httpx.HTTPError:
        return 0


# -- workload --------------------------------------------------------------------------------------
@dataclass
class Limits:
    context_len: int
    tokens_per_word: float
    max_prompt_words: int
    max_new_tokens: int
    abort_new_tokens: int


async def probe(client: httpx.AsyncClient, cfg: SoakConfig, model: str) -> Limits:
    """Size prompts to the model: its context length and the tokens per word of our prompts."""
    resp = await client.get("/v1/models")
    raise_for_auth(resp)
    models = resp.json().get("data") or [{}]
    ctx = int(models[0].get("max_model_len") or 2048)
    text = " ".join(random.Random(cfg.seed).choices(WORDS, k=100))
    body = {"model": model, "prompt": text, "max_tokens": 1}
    resp = await client.post("/v1/completions", json=body)
    raise_for_auth(resp)
    if resp.status_code != 200:
        raise SystemExit(f"the server does not serve a probe request: {resp.text[:300]}")
    per_word = resp.json()["usage"]["prompt_tokens"] / 100
    max_new = min(cfg.max_new_tokens, ctx // 4)
    abort_new = min(cfg.abort_new_tokens, ctx // 4)
    room = ctx - max(max_new, abort_new) - 64  # 64: chat template and special tokens
    words = int(min(room, cfg.max_prompt_tokens) / per_word * 0.8)
    if words < 8:
        raise SystemExit(f"context length {ctx} leaves no room for prompts")
    return Limits(ctx, per_word, words, max_new, abort_new)


def make_contexts(
    client: httpx.AsyncClient, cfg: SoakConfig, model: str, limits: Limits
) -> list[ActionContext]:
    run_tag = uuid.uuid4().hex[:8]  # rids unique across runs; choices stay seeded
    return [
        ActionContext(
            client=client,
            rng=random.Random(f"{cfg.seed}:{i}"),
            model=model,
            max_new_tokens=limits.max_new_tokens,
            abort_new_tokens=limits.abort_new_tokens,
            max_prompt_words=limits.max_prompt_words,
            abort_delay_max=cfg.abort_delay_max,
            abort_grace=cfg.abort_grace,
            rid_prefix=f"soak-{run_tag}-w{i}",
        )
        for i in range(cfg.concurrency)
    ]


async def _worker(ctx: ActionContext, cfg: SoakConfig, deadline: float, tally: Tally) -> None:
    kinds = [k for k, w in cfg.mix.items() if w > 0]
    weights = [cfg.mix[k] for k in kinds]
    while time.monotonic() < deadline:
        kind = ctx.rng.choices(kinds, weights)[0]
        outcome = await run_action(kind, ctx, cfg.request_timeout)
        tally.add(outcome)
        if outcome.result == HTTP_503:  # overloaded: back off as Retry-After asks
            await asyncio.sleep(RETRY_AFTER_S)


async def _progress(tally: Tally, start: float, interval: float, label: str) -> None:
    while interval > 0:
        await asyncio.sleep(interval)
        totals = tally.totals()
        bad = sum(totals[r] for r in FAILURES)
        print(
            f"[{label} {time.monotonic() - start:6.0f} s] {sum(totals.values())} requests, "
            f"{bad} failures",
            flush=True,
        )


async def run_phase(
    contexts: list[ActionContext], cfg: SoakConfig, seconds: float, tally: Tally, label: str
) -> float:
    """All workers until `seconds` have passed (then each finishes its action); wall time."""
    start = time.monotonic()
    ticker = asyncio.ensure_future(_progress(tally, start, cfg.progress_interval, label))
    try:
        await asyncio.gather(*(_worker(c, cfg, start + seconds, tally) for c in contexts))
    finally:
        ticker.cancel()
    return time.monotonic() - start


async def soak(cfg: SoakConfig, transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """The whole run; returns the report (see `soak_report.evaluate` for the checks)."""
    client_cfg = ClientConfig(
        "openai", cfg.base_url, read_timeout=cfg.request_timeout, api_key=cfg.api_key
    )
    async with make_client(client_cfg, transport) as client:
        model = cfg.model or await discover_model(client)
        limits = await probe(client, cfg, model)
        contexts = make_contexts(client, cfg, model, limits)
        tally = Tally()
        warm_s = await run_phase(contexts, cfg, cfg.warmup, tally, "warm-up")
        info, _ = await wait_drained(client, cfg.drain_timeout)
        pids = server_pids(info, cfg.pids)
        rss_start = sample_rss(pids)
        soak_s = await run_phase(contexts, cfg, cfg.duration, tally, "soak")
        info, drained = await wait_drained(client, cfg.drain_timeout)
        rss_end = sample_rss(pids)
        status = await health(client)
    report = {
        "config": {**_public(cfg), "model": model},
        "limits": asdict(limits),
        "wall_s": {"warmup": warm_s, "soak": soak_s},
        "counts": {kind: dict(c) for kind, c in tally.counts.items()},
        "totals": {r: tally.totals()[r] for r in RESULTS},
        "latency_s": tally.latency_summary(),
        "failures": tally.failures,
        "rss": {"pids": pids, "start": rss_start, "end": rss_end},
        "server_info_end": _public(info),
        "drained": drained,
        "health_status_end": status,
    }
    return evaluate(report, cfg.max_rss_growth)


def _public(cfg: SoakConfig | dict[str, Any]) -> dict[str, Any]:
    """The config, or the server's /server_info (its ServerArgs), as the report shows them:
    without the API key."""
    fields = asdict(cfg) if isinstance(cfg, SoakConfig) else cfg
    return {k: v for k, v in fields.items() if k != "api_key"}


# -- CLI -------------------------------------------------------------------------------------------
def _parse_mix(text: str | None) -> dict[str, float]:
    mix = dict(DEFAULT_MIX)
    for item in (text or "").split(","):
        if item.strip():
            name, _, weight = item.partition("=")
            if name.strip() not in ACTIONS:
                raise ValueError(f"--mix: unknown kind {name!r}; kinds: {', '.join(ACTIONS)}")
            value = float(weight)  # a ValueError names a weight that is no number
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"--mix: the weight of {name.strip()} must be >= 0, got {weight}")
            mix[name.strip()] = value
    if not any(w > 0 for w in mix.values()):
        raise ValueError("--mix: every weight is 0; give at least one kind a positive weight")
    return mix


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m radixserve bench soak",
        description="A bounded saturation run mixing every kind of request against a server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base-url", default=None, help="Overrides --host/--port.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=PORT, default=30000)
    p.add_argument("--model", default=None, help="Model name; default: /v1/models.")
    add_api_key_arg(p)
    p.add_argument("--duration", type=SECONDS, default=600.0, help="Seconds of soak.")
    p.add_argument(
        "--warmup", type=float_in(0.0), default=15.0, help="Seconds before the RSS baseline."
    )
    p.add_argument("--concurrency", type=POSITIVE, default=32)
    p.add_argument("--seed", type=NON_NEGATIVE, default=0)
    p.add_argument("--max-new-tokens", type=POSITIVE, default=64, help="Cap of ordinary requests.")
    p.add_argument("--abort-new-tokens", type=POSITIVE, default=256, help="Requests to abort.")
    p.add_argument("--max-prompt-tokens", type=POSITIVE, default=1024, help="Longest prompts.")
    p.add_argument(
        "--abort-delay-max", type=float_in(0.0), default=2.0, help="Seconds before abort."
    )
    p.add_argument("--abort-grace", type=float_in(0.0), default=5.0, help="See soak_actions.")
    p.add_argument("--request-timeout", type=SECONDS, default=600.0, help="A hang.")
    p.add_argument("--drain-timeout", type=SECONDS, default=60.0)
    p.add_argument(
        "--max-rss-growth", type=float_in(0.0), default=0.05, help="Fraction, 0.05 = 5%%."
    )
    p.add_argument("--mix", default=None, help="kind=weight,... over " + ",".join(ACTIONS))
    p.add_argument("--pids", type=POSITIVE, nargs="*", default=[], help="More pids to sample RSS.")
    p.add_argument("--progress-interval", type=float_in(0.0), default=30.0, help="0 = quiet.")
    p.add_argument("--output", type=OUTPUT_FILE, default=None, help="Write the report as JSON.")
    return p


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    return SoakConfig(
        base_url=base_url.rstrip("/"),
        duration=args.duration,
        warmup=args.warmup,
        concurrency=args.concurrency,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        abort_new_tokens=args.abort_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        abort_delay_max=args.abort_delay_max,
        abort_grace=args.abort_grace,
        request_timeout=args.request_timeout,
        drain_timeout=args.drain_timeout,
        max_rss_growth=args.max_rss_growth,
        mix=_parse_mix(args.mix),
        pids=tuple(args.pids),
        model=args.model,
        progress_interval=args.progress_interval,
        api_key=args.api_key,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """CLI body of `python -m radixserve bench soak`; exits 1 when an invariant failed."""
    args = build_parser().parse_args(argv)
    try:
        report = asyncio.run(soak(config_from_args(args)))
    except AuthError as e:  # one line, not a traceback
        raise SystemExit(str(e)) from e
    print_report(report)
    if args.output:
        with open(args.output, "w") as f:
            f.write(json_line(report, indent=2) + "\n")
    if not report["passed"]:
        print("soak FAILED", file=sys.stderr)
        raise SystemExit(1)
    return report
