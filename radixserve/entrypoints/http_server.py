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
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, ConfigDict
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response, StreamingResponse

from radixserve.args import ServerArgs
from radixserve.entrypoints.dashboard import router as dashboard_router
from radixserve.entrypoints.engine import server_info_view
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
from radixserve.entrypoints.openai_api import (
    adapter_name_shadows_the_model,
    model_aliases,
    resolved_model_path,
    served_model_name,
)
from radixserve.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    TokenId,
    error_body,
)
from radixserve.entrypoints.openai_serving import OpenAIServing, model_sampling_defaults
from radixserve.entrypoints.responses_serving import install_responses_api
from radixserve.io_struct import GenerateReqInput
from radixserve.managers.metrics import CONTENT_TYPE, ServerMetrics
from radixserve.managers.tokenizer_manager import RequestError
from radixserve.managers.tokenizer_utils import exported_tokenizer_dir

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0
# How long /metrics waits for the scheduler's gauges before it renders the last ones it has:
# the scheduler answers between steps, and a long prefill step would hold the scrape past
# Prometheus' default 10 s scrape timeout (the counters are this process's own, always live).
METRICS_INFO_WAIT_S = 2.0
HEALTH_GENERATE_TIMEOUT_S = 60.0
HEALTH_GENERATE_POLL_S = 0.05
WARMUP_TIMEOUT_S = 300.0
WARMUP_FLUSH_S = 10.0
WATCHDOG_INTERVAL_S = 0.5
GRACEFUL_SHUTDOWN_S = 3
WARMING_UP = "the server is starting: its warm-up request still runs"
SHUTTING_DOWN = "the server is shutting down"  # what requests cut short by a stop are told
# How long an idle keep-alive connection stays open: longer than clients keep idle connections
# in their pools (httpx, and so the OpenAI SDK: 5 s; aiohttp: 15 s). At uvicorn's default of
# 5 s the server could close a connection just as a client reused it, which the client sees as
# a failed request (httpx.ReadError); nginx's default is 75 s.
KEEP_ALIVE_S = 75
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
    loop: asyncio.AbstractEventLoop | None = None  # the serving loop
    failure: str | None = None  # set by the watchdog: why the server is going down
    exit_code: int = 0
    tokenizer_dir: str | None = None  # what /model_info and /server_info report
    warming_up: bool = False  # the warm-up request still runs: /health answers 503

    def __post_init__(self) -> None:
        self.warming_up = self.procs is not None  # (a real server warms up before "ready")

    def tokenizer_path(self) -> str:
        return (
            self.tokenizer_dir
            or self.server_args.tokenizer_path
            or resolved_model_path(self.server_args)
        )

    def find_failure(self) -> str | None:
        if self.failure is not None:
            return self.failure
        if self.procs is not None and (dead := self.procs.dead_child()) is not None:
            return dead
        return self._silent_scheduler()

    def _silent_scheduler(self) -> str | None:
        """Requests are pending but the scheduler's loop (or the detokenizer's) has not come
        round for watchdog_timeout s: it is stuck. Liveness comes from each loop's heartbeat,
        not from request output (a long generation that streams nothing is healthy)."""
        timeout, procs = self.server_args.watchdog_timeout, self.procs
        states = getattr(self.tokenizer_manager, "rid_to_state", None)
        if procs is None or not states or not timeout or timeout <= 0:
            return None
        name, silent = procs.silent_child()
        if silent <= timeout:
            return None
        return f"the {name} has been stuck for {silent:.0f} s with {len(states)} requests pending"

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
    announce = asyncio.create_task(_announce_ready(state))  # warm-up included: runs beside
    stopping_since: float | None = None
    try:
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
            if state.server is None or not state.server.should_exit:
                continue
            # SIGTERM/SIGINT: uvicorn waits GRACEFUL_SHUTDOWN_S for the requests in flight,
            # then cancels them (a bare 500, a cut stream). Just before, answer them with the
            # reason instead.
            now = time.monotonic()
            stopping_since = stopping_since or now
            if now - stopping_since >= GRACEFUL_SHUTDOWN_S - 2 * WATCHDOG_INTERVAL_S:
                if hasattr(state.tokenizer_manager, "fail_all"):
                    state.tokenizer_manager.fail_all(SHUTTING_DOWN)
                return
    finally:
        announce.cancel()


