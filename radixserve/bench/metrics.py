"""Per-request timing records and the serving-benchmark metrics computed from them.

The definitions follow SGLang's `bench_serving`:

* TTFT: first chunk carrying output tokens minus the send time.
* ITL: the gap between consecutive chunks that carry output tokens; a chunk that carries n tokens
  contributes n entries of gap / n (a server may batch tokens into one SSE event). The native
  backend knows n from each event's completion_tokens; the openai backend only where a chunk
  carries `usage` (else each chunk is one gap, as in SGLang's and vLLM's clients, so with
  --stream-interval > 1 its ITL is per chunk while TPOT stays per token).
* Output tokens: the server's count (usage, completion_tokens); a server that reports none has
  its generated text re-tokenized with --tokenizer.
* TPOT: (latency - TTFT) / (output_len - 1), only for requests with output_len > 1.
* E2E latency: end of the response minus the send time.
* Throughputs divide token totals of successful requests by the benchmark's wall duration;
  total throughput counts input + output tokens.
* Concurrency: the sum of E2E latencies over the duration (the mean number of requests in flight).
* Cached-token ratio: server-reported cached prompt tokens over prompt tokens, when reported.
* Speculative decoding (radixserve's meta_info): accept length is the tokens committed per
  verify step (accepted drafts + the bonus token), accept rate the share of draft tokens
  accepted, both averaged over all verify steps of the run.

Failed requests count only in `failed` (an HTTP error, an error event, a timeout, or a stream
that ends before its request finished); statistics of nothing measured are None ("n/a"). Called by `bench.serving`; `print_metrics` and
`append_jsonl` are shared with `bench.hf_baseline`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (90, 95, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request; times are `time.perf_counter()` seconds."""

    prompt_len: int = 0  # the server's prompt_tokens when it reports them, else the dataset's
    start_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks with new tokens
    chunk_tokens: list[int] = field(default_factory=list)  # new output tokens in each chunk
    end_time: float = 0.0
    output_len: int = 0
    cached_tokens: int | None = None
    # Speculative decoding, as the server reports it (meta_info): verify steps with drafts,
    # tokens committed per such step, the share of draft tokens accepted, and (radixserve) the
    # draft tokens proposed and accepted.
    spec_verify_ct: int | None = None
    spec_accept_length: float | None = None
    spec_accept_rate: float | None = None
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    success: bool = False
    error: str = ""
    generated_text: str = ""

    def add_chunk(self, now: float, num_tokens: int = 1) -> None:
        self.chunk_times.append(now)
        self.chunk_tokens.append(num_tokens)

    @property
    def ttft(self) -> float:
        first = self.chunk_times[0] if self.chunk_times else self.end_time
        return first - self.start_time

    @property
    def latency(self) -> float:
        return self.end_time - self.start_time

    @property
    def itl(self) -> list[float]:
        gaps: list[float] = []
        for i in range(1, len(self.chunk_times)):
            gap = self.chunk_times[i] - self.chunk_times[i - 1]
            n = max(self.chunk_tokens[i], 1)
            gaps.extend([gap / n] * n)
        return gaps

    @property
    def tpot(self) -> float | None:
        """None with one token, or no timing after the first chunk (a response not streamed
        arrives whole: its TPOT was reported as 0.00 ms, infinitely fast decoding)."""
        if self.output_len <= 1 or len(self.chunk_times) < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated between ranks as numpy's (SGLang's and vLLM's
    benchmarks'); every bench tool reports with it."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def _stats_ms(name: str, values: list[float]) -> dict[str, float | None]:
    """mean / median / std / p90 / p95 / p99 / max in milliseconds (None when nothing was
    measured: every request failed, or TPOT/ITL of a run without streaming)."""
    keys = ["mean", "median", "std", *(f"p{p}" for p in PERCENTILES), "max"]
    if not values:
        return {f"{k}_{name}_ms": None for k in keys}
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    out = {
        f"mean_{name}_ms": float(np.mean(arr)),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(np.std(arr)),
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p))
    out[f"max_{name}_ms"] = float(np.max(arr))
    return out


def compute_metrics(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    """Aggregate metrics over successful records; `duration` is the run's wall time in seconds."""
    assert duration > 0, f"duration must be positive, got {duration}"
    ok = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    latencies = [r.latency for r in ok]
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "input_throughput": total_input / duration,
        "output_throughput": total_output / duration,
        "total_throughput": (total_input + total_output) / duration,
        "concurrency": sum(latencies) / duration,
    }
    metrics.update(_stats_ms("ttft", [r.ttft for r in ok]))
    metrics.update(_stats_ms("itl", [gap for r in ok for gap in r.itl]))
    metrics.update(_stats_ms("tpot", tpots))
    metrics.update(_stats_ms("e2e_latency", latencies))
    metrics.update(_cache_metrics(ok))
    metrics.update(_spec_metrics(ok))
    return metrics


