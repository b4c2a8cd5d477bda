"""HTTP plumbing shared by the native and the OpenAI routes: JSON/SSE responses, body parsing
(and its description in the OpenAPI document), waiting on the TokenizerManager while watching
for client disconnects, error handlers, API key.

Used by `http_server` (routes, app) and `openai_api` (OpenAI endpoints).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from radixserve.entrypoints.openai_protocol import (
    error_body,
)
from radixserve.managers.tokenizer_manager import RequestError, detached

logger = logging.getLogger(__name__)

# Reachable without the API key, as in SGLang (probes and scrapers; /dashboard is a page
# without data, its stream needs the key).
OPEN_PATHS = ("/health", "/health_generate", "/metrics", "/dashboard")
BodyT = TypeVar("BodyT", bound=BaseModel)
REF_TEMPLATE = "#/components/schemas/{model}"
UNION_TAGS = frozenset(("str", "int", "float", "bool", "none", "list", "dict", "any"))


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


def json_response(content: Any, status_code: int = 200) -> Response:
    if isinstance(content, BaseModel):
        body = content.model_dump_json()
    else:
        body = orjson.dumps(content).decode()  # NaN/inf → null; json.dumps would raise
    return Response(body, status_code=status_code, media_type="application/json")


def error_response(
    message: str, status_code: int = 400, headers: dict[str, str] | None = None
) -> Response:
    response = json_response(error_body(message, status_code), status_code)
    response.headers.update(headers or {})
    return response


def sse_event(data: Any) -> bytes:
    if isinstance(data, BaseModel):
        return b"data: " + data.model_dump_json().encode() + b"\n\n"
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
# Past this a body is refused unread (a 50 MB prompt's parse and tokenization took the
# server's memory until the kernel killed it): more than any context's worth of text.
MAX_BODY_BYTES = 64 << 20
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def parse_body(request: Request, model: type[BodyT]) -> BodyT:
    """Parse a JSON body whatever its Content-Type (curl -d sends a form type). A client that
    leaves before its body has arrived raises starlette's ClientDisconnect: a 499, nothing
    logged (install_error_handlers). One past MAX_BODY_BYTES is a 413, read no further."""
    data = loads_json(await _read_body(request))
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestError(validation_message(e.errors())) from None


async def _read_body(request: Request) -> bytes:
    too_large = RequestError(f"the body is larger than {MAX_BODY_BYTES >> 20} MiB", 413)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def loads_json(raw: bytes) -> Any:
    """orjson, else Python's parser, which also reads NaN, Infinity and 1e999: such a number is
    then refused by validation with a message that names its field. What orjson refuses for
    another reason (a lone surrogate, which no tokenizer takes) stays refused."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        error = RequestError(f"the body is not valid JSON: {e}")
    try:
        data = json.loads(raw)
        orjson.dumps(data)  # raises on a lone surrogate; NaN and inf pass (as null)
    except (ValueError, TypeError, RecursionError):
        raise error from None
    return data


def validation_message(errors: list[Any]) -> str:
    """Pydantic errors as one line that names each field: unknown fields first, together; then
    per field the reasons it failed (a union's members each add one)."""
    unknown = [_loc(err) for err in errors if err.get("type") == "extra_forbidden"]
    reasons: dict[str, list[str]] = {}
    for err in errors:
        if err.get("type") != "extra_forbidden":
            msgs = reasons.setdefault(_loc(err), [])
            if err.get("msg") not in msgs:
                msgs.append(str(err.get("msg")))
    # A union member that failed higher up (a dict is not a list) would hide the deeper reason
    # (a bad or unknown field inside the dict): only the deepest are named.
    deepest = [
        loc for loc in reasons if not any(o.startswith(loc + ".") for o in (*reasons, *unknown))
    ]
    parts = [f"unsupported field(s): {', '.join(unknown)}"] if unknown else []
    for loc in deepest[:5]:
        why = " or ".join(reasons[loc])
        parts.append(f"{loc}: {why}" if loc else why)
    return "; ".join(parts) or "invalid request"


