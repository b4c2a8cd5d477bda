"""End-to-end tests of the HTTP server with the real default model, through the official
`openai` client and raw HTTP: OpenAI and native APIs, streaming, concurrency, disconnects,
bad input, control routes, SIGTERM, and a scheduler crash taking the server down.

The server runs as a subprocess (`python -m radixserve serve`) in its own session so that
the test can always kill it and its children. One server serves the TestServing class; the
crash test starts a second one, on a tiny model, after the first has stopped (the machine has
few cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import psutil
import pytest
from rs_testing import make_tiny_served_model

from radixserve.utils import free_port

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 180
MAX_TOTAL_TOKENS = 16384
GREEDY = {"temperature": 0.0}
IGNORE_EOS = {"ignore_eos": True}
NEW_TOKENS_UNDER_LOAD = 6  # per request in the 64-stream test


class ServerProcess:
    """`python -m radixserve serve` on a free port, logging to a file."""

    def __init__(
        self, log_dir: str, *extra: str, env: dict[str, str] | None = None, no_stdin: bool = False
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"server-{self.port}.log")
        cmd = [sys.executable, "-m", "radixserve", "serve", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--dtype", "float32"]
        cmd += ["--max-total-tokens", str(MAX_TOTAL_TOKENS), "--enable-integrity-checks", *extra]
        # The "ready" line is logged at info level; a quieter server is ready at /health.
        level = extra[extra.index("--log-level") + 1] if "--log-level" in extra else "info"
        self.says_ready = level in ("debug", "info")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                preexec_fn=(lambda: os.close(0)) if no_stdin else None,
            )

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self) -> None:
        """Until the server says it is ready: /health answers as soon as uvicorn listens, but
        the warm-up request and the cache flush after it come later, and a test's first
        requests must not share a batch with the one or have their cache emptied by the other."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                healthy = httpx.get(self.url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                healthy = False
            if healthy and (not self.says_ready or "radixserve ready on" in self.log()):
                return
            time.sleep(0.2 if healthy else 0.5)
        self.stop()
        pytest.fail(f"server not healthy within {STARTUP_TIMEOUT_S} s:\n{self.log()[-3000:]}")

    def running(self) -> Iterator[ServerProcess]:
        """For a fixture (`yield from ServerProcess(...).running()`): ready, then stopped."""
        try:
            self.wait_ready()
            yield self
        finally:
            self.stop()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the whole session (server and children) no matter what."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(20)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait(10)

    def server_info(self) -> dict[str, Any]:
        return httpx.get(self.url + "/server_info", timeout=30).json()


def wait_drained(server: ServerProcess, timeout: float = 15.0) -> dict[str, Any]:
    """Poll until nothing runs or waits and every KV slot is free or evictable."""
    deadline = time.monotonic() + timeout
    while True:
        info = server.server_info()
        free = info["available_tokens"] + info["evictable_tokens"]
        if info["running"] == 0 and info["queued"] == 0 and free == info["max_total_num_tokens"]:
            return info
        if time.monotonic() > deadline:
            pytest.fail(f"server did not drain within {timeout} s: {info}")
        time.sleep(0.2)


def sse_events(lines: Any) -> list[Any]:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return default_tokenizer  # the session's (see conftest.py)


@pytest.fixture(scope="class")
def server(tmp_path_factory, default_model_path):
    yield from ServerProcess(str(tmp_path_factory.mktemp("server"))).running()


@pytest.fixture(scope="class")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def _stream_by_choice(chunks: list[Any]) -> dict[int, list[Any]]:
    by_choice: dict[int, list[Any]] = defaultdict(list)
    for chunk in chunks:
        for choice in chunk.choices:
            by_choice[choice.index].append(choice)
    return by_choice