def _spec_metrics(ok: list[RequestRecord]) -> dict[str, Any]:
    """Mean accepted length over all verify steps (weighted by steps), and the share of all
    draft tokens accepted: from the requests' draft counts where the server reports them, else
    their rates weighted by steps (requests draft unevenly per step: 0.47 against the
    server's 0.45)."""
    reported = [r for r in ok if r.spec_verify_ct]
    if not reported:
        return {}
    steps = sum(r.spec_verify_ct or 0 for r in reported)
    drafts = sum(r.spec_draft_tokens or 0 for r in reported)
    if all(r.spec_draft_tokens is not None for r in reported) and drafts:
        rate = sum(r.spec_accepted_tokens or 0 for r in reported) / drafts
    else:
        rate = sum((r.spec_accept_rate or 0.0) * (r.spec_verify_ct or 0) for r in reported) / steps
    return {
        "spec_verify_ct": steps,
        "spec_accept_length": sum(
            (r.spec_accept_length or 0.0) * (r.spec_verify_ct or 0) for r in reported
        )
        / steps,
        "spec_accept_rate": rate,
    }


def _cache_metrics(ok: list[RequestRecord]) -> dict[str, Any]:
    reported = [r for r in ok if r.cached_tokens is not None]
    if not reported:
        return {"total_cached_tokens": None, "cached_token_ratio": None}
    cached = sum(r.cached_tokens or 0 for r in reported)
    prompt = sum(r.prompt_len for r in reported)
    return {"total_cached_tokens": cached, "cached_token_ratio": cached / prompt if prompt else 0.0}


def first_error(records: list[RequestRecord]) -> str | None:
    return next((r.error for r in records if not r.success), None)


_ROWS: list[tuple[str, str]] = [
    ("Successful requests:", "completed"),
    ("Failed requests:", "failed"),
    ("Benchmark duration (s):", "duration"),
    ("Total input tokens:", "total_input_tokens"),
    ("Total generated tokens:", "total_output_tokens"),
    ("Request throughput (req/s):", "request_throughput"),
    ("Input token throughput (tok/s):", "input_throughput"),
    ("Output token throughput (tok/s):", "output_throughput"),
    ("Total token throughput (tok/s):", "total_throughput"),
    ("Concurrency:", "concurrency"),
    ("Cached token ratio:", "cached_token_ratio"),
    ("Speculative verify steps:", "spec_verify_ct"),
    ("Accept length (tokens per verify step):", "spec_accept_length"),
    ("Accept rate (draft tokens):", "spec_accept_rate"),
    ("Number of batches:", "num_batches"),
    ("Mean batch latency (ms):", "mean_batch_latency_ms"),
]
_SECTIONS = [
    ("End-to-End Latency", "e2e_latency", "E2E Latency"),
    ("Time to First Token", "ttft", "TTFT"),
    ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
    ("Inter-Token Latency", "itl", "ITL"),
]

_STATS = [("mean", "Mean"), ("median", "Median")] + [(f"p{p}", f"P{p}") for p in PERCENTILES]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "n/a" if value is None else str(value)


def format_metrics(
    metrics: dict[str, Any], header: dict[str, Any] | None = None, title: str = "Serving Benchmark"
) -> str:
    """SGLang-style result table; `header` rows (backend, rate, ...) come first."""
    lines = [f" {title} Result ".center(60, "=")]
    for label, value in (header or {}).items():
        lines.append(f"{label + ':':<44} {_fmt(value)}")
    for label, key in _ROWS:
        if key in metrics:
            value = metrics[key]
            text = f"{value:.4f}" if key.endswith("ratio") and value is not None else _fmt(value)
            lines.append(f"{label:<44} {text}")
    for section, name, short in _SECTIONS:
        if f"mean_{name}_ms" not in metrics:
            continue
        lines.append(f" {section} ".center(60, "-"))
        for stat, stat_label in _STATS:
            label = f"{stat_label} {short} (ms):"
            lines.append(f"{label:<44} {_fmt(metrics[f'{stat}_{name}_ms'])}")
    lines.append("=" * 60)
    return "\n".join(lines)


def print_metrics(
    metrics: dict[str, Any], header: dict[str, Any] | None = None, title: str = "Serving Benchmark"
) -> None:
    print(format_metrics(metrics, header, title), flush=True)


def finite(value: Any) -> Any:
    """`value` with every NaN or infinite float (nested in dicts, lists, tuples) made None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def json_line(result: Any, **kwargs: Any) -> str:
    """`result` as strict JSON: a statistic of nothing measured, or a NaN / infinity, is null
    (json.dumps writes bare NaN / Infinity, which JSON parsers such as jq reject); values of
    other types are written as their str()."""
    kwargs.setdefault("default", str)
    return json.dumps(finite(result), allow_nan=False, **kwargs)


def append_jsonl(path: str, result: dict[str, Any]) -> None:
    """Append `result` as one JSON line to `path` (created if missing)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json_line(result, sort_keys=True) + "\n")