async def _announce_ready(state: AppState) -> None:
    server = state.server
    if server is None:
        return
    while not server.started:
        await asyncio.sleep(0.05)
    args = state.server_args
    if state.procs is not None:
        try:
            await _warm_up(state)
        finally:
            state.warming_up = False
        logger.info("%s", startup_summary(args, state.procs.scheduler_info))
    logger.info("radixserve ready on http://%s:%d", args.host, args.port)


async def _warm_up(state: AppState) -> None:
    """One short greedy request through every process before "ready" (the first request pays
    for lazy initialisation otherwise), then an empty cache again. With --dp-size N, N distinct
    prompts at once: every load-balance method sends them to N different replicas."""
    tm = state.tokenizer_manager
    params = {"max_new_tokens": 2, "temperature": 0}
    # (its last tokens where the context is shorter: with --context-length 16 it was refused,
    # and the first user request paid for the start-up)
    keep = max(1, tm.context_len - params["max_new_tokens"])
    objs = [
        GenerateReqInput(
            input_ids=tm.tokenizer.encode(f"{i or ''}The capital city of France is")[-keep:],
            sampling_params=params,
            log_metrics=False,  # not a user's: its cold-start TTFT is not in the histograms
        )
        for i in range(state.server_args.dp_size)
    ]
    start = time.monotonic()
    try:

        async def warm() -> None:  # (a task: a bare gather cancelled with the start-up, as a
            # child dies, logged "_GatheringFuture exception was never retrieved")
            await asyncio.gather(*(collect(tm.generate_request(o, None), None) for o in objs))

        await asyncio.wait_for(warm(), WARMUP_TIMEOUT_S)
        # The scheduler refuses a flush while work is left: the finished warm-up request until
        # its next step, a hierarchical-cache backup of its KV. Ask until it is done.
        deadline = time.monotonic() + WARMUP_FLUSH_S
        while not (await tm.flush_cache()).success and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    except Exception as e:  # the watchdog reports a dead child; this only says what it saw
        logger.warning("warm-up request failed: %r", e)
        return
    logger.info("warm-up request done in %.2f s", time.monotonic() - start)


def startup_summary(args: ServerArgs, info: dict[str, Any]) -> str:
    """One line with what a user checks first: the model and how it is served."""
    chunk = info.get("chunked_prefill_size")
    spec = info.get("speculative_algorithm")
    parts = [
        f"model {served_model_name(args)} ({', '.join(info.get('architectures') or ['?'])})",
        f"dtype {info.get('dtype')}" + (f" + {q}" if (q := info.get("quantization")) else ""),
        f"device {info.get('device')}",
        f"{info.get('threads')} threads",
        f"attention {info.get('attention_backend')}",
        f"context {info.get('context_len')}",
        f"KV pool {info.get('max_total_num_tokens')} tokens",
        f"max running {info.get('max_running_requests')}",
        f"chunk {chunk if chunk else 'off'}",
        f"overlap {'on' if info.get('overlap') else 'off'}",
        f"speculation {spec if spec else 'off'}",
    ]
    if info.get("device") == "cuda":
        bs = info.get("cuda_graph_max_bs")
        parts.append(f"CUDA graphs {f'up to batch {bs}' if bs else 'off'}")
    if args.dp_size > 1:  # the figures above are each replica's
        parts.append(f"{args.dp_size} data-parallel replicas ({args.load_balance_method})")
    return "serving " + ", ".join(parts)