class TestServing:
    def test_ready_log_line(self, server):
        line = f"radixserve ready on http://127.0.0.1:{server.port}"
        deadline = time.monotonic() + 30  # logged just after the first /health can answer
        while line not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert line in server.log()

    # -- completions ------------------------------------------------------------------------------
    def test_completion_string_and_token_ids_agree(self, client, tokenizer):
        prompt = "The capital of France is"
        kw = dict(model=MODEL, max_tokens=6, extra_body=IGNORE_EOS, **GREEDY)
        by_text = client.completions.create(prompt=prompt, **kw)
        by_ids = client.completions.create(prompt=tokenizer.encode(prompt), **kw)
        assert by_text.choices[0].text == by_ids.choices[0].text
        assert by_text.choices[0].finish_reason == "length"
        assert by_text.object == "text_completion" and by_text.model == MODEL
        usage = by_text.usage
        assert usage.completion_tokens == 6
        assert usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert usage.total_tokens == usage.prompt_tokens + 6

    def test_completion_prompt_list_and_n(self, client):
        prompts = ["Once upon a time", "1, 2, 3,"]
        resp = client.completions.create(
            model=MODEL, prompt=prompts, n=2, max_tokens=4, extra_body=IGNORE_EOS, **GREEDY
        )
        assert [c.index for c in resp.choices] == [0, 1, 2, 3]
        texts = [c.text for c in resp.choices]
        assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: samples agree
        assert texts[0] != texts[2]
        assert resp.usage.completion_tokens == 16

    def test_completion_echo_and_logprobs(self, client):
        prompt = "Paris is the capital of"
        resp = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, logprobs=3, **GREEDY
        )
        lp = resp.choices[0].logprobs
        n_out = resp.usage.completion_tokens
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_out
        for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
            assert token_lp <= 0 and 1 <= len(top) <= 3
            assert token_lp >= max(top.values()) - 1e-4  # greedy picks the most likely token
        assert lp.text_offset == sorted(lp.text_offset)
        echoed = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, echo=True, **GREEDY
        )
        text = echoed.choices[0].text
        assert text.startswith(prompt) and len(text) > len(prompt)
        # echo with logprobs: the prompt's tokens first (the first one has no logprob), then
        # the same output logprobs as without echo; streamed, the same entries in pieces.
        both = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, echo=True, logprobs=3, **GREEDY
        )
        blp = both.choices[0].logprobs
        n_prompt = both.usage.prompt_tokens
        assert len(blp.tokens) == len(blp.token_logprobs) == n_prompt + n_out
        assert blp.token_logprobs[0] is None and blp.top_logprobs[0] is None
        assert all(x <= 0 for x in blp.token_logprobs[1:n_prompt])
        assert all(1 <= len(top) <= 3 for top in blp.top_logprobs[1:])
        assert "".join(blp.tokens[:n_prompt]) == prompt
        assert blp.tokens[n_prompt:] == lp.tokens
        assert all(
            abs(a - b) < 1e-4
            for a, b in zip(blp.token_logprobs[n_prompt:], lp.token_logprobs, strict=True)
        )
        assert blp.text_offset == sorted(blp.text_offset) and blp.text_offset[0] == 0
        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, echo=True, logprobs=3, stream=True, **GREEDY
        )
        tokens = [t for c in stream for t in (c.choices[0].logprobs.tokens if c.choices else [])]
        assert tokens == blp.tokens
        # max_tokens 0 scores the prompt alone (SGLang's and the legacy API's): it was a 400.
        scored = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=3, **GREEDY
        )
        slp = scored.choices[0].logprobs
        assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
        assert slp.tokens == blp.tokens[:n_prompt]
        assert all(
            (a is None and b is None) or abs(a - b) < 1e-4
            for a, b in zip(slp.token_logprobs, blp.token_logprobs[:n_prompt], strict=True)
        )

    def test_completion_stream(self, client):
        kw = dict(model=MODEL, prompt="The sky is", max_tokens=6, extra_body=IGNORE_EOS, **GREEDY)
        full = client.completions.create(**kw).choices[0].text
        chunks = list(
            client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
        )
        by_choice = _stream_by_choice(chunks)
        assert "".join(c.text for c in by_choice[0]) == full
        assert [c.finish_reason for c in by_choice[0] if c.finish_reason] == ["length"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

    # -- chat -------------------------------------------------------------------------------------
    MESSAGES = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three colors."},
    ]

    def test_chat_basic_and_n(self, client):
        resp = client.chat.completions.create(
            model=MODEL, messages=self.MESSAGES, max_tokens=4, n=2, **GREEDY
        )
        assert resp.object == "chat.completion" and len(resp.choices) == 2
        assert resp.choices[0].message.role == "assistant"
        assert resp.choices[0].message.content == resp.choices[1].message.content
        assert resp.choices[0].message.content
        assert resp.usage.completion_tokens <= 8 and resp.usage.prompt_tokens > 10

    def test_chat_max_tokens_and_stop(self, client):
        kw = dict(model=MODEL, messages=self.MESSAGES, **GREEDY)
        full = client.chat.completions.create(max_tokens=12, extra_body=IGNORE_EOS, **kw)
        assert full.choices[0].finish_reason == "length"
        assert full.usage.completion_tokens == 12
        text = full.choices[0].message.content
        words = text.split()
        assert len(words) >= 3, text
        stop = " " + words[2]
        assert stop in text
        stopped = client.chat.completions.create(max_tokens=12, stop=[stop], **kw)
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].message.content == text[: text.index(stop)]

    def test_chat_logprobs(self, client):
        resp = client.chat.completions.create(
            model=MODEL, messages=self.MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2
        )
        content = resp.choices[0].logprobs.content
        assert len(content) == resp.usage.completion_tokens
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            assert entry.bytes == list(entry.token.encode())
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob

    def test_chat_stream(self, client):
        kw = dict(model=MODEL, messages=self.MESSAGES, max_tokens=4, **GREEDY)
        full = client.chat.completions.create(**kw).choices[0].message.content
        chunks = list(
            client.chat.completions.create(
                stream=True, n=2, stream_options={"include_usage": True}, **kw
            )
        )
        by_choice = _stream_by_choice(chunks)
        assert sorted(by_choice) == [0, 1]
        for choices in by_choice.values():
            assert choices[0].delta.role == "assistant"
            assert all(c.delta.role is None for c in choices[1:])
            assert "".join(c.delta.content or "" for c in choices) == full
            assert len([c for c in choices if c.finish_reason]) == 1
            assert choices[-1].finish_reason is not None
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage.total_tokens > usage.completion_tokens > 0

    # -- models -----------------------------------------------------------------------------------
    def test_models(self, client, default_model_path):
        models = client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert client.models.retrieve(MODEL).id == MODEL
        assert client.models.retrieve(os.path.basename(default_model_path)).id == MODEL
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("no-such-model")
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)

    # -- native API -------------------------------------------------------------------------------
    def test_native_generate(self, server):
        body = {"text": "Hello, my name is", "sampling_params": {"max_new_tokens": 5, **GREEDY}}
        out = httpx.post(server.url + "/generate", json=body, timeout=60).json()
        assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] <= 5
        with httpx.stream(
            "POST", server.url + "/generate", json={**body, "stream": True}, timeout=60
        ) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        assert events[-2]["text"] == out["text"]
        assert events[-2]["output_ids"] == out["output_ids"]
        assert [e["meta_info"]["finish_reason"] is not None for e in events[:-1]].count(True) == 1

    def test_native_generate_logprobs_and_batch(self, server):
        body = {
            "text": ["a b c", "x y z"],
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 2,
        }
        outs = httpx.post(server.url + "/generate", json=body, timeout=60).json()
        assert len(outs) == 2
        for out in outs:
            assert len(out["meta_info"]["output_token_logprobs"]) == 3
            assert all(len(top) == 2 for top in out["meta_info"]["output_top_logprobs"])

    # -- load, disconnects, abort -----------------------------------------------------------------
    def test_64_concurrent_streams(self, server):
        async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[int, list[str], int]:
            stream = await aclient.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Count from {i} to {i + 20}."}],
                max_tokens=NEW_TOKENS_UNDER_LOAD,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=IGNORE_EOS,
            )
            reasons, usage = [], -1
            async for chunk in stream:
                reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            return i, reasons, usage

        async def run() -> list[tuple[int, list[str], int]]:
            aclient = openai.AsyncOpenAI(
                base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0
            )
            try:
                return await asyncio.gather(*(one(aclient, i) for i in range(64)))
            finally:
                await aclient.close()

        results = asyncio.run(run())
        assert len(results) == 64
        for i, reasons, usage in results:
            assert reasons == ["length"], (i, reasons)
            assert usage == NEW_TOKENS_UNDER_LOAD, (i, usage)
        wait_drained(server)

    def test_closing_a_stream_frees_its_slots(self, server):
        body = {"prompt": "Tell me a long story.", "max_tokens": 4000, "stream": True}
        body.update(IGNORE_EOS)
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break
        wait_drained(server, timeout=10)

    def test_client_timeout_on_non_streaming_request_frees_its_slots(self, server):
        body = {"prompt": "Tell me a long story.", "max_tokens": 4000, **IGNORE_EOS}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json=body, timeout=2)
        wait_drained(server, timeout=10)

    def test_abort_request_route(self, server):
        body = {
            "text": "Tell me a long story.",
            "rid": "abort-me",
            "stream": True,
            "sampling_params": {"max_new_tokens": 4000, **IGNORE_EOS},
        }
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[len("data: ") :])["meta_info"]["finish_reason"] is None
            resp = httpx.post(server.url + "/abort_request", json={"rid": "abort-me"}, timeout=30)
            assert resp.json() == {"success": True}
            events = sse_events(lines)
        assert events[-1] == "[DONE]"
        assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
        wait_drained(server, timeout=10)

    # -- bad input --------------------------------------------------------------------------------
    BAD = [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.01}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True, "top_p": 2}, 400),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}], "n": -2}, 400),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user"}]}, 404),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "a"}}, 400),
        ("/generate", {"sampling_params": {}}, 400),
        ("/v1/completions", b"{not json", 400),
        ("/v1/chat/completions", b"", 400),
    ]

    @pytest.mark.parametrize("path,body,status", BAD)
    def test_bad_input_then_next_request_is_served(self, server, path, body, status):
        if isinstance(body, bytes):
            r = httpx.post(server.url + path, content=body, timeout=30)
        else:
            r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["code"] == status and error["message"] and error["type"]
        ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
        assert httpx.post(server.url + "/v1/completions", json=ok, timeout=60).status_code == 200

    def test_openai_client_raises_bad_request(self, client):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x", temperature=-1)

    # -- control routes ---------------------------------------------------------------------------
    def test_control_routes(self, server):
        url = server.url
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        assert httpx.get(url + "/health_generate", timeout=60).status_code == 200
        info = httpx.get(url + "/model_info", timeout=30).json()
        assert info["is_generation"] is True and info["served_model_name"] == MODEL
        assert info["model_path"].endswith(".gguf")
        server_info = wait_drained(server)
        assert server_info["port"] == server.port and server_info["dtype"] == "float32"
        assert server_info["max_total_num_tokens"] == MAX_TOTAL_TOKENS
        assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
        assert httpx.get(url + "/flush_cache", timeout=30).status_code == 200
        assert server.server_info()["evictable_tokens"] == 0  # the flush emptied the tree
        assert httpx.post(url + "/abort_request", json={"rid": "nope"}).json()["success"] is False

    def test_metrics(self, server):
        text = httpx.get(server.url + "/metrics", timeout=30).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name.split("{")[0]] = float(value)
        assert values["sglang:num_requests_total"] >= 64
        assert values["sglang:generation_tokens_total"] >= 64 * NEW_TOKENS_UNDER_LOAD
        assert values["sglang:prompt_tokens_total"] > 0
        assert values["sglang:time_to_first_token_seconds_count"] >= 64
        assert values["sglang:inter_token_latency_seconds_count"] > 0
        assert values["sglang:e2e_request_latency_seconds_count"] >= 64
        assert values["sglang:max_total_num_tokens"] == MAX_TOTAL_TOKENS
        assert values["sglang:num_running_reqs"] == 0
        assert "sglang:cached_tokens_total" in values

    def test_structured_output_through_both_apis(self, server, client):
        from concurrent.futures import ThreadPoolExecutor

        from constrained.schemas import SCHEMAS

        def chat(item: tuple[str, dict]) -> Any:
            name, schema = item
            return client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Give me an example of {name}."}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": name, "schema": schema},
                },
                max_tokens=256,
                temperature=0.0,
            )

        # Schemas through the OpenAI API (concurrently, beside a free request; all 20 schemas at
        # two temperatures run through the Engine in tests/constrained) ...
        picked = SCHEMAS[:8]
        with ThreadPoolExecutor(len(picked) + 1) as pool:
            free = pool.submit(client.completions.create, model=MODEL, prompt="Hi", max_tokens=8)
            replies = list(pool.map(chat, picked))
        assert free.result().usage.completion_tokens > 0
        for (name, schema), reply in zip(picked, replies, strict=True):
            choice = reply.choices[0]
            assert choice.finish_reason == "stop", (name, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)
        # ... and as one native /generate batch.
        picked = SCHEMAS[8:16]
        r = httpx.post(
            server.url + "/generate",
            json={
                "text": [f"A JSON example of {name}:" for name, _ in picked],
                "sampling_params": [
                    {"json_schema": json.dumps(s), "max_new_tokens": 256, "temperature": 0.0}
                    for _, s in picked
                ],
            },
            timeout=600,
        )
        assert r.status_code == 200, r.text
        for (_, schema), out in zip(picked, r.json(), strict=True):
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]
            jsonschema.validate(json.loads(out["text"]), schema)
        r = httpx.post(
            server.url + "/generate",
            json={
                "text": "Phone:",
                "sampling_params": {"regex": r"\d{3}-\d{4}", "max_new_tokens": 16},
            },
            timeout=120,
        )
        assert re.fullmatch(r"\d{3}-\d{4}", r.json()["text"])
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Any JSON object."}],
            response_format={"type": "json_object"},
            max_tokens=128,
            temperature=0.0,
        )
        choice = reply.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # any-object JSON is unbounded: a small model may still be inside a string
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")
        bad = httpx.post(
            server.url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "bad", "schema": {"type": "nope"}},
                },
            },
            timeout=60,
        )
        assert bad.status_code == 400 and bad.json()["error"]["message"]
        wait_drained(server)

    def test_greedy_matches_offline_engine(self, server, default_model_path):
        prompts = [
            "The capital of France is",
            "List three colors:",
            "def fibonacci(n):",
            "Once upon a time",
            "Water boils at",
            "The best way to learn is",
            "Translate to French: good morning",
            "1, 2, 3, 4,",
        ]
        params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        served = []
        for p in prompts:
            r = httpx.post(
                server.url + "/generate", json={"text": p, "sampling_params": params}, timeout=120
            )
            assert r.status_code == 200, r.text
            served.append(r.json()["output_ids"])
        from radixserve import Engine

        with Engine(model_path=default_model_path, dtype="float32", max_total_tokens=4096) as e:
            offline = [o["output_ids"] for o in e.generate(prompts, params)]
        assert served == offline

    def test_sigterm_stops_server_and_children(self, server):
        children = psutil.Process(server.proc.pid).children(recursive=True)
        assert len(children) >= 2
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        _assert_gone(children)  # the resource tracker too: it reports leaks as it exits
        assert "leaked" not in server.log(), server.log()[-2000:]


