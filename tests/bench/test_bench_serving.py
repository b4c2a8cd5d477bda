"""The serving benchmark's client loop against fake SSE servers.

Unit tests use an `httpx.MockTransport` whose stream advances a fake clock before each event, so
TTFT and ITL have exact expected values; one test runs a real uvicorn server on a free local port
to show that chunk arrivals (not the end of the response) are what gets measured.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from radixserve.bench import serving
from radixserve.bench.client import ClientConfig, build_payload, make_client, send_request
from radixserve.bench.datasets import BenchRequest


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _sse(events: list[tuple[float, object]], clock: FakeClock) -> Callable:
    """A handler that streams `data:` events, setting the clock to each event's time."""
    seen: list[dict] = []

    async def body() -> AsyncIterator[bytes]:
        for t, event in events:
            clock.now = t
            data = event if isinstance(event, str) else json.dumps(event)
            yield f"data: {data}\n\n".encode()

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    handler.seen = seen  # type: ignore[attr-defined]
    return handler


def _send(cfg: ClientConfig, handler: Callable, clock: FakeClock, req: BenchRequest):
    async def go():
        async with httpx.AsyncClient(
            base_url=cfg.base_url, transport=httpx.MockTransport(handler)
        ) as client:
            return await send_request(client, cfg, req, clock=clock)

    return asyncio.run(go())


def _native(text: str, completion: int, **meta) -> dict:
    return {"text": text, "meta_info": {"completion_tokens": completion, **meta}}


REQ = BenchRequest(prompt="hello world", prompt_len=2, output_len=4)


def test_native_stream_timings_and_payload():
    clock = FakeClock()
    events = [
        (0.5, _native("a", 1, prompt_tokens=7, cached_tokens=3)),
        (0.7, _native("ab", 2, prompt_tokens=7, cached_tokens=3)),
        (1.0, _native("abcd", 4, prompt_tokens=7, cached_tokens=3, finish_reason="length")),
        (1.1, "[DONE]"),
    ]
    handler = _sse(events, clock)
    extra = {"sampling_params": {"top_k": 1}, "rid": "x"}
    cfg = ClientConfig("radixserve", "http://fake", extra_body=extra)
    rec = _send(cfg, handler, clock, REQ)
    assert rec.success, rec.error
    assert rec.ttft == pytest.approx(0.5)
    # The last event brought two tokens after 0.3 s: two ITL samples of 0.15 s.
    assert rec.itl == pytest.approx([0.2, 0.15, 0.15])
    assert rec.latency == pytest.approx(1.1)
    assert (rec.output_len, rec.prompt_len, rec.cached_tokens) == (4, 7, 3)
    assert rec.generated_text == "abcd"
    (sent,) = handler.seen
    assert sent["text"] == "hello world" and sent["stream"] is True and sent["rid"] == "x"
    assert sent["sampling_params"] == {
        "max_new_tokens": 4,
        "temperature": 0.0,
        "ignore_eos": True,
        "top_k": 1,  # merged into sampling_params, not replacing it
    }


def test_native_payload_sends_token_ids():
    cfg = ClientConfig("radixserve", "http://fake", ignore_eos=False, stream=False)
    body = build_payload(cfg, BenchRequest([5, 6, 7], 3, 2))
    assert body["input_ids"] == [5, 6, 7] and "text" not in body
    assert body["stream"] is False and body["sampling_params"]["ignore_eos"] is False


def test_openai_stream_uses_usage_for_counts():
    clock = FakeClock()
    delta = lambda text: {"choices": [{"index": 0, "text": text}], "usage": None}  # noqa: E731
    usage = {
        "prompt_tokens": 11,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 5},
    }
    events = [
        (0.3, delta("x")),
        (0.5, delta("y")),
        (0.9, delta("z")),
        (0.95, {"choices": [], "usage": usage}),
        (1.0, "[DONE]"),
    ]
    handler = _sse(events, clock)
    cfg = ClientConfig("openai", "http://fake", model="tiny")
    rec = _send(cfg, handler, clock, REQ)
    assert rec.success, rec.error
    assert rec.ttft == pytest.approx(0.3)
    assert rec.itl == pytest.approx([0.2, 0.4])
    assert rec.latency == pytest.approx(1.0)
    assert (rec.output_len, rec.prompt_len, rec.cached_tokens) == (3, 11, 5)
    assert rec.generated_text == "xyz"
    (sent,) = handler.seen
    assert sent["model"] == "tiny" and sent["prompt"] == "hello world"
    assert sent["max_tokens"] == 4 and sent["ignore_eos"] is True and sent["temperature"] == 0
    assert sent["stream_options"] == {"include_usage": True}


