"""The offline Engine: the Scheduler and Detokenizer subprocesses plus an in-process
TokenizerManager running on a private event-loop thread.

    with Engine(model_path=...) as engine:
        out = engine.generate("Hello", {"max_new_tokens": 16, "temperature": 0})

`launch_subprocesses` is shared with the HTTP server.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import multiprocessing as mp
import queue
import shutil
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, MutableSequence
from concurrent.futures import CancelledError, Future
from typing import Any

from radixserve.args import ServerArgs
from radixserve.io_struct import PER_PROMPT_LOGPROB_FIELDS, GenerateReqInput
from radixserve.managers.data_parallel_controller import (
    DataParallelController,
    replica_port_args,
    replica_processes,
)
from radixserve.managers.detokenizer_manager import run_detokenizer_process
from radixserve.managers.scheduler_process import run_scheduler_process
from radixserve.managers.tokenizer_manager import RequestError, TokenizerManager, detached
from radixserve.managers.tokenizer_utils import load_tokenizer_for
from radixserve.utils import PortArgs, zmq_socket

_DONE = object()  # the end of a stream's queue (Engine._start_stream)


def _put_latest(items: MutableSequence[Any], item: Any) -> None:
    """Queue a stream's output in place of an unread one of the same stream (its "index": a
    batch's or n > 1's): each is a cumulative copy, so the newer covers the older, and a reader
    busy elsewhere kept one per token, O(output²) memory (250 MB for 8,000 tokens). Errors and
    the end are never replaced, and nothing is queued after them."""
    if isinstance(item, dict):
        for i, old in enumerate(items):
            if isinstance(old, dict) and old.get("index") == item.get("index"):
                items[i] = item
                return
    items.append(item)


class _LatestQueue(queue.Queue):
    """A sync stream's outputs, the latest of each stream unread (_put_latest)."""

    def _put(self, item: Any) -> None:
        _put_latest(self.queue, item)


class _AsyncLatestQueue(asyncio.Queue):
    """An async stream's outputs, the latest of each stream unread (_put_latest)."""

    def _put(self, item: Any) -> None:
        _put_latest(self._queue, item)  # type: ignore[attr-defined]


logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600
CHILD_POLL_S = 0.5
SHUTDOWN_WAIT_S = 10.0  # for the loop to cancel its tasks (after a start-up: its children stop)


class StartupInterrupted(RuntimeError):
    """The start-up was stopped (a signal, Ctrl-C, shutdown()) while the children started."""


