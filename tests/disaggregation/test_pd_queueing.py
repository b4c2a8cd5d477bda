"""How each side of a P/D pair waits for the other, one scheduler driven step by step in this
process and its peer played by hand over a bare control channel: a decode server with more
requests than KV slots queues them as one server would (its prefill peer is told each room is
queued, the KV timeout counts from the reservation), a prefill server refuses at once a
copy whose decode server's KV layout it already refused, and a first token the decode model
cannot embed fails its request, not the decode server."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from rs_testing import SchedulerHarness, make_tiny_served_model

from radixserve.disaggregation.channel import ControlChannel
from radixserve.disaggregation.side import prompt_fingerprint
from radixserve.disaggregation.transfer import TransferError
from radixserve.io_struct import TokenizedGenerateReqInput
from radixserve.sampling_params import SamplingParams
from radixserve.utils import free_port

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_served_model(str(tmp_path_factory.mktemp("pd_queueing")))


def _submit(h: SchedulerHarness, rid: str, prompt: list[int], port: int, room: int) -> None:
    req = TokenizedGenerateReqInput(
        rid,
        None,
        prompt,
        SamplingParams(max_new_tokens=4, temperature=0),
        bootstrap_host="127.0.0.1",
        bootstrap_port=port,
        bootstrap_room=room,
    )
    h.scheduler.process_input_requests([req])


class Peer:
    """The other side, by hand: collects what arrives, answers pings."""

    def __init__(self, port: int = 0) -> None:
        self.channel = ControlChannel("127.0.0.1", port, "127.0.0.1")
        self.seen: list[dict[str, Any]] = []

    def drain(self) -> None:
        for msg in self.channel.recv_all():
            if msg.get("type") == "ping":
                pong = {"type": "pong", "from": msg["to"], "instance": "p"}
                self.channel.send(msg["reply_to"], pong)
            self.seen.append(msg)

    def find(self, kind: str, room: int) -> dict[str, Any] | None:
        return next((m for m in self.seen if m["type"] == kind and m.get("room") == room), None)


def _step_until(h: SchedulerHarness, peer: Peer, done: Any, what: str, limit: float = 20) -> None:
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, f"no {what}: {peer.seen} {h.finish_reasons()}"
        h.step()
        peer.drain()
        time.sleep(0.01)


def _step_for(h: SchedulerHarness, peer: Peer, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        h.step()
        peer.drain()
        time.sleep(0.01)


def _kv_payload(h: SchedulerHarness, n: int) -> torch.Tensor:
    """A fake-backend `done` payload for n tokens (zeros: the test checks the queueing)."""
    pool = h.scheduler.tp_worker.model_runner.token_to_kv_pool
    bufs = [*pool.k_buffer, *pool.v_buffer]
    return torch.zeros((len(bufs), n, *bufs[0].shape[1:]), dtype=bufs[0].dtype).view(torch.uint8)


def _decode_harness(model: str, timeout: float) -> SchedulerHarness:
    return SchedulerHarness(
        model_path=model,
        max_total_tokens=512,  # one 300-token prompt at a time
        disable_overlap_schedule=True,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="fake",
        disaggregation_timeout=timeout,
    )


def test_a_decode_server_queues_for_slots_and_times_the_kv_from_the_reservation(model):
    """Two requests in a pool that holds one: the second waited for slots on the deadline set
    at its arrival, the same that then covered its KV, and failed with 503 ("no KV arrived")
    where a single server would have queued and served it. Now each room is announced to the
    prefill server on arrival (`queued`, with the pool layout), and the KV timeout counts
    from the reservation."""
    timeout = 2.0
    peer = Peer()
    h = _decode_harness(model, timeout)
    try:
        _submit(h, "a", list(range(5, 305)), peer.channel.port, 1)
        _submit(h, "b", list(range(6, 306)), peer.channel.port, 2)
        _step_until(h, peer, lambda: peer.find("queued", 2) and peer.find("reserve", 1), "queue")
        queued = peer.find("queued", 1)
        assert queued["layout"] == h.scheduler.disagg.layout.__dict__
        reply_to = queued["reply_to"]
        assert reply_to == h.scheduler.disagg.channel.address
        done = {"type": "done", "token": 7, "cached_tokens": 0, "payload": _kv_payload(h, 300)}
        # Each KV comes 0.7 × the timeout after its reservation: the second's, 1.4 × the
        # timeout after it arrived.
        _step_for(h, peer, 0.7 * timeout)
        assert peer.find("reserve", 2) is None  # queued for slots
        peer.channel.send(reply_to, {**done, "room": 1})
        _step_until(h, peer, lambda: peer.find("reserve", 2), "second reservation")
        _step_for(h, peer, 0.7 * timeout)
        assert "b" not in h.finish_reasons(), h.finish_reasons()
        peer.channel.send(reply_to, {**done, "room": 2})
        _step_until(h, peer, lambda: "b" in h.finish_reasons(), "second request's end")
        reasons = h.finish_reasons()
        assert [reasons[r]["type"] for r in "ab"] == ["length", "length"], reasons
        h.run_until_idle()
        h.scheduler.assert_drained()
    finally:
        peer.channel.close()
        h.scheduler.disagg.close()


def test_a_decode_request_queued_behind_a_slow_one_waits_past_the_timeout(model):
    """The first request's KV never comes: it fails --disaggregation-timeout after its
    reservation, while the second waited as long for slots (that was a 503, "no room in the
    KV cache", on a live pair); the second then reserves and has a timeout of its own."""
    peer = Peer()
    h = _decode_harness(model, TIMEOUT_S)
    try:
        _submit(h, "a", list(range(5, 305)), peer.channel.port, 1)
        _submit(h, "b", list(range(6, 306)), peer.channel.port, 2)
        _step_until(h, peer, lambda: peer.find("reserve", 1), "reservation")
        _step_until(h, peer, lambda: "a" in h.finish_reasons(), "first request's timeout")
        assert "no KV arrived" in h.finish_reasons()["a"]["message"]
        _step_until(h, peer, lambda: peer.find("reserve", 2), "second reservation")
        assert "b" not in h.finish_reasons()
        reserved = time.monotonic()
        _step_until(h, peer, lambda: "b" in h.finish_reasons(), "second request's timeout")
        assert time.monotonic() - reserved > TIMEOUT_S * 0.8
        assert "no KV arrived" in h.finish_reasons()["b"]["message"]
        h.run_until_idle()
        h.scheduler.assert_drained()
    finally:
        peer.channel.close()
        h.scheduler.disagg.close()


def _prefill_harness(model: str, timeout: float = TIMEOUT_S) -> tuple[SchedulerHarness, int]:
    port = free_port()
    h = SchedulerHarness(
        model_path=model,
        max_total_tokens=1024,
        disable_overlap_schedule=True,
        disaggregation_mode="prefill",
        disaggregation_bootstrap_port=port,
        disaggregation_transfer_backend="fake",
        disaggregation_timeout=timeout,
    )
    return h, port


def test_a_prefill_copy_queued_on_a_live_decode_server_waits_for_its_reservation(model):
    """The decode server announced the room (`queued`) and pings: the prefill copy outlives
    --disaggregation-timeout and runs once the reservation comes (it expired: "no decode
    server reserved"). Without pings it fails, naming the decode server that went quiet; a
    room announced whose copy never comes here is answered `failed` after the timeout."""
    h, port = _prefill_harness(model)
    decode = Peer()
    address = f"tcp://127.0.0.1:{port}"
    try:
        layout = h.scheduler.disagg.layout.__dict__
        me = decode.channel.address
        prompt = list(range(5, 45))
        for rid, room in (("a", 1), ("b", 2), (None, 4)):  # room 4's copy never comes
            if rid is not None:
                _submit(h, rid, prompt, port, room)
            decode.channel.send(
                address, {"type": "queued", "room": room, "reply_to": me, "layout": layout}
            )
        end = time.monotonic() + 3 * TIMEOUT_S
        while time.monotonic() < end:  # pings from the decode side, then silence
            decode.channel.send(address, {"type": "ping", "reply_to": me, "to": address})
            _step_for(h, decode, 0.1)
        assert h.finish_reasons() == {}
        never = decode.find("failed", 4)  # the decode side stops waiting for room 4
        assert never is not None and "never received" in never["error"], decode.seen
        decode.channel.send(
            address,
            {
                "type": "reserve",
                "room": 1,
                "rid": "a",
                "reply_to": me,
                "slots": list(range(len(prompt))),
                "layout": layout,
                "desc": {},
                "prompt": prompt_fingerprint(prompt),
            },
        )
        _step_until(h, decode, lambda: decode.find("done", 1), "transfer")
        _step_until(h, decode, lambda: "b" in h.finish_reasons(), "expiry")
        reason = h.finish_reasons()["b"]
        assert reason["status_code"] == 503 and "has not pinged" in reason["message"], reason
        _step_until(h, decode, lambda: decode.find("failed", 2), "failed")  # told, if it listens
        assert h.finish_reasons()["a"]["type"] == "length"
        h.run_until_idle()
        h.scheduler.assert_drained()
    finally:
        decode.channel.close()
        h.scheduler.disagg.close()


@pytest.mark.parametrize("kind", ["reserve", "queued"])
@pytest.mark.parametrize(
    "differs,match",
    [
        ({"page_size": 16}, "page_size 16 vs 1"),
        # a decode model with fewer tokens crashed on a first token it had no embedding for
        ({"vocab_size": 280}, "vocab_size 280 vs "),
        # crossed backends: the KV never written (fake → mooncake) or a misleading 503
        ({"transfer_backend": "mooncake"}, "transfer backends differ: decode mooncake vs prefill"),
        # another model of the same shapes: its tokens were neither server's
        ({"model": "0" * 16}, "run different models (fingerprint decode 0000000000000000"),
    ],
)
def test_a_refused_layout_refuses_the_prefill_copy_that_comes_after_it(model, kind, differs, match):
    """The decode server's message (its reservation, or its announcement) with another page
    size, vocabulary or transfer backend reaches the prefill server before the prefill copy of
    the request: the decode side is answered `failed` at once, and so now is the copy (400,
    the mismatch), which waited the whole timeout for a 503 that blamed a missing decode
    server. Nothing was tried: the decode server is not taken for a failed one."""
    h, port = _prefill_harness(model)
    decode = Peer()
    address = f"tcp://127.0.0.1:{port}"
    try:
        layout = {**h.scheduler.disagg.layout.__dict__, **differs}
        prompt = list(range(5, 45))
        msg = {"type": kind, "room": 3, "reply_to": decode.channel.address, "layout": layout}
        if kind == "reserve":
            msg.update(rid="a", slots=list(range(len(prompt))), desc={})
            msg.update(prompt=prompt_fingerprint(prompt))
        decode.channel.send(address, msg)
        _step_until(h, decode, lambda: decode.find("failed", 3), "refusal")
        assert match in decode.find("failed", 3)["error"]
        _submit(h, "a", prompt, port, 3)
        h.step()
        reason = h.finish_reasons().get("a")
        assert reason is not None, "the copy waits for a reservation already refused"
        assert reason["status_code"] == 400 and match in reason["message"]
        assert h.scheduler.disagg.failed_peers == {}
        # The room is forgotten once used: a later copy on it pairs as ever.
        assert 3 not in h.scheduler.disagg.refused
        h.run_until_idle()
        h.scheduler.assert_drained()
    finally:
        decode.channel.close()
        h.scheduler.disagg.close()


@pytest.mark.parametrize("adapter", ["lora:a:0123456789abcdef", None])
def test_copies_served_with_different_adapters_are_refused_not_paired(model, adapter):
    """The decode server served its copy with adapter a (or with a's other files, mid-way
    through a rolling reload), this one with the base model: they paired, and the decode side
    continued this side's KV under other weights, a 200 with tokens neither would give."""
    h, port = _prefill_harness(model)
    decode = Peer()
    try:
        prompt = list(range(5, 45))
        reserve = {
            "type": "reserve",
            "room": 5,
            "rid": "a",
            "reply_to": decode.channel.address,
            "slots": list(range(len(prompt))),
            "layout": h.scheduler.disagg.layout.__dict__,
            "desc": {},
            "prompt": prompt_fingerprint(prompt),
            "adapter": adapter,
        }
        decode.channel.send(f"tcp://127.0.0.1:{port}", reserve)
        req = TokenizedGenerateReqInput(
            "a",
            None,
            prompt,
            SamplingParams(max_new_tokens=4, temperature=0),
            bootstrap_host="127.0.0.1",
            bootstrap_port=port,
            bootstrap_room=5,
            extra_key=None if adapter is not None else "lora:a:fedcba9876543210",
        )
        h.scheduler.process_input_requests([req])
        _step_until(h, decode, lambda: "a" in h.finish_reasons(), "refusal")
        reason = h.finish_reasons()["a"]
        assert reason["status_code"] == 400, reason
        assert "LoRA adapter 'a'" in reason["message"] and "base model" in reason["message"]
        _step_until(h, decode, lambda: decode.find("failed", 5), "the decode side told")
        assert "LoRA adapter 'a'" in decode.find("failed", 5)["error"]
        h.run_until_idle()
        h.scheduler.assert_drained()
    finally:
        decode.channel.close()
        h.scheduler.disagg.close()


def test_a_first_token_outside_the_vocabulary_fails_its_request_not_the_server(model):
    """A `done` whose token the decode model has no embedding for (a prefill model with a
    bigger vocabulary) was appended as it came: the next decode step's IndexError ended the
    whole decode server. Now that request fails (503, naming the token) and the server goes
    on serving."""
    peer = Peer()
    h = _decode_harness(model, 20.0)
    try:
        vocab_size = h.scheduler.model_config.vocab_size
        prompt = list(range(5, 45))
        done = {"type": "done", "cached_tokens": 0, "payload": _kv_payload(h, len(prompt))}
        for rid, room, token in (("a", 1, vocab_size + 38), ("b", 2, 7)):
            _submit(h, rid, prompt, peer.channel.port, room)
            _step_until(h, peer, lambda r=room: peer.find("reserve", r), "reservation")
            reply_to = peer.find("reserve", room)["reply_to"]
            peer.channel.send(reply_to, {**done, "room": room, "token": token})
            _step_until(h, peer, lambda r=rid: r in h.finish_reasons(), "end")
        reasons = h.finish_reasons()
        assert reasons["a"]["status_code"] == 503, reasons
        assert f"first token {vocab_size + 38} is outside" in reasons["a"]["message"]
        assert reasons["b"]["type"] == "length", reasons
        h.run_until_idle()
        h.scheduler.assert_drained()
    finally:
        peer.channel.close()
        h.scheduler.disagg.close()


class HungWrites:
    """A transfer backend whose writes of `hung` tokens (one room's) hang until `release` (a
    decode host stopped mid-write: Mooncake's TCP timeout, ~30 s), then fail; others go through."""

    def __init__(self, side: Any, hung: int) -> None:
        self.real, self.hung = side.transfer.send, hung
        self.release = threading.Event()
        self.tried: list[int] = []  # each write's token count
        side.transfer.send = self.send

    def send(self, desc: dict[str, Any], src: list[int], dst: list[int]) -> Any:
        self.tried.append(len(src))
        if len(src) == self.hung:
            self.release.wait(30)
            raise TransferError("Mooncake's write to the decode host timed out")
        return self.real(desc, src, dst)


def _reserve_from(h: SchedulerHarness, decode: Peer, port: int, rooms: dict[int, int]) -> None:
    """Each room's prompt (that many tokens) arrives here, reserved by the decode peer."""
    for room, n in rooms.items():
        prompt = list(range(room, room + n))
        _submit(h, f"r{room}", prompt, port, room)
        reserve = {
            "type": "reserve",
            "room": room,
            "rid": f"r{room}",
            "reply_to": decode.channel.address,
            "slots": list(range(n)),
            "layout": h.scheduler.disagg.layout.__dict__,
            "desc": {},
            "prompt": prompt_fingerprint(prompt),
        }
        decode.channel.send(f"tcp://127.0.0.1:{port}", reserve)


@contextlib.contextmanager
def _prefill_with_hung_writes(model: str, *peers: Peer, **harness: Any) -> Iterator[Any]:
    """A prefill harness whose 40-token writes hang (HungWrites): (harness, port, writes).
    It ends drained; its peers and its side are closed whatever happens."""
    h, port = _prefill_harness(model, **harness)
    writes = HungWrites(h.scheduler.disagg, hung=40)
    try:
        yield h, port, writes
        h.run_until_idle()
        h.scheduler.assert_drained()
    finally:
        writes.release.set()
        for peer in peers:
            peer.channel.close()
        h.scheduler.disagg.close()


def test_transfers_queued_behind_a_hung_write_end_at_the_decode_side_deadline(model):
    """A decode host stopped after it reserved: the one transfer thread hung in the first write,
    and the transfers queued behind it held their prompt's KV (3 × 3000 tokens in the report)
    until it failed, then each tried another hung write. Now each queued transfer ends once its
    reservation is older than --disaggregation-timeout (the decode side has given up on it):
    its KV freed, the decode side told `failed`; no write but the hung one is tried."""
    decode = Peer()  # never pings: stopped
    with _prefill_with_hung_writes(model, decode) as (h, port, writes):
        side = h.scheduler.disagg
        _reserve_from(h, decode, port, {1: 40, 2: 41, 3: 42})
        _step_until(h, decode, lambda: writes.tried, "first write")
        _step_until(
            h, decode, lambda: decode.find("failed", 2) and decode.find("failed", 3), "expiry", 4
        )
        assert "deadline" in decode.find("failed", 3)["error"]
        assert [r.bootstrap_room for r, _ in side.sending] == [1]  # their KV is back
        assert writes.tried == [40]
        writes.release.set()
        _step_until(h, decode, lambda: decode.find("failed", 1), "hung write's failure")
        assert writes.tried == [40]
        assert side.num_failed == 3 and side.num_transferred == 0
        assert {r: h.finish_reasons()[f"r{r}"]["type"] for r in (1, 2, 3)} == dict.fromkeys(
            (1, 2, 3), "length"
        )  # (the first token was answered here before the transfer)


def test_a_failed_write_stops_the_next_queued_one_to_a_silent_decode_server(model):
    """The failure was recorded by the scheduler loop after the transfer thread had already
    started the next queued transfer to the same hung host (one more ~30 s write each). It is
    recorded on the transfer thread now: the next one waits PING_WAIT_S for a sign of life and
    is not tried, nor is the one after; the server, heard from again, is tried again."""
    decode = Peer()
    # (a 30 s timeout: no deadline passes here)
    with _prefill_with_hung_writes(model, decode, timeout=30.0) as (h, port, writes):
        side, address = h.scheduler.disagg, f"tcp://127.0.0.1:{port}"
        _reserve_from(h, decode, port, {1: 40, 2: 41, 3: 42})
        _step_until(h, decode, lambda: len(side.sending) == 3, "three queued transfers")
        writes.release.set()
        ended = [lambda r=r: decode.find("failed", r) or decode.find("done", r) for r in (1, 2, 3)]
        _step_until(h, decode, lambda: all(e() for e in ended), "ends")
        assert writes.tried == [40], writes.tried  # (was [40, 41, 42]: each one tried)
        assert "has not answered" in decode.find("failed", 3)["error"]
        assert decode.channel.address in side.failed_peers
        me = decode.channel.address
        decode.channel.send(address, {"type": "ping", "reply_to": me, "to": address})
        _reserve_from(h, decode, port, {4: 43})
        _step_until(h, decode, lambda: decode.find("done", 4), "transfer")
        assert writes.tried == [40, 43] and side.failed_peers == {}


def test_a_hung_decode_host_stalls_no_other_decode_servers_transfers(model):
    """One transfer thread served every decode server: another one's KV waited behind the hung
    host's write (~30 s), and failed at its own deadline. Each decode server has its own now."""
    hung, live = Peer(), Peer()
    with _prefill_with_hung_writes(model, hung, live) as (h, port, writes):
        side = h.scheduler.disagg
        _reserve_from(h, hung, port, {1: 40})
        _step_until(h, hung, lambda: writes.tried, "hung write")
        _reserve_from(h, live, port, {2: 41})
        _step_until(h, live, lambda: live.find("done", 2) or live.find("failed", 2), "transfer")
        assert live.find("done", 2) is not None, live.find("failed", 2)
        assert [r.bootstrap_room for r, _ in side.sending] == [1]  # still hung
        writes.release.set()
        _step_until(h, hung, lambda: hung.find("failed", 1), "hung write's failure")
        assert writes.tried == [40, 41] and side.num_transferred == 1
    assert side.pools == {}  # (each peer's thread ended with its last transfer)
