"""The prefill side of P/D disaggregation (`--disaggregation-mode prefill`).

A request arrives with a bootstrap room (SGLang's router sends the same body to the decode
server at the same moment). Its life here:

  bootstrap    waits until the decode server's `reserve` for its room arrives (either may come
               first); then it joins the waiting queue, max_new_tokens forced to 1. The decode
               server announces the room (`queued`) as soon as its copy arrives there, then
               reserves once KV slots fit; a queued copy waits here as long as that decode
               server keeps pinging (a loaded decode server queues, as one server would),
               --disaggregation-timeout without a reservation or a ping otherwise
  prefill      scheduled as usual: chunked, radix-cached, batched with others
  transferring its first token is sampled and streamed to this server's client (the router
               drops that response); its prompt KV stays held, off the tree, while a worker
               thread writes it into the decode server's reserved slots; then `done` carries
               the first token, and the KV goes to this server's radix tree

Failures (the decode side aborts, pairing or transfer times out, the transfer fails, a client
aborts here) end the request here with an error and tell the decode side `failed`. A room the
decode side's layout was refused for (page size, dtype, layers, vocabulary, transfer backend
differ) is remembered: a copy arriving after the refusal is refused at once (400), not left to
wait out the timeout.

Each decode server's transfers go one at a time on a thread of their own: a hung decode host
holds its thread for a whole failed write (~30 s with Mooncake's TCP timeout) and stalls no
other decode server's. A transfer still queued when its reservation is older than
--disaggregation-timeout (the decode side gave up on it), or whose decode server has not been
heard from since a write to it failed, is not tried: its KV is freed at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any

from radixserve.disaggregation.side import DisaggSide, adapter_of, prompt_fingerprint
from radixserve.io_struct import RoomRefusedReq
from radixserve.managers.schedule_batch import Req

logger = logging.getLogger(__name__)
# After a transfer to a decode server failed, how long the next one waits for that server's
# ping (it pings every second while it waits for KV from here) before taking it for dead.
PING_WAIT_S = 1.5


class SilentPeer(RuntimeError):
    """A transfer not tried: its decode server has not pinged since a transfer to it failed."""


class TooLate(RuntimeError):
    """A transfer not tried: the decode side's deadline for the KV passed while it queued."""


def _adapter_name(key: str | None) -> str:
    """adapter_of's key ("lora:<name>:<hash of its files>"; a name may hold colons) in words."""
    if key is None:
        return "the base model"
    name, _, digest = key.removeprefix("lora:").rpartition(":")
    return f"LoRA adapter {name!r} (files {digest})"