class Subprocesses:
    """The scheduler and detokenizer processes and what the scheduler reported at start-up.
    `stop`, once set, ends a start-up still waiting for them (StartupInterrupted; what started
    is stopped): a model takes minutes to load, and Ctrl-C or SIGTERM waited for it."""

    def __init__(self, server_args: ServerArgs, stop: threading.Event | None = None) -> None:
        self._stop = stop
        ctx = mp.get_context("spawn")
        self.port_args = PortArgs.new()
        sched_r, sched_w = ctx.Pipe(duplex=False)
        detok_r, detok_w = ctx.Pipe(duplex=False)
        # The scheduler loop's last time.monotonic(), written each iteration (see liveness).
        self.heartbeat = ctx.Value("d", time.monotonic(), lock=False)
        # One scheduler per TP rank on this machine; rank 0 (`self.scheduler`, on node 0)
        # talks to the other processes.
        self.schedulers, rank_pipes = [], [sched_r]
        for i, rank in enumerate(server_args.local_tp_ranks):
            if i > 0:
                sched_r, sched_w = ctx.Pipe(duplex=False)
                rank_pipes.append(sched_r)
            self.schedulers.append(
                ctx.Process(
                    target=run_scheduler_process,
                    args=(
                        server_args,
                        self.port_args,
                        sched_w,
                        self.heartbeat if rank == 0 else None,
                        rank,
                    ),
                    name="radixserve-scheduler" + (f"-tp{rank}" if server_args.tp_size > 1 else ""),
                    daemon=True,
                )
            )
        self.scheduler = self.schedulers[0]
        self.heartbeats = [self.heartbeat]
        if server_args.dp_size > 1:  # instead, one scheduler per data-parallel replica
            self.schedulers, rank_pipes, self.heartbeats = replica_processes(
                ctx, server_args, self.port_args
            )
            self.scheduler, self.heartbeat = self.schedulers[0], self.heartbeats[0]
        # A machine other than node 0 runs its TP ranks' schedulers only (run_worker_node).
        self.detokenizer = None
        self.detokenizer_heartbeat = ctx.Value("d", time.monotonic(), lock=False)
        if server_args.node_rank == 0:
            self.detokenizer = ctx.Process(
                target=run_detokenizer_process,
                args=(server_args, self.port_args, detok_w, self.detokenizer_heartbeat),
                name="radixserve-detokenizer",
                daemon=True,
            )
        try:
            for proc in self.children:
                proc.start()
            self.scheduler_info = self._wait_ranks_ready(rank_pipes)
            if self.detokenizer is not None:
                self._wait_ready(detok_r, self.detokenizer, "detokenizer")
        except BaseException:
            # One rank failed: the others may still wait for it in a collective (and later
            # join whatever listens on its port). Nothing of a failed start is left running.
            self.shutdown()
            raise

    @property
    def children(self) -> list[mp.Process]:
        return [*self.schedulers, *([self.detokenizer] if self.detokenizer is not None else [])]

    def _wait_ranks_ready(self, pipes: list[Any]) -> dict[str, Any]:
        """Every TP rank's (or data-parallel replica's) "ready" (rank 0's carries the scheduler
        info); the first rank that fails or exits fails the start-up, even while the others
        wait for it in a collective."""
        if len(pipes) == 1:
            return self._wait_ready(pipes[0], self.scheduler, "scheduler")
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        infos: dict[int, dict[str, Any]] = {}
        while len(infos) < len(pipes):
            self._check_stop()
            for rank, (pipe, proc) in enumerate(zip(pipes, self.schedulers, strict=True)):
                if rank not in infos and (pipe.poll(0.1) or not proc.is_alive()):
                    infos[rank] = self._wait_ready(pipe, proc, proc.name)
                    logger.info("%s ready (%d of %d)", proc.name, len(infos), len(pipes))
            if time.monotonic() > deadline:
                raise RuntimeError(f"the schedulers did not start within {STARTUP_TIMEOUT_S} s")
        return infos[0]

    def _check_stop(self) -> None:
        """Between the polls of a start-up wait: interrupted, or the detokenizer dead already
        (it was found only once the schedulers had loaded the model: minutes, for a large
        one)."""
        if self._stop is not None and self._stop.is_set():
            raise StartupInterrupted("the start-up was interrupted")
        detokenizer = self.detokenizer
        if detokenizer is not None and detokenizer.exitcode is not None:
            raise RuntimeError(
                f"the detokenizer exited during start-up (code {detokenizer.exitcode})"
            )

    def _wait_ready(self, pipe: Any, proc: mp.Process, name: str) -> dict[str, Any]:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not pipe.poll(0.2):
            self._check_stop()
            if not proc.is_alive():
                raise RuntimeError(f"the {name} exited during start-up (code {proc.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {name} did not start within {STARTUP_TIMEOUT_S} s")
        try:
            msg = pipe.recv()
        except EOFError:
            proc.join(5)
            raise RuntimeError(
                f"the {name} exited during start-up (code {proc.exitcode})"
            ) from None
        if msg.get("status") != "ready":
            raise RuntimeError(f"the {name} failed to start: {msg.get('message')}")
        return msg

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.children)

    def dead_child(self) -> str | None:
        """Every child found dead, not only the first: when one tensor-parallel rank dies its
        peers fail in their next collective, and the report must still name the first cause."""
        dead = [p for p in self.children if not p.is_alive()]
        if not dead:
            return None
        return "; ".join(f"{p.name} exited with code {p.exitcode}" for p in dead)

    def seconds_since_heartbeat(self) -> float:
        """Of the scheduler (data-parallel replica) that has been silent longest."""
        return time.monotonic() - min(h.value for h in self.heartbeats)

    def silent_child(self) -> tuple[str, float]:
        """The child silent longest, the schedulers' loops or the detokenizer's, and for how
        many seconds (a data-parallel replica's scheduler by its process name)."""
        scheduler = ("scheduler", self.seconds_since_heartbeat())
        if len(self.heartbeats) > 1:
            rank = min(range(len(self.heartbeats)), key=lambda r: self.heartbeats[r].value)
            scheduler = (f"scheduler of data-parallel replica {rank}", scheduler[1])
        if self.detokenizer is None:
            return scheduler
        detokenizer = ("detokenizer", time.monotonic() - self.detokenizer_heartbeat.value)
        return max(scheduler, detokenizer, key=lambda named: named[1])

    def shutdown(self) -> None:
        started = [p for p in self.children if p.pid is not None]  # (Ctrl-C while starting)
        for p in started:
            if p.is_alive():
                p.terminate()
        for p in started:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(1)
        if self.port_args.ipc_dir:  # the socket files (the bound ones still work unlinked)
            shutil.rmtree(self.port_args.ipc_dir, ignore_errors=True)


