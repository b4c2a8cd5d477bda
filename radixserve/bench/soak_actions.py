"""The request kinds of the soak run (`bench.soak`): what each one sends and what counts as right.

Every action takes an `ActionContext` (HTTP client, seeded rng, limits) and returns an `Outcome`
whose `result` is one of `RESULTS`. The kinds: streaming `/v1/chat/completions`, non-streaming
`/v1/completions`, native `/generate` (plain and streaming), a request aborted through
`POST /abort_request`, a client that disconnects early, bad input (a 4xx is expected), and a
`json_schema` grammar request whose output must parse when it finishes with "stop".

An abort is judged by `classify_abort`: an abort acknowledged with `success: true` must end the
request with finish_reason "abort", unless the request had already finished, which the client
sees as its final response arriving within `abort_grace` seconds of the acknowledgement.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from radixserve.bench.soak_client import Reply, exchange
from radixserve.bench.soak_inputs import (
    BAD_INPUTS,
    GRAMMAR_SCHEMA,
    make_messages,
    make_prompt,
    matches_schema,
)

OK, INVALID, DISCONNECTED = "ok", "invalid", "disconnected"
EXPECTED_4XX, UNEXPECTED_4XX, HTTP_503, OTHER_5XX = "4xx", "unexpected_4xx", "503", "other_5xx"
TIMEOUT, TRANSPORT = "timeout", "transport_error"
ABORTED, FINISHED_BEFORE_ABORT = "aborted", "finished_before_abort"
ABORT_LOST, ABORT_UNACKED = "abort_lost", "abort_unacked"
RESULTS = (
    OK,
    ABORTED,
    FINISHED_BEFORE_ABORT,
    DISCONNECTED,
    EXPECTED_4XX,
    HTTP_503,
    UNEXPECTED_4XX,
    OTHER_5XX,
    TIMEOUT,
    TRANSPORT,
    INVALID,
    ABORT_LOST,
    ABORT_UNACKED,
)
# Results that break an invariant of the run (503 under overload is allowed).
FAILURES = (UNEXPECTED_4XX, OTHER_5XX, TIMEOUT, TRANSPORT, INVALID, ABORT_LOST, ABORT_UNACKED)


@dataclass
class Outcome:
    kind: str
    result: str
    detail: str = ""
    body: Any = None  # the request body, kept for failures
    latency: float = 0.0  # seconds the action took


@dataclass
class ActionContext:
    client: httpx.AsyncClient
    rng: random.Random
    model: str
    max_new_tokens: int  # upper bound of ordinary requests
    abort_new_tokens: int  # requests to abort or disconnect ask for this many (ignore_eos)
    max_prompt_words: int
    abort_delay_max: float  # seconds between submission and /abort_request
    abort_grace: float
    rid_prefix: str
    counter: itertools.count = field(default_factory=itertools.count)
    last_body: Any = None  # what the current action sent, for the report of a timeout

    def new_rid(self) -> str:
        return f"{self.rid_prefix}-{next(self.counter)}"


# -- judging -------------------------------------------------------------------------------------
def status_result(status: int) -> str:
    if status == 503:
        return HTTP_503
    return OTHER_5XX if status >= 500 else UNEXPECTED_4XX


def check_reply(
    reply: Reply,
    stream: bool,
    openai: bool,
    max_tokens: int,
    finishes: tuple[str, ...] = ("stop", "length"),
) -> tuple[str, str]:
    """(result, detail) for a request that should have been served with one of `finishes`."""
    if reply.status != 200:
        return status_result(reply.status), f"HTTP {reply.status}: {reply.error or reply.malformed}"
    if reply.malformed is not None:
        return INVALID, reply.malformed
    if reply.error is not None:
        code = reply.error_code or 500
        return status_result(code) if code >= 500 else UNEXPECTED_4XX, f"error: {reply.error}"
    if stream and not reply.done:
        return INVALID, "the stream ended without [DONE]"
    if reply.finish not in finishes:
        return INVALID, f"finish_reason {reply.finish!r}"
    if stream and openai and reply.finishes != 1:
        return INVALID, f"{reply.finishes} finish_reason chunks"
    if reply.tokens is not None and reply.tokens > max_tokens:
        return INVALID, f"{reply.tokens} tokens for max_tokens {max_tokens}"
    return OK, ""


def classify_abort(
    reply: Reply,
    ack_time: float | None,
    finished_unacked: bool,
    grace: float,
    stream: bool = False,
    openai: bool = False,
) -> tuple[str, str]:
    """(result, detail) of a request that was aborted; see the module docstring for the rule."""
    allowed = ("stop", "length", "abort")
    result, detail = check_reply(reply, stream, openai, 1 << 30, allowed)
    if result != OK:
        return result, detail
    if reply.finish == "abort":
        if ack_time is None:
            return INVALID, "finish_reason abort but no abort was acknowledged"
        return ABORTED, ""
    if ack_time is None:
        if finished_unacked:
            return FINISHED_BEFORE_ABORT, ""
        return ABORT_UNACKED, "/abort_request kept answering success:false while it ran"
    late = reply.end - ack_time
    if late <= grace:
        return FINISHED_BEFORE_ABORT, ""
    return ABORT_LOST, (
        f"acknowledged, then finished {reply.finish!r} {late:.2f} s later "
        f"with {reply.tokens} tokens"
    )


# -- actions -------------------------------------------------------------------------------------
def _temperature(ctx: ActionContext) -> float:
    return ctx.rng.choice((0.0, 0.0, 0.7, 1.0))


def _request(ctx: ActionContext, api: str, stream: bool, max_tokens: int, **extra: Any) -> Any:
    """(path, body) of an ordinary request through `api` (chat | completion | native)."""
    path, body = _build(ctx, api, stream, max_tokens, **extra)
    ctx.last_body = body
    return path, body


def _build(ctx: ActionContext, api: str, stream: bool, max_tokens: int, **extra: Any) -> Any:
    t = _temperature(ctx)
    if api == "native":
        sp = {"max_new_tokens": max_tokens, "temperature": t, **extra.pop("sampling", {})}
        body = {"text": make_prompt(ctx.rng, ctx.max_prompt_words), "sampling_params": sp}
        return "/generate", {**body, "stream": stream, **extra}
    body = {"model": ctx.model, "max_tokens": max_tokens, "temperature": t, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if api == "chat":
        body["messages"] = make_messages(ctx.rng, ctx.max_prompt_words)
        return "/v1/chat/completions", {**body, **extra}
    body["prompt"] = make_prompt(ctx.rng, ctx.max_prompt_words)
    return "/v1/completions", {**body, **extra}


async def _served(ctx: ActionContext, kind: str, api: str, stream: bool) -> Outcome:
    max_tokens = ctx.rng.randint(1, ctx.max_new_tokens)
    path, body = _request(ctx, api, stream, max_tokens)
    reply = await exchange(ctx.client, path, body, stream)
    result, detail = check_reply(reply, stream, api != "native", max_tokens)
    return Outcome(kind, result, detail, body)


async def chat_stream(ctx: ActionContext) -> Outcome:
    return await _served(ctx, "chat_stream", "chat", True)


async def completion(ctx: ActionContext) -> Outcome:
    return await _served(ctx, "completion", "completion", False)


async def generate(ctx: ActionContext) -> Outcome:
    return await _served(ctx, "generate", "native", False)


async def generate_stream(ctx: ActionContext) -> Outcome:
    return await _served(ctx, "generate_stream", "native", True)


async def abort(ctx: ActionContext) -> Outcome:
    """A long request (ignore_eos) with its own rid, aborted after a random delay."""
    api, stream = ctx.rng.choice((("native", True), ("native", False), ("chat", True)))
    rid = ctx.new_rid()
    long = {"sampling": {"ignore_eos": True}} if api == "native" else {"ignore_eos": True}
    path, body = _request(ctx, api, stream, ctx.abort_new_tokens, rid=rid, **long)
    task = asyncio.ensure_future(exchange(ctx.client, path, body, stream))
    try:
        await asyncio.sleep(ctx.rng.uniform(0.0, ctx.abort_delay_max))
        ack_time, finished_unacked = await _abort_until_acked(ctx, rid, task)
        reply = await task
    finally:
        if not task.done():
            task.cancel()
        elif not task.cancelled():  # (one failed while the abort did: read, or asyncio logs
            task.exception()  # "Task exception was never retrieved" and its traceback)
    args = (ctx.abort_grace, stream, api != "native")
    result, detail = classify_abort(reply, ack_time, finished_unacked, *args)
    return Outcome("abort", result, detail and f"rid {rid}: {detail}", body)


async def _abort_until_acked(
    ctx: ActionContext, rid: str, task: asyncio.Future, patience: float = 10.0
) -> tuple[float | None, bool]:
    """POST /abort_request until success:true (the rid may not be registered yet) or the
    request is over; returns (time of the acknowledgement, finished without one)."""
    deadline = time.monotonic() + patience
    while True:
        resp = await ctx.client.post("/abort_request", json={"rid": rid})
        if resp.status_code == 200 and resp.json().get("success") is True:
            return time.monotonic(), False
        if resp.status_code != 200:
            raise AbortRouteError(resp.status_code, resp.text[:200])
        if task.done():
            return None, True
        if time.monotonic() > deadline:
            return None, False
        await asyncio.sleep(0.05)


class AbortRouteError(RuntimeError):
    """/abort_request itself failed."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"/abort_request answered HTTP {status}: {text}")
        self.status = status


