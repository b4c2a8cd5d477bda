"""http_utils' error handlers at the ASGI level: what a route answers when its client is gone
before the body arrived, and that nothing is logged as an internal error."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request

from radixserve.entrypoints.http_utils import install_error_handlers, parse_body
from radixserve.entrypoints.openai_protocol import CompletionRequest


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/parse")
    async def parse(request: Request) -> dict[str, Any]:
        body = await parse_body(request, CompletionRequest)
        return {"prompt": body.prompt}

    return app


def _call(app: FastAPI, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One POST /parse whose client sends `messages` (then nothing more); what the app sent."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/parse",
        "raw_path": b"/parse",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    inbox = list(messages)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if inbox:
            return inbox.pop(0)
        await asyncio.sleep(3600)  # a client that never sends more
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    return sent


def test_client_gone_while_the_body_is_read_is_a_quiet_499(caplog):
    part = {"type": "http.request", "body": b'{"model": "m", "prompt": "He', "more_body": True}
    with caplog.at_level(logging.DEBUG):
        sent = _call(_app(), [part, {"type": "http.disconnect"}])
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_whole_body_is_still_parsed():
    body = b'{"model": "m", "prompt": "Hello"}'
    sent = _call(_app(), [{"type": "http.request", "body": body, "more_body": False}])
    assert sent[0]["status"] == 200
    assert sent[1]["body"] == b'{"prompt":"Hello"}'


def test_the_first_streamed_item_is_a_copy_kept_until_the_response_starts():
    """Its lists are the request state's, which later outputs extend before the response sends
    it: the first chunk of a native stream carried 11 ids with completion_tokens 1."""
    from radixserve.entrypoints.http_utils import first_item

    ids, logprobs = [7], [(-0.5, 7, None)]
    item = {"text": "a", "output_ids": ids, "meta_info": {"output_token_logprobs": logprobs}}

    async def gen():
        yield item

    first = asyncio.run(first_item(gen(), None))
    ids.append(8)
    logprobs.append((-0.1, 8, None))
    assert first["output_ids"] == [7] and first["meta_info"]["output_token_logprobs"] == [
        (-0.5, 7, None)
    ]


def test_a_client_gone_is_noticed_at_once_not_at_the_next_poll():
    """The disconnect was polled every second: an abandoned request ran on for up to that
    long, and its client's retry with the same rid was refused as a duplicate meanwhile."""
    from radixserve.entrypoints.http_utils import ClientDisconnected, until_disconnected

    async def body() -> None:
        gone = asyncio.Event()
        messages = [{"type": "http.request", "body": b"", "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        work = asyncio.Event()  # never set: the request's work outlives its client
        cancelled = []

        async def generate() -> None:
            try:
                await work.wait()
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        waiter = asyncio.ensure_future(until_disconnected(generate(), request))
        await asyncio.sleep(0)
        gone.set()
        for _ in range(20):  # a few turns of the loop, no clock (the poll waited a second)
            await asyncio.sleep(0)
        assert waiter.done() and cancelled == [True]
        assert isinstance(waiter.exception(), ClientDisconnected)

    asyncio.run(body())
