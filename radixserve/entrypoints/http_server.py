"""The HTTP server: FastAPI routes (native SGLang API, OpenAI API, health, metrics, control) and
`launch_server`, which owns the scheduler/detokenizer children for the server's whole life.

`launch_server` starts the children, builds the app, creates the TokenizerManager inside
uvicorn's event loop (lifespan), and serves until SIGINT/SIGTERM or until a child dies; a
watchdog task turns a dead or silent child into a 503 on /health and a non-zero exit within a
few seconds. The children are shut down on every exit path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse

from radixserve.args import ServerArgs
from radixserve.entrypoints.http_utils import (
    SSE_DONE,
    SSE_HEADERS,
    ApiKeyMiddleware,
    chain,
    collect,
    error_response,
    first_item,
    install_error_handlers,
    install_request_bodies,
    json_response,
    parse_body,
    sse_event,
)
from radixserve.entrypoints.openai_api import model_aliases, resolved_model_path, served_model_name
from radixserve.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    error_body,
)
from radixserve.entrypoints.openai_serving import OpenAIServing
from radixserve.io_struct import GenerateReqInput
from radixserve.managers.metrics import CONTENT_TYPE, ServerMetrics
from radixserve.managers.tokenizer_manager import RequestError

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0
HEALTH_GENERATE_TIMEOUT_S = 60.0
WATCHDOG_INTERVAL_S = 0.5
GRACEFUL_SHUTDOWN_S = 3
HARD_EXIT_AFTER_S = 6.0


# -- per-app state -------------------------------------------------------------------------------
@dataclass
class AppState:
    server_args: ServerArgs
    procs: Any = None  # engine.Subprocesses, or None when a test provides the TokenizerManager
    tokenizer_manager: Any = None
    openai: OpenAIServing | None = None
    metrics: ServerMetrics | None = None
    server: Any = None  # uvicorn.Server
    failure: str | None = None  # set by the watchdog: why the server is going down
    exit_code: int = 0

    def find_failure(self) -> str | None:
        if self.failure is not None:
            return self.failure
        if self.procs is not None and (dead := self.procs.dead_child()) is not None:
            return dead
        return self._silent_scheduler()

    def _silent_scheduler(self) -> str | None:
        """Requests are pending but the scheduler's loop has not come round for
        watchdog_timeout s: it is stuck in one step. Liveness comes from the loop's heartbeat,
        not from request output (a long generation that streams nothing is healthy)."""
        timeout, procs = self.server_args.watchdog_timeout, self.procs
        states = getattr(self.tokenizer_manager, "rid_to_state", None)
        if procs is None or not states or not timeout or timeout <= 0:
            return None
        silent = procs.seconds_since_heartbeat()
        if silent <= timeout:
            return None
        return (
            f"the scheduler has been stuck for {silent:.0f} s with {len(states)} requests pending"
        )

    def request_exit(self, code: int) -> None:
        self.exit_code = code
        if self.server is not None:
            self.server.should_exit = True
            self.server.force_exit = True  # do not wait for requests that can never finish
        _arm_hard_exit(self.procs, code)


def _arm_hard_exit(procs: Any, code: int) -> None:
    """If the orderly shutdown stalls, stop the children and leave anyway."""

    def hard_exit() -> None:
        logger.error("shutdown did not finish within %.0f s; exiting", HARD_EXIT_AFTER_S)
        if procs is not None:
            procs.shutdown()
        os._exit(code)

    timer = threading.Timer(HARD_EXIT_AFTER_S, hard_exit)
    timer.daemon = True
    timer.start()


def _state(request: Request) -> AppState:
    return request.app.state.rs


def _tm(request: Request) -> Any:
    return _state(request).tokenizer_manager


async def _watchdog(state: AppState) -> None:
    await _announce_ready(state)
    while True:
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
        reason = state.find_failure()
        if reason is not None:
            state.failure = reason
            logger.error("%s; shutting the server down", reason)
            if hasattr(state.tokenizer_manager, "fail_all"):
                state.tokenizer_manager.fail_all(reason)  # waiting clients get a 503 now
            state.request_exit(1)
            return


async def _announce_ready(state: AppState) -> None:
    server = state.server
    if server is None:
        return
    while not server.started:
        await asyncio.sleep(0.05)
    args = state.server_args
    logger.info("radixserve ready on http://%s:%d", args.host, args.port)


# -- routes --------------------------------------------------------------------------------------
router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 when the children live and the scheduler answers; 503 (with the reason) otherwise."""
    st = _state(request)
    ping = asyncio.ensure_future(st.tokenizer_manager.get_server_info())
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    try:
        while not ping.done():
            if (reason := st.find_failure()) is not None:
                return error_response(reason, 503)
            if time.monotonic() > deadline:
                return error_response("the scheduler did not respond", 503)
            await asyncio.wait({ping}, timeout=WATCHDOG_INTERVAL_S)
        ping.result()
    except Exception as e:
        return error_response(f"the scheduler did not respond: {e!r}", 503)
    finally:
        ping.cancel()
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
    try:
        gen = _tm(request).generate_request(obj, None)
        await asyncio.wait_for(collect(gen, request), HEALTH_GENERATE_TIMEOUT_S)
    except Exception as e:
        return error_response(f"generation failed: {e!r}", 503)
    return Response(status_code=200)


@router.post("/generate")
async def generate(request: Request) -> Response:
    body = await parse_body(request, GenerateRequest)
    obj = GenerateReqInput(**body.model_dump())
    gen = _tm(request).generate_request(obj, None)
    if not obj.stream:
        return json_response(await collect(gen, request))
    first = await first_item(gen, request)
    return StreamingResponse(
        _native_stream(first, gen), media_type="text/event-stream", headers=SSE_HEADERS
    )