class PrefillBootstrap(DisaggSide):
    ANSWERS_PINGS = True
    _counting = threading.Lock()  # the transfer counters, added to from each peer's thread

    def __init__(self, scheduler: Any) -> None:
        super().__init__(scheduler, scheduler.server_args.disaggregation_bootstrap_port)
        self.waiting: dict[int, Req] = {}  # room → request waiting for its reservation
        self.reservations: dict[int, tuple[float, dict[str, Any]]] = {}  # arrived first
        self.sending: list[tuple[Req, concurrent.futures.Future]] = []
        self.cancelled: dict[int, float] = {}  # rooms the decode side gave up, since when
        self.ended: dict[int, tuple[float, str]] = {}  # rooms ended here before pairing: why
        self.refused: dict[int, tuple[float, str]] = {}  # rooms whose layout was refused: why
        # Rooms a decode server queued for KV slots (`queued`, before its `reserve`): since when,
        # and its address; their copies here wait while it pings.
        self.queued: dict[int, tuple[float, str]] = {}
        # Decode servers (their channel addresses) a transfer failed to, since when; and when
        # each was last heard from (a ping or any message). One not heard from since its failure
        # gets no more tries (_send), so a dead or hung decode server does not hold its transfer
        # thread, and the KV queued there, a failed write (~30 s on a hung host) per request.
        # Written on that thread only, at the failure itself (its next queued transfer starts at
        # once, before this loop could see it), and kept until the server takes a KV again.
        self.failed_peers: dict[str, float] = {}
        self.pinged: dict[str, float] = {}
        # One transfer thread per decode server (its channel address) with transfers here.
        self.pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self.transfer_bytes = 0
        self.transfer_seconds = 0.0
        pool = scheduler.tp_worker.model_runner.token_to_kv_pool
        self.token_bytes = sum(b[0].numel() * b.element_size() for b in pool.k_buffer) * 2
        logger.info(
            "prefill server: bootstrap server on port %d, KV transfer over %s",
            self.channel.port,
            self.transfer.name,
        )

    # -- requests -------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        room = req.bootstrap_room
        if self._room_in_use(room):
            self.s._reject(req, f"bootstrap_room {room} is already in use on this server")
            return
        refused = self.refused.pop(room, None)
        if refused is not None:  # its decode server's reservation came first and was refused
            self.cancelled.pop(room, None)
            self.s._finish_queued_abort(req, refused[1], status_code=400)
            return
        if self.cancelled.pop(room, None) is not None:  # given up before it came
            self.s._finish_queued_abort(req, "the decode server aborted the request")
            return
        req.sampling_params.max_new_tokens = 1  # the decode server generates the rest
        req.disagg_deadline = time.monotonic() + self.timeout
        arrived = self.reservations.pop(room, None)
        if arrived is not None:
            self._pair(req, arrived[1])
        else:
            self.waiting[room] = req

    def _pair(self, req: Req, reservation: dict[str, Any]) -> None:
        error = None
        if len(reservation["slots"]) != len(req.origin_input_ids):
            error = (
                f"the decode server reserved {len(reservation['slots'])} slots for a prompt of "
                f"{len(req.origin_input_ids)} tokens (do both servers use the same tokenizer?)"
            )
        elif reservation["prompt"] != prompt_fingerprint(req.origin_input_ids):
            error = (
                f"bootstrap_room {req.bootstrap_room} pairs two different prompts (each "
                "request needs a room of its own; do both servers use the same tokenizer?)"
            )
        elif reservation["adapter"] != adapter_of(req):
            theirs, ours = reservation["adapter"], adapter_of(req)
            error = (
                f"the decode server serves it with {_adapter_name(theirs)} and this server with "
                f"{_adapter_name(ours)} (both servers need the same adapter files under its name)"
            )
        if error is not None:
            self._fail_reservation(reservation, error)
            self.s._finish_queued_abort(
                req, f"the decode server's reservation does not match: {error}", status_code=400
            )
            return
        req.disagg_target = reservation
        self.s.waiting_queue.append(req)

    def on_finished(self, req: Req) -> bool:
        """A request finished its forward (or was aborted in flight). True: its KV is being
        sent and it is released later (`poll`); False: release it now."""
        target = req.disagg_target
        if target is None:
            return False
        if self.cancelled.pop(req.bootstrap_room, None) is not None:
            req.disagg_target = None
            return False
        if req.finished_reason and req.finished_reason["type"] == "abort":
            self._fail_reservation(target, req.finished_reason["message"])
            req.disagg_target = None
            return False
        slots = self.s.req_to_token_pool.req_to_token[req.req_pool_idx, : len(target["slots"])]
        src = slots.tolist()
        peer = target["reply_to"]
        if peer not in self.pools:
            self.pools[peer] = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="kv-send"
            )
        fut = self.pools[peer].submit(
            self._send, target["desc"], src, target["slots"], peer, target["deadline"]
        )
        self.sending.append((req, fut))
        return True

    def _send(
        self,
        desc: dict[str, Any],
        src: list[int],
        dst: list[int],
        peer: str,
        deadline: float = float("inf"),
    ) -> Any:
        """On the transfer thread: move the KV, count its bytes and time. Not tried (TooLate)
        past the decode side's deadline, nor (SilentPeer) where a transfer to this decode server
        failed and it has not been heard from since."""
        if time.monotonic() > deadline:
            raise TooLate(self._too_late(peer))
        failed = self.failed_peers.get(peer)
        if failed is not None:
            while self.pinged.get(peer, 0.0) < failed:
                if time.monotonic() > failed + PING_WAIT_S:
                    raise SilentPeer(self._silent(peer))
                time.sleep(0.02)
        start = time.perf_counter()
        try:
            payload = self.transfer.send(desc, src, dst)
        except Exception:
            self.failed_peers[peer] = time.monotonic()
            raise
        self.failed_peers.pop(peer, None)
        with self._counting:
            self.transfer_seconds += time.perf_counter() - start
            self.transfer_bytes += len(src) * self.token_bytes
        return payload

    def _not_worth_sending(self, target: dict[str, Any], now: float) -> str | None:
        """Why a queued transfer would not be tried (_send's checks, made on the loop to free
        its KV without waiting for the transfer thread), or None."""
        peer = target["reply_to"]
        if now > target["deadline"]:
            return self._too_late(peer)
        failed = self.failed_peers.get(peer)
        if failed is not None and self.pinged.get(peer, 0.0) < failed < now - PING_WAIT_S:
            return self._silent(peer)
        return None

    def _too_late(self, peer: str) -> str:
        return (
            f"it waited for the transfer thread past the decode server's deadline "
            f"({self.timeout:g} s after its reservation; the decode server at {peer} gave up)"
        )

    @staticmethod
    def _silent(peer: str) -> str:
        return f"the decode server at {peer} has not answered since a transfer to it failed"

    def abort(self, hit: Any) -> None:
        for room, req in list(self.waiting.items()):
            if hit(req):
                del self.waiting[room]
                self.s._finish_queued_abort(req, "aborted by the client")

    def on_aborted(self, req: Req) -> None:
        """A paired request aborted here before its forward finished: the decode side stops
        waiting for it. One that ends before it paired (aborted while it waited, refused):
        the decode side's reservation, arrived or still to come, is answered `failed` at once
        (it held its slots until the timeout, then blamed a request never received)."""
        message = (req.finished_reason or {}).get("message") or req.to_abort or "aborted"
        if req.disagg_target is not None:
            self._fail_reservation(req.disagg_target, message)
            req.disagg_target = None
            return
        self._end_room(req.bootstrap_room, message)

    def on_refused(self, msg: RoomRefusedReq) -> None:
        """A request this server's TokenizerManager refused (the scheduler never saw it): as
        one that ended here before it paired."""
        self._end_room(msg.room, msg.message)

    def _end_room(self, room: int | None, message: str) -> None:
        if room is None or self._room_in_use(room):
            return  # (in use: another request's room, refused as a duplicate)
        arrived = self.reservations.pop(room, None)
        queued = self.queued.pop(room, None)
        if arrived is not None:
            self._fail_reservation(arrived[1], message)
        elif queued is not None:  # its decode copy leaves the slot queue at once
            self._fail_reservation({"room": room, "reply_to": queued[1]}, message)
        else:
            self.ended[room] = (time.monotonic(), message)

    def _room_in_use(self, room: int) -> bool:
        return room in self.waiting or any(r.bootstrap_room == room for r, _ in self.sending)

    def has_work(self) -> bool:
        return bool(self.waiting or self.sending)

    def queued_reqs(self) -> list[Req]:
        """The requests this side holds outside the scheduler's queues."""
        return [*self.waiting.values(), *(r for r, _ in self.sending)]

    def stats(self) -> dict[str, Any]:
        return {
            "mode": "prefill",
            "bootstrap_port": self.channel.port,
            "transfer_backend": self.transfer.name,
            "waiting_for_decode": len(self.waiting),
            "transferring": len(self.sending),
            "transferred": self.num_transferred,
            "failed": self.num_failed,
            "transfer_bytes": self.transfer_bytes,
            "transfer_seconds": round(self.transfer_seconds, 6),
        }

    def poll_interval_ms(self) -> int:
        """How soon the idle loop must look again: transfers finish on a thread, not a socket."""
        return 2 if self.sending else 50

    # -- the loop ------------------------------------------------------------------------------
    def poll(self) -> None:
        for msg in self.channel.recv_all():
            kind = msg.get("type")
            if "reply_to" in msg:  # any message, a ping too, shows its decode server is alive
                self.pinged[msg["reply_to"]] = time.monotonic()
            if kind == "reserve":
                self._on_reserve(msg)
            elif kind == "queued":
                self._on_queued(msg)
            elif kind == "abort":
                self._on_decode_abort(msg)
            # (a ping is answered by the channel's own thread: nothing more to do here)
        self._finish_transfers()
        self._expire()

    def _on_queued(self, msg: dict[str, Any]) -> None:
        """A decode server holds the room's copy in its queue for KV slots: this room's copy
        here waits for the reservation while that server pings (`_expire`)."""
        room = msg["room"]
        error = self.layout.mismatch(msg.get("layout", {}))
        if error is not None:
            self._refuse(msg, error)
            return
        ended = self.ended.pop(room, None)
        if ended is not None:  # its request ended here before the decode server queued it
            self._fail_reservation(msg, ended[1])
            return
        self.queued[room] = (time.monotonic(), msg["reply_to"])

    def _refuse(self, msg: dict[str, Any], error: str) -> None:
        """The decode server's KV layout differs: fail its room there, and here the copy that
        waits or, remembered until 2 × the timeout passes, the one still to come."""
        room = msg["room"]
        self._fail_reservation(msg, error)
        self.queued.pop(room, None)
        req = self.waiting.pop(room, None)
        if req is not None:
            self.s._finish_queued_abort(req, error, status_code=400)
        else:
            self.refused[room] = (time.monotonic(), error)

    def _on_reserve(self, msg: dict[str, Any]) -> None:
        # The decode side waits for the KV this long from its reservation (sent just before).
        msg["deadline"] = time.monotonic() + self.timeout
        self.queued.pop(msg["room"], None)
        error = self.layout.mismatch(msg.get("layout", {}))
        if error is not None:
            self._refuse(msg, error)
            return
        ended = self.ended.pop(msg["room"], None)
        if ended is not None:  # its request ended here before the reservation came
            self._fail_reservation(msg, ended[1])
            return
        req = self.waiting.pop(msg["room"], None)
        if req is None:
            self.reservations[msg["room"]] = (time.monotonic(), msg)
        else:
            self._pair(req, msg)

    def _on_decode_abort(self, msg: dict[str, Any]) -> None:
        """Stop the room's request here. Unless its KV is being written, answer `failed` at
        once: the decode side keeps the room's slots until it knows no write will come."""
        room = msg["room"]
        self.queued.pop(room, None)
        if room in self.refused:  # the decode copy ends on the refusal: nothing runs here
            return
        if not any(r.bootstrap_room == room for r, _ in self.sending):
            self.channel.send(msg["reply_to"], {"type": "failed", "room": room, "error": "aborted"})
            self.cancelled[room] = time.monotonic()  # whatever runs for it sends nothing
        self.reservations.pop(room, None)
        req = self.waiting.pop(room, None)
        if req is not None:
            self.s._finish_queued_abort(req, "the decode server aborted the request")
            return
        for r in self.s.waiting_queue:
            if r.bootstrap_room == room:
                r.disagg_target = None  # nothing to send any more
                r.to_abort = "the decode server aborted the request"
        for r in self.s._in_flight_reqs():
            if r.bootstrap_room == room and not r.finished():
                r.disagg_target = None
                r.to_abort = "the decode server aborted the request"

    def _finish_transfers(self) -> None:
        still = []
        now = time.monotonic()
        for req, fut in self.sending:
            target = req.disagg_target
            error = None
            if not fut.done():
                # Queued behind a hung write: not to be tried, so its KV is freed now.
                error = self._not_worth_sending(target, now)
                if error is None or not fut.cancel():  # (started: it ends on its own)
                    still.append((req, fut))
                    continue
            else:
                try:
                    payload = fut.result()
                except Exception as e:
                    error = str(e)
            if error is not None:
                logger.warning("KV transfer of room %s failed: %s", req.bootstrap_room, error)
                self.num_failed += 1
                self._fail_reservation(target, f"the KV transfer failed: {error}")
            else:
                self.num_transferred += 1
                logprob = req.output_token_logprobs[0][0] if req.output_token_logprobs else None
                top = req.output_top_logprobs[0] if req.output_top_logprobs else None
                self.channel.send(
                    target["reply_to"],
                    {
                        "type": "done",
                        "room": req.bootstrap_room,
                        "token": req.output_ids[0],
                        "logprob": logprob,
                        "top_logprobs": top,
                        "input_logprobs": (
                            (req.input_token_logprobs, req.input_top_logprobs)
                            if req.return_logprob
                            else None
                        ),
                        "cached_tokens": req.cached_tokens,
                        "payload": payload,
                    },
                )
            req.disagg_target = None
            self.s.tree_cache.cache_finished_req(req)
        self.sending = still
        busy = {req.disagg_target["reply_to"] for req, _ in still}
        for peer in [p for p in self.pools if p not in busy]:  # its thread ends, idle
            self.pools.pop(peer).shutdown(wait=False)

    def _expire(self) -> None:
        now = time.monotonic()
        for room, req in list(self.waiting.items()):
            queued = self.queued.get(room)
            if queued is None:
                if now <= req.disagg_deadline:
                    continue
                message = (
                    f"no decode server reserved bootstrap_room {room} within {self.timeout:g} s"
                )
            else:  # queued there for slots: waits while that decode server pings
                since, peer = queued
                if now <= max(since, self.pinged.get(peer, 0.0)) + self.timeout:
                    continue
                # (on_aborted answers that decode server `failed`, should it still listen)
                message = (
                    f"the decode server at {peer} queued bootstrap_room {room} but has not "
                    f"pinged for {self.timeout:g} s"
                )
            del self.waiting[room]
            self.num_failed += 1
            self.s._finish_queued_abort(req, message, status_code=503)
        # Rooms queued there whose copy never came here: the decode server stops waiting.
        for room, (since, peer) in list(self.queued.items()):
            if room not in self.waiting and now > since + self.timeout:
                del self.queued[room]
                self.cancelled[room] = now  # a copy that comes later ends at once
                self._fail_reservation(
                    {"room": room, "reply_to": peer},
                    f"the prefill server never received the request of room {room}",
                )
        # Rooms given up, and decode servers heard from, long ago: forgotten. (Not a failed
        # one: forgotten, it was tried again, one failed write per request on a hung host.)
        for since in (self.cancelled, self.pinged):
            for key, t in list(since.items()):
                if now > t + 2 * self.timeout:
                    del since[key]
        for ended in (self.ended, self.refused):
            for room, (t, _) in list(ended.items()):
                if now > t + 2 * self.timeout:
                    del ended[room]
        for room, (t, msg) in list(self.reservations.items()):
            if now > t + self.timeout:
                del self.reservations[room]
                self._fail_reservation(
                    msg, f"the prefill server never received the request of room {room}"
                )

    def _fail_reservation(self, reservation: dict[str, Any] | None, error: str) -> None:
        if reservation is not None:
            self.channel.send(
                reservation["reply_to"],
                {"type": "failed", "room": reservation["room"], "error": error},
            )

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=True, cancel_futures=True)
        super().close()