def _assert_gone(procs: list[psutil.Process], timeout: float = 10.0) -> None:
    gone, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"children still running: {alive}"


def test_a_server_without_stdin_in_a_long_tmpdir_starts_and_stops_cleanly(tmp_path):
    """Started with stdin closed (`0<&-`), uvloop's epoll took fd 0 and libuv aborted on closing
    it at exit (SIGABRT, the clean-up skipped); under a TMPDIR past ~77 characters (SLURM's,
    CI's) the IPC socket paths were too long for ZMQ and the server did not start."""
    model = make_tiny_served_model(str(tmp_path / "tiny"))
    tmpdir = tmp_path / ("t" * (100 - len(str(tmp_path))))
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    server = ServerProcess(str(tmp_path), "--model-path", model, env=env, no_stdin=True)
    try:
        server.wait_ready()
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(server.url + "/generate", json=body, timeout=60).status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.log()[-3000:]
        assert "Traceback" not in server.log() and "Assertion" not in server.log()
    finally:
        server.stop()


def test_a_stopped_server_does_not_wait_for_a_refused_compile(tmp_path):
    """A grammar refused for its compile time still compiles in C++ (it cannot be stopped);
    the server's exit waited for it: after SIGTERM it lived on for as long, its port closed."""
    model = make_tiny_served_model(str(tmp_path / "tiny"))
    env = {**os.environ, "RADIXSERVE_GRAMMAR_TIMEOUT": "0.5"}
    server = ServerProcess(str(tmp_path), "--model-path", model, env=env)
    try:
        server.wait_ready()
        slow: dict[str, Any] = {"type": "integer"}  # under the size caps: seconds to compile
        for _ in range(120):
            fields = {f"p{i}": {"type": "integer"} for i in range(80)}
            slow = {"type": "object", "properties": {**fields, "n": slow}}
        text = json.dumps(slow, separators=(",", ":"))  # (under MAX_GRAMMAR_CHARS so)
        body = {"text": "a", "sampling_params": {"json_schema": text}}
        r = httpx.post(server.url + "/generate", json=body, timeout=60)
        assert r.status_code == 400 and "did not compile within" in r.text, r.text
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(6) == 0
        assert "exiting without waiting for a grammar compile" in server.log()
    finally:
        server.stop()


