"""The live dashboard (GET /dashboard, GET /dashboard/events): the shared feed (one scheduler
round trip per interval, a clean end on disconnect and on shutdown), the routes' status codes,
a live server under load, and headless Chromium reading the page. The bookkeeping behind it is
tested in tests/managers/test_live_stats.py and tests/mem_cache/test_radix_stats.py.

The browser test drives Debian's /usr/bin/chromium through playwright (`make browser`, never
`playwright install`). It skips when either is missing, except with RADIXSERVE_REQUIRE_BROWSER=1
(CI), where it fails. It saves a screenshot to test-artifacts/dashboard.png in the repository
root (gitignored), or to $RADIXSERVE_ARTIFACTS_DIR/dashboard.png.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from rs_fake_worker import FakeRun
from rs_testing import make_tiny_served_model
from test_http_server import ServerProcess

from radixserve.args import ServerArgs
from radixserve.entrypoints.dashboard import DashboardFeed, page_html
from radixserve.managers.live_stats import LatencyWindow

API_KEY = "dash+key/x=&y"  # "+" and "&" as base64-style keys have them (#key= keeps them)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYSTEM = "You are a helpful assistant. Answer in one short sentence, please. "
# The documented snapshot: top-level key -> its keys.
FIELDS = {
    "requests": {"running", "waiting", "chunked", "grammar_queue", "in_flight", "max_running"},
    "kv": {"total", "free", "evictable", "protected", "private", "token_usage"},
    "tree": {
        "nodes",
        "cached_tokens",
        "depth",
        "depth_tokens",
        "leaves",
        "truncated",
        "hit_rate",
        "window_hit_rate",
        "top_prefixes",
    },
    "steps": {"t", "mode", "prefill", "decode", "batch"},
    "throughput": {"window_s", "rate_window_s", "prompt_tps", "generation_tps", "series"},
    "latency": {
        "window_s",
        "ttft_mean",
        "ttft_max",
        "tpot_mean",
        "e2e_mean",
        "streamed_requests",
        "finished_requests",
        "series",
    },
    "counters": {
        "num_requests",
        "num_finished",
        "num_aborted",
        "num_retractions",
        "prompt_tokens",
        "cached_tokens",
        "generation_tokens",
        "num_prefill_batches",
        "num_decode_batches",
    },
}
PREFIX_FIELDS = {"tokens", "leaves", "hits", "locks", "extra_key", "preview"}


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7 + i * 3) % 90 + 3 for i in range(n)]


# -- the shared feed -----------------------------------------------------------------------------
class FeedTM:
    """Answers get_dashboard_snapshot from a drained fake-worker scheduler."""

    tokenizer = None

    def __init__(self, delay: float = 0.0, fail: bool = False) -> None:
        run = FakeRun(total_tokens=1024, overlap=False)
        run.submit("a", _prompt(1, 12), max_new=3)
        run.drain()
        self.snapshot = run.s.dashboard_snapshot()
        self.delay, self.fail, self.calls = delay, fail, 0

    async def get_dashboard_snapshot(self, timeout: float) -> dict[str, Any]:
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.fail:
            raise TimeoutError("the scheduler did not answer")
        snap = copy.deepcopy(self.snapshot)
        return {**snap, "in_flight": 0, "latency": LatencyWindow().snapshot()}


def _feed(tm: FeedTM, interval_s: float = 0.3) -> DashboardFeed:
    server = SimpleNamespace(should_exit=False)
    state = SimpleNamespace(
        tokenizer_manager=tm, server=server, failure=None, server_args=ServerArgs(model_path="m")
    )
    return DashboardFeed(state, interval_s)


async def _events(gen: Any, n: int) -> list[dict[str, Any]]:
    out = []
    async for chunk in gen:
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
        out.append(json.loads(chunk[6:]))
        if len(out) == n:
            break
    return out


def test_streams_share_one_scheduler_round_trip_per_interval():
    async def main() -> None:
        tm = FeedTM(delay=0.02)
        feed = _feed(tm)
        gens = [feed.stream() for _ in range(3)]
        results = await asyncio.gather(*(_events(g, 4) for g in gens))
        for gen in gens:
            await gen.aclose()
        assert all(len(r) == 4 for r in results)
        assert set(results[0][0]) >= {*FIELDS, "time", "model", "clients"}
        assert results[0][0]["model"] == "m"
        assert tm.calls <= 5, f"{tm.calls} round trips for 3 clients x 4 snapshots"
        assert feed.clients == 0

    asyncio.run(main())


def test_a_client_that_leaves_mid_fetch_leaves_no_task_behind():
    async def main() -> None:
        tm = FeedTM(delay=30.0)  # the scheduler never answers in time
        feed = _feed(tm)
        reader = asyncio.create_task(_events(feed.stream(), 1))
        while tm.calls == 0:
            await asyncio.sleep(0.01)
        assert feed.clients == 1
        reader.cancel()  # what Starlette does when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await reader
        await asyncio.sleep(0.01)
        assert feed.clients == 0
        assert feed._pending is not None and feed._pending.cancelled()
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())


def test_the_stream_ends_when_the_server_shuts_down_and_reports_scheduler_errors():
    async def main() -> None:
        feed = _feed(FeedTM(fail=True), interval_s=30.0)
        gen = feed.stream()
        first = json.loads((await gen.__anext__())[6:])
        assert "no snapshot from the scheduler" in first["error"]
        waiting = asyncio.ensure_future(gen.__anext__())  # now sleeping until the next one
        await asyncio.sleep(0.1)
        started = time.monotonic()
        feed.state.server.should_exit = True
        with pytest.raises(StopAsyncIteration):
            await waiting
        assert time.monotonic() - started < 1.0, "a 30 s interval must not delay shutdown"
        assert feed.clients == 0

    asyncio.run(main())


# -- routes --------------------------------------------------------------------------------------
def test_the_page_is_open_and_the_stream_needs_the_api_key(fake_tm, make_client):
    with make_client(fake_tm, api_key=API_KEY) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'id="generation-tokens"' in page.text and "/events" in page.text
        assert client.get("/dashboard/").status_code == 200  # redirected, not refused
        assert client.get("/metrics/").status_code == 200
        assert client.get("/dashboard/events").status_code == 401
        assert client.get("/dashboard/events/").status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert client.get("/dashboard/events", headers=wrong).status_code == 401
        paths = client.get("/openapi.json", headers=AUTH).json()["paths"]
        assert not any(p.startswith("/dashboard") for p in paths), "kept out of the fuzzed API"


def test_disable_dashboard_turns_both_routes_off(fake_tm, make_client):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args(["--disable-dashboard"])).disable_dashboard
    assert not ServerArgs.from_cli_args(parser.parse_args([])).disable_dashboard
    with make_client(fake_tm, disable_dashboard=True) as client:
        assert client.get("/dashboard").status_code == 404
        assert client.get("/dashboard/events").status_code == 404
        assert client.get("/health").status_code == 200


def test_the_page_ships_as_package_data():
    html = page_html()
    assert html.startswith("<!doctype html>")
    assert "http://" not in html and "https://" not in html, "no external resources"


# -- a live server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_served_model(str(tmp_path_factory.mktemp("dashboard_model")))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[ServerProcess]:
    extra = ["--model-path", tiny_model, "--api-key", API_KEY, "--chunked-prefill-size", "64"]
    proc = ServerProcess(str(tmp_path_factory.mktemp("dashboard_server")), *extra)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _load_bodies(n: int, new_tokens: int) -> list[dict[str, Any]]:
    params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}
    text = SYSTEM * 3 + "Question {}: name a colour."
    return [{"text": text.format(i), "sampling_params": params, "stream": True} for i in range(n)]


async def _run_load(url: str, bodies: list[dict[str, Any]]) -> list[int]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=300, limits=limits) as c:

        async def one(body: dict[str, Any]) -> int:
            async with c.stream("POST", "/generate", json=body) as r:
                async for _ in r.aiter_lines():
                    pass
                return r.status_code

        return list(await asyncio.gather(*(one(b) for b in bodies)))


async def _read_events(client: httpx.AsyncClient, out: list[dict], stop: asyncio.Event) -> None:
    async with client.stream("GET", "/dashboard/events") as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
            if stop.is_set():
                return


def test_live_snapshots_have_the_documented_fields_and_move_under_load(server):
    n, new_tokens = 10, 40

    async def main() -> tuple[list[dict], list[int]]:
        events: list[dict] = []
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            reader = asyncio.create_task(_read_events(client, events, stop))
            while not events:
                await asyncio.sleep(0.05)
            # Snapshots come once a second and a round of load can be shorter: load again until
            # one snapshot has seen requests running (bounded).
            statuses: list[int] = []
            deadline = time.monotonic() + 120
            load = asyncio.create_task(_run_load(server.url, _load_bodies(n, new_tokens)))
            while not any(e["requests"]["running"] > 0 for e in events):
                assert time.monotonic() < deadline, "no snapshot saw a running request"
                if load.done():
                    statuses += load.result()
                    load = asyncio.create_task(_run_load(server.url, _load_bodies(n, new_tokens)))
                await asyncio.sleep(0.05)
            statuses += await load
            before = len(events)
            while len(events) < before + 2:  # a snapshot taken after the load
                await asyncio.sleep(0.05)
            stop.set()
            await reader
        return events, statuses

    events, statuses = asyncio.run(main())
    assert len(statuses) >= n and statuses == [200] * len(statuses)
    first, last = events[0], events[-1]
    for key, fields in FIELDS.items():
        assert set(first[key]) == fields, key
    assert {"time", "model", "clients", "new_token_ratio"} <= set(first)
    done = last["counters"]["generation_tokens"] - first["counters"]["generation_tokens"]
    assert done >= n * new_tokens
    assert last["counters"]["num_finished"] - first["counters"]["num_finished"] >= n
    assert any(e["requests"]["running"] > 0 for e in events), "no snapshot saw a running request"
    assert last["throughput"]["generation_tps"] > 0 and last["throughput"]["prompt_tps"] > 0
    assert {"prefill", "decode"} <= set(last["steps"]["mode"])
    latency = last["latency"]
    assert latency["streamed_requests"] >= n and latency["ttft_mean"] > 0
    assert latency["tpot_mean"] > 0 and latency["e2e_mean"] >= latency["ttft_mean"]
    tree = last["tree"]
    assert 0 < tree["hit_rate"] < 1 and tree["nodes"] >= 2
    top = tree["top_prefixes"][0]
    assert set(top) == PREFIX_FIELDS
    assert top["leaves"] >= n and top["preview"] and SYSTEM.startswith(top["preview"][:20])
    kv = last["kv"]  # drained: every slot free or cached, nothing locked
    assert kv["protected"] == kv["private"] == 0
    assert kv["free"] + kv["evictable"] == kv["total"]
    assert kv["evictable"] == tree["cached_tokens"] > 0


def test_live_stream_needs_the_key_and_forgets_a_client_that_left(server):
    assert httpx.get(server.url + "/dashboard/events", timeout=10).status_code == 401
    assert httpx.get(server.url + "/dashboard", timeout=10).status_code == 200

    async def main() -> None:
        async with (
            httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as a,
            httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as b,
        ):
            seen_a: list[dict] = []
            stop_a = asyncio.Event()
            reader_a = asyncio.create_task(_read_events(a, seen_a, stop_a))

            async def until_two_clients() -> None:
                async with b.stream("GET", "/dashboard/events") as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and json.loads(line[6:])["clients"] == 2:
                            return

            await asyncio.wait_for(until_two_clients(), 15)
            # b has disconnected: a's snapshots soon count one client again.
            deadline = time.monotonic() + 10
            while not (seen_a and seen_a[-1]["clients"] == 1):
                assert time.monotonic() < deadline, [e["clients"] for e in seen_a]
                await asyncio.sleep(0.1)
            stop_a.set()
            await reader_a

    asyncio.run(main())


def test_the_server_exits_promptly_with_a_dashboard_client_connected(tiny_model, tmp_path):
    proc = ServerProcess(str(tmp_path), "--model-path", tiny_model)
    ended: dict[str, Any] = {}

    def read() -> None:
        try:
            with httpx.stream("GET", proc.url + "/dashboard/events", timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        ended["events"] = ended.get("events", 0) + 1
            ended["at"] = time.monotonic()  # the stream ended cleanly
        except httpx.HTTPError as e:
            ended["error"] = repr(e)

    try:
        proc.wait_ready()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + 10
        while ended.get("events", 0) < 2:
            assert time.monotonic() < deadline and reader.is_alive(), ended
            time.sleep(0.05)
        signalled = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        proc.proc.wait(15)
        reader.join(5)
        exited = time.monotonic() - signalled
    finally:
        proc.stop()
    assert "error" not in ended, ended
    # uvicorn would wait GRACEFUL_SHUTDOWN_S (3 s) for the stream, then cancel it.
    assert ended["at"] - signalled < 2.5
    assert proc.proc.returncode == 0 and exited < 10
    assert "timeout graceful shutdown exceeded" not in proc.log()


# -- headless Chromium ---------------------------------------------------------------------------
def _browser_or_skip() -> Any:
    missing = []
    if not os.path.exists(CHROMIUM):
        missing.append(f"{CHROMIUM} (`make browser` installs Debian's chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
        missing.append("the playwright package (pip install -e '.[dev]')")
    if missing:
        reason = "the dashboard browser test needs " + " and ".join(missing)
        if os.environ.get("RADIXSERVE_REQUIRE_BROWSER") == "1":
            pytest.fail(reason + " (RADIXSERVE_REQUIRE_BROWSER=1)")
        pytest.skip(reason)
    return sync_playwright


def _number(page: Any, element_id: str) -> int:
    text = page.inner_text(f"#{element_id}")
    digits = "".join(ch for ch in text if ch.isdigit())
    return int(digits) if digits else -1


def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_the_page_in_headless_chromium_shows_live_numbers(server):
    sync_playwright = _browser_or_skip()
    shots = os.environ.get("RADIXSERVE_ARTIFACTS_DIR") or os.path.join(REPO_ROOT, "test-artifacts")
    os.makedirs(shots, exist_ok=True)
    n, new_tokens = 12, 96
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            # A key no HTTP header can carry ("€": fetch throws) is asked for again: it was
            # taken for a lost connection and retried for ever, and stayed in sessionStorage.
            asking = browser.new_page()
            asking.goto(server.url + "/dashboard#key=%E2%82%AC")
            asking.wait_for_selector("#key-form.shown", timeout=15_000)
            assert "printable ASCII" in asking.inner_text("#status")
            # Without the key the page asks for it; entering it connects.
            asking.goto(server.url + "/dashboard")
            asking.wait_for_selector("#key-form.shown", timeout=15_000)
            assert "API key" in asking.inner_text("#status")
            asking.fill("#key-input", API_KEY)
            asking.click("#key-form button")
            asking.wait_for_selector("#status.live", timeout=15_000)
            asking.close()

            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(server.url + f"/dashboard#key={API_KEY}")
            page.wait_for_selector("#status.live", timeout=15_000)
            assert page.evaluate("location.hash") == "", "the key must leave the URL"
            _wait_for(lambda: _number(page, "generation-tokens") >= 0, 10, "a first snapshot")
            before = _number(page, "generation-tokens")

            # Rounds of load until the page has been seen under it: on a fast machine one
            # round can finish between two of the page's once-a-second snapshots.
            stop, rounds = threading.Event(), []

            def keep_loading() -> None:
                while not rounds or not stop.is_set():
                    rounds.append(asyncio.run(_run_load(server.url, _load_bodies(n, new_tokens))))

            load = threading.Thread(target=keep_loading)
            load.start()
            try:
                _wait_for(lambda: _number(page, "running") > 0, 30, "running requests")
                _wait_for(
                    lambda: _number(page, "generation-tokens") > before, 30, "generated tokens"
                )
                time.sleep(1.5)  # a few snapshots into the charts
                page.screenshot(path=os.path.join(shots, "dashboard.png"), full_page=True)
            finally:
                stop.set()
                load.join(300)
            assert all(code == 200 for codes in rounds for code in codes)
            target = before + len(rounds) * n * new_tokens
            _wait_for(lambda: _number(page, "generation-tokens") >= target, 15, "the final count")
            assert _number(page, "num-finished") >= len(rounds) * n
            assert page.inner_text("#prefixes tr:first-child td.preview").startswith("You are")
            assert _number(page, "tree-nodes") >= 2
        finally:
            browser.close()
