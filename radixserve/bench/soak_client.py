"""The client side of the soak run (`bench.soak_actions`): one POST and what came back.

`exchange` sends a body (raw bytes for malformed JSON) and fills a `Reply` from a JSON body or
from SSE events (native `/generate` events carry the cumulative text and `meta_info`; OpenAI
chunks carry deltas and one finish_reason per choice). SSE lines split at LF only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from radixserve.bench.client import sse_lines


@dataclass
class Reply:
    """What the client saw of one response (streaming or not)."""

    status: int = 0
    finish: str | None = None
    finishes: int = 0  # finish_reason occurrences (an OpenAI stream has exactly one)
    text: str = ""
    tokens: int | None = None
    error: str | None = None  # an error event inside a 200 stream, or the error body
    error_code: int | None = None
    malformed: str | None = None  # a 200 body or SSE event that is not the expected JSON
    done: bool = True  # a stream ended with [DONE]
    events: int = 0
    end: float = 0.0  # time.monotonic() of the last byte


# -- parsing -------------------------------------------------------------------------------------
def _on_event(reply: Reply, api: str, data: dict[str, Any]) -> None:
    reply.events += 1
    if "error" in data:
        err = data["error"]
        reply.error = str(err.get("message", err)) if isinstance(err, dict) else str(err)
        reply.error_code = err.get("code") if isinstance(err, dict) else None
        return
    if api == "native":
        meta = data.get("meta_info") or {}
        reply.text = data.get("text") or ""
        reply.tokens = meta.get("completion_tokens", reply.tokens)
        if meta.get("finish_reason"):
            reply.finish = meta["finish_reason"].get("type")
            reply.finishes += 1
        return
    for choice in data.get("choices") or []:
        part = choice.get("delta") or choice.get("message") or {}
        reply.text += choice.get("text") or part.get("content") or ""
        if choice.get("finish_reason"):
            reply.finish = choice["finish_reason"]
            reply.finishes += 1
    if data.get("usage"):
        reply.tokens = data["usage"].get("completion_tokens")


async def exchange(
    client: httpx.AsyncClient, path: str, body: Any, stream: bool, max_events: int | None = None
) -> Reply:
    """POST `body` (bytes are sent raw) and read the reply; with `max_events` a stream is closed
    after that many events, which is a client disconnect."""
    api = "native" if path == "/generate" else "openai"
    kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    reply = Reply()
    async with client.stream("POST", path, **kw) as resp:
        reply.status = resp.status_code
        if resp.status_code != 200 or not stream:
            raw = await resp.aread()
            reply.end = time.monotonic()
            _parse_whole(reply, api, raw)
            return reply
        reply.done = False
        async for line in sse_lines(resp):
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:") :].strip().decode()
            reply.end = time.monotonic()
            if data == "[DONE]":
                reply.done = True
                break
            try:
                _on_event(reply, api, json.loads(data))
            except ValueError:
                reply.malformed = f"SSE event is not JSON: {data[:200]!r}"
                break
            if max_events is not None and reply.events >= max_events:
                break
    return reply


def _parse_whole(reply: Reply, api: str, raw: bytes) -> None:
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if isinstance(data, dict):
        _on_event(reply, api, data)
    else:
        reply.malformed = f"body is not a JSON object: {raw[:200]!r}"
