"""`python -m radixserve bench serving`: an online serving benchmark modelled on SGLang's.

It builds a dataset (`bench.datasets`), sends the requests to a running server through
`bench.client` (native `/generate` or OpenAI `/v1/completions`, streaming SSE) with Poisson or
all-at-once arrivals and an optional concurrency cap, and prints SGLang's metrics table
(`bench.metrics`). `main(argv)` is called by the CLI dispatcher in `__main__.py`.

Prompts are built with `--tokenizer`, else the served model's (the path that GET
/get_model_info names, when it exists on this machine), else the default model's, which a line
on stderr says. A server started with `--api-key` takes `--api-key` or `$OPENAI_API_KEY`.

Example:
    python -m radixserve bench serving --dataset-name random --num-prompts 32 \\
        --random-input-len 200 --random-output-len 128 --max-concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from radixserve.bench import (
    NON_NEGATIVE,
    OUTPUT_FILE,
    PORT,
    POSITIVE,
    SECONDS,
    datasets,
    float_in,
    json_object,
)
from radixserve.bench.client import (
    BACKEND_PATHS,
    AuthError,
    ClientConfig,
    add_api_key_arg,
    discover_model,
    make_client,
    model_info,
    raise_for_auth,
    send_request,
)
from radixserve.bench.datasets import BenchRequest
from radixserve.bench.metrics import (
    RequestRecord,
    append_jsonl,
    compute_metrics,
    first_error,
    print_metrics,
)

WARMUP_OUTPUT_LEN = 16


class WarmupError(RuntimeError):
    """Every warmup request failed: the server or the arguments are wrong."""


async def request_arrivals(
    requests: list[BenchRequest], request_rate: float, seed: int
) -> AsyncIterator[BenchRequest]:
    """Yield requests all at once (rate inf) or with exponential gaps (a Poisson process)."""
    rng = np.random.default_rng(seed)
    for i, req in enumerate(requests):
        if i > 0 and math.isfinite(request_rate):
            await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))
        yield req


async def warmup(client: httpx.AsyncClient, cfg: ClientConfig, req: BenchRequest, n: int) -> None:
    """`n` requests like `req` but its prompt reversed (the same length, and no prefix of the
    run's first request left in the server's cache)."""
    if n <= 0:
        return
    short = replace(req, prompt=req.prompt[::-1], output_len=min(req.output_len, WARMUP_OUTPUT_LEN))
    records = await asyncio.gather(*(send_request(client, cfg, short) for _ in range(n)))
    if not any(r.success for r in records):
        raise WarmupError(f"warmup failed: {records[0].error}")


FLUSH_TRIES = 20  # a server refuses to flush while requests run: 5 s for the last to drain


async def _flush_cache(client: httpx.AsyncClient) -> None:
    """POST /flush_cache. The server refuses (HTTP 400) while requests run, and the previous
    run's last request may still be finishing there after its client saw the final chunk, so
    a refusal is retried for a few seconds before the run goes on with a warm cache."""
    for attempt in range(FLUSH_TRIES):
        try:
            resp = await client.post("/flush_cache")
            status = f"HTTP {resp.status_code}"
        except httpx.HTTPError as e:
            status = f"{type(e).__name__}: {e}"
            break
        raise_for_auth(resp)
        if resp.status_code != 400 or attempt == FLUSH_TRIES - 1:
            break
        await asyncio.sleep(0.25)
    if status != "HTTP 200":
        print(f"warning: /flush_cache failed ({status}); the cache stays warm", file=sys.stderr)


async def run_benchmark(
    cfg: ClientConfig,
    requests: list[BenchRequest],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    warmup_requests: int = 1,
    flush_cache: bool = False,
    seed: int = 1,
    disable_tqdm: bool = False,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[list[RequestRecord], float, ClientConfig]:
    """Run the workload; returns the records (in dataset order), the wall duration and the
    config with the model name resolved."""
    async with make_client(cfg, transport) as client:
        if cfg.backend == "openai" and cfg.model is None:
            cfg = replace(cfg, model=await discover_model(client))
        await warmup(client, cfg, requests[0], warmup_requests)
        if flush_cache:
            await _flush_cache(client)
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        pbar = tqdm(total=len(requests), disable=disable_tqdm)

        async def limited(req: BenchRequest) -> RequestRecord:
            if semaphore is None:
                record = await send_request(client, cfg, req)
            else:
                async with semaphore:
                    record = await send_request(client, cfg, req)
            pbar.update(1)
            return record

        start = time.perf_counter()
        tasks = [
            asyncio.create_task(limited(req))
            async for req in request_arrivals(requests, request_rate, seed)
        ]
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        pbar.close()
    return records, duration, cfg


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m radixserve bench serving",
        description="Benchmark a running server's online serving throughput and latency.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--backend", choices=sorted(BACKEND_PATHS), default="radixserve")
    p.add_argument("--base-url", default=None, help="Overrides --host/--port.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=PORT, default=30000)
    p.add_argument("--model", default=None, help="Model name (openai); default: /v1/models.")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="HF dir or .gguf; default: the served model's (GET /get_model_info), else the "
        "default model's.",
    )
    add_api_key_arg(p)
    datasets.add_dataset_args(p)
    p.add_argument(
        "--request-rate",
        type=float_in(0.0, low_open=True),
        default=math.inf,
        help="req/s; inf = burst.",
    )
    p.add_argument("--max-concurrency", type=POSITIVE, default=None)
    p.add_argument("--seed", type=NON_NEGATIVE, default=1)
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument(
        "--output-file", type=OUTPUT_FILE, default=None, help="Append the result as a JSON line."
    )
    p.add_argument("--warmup-requests", type=NON_NEGATIVE, default=1)
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache after warmup.")
    p.add_argument(
        "--extra-request-body",
        type=json_object,
        default={},
        help="JSON object merged into each request.",
    )
    p.add_argument("--request-timeout", type=SECONDS, default=3600.0, help="Seconds per request.")
    p.add_argument("--tag", default=None, help="Free-form label stored in the output file.")
    return p


def client_config(args: argparse.Namespace) -> ClientConfig:
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    return ClientConfig(
        backend=args.backend,
        base_url=base_url.rstrip("/"),
        model=args.model,
        ignore_eos=not args.disable_ignore_eos,
        stream=not args.disable_stream,
        extra_body=args.extra_request_body,
        request_timeout=args.request_timeout,
        api_key=args.api_key,
    )


def served_tokenizer(
    cfg: ClientConfig, transport: httpx.AsyncBaseTransport | None = None
) -> str | None:
    """The served model's tokenizer, for a run without --tokenizer: the tokenizer_path (else
    the model_path) of GET /get_model_info when it is a path on this machine. None (the default
    model's) from any other server, which one line on stderr says."""

    async def ask() -> tuple[dict[str, Any], str]:
        async with make_client(cfg, transport) as client:
            return await model_info(client)

    info, why = asyncio.run(ask())
    named = [info.get(k) for k in ("tokenizer_path", "model_path")]
    named = [p for p in named if isinstance(p, str) and p]
    for path in named:
        if os.path.exists(path):
            print(f"tokenizer: {path} (the served model's)", file=sys.stderr)
            return path
    if not why:
        why = f"GET /get_model_info names no path on this machine ({', '.join(named) or 'none'})"
    print(
        f"warning: {why}; the prompts are built with the default model's tokenizer "
        "(pass the served model's with --tokenizer)",
        file=sys.stderr,
    )
    return None


def run(
    args: argparse.Namespace,
    tokenizer: Any | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict[str, Any]:
    """Build the dataset, run the benchmark, print the table; returns the result dict."""
    cfg = client_config(args)
    tokenizer_path = args.tokenizer
    if tokenizer is None:
        tokenizer_path = tokenizer_path or served_tokenizer(cfg, transport)
        tokenizer = datasets.load_tokenizer(tokenizer_path)
    cfg = replace(cfg, tokenizer=tokenizer)  # counts tokens without usage
    requests = datasets.build_dataset(args, tokenizer)
    if not requests:
        raise SystemExit("the dataset produced no requests")
    print(datasets.summarize(requests), flush=True)
    records, duration, cfg = asyncio.run(
        run_benchmark(
            cfg,
            requests,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            warmup_requests=args.warmup_requests,
            flush_cache=args.flush_cache,
            seed=args.seed,
            disable_tqdm=args.disable_tqdm,
            transport=transport,
        )
    )
    metrics = compute_metrics(records, duration)
    header = {
        "Backend": cfg.backend,
        "Dataset": args.dataset_name,
        "Traffic request rate": args.request_rate,
        "Max request concurrency": args.max_concurrency or "not set",
    }
    print_metrics(metrics, header)
    error = first_error(records)
    if error:
        print(f"first error: {error}", file=sys.stderr)
    result = {**_run_info(args, cfg), "tokenizer": tokenizer_path, **metrics}
    if args.output_file:
        append_jsonl(args.output_file, result)
    if metrics["completed"] == 0:
        raise SystemExit(f"all {len(records)} requests failed; the first: {error}")
    return result


def _run_info(args: argparse.Namespace, cfg: ClientConfig) -> dict[str, Any]:
    info = {k: v for k, v in vars(args).items() if k not in ("extra_request_body", "api_key")}
    info["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    info.update(backend=cfg.backend, base_url=cfg.base_url, model=cfg.model)
    info["extra_request_body"] = cfg.extra_body
    info["timestamp"] = time.time()
    return info


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """CLI body of `python -m radixserve bench serving`."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (WarmupError, AuthError) as e:  # say why instead of a traceback
        raise SystemExit(str(e)) from e
