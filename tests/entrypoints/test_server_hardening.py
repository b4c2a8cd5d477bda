"""The live server under the inputs, timings and load of issue 9: 200 concurrent requests under
lpm with 8 running, duplicate rids, aborts right after submission, a long silent generation
with a short watchdog, and the offline Engine when its scheduler dies. (The queue bound is
tested in the TokenizerManager's tests, over HTTP in test_openai_api and live in the soak.)"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from rs_testing import make_tiny_served_model
from test_http_server import ServerProcess, wait_drained

pytestmark = pytest.mark.real_model

SHORT_WATCHDOG_S = 5


@pytest.fixture(scope="module")
def lpm_server(tmp_path_factory, default_model_path):
    server = ServerProcess(
        str(tmp_path_factory.mktemp("hardening")),
        "--schedule-policy",
        "lpm",
        "--max-running-requests",
        "8",
        "--chunked-prefill-size",
        "64",
        "--enable-mixed-chunk",
        "--watchdog-timeout",
        str(SHORT_WATCHDOG_S),
    )
    try:
        server.wait_ready()
        warm_up = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}  # first forward
        assert httpx.post(server.url + "/generate", json=warm_up, timeout=120).status_code == 200
        yield server
    finally:
        server.stop()


async def _post_all(url: str, bodies: list[dict[str, Any]], path: str = "/generate") -> list:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        return await asyncio.gather(*(client.post(path, json=b) for b in bodies))


def test_200_concurrent_requests_under_lpm_with_8_running(lpm_server):
    prefixes = ["You are a helpful assistant. " * 8, "Translate into French: " * 6, ""]
    bodies = [
        {
            "text": prefixes[i % 3] + f"Question {i}: name a colour.",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        }
        for i in range(200)
    ]
    replies = asyncio.run(_post_all(lpm_server.url, bodies))
    assert [r.status_code for r in replies] == [200] * 200
    assert all(r.json()["meta_info"]["completion_tokens"] == 4 for r in replies)
    info = wait_drained(lpm_server)
    assert info["protected_tokens"] == 0


def test_duplicate_rid_is_a_400_and_the_first_request_answers(lpm_server):
    """The second request comes while the first surely runs (it cannot end before the abort
    that ends it); the first then answers, ended by the abort."""
    body = {
        "text": "Count slowly:",
        "rid": "dup-1",
        "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True},
    }

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=lpm_server.url, timeout=120) as client:
            first = asyncio.create_task(client.post("/generate", json=body))
            deadline = time.monotonic() + 60
            while (await client.get("/server_info")).json()["running"] < 1:
                assert time.monotonic() < deadline, "the first request never ran"
                await asyncio.sleep(0.02)
            second = await client.post("/generate", json=body)
            await client.post("/abort_request", json={"rid": "dup-1"})
            return [await first, second]

    first, second = asyncio.run(run())
    assert first.status_code == 200 and first.json()["meta_info"]["id"] == "dup-1"
    assert first.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert second.status_code == 400 and "dup-1" in second.json()["error"]["message"]
    wait_drained(lpm_server)


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.15, 0.3, 0.6, 1.0])
def test_abort_soon_after_submission_is_never_lost(lpm_server, delay):
    rid = f"abort-{delay}"
    body = {
        "text": "Write a long story about a dragon.",
        "rid": rid,
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
    }

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=lpm_server.url, timeout=120) as client:
            task = asyncio.create_task(client.post("/generate", json=body))
            await asyncio.sleep(delay)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until the request is registered
                ack = await client.post("/abort_request", json={"rid": rid})
                if ack.json()["success"]:
                    break
                await asyncio.sleep(0.01)
            return ack, await task

    ack, reply = asyncio.run(run())
    assert ack.json()["success"]
    meta = reply.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort", meta
    assert meta["completion_tokens"] < 200
    wait_drained(lpm_server)


def _post_head(path: str, length: int) -> bytes:
    """An HTTP/1.1 POST's request line and headers, for a JSON body of `length` bytes."""
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {length}\r\n\r\n").encode()


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_client_gone_before_its_body_arrived_is_not_an_error(lpm_server, path):
    """A client that sends its headers and part of its body, then closes the connection, is a
    disconnect: no traceback in the log (it was logged twice as an internal error)."""
    log_before = len(lpm_server.log())
    part = b'{"prompt": "Hel'
    with socket.create_connection(("127.0.0.1", lpm_server.port), timeout=10) as sock:
        sock.sendall(_post_head(path, len(part) + 100) + part)
        time.sleep(0.3)  # the route is reading the body when the client goes
    # The server handles the disconnect as soon as the socket closes; a request served after
    # it shows the handler has run.
    ok = {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}
    assert httpx.post(lpm_server.url + "/generate", json=ok, timeout=60).status_code == 200
    time.sleep(0.2)
    log = lpm_server.log()[log_before:]
    assert "Traceback" not in log and "request failed" not in log, log[-3000:]
    wait_drained(lpm_server)


