"""TokenizerManager: the main process's side of every request (seed 000 §4, §13.3).

generate_request: tokenize and verify → create rid_to_state[rid] (before dispatch, invariant 1)
→ send TokenizedGenerateReqInput to the scheduler → wait on the state's event, which
_drain_outputs sets when the detokenizer's BatchStrOutput for that rid arrives → yield dicts.
Any failure (bad input, client gone, abort) removes the state and tells the scheduler.
Until it registers, the request is in _arriving: an abort or an adapter's unload finds it there.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.io_struct import (
    FLUSH_WAIT_S,
    AbortReq,
    BatchStrOutput,
    BatchTokenizedGenerateReqInput,
    DashboardSnapshotReq,
    DashboardSnapshotReqOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    LoadLoRAAdapterReq,
    LoRAUpdateReqOutput,
    RoomRefusedReq,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
    new_rid,
)
from radixserve.lora.adapter import (
    NO_LORA,
    LoRAError,
    adapter_key,
    check_adapter_dir,
    is_adapter_name,
    parse_lora_paths,
)
from radixserve.managers.grammar_check import GrammarCheck
from radixserve.managers.live_stats import LatencyWindow
from radixserve.managers.request_checks import (
    RequestError,
    check_length,
    num_choices,
    verify_request_fields,
)
from radixserve.managers.tokenizer_utils import TokenStrings
from radixserve.sampling_params import SamplingParams, SamplingParamsError, is_int

logger = logging.getLogger(__name__)
DRAIN_BATCH = 256  # outputs handled per wake-up before other tasks get the loop

RETRY_AFTER_S = 1  # what a 503 for overload tells the client to wait
DISCONNECT_POLL_S = 2.0  # how often a waiting request checks that its client is still there
RID_DRAIN_WAIT_S = 2.0  # how long a request waits for an aborted one of its rid to drain
LORA_UNLOAD_WAIT_S = 120.0  # how long an unload waits for the adapter's requests in flight
# Up to this many characters of a request's prompts are tokenized on the event loop, the rest
# on a worker thread (HF tokenizers release the GIL): a 2.6 MB prompt held every other request
# and stream for 6 s. That many take a few ms, about one decode step, while a hop to a thread
# costs ~0.1 ms, more than a short prompt's whole encode (which stays as cheap as it was).
ENCODE_ON_LOOP_CHARS = 16 * 1024
__all__ = ["RequestError", "ReqState", "TokenizerManager"]
Triple = tuple[float | None, int, str | None]


@dataclass
class ReqState:
    """What the waiter of one request needs: the latest cumulative output (never a list of
    every intermediate one, so a slow streaming client costs O(output), not O(output²))."""

    rid: str
    stream: bool
    prompt_len: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None  # {"message", "status_code"}: the request was refused
    finished: bool = False
    lora_id: str | None = None
    # A choice of an n > 1 request, or a prompt of a batch with one rid: that request's rid.
    parent_rid: str | None = None
    # GenerateReqInput.router_merges_prompt_logprobs: the prompt's token logprobs are left out
    omit_input_logprobs: bool = False
    log_metrics: bool = True  # GenerateReqInput.log_metrics
    priority: int = 0  # GenerateReqInput.priority (None: 0, as --schedule-policy priority)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.monotonic)
    last_time: float = 0.0
    # Logprobs as SGLang's triples (logprob, token id, token text or None); top-k as lists of
    # triples, None for a position without any (the first prompt token).
    return_logprob: bool = False
    token_text: Callable[[int], str] | None = None  # set by return_text_in_logprobs
    output_token_logprobs: list[Triple] = field(default_factory=list)
    output_top_logprobs: list[list[Triple]] = field(default_factory=list)
    input_token_logprobs: list[Triple] = field(default_factory=list)
    input_top_logprobs: list[list[Triple] | None] = field(default_factory=list)

    def triple(self, logprob: float | None, token: int) -> Triple:
        return (logprob, token, self.token_text(token) if self.token_text else None)

    def triples(self, pairs: list[tuple[float, int]] | None) -> list[Triple] | None:
        return None if pairs is None else [self.triple(lp, t) for lp, t in pairs]

    def snapshot(self) -> dict[str, Any]:
        """The output dict as of now. Its lists are the state's own (read-only for the caller,
        valid until the next await): copying them per token would cost O(output²)."""
        meta = dict(self.meta)
        if self.return_logprob:
            omit = self.omit_input_logprobs
            meta["input_token_logprobs"] = [] if omit else self.input_token_logprobs
            meta["output_token_logprobs"] = self.output_token_logprobs
            meta["input_top_logprobs"] = self.input_top_logprobs
            meta["output_top_logprobs"] = self.output_top_logprobs
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": meta}


@dataclass(eq=False)
class _Arrival:
    """A request from its arrival in generate_request until it registers (its tokenizing,
    grammar check and rid wait: seconds for a large schema), as an abort or an adapter's unload
    finds it there."""

    rid: Any  # GenerateReqInput.rid as its client gave it (unverified: compared, never hashed)
    adapters: dict[str, str] = field(default_factory=dict)  # name -> cache namespace at arrival
    aborted: set[str] = field(default_factory=set)  # its rids that /abort_request named
    aborted_all: bool = False

    def names(self, rid: str) -> bool:
        """Whether `rid` is one its client gave: its own, its group's, one of a batch's."""
        return rid in self.rid if isinstance(self.rid, list) else rid == self.rid

    def hits(self, state: ReqState) -> bool:
        """Whether an abort sent while it arrived names this sub-request (as request_abort
        would have, had it been registered)."""
        return self.aborted_all or state.rid in self.aborted or state.parent_rid in self.aborted


def detached(out: Any) -> Any:
    """An output (dict, or list of them) that stays as it is: `ReqState.snapshot`'s dicts
    share the state's lists, which later outputs extend. For an item kept across an await."""
    if isinstance(out, list):
        return [detached(o) for o in out]
    if not isinstance(out, dict):
        return out
    kept = _lists_copied(out)
    if isinstance(out.get("meta_info"), dict):
        kept["meta_info"] = _lists_copied(out["meta_info"])
    return kept


