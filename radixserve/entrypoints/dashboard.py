"""The live dashboard: GET /dashboard (one static HTML page) and GET /dashboard/events (a
server-sent-events stream of snapshots, about one a second).

`build_app` includes `router` unless --disable-dashboard. The page holds no data and is served
without the API key (http_utils.OPEN_PATHS); the stream needs `Authorization: Bearer <key>`
like every other route, which is why the page reads it with fetch() rather than EventSource.

All clients share one snapshot per interval (`DashboardFeed`): the first stream that finds the
last snapshot stale asks the scheduler (TokenizerManager.get_dashboard_snapshot), the others
await the same answer. A stream ends when its client disconnects (Starlette cancels it), when
the server is shutting down (it checks uvicorn's should_exit every tick) or after a failure.

Each event is `data: <json>` with these fields (where each number comes from):
* time, model, clients (streams connected to this server), new_token_ratio;
* requests: running, waiting, chunked (0/1), grammar_queue, max_running (Scheduler);
  in_flight (TokenizerManager.rid_to_state);
* kv: total, free (allocator), evictable, protected (radix cache), private (the rest: slots
  owned by running requests, not yet in the tree), token_usage;
* tree: nodes, depth, depth_tokens, leaves, truncated, top_prefixes [{tokens, leaves, hits,
  locks, extra_key, preview}] (radix_stats.tree_stats, a walk of at most 4096 nodes),
  cached_tokens (evictable + protected), hit_rate (cached / prompt tokens since start),
  window_hit_rate (the same over the last five minutes);
* steps: t, mode (prefill | decode | mixed), prefill and decode tokens, batch size of the last
  120 steps (LiveStats' ring);
* throughput: prompt_tps and generation_tps (means over rate_window_s = 10 s) and series {t,
  prompt, cached, generation}: tokens per second over window_s = 300 s (LiveStats);
* latency: ttft_mean, ttft_max, tpot_mean (streaming requests), e2e_mean (all), their counts
  streamed_requests and finished_requests, and per-second series over window_s
  (TokenizerManager.latency_window);
* counters since start (SchedulerStats; clients' requests, not the warm-up or probes):
  num_requests, num_finished, num_aborted, num_retractions, prompt_tokens, cached_tokens,
  generation_tokens, num_prefill_batches, num_decode_batches.
A snapshot the scheduler did not answer in time is `{"time", "error"}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from functools import cache
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import HTMLResponse, Response, StreamingResponse

from radixserve.entrypoints.http_utils import SSE_HEADERS, sse_event
from radixserve.entrypoints.openai_api import served_model_name

INTERVAL_S = 1.0  # one snapshot a second
TICK_S = 0.2  # how often a waiting stream checks for shutdown
SNAPSHOT_TIMEOUT_S = 10.0
COUNTERS = (  # SchedulerStats' counters since start that the page shows
    "num_requests",
    "num_finished",
    "num_aborted",
    "num_retractions",
    "prompt_tokens",
    "cached_tokens",
    "generation_tokens",
    "num_prefill_batches",
    "num_decode_batches",
)

router = APIRouter()


@cache
def page_html() -> str:
    return resources.files("radixserve.entrypoints").joinpath("static/dashboard.html").read_text()


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> Response:
    return HTMLResponse(page_html(), headers={"Cache-Control": "no-cache"})


@router.get("/dashboard/events", include_in_schema=False)
async def dashboard_events(request: Request) -> Response:
    return StreamingResponse(
        feed_of(request).stream(), media_type="text/event-stream", headers=SSE_HEADERS
    )


def feed_of(request: Request) -> DashboardFeed:
    app_state = request.app.state
    feed = getattr(app_state, "dashboard_feed", None)
    if feed is None:
        feed = app_state.dashboard_feed = DashboardFeed(app_state.rs)
    return feed


class DashboardFeed:
    """One snapshot per interval, shared by every connected stream."""

    def __init__(self, state: Any, interval_s: float = INTERVAL_S) -> None:
        self.state = state  # http_server.AppState: tokenizer_manager, server, failure
        self.interval_s = interval_s
        self.clients = 0
        self._pending: asyncio.Future | None = None
        self._fetched_at = -float("inf")

    def closing(self) -> bool:
        server = self.state.server
        return self.state.failure is not None or (server is not None and server.should_exit)

    async def stream(self) -> AsyncIterator[bytes]:
        self.clients += 1
        try:
            while not self.closing():
                yield sse_event(await self.latest())
                deadline = time.monotonic() + self.interval_s
                while not self.closing() and time.monotonic() < deadline:
                    await asyncio.sleep(TICK_S)
        finally:
            self.clients -= 1
            if self.clients == 0 and self._pending is not None:
                self._pending.cancel()  # no one waits for it any more: no task outlives us

    async def latest(self) -> dict[str, Any]:
        """The current snapshot, asking the scheduler at most once per interval."""
        stale = time.monotonic() - self._fetched_at >= self.interval_s * 0.8
        pending = self._pending
        if pending is None or pending.cancelled() or (pending.done() and stale):
            self._fetched_at = time.monotonic()
            self._pending = asyncio.ensure_future(self._fetch())
        try:
            return await asyncio.shield(self._pending)  # a client leaving cancels only itself
        except Exception as e:
            return {"time": time.time(), "error": f"no snapshot from the scheduler: {e!r}"}

    async def _fetch(self) -> dict[str, Any]:
        tm = self.state.tokenizer_manager
        snap = await tm.get_dashboard_snapshot(SNAPSHOT_TIMEOUT_S)
        model = served_model_name(self.state.server_args)
        return {**shape(snap, getattr(tm, "tokenizer", None), model), "clients": self.clients}


def shape(snap: dict[str, Any], tokenizer: Any, model: str) -> dict[str, Any]:
    """The scheduler's flat snapshot grouped as the page draws it (the documented fields)."""
    total = snap["max_total_num_tokens"]
    free, evictable = snap["available_tokens"], snap["evictable_tokens"]
    protected = snap["protected_tokens"]
    tree = {k: v for k, v in snap["tree"].items() if k != "top_prefixes"}
    tree["top_prefixes"] = [_with_preview(p, tokenizer) for p in snap["tree"]["top_prefixes"]]
    tree["cached_tokens"] = evictable + protected
    prompt, cached = snap["prompt_tokens"], snap["cached_tokens"]
    tree["hit_rate"] = cached / prompt if prompt else None
    throughput = dict(snap["throughput"])
    tree["window_hit_rate"] = throughput.pop("window_hit_rate")
    return {
        "time": time.time(),
        "model": model,
        "requests": {
            "running": snap["running"],
            "waiting": snap["queued"],
            "chunked": snap["chunked"],
            "grammar_queue": snap["grammar_queue"],
            "in_flight": snap["in_flight"],
            "max_running": snap["max_running_requests"],
        },
        "kv": {
            "total": total,
            "free": free,
            "evictable": evictable,
            "protected": protected,
            "private": total - free - evictable - protected,  # running requests' own slots
            "token_usage": snap["token_usage"],
        },
        "tree": tree,
        "steps": snap["steps"],
        "throughput": throughput,
        "latency": snap["latency"],
        "counters": {key: snap[key] for key in COUNTERS},
        "new_token_ratio": snap["new_token_ratio"],
    }


def _with_preview(prefix: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """A top prefix with its first and last token ids decoded into `preview` ("head … tail")."""
    out = {k: v for k, v in prefix.items() if k not in ("head_ids", "tail_ids")}
    out["preview"] = _decode(tokenizer, prefix["head_ids"])
    if prefix["tail_ids"]:
        out["preview"] += " … " + _decode(tokenizer, prefix["tail_ids"])
    return out


def _decode(tokenizer: Any, ids: list[int]) -> str:
    if tokenizer is None:
        return " ".join(map(str, ids))
    with contextlib.suppress(Exception):
        return tokenizer.decode(ids, skip_special_tokens=False)
    return ""