def test_scheduler_crash_makes_server_exit_nonzero(tmp_path):
    # A tiny model: what is tested is the process supervision, not the model (it loads in
    # seconds where the default model takes half a minute on two cores).
    model = make_tiny_served_model(str(tmp_path / "tiny"))
    server = ServerProcess(str(tmp_path), "--model-path", model)
    try:
        server.wait_ready()
        info = server.server_info()
        scheduler, detokenizer = info["scheduler_pid"], info["detokenizer_pid"]
        assert {scheduler, detokenizer} <= {
            p.pid for p in psutil.Process(server.proc.pid).children()
        }
        detok = psutil.Process(detokenizer)
        start = time.monotonic()
        os.kill(scheduler, signal.SIGKILL)
        code = server.proc.wait(10)
        assert code != 0
        assert time.monotonic() - start < 10
        _assert_gone([detok], timeout=5)
        log = server.log()
        assert "radixserve-scheduler exited with code -9" in log
    finally:
        server.stop()


@pytest.mark.parametrize(
    "signals",
    [("SIGTERM",), ("SIGHUP",), ("SIGINT", "SIGINT"), ("group SIGTERM",), ("group SIGHUP",)],
)
def test_a_stop_signal_answers_requests_in_flight_with_503(tmp_path, signals):
    """Requests still running when the graceful shutdown's time is nearly up (or at once, after
    a second Ctrl-C) get a 503 naming the shutdown (a JSON error, an SSE error event): uvicorn
    cancelled them and the client saw a bare 500 or a cut stream (and a second Ctrl-C left
    ZMQError tracebacks). SIGHUP, a closed terminal, killed the server without its clean-up.
    A signal to the server's process group (systemctl stop, `timeout`, a closed terminal's
    job) killed the children first: exit 1, "scheduler exited with code -15"."""
    model = make_tiny_served_model(str(tmp_path / "tiny"), context=8192)
    server = ServerProcess(str(tmp_path), "--model-path", model)
    try:
        server.wait_ready()
        params = {"max_new_tokens": 8000, "ignore_eos": True, "temperature": 0}
        results: dict[str, Any] = {}

        async def plain() -> None:
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"input_ids": [5, 6, 7], "sampling_params": params}
                results["plain"] = await c.post(server.url + "/generate", json=body)

        async def stream() -> None:
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"input_ids": [5, 6, 8], "sampling_params": params, "stream": True}
                async with c.stream("POST", server.url + "/generate", json=body) as r:
                    results["stream_status"] = r.status_code
                    results["stream"] = [line async for line in r.aiter_lines() if line]

        async def body() -> None:
            tasks = [asyncio.create_task(plain()), asyncio.create_task(stream())]
            await asyncio.sleep(1.0)
            signalled = time.monotonic()
            for name in signals:
                group, _, name = name.rpartition(" ")
                if group:
                    os.killpg(server.proc.pid, getattr(signal, name))
                else:
                    server.proc.send_signal(getattr(signal, name))
                await asyncio.sleep(0.2)
            await asyncio.gather(*tasks)
            results["answered_after"] = time.monotonic() - signalled

        asyncio.run(asyncio.wait_for(body(), 60))
        assert server.proc.wait(15) == 0
        plain_r = results["plain"]
        assert plain_r.status_code == 503, plain_r.text
        assert "shutting down" in plain_r.json()["error"]["message"]
        assert results["stream_status"] == 200
        last = results["stream"][-2] if results["stream"][-1] == "data: [DONE]" else None
        assert last is not None and "shutting down" in last, results["stream"][-3:]
        assert results["answered_after"] < (1.5 if len(signals) > 1 else 5)
        assert "timeout graceful shutdown exceeded" not in server.log()
        assert "Traceback" not in server.log(), server.log()[-3000:]
    finally:
        server.stop()


