"""The HTTP side of the serving benchmark: request bodies, SSE parsing, one timed request.

Two backends: `radixserve` (native `POST /generate`, whose SSE events carry the cumulative
`text` and `meta_info` {prompt_tokens, completion_tokens, cached_tokens, finish_reason}) and
`openai` (`POST /v1/completions` with `stream_options.include_usage`). Every `data:` line that
brings new output tokens is stamped with the clock on arrival; `bench.metrics` turns the stamps
into TTFT and ITL. Used by `bench.serving`, `bench.soak` and `bench.overhead`.

Every client sends `Authorization: Bearer <key>` (a server started with `--api-key`): the key
of `--api-key`, else `$OPENAI_API_KEY` as SGLang's bench_serving. An HTTP 401 is an `AuthError`
that names the fix.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from radixserve.bench.datasets import BenchRequest
from radixserve.bench.metrics import RequestRecord

Clock = Callable[[], float]
BACKEND_PATHS = {"radixserve": "/generate", "openai": "/v1/completions"}
API_KEY_ENV = "OPENAI_API_KEY"


@dataclass(frozen=True)
class ClientConfig:
    """How to talk to the server; one per run."""

    backend: str
    base_url: str
    model: str | None = None
    ignore_eos: bool = True
    stream: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout: float = 3600.0  # seconds for a whole request
    read_timeout: float = 600.0  # seconds of silence allowed between two chunks
    # Counts the output tokens of a server that reports no `usage` (openai backend); without
    # it, each chunk that carries text counts as one token.
    tokenizer: Any = None
    api_key: str | None = field(default=None, repr=False)  # None: $OPENAI_API_KEY, if set

    def __post_init__(self) -> None:
        assert self.backend in BACKEND_PATHS, f"unknown backend {self.backend!r}"

    @property
    def path(self) -> str:
        return BACKEND_PATHS[self.backend]


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` over `base`; nested dicts (e.g. sampling_params) are merged, not replaced."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def build_payload(cfg: ClientConfig, req: BenchRequest) -> dict[str, Any]:
    """The JSON body for one request: greedy, `output_len` new tokens, ignore_eos unless off."""
    if cfg.backend == "radixserve":
        payload: dict[str, Any] = {
            ("text" if isinstance(req.prompt, str) else "input_ids"): req.prompt,
            "sampling_params": {
                "max_new_tokens": req.output_len,
                "temperature": 0.0,
                "ignore_eos": cfg.ignore_eos,
            },
            "stream": cfg.stream,
        }
    else:
        payload = {
            "model": cfg.model or "default",
            "prompt": req.prompt,
            "max_tokens": req.output_len,
            "temperature": 0.0,
            "stream": cfg.stream,
            "ignore_eos": cfg.ignore_eos,  # an extra body field that SGLang and vLLM accept
        }
        if cfg.stream:
            payload["stream_options"] = {"include_usage": True}
    return _deep_merge(payload, cfg.extra_body)


class ServerError(RuntimeError):
    """An HTTP error status or an error event inside the stream."""


class AuthError(ServerError):
    """HTTP 401: the server wants an API key that was not sent, or refused the one sent."""


def add_api_key_arg(parser: Any) -> None:
    """--api-key, for the commands that talk to a server."""
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"Sent as `Authorization: Bearer KEY` (default: ${API_KEY_ENV}, if set).",
    )


def resolve_api_key(key: str | None) -> str | None:
    """`key` (--api-key) wins; else $OPENAI_API_KEY; an empty one is none."""
    return key or os.environ.get(API_KEY_ENV) or None


def raise_for_auth(resp: httpx.Response) -> None:
    """An AuthError that says what to do, for an HTTP 401 answer."""
    if resp.status_code != 401:
        return
    where = f"{resp.request.method} {resp.request.url.path}"
    if resp.request.headers.get("authorization"):
        fix = f"the server refused the API key (from --api-key, else ${API_KEY_ENV})"
    else:
        fix = f"the server wants an API key: pass --api-key or set {API_KEY_ENV}"
    raise AuthError(f"HTTP 401 from {where}: {fix}")


def raise_aborted(message: str | None) -> None:
    """A request the server aborted (by /abort_request, a shutdown, ...) did not finish: it is
    a failure, not a success with its output cut short."""
    raise ServerError("the server aborted the request" + (f": {message}" if message else ""))


class NativeParser:
    """Events of `/generate`: cumulative `text` and `meta_info.completion_tokens`."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.finished = False  # an event carried meta_info.finish_reason

    def on_event(self, data: dict[str, Any], now: float) -> None:
        if "error" in data:
            raise ServerError(str(data["error"]))
        rec, meta = self.record, data.get("meta_info") or {}
        finish = meta.get("finish_reason")
        if finish:
            if isinstance(finish, dict) and finish.get("type") == "abort":
                raise_aborted(finish.get("message"))
            self.finished = True
        text = data.get("text") or ""
        done = rec.output_len
        grew = len(text) > len(rec.generated_text)
        completion = meta.get("completion_tokens", done + 1 if grew else done)
        if completion > done:
            rec.add_chunk(now, completion - done)
            rec.output_len = completion
        rec.generated_text = text
        if meta.get("prompt_tokens") is not None:
            rec.prompt_len = int(meta["prompt_tokens"])
        if meta.get("cached_tokens") is not None:
            rec.cached_tokens = int(meta["cached_tokens"])
        if meta.get("spec_verify_ct") is not None:
            rec.spec_verify_ct = int(meta["spec_verify_ct"])
            rec.spec_accept_length = float(meta.get("spec_accept_length") or 0.0)
            rec.spec_accept_rate = float(meta.get("spec_accept_rate") or 0.0)
            if meta.get("spec_draft_tokens") is not None:  # (radixserve's; not SGLang's)
                rec.spec_draft_tokens = int(meta["spec_draft_tokens"])
                rec.spec_accepted_tokens = int(meta.get("spec_accepted_tokens") or 0)

    def finish(self) -> None:
        pass


