"""The decode side of P/D disaggregation (`--disaggregation-mode decode`).

A request arrives with the prefill server's bootstrap host, port and room. Its life here:

  prealloc     the prefill server is told at once that the room is queued here (`queued`:
               its copy there waits while this side pings, and a differing pool layout is
               refused now); the request waits until a request row and KV slots for its whole
               prompt fit (beside what the running requests are expected to need), as long as
               that takes while the prefill server answers pings (a single server queues as
               long); then the slots are reserved and the prefill server is told where
               (`reserve`: slots, pool layout, the transfer backend's descriptor)
  waiting-kv   the prefill server computes the prompt and writes its KV into those slots;
               `done` brings the first token (and its logprob); --disaggregation-timeout
               counts from the reservation
  decoding     the request joins the running batch as if it had just prefilled here: its
               first token is streamed, the next step decodes from it

A `failed` message, no `done` within --disaggregation-timeout, or a prefill server that stops
answering pings (PEER_SILENT_S) fails the request with an error (HTTP 503 before any token)
and frees its row; its slots are free at once unless the prefill server writes into this pool
itself (Mooncake) and may still do so: then they wait in quarantine until it answers for the
room. A client abort here tells the prefill server too, as does any end of a request before
it reserved (an abort while queued, a refusal, a timeout).
"""

from __future__ import annotations

import logging
import numbers
import time
from collections import deque
from typing import Any

import torch

from radixserve.disaggregation.side import DisaggSide, adapter_of, prompt_fingerprint
from radixserve.io_struct import RoomRefusedReq
from radixserve.managers.schedule_batch import Req
from radixserve.managers.schedule_policy import lora_fits

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 1.0
PEER_SILENT_S = 5.0  # a prefill server this long without a pong is taken for dead
MAX_RESERVE = 4096  # of a running request's remaining tokens counted against new reservations