# -- routes --------------------------------------------------------------------------------------
router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 when the children live and the scheduler answers; 503 (with the reason) otherwise,
    and while the warm-up request runs (a router or readiness probe sends traffic at 200)."""
    st = _state(request)
    if st.warming_up:
        return error_response(WARMING_UP, 503)
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
    """200 once the server generates: a one-token request finishes, or, under load, any output
    reaches us while it waits (SGLang's rule); 503 if neither happens in time. A probe refused
    because the queue is full (--max-queued-requests) waits for the others' output instead: a
    busy server is a healthy one."""
    if _state(request).warming_up:
        return error_response(WARMING_UP, 503)
    tm = _tm(request)
    start = time.monotonic()
    obj = GenerateReqInput(
        input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0}, log_metrics=False
    )
    probe = asyncio.ensure_future(collect(tm.generate_request(obj, None), request))
    try:
        while getattr(tm, "last_output_time", 0.0) <= start:
            dead = getattr(tm, "dead", None)
            if dead:  # (its 503 is no full queue: waiting ended in a 500 at shutdown)
                return error_response(f"the server cannot generate: {dead}", 503)
            if probe.done():
                error = probe.exception()
                if error is None:
                    break
                if getattr(error, "status_code", None) != 503:
                    return error_response(f"generation failed: {error!r}", 503)
            if time.monotonic() - start > HEALTH_GENERATE_TIMEOUT_S:
                return error_response("no output within the health check's time limit", 503)
            if probe.done():
                await asyncio.sleep(HEALTH_GENERATE_POLL_S)
            else:
                await asyncio.wait({probe}, timeout=HEALTH_GENERATE_POLL_S)
    finally:
        probe.cancel()  # aborts the probe if it is still queued (see TokenizerManager._wait_one)
    return Response(status_code=200)


@router.post("/generate")
async def generate(request: Request) -> Response:
    body = await parse_body(request, GenerateRequest)
    obj = GenerateReqInput(**body.model_dump(), router_merges_prompt_logprobs=True)
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
    return json_response(serving.model_card(serving.check_model(model_id)))


def _model_fields(st: AppState) -> dict[str, Any]:
    """The model as /model_info and /server_info name it (resolved: never null)."""
    return {
        "model_path": resolved_model_path(st.server_args),
        "tokenizer_path": st.tokenizer_path(),
        "served_model_name": served_model_name(st.server_args),
    }


@router.get("/model_info", operation_id="model_info")
@router.get("/get_model_info", operation_id="get_model_info")
async def model_info(request: Request) -> Response:
    st = _state(request)
    info = st.procs.scheduler_info if st.procs is not None else {}
    return json_response(
        {
            **_model_fields(st),
            "is_generation": True,
            "model_type": info.get("model_type"),
            "architectures": info.get("architectures"),
            "max_context_length": info.get("context_len"),
        }
    )


@router.get("/server_info", operation_id="server_info")
@router.get("/get_server_info", operation_id="get_server_info")
async def server_info(request: Request) -> Response:
    st = _state(request)
    info = await st.tokenizer_manager.get_server_info()
    pids = {}
    if st.procs is not None:  # lets operators (and tests) find the children
        pids = {
            "scheduler_pid": st.procs.scheduler.pid,
            "scheduler_pids": [p.pid for p in st.procs.schedulers],  # per TP rank / DP replica
            "detokenizer_pid": st.procs.detokenizer.pid,
        }
    # The model never null: it names the model SGLang's router routes to.
    return json_response({**server_info_view(st.server_args, info), **_model_fields(st), **pids})


@router.get("/get_load")
async def get_load(request: Request) -> Response:
    """Load per data-parallel rank, as SGLang's router reads it (`power_of_two` sums
    num_tokens): requests running and waiting, and the KV tokens they hold."""
    info = await _tm(request).get_server_info()
    return json_response([_load(rank) for rank in info.get("replicas", [info])])


def _load(info: dict[str, Any]) -> dict[str, Any]:
    """SGLang's load report: requests in flight and queued; tokens in use plus those queued."""
    used = info["max_total_num_tokens"] - info["available_tokens"] - info["evictable_tokens"]
    return {
        "dp_rank": info.get("dp_rank", 0),
        "num_reqs": info["running"] + info["queued"],
        "num_waiting_reqs": info["queued"],
        "num_tokens": used + info.get("queued_tokens", 0),
    }


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId] | list[list[TokenId]]
    skip_special_tokens: bool = True


@router.post("/tokenize")
@router.post("/v1/tokenize", operation_id="tokenize_v1")
async def tokenize(request: Request) -> Response:
    """SGLang's /tokenize: token ids of a prompt (or of each prompt of a list). On a worker
    thread, past the length no prompt could have (TokenizerManager.encode): a long text must
    not hold the loop that serves every other request."""
    body = await parse_body(request, TokenizeBody)
    st = _state(request)
    st.openai.check_model(body.model)  # type: ignore[union-attr]
    tm = _tm(request)
    encode = getattr(tm, "encode", tm.tokenizer.encode)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    kw = {"add_special_tokens": body.add_special_tokens}
    ids = await asyncio.to_thread(lambda: [encode(p, **kw) for p in prompts])
    single = isinstance(body.prompt, str)
    return json_response(
        {
            "tokens": ids[0] if single else ids,
            "count": len(ids[0]) if single else [len(i) for i in ids],
            "max_model_len": getattr(_tm(request), "context_len", None),
        }
    )