def test_the_warm_up_flush_is_asked_again_until_the_scheduler_accepts_it(fake_tm):
    """The scheduler refuses a flush while the warm-up request's work is left (a finished
    request until its next step, a hierarchical-cache backup); the refusal was ignored and the
    server started with the warm-up prompt cached."""
    from radixserve.args import ServerArgs
    from radixserve.entrypoints.http_server import AppState, _warm_up
    from radixserve.io_struct import FlushCacheReqOutput

    answers = [False, False, True]

    async def flush_cache() -> FlushCacheReqOutput:
        return FlushCacheReqOutput(answers.pop(0), "requests are running")

    fake_tm.flush_cache = flush_cache
    state = AppState(ServerArgs(model_path="/models/tiny-llama.gguf"), tokenizer_manager=fake_tm)
    asyncio.run(asyncio.wait_for(_warm_up(state), 10))
    assert answers == [] and len(fake_tm.requests) == 1


def test_the_warm_up_prompt_fits_a_short_context(fake_tm):
    """With --context-length 16 the warm-up prompt (29 tokens) was refused, and the first
    user request paid for the start-up: it keeps its last tokens now, room left for two new."""
    from radixserve.args import ServerArgs
    from radixserve.entrypoints.http_server import AppState, _warm_up

    fake_tm.context_len = 8
    state = AppState(ServerArgs(model_path="/models/tiny-llama.gguf"), tokenizer_manager=fake_tm)
    asyncio.run(asyncio.wait_for(_warm_up(state), 10))
    (warm,) = fake_tm.requests
    assert len(warm.input_ids) + warm.sampling_params["max_new_tokens"] == 8