def run_worker_node(server_args: ServerArgs) -> int:
    """A machine other than node 0 (--node-rank > 0): run this node's TP ranks until one of
    them exits (node 0 stopped, or a rank failed) or a signal arrives; no HTTP server, no
    tokenizer and no detokenizer here: rank 0 broadcasts every request to these ranks."""
    import signal

    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    procs = None
    try:
        procs = Subprocesses(server_args, stop)  # (a signal ends its wait too)
        ranks = list(server_args.local_tp_ranks)
        logger.info(
            "node %d of %d ready: TP ranks %d-%d joined node 0 at %s",
            server_args.node_rank,
            server_args.nnodes,
            ranks[0],
            ranks[-1],
            server_args.dist_init_addr,
        )
        while not stop.wait(CHILD_POLL_S):
            if (reason := procs.dead_child()) is not None:
                logger.error("%s; node %d stops", reason, server_args.node_rank)
                return 1
        logger.info("node %d: signal received; shutting down", server_args.node_rank)
        return 0
    except StartupInterrupted:
        logger.info("node %d: signal received during start-up; stopped", server_args.node_rank)
        return 0
    except Exception as e:
        logger.error("node %d failed: %s: %s", server_args.node_rank, type(e).__name__, e)
        return 1
    finally:
        if procs is not None:
            procs.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def create_tokenizer_manager(
    server_args: ServerArgs, procs: Subprocesses, metrics: Any = None
) -> TokenizerManager:
    """Must run inside the event loop that will serve requests (zmq.asyncio binds to it)."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context(2)
    recv = zmq_socket(ctx, zmq.PULL, procs.port_args.tokenizer_ipc, bind=True)
    info = procs.scheduler_info
    dp_size = server_args.dp_size
    dp_controller = None
    if dp_size == 1:
        send: Any = zmq_socket(ctx, zmq.PUSH, procs.port_args.scheduler_input_ipc, bind=False)
    else:  # the controller stands in for the socket and dispatches to the replicas' sockets
        endpoints = [
            replica_port_args(procs.port_args, r).scheduler_input_ipc for r in range(dp_size)
        ]
        send = dp_controller = DataParallelController(
            [zmq_socket(ctx, zmq.PUSH, e, bind=False) for e in endpoints],
            server_args.load_balance_method,
            info["max_total_num_tokens"],  # per replica (each sized its own KV pool alike)
            info.get("max_running_requests"),
        )
    max_running = info.get("max_running_requests")
    tokenizer = load_tokenizer_for(server_args)
    return TokenizerManager(
        server_args,
        tokenizer,
        send,
        recv,
        context_len=info["context_len"],
        vocab_size=info["vocab_size"],
        metrics=metrics,
        eos_token_ids=info.get("eos_token_ids"),
        max_running_requests=max_running * dp_size if max_running else max_running,
        dp_controller=dp_controller,
    )


# Engine.generate parameters of SGLang's that ask for what is not served here: accepted at the
# value that asks for nothing (RL frameworks pass them so), refused otherwise.
SGLANG_NOOP_KWARGS: dict[str, Any] = {
    "image_data": None,
    "audio_data": None,
    "video_data": None,
    "token_ids_logprob": None,
    "custom_logit_processor": None,
    "return_hidden_states": False,
}


class ControlResult(dict):
    """A control call's answer, {"success", "message"}: read as a dict, or as SGLang's Engine
    gives it (its reply object: .success, .message); true when it succeeded."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __bool__(self) -> bool:
        return bool(self.get("success"))


