"""The control channel between a prefill and a decode scheduler: small JSON dicts over ZMQ.

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

A message is one JSON frame, and a second of raw bytes where it carries a KV payload (the fake
backend's `done`). Never pickle: the bootstrap port listens on the network, and an unpickled
message runs whatever code its sender put in it. Each message is checked against its type's
fields (`FIELDS`) before the scheduler reads it; one that does not match is logged and dropped
(a `reserve` without its fields ended the scheduler with a KeyError).

Messages (`type` and the fields it carries):
  decode → prefill  queued   room, reply_to, layout
                    reserve  room, rid, prompt, adapter, reply_to, slots, layout, desc (backend
                             descriptor)
                    abort    room, reply_to
                    ping     reply_to
  prefill → decode  done     room, token, logprob, top_logprobs, input_logprobs, cached_tokens,
                             payload
                    failed   room, error
                    pong     from (the address pinged), instance (this process's: a restarted
                             prefill server answers with another)
"""

from __future__ import annotations

import json
import logging
import math
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

SEND_HWM = 10000
PING_THREAD_POLL_MS = 100  # how soon the ping thread sees close()


# -- what each message must hold -------------------------------------------------------------
def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{v!r} is not an integer")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{v!r} is not a string")
    return v


def _dict(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError(f"{v!r} is not an object")
    return v


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`check`, or None: also where the field is missing."""

    def checked(v: Any) -> Any:
        return None if v is None else check(v)

    checked.optional = True  # type: ignore[attr-defined]
    return checked


def _list_of(check: Callable[[Any], Any]) -> Callable[[Any], list[Any]]:
    def checked(v: Any) -> list[Any]:
        if not isinstance(v, list):
            raise ValueError(f"{v!r} is not a list")
        return [check(x) for x in v]

    return checked


def _logprob(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{v!r} is not a logprob")
    return float(v)


def _pair(v: Any) -> tuple[float | None, int]:
    """(logprob, token id), as Req keeps them (JSON made the tuple a list); a prompt's first
    token has no logprob."""
    if not isinstance(v, list) or len(v) != 2:
        raise ValueError(f"{v!r} is not a (logprob, token) pair")
    return _optional(_logprob)(v[0]), _int(v[1])


_pairs = _list_of(_pair)


def _input_logprobs(v: Any) -> tuple[list[Any], list[Any]]:
    if not isinstance(v, list) or len(v) != 2:
        raise ValueError("input_logprobs is not (token logprobs, top logprobs)")
    return _pairs(v[0]), _list_of(_optional(_pairs))(v[1])


FIELDS: dict[str, dict[str, Callable[[Any], Any]]] = {
    "queued": {"room": _int, "reply_to": _str, "layout": _dict},
    "reserve": {
        "room": _int,
        "rid": _str,
        "prompt": _str,
        "adapter": _optional(_str),
        "reply_to": _str,
        "slots": _list_of(_int),
        "layout": _dict,
        "desc": _dict,
    },
    "abort": {"room": _int, "reply_to": _str},
    "ping": {"reply_to": _str, "to": _str},
    "done": {
        "room": _int,
        "token": _int,
        "logprob": _optional(_logprob),
        "top_logprobs": _optional(_pairs),
        "input_logprobs": _optional(_input_logprobs),
        "cached_tokens": _int,
        "payload": _optional(lambda v: v),  # (a tensor, from its own frame)
    },
    "failed": {"room": _int, "error": _str},
    "pong": {"from": _optional(_str), "instance": _str},
}


def encode_message(msg: dict[str, Any]) -> list[bytes]:
    """A message's frames: its JSON, then its payload tensor's bytes where it has one."""
    payload = msg.get("payload")
    if not isinstance(payload, torch.Tensor):
        return [json.dumps(msg).encode()]
    header = {**msg, "payload": {"shape": list(payload.shape)}}
    data = payload.contiguous().view(torch.uint8).numpy().tobytes()
    return [json.dumps(header).encode(), data]


def decode_message(frames: list[bytes]) -> dict[str, Any]:
    """The message in `frames`, its fields checked against its type's (and only those kept);
    ValueError where it is not one this channel sends."""
    try:
        msg = json.loads(frames[0])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(msg, dict) or msg.get("type") not in FIELDS:
        raise ValueError("not a message of a known type")
    out: dict[str, Any] = {"type": msg["type"]}
    for name, check in FIELDS[msg["type"]].items():
        if name not in msg and not getattr(check, "optional", False):
            raise ValueError(f"a {msg['type']} message without {name!r}")
        try:
            out[name] = check(msg.get(name))
        except ValueError as e:
            raise ValueError(f"{msg['type']}.{name}: {e}") from None
    if out["type"] == "done":
        out["payload"] = _payload(out["payload"], frames[1:])
    return out


def _payload(header: Any, frames: list[bytes]) -> torch.Tensor | None:
    if header is None and not frames:
        return None
    shape = header.get("shape") if isinstance(header, dict) else None
    if len(frames) != 1 or not isinstance(shape, list):
        raise ValueError("done.payload: not a shape and one frame of bytes")
    shape = [_int(n) for n in shape]
    if any(n < 0 for n in shape) or math.prod(shape) != len(frames[0]):
        raise ValueError(f"done.payload: shape {shape} does not hold {len(frames[0])} bytes")
    return torch.frombuffer(bytearray(frames[0]), dtype=torch.uint8).reshape(shape)


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
                frames = bound.recv_multipart()
                try:
                    msg = decode_message(frames[:1]) if len(frames) == 1 else None
                except ValueError:  # unreadable: the loop's recv_all logs and drops it
                    msg = None
                if msg is not None and msg["type"] == "ping":
                    self._pong(replies, msg)
                forward.send_multipart(frames)
        except zmq.ZMQError:  # the context is ending
            pass
        finally:
            for sock in replies.values():
                sock.close()
            bound.close()
            forward.close()

    def _pong(self, replies: dict[str, Any], ping: dict[str, Any]) -> None:
        zmq = self._zmq
        try:
            sock = self._outbound(replies, ping["reply_to"])
        except ValueError:
            return
        pong = {"type": "pong", "from": ping["to"], "instance": self.instance}
        try:
            sock.send_multipart(encode_message(pong), flags=zmq.NOBLOCK)
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
            sock.send_multipart(encode_message(msg), flags=zmq.NOBLOCK)
        except zmq.Again:  # the peer is gone and its queue is full; its pings will tell
            logger.warning("dropped a %s message to %s (queue full)", msg.get("type"), address)

    def recv_all(self) -> list[dict[str, Any]]:
        zmq = self._zmq
        msgs = []
        while True:
            try:
                frames = self.inbound.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return msgs
            try:
                msgs.append(decode_message(frames))
            except ValueError as e:  # a malformed message must not take the scheduler down
                logger.warning("dropped an unreadable disaggregation message: %s", e)

    def close(self) -> None:
        if self._ping_thread is not None:
            self._stop.set()
            self._ping_thread.join()
        for sock in self.peers.values():
            sock.close()
        self.inbound.close()
        self.ctx.term()