async def disconnect(ctx: ActionContext) -> Outcome:
    """Close a stream after a few events, or give up on a non-streaming request."""
    api, stream = ctx.rng.choice((("chat", True), ("native", True), ("completion", False)))
    long = {"sampling": {"ignore_eos": True}} if api == "native" else {"ignore_eos": True}
    path, body = _request(ctx, api, stream, ctx.abort_new_tokens, **long)
    if stream:
        k = ctx.rng.randint(1, 4)
        reply = await exchange(ctx.client, path, body, True, max_events=k)
        if reply.status == 200 and reply.error is None and reply.events >= k:
            return Outcome("disconnect", DISCONNECTED)
        result, detail = check_reply(reply, True, api != "native", ctx.abort_new_tokens)
        return Outcome("disconnect", result, detail, body)
    try:
        wait = ctx.rng.uniform(0.05, 1.0)
        reply = await asyncio.wait_for(exchange(ctx.client, path, body, False), wait)
    except asyncio.TimeoutError:
        return Outcome("disconnect", DISCONNECTED)
    result, detail = check_reply(reply, False, True, ctx.abort_new_tokens)
    return Outcome("disconnect", result, detail, body)


async def duplicate_rid(ctx: ActionContext) -> Outcome:
    """Two requests with one rid at once: each is served or refused with a 4xx, and at least
    one is served; neither may hang or take the other's output."""
    rid = ctx.new_rid()
    max_tokens = ctx.rng.randint(1, ctx.max_new_tokens)
    path, body = _request(ctx, "native", False, max_tokens, rid=rid)
    replies = await asyncio.gather(*(exchange(ctx.client, path, body, False) for _ in "ab"))
    served = 0
    for reply in replies:
        if 400 <= reply.status < 500 and reply.status != 404:
            continue  # refused: the rid is in use
        result, detail = check_reply(reply, False, False, max_tokens)
        if result != OK:
            return Outcome("duplicate_rid", result, f"rid {rid}: {detail}", body)
        served += 1
    if served == 0:
        return Outcome("duplicate_rid", UNEXPECTED_4XX, f"rid {rid}: both refused", body)
    return Outcome("duplicate_rid", OK)