class DecodePrealloc(DisaggSide):
    def __init__(self, scheduler: Any) -> None:
        super().__init__(scheduler, 0)
        self.default_port = scheduler.server_args.disaggregation_bootstrap_port
        self.prealloc: deque[Req] = deque()
        self.waiting_kv: dict[int, Req] = {}  # room → request whose KV is on its way
        # prefill address → last ping, last pong, the instance that answered
        self.peers: dict[str, dict[str, Any]] = {}
        # Slots of requests dropped while the prefill server may still be writing into them
        # (room → slots, its address, since when): free only once it answers for the room
        # or is gone, never handed to another request while a late write can land.
        self.quarantine: dict[int, tuple[torch.Tensor, str, float]] = {}

    # -- requests -------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        room = req.bootstrap_room
        if self._room_in_use(room):
            self.s._reject(req, f"bootstrap_room {room} is already in use on this server")
            return
        address = self.peer_address(req)
        try:
            self.channel.connect(address)
        except ValueError as e:  # an address ZMQ cannot even parse: this request's fault
            self.s._reject(req, str(e))
            return
        # Set when its slots are reserved: the wait for them is no transfer timeout.
        req.disagg_deadline = float("inf")
        # The prompt's logprobs are computed on the prefill server: its `done` brings them.
        req.input_token_logprobs, req.input_top_logprobs = [], []
        req.input_logprob_pos = len(req.origin_input_ids)
        self.prealloc.append(req)
        # Pinged from now on (a silent prefill server fails it, _watch_peers); its copy there
        # waits for the reservation while those pings come.
        self.peers.setdefault(address, {"ping": 0.0, "pong": time.monotonic()})
        self.channel.send(
            address,
            {
                "type": "queued",
                "room": room,
                "reply_to": self.channel.address,
                "layout": self.layout.__dict__,
            },
        )

    def peer_address(self, req: Req) -> str:
        return self._address(req.bootstrap_host, req.bootstrap_port)

    def _address(self, host: str, port: int | None) -> str:
        if ":" in host and not host.startswith("["):  # a bare IPv6 address
            host = f"[{host}]"
        return f"tcp://{host}:{port or self.default_port}"

    def abort(self, hit: Any) -> None:
        for req in [r for r in self.prealloc if hit(r)]:
            self.prealloc.remove(req)
            self.s._finish_queued_abort(req, "aborted by the client")
        for room, req in list(self.waiting_kv.items()):
            if hit(req):
                self._drop(room, "aborted by the client", status_code=None, tell_peer=True)

    def on_finished(self, req: Req) -> bool:
        return False  # a decoded request is released as in a plain server

    def on_aborted(self, req: Req) -> None:
        """A request that ends here before it reserved slots (aborted while queued, refused,
        its prefill server silent): its prefill copy is told to stop. It waited for a
        reservation until its own timeout (60 s by default; behind SGLang's router the client
        waited as long for a 400 this side had answered at once)."""
        if not req.disagg_reserved:  # (reserved: _drop tells the peer)
            self._end_room(req.bootstrap_room, req.bootstrap_host, req.bootstrap_port)

    def on_refused(self, msg: RoomRefusedReq) -> None:
        """A request this server's TokenizerManager refused (the scheduler never saw it): its
        prefill copy is told to stop, as for one aborted here while queued."""
        self._end_room(msg.room, msg.host, msg.port)

    def _end_room(self, room: int | None, host: str | None, port: int | None) -> None:
        if room is None or not host or self._room_in_use(room):
            return  # (in use: another request's room)
        address = self._address(host, port)
        try:
            self.channel.connect(address)
        except ValueError:  # an address ZMQ cannot parse: nobody to tell
            return
        self.channel.send(
            address, {"type": "abort", "room": room, "reply_to": self.channel.address}
        )

    def _room_in_use(self, room: int) -> bool:
        return room in self.waiting_kv or any(r.bootstrap_room == room for r in self.prealloc)

    def has_work(self) -> bool:
        return bool(self.prealloc or self.waiting_kv or self.quarantine)

    def holds_reservations(self) -> bool:
        return bool(self.waiting_kv)

    def queued_reqs(self) -> list[Req]:
        """The requests this side holds outside the scheduler's queues."""
        return [*self.prealloc, *self.waiting_kv.values()]

    def poll_interval_ms(self) -> int:
        """Messages wake the loop (the channel is polled with the input socket); this bounds
        how late a timeout, a ping or a reservation that now fits is noticed."""
        return 20 if self.prealloc else 50

    def stats(self) -> dict[str, Any]:
        return {
            "mode": "decode",
            "transfer_backend": self.transfer.name,
            "waiting_for_slots": len(self.prealloc),
            "waiting_for_kv": len(self.waiting_kv),
            "quarantined_slots": sum(len(q[0]) for q in self.quarantine.values()),
            "transferred": self.num_transferred,
            "failed": self.num_failed,
        }

    # -- the loop ------------------------------------------------------------------------------
    def poll(self) -> list[Req]:
        """Handle the peers' messages, reserve what fits, expire what waited too long; returns
        the requests whose KV arrived, ready to join the running batch."""
        ready: list[Req] = []
        for msg in self.channel.recv_all():
            kind = msg.get("type")
            if kind in ("done", "failed") and msg.get("room") in self.quarantine:
                self._release_quarantine(msg["room"])  # no more writes will come for it
                continue
            if kind == "done":
                req = self._on_done(msg)
                if req is not None:
                    ready.append(req)
            elif kind == "failed":
                if msg["room"] in self.waiting_kv:
                    self._drop(msg["room"], f"the prefill server failed: {msg['error']}")
                else:  # refused before this side reserved anything (e.g. a layout mismatch)
                    for req in [r for r in self.prealloc if r.bootstrap_room == msg["room"]]:
                        self.prealloc.remove(req)
                        self.num_failed += 1
                        self.s._finish_queued_abort(
                            req, f"the prefill server failed: {msg['error']}", status_code=503
                        )
            elif kind == "pong":
                self._on_pong(msg)
        self._reserve()
        self._watch_peers()
        return ready

    def _reserve(self) -> None:
        s = self.s
        while self.prealloc:
            req = self.prealloc[0]
            if req.to_abort is not None:
                self.prealloc.popleft()
                s._finish_queued_abort(req, req.to_abort)
                continue
            n = len(req.origin_input_ids)
            running = len(s.running_batch.reqs) + len(self.waiting_kv)
            if running >= s.max_running_requests or s.req_to_token_pool.available_size() < 1:
                return
            if not self._lora_fits(req):
                return  # --max-loras-per-batch other adapters are decoding
            batch = s._new_batch([req])
            need = batch.new_slots_needed([req], [0], [n])
            if need > s.allocator.available_size() + s.tree_cache.evictable_size() - (
                self._reserved_tokens()
            ):
                return
            self.prealloc.popleft()
            address = self.peer_address(req)
            try:
                self.channel.connect(address)
            except ValueError as e:  # an address ZMQ cannot even parse: this request's fault
                s._finish_queued_abort(req, str(e), status_code=400)
                continue
            req.req_pool_idx = s.req_to_token_pool.alloc(1)[0]
            req.kv_allocated_len = 0
            req.disagg_reserved = True
            req.disagg_deadline = time.monotonic() + self.timeout  # for its KV, from now
            slots = batch._alloc_slots([req], [0], [n])
            req.last_node = s.tree_cache.root_node
            self.waiting_kv[req.bootstrap_room] = req
            self.channel.send(
                address,
                {
                    "type": "reserve",
                    "room": req.bootstrap_room,
                    "rid": req.rid,
                    "prompt": prompt_fingerprint(req.origin_input_ids),
                    "adapter": adapter_of(req),
                    "reply_to": self.channel.address,
                    "slots": slots.tolist(),
                    "layout": self.layout.__dict__,
                    "desc": self.transfer.descriptor(),
                },
            )

    def _lora_fits(self, req: Req) -> bool:
        reqs = [*self.s.running_batch.reqs, *self.waiting_kv.values()]
        loras = {r.lora_id for r in reqs if r.lora_id is not None}
        return lora_fits(req, loras, self.s.server_args.max_loras_per_batch)

    def _reserved_tokens(self) -> int:
        """What the running and arriving requests are expected to still write (PrefillAdder's
        reservation), so new reservations do not push them into retraction."""
        ratio = self.s.ratio.value
        reqs = [*self.s.running_batch.reqs, *self.waiting_kv.values()]
        return int(
            sum(min(r.max_new_tokens - len(r.output_ids), MAX_RESERVE) for r in reqs) * ratio
        )

    def _on_done(self, msg: dict[str, Any]) -> Req | None:
        req = self.waiting_kv.pop(msg["room"], None)
        if req is None:  # aborted or expired here meanwhile: nothing to do
            return None
        token = msg.get("token")
        vocab_size = self.s.model_config.vocab_size
        if not isinstance(token, numbers.Integral) or not 0 <= token < vocab_size:
            # The layouts' vocabularies matched (KVLayout); a token past ours still must not
            # reach the embedding: its IndexError ended this whole server.
            self.waiting_kv[msg["room"]] = req
            self._drop(
                msg["room"],
                f"the prefill server's first token {token!r} is outside this model's "
                f"vocabulary of {vocab_size} (do both servers serve the same model?)",
            )
            return None
        n = len(req.origin_input_ids)
        slots = self.s.req_to_token_pool.req_to_token[req.req_pool_idx, :n].tolist()
        try:
            self.transfer.receive(msg.get("payload"), slots)
        except Exception as e:
            self.waiting_kv[msg["room"]] = req
            self._drop(msg["room"], f"the KV transfer failed: {e}")
            return None
        self.num_transferred += 1
        req.kv_committed_len = n
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.fill_ids = list(req.origin_input_ids)
        req.admitted = True
        req.cached_tokens = int(msg.get("cached_tokens") or 0)
        self.s.stats.on_first_admission(req)
        if req.return_logprob and msg.get("input_logprobs") is not None:
            req.input_token_logprobs, req.input_top_logprobs = msg["input_logprobs"]
        logprob = None
        if req.return_logprob and msg.get("logprob") is not None:
            logprob = (msg["logprob"], msg.get("top_logprobs"))
        self.s._append_token(req, int(token), logprob)
        return req

    def _on_pong(self, msg: dict[str, Any]) -> None:
        address = msg.get("from")
        peer = self.peers.get(address)
        if peer is None:
            return
        peer["pong"] = time.monotonic()
        instance = msg.get("instance")
        if peer.get("instance") not in (None, instance):
            # Another process answers there now: the one that held these rooms is gone and
            # writes no more.
            for room in [r for r, q in self.quarantine.items() if q[1] == address]:
                self._release_quarantine(room)
        peer["instance"] = instance

    def _watch_peers(self) -> None:
        now = time.monotonic()
        busy = {self.peer_address(r) for r in (*self.waiting_kv.values(), *self.prealloc)}
        busy |= {q[1] for q in self.quarantine.values()}
        for address, peer in list(self.peers.items()):
            if address not in busy:
                del self.peers[address]
                continue
            if now - peer["pong"] > PEER_SILENT_S:
                if peer.get("instance") is None:  # (never answered: a wrong address, or down)
                    silent = (
                        f"no prefill server answers at {address} (check bootstrap_host and "
                        "bootstrap_port: the prefill server's --disaggregation-bootstrap-port)"
                    )
                    on_the_way = silent
                else:
                    silent = f"the prefill server at {address} stopped answering"
                    on_the_way = f"{silent} while its KV was on the way"
                # Silent is not gone (a stopped or starved process wakes up and writes what it
                # was asked to): its rooms are aborted there and, where it writes into this
                # pool itself, their slots wait in quarantine until it answers for them, comes
                # back as another process, or 2 × the timeout passes; handed to another request,
                # a late write corrupted that request's KV.
                for room, req in list(self.waiting_kv.items()):
                    if self.peer_address(req) == address:
                        self._drop(room, on_the_way, tell_peer=True)
                # Those still queued for slots would each reserve and wait out the pings again
                # (the only end of their wait for slots: no timeout while the peer answers).
                self._fail_queued(lambda r, a=address: self.peer_address(r) == a, silent)
            if now - peer["ping"] >= PING_INTERVAL_S:
                peer["ping"] = now
                self.channel.send(
                    address, {"type": "ping", "reply_to": self.channel.address, "to": address}
                )
        for room, req in list(self.waiting_kv.items()):
            if now > req.disagg_deadline:
                self._drop(
                    room,
                    f"no KV arrived from the prefill server within {self.timeout:g} s",
                    tell_peer=True,
                )
        for room, (_, address, since) in list(self.quarantine.items()):
            if now - since > 2 * self.timeout:  # it answers pings but not for this room
                logger.warning("releasing the slots of room %d: %s never answered", room, address)
                self._release_quarantine(room)

    def _fail_queued(self, hit: Any, message: str) -> None:
        """Fail (503) the requests still queued for slots that `hit` picks."""
        for req in [r for r in self.prealloc if hit(r)]:
            self.prealloc.remove(req)
            self.num_failed += 1
            self.s._finish_queued_abort(req, message, status_code=503)

    def _drop(
        self, room: int, message: str, status_code: int | None = 503, tell_peer: bool = False
    ) -> None:
        """Fail a request that holds reserved slots and answer with the error. With tell_peer
        the prefill server is still there and told to stop; where it writes into this pool
        itself (Mooncake) a write may already be under way, so the slots wait in quarantine
        until it answers for the room; otherwise they are free at once."""
        req = self.waiting_kv.pop(room)
        if status_code is not None:
            self.num_failed += 1
        address = self.peer_address(req)
        if tell_peer:
            self.channel.send(
                address, {"type": "abort", "room": room, "reply_to": self.channel.address}
            )
        if tell_peer and self.transfer.remote_writes:
            pool = self.s.req_to_token_pool
            slots = pool.req_to_token[req.req_pool_idx, : req.kv_allocated_len].to(torch.int64)
            self.quarantine[room] = (slots.clone(), address, time.monotonic())
            pool.free(req.req_pool_idx)
            req.req_pool_idx = None
        else:
            self.s.tree_cache.cache_finished_req(req, is_insert=False)
        self.s._finish_queued_abort(req, message, status_code=status_code)

    def _release_quarantine(self, room: int) -> None:
        slots, _, _ = self.quarantine.pop(room)
        self.s.allocator.free(slots)