@router.post("/detokenize")
@router.post("/v1/detokenize", operation_id="detokenize_v1")
async def detokenize(request: Request) -> Response:
    """SGLang's /detokenize: the text of token ids (or of each list of a list). On a worker
    thread, as /tokenize: the ids of a 19 MB body took the loop 0.7 s to check and decode."""
    body = await parse_body(request, DetokenizeBody)
    st = _state(request)
    st.openai.check_model(body.model)  # type: ignore[union-attr]
    tm = _tm(request)
    single = not body.tokens or isinstance(body.tokens[0], int)
    seqs: list[list[int]] = [body.tokens] if single else body.tokens  # type: ignore[list-item]
    vocab = getattr(tm, "vocab_size", None)

    def decode() -> list[str]:
        if vocab is not None and any(t >= vocab for seq in seqs for t in seq):
            raise RequestError(f"tokens must be token ids in [0, {vocab})")
        skip = body.skip_special_tokens
        return [tm.tokenizer.decode(s, skip_special_tokens=skip) for s in seqs]

    texts = await asyncio.to_thread(decode)
    return json_response({"text": texts[0] if single else texts})


@router.get("/flush_cache", operation_id="flush_cache_get")
@router.post("/flush_cache", operation_id="flush_cache_post")
async def flush_cache(request: Request) -> Response:
    out = await _tm(request).flush_cache()
    if not out.success:
        return error_response(out.message or "cache flush failed", 400)
    return Response("Cache flushed.\n", status_code=200)


class LoadLoRABody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRABody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    """SGLang's: serve one more LoRA adapter (the server runs with --enable-lora or
    --lora-paths); 400 with the reason when it cannot."""
    body = await parse_body(request, LoadLoRABody)
    tm = _tm(request)
    if adapter_name_shadows_the_model(body.lora_name, _state(request).openai.model_names):
        return error_response(
            f"{body.lora_name!r} names the served model (or `<model>:<adapter>`, its name for "
            "an adapter): an adapter needs a name of its own",
            400,
        )
    out = await tm.load_lora_adapter(body.lora_name, body.lora_path)
    if not out.success:
        return error_response(out.message, 400)
    return json_response({"success": True, "loaded_adapters": dict(tm.lora_paths)})


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    body = await parse_body(request, UnloadLoRABody)
    tm = _tm(request)
    out = await tm.unload_lora_adapter(body.lora_name)
    if not out.success:
        return error_response(out.message, 400)
    return json_response({"success": True, "loaded_adapters": dict(tm.lora_paths)})


class AbortRequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rid: str = ""
    abort_all: bool = False