def test_openai_stream_without_usage_counts_chunks():
    clock = FakeClock()
    chunk = {"choices": [{"index": 0, "text": "t"}]}
    events = [(0.1, chunk), (0.2, chunk), (0.2, {"choices": [{"text": ""}]}), (0.3, "[DONE]")]
    rec = _send(ClientConfig("openai", "http://fake"), _sse(events, clock), clock, REQ)
    assert rec.success and rec.output_len == 2
    assert rec.prompt_len == REQ.prompt_len and rec.cached_tokens is None


def test_openai_stream_without_usage_is_retokenized_with_the_tokenizer():
    """A server that reports no usage and puts 1 or 2 tokens in a chunk: counting chunks gave
    42 of 60 tokens (and TPOT 50 ms for 34 ms); the tokenizer counts the text."""

    class Chars:  # one token per character
        def encode(self, text, add_special_tokens=True):
            return list(text)

    clock = FakeClock()
    events = [(0.1, {"choices": [{"text": "ab"}]}), (0.2, {"choices": [{"text": "c"}]})]
    events += [(0.3, {"choices": [{"text": "de", "finish_reason": "length"}]})]
    cfg = ClientConfig("openai", "http://fake", tokenizer=Chars())
    rec = _send(cfg, _sse(events, clock), clock, REQ)
    assert rec.success and rec.output_len == 5 and rec.generated_text == "abcde"
    assert rec.tpot == pytest.approx((0.3 - 0.1) / 4)


@pytest.mark.parametrize("backend", ["openai", "radixserve"])
def test_a_stream_cut_off_before_its_end_is_a_failure(backend):
    """No [DONE] and no finish_reason: the connection closed mid-generation (it counted as a
    success with the tokens it had)."""
    clock = FakeClock()
    if backend == "openai":
        events = [(0.1, {"choices": [{"text": "a"}]}), (0.2, {"choices": [{"text": "b"}]})]
    else:
        events = [(0.1, _native("a", 1)), (0.2, _native("ab", 2))]
    rec = _send(ClientConfig(backend, "http://fake"), _sse(events, clock), clock, REQ)
    assert not rec.success and "ended before the request finished" in rec.error


@pytest.mark.parametrize("backend", ["openai", "radixserve"])
@pytest.mark.parametrize("stream", [True, False])
def test_a_request_the_server_aborted_is_a_failure(backend, stream):
    """finish_reason abort (/abort_request, a shutdown): it counted as a success, its cut-off
    output in the token counts, TPOT and throughput, and the run passed."""
    clock = FakeClock()
    if backend == "openai":
        end = {"choices": [{"text": "", "finish_reason": "abort"}]}
        events = [(0.1, {"choices": [{"text": "a"}]}), (0.2, end)]
    else:
        abort = {"type": "abort", "message": "aborted by the client"}
        events = [(0.1, _native("a", 1)), (0.2, _native("a", 1, finish_reason=abort))]
    cfg = ClientConfig(backend, "http://fake", stream=stream)

    def whole(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=events[-1][1])

    rec = _send(cfg, _sse(events, clock) if stream else whole, clock, REQ)
    assert not rec.success and "the server aborted the request" in rec.error


def test_when_every_request_fails_the_run_fails_and_shows_no_latencies(capsys, tmp_path):
    from radixserve.bench.metrics import compute_metrics
    from radixserve.bench.serving import build_parser, run

    failing = httpx.MockTransport(lambda r: httpx.Response(500, text="boom"))
    args = build_parser().parse_args(
        ["--backend", "radixserve", "--num-prompts", "2", "--warmup-requests", "0"]
        + ["--random-input-len", "8", "--random-output-len", "4", "--disable-tqdm"]
    )

    from rs_testing import save_byte_tokenizer
    from transformers import AutoTokenizer

    save_byte_tokenizer(str(tmp_path), 320)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    with pytest.raises(SystemExit, match="all 2 requests failed; the first: ServerError: HTTP 500"):
        run(args, tokenizer=tokenizer, transport=failing)
    assert "n/a" in capsys.readouterr().out
    metrics = compute_metrics([], 1.0)
    assert metrics["mean_ttft_ms"] is None and metrics["p99_tpot_ms"] is None