async def bad_input(ctx: ActionContext) -> Outcome:
    path, body, expected = ctx.rng.choice(BAD_INPUTS)
    if isinstance(body, dict) and path != "/generate":
        body = {"model": ctx.model, **body}
    shown = body.decode(errors="replace") if isinstance(body, bytes) else body
    ctx.last_body = shown
    reply = await exchange(ctx.client, path, body, False)
    if reply.status == 200:
        return Outcome("bad_input", INVALID, f"{path} accepted bad input", shown)
    if reply.status not in expected:
        detail = f"{path}: HTTP {reply.status} (expected {sorted(expected)}): {reply.error}"
        result = status_result(reply.status)
        return Outcome("bad_input", result, detail, shown)
    if reply.error is None or reply.error_code != reply.status:
        return Outcome("bad_input", INVALID, f"{path}: no OpenAI-style error body", shown)
    return Outcome("bad_input", EXPECTED_4XX)


async def grammar(ctx: ActionContext) -> Outcome:
    """json_schema through chat (response_format) or /generate (sampling_params.json_schema)."""
    api, stream = ctx.rng.choice((("chat", False), ("chat", True), ("native", False)))
    max_tokens = ctx.rng.randint(32, max(32, ctx.max_new_tokens))
    if api == "chat":
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": GRAMMAR_SCHEMA}}
        path, body = _request(ctx, api, stream, max_tokens, response_format=fmt)
    else:
        schema = {"sampling": {"json_schema": json.dumps(GRAMMAR_SCHEMA)}}
        path, body = _request(ctx, api, stream, max_tokens, **schema)
    reply = await exchange(ctx.client, path, body, stream)
    result, detail = check_reply(reply, stream, api != "native", max_tokens)
    if result == OK and reply.finish == "stop" and not matches_schema(reply.text):
        result, detail = INVALID, f"output does not match the schema: {reply.text[:200]!r}"
    return Outcome("grammar", result, detail, body)


ACTIONS = {
    "chat_stream": chat_stream,
    "completion": completion,
    "generate": generate,
    "generate_stream": generate_stream,
    "abort": abort,
    "disconnect": disconnect,
    "duplicate_rid": duplicate_rid,
    "bad_input": bad_input,
    "grammar": grammar,
}
DEFAULT_MIX = {
    "chat_stream": 3,
    "completion": 2,
    "generate": 2,
    "generate_stream": 2,
    "abort": 3,
    "disconnect": 2,
    "duplicate_rid": 1,
    "bad_input": 2,
    "grammar": 1,
}


async def run_action(kind: str, ctx: ActionContext, timeout: float) -> Outcome:
    """One action, bounded by `timeout`; a failed request is data, never an exception."""
    ctx.last_body = None
    start = time.monotonic()
    try:
        outcome = await asyncio.wait_for(ACTIONS[kind](ctx), timeout)
    except asyncio.TimeoutError:
        outcome = Outcome(kind, TIMEOUT, f"no answer within {timeout:g} s")
    except httpx.TimeoutException as e:
        outcome = Outcome(kind, TIMEOUT, f"{type(e).__name__}: {e}")
    except httpx.TransportError as e:
        outcome = Outcome(kind, TRANSPORT, f"{type(e).__name__}: {e}")
    except AbortRouteError as e:
        outcome = Outcome(kind, status_result(e.status), str(e))
    except ValueError as e:  # e.g. an /abort_request answer that is not JSON
        outcome = Outcome(kind, INVALID, f"{type(e).__name__}: {e}")
    if outcome.body is None and outcome.result in FAILURES:
        outcome.body = ctx.last_body
    outcome.latency = time.monotonic() - start
    return outcome