# The bodies that routes read with parse_body, for the OpenAPI document.
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/generate": GenerateRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/abort_request": AbortRequestBody,
    "/tokenize": TokenizeBody,
    "/detokenize": DetokenizeBody,
}


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """Abort one request by rid, or every request with abort_all. The waiting clients then
    receive their outputs with finish_reason "abort"."""
    body = await parse_body(request, AbortRequestBody)
    tm = _tm(request)
    if body.abort_all:
        return json_response({"success": True, "aborted": tm.request_abort_all()})
    if not body.rid:
        return error_response("give a rid, or abort_all: true", 400)
    return json_response({"success": tm.request_abort(body.rid)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    st = _state(request)
    assert st.metrics is not None
    with contextlib.suppress(Exception):
        info = await asyncio.wait_for(st.tokenizer_manager.get_server_info(), METRICS_INFO_WAIT_S)
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
        state.loop = asyncio.get_running_loop()
        tm = make_tokenizer_manager(state.metrics)
        if hasattr(tm, "start"):
            tm.start()
        state.tokenizer_manager = tm
        if state.procs is not None:  # a real server: give SGLang's router a tokenizer directory
            state.tokenizer_dir = await asyncio.to_thread(
                exported_tokenizer_dir, server_args, tm.tokenizer
            )
        state.openai = OpenAIServing(
            tm,
            served_model_name(server_args),
            model_aliases(server_args),
            model_root=server_args.model_path,
            sampling_defaults=model_sampling_defaults(server_args),
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
    install_responses_api(app)
    if not server_args.disable_dashboard:
        app.include_router(dashboard_router)
    install_request_bodies(app, REQUEST_BODIES)
    install_error_handlers(app)
    if server_args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=server_args.api_key)
    # Outermost: browser pages of any origin may call the API (SGLang's policy); a preflight
    # is answered before the key check, and a 401 carries the CORS headers too.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=["*"],
        allow_credentials=True,
        allow_methods=["*"],
        allow_headers=["*"],
    )
    return app


class _Signals:
    """SIGINT/SIGTERM/SIGHUP: abort start-up (KeyboardInterrupt) or ask uvicorn to stop once
    serving (a closed terminal's SIGHUP killed the server without a word or its clean-up).

    uvicorn installs its own handlers while it serves and, when done, restores these and
    re-raises the signal it caught; this handler then only asks for an exit again (a no-op).
    """

    def __init__(self) -> None:
        self.server: Any = None
        self.previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # (uvicorn: the first two)
                self.previous[sig] = signal.signal(sig, self)

    def __call__(self, signum: int, frame: Any) -> None:
        if self.server is None:
            raise KeyboardInterrupt
        self.server.should_exit = True

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _adapters_named_like_the_model(server_args: ServerArgs) -> str:
    """The --lora-paths names a request's `model` could not reach (they name the model)."""
    from radixserve.lora.adapter import parse_lora_paths

    names = set(parse_lora_paths(server_args.lora_paths)) if server_args.lora_paths else set()
    aliases = model_aliases(server_args)
    return ", ".join(sorted(n for n in names if adapter_name_shadows_the_model(n, aliases)))


def launch_server(server_args: ServerArgs) -> int:
    """Serve until a signal (exit 0) or a failure (exit non-zero); always stop the children."""
    from radixserve.entrypoints.engine import (
        Subprocesses,
        create_tokenizer_manager,
        run_worker_node,
    )
    from radixserve.utils import configure_logging

    configure_logging(server_args.log_level)
    if server_args.node_rank > 0:
        return run_worker_node(server_args)
    clash = _adapters_named_like_the_model(server_args)
    if clash:
        logger.error("--lora-paths: %s names the served model; give the adapter its own", clash)
        return 2
    busy = _port_in_use(server_args.host, server_args.port)
    if busy:  # found now, not after every rank has loaded the model (minutes)
        logger.error("cannot listen on %s:%d: %s", server_args.host, server_args.port, busy)
        return 1
    signals = _Signals()
    procs = app = None
    code = 1
    try:
        procs = Subprocesses(server_args)
        app = build_app(
            server_args, lambda m: create_tokenizer_manager(server_args, procs, m), procs
        )
        code = _serve(app, server_args, signals)
    except KeyboardInterrupt:
        logger.info("interrupted; shutting down")
        code = 0
    except Exception as e:
        logger.error("the server failed: %s: %s", type(e).__name__, e)
    finally:
        if procs is not None:
            procs.shutdown()
        signals.restore()
    _exit_past_a_running_compile(app, code)
    return code


def _exit_past_a_running_compile(app: FastAPI | None, code: int) -> None:
    """A grammar compile whose request was refused for its time runs on in C++ (it cannot be
    stopped), and the interpreter's exit waits for its thread: a stopped server lived on for
    minutes, its port closed. Everything is shut down by now: exit without waiting."""
    tm = app.state.rs.tokenizer_manager if app is not None else None
    if tm is None or not tm.grammar_compiling():  # (None: the start-up failed before it)
        return
    logger.info("exiting without waiting for a grammar compile still running")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _port_in_use(host: str, port: int) -> str | None:
    """Why uvicorn could not bind host:port (as it binds: SO_REUSEADDR), or None."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return f"{e} (--host)"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                return f"{e.strerror or e} (--host {host} is not an address of this machine)"
            return f"{e.strerror or e} (is another server on it? pick another --port)"
    return None


def _serve(app: FastAPI, server_args: ServerArgs, signals: _Signals) -> int:
    import uvicorn

    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        log_level=server_args.log_level.lower(),
        access_log=server_args.log_level.lower() == "debug",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    state: AppState = app.state.rs

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            """A second Ctrl-C stops at once: uvicorn drops the requests in flight (a bare 500,
            a cut stream); answer them first, as at the end of the grace."""
            super().handle_exit(sig, frame)
            tm, loop = state.tokenizer_manager, state.loop
            if self.force_exit and loop is not None and hasattr(tm, "fail_all"):
                loop.call_soon_threadsafe(tm.fail_all, SHUTTING_DOWN)

        async def shutdown(self, sockets: Any = None) -> None:
            await super().shutdown(sockets)
            if self.force_exit:  # uvicorn skips the app's own shutdown then, and the loop's
                await self.lifespan.shutdown()  # end cancelled it: a CancelledError traceback

    server = Server(config)
    state.server = signals.server = server
    try:
        server.run()
    except SystemExit as e:  # uvicorn exits on a failed start (port in use, lifespan error)
        return e.code if isinstance(e.code, int) and e.code else 1
    if not server.started:
        return 1
    return state.exit_code