def test_a_warm_up_cancelled_with_the_start_up_logs_no_error(fake_tm, caplog):
    """A child dying during the warm-up cancels the start-up: the warm-up's gather, cancelled
    with it, logged "_GatheringFuture exception was never retrieved" and a traceback."""
    import gc

    from radixserve.args import ServerArgs
    from radixserve.entrypoints.http_server import AppState, _warm_up

    async def hang(obj, request=None):
        await asyncio.sleep(60)
        yield {}

    fake_tm.generate_request = hang
    state = AppState(ServerArgs(model_path="/models/tiny-llama.gguf"), tokenizer_manager=fake_tm)

    async def body() -> None:
        task = asyncio.ensure_future(_warm_up(state))
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        gc.collect()
        await asyncio.sleep(0.05)

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(body())
        gc.collect()
    assert "never retrieved" not in caplog.text, caplog.text


def test_metrics_answer_while_the_scheduler_is_inside_a_step(tmp_path):
    """/metrics asks the scheduler for its gauges, which it answers between steps: a scrape
    during a long step waited up to 10 s (Prometheus' default scrape timeout) for them. It now
    renders the last gauges after a short wait, with its own counters live. The warm-up request
    is not a user's and is not counted (its cold-start TTFT was in the histograms)."""
    model = make_tiny_served_model(str(tmp_path / "tiny"))
    server = ServerProcess(str(tmp_path), "--model-path", model)
    try:
        server.wait_ready()
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(server.url + "/generate", json=body, timeout=60).status_code == 200
        scheduler = server.server_info()["scheduler_pid"]
        os.kill(scheduler, signal.SIGSTOP)  # a step that does not end
        try:
            r = httpx.get(server.url + "/metrics", timeout=7)
        finally:
            os.kill(scheduler, signal.SIGCONT)
        assert r.status_code == 200
        assert re.search(r"^sglang:num_requests_total\S* 1", r.text, re.M), r.text
        assert re.search(r"^sglang:num_running_reqs\S* 0", r.text, re.M), r.text
    finally:
        server.stop()


def test_a_stuck_detokenizer_is_found_by_the_watchdog(tmp_path):
    """Only the scheduler had a heartbeat: with the detokenizer stuck, requests waited until
    their clients gave up and the server never exited (/health blamed the scheduler)."""
    model = make_tiny_served_model(str(tmp_path / "tiny"))
    server = ServerProcess(str(tmp_path), "--model-path", model, "--watchdog-timeout", "3")
    try:
        server.wait_ready()
        detokenizer = server.server_info()["detokenizer_pid"]
        os.kill(detokenizer, signal.SIGSTOP)
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}
        r = httpx.post(server.url + "/generate", json=body, timeout=30)
        assert r.status_code == 503, r.text
        assert "the detokenizer has been stuck" in r.json()["error"]["message"]
        assert server.proc.wait(15) != 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(detokenizer, signal.SIGCONT)
        server.stop()