def _loc(err: Any) -> str:
    """The field's path, without FastAPI's "body" and pydantic's union member tags."""
    return ".".join(str(x) for x in err.get("loc", ()) if not _is_tag(x))


def _is_tag(x: Any) -> bool:
    return isinstance(x, str) and (x == "body" or "[" in x or x in UNION_TAGS)


def with_request_bodies(
    schema: dict[str, Any], bodies: dict[str, type[BaseModel]]
) -> dict[str, Any]:
    """Add to an OpenAPI document the JSON body of each POST route in `bodies` (path → model):
    routes that read their body with parse_body are otherwise documented without one."""
    refs, defs = models_json_schema(
        [(m, "validation") for m in bodies.values()], ref_template=REF_TEMPLATE
    )
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    for path, model in bodies.items():
        operation = schema["paths"][path]["post"]
        content = {"application/json": {"schema": refs[(model, "validation")]}}
        operation["requestBody"] = {"required": True, "content": content}
        operation["responses"].setdefault("400", {"description": "Invalid request"})
    return schema


def install_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make the app's /openapi.json describe the bodies that parse_body reads."""
    original = app.openapi
    app.openapi = lambda: with_request_bodies(original(), bodies)  # type: ignore[method-assign]


async def until_disconnected(aw: Awaitable[Any], request: Request | None) -> Any:
    """Await `aw`, cancelling it (so the TokenizerManager aborts the request) as soon as the
    client disconnects: the server's disconnect message is awaited, not polled (a poll each
    second let an abandoned request run on for up to that long, and the client's
    retry with its rid was refused meanwhile as a duplicate)."""
    task = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(_disconnect(request)) if request is not None else None
    try:
        done, _ = await asyncio.wait({task, gone} - {None}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientDisconnected
    finally:
        for t in (task, gone):
            if t is not None and not t.done():
                t.cancel()
                await asyncio.wait({t})


async def _disconnect(request: Request) -> None:
    """Returns once the client is gone. The body has been read: the next message the server
    has for the request is its disconnect (or, once answered, the end of the response)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(gen: AsyncIterator[Any], request: Request | None) -> Any:
    """The last item of a non-streaming generation (None if the client went away)."""

    async def last() -> Any:
        out = None
        async for item in gen:
            out = item
        return out

    return await until_disconnected(last(), request)


async def first_item(gen: AsyncIterator[Any], request: Request | None) -> Any:
    """Wait for the first streamed item, so that input errors still become an HTTP 400. It is
    sent only once the response starts: a copy, or the tokens that arrive meanwhile would join
    its lists (its text would not)."""
    try:
        return detached(await until_disconnected(gen.__anext__(), request))
    except StopAsyncIteration:
        return None


async def chain(first: Any, gen: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for item in gen:
        yield item


# -- errors and auth -----------------------------------------------------------------------------
def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> Response:
        return error_response(validation_message(exc.errors()), 400)

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> Response:
        return error_response(str(exc), exc.status_code, exc.headers)

    @app.exception_handler(ClientDisconnected)
    @app.exception_handler(ClientDisconnect)  # starlette's, from reading a request's body
    async def on_disconnect(_: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(str(exc.detail), exc.status_code, exc.headers)  # (405: Allow)

    @app.exception_handler(Exception)
    async def on_error(_: Request, exc: Exception) -> Response:
        logger.exception("request failed")
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)


class ApiKeyMiddleware:
    """Every route except OPEN_PATHS needs `Authorization: Bearer <key>` (401 otherwise)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # (rstrip: "/dashboard/" is open too; routing redirects it without the slash)
        # (a CORS preflight carries no credentials; CORSMiddleware answers it before this)
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and scope["path"].rstrip("/") not in OPEN_PATHS
        ):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(auth, self.expected):
                response = error_response("invalid or missing API key", 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