def test_an_idle_keep_alive_connection_outlives_client_pool_expiry(lpm_server):
    """The server keeps an idle connection open longer than httpx's pools keep one (5 s): at
    5 s it could close a connection just as a client reused it (a spurious ReadError)."""
    body = b'{"text": "Hi", "sampling_params": {"max_new_tokens": 1}}'
    request = _post_head("/generate", len(body)) + body

    def exchange(sock: socket.socket) -> bytes:
        sock.sendall(request)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(65536)
            if not chunk:
                return reply  # closed by the server
            reply += chunk
        header, rest = reply.split(b"\r\n\r\n", 1)
        length = int(header.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(rest) < length:
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection mid-body"
            rest += chunk
        return header

    with socket.create_connection(("127.0.0.1", lpm_server.port), timeout=60) as sock:
        assert exchange(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6.5)  # idle past httpx's keepalive_expiry and uvicorn's default timeout
        assert exchange(sock).startswith(b"HTTP/1.1 200")


def test_long_silent_generation_outlives_a_short_watchdog(lpm_server):
    """Nothing is streamed for longer than the watchdog timeout; the scheduler's heartbeat
    keeps the server up (it used to exit, taking every request with it). The request is far
    longer than a CPU generates in that time (a fixed 150 tokens once took 4.7 s, under the
    timeout); it is aborted once it has run past the timeout."""
    pool = ThreadPoolExecutor(1)
    body = {
        "text": "Once",
        "rid": "silent",
        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
    }
    start = time.monotonic()
    reply = pool.submit(httpx.post, lpm_server.url + "/generate", json=body, timeout=300)
    try:
        time.sleep(SHORT_WATCHDOG_S + 1.5)
        assert not reply.done(), "the request ended before the watchdog's timeout had passed"
        assert lpm_server.proc.poll() is None
    finally:  # never leave it running for the module's next tests
        aborted = httpx.post(lpm_server.url + "/abort_request", json={"rid": "silent"}, timeout=30)
        result = reply.result(timeout=60)
        pool.shutdown()
    assert aborted.json() == {"success": True}
    assert result.status_code == 200
    meta = result.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort", meta
    assert time.monotonic() - start > SHORT_WATCHDOG_S + 1
    assert lpm_server.proc.poll() is None
    assert httpx.get(lpm_server.url + "/health", timeout=30).status_code == 200
    wait_drained(lpm_server)


def test_engine_raises_when_its_scheduler_dies(tmp_path):
    from radixserve import Engine
    from radixserve.managers.tokenizer_manager import RequestError

    model = make_tiny_served_model(str(tmp_path / "tiny"))
    engine = Engine(model_path=model, dtype="float32", max_total_tokens=4096)
    try:
        params = {"max_new_tokens": 1000, "ignore_eos": True}
        pool = ThreadPoolExecutor(1)
        fut = pool.submit(engine.generate, [f"Tell me story {i}." for i in range(8)], params)
        time.sleep(0.5)
        assert not fut.done(), "the generation must still be running when the scheduler dies"
        os.kill(engine.procs.scheduler.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RequestError) as e:
            fut.result(timeout=15)
        assert e.value.status_code == 503 and "scheduler" in str(e.value)
        assert time.monotonic() - start < 10
        with pytest.raises(RequestError):
            engine.generate("Hello", {"max_new_tokens": 2})
    finally:
        engine.shutdown()