def test_the_warmup_request_shares_no_prefix_with_the_first_one():
    """It reused request 0's prompt, which then hit the prefix cache (a low TTFT for it, and a
    cached-token ratio of 0.13 where 0.006 was true)."""
    clock, seen = FakeClock(), []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=_native("ab", 2, finish_reason="length"))

    cfg = ClientConfig("radixserve", "http://fake", stream=False)
    first = BenchRequest([5, 6, 7, 8], 4, 2)

    async def go():
        async with httpx.AsyncClient(
            base_url=cfg.base_url, transport=httpx.MockTransport(handler)
        ) as client:
            await serving.warmup(client, cfg, first, 1)

    asyncio.run(go())
    assert seen[0]["input_ids"] == [8, 7, 6, 5] and clock.now == 0.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serving", "--extra-request-body", "[1]"], "must be a JSON object"),
        (["serving", "--extra-request-body", "{x"], "is not JSON"),
        (["offline", "--extra-sampling-params", '"x"'], "must be a JSON object"),
        (["multiturn", "--hicache-args", "[1]"], "must be a JSON object"),
        (["multiturn", "--max-parallel", "-1"], "must be >= 1"),
        (["serving", "--port", "70000"], "must be a port in"),
        # (an output file that cannot be written failed after the run, its result lost)
        (["serving", "--output-file", "/"], "/ is a directory; name a file in it"),
        (["one-batch", "--output-file", "/no/such/dir/x.json"], "/no/such/dir does not exist"),
        (["soak", "--output", "/tmp"], "/tmp is a directory"),
    ],
)
def test_bad_bench_flags_end_with_usage_and_one_line(argv, message, capsys):
    from radixserve.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_dataset_path_that_is_a_directory_ends_in_one_line(tmp_path, capsys):
    """IsADirectoryError (an OSError, not FileNotFoundError) was a traceback."""
    from rs_testing import save_byte_tokenizer

    from radixserve.__main__ import main

    save_byte_tokenizer(str(tmp_path), 320)
    argv = ["--dataset-name", "sharegpt", "--dataset-path", str(tmp_path), "--port", "9"]
    assert main(["bench", "serving", "--tokenizer", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert "Is a directory" in err and "Traceback" not in err


def test_a_soak_mix_without_a_positive_weight_is_refused():
    from radixserve.bench.soak import ACTIONS, _parse_mix

    with pytest.raises(ValueError, match="every weight is 0"):
        _parse_mix(",".join(f"{name}=0" for name in ACTIONS))
    with pytest.raises(ValueError, match="must be >= 0"):
        _parse_mix("generate=-1")


def test_non_streamed_response_counts_as_one_chunk():
    clock = FakeClock()

    def handler(request: httpx.Request) -> httpx.Response:
        clock.now = 2.0
        return httpx.Response(200, json=_native("abcde", 5, prompt_tokens=2))

    cfg = ClientConfig("radixserve", "http://fake", stream=False)
    rec = _send(cfg, handler, clock, REQ)
    assert rec.success and rec.output_len == 5
    assert rec.ttft == rec.latency == pytest.approx(2.0) and rec.itl == []


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(400, json={"error": {"message": "prompt too long"}}),
        httpx.Response(200, content=b'data: {"error": {"message": "aborted"}}\n\n'),
        httpx.Response(200, content=b"data: [DONE]\n\n"),
    ],
)
def test_errors_are_recorded_not_raised(response):
    rec = _send(ClientConfig("radixserve", "http://fake"), lambda r: response, FakeClock(), REQ)
    assert not rec.success and rec.error
    if response.status_code == 400:
        assert "HTTP 400" in rec.error and "prompt too long" in rec.error


def test_poisson_arrivals_are_seeded(monkeypatch):
    sleeps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    monkeypatch.setattr(serving.asyncio, "sleep", fake_sleep)
    reqs = [REQ] * 50

    async def drain(rate: float) -> int:
        return len([r async for r in serving.request_arrivals(reqs, rate, seed=3)])

    assert asyncio.run(drain(math.inf)) == 50 and sleeps == []
    asyncio.run(drain(10.0))
    first = list(sleeps)
    assert len(first) == 49 and all(s > 0 for s in first)
    assert 0.05 < sum(first) / len(first) < 0.2  # exponential gaps with mean 1 / rate
    sleeps.clear()
    asyncio.run(drain(10.0))
    assert sleeps == first