async def _native_stream(first: Any, gen: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    try:
        async for out in chain(first, gen):
            yield sse_event(out)
    except RequestError as e:
        yield sse_event(error_body(str(e), e.status_code))
    finally:
        await gen.aclose()
    yield SSE_DONE


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    return await _state(request).openai.completions(body, request)  # type: ignore[union-attr]


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    return await _state(request).openai.chat_completions(body, request)  # type: ignore[union-attr]


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    return json_response(_state(request).openai.list_models())  # type: ignore[union-attr]


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    serving: OpenAIServing = _state(request).openai  # type: ignore[assignment]
    serving.check_model(model_id)
    return json_response(serving.model_card())


@router.get("/model_info")
async def model_info(request: Request) -> Response:
    args = _state(request).server_args
    path = resolved_model_path(args)
    return json_response(
        {
            "model_path": path,
            "tokenizer_path": args.tokenizer_path or path,
            "is_generation": True,
            "served_model_name": served_model_name(args),
        }
    )


@router.get("/server_info")
async def server_info(request: Request) -> Response:
    st = _state(request)
    info = await st.tokenizer_manager.get_server_info()
    pids = {}
    if st.procs is not None:  # lets operators (and tests) find the children
        pids = {
            "scheduler_pid": st.procs.scheduler.pid,
            "detokenizer_pid": st.procs.detokenizer.pid,
        }
    return json_response({**dataclasses.asdict(st.server_args), **info, **pids})


@router.get("/flush_cache", operation_id="flush_cache_get")
@router.post("/flush_cache", operation_id="flush_cache_post")
async def flush_cache(request: Request) -> Response:
    out = await _tm(request).flush_cache()
    if not out.success:
        return error_response(out.message or "cache flush failed", 400)
    return Response("Cache flushed.\n", status_code=200)


class AbortRequestBody(BaseModel):
    rid: str


# The bodies that routes read with parse_body, for the OpenAPI document.
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/generate": GenerateRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/abort_request": AbortRequestBody,
}


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    body = await parse_body(request, AbortRequestBody)
    # The waiting client then receives its output with finish_reason "abort".
    return json_response({"success": _tm(request).request_abort(body.rid)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    st = _state(request)
    assert st.metrics is not None
    with contextlib.suppress(Exception):
        info = await asyncio.wait_for(st.tokenizer_manager.get_server_info(), HEALTH_TIMEOUT_S)
        st.metrics.update_from_server_info(info)
    return Response(st.metrics.render(), media_type=CONTENT_TYPE)


# -- app and launch ------------------------------------------------------------------------------
def build_app(
    server_args: ServerArgs,
    make_tokenizer_manager: Callable[[ServerMetrics], Any],
    procs: Any = None,
) -> FastAPI:
    """The FastAPI app. `make_tokenizer_manager(metrics)` runs inside the serving event loop."""
    state = AppState(server_args, procs=procs)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.metrics = ServerMetrics(served_model_name(server_args))
        tm = make_tokenizer_manager(state.metrics)
        if hasattr(tm, "start"):
            tm.start()
        state.tokenizer_manager = tm
        state.openai = OpenAIServing(
            tm,
            served_model_name(server_args),
            model_aliases(server_args),
            resolved_model_path(server_args),
        )
        watchdog = asyncio.create_task(_watchdog(state))
        try:
            yield
        finally:
            watchdog.cancel()
            if hasattr(tm, "close"):
                tm.close()

    app = FastAPI(title="radixserve", lifespan=lifespan)
    app.state.rs = state
    app.include_router(router)
    install_request_bodies(app, REQUEST_BODIES)
    install_error_handlers(app)
    if server_args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=server_args.api_key)
    return app


class _Signals:
    """SIGINT/SIGTERM: abort start-up (KeyboardInterrupt) or ask uvicorn to stop once serving.

    uvicorn installs its own handlers while it serves and, when done, restores these and
    re-raises the signal it caught; this handler then only asks for an exit again (a no-op).
    """

    def __init__(self) -> None:
        self.server: Any = None
        self.previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self)

    def __call__(self, signum: int, frame: Any) -> None:
        if self.server is None:
            raise KeyboardInterrupt
        self.server.should_exit = True

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def launch_server(server_args: ServerArgs) -> int:
    """Serve until a signal (exit 0) or a failure (exit non-zero); always stop the children."""
    from radixserve.entrypoints.engine import Subprocesses, create_tokenizer_manager
    from radixserve.utils import configure_logging

    configure_logging(server_args.log_level)
    signals = _Signals()
    procs = None
    try:
        procs = Subprocesses(server_args)
        app = build_app(
            server_args, lambda m: create_tokenizer_manager(server_args, procs, m), procs
        )
        return _serve(app, server_args, signals)
    except KeyboardInterrupt:
        logger.info("interrupted; shutting down")
        return 0
    except Exception as e:
        logger.error("the server failed: %s: %s", type(e).__name__, e)
        return 1
    finally:
        if procs is not None:
            procs.shutdown()
        signals.restore()


def _serve(app: FastAPI, server_args: ServerArgs, signals: _Signals) -> int:
    import uvicorn

    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        log_level=server_args.log_level.lower(),
        access_log=server_args.log_level.lower() == "debug",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=5,
    )
    server = uvicorn.Server(config)
    state: AppState = app.state.rs
    state.server = signals.server = server
    try:
        server.run()
    except SystemExit as e:  # uvicorn exits on a failed start (port in use, lifespan error)
        return e.code if isinstance(e.code, int) and e.code else 1
    if not server.started:
        return 1
    return state.exit_code
