"""The control channel between a prefill and a decode scheduler: small pickled dicts over ZMQ.

Each side binds one inbound PULL socket (the prefill side's on its bootstrap port: that is its
bootstrap server; the decode side's on a free port it names in every message as `reply_to`)
and keeps one outbound PUSH socket per peer address. Nothing blocks: `recv_all` drains what
has arrived, `send` queues (a peer that went away is found by the decode side's pings, never
by a blocked send).

Messages (`type` and the fields it carries):
  decode → prefill  reserve  room, rid, reply_to, slots, layout, desc (backend descriptor)
                    abort    room, reply_to
                    ping     reply_to
  prefill → decode  done     room, token, logprob, top_logprobs, cached_tokens, payload
                    failed   room, error
                    pong
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

SEND_HWM = 10000


class ControlChannel:
    def __init__(self, bind_host: str, port: int, advertised_host: str) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context(1)
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

    def connect(self, address: str) -> Any:
        """The outbound socket to `address`, connected on first use (ZMQ connects in the
        background: an unreachable peer is found by pings). ValueError where ZMQ refuses the
        address itself."""
        zmq = self._zmq
        sock = self.peers.get(address)
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
            self.peers[address] = sock
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
        for sock in self.peers.values():
            sock.close()
        self.inbound.close()
        self.ctx.term()