def _lists_copied(d: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, list) else v for k, v in d.items()}


class TokenizerManager:
    def __init__(
        self,
        server_args: Any,
        tokenizer: Any,
        send_to_scheduler: Any,
        recv_from_detokenizer: Any,
        context_len: int,
        vocab_size: int,
        metrics: Any = None,
        eos_token_ids: list[int] | None = None,
        max_running_requests: int | None = None,
        dp_controller: Any = None,
    ) -> None:
        self.server_args = server_args
        self.tokenizer = tokenizer
        self.send_to_scheduler = send_to_scheduler  # zmq.asyncio PUSH socket
        # --dp-size > 1: the DataParallelController, which is also send_to_scheduler; it sees
        # every output and merges the replicas' replies to control requests.
        self.dp_controller = dp_controller
        self.recv_from_detokenizer = recv_from_detokenizer  # zmq.asyncio PULL socket
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.metrics = metrics
        self.eos_token_ids = list(eos_token_ids or [])
        self._grammar_check = GrammarCheck(
            server_args.grammar_backend, tokenizer, vocab_size, self.eos_token_ids
        )
        # The LoRA adapters being served: name -> path, and their cache namespaces (a hash of
        # their files). /load_lora_adapter and /unload_lora_adapter change them.
        self.lora_paths = parse_lora_paths(getattr(server_args, "lora_paths", ()))
        self.lora_keys = {name: adapter_key(name, path) for name, path in self.lora_paths.items()}
        self._lora_lock: asyncio.Lock | None = None  # one load or unload at a time
        self.rid_to_state: dict[str, ReqState] = {}
        # Aborted here, not yet finished in the scheduler: the state of a waiter that went away
        # (its late outputs still count in the metrics), None for one already finished here.
        self._draining: dict[str, ReqState | None] = {}
        self._arriving: set[_Arrival] = set()  # requests not yet in rid_to_state (see _Arrival)
        self.dead: str | None = None  # why no request can be served any more (fail_all)
        self.closed = False  # close() ran: nothing can be sent any more
        queued = getattr(server_args, "max_queued_requests", None)
        self.max_in_flight = (
            None
            if queued is None or max_running_requests is None
            else max_running_requests + queued
        )
        self._control_waiters: dict[type, list[asyncio.Future]] = {}
        self.latency_window = LatencyWindow()  # TTFT/TPOT per second for the dashboard
        self._reader: tuple[asyncio.AbstractEventLoop, int] | None = None  # (loop, socket FD)
        self._recv_now: Any = None  # a synchronous view of recv_from_detokenizer
        self._await_task: asyncio.Task | None = None  # a socket stand-in's receiving (tests)
        self.token_strings = TokenStrings(tokenizer)  # return_text_in_logprobs
        self._max_token_chars: int | None = None  # the longest token's text (see encode)
        self.last_output_time = 0.0  # monotonic time of the last output from the scheduler

    def close(self) -> None:
        """Stop receiving and close both sockets and their context (call on the loop's thread);
        a context left to the garbage collector blocks whichever thread collects it."""
        self.closed = True
        self._grammar_check.close()  # a check waiting on a compile returns now
        if self._reader is not None:
            loop, fd = self._reader
            loop.remove_reader(fd)
            self._reader = None
        if self._await_task is not None:
            self._await_task.cancel()
        for sock in (self.send_to_scheduler, self.recv_from_detokenizer):
            sock.close(linger=0)
        ctx = getattr(self.recv_from_detokenizer, "context", None)
        if ctx is not None:
            ctx.term()

    # -- receiving the detokenizer's outputs -----------------------------------------------------
    def start(self) -> None:
        """Receive from the detokenizer on the running loop: a reader on the socket's FD
        drains every queued message with non-blocking receives. (An awaited recv_pyobj per
        message made a future and registered and dropped a reader per output token, CPU
        taken from the cores the model runs on.)"""
        if self._reader is not None or self._await_task is not None:
            return
        import zmq

        sock = self.recv_from_detokenizer
        loop = asyncio.get_running_loop()
        if not isinstance(sock, zmq.Socket):  # a stand-in with an awaitable recv_pyobj
            self._await_task = loop.create_task(self._await_outputs())
            return
        self._recv_now = zmq.Socket.shadow(sock.underlying)
        fd = self._recv_now.getsockopt(zmq.FD)
        loop.add_reader(fd, self._drain_outputs)
        self._reader = (loop, fd)
        loop.call_soon(self._drain_outputs)  # anything queued before the reader was added

    def _drain_outputs(self) -> None:
        """Handle every message queued on the socket (at most DRAIN_BATCH, then yield to the
        loop and continue). The FD is edge-triggered: it signals again only for messages that
        arrive after the socket's EVENTS showed the queue empty, so the queue is always
        drained to empty or rescheduled."""
        import zmq

        if self._reader is None:  # closed
            return
        loop = self._reader[0]
        sock = self._recv_now
        for _ in range(DRAIN_BATCH):
            try:
                # Reading EVENTS re-arms the FD once the queue is empty; asking first spares
                # the zmq.Again exception that ending each drain would otherwise raise.
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                msg = sock.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                continue  # EVENTS is checked again
            except zmq.ZMQError:  # the socket closed under us
                return
            except Exception:  # a message that does not unpickle
                logger.exception("dropped an undecodable message from the detokenizer")
                continue
            self._dispatch_logged(msg)
        loop.call_soon(self._drain_outputs)

    async def _await_outputs(self) -> None:
        while True:
            self._dispatch_logged(await self.recv_from_detokenizer.recv_pyobj())

    def _dispatch_logged(self, msg: Any) -> None:
        try:
            self._dispatch(msg)
        except Exception:  # a bad message must not stop the receiving that serves everyone
            logger.exception("failed to handle %s", type(msg).__name__)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchStrOutput):
            if self.dp_controller is not None:
                self.dp_controller.on_output(msg)
            self._handle_batch_output(msg)
            return
        if self.dp_controller is not None:
            self.dp_controller.on_reply(msg)
            return
        for fut in self._control_waiters.pop(type(msg), []):
            if not fut.done():
                fut.set_result(msg)

    def _handle_batch_output(self, out: BatchStrOutput) -> None:
        now = self.last_output_time = time.monotonic()
        for rid in out.failed_rids:  # the detokenizer failed these; stop them in the scheduler
            self._abort_in_scheduler(rid)
        for i, rid in enumerate(out.rids):
            finished = out.finished_reasons[i]
            state = self.rid_to_state.get(rid)
            if state is None:  # aborted by us: late output, for the metrics only
                gone = self._draining.get(rid)
                if gone is not None:
                    self._observe(gone, len(out.output_ids[i]), now, finished)
                if finished is not None:
                    self._draining.pop(rid, None)
                continue
            state.text += out.output_strs[i]
            state.output_ids.extend(out.output_ids[i])
            if out.output_token_logprobs and out.output_token_logprobs[i] is not None:
                state.output_token_logprobs.extend(state.triples(out.output_token_logprobs[i]))
                for top in out.output_top_logprobs[i] or []:
                    state.output_top_logprobs.append(state.triples(top))
            if out.input_token_logprobs and out.input_token_logprobs[i] is not None:
                state.input_token_logprobs.extend(state.triples(out.input_token_logprobs[i]))
                for top in out.input_top_logprobs[i] or []:
                    state.input_top_logprobs.append(state.triples(top))
            state.meta = {
                "id": rid,
                "prompt_tokens": out.prompt_tokens[i],
                "completion_tokens": out.completion_tokens[i],
                "cached_tokens": out.cached_tokens[i],
                "finish_reason": _public_finish_reason(finished),
                "e2e_latency": now - state.created,
            }
            if out.spec_verify_ct:
                state.meta["spec_verify_ct"] = out.spec_verify_ct[i]
                state.meta["spec_accept_length"] = out.spec_accept_length[i]
                drafts, accepted = out.spec_draft_tokens[i], out.spec_accepted_tokens[i]
                state.meta["spec_accept_rate"] = accepted / drafts if drafts else 0.0
                # (the counts too: a client's rate over many requests is their sums' ratio)
                state.meta["spec_draft_tokens"] = drafts
                state.meta["spec_accepted_tokens"] = accepted
            self._observe(state, len(out.output_ids[i]), now, finished)
            if finished is not None:
                if finished.get("status_code"):
                    state.error = {
                        "message": finished["message"],
                        "status_code": finished["status_code"],
                    }
                state.finished = True
                self.rid_to_state.pop(rid, None)
            state.event.set()

    def _observe(
        self, state: ReqState, new_tokens: int, now: float, finished: dict[str, Any] | None
    ) -> None:
        if state.log_metrics:
            if self.metrics is not None:
                self.metrics.on_output(state, new_tokens, now, finished)
            self.latency_window.on_output(state, new_tokens, now, finished)
        state.last_time = now

    def fail_all(self, message: str, status_code: int = 503) -> None:
        """The scheduler or detokenizer is gone: every waiter gets an error now, not never."""
        for state in list(self.rid_to_state.values()):
            state.error = {"message": message, "status_code": status_code}
            state.finished = True
            state.event.set()
        self.rid_to_state.clear()
        for waiters in self._control_waiters.values():  # flush_cache, server info, LoRA loads
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(RequestError(message, status_code))
        self._control_waiters.clear()
        if self.dp_controller is not None:
            self.dp_controller.fail_calls(RequestError(message, status_code))
        self.dead = message
        self._grammar_check.close()  # requests still in their grammar check get the 503 now

    # -- requests -------------------------------------------------------------------------------
    def tokenize_one(
        self, obj: GenerateReqInput, encoded: list[int] | None = None
    ) -> TokenizedGenerateReqInput:
        """Tokenize one single request whose fields generate_request has checked (for the whole
        batch at once) and verify its sampling params; RequestError names a bad field.
        `encoded`: its text's tokens, when tokenize_and_check encoded them off the loop."""
        if obj.input_ids is not None:
            input_ids = list(obj.input_ids)  # type: ignore[arg-type]
            if any(t < 0 or t >= self.vocab_size for t in input_ids):  # type: ignore[operator]
                raise RequestError("input_ids must be token ids in [0, vocab_size)")
            text = None
        else:
            text = obj.text  # type: ignore[assignment]
            input_ids = self.encode(text) if encoded is None else encoded
        if not input_ids:
            raise RequestError("the prompt is empty")
        try:
            sp = SamplingParams.from_dict(copy.deepcopy(obj.sampling_params))
            sp.verify(self.vocab_size)
        except SamplingParamsError as e:
            raise RequestError(str(e)) from None
        given = obj.sampling_params
        explicit = isinstance(given, SamplingParams) or (
            isinstance(given, dict) and given.get("max_new_tokens") is not None
        )
        check_length(len(input_ids), sp, self.context_len, explicit)
        dp_rank, dp_size = obj.data_parallel_rank, self.server_args.dp_size
        if dp_rank is not None and not 0 <= dp_rank < dp_size:
            raise RequestError(
                f"data_parallel_rank {dp_rank} is out of range: this server has --dp-size "
                f"{dp_size} (ranks 0 to {dp_size - 1})"
            )
        if obj.return_logprob and obj.logprob_start_len > len(input_ids):
            raise RequestError(
                f"logprob_start_len {obj.logprob_start_len} is past the prompt's "
                f"{len(input_ids)} tokens"
            )
        # (an unknown adapter was refused as the request arrived: _resolve_adapters)
        lora_id = obj.lora_path[0] if isinstance(obj.lora_path, list) else obj.lora_path
        # The client's key has a namespace of its own: it could name an adapter's ("lora:...")
        # and read, or write base-model KV into, that adapter's cache. The adapter's part is
        # added by _bind_adapters.
        extra_key = None if obj.extra_key is None else f"user:{obj.extra_key}"
        return TokenizedGenerateReqInput(
            rid=obj.rid if isinstance(obj.rid, str) else new_rid(),
            input_text=text,
            input_ids=input_ids,
            sampling_params=sp,
            stream=obj.stream,
            return_logprob=obj.return_logprob,
            top_logprobs_num=obj.top_logprobs_num,
            logprob_start_len=obj.logprob_start_len,
            return_text_in_logprobs=obj.return_text_in_logprobs,
            extra_key=extra_key,
            priority=obj.priority,
            routing_key=obj.routing_key,
            lora_id=lora_id,
            bootstrap_host=obj.bootstrap_host,
            bootstrap_port=obj.bootstrap_port,
            bootstrap_room=obj.bootstrap_room,
            data_parallel_rank=obj.data_parallel_rank,
            log_metrics=obj.log_metrics,
        )

    def _adapter_key(self, lora_id: str) -> str:
        if lora_id not in self.lora_keys:
            loaded = ", ".join(sorted(self.lora_keys)) or "none (start with --lora-paths)"
            raise RequestError(f"unknown LoRA adapter {lora_id!r}; loaded: {loaded}")
        return self.lora_keys[lora_id]

    def _resolve_adapters(self, obj: GenerateReqInput) -> dict[str, str]:
        """The cache namespaces of the adapters a request names (its fields verified), as
        loaded when it arrives; an unknown one is refused before anything else is done."""
        lora = obj.lora_path
        names = lora if isinstance(lora, list) else [lora]
        return {name: self._adapter_key(name) for name in names if name is not None}

    def _bind_adapters(
        self, tokenized_list: list[TokenizedGenerateReqInput], adapters: dict[str, str]
    ) -> None:
        """Namespace each request's KV by its adapter's contents, as resolved when it arrived
        (`adapters`). From its arrival to its end the request counts as the adapter's user
        (_lora_users) and an unload waits for it, so no other files can be loaded under the
        name meanwhile: the key resolved then is that of the weights that serve it. (Without
        that wait, a key taken before the grammar check served the new files' weights from the
        old files' cached KV after an unload and a reload during the check; taken after it, the
        request got a 400 "unknown LoRA adapter" when an unload came first.)"""
        for t in tokenized_list:
            if t.lora_id is not None:
                key = adapters[t.lora_id]
                t.extra_key = key + ("" if t.extra_key is None else f"|{t.extra_key}")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Render the chat template to text, then tokenize it (no extra special tokens)."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as e:  # jinja errors, missing template
            raise RequestError(f"cannot apply the chat template: {e}") from None
        return self.encode(text, add_special_tokens=False)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        """The text's tokens; a text too long for the context is refused unread (check_chars)."""
        self.check_chars(text)
        return self.tokenizer.encode(text, **kwargs)

    def check_chars(self, text: str) -> None:
        """Refuse a text too long for any of its tokenizations to fit the context, before it
        is tokenized (a 4 MB prompt was tokenized for 8 s to be refused for its length; 50 MB
        took the server's memory)."""
        if self._max_token_chars is None:  # (no token decodes to more characters than this)
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._max_token_chars = max(map(len, vocab), default=64)
        # (normalizers may compose a few characters into one: the factor 4 is room for that)
        limit = self.context_len * self._max_token_chars * 4
        if self.context_len and len(text) > limit:
            raise RequestError(
                f"the prompt has {len(text)} characters: more than the {self.context_len} "
                "tokens of the context length can hold"
            )

    async def tokenize_and_check(
        self, obj: GenerateReqInput, on_loop: bool = True
    ) -> TokenizedGenerateReqInput:
        """tokenize_one (its text encoded on a worker thread unless `on_loop`), then the grammar
        check on a worker thread (compiling a large schema must not stall the event loop that
        serves every other request)."""
        encoded = None
        if not on_loop and obj.input_ids is None:
            encoded = await asyncio.to_thread(self.encode, obj.text)  # type: ignore[arg-type]
        tokenized = self.tokenize_one(obj, encoded)
        sp = tokenized.sampling_params
        if sp.json_schema is not None or sp.regex is not None or sp.ebnf is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(
                    None, self._grammar_check.check, sp
                )
            except RuntimeError:  # closed under it (fail_all, close): the server is stopping
                if self.dead is None and not self.closed:
                    raise
                raise RequestError(self.dead or "the server is shutting down", 503) from None
        return tokenized

    async def generate_request(
        self, obj: GenerateReqInput, request: Any = None
    ) -> AsyncIterator[Any]:
        """Yield output dicts (streaming: one per wake-up, cumulative; otherwise one final dict).
        A batch or n > 1 yields one list of dicts (non-streaming) or dicts tagged with "index"
        (streaming). Nothing is dispatched unless every sub-request is valid."""
        received = time.monotonic()  # (the latencies count the tokenizing and grammar check)
        self.start()
        if self.dead is not None:
            raise RequestError(self.dead, 503)
        arrival = _Arrival(obj.rid)
        self._arriving.add(arrival)
        try:
            tokenized_list, parents, n = await self._tokenize_and_admit(obj, arrival)
        except RequestError as e:
            self._tell_peers_refused(obj, str(e))
            raise
        finally:
            self._arriving.discard(arrival)  # (no await from here until the states register)
        states = [self._register(t, obj.log_metrics, received) for t in tokenized_list]
        # (the prefill server's copy reaches the client through the router: see the field; it
        # merges the prompt's token logprobs of one non-streamed answer, not its top ones)
        peer_logprobs = (
            obj.router_merges_prompt_logprobs
            and self.server_args.disaggregation_mode == "decode"
            and obj.is_single
            and n == 1
            and not obj.stream
        )
        for state, parent, sub in zip(states, parents, tokenized_list, strict=True):
            state.parent_rid = parent
            state.omit_input_logprobs = peer_logprobs and sub.bootstrap_room is not None
        if len(tokenized_list) == 1:
            self.send_to_scheduler.send_pyobj(tokenized_list[0])
        else:
            self.send_to_scheduler.send_pyobj(BatchTokenizedGenerateReqInput(tokenized_list))
        if arrival.aborted or arrival.aborted_all:  # (/abort_request named it as it arrived)
            self._abort_on_arrival(arrival, states)
        if obj.is_single and n == 1:
            async for out in self._wait_one(states[0], request):
                yield out
        elif obj.stream:
            async for out in self._merge_streams(states, request):
                yield out
        else:
            yield await self._gather(states, request)

    def _abort_on_arrival(self, arrival: _Arrival, states: list[ReqState]) -> None:
        """Aborts that came while the request arrived (sent after it: the scheduler ends it as
        a queued request, and its waiter receives finish_reason "abort", as if registered)."""
        for state in states:
            if arrival.hits(state):
                self.send_to_scheduler.send_pyobj(AbortReq(state.rid))

    async def _tokenize_and_admit(
        self, obj: GenerateReqInput, arrival: _Arrival
    ) -> tuple[list[TokenizedGenerateReqInput], list[str | None], int]:
        """Every sub-request tokenized and checked, and admitted (a RequestError otherwise):
        (the sub-requests, the rid each is aborted by as a group, n)."""
        verify_request_fields(obj)
        # Before the first await: as in SGLang, an unload that starts after the request
        # arrived waits for it (_lora_users), and one under way refuses it.
        arrival.adapters = self._resolve_adapters(obj)
        n = num_choices(obj)
        singles = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
        for single in singles:  # (a batch's prompt too long is refused before any is tokenized)
            if single.text is not None:
                self.check_chars(single.text)
        tokenized_list, parents = [], []
        budget = ENCODE_ON_LOOP_CHARS  # what is left of the characters tokenized on the loop
        for i, single in enumerate(singles):
            if i:  # (others are served between prompts: many with a large n held the loop)
                await asyncio.sleep(0)
            chars = len(single.text or "")
            on_loop = chars <= budget
            if on_loop:
                budget -= chars
            base = await self.tokenize_and_check(single, on_loop)
            subs = [base] if n == 1 else _choices(base, n)
            for j, sub in enumerate(subs):  # each sub-request's own P/D pairing
                for name, value in obj.pairing(j * len(singles) + i).items():
                    setattr(sub, name, value)
            tokenized_list += subs
            # The rid of a batch (its prompts got `<rid>_<i>`) or of an n > 1 request finds
            # all its sub-requests (request_abort).
            group = obj.rid if not obj.is_single and isinstance(obj.rid, str) else None
            parents += [group] if n == 1 else [group or base.rid] * n
        await self._await_drained(tokenized_list)
        if self.dead is not None:  # it died during the checks: nobody would answer
            raise RequestError(self.dead, 503)
        self._bind_adapters(tokenized_list, arrival.adapters)
        self._admit(tokenized_list, parents)
        return tokenized_list, parents, n

    def _tell_peers_refused(self, obj: GenerateReqInput, message: str) -> None:
        """A P/D request refused here, before the scheduler saw it: its peer (the other
        server's copy, paired on the same room) is told through the scheduler at once; it
        waited out --disaggregation-timeout (60 s) for a room nobody would fill."""
        mode = self.server_args.disaggregation_mode
        if mode == "null" or obj.bootstrap_room is None or self.dead is not None:
            return
        try:
            pairings = [obj.pairing(k) for k in range(obj.batch_size * num_choices(obj))]
        except Exception:  # (a body too malformed to name its rooms)
            return
        for p in pairings:
            if is_int(p["bootstrap_room"]):
                refused = RoomRefusedReq(
                    p["bootstrap_room"], p["bootstrap_host"], p["bootstrap_port"], message
                )
                self.send_to_scheduler.send_pyobj(refused)

    async def _await_drained(self, tokenized_list: list[TokenizedGenerateReqInput]) -> None:
        """A rid whose earlier request was aborted (a client's timeout, then its retry) is
        taken until the scheduler's last output for it has come: wait for that a moment
        rather than refuse the retry at once (its late output must not reach the new one)."""
        deadline = time.monotonic() + RID_DRAIN_WAIT_S
        while any(t.rid in self._draining for t in tokenized_list):
            if time.monotonic() >= deadline or self.dead is not None:
                return  # (_admit says why)
            await asyncio.sleep(0.005)

    def _admit(
        self, tokenized_list: list[TokenizedGenerateReqInput], parents: list[str | None]
    ) -> None:
        """Refuse a rid that is taken (400) and load past the queue bound (503), before any
        sub-request is sent. The group rid of an n > 1 request or a batch is taken with its
        sub-requests' rids: /abort_request with a rid shared by a group and a request stopped
        only the request."""
        rids = [t.rid for t in tokenized_list]
        groups = {p for p in parents if p is not None}
        live_groups = {s.parent_rid for s in self.rid_to_state.values()}
        seen: set[str] = set()
        for rid in rids:
            taken = rid in self.rid_to_state or rid in self._draining or rid in live_groups
            if taken or rid in seen or rid in groups:
                raise RequestError(f"a request with rid {rid!r} is already running")
            seen.add(rid)
        for group in groups:
            if group in self.rid_to_state or group in live_groups:
                raise RequestError(f"a request with rid {group!r} is already running")
        limit = self.max_in_flight
        if limit is not None and len(rids) > limit:  # no retry could ever succeed
            raise RequestError(
                f"a batch of {len(rids)} requests (prompts times n) is more than the "
                f"{limit} this server holds at once (--max-queued-requests); split it"
            )
        full = limit is not None and len(self.rid_to_state) + len(rids) > limit
        if full and not self._outranks_one_in_flight(tokenized_list[0].priority):
            raise RequestError(
                f"the server is overloaded: more than {limit} requests in flight "
                "(--max-queued-requests); retry later",
                503,
                {"Retry-After": str(RETRY_AFTER_S)},
            )

    def _outranks_one_in_flight(self, priority: int | None) -> bool:
        """--schedule-policy priority: a request that ranks above one in flight passes the
        bound; the scheduler refuses the lowest-ranked waiting request instead (a
        high-priority request was refused while low-priority ones waited)."""
        if self.server_args.schedule_policy != "priority" or not self.rid_to_state:
            return False
        return (priority or 0) > min(s.priority for s in self.rid_to_state.values())

    def _register(
        self, tokenized: TokenizedGenerateReqInput, log_metrics: bool, received: float
    ) -> ReqState:
        state = ReqState(tokenized.rid, tokenized.stream, len(tokenized.input_ids))
        state.created = received
        state.log_metrics = log_metrics
        state.priority = tokenized.priority or 0
        state.lora_id = tokenized.lora_id
        state.return_logprob = tokenized.return_logprob
        if tokenized.return_logprob and tokenized.return_text_in_logprobs:
            state.token_text = self.token_strings
        self.rid_to_state[tokenized.rid] = state
        if self.metrics is not None and log_metrics:
            self.metrics.on_request(len(tokenized.input_ids))
        return state

    async def _wait_one(self, state: ReqState, request: Any) -> AsyncIterator[dict[str, Any]]:
        try:
            while True:
                if not await _wait_event(state.event, DISCONNECT_POLL_S):
                    if request is not None and await request.is_disconnected():
                        self.abort_request(state.rid)
                        return
                    continue
                state.event.clear()
                if state.error is not None:
                    code = state.error["status_code"]
                    retry = {"Retry-After": str(RETRY_AFTER_S)} if code == 503 else None
                    raise RequestError(state.error["message"], code, retry)
                # Decide on this snapshot: more output (the finish, even) can arrive while the
                # consumer holds it, and must then be yielded on the next round, not skipped.
                finished = state.finished
                if state.stream or finished:
                    yield state.snapshot()
                if finished:
                    return
        finally:
            if not state.finished:  # the consumer went away (disconnect, cancel, error)
                self.abort_request(state.rid)

    async def _gather(self, states: list[ReqState], request: Any) -> list[dict[str, Any]]:
        """Every sub-request's final output; when one fails, the others are aborted."""
        tasks = [asyncio.ensure_future(self._last(s, request)) for s in states]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()  # a no-op for the finished ones; aborts the rest (see _wait_one)
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _last(self, state: ReqState, request: Any) -> dict[str, Any]:
        last: dict[str, Any] = {}
        async for out in self._wait_one(state, request):
            last = out
        return last

    async def _merge_streams(self, states: list[ReqState], request: Any) -> AsyncIterator[Any]:
        """The sub-requests' streams as one, each output tagged with its index. An output waits
        in the queue while the consumer (a slow client) is busy, so it is detached from its
        state's lists, which later outputs extend; the queue holds one per sub-request, so a
        pump that finds it full waits, and its next output covers what arrived meanwhile."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(states))

        async def pump(index: int, state: ReqState) -> None:
            try:
                async for out in self._wait_one(state, request):
                    await queue.put({**detached(out), "index": index})
            except Exception as e:  # surfaced to the consumer below
                await queue.put(e)
            await queue.put(None)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(states)]
        done = 0
        try:
            while done < len(tasks):
                item = await queue.get()
                if item is None:
                    done += 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    def request_abort(self, rid: str) -> bool:
        """An abort asked by someone other than the waiter (e.g. /abort_request): the state stays
        so the waiter receives the scheduler's finish_reason "abort". The rid of an n > 1
        request aborts each of its choices. A request still arriving (in its grammar check, say)
        is marked, and aborted as it registers (SGLang registers it first: the abort found it)."""
        if rid in self.rid_to_state:
            rids = [rid]
        else:
            rids = [r for r, s in self.rid_to_state.items() if s.parent_rid == rid]
        for r in rids:
            self.send_to_scheduler.send_pyobj(AbortReq(r))
        arriving = [a for a in self._arriving if a.names(rid)]
        for a in arriving:
            a.aborted.add(rid)
        return bool(rids or arriving)

    def request_abort_all(self) -> int:
        """Abort every request in flight (/abort_request with abort_all); their waiters receive
        finish_reason "abort". Returns how many there were (a request still arriving counts
        once, its sub-requests being unknown yet)."""
        for a in self._arriving:
            a.aborted_all = True
        n = len(self.rid_to_state) + len(self._arriving)
        self.send_to_scheduler.send_pyobj(AbortReq("", abort_all=True))
        return n

    def abort_request(self, rid: str) -> None:
        """The waiter is gone: drop its state and stop the request in the scheduler."""
        state = self.rid_to_state.pop(rid, None)
        if state is not None:
            self._abort_in_scheduler(rid, state)

    def _abort_in_scheduler(self, rid: str, state: ReqState | None = None) -> None:
        # The rid stays taken until the scheduler's final output for it passes (so a new
        # request reusing it never receives the old one's output).
        self._draining[rid] = state
        if not self.closed:  # (handlers cancelled as the server stops: the sockets are gone)
            self.send_to_scheduler.send_pyobj(AbortReq(rid))

    # -- control --------------------------------------------------------------------------------
    async def _control(self, req: Any, reply_type: type, timeout: float = 30.0) -> Any:
        self.start()
        if self.dead is not None:  # nobody would answer: fail now, as a request does
            raise RequestError(self.dead, 503)
        try:
            if self.dp_controller is not None:  # every replica answers; the controller merges
                return await self.dp_controller.control(req, reply_type, timeout)
            fut = asyncio.get_running_loop().create_future()
            self._control_waiters.setdefault(reply_type, []).append(fut)
            self.send_to_scheduler.send_pyobj(req)
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:  # a stalled scheduler: a 503 that says so, not a 500
            raise RequestError(
                f"the scheduler did not answer {type(req).__name__} within {timeout:g} s", 503
            ) from None

    async def flush_cache(self) -> FlushCacheReqOutput:
        # (the scheduler may hold it FLUSH_WAIT_S for the cache's copies: it answers first)
        return await self._control(FlushCacheReq(), FlushCacheReqOutput, FLUSH_WAIT_S + 30)

    async def load_lora_adapter(self, name: str, path: str) -> LoRAUpdateReqOutput:
        """Load an adapter into every scheduler (each TP rank its shard, each DP replica);
        requests may name it once this returns success. A relative path is this process's
        (made absolute: a TP rank on another machine runs elsewhere)."""
        sa = self.server_args
        if not (sa.enable_lora or sa.lora_paths):  # (before the path is looked at: a client
            # told "no adapter_config.json" from "not a directory" learnt what the disk holds)
            return LoRAUpdateReqOutput(False, NO_LORA)
        path = os.path.abspath(os.path.expanduser(path))
        async with self._lora_guard():
            if name in self.lora_keys:
                return LoRAUpdateReqOutput(False, f"a LoRA adapter named {name!r} is loaded")
            if not is_adapter_name(name):
                return LoRAUpdateReqOutput(
                    False, f"{name!r} is not an adapter name (no whitespace or '|')"
                )

            def checked_key() -> str:
                check_adapter_dir(path)
                return adapter_key(name, path)

            try:  # (on a thread: hashing a large adapter's weights held every request here)
                key = await asyncio.to_thread(checked_key)
            except (LoRAError, OSError) as e:
                return LoRAUpdateReqOutput(False, str(e))
            out = await self._control(LoadLoRAAdapterReq(name, path), LoRAUpdateReqOutput, 300)
            if out.success:
                self.lora_paths[name], self.lora_keys[name] = path, key
            else:
                await self._undo_on_replicas(UnloadLoRAAdapterReq(name, restore=True))
            return out

    async def unload_lora_adapter(self, name: str) -> LoRAUpdateReqOutput:
        """As in SGLang: new requests naming the adapter are refused from the moment this
        starts, and the unload waits (up to LORA_UNLOAD_WAIT_S) for those in flight to finish.
        Refusing while any was in flight, an unload under steady traffic almost never passed."""
        async with self._lora_guard():
            if name not in self.lora_keys:
                return LoRAUpdateReqOutput(False, f"no LoRA adapter named {name!r} is loaded")
            path, key = self.lora_paths.pop(name), self.lora_keys.pop(name)
            try:
                deadline = time.monotonic() + LORA_UNLOAD_WAIT_S
                while (users := self._lora_users(name)) and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
            except BaseException:  # (the client left, or the server stops: still loaded)
                self.lora_paths[name], self.lora_keys[name] = path, key
                raise
            if users:
                self.lora_paths[name], self.lora_keys[name] = path, key
                return LoRAUpdateReqOutput(
                    False,
                    f"{users} requests still use LoRA adapter {name!r} after "
                    f"{LORA_UNLOAD_WAIT_S:g} s; it stays loaded",
                )
            out = await self._control(UnloadLoRAAdapterReq(name), LoRAUpdateReqOutput)
            if not out.success:
                self.lora_paths[name], self.lora_keys[name] = path, key
                await self._undo_on_replicas(LoadLoRAAdapterReq(name, path, restore=True))
            return out

    def _lora_users(self, name: str) -> int:
        """Requests of the adapter in flight: those still arriving (see _bind_adapters),
        registered ones, and those whose clients left (still in the scheduler until their abort
        passes)."""
        states = [*self.rid_to_state.values(), *self._draining.values()]
        arriving = sum(1 for a in self._arriving if name in a.adapters)
        return arriving + sum(1 for s in states if s is not None and s.lora_id == name)

    async def _undo_on_replicas(self, req: LoadLoRAAdapterReq | UnloadLoRAAdapterReq) -> None:
        """A LoRA load or unload that some data-parallel replicas refused (each decides alone;
        TP ranks agree among themselves) is undone on the others, so that every replica serves
        the adapter or none does."""
        if self.dp_controller is None:
            return
        try:
            out = await self._control(req, LoRAUpdateReqOutput, 300)
        except RequestError as e:
            out = LoRAUpdateReqOutput(False, str(e))
        if not out.success:
            logger.error(
                "undoing LoRA %s of %r on the replicas that did it failed: %s",
                "unload" if isinstance(req, LoadLoRAAdapterReq) else "load",
                req.lora_name,
                out.message,
            )

    def grammar_compiling(self) -> bool:
        """Whether a grammar check's compile still runs (one refused for its time goes on)."""
        return self._grammar_check.compiling()

    def _lora_guard(self) -> asyncio.Lock:
        if self._lora_lock is None:  # created on the serving loop
            self._lora_lock = asyncio.Lock()
        return self._lora_lock

    async def get_server_info(self) -> dict[str, Any]:
        out: GetServerInfoReqOutput = await self._control(
            GetServerInfoReq(), GetServerInfoReqOutput
        )
        return out.info

    async def get_dashboard_snapshot(self, timeout: float = 10.0) -> dict[str, Any]:
        """The scheduler's dashboard snapshot plus this side's requests and latencies."""
        out: DashboardSnapshotReqOutput = await self._control(
            DashboardSnapshotReq(), DashboardSnapshotReqOutput, timeout
        )
        return {
            **out.info,
            "in_flight": len(self.rid_to_state),
            "latency": self.latency_window.snapshot(),
        }


async def _wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Whether `event` was set within `timeout` seconds. Not asyncio.wait_for: on Python 3.11
    it swallows a cancel that comes after the event fired and before the task resumed
    (CPython gh-86296), and the request of a stream its consumer closed, or a Ctrl-C, ran on
    to its end unread, holding its KV."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return bool(done)


def _choices(base: TokenizedGenerateReqInput, n: int) -> list[TokenizedGenerateReqInput]:
    """n sub-requests of one prompt, rids `<rid>_<i>` (SGLang's: the request's rid finds
    them, TokenizerManager.request_abort) and, with a seed, each its own stream of random
    numbers (seed + i), so that seeded choices differ yet reproduce."""
    out = []
    for i in range(n):
        t = copy.copy(base)
        t.rid = f"{base.rid}_{i}"
        t.sampling_params = copy.deepcopy(base.sampling_params)
        t.sampling_params.n = 1
        if t.sampling_params.seed is not None:
            t.sampling_params.seed += i
        out.append(t)
    return out


def _public_finish_reason(reason: dict[str, Any] | None) -> dict[str, Any] | None:
    if reason is None:
        return None
    return {k: v for k, v in reason.items() if k != "status_code"}