class FakeServer:
    """Native + OpenAI endpoints over MockTransport; tracks requests in flight."""

    def __init__(self) -> None:
        self.in_flight = self.max_in_flight = 0
        self.calls: list[str] = []

    async def _stream(self, body: dict) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            n = body.get("max_tokens") or body["sampling_params"]["max_new_tokens"]
            for i in range(1, n + 1):
                await asyncio.sleep(0.001)
                if "max_tokens" in body:
                    event = {"choices": [{"text": "w "}], "usage": None}
                else:
                    event = _native("w " * i, i, prompt_tokens=9, cached_tokens=i % 2)
                yield f"data: {json.dumps(event)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(f"{request.method} {request.url.path}")
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny-model"}]})
        if request.url.path == "/flush_cache":
            return httpx.Response(200, text="ok")
        body = json.loads(request.content)
        if request.url.path == "/v1/completions":
            assert body["model"] == "tiny-model"
        return httpx.Response(200, content=self._stream(body))


@pytest.mark.parametrize("backend", ["radixserve", "openai"])
def test_run_end_to_end_with_concurrency_cap(backend, word_tokenizer, tmp_path):
    out = tmp_path / "result.jsonl"
    args = serving.build_parser().parse_args(
        f"--backend {backend} --num-prompts 8 --random-input-len 12 --random-output-len 5 "
        f"--max-concurrency 2 --flush-cache --disable-tqdm --output-file {out}".split()
    )
    server = FakeServer()
    result = serving.run(args, tokenizer=word_tokenizer, transport=httpx.MockTransport(server))
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 40
    assert server.max_in_flight == 2
    # Warmup first, then the cache flush, then the measured requests.
    path = "/generate" if backend == "radixserve" else "/v1/completions"
    measured = [c for c in server.calls if c.endswith(path)]
    assert len(measured) == 9
    assert server.calls.index("POST /flush_cache") == server.calls.index(f"POST {path}") + 1
    if backend == "radixserve":
        assert result["total_input_tokens"] == 8 * 9  # the server's prompt_tokens
        assert result["cached_token_ratio"] == pytest.approx(1 / 9)
    else:
        assert result["model"] == "tiny-model" and result["cached_token_ratio"] is None
    (line,) = out.read_text().splitlines()
    assert json.loads(line)["completed"] == 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_server_chunk_arrivals_are_measured():
    """A uvicorn server sleeps 0.1 s before the first event and 0.25 s between events: a client
    that buffered the response would see ITLs near zero. (Bounds with room for a loaded
    machine, where the client can read two events at once after a stall.)"""
    uvicorn = pytest.importorskip("uvicorn")
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/generate")
    async def generate(body: dict) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            await asyncio.sleep(0.1)
            for i in range(1, 5):
                yield f"data: {json.dumps(_native('x' * i, i))}\n\n"
                await asyncio.sleep(0.25)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        cfg = ClientConfig("radixserve", f"http://127.0.0.1:{port}")

        async def go():
            async with make_client(cfg) as client:
                return await send_request(client, cfg, REQ)

        rec = asyncio.run(go())
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert rec.success, rec.error
    assert rec.output_len == 4 and len(rec.itl) == 3
    assert rec.ttft >= 0.09
    assert sum(rec.itl) >= 0.3 and max(rec.itl) >= 0.1
    assert rec.latency >= rec.ttft + 0.7


@pytest.mark.parametrize("refusals", [2, 100])
def test_a_refused_flush_is_retried_until_the_last_request_drains(refusals, monkeypatch, capsys):
    """The server answers 400 while a request still runs (the previous run's last one can be
    finishing after its client saw the final chunk): the flush is retried, and only a server
    that keeps refusing leaves the run with a warm cache and a warning."""
    monkeypatch.setattr(serving, "FLUSH_TRIES", 5)
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(400 if len(calls) <= refusals else 200, text="busy")

    async def flush() -> None:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            await serving._flush_cache(client)

    asyncio.run(flush())
    assert calls == ["/flush_cache"] * min(refusals + 1, 5)
    warned = "flush_cache failed (HTTP 400)" in capsys.readouterr().err
    assert warned == (refusals >= 5)
