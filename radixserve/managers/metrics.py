"""Prometheus metrics of one server, in its own CollectorRegistry (never the global one).

The TokenizerManager calls `on_request` when it dispatches a request and `on_output` for every
output it receives (a user's request: the server's own warm-up and health probes are not
counted); the HTTP server calls `update_from_server_info` with the scheduler's
`get_server_info()` snapshot when `/metrics` is scraped, then serves `render()`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "sglang:"  # SGLang's names, so its dashboards and router read ours
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Scheduler snapshot keys exposed as gauges: key → (metric name, help).
_GAUGES = {
    "running": ("num_running_reqs", "Requests in the running batch."),
    "queued": (
        "num_queue_reqs",
        "Requests in the waiting queue (with P/D, also those waiting for their peer).",
    ),
    "token_usage": ("token_usage", "Fraction of KV slots in use (not free, not evictable)."),
    "available_tokens": ("available_tokens", "Free KV slots."),
    "evictable_tokens": ("evictable_tokens", "KV slots held only by the radix cache."),
    "max_total_num_tokens": ("max_total_num_tokens", "KV pool size in tokens."),
    "new_token_ratio": ("new_token_ratio", "Share of max_new_tokens reserved at admission."),
    "num_used_tokens": ("num_used_tokens", "KV slots in use (not free, not evictable)."),
    "num_grammar_queue_reqs": (
        "num_grammar_queue_reqs",
        "Requests waiting for their grammar to compile.",
    ),
    "gen_throughput": ("gen_throughput", "Tokens generated per second, recently."),
    "cache_hit_rate": ("cache_hit_rate", "Share of recent prompt tokens from the prefix cache."),
    "spec_accept_length": (
        "spec_accept_length",
        "Speculative decoding: tokens committed per verify step (accepted drafts + 1).",
    ),
    "spec_accept_rate": ("spec_accept_rate", "Speculative decoding: draft tokens accepted."),
}
# Scheduler counters since start: key → (metric name without _total, help).
_COUNTERS = {
    "cached_tokens": ("cached_tokens", "Prompt tokens served from the prefix cache."),
    "num_retractions": ("num_retracted_requests", "Requests retracted for lack of KV slots."),
    "spec_verify_ct": ("spec_verify_steps", "Request-steps that verified draft tokens."),
    "spec_draft_tokens": ("spec_draft_tokens", "Draft tokens proposed."),
    "spec_accepted_tokens": ("spec_accepted_tokens", "Draft tokens accepted."),
    "hicache_host_hit_tokens": (
        "hicache_host_hit_tokens",
        "Hierarchical cache: prefix tokens loaded back from the host tier.",
    ),
    "hicache_storage_hit_tokens": (
        "hicache_storage_hit_tokens",
        "Hierarchical cache: prefix tokens read back from the storage tier.",
    ),
}


class _SchedulerCollector:
    """Yields the last scheduler snapshot as gauges and counters (values owned by the scheduler)."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.info: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        names, values = list(self.labels), list(self.labels.values())
        for key, (name, doc) in _GAUGES.items():
            g = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            g.add_metric(values, float(self.info.get(key, 0) or 0))
            yield g
        for key, (name, doc) in _COUNTERS.items():
            c = CounterMetricFamily(PREFIX + name, doc, labels=names)
            c.add_metric(values, float(self.info.get(key, 0) or 0))
            yield c


class ServerMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = list(self.labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, names, registry=self.registry).labels(**self.labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(PREFIX + name, doc, names, buckets=buckets, registry=self.registry)
            return h.labels(**self.labels)

        self.num_requests = counter("num_requests", "Requests dispatched to the scheduler.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of dispatched requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_finished = counter("num_finished_reqs", "Requests finished (any reason).")
        self.num_aborted = counter("num_aborted_requests", "Requests aborted (any cause).")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency.", E2E_BUCKETS)
        self.scheduler = _SchedulerCollector(self.labels)
        self.registry.register(self.scheduler)

    # -- hooks called by the TokenizerManager -----------------------------------------------------
    def on_request(self, prompt_len: int) -> None:
        self.num_requests.inc()
        self.prompt_tokens.inc(prompt_len)

    def on_output(
        self, state: Any, new_tokens: int, now: float, finished_reason: dict[str, Any] | None
    ) -> None:
        """`state.last_time` is 0.0 until the request's first output (set after this call)."""
        if new_tokens > 0:
            self.generation_tokens.inc(new_tokens)
            if state.last_time == 0.0:
                self.ttft.observe(max(now - state.created, 0.0))
            else:
                # Outputs may carry several tokens (stream_interval > 1): latency per token.
                per_token = max(now - state.last_time, 0.0) / new_tokens
                for _ in range(new_tokens):
                    self.itl.observe(per_token)
        if finished_reason is not None:
            self.num_finished.inc()
            if finished_reason.get("type") == "abort":
                self.num_aborted.inc()
            self.e2e.observe(max(now - state.created, 0.0))

    # -- scrape -----------------------------------------------------------------------------------
    def update_from_server_info(self, info: dict[str, Any]) -> None:
        self.scheduler.info = dict(info)

    def render(self) -> bytes:
        return generate_latest(self.registry)