class OpenAIParser:
    """Events of `/v1/completions`: text deltas; token counts from `usage` when present,
    else the generated text re-tokenized (one token per chunk that carries text without a
    tokenizer). The chunks' times come from the stream: a chunk carrying several tokens (by
    the usage in it) counts as that many equal inter-token gaps, else as one gap."""

    def __init__(self, record: RequestRecord, tokenizer: Any = None) -> None:
        self.record = record
        self.tokenizer = tokenizer
        self.counted = 0
        self.usage_seen = False
        self.finished = False  # a choice carried a finish_reason

    def on_event(self, data: dict[str, Any], now: float) -> None:
        if "error" in data:
            raise ServerError(str(data["error"]))
        rec, usage = self.record, data.get("usage") or {}
        choices = data.get("choices") or []
        text = (choices[0].get("text") or "") if choices else ""
        if choices and choices[0].get("finish_reason"):
            if choices[0]["finish_reason"] == "abort":  # (SGLang's and vLLM's)
                raise_aborted(None)
            self.finished = True
        if text:
            new = usage.get("completion_tokens", self.counted + 1) - self.counted
            rec.add_chunk(now, max(new, 1))
            self.counted += max(new, 1)
            rec.generated_text += text
        if usage:
            self.usage_seen = True
            rec.output_len = int(usage.get("completion_tokens", self.counted))
            rec.prompt_len = int(usage.get("prompt_tokens", rec.prompt_len))
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens", usage.get("cached_tokens"))
            if cached is not None:
                rec.cached_tokens = int(cached)

    def finish(self) -> None:
        if self.usage_seen:
            return
        rec = self.record
        if self.tokenizer is not None and rec.generated_text:
            rec.output_len = len(
                self.tokenizer.encode(rec.generated_text, add_special_tokens=False)
            )
        else:
            rec.output_len = self.counted


def _parser(cfg: ClientConfig, record: RequestRecord) -> NativeParser | OpenAIParser:
    if cfg.backend == "radixserve":
        return NativeParser(record)
    return OpenAIParser(record, cfg.tokenizer)