class Engine:
    def __init__(self, server_args: ServerArgs | None = None, **kwargs: Any) -> None:
        if server_args is None:
            server_args = ServerArgs(**kwargs)
        self.server_args = server_args.resolve()
        if self.server_args.node_rank > 0:
            raise ValueError(
                "--node-rank > 0 runs only scheduler ranks and serves no requests; start it "
                "with `python -m radixserve serve ... --node-rank N` and use the Engine on node 0"
            )
        from radixserve.model_loader.loader import check_model_files

        check_model_files(self.server_args)
        self._closed = threading.Event()
        self.procs = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=_run_loop, args=(self.loop,), daemon=True)
        self._thread.start()
        try:
            # The children start from the loop's thread, which lives as long as the engine:
            # they die with the thread that started them (PR_SET_PDEATHSIG), and an Engine made
            # in a worker thread lost them when that thread ended.
            self._run(self._start_children())
            self.tokenizer_manager: TokenizerManager = self._run(self._init_tm())
        except BaseException:  # (a failed start left its loop's thread running forever)
            self.shutdown()
            raise
        self.tokenizer = self.tokenizer_manager.tokenizer
        # Neither thread nor the exit hook holds the engine: one dropped without shutdown()
        # is collected, and __del__ stops its processes.
        self._monitor = threading.Thread(
            target=_watch_children, args=(weakref.ref(self), self._closed), daemon=True
        )
        self._monitor.start()
        atexit.register(_shutdown_at_exit, weakref.ref(self))

    async def _start_children(self) -> None:
        # (set here: shutdown() finds them); shutdown() during the start (Ctrl-C in __init__)
        # ends its wait through _closed: the loop's thread was blocked in it until the
        # children had loaded the model, and shutdown() timed out waiting for the loop.
        self.procs = Subprocesses(self.server_args, self._closed)

    async def _init_tm(self) -> TokenizerManager:
        tm = create_tokenizer_manager(self.server_args, self.procs)
        tm.start()
        return tm

    def _submit(self, coro: Any) -> Future:
        """Run `coro` on the engine's loop; RuntimeError once the engine is shut down (its loop
        has stopped: the future would never finish)."""
        if self._closed.is_set():
            coro.close()
            raise RuntimeError("the engine is shut down")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def _run(self, coro: Any) -> Any:
        """Wait for `coro` on the engine's loop; interrupted (Ctrl-C), it is cancelled, which
        aborts its requests."""
        fut = self._submit(coro)
        try:
            return fut.result()
        except CancelledError:
            if self._closed.is_set():  # shutdown() cancelled it (a bare CancelledError)
                raise RuntimeError("the engine is shut down") from None
            raise
        except BaseException:
            fut.cancel()
            raise

    # -- generation -----------------------------------------------------------------------------
    @staticmethod
    def _make_obj(
        prompt: str | list[str] | None,
        sampling_params: dict | list[dict] | None,
        input_ids: list[int] | list[list[int]] | None,
        stream: bool,
        **extra: Any,
    ) -> GenerateReqInput:
        for name, default in SGLANG_NOOP_KWARGS.items():
            value = extra.pop(name, default)
            # (SGLang's Engine passes [] and one None per prompt of a batch for "none")
            nothing = value in (default, None, []) or (
                isinstance(value, list) and all(v in (default, None) for v in value)
            )
            if not nothing:
                raise RequestError(f"{name} is not supported")
        for name in ("return_text_in_logprobs", *PER_PROMPT_LOGPROB_FIELDS):
            if name in extra and extra[name] is None:  # (SGLang's defaults: None is the default)
                del extra[name]
        obj = GenerateReqInput(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            stream=False if stream is None else stream,
            **extra,
        )
        return obj

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        **extra: Any,
    ) -> Any:
        """Blocking generate. One prompt → dict; a list → list of dicts; stream → iterator."""
        obj = self._make_obj(prompt, sampling_params, input_ids, stream, **extra)
        if stream:
            return self._stream_sync(obj)
        return self._run(self._collect(obj))

    async def _collect(self, obj: GenerateReqInput) -> Any:
        result = None
        async for out in self.tokenizer_manager.generate_request(obj):
            result = out
        return result

    def _start_stream(self, obj: GenerateReqInput, put: Callable[[Any], None]) -> Future:
        """Run the request on the engine's loop, its outputs (then an exception or _DONE) given
        to `put`; cancelling the returned future aborts the request (generate_request's
        own clean-up), which is what a consumer that stops reading early must do."""

        async def pump() -> None:
            try:
                async for out in self.tokenizer_manager.generate_request(obj):
                    put(detached(out))  # the caller keeps it; later outputs go on
            except asyncio.CancelledError:  # the consumer stopped, or shutdown(): a reader
                put(RuntimeError("the engine is shut down"))  # still waiting must wake
                put(_DONE)
                raise
            except Exception as e:
                put(e)
            put(_DONE)

        return self._submit(pump())

    def _stream_sync(self, obj: GenerateReqInput) -> Iterator[dict[str, Any]]:
        q = _LatestQueue()
        pump = self._start_stream(obj, q.put)
        try:
            while (item := q.get()) is not _DONE:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:  # (closed early, or garbage-collected: the request is aborted)
            pump.cancel()

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        **extra: Any,
    ) -> Any:
        """Awaitable generate for callers on their own event loop; stream → async iterator."""
        obj = self._make_obj(prompt, sampling_params, input_ids, stream, **extra)
        if stream:
            return self._stream_async(obj)
        return await asyncio.wrap_future(self._submit(self._collect(obj)))

    async def _stream_async(self, obj: GenerateReqInput) -> AsyncIterator[dict[str, Any]]:
        """The outputs reach the caller's loop by call_soon_threadsafe, no thread waits for
        them: each waiting stream held one of the caller's executor threads, and more open
        streams than threads stalled one another and the caller's own to_thread calls."""
        loop = asyncio.get_running_loop()
        items = _AsyncLatestQueue()

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody reads any more
                pass

        pump = self._start_stream(obj, put)
        try:
            while (item := await items.get()) is not _DONE:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:  # (aclose, or the consumer's task cancelled while it waited)
            pump.cancel()

    # -- control --------------------------------------------------------------------------------
    def abort_request(self, rid: str = "", abort_all: bool = False) -> bool:
        """Abort the request `rid` (its n choices, a batch's prompts too), or every request
        (abort_all), as SGLang's Engine does; whether any was running. Its caller gets
        finish_reason abort."""
        tm = self.tokenizer_manager

        async def abort() -> bool:
            return tm.request_abort_all() > 0 if abort_all else tm.request_abort(rid)

        return self._run(abort())

    def flush_cache(self) -> ControlResult:
        """Empty the prefix cache (refused while requests run); true when it was."""
        out = self._run(self.tokenizer_manager.flush_cache())
        return ControlResult(success=out.success, message=out.message)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> ControlResult:
        """Serve one more LoRA adapter (needs enable_lora or lora_paths): {success, message}."""
        out = self._run(self.tokenizer_manager.load_lora_adapter(lora_name, lora_path))
        return ControlResult(success=out.success, message=out.message)

    def unload_lora_adapter(self, lora_name: str) -> ControlResult:
        out = self._run(self.tokenizer_manager.unload_lora_adapter(lora_name))
        return ControlResult(success=out.success, message=out.message)

    def get_server_info(self) -> dict[str, Any]:
        """The server's arguments and figures, as SGLang's Engine and /get_server_info give
        them (internal_states, version; it gave the scheduler's figures alone)."""
        from radixserve.entrypoints.openai_api import resolved_model_path

        info = self._run(self.tokenizer_manager.get_server_info())
        view = server_info_view(self.server_args, info)
        return {**view, "model_path": resolved_model_path(self.server_args)}

    def shutdown(self) -> None:
        """Stop the processes, cancel what runs on the loop, stop the loop (its thread closes
        it). Safe to call twice, from a failed __init__, and from the loop's own thread (an
        engine dropped by a stream's last reference is collected there)."""
        if hasattr(self, "_closed"):
            self._closed.set()
        if getattr(self, "procs", None) is not None:
            self.procs.shutdown()
            self.procs = None  # type: ignore[assignment]
        loop = getattr(self, "loop", None)
        if loop is None or loop.is_closed() or not loop.is_running():
            return
        if threading.current_thread() is self._thread:  # waiting here would wait for itself
            loop.create_task(self._cancel_tasks(stop=True))
            return
        try:
            asyncio.run_coroutine_threadsafe(self._cancel_tasks(), loop).result(SHUTDOWN_WAIT_S)
        except TimeoutError:  # (never hides the exception shutdown() is called for)
            logger.warning("the engine's loop did not stop its tasks in %g s", SHUTDOWN_WAIT_S)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(5)

    async def _cancel_tasks(self, stop: bool = False) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        tm = getattr(self, "tokenizer_manager", None)
        if tm is not None:
            tm.close()
        if stop:
            asyncio.get_running_loop().stop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The engine's loop thread: run until shutdown() stops the loop, then close it (its
    selector's file descriptors and its executor's threads went only with the Engine)."""
    try:
        loop.run_forever()
    finally:
        loop.close()


def _watch_children(ref: weakref.ref, closed: threading.Event) -> None:
    """A dead scheduler or detokenizer fails every pending and later request (RequestError,
    status 503) instead of leaving the caller waiting forever."""
    while not closed.wait(CHILD_POLL_S):
        engine = ref()
        if engine is None:
            return
        procs = engine.procs
        reason = procs.dead_child() if procs is not None else None
        if reason is not None:
            logger.error("%s; the engine can serve no more requests", reason)
            engine.loop.call_soon_threadsafe(engine.tokenizer_manager.fail_all, reason)
            return
        del engine


def _shutdown_at_exit(ref: weakref.ref) -> None:
    """An engine still open when the interpreter exits: stop its processes, remove its files."""
    engine = ref()
    if engine is not None:
        engine.shutdown()


def server_info_view(args: ServerArgs, info: dict[str, Any]) -> dict[str, Any]:
    """/get_server_info's and Engine.get_server_info's answer: the arguments (not the API key:
    the answer ends up in routers' logs, dashboards, bug reports), what SGLang's router reads
    besides them (the parallel layout, the P/D role), the scheduler's figures `info`, and
    SGLang's version and internal_states."""
    shown = {**dataclasses.asdict(args), "api_key": "<set>" if args.api_key else None}
    layout = {
        "tp_size": args.tp_size,
        "dp_size": args.dp_size,
        "disaggregation_mode": args.disaggregation_mode,
    }
    # A figure named as an argument (max_running_requests) keeps the argument's meaning, one
    # replica's value, resolved ("auto" too); the replicas' sum is `<name>_total`. The sum
    # overwrote the argument: 16 for --max-running-requests 8 --dp-size 2.
    replica = (info.get("replicas") or [info])[0]
    named = [k for k in info if k in shown]
    per_replica = {k: replica.get(k, info[k]) for k in named}
    totals = {f"{k}_total": info[k] for k in named}
    return {**shown, **layout, **info, **per_replica, **totals, **_sglang_state(info)}


def _sglang_state(info: dict[str, Any]) -> dict[str, Any]:
    """What SGLang's tools read from /get_server_info besides the flat figures: its version
    and, per data-parallel replica, `internal_states` (bench_serving and the router's mini
    load balancer take the generation throughput and speculative accept length from them)."""
    from radixserve import __version__

    states = [
        {
            "dp_rank": r.get("dp_rank", 0),
            "last_gen_throughput": r.get("gen_throughput", 0.0),
            "avg_spec_accept_length": r.get("spec_accept_length")
            if r.get("spec_verify_ct")
            else None,
        }
        for r in info.get("replicas") or [info]
    ]
    return {"version": __version__, "internal_states": states}
