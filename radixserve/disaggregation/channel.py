"""The control channel between a prefill and a decode scheduler: small pickled dicts over ZMQ.

Each side binds one inbound PULL socket (the prefill side's on its bootstrap port: that is its
bootstrap server; the decode side's on a free port it names in every message as `reply_to`)
and keeps one outbound PUSH socket per peer address. Nothing blocks: `recv_all` drains what
has arrived, `send` queues (a peer that went away is found by the decode side's pings, never
by a blocked send).

The prefill side answers pings on a thread of its own (`answer_pings`): answered by its
scheduler loop, between forwards, one long forward or a starved CPU went unanswered for
seconds and the decode side took a live server for dead. The thread owns the bound socket,
answers each ping at once and passes every message (pings too) on to the loop through an
in-process socket, `inbound`, which the loop reads and polls as before.

Messages (`type` and the fields it carries):
  decode → prefill  reserve  room, rid, reply_to, slots, layout, desc (backend descriptor)
                    abort    room, reply_to
                    ping     reply_to
  prefill → decode  done     room, token, logprob, top_logprobs, cached_tokens, payload
                    failed   room, error
                    pong     from (the address pinged), instance (this process's: a restarted
                             prefill server answers with another)
"""

from __future__ import annotations

import logging
import pickle
import threading
import uuid
from typing import Any

logger = logging.getLogger(__name__)

SEND_HWM = 10000
PING_THREAD_POLL_MS = 100  # how soon the ping thread sees close()


class ControlChannel:
    def __init__(
        self, bind_host: str, port: int, advertised_host: str, answer_pings: bool = False
    ) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context(1)
        self.instance = uuid.uuid4().hex
        self.inbound = self.ctx.socket(zmq.PULL)
        self.inbound.setsockopt(zmq.LINGER, 0)
        host = "*" if bind_host in ("0.0.0.0", "::", "") else bind_host
        try:
            if port:
                self.inbound.bind(f"tcp://{host}:{port}")
            else:
                port = self.inbound.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            self.inbound.close()
            raise RuntimeError(
                f"cannot bind the disaggregation channel on {host}:{port}: {e} (is the "
                "bootstrap port in use? pick another with --disaggregation-bootstrap-port)"
            ) from None
        self.port = port
        self.address = f"tcp://{advertised_host}:{port}"
        self.peers: dict[str, Any] = {}
        self._ping_thread: threading.Thread | None = None
        if answer_pings:
            self._start_ping_thread()

    def _start_ping_thread(self) -> None:
        zmq = self._zmq
        bound, self.inbound = self.inbound, self.ctx.socket(zmq.PULL)
        self.inbound.setsockopt(zmq.LINGER, 0)
        inproc = f"inproc://disagg-loop-{self.instance}"
        self.inbound.bind(inproc)
        forward = self.ctx.socket(zmq.PUSH)
        forward.setsockopt(zmq.LINGER, 0)
        forward.connect(inproc)
        self._stop = threading.Event()
        self._ping_thread = threading.Thread(
            target=self._answer_pings, args=(bound, forward), name="disagg-pings", daemon=True
        )
        self._ping_thread.start()

    def _answer_pings(self, bound: Any, forward: Any) -> None:
        """The ping thread: pong each ping at once (its own outbound sockets: ZMQ sockets are
        not shared between threads), pass every message on to the loop."""
        zmq = self._zmq
        replies: dict[str, Any] = {}
        try:
            while not self._stop.is_set():
                if not bound.poll(PING_THREAD_POLL_MS):
                    continue
                raw = bound.recv()
                try:
                    msg = pickle.loads(raw)
                except Exception:  # unreadable: the loop's recv_all logs and drops it
                    msg = None
                if isinstance(msg, dict) and msg.get("type") == "ping":
                    self._pong(replies, msg)
                forward.send(raw)
        except zmq.ZMQError:  # the context is ending
            pass
        finally:
            for sock in replies.values():
                sock.close()
            bound.close()
            forward.close()

    def _pong(self, replies: dict[str, Any], ping: dict[str, Any]) -> None:
        zmq = self._zmq
        address = ping.get("reply_to")
        if not isinstance(address, str):
            return
        try:
            sock = self._outbound(replies, address)
        except ValueError:
            return
        pong = {"type": "pong", "from": ping.get("to"), "instance": self.instance}
        try:
            sock.send_pyobj(pong, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # the pinging side is gone

    def connect(self, address: str) -> Any:
        """The outbound socket to `address`, connected on first use (ZMQ connects in the
        background: an unreachable peer is found by pings). ValueError where ZMQ refuses the
        address itself."""
        return self._outbound(self.peers, address)

    def _outbound(self, sockets: dict[str, Any], address: str) -> Any:
        """`sockets[address]`, made and connected first if missing (each thread keeps its own
        dict: ZMQ sockets are not shared between threads)."""
        zmq = self._zmq
        sock = sockets.get(address)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.IPV6, 1)
            try:
                sock.connect(address)
            except zmq.ZMQError as e:
                sock.close()
                raise ValueError(f"cannot connect to {address}: {e}") from None
            sockets[address] = sock
        return sock

    def send(self, address: str, msg: dict[str, Any]) -> None:
        zmq = self._zmq
        sock = self.connect(address)
        try:
            sock.send_pyobj(msg, flags=zmq.NOBLOCK)
        except zmq.Again:  # the peer is gone and its queue is full; its pings will tell
            logger.warning("dropped a %s message to %s (queue full)", msg.get("type"), address)

    def recv_all(self) -> list[dict[str, Any]]:
        zmq = self._zmq
        msgs = []
        while True:
            try:
                msgs.append(self.inbound.recv_pyobj(flags=zmq.NOBLOCK))
            except zmq.Again:
                return msgs
            except Exception as e:  # a malformed message must not take the scheduler down
                logger.warning("dropped an unreadable disaggregation message: %r", e)

    def close(self) -> None:
        if self._ping_thread is not None:
            self._stop.set()
            self._ping_thread.join()
        for sock in self.peers.values():
            sock.close()
        self.inbound.close()
        self.ctx.term()