async def _exchange(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    payload: dict[str, Any],
    parser: NativeParser | OpenAIParser,
    clock: Clock,
) -> None:
    rec = parser.record
    async with client.stream("POST", cfg.path, json=payload) as resp:
        raise_for_auth(resp)
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            raise ServerError(f"HTTP {resp.status_code}: {body[:500]}")
        if not cfg.stream:
            body_bytes = await resp.aread()
            rec.end_time = clock()
            parser.on_event(json.loads(body_bytes), rec.end_time)
        else:
            done = False
            async for raw in sse_lines(resp):
                now = clock()
                line = raw.decode()
                if not line.startswith("data:"):
                    continue
                chunk = line[len("data:") :].strip()
                rec.end_time = now
                if chunk == "[DONE]":
                    done = True
                else:
                    parser.on_event(json.loads(chunk), now)
            if not (done or parser.finished):  # the connection closed mid-generation
                raise ServerError("the stream ended before the request finished (no [DONE])")
    parser.finish()
    if rec.output_len == 0:
        raise ServerError("the response carried no output tokens")


async def send_request(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    req: BenchRequest,
    clock: Clock = time.perf_counter,
) -> RequestRecord:
    """Send one request and record its timings; never raises (errors land in the record)."""
    record = RequestRecord(prompt_len=req.prompt_len)
    parser = _parser(cfg, record)
    payload = build_payload(cfg, req)
    record.start_time = clock()
    try:
        await asyncio.wait_for(_exchange(client, cfg, payload, parser, clock), cfg.request_timeout)
        record.success = True
    except asyncio.TimeoutError:
        record.error = f"timed out after {cfg.request_timeout:g} s"
    except Exception as e:  # a failed request is data, not a crash
        record.error = f"{type(e).__name__}: {e}"
    if not record.end_time:
        record.end_time = clock()
    return record


def make_client(
    cfg: ClientConfig, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    # Pool limits off: concurrency is bounded by the semaphore, not by httpx's 100 connections.
    # Idle connections are dropped after 3 s, before servers that close them after 5 s (uvicorn's
    # and llama-server's defaults) can close one just as it is reused (a spurious ReadError).
    timeout = httpx.Timeout(connect=30.0, read=cfg.read_timeout, write=60.0, pool=None)
    limits = httpx.Limits(
        max_connections=None, max_keepalive_connections=None, keepalive_expiry=3.0
    )
    key = resolve_api_key(cfg.api_key)
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return httpx.AsyncClient(
        base_url=cfg.base_url, timeout=timeout, limits=limits, transport=transport, headers=headers
    )


async def discover_model(client: httpx.AsyncClient) -> str:
    """The first model id from GET /v1/models, or "default" (servers without /v1/models take
    any name); an AuthError for HTTP 401."""
    try:
        resp = await client.get("/v1/models")
    except httpx.HTTPError:
        return "default"
    raise_for_auth(resp)
    try:
        return str(resp.json()["data"][0]["id"])
    except Exception:
        return "default"


async def model_info(client: httpx.AsyncClient) -> tuple[dict[str, Any], str]:
    """GET /get_model_info (radixserve's and SGLang's: model_path, tokenizer_path): the answer,
    or {} and why there is none (another server, or none listening); an AuthError for 401."""
    try:
        resp = await client.get("/get_model_info")
    except httpx.HTTPError as e:
        return {}, f"GET /get_model_info failed: {type(e).__name__}: {e}"
    raise_for_auth(resp)
    if resp.status_code != 200:
        return {}, f"GET /get_model_info answered HTTP {resp.status_code}"
    try:
        info = resp.json()
    except ValueError:
        info = None
    if not isinstance(info, dict):
        return {}, "GET /get_model_info answered no JSON object"
    return info, ""


async def sse_lines(resp: httpx.Response) -> AsyncIterator[bytes]:
    """Lines split at LF only, as SSE says; httpx's aiter_lines also splits at U+2028, U+0085
    and other characters that JSON carries unescaped inside a string."""
    buffer = b""
    async for chunk in resp.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if buffer:
        yield buffer
