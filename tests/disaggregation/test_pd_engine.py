"""P/D disaggregation through two offline Engines (a prefill one and a decode one, each with its
real scheduler process) and the `fake` transfer backend, which needs no extra package: every
request is sent to both with the same bootstrap room, as SGLang's router does, and the decode
engine's answers are transformers' greedy tokens — with chunked prefill and the radix cache on
the prefill side (a second wave is served from it), a first token that already ends the
request, and both engines' pools drained afterwards. Plus the transfer backends' own pieces."""

from __future__ import annotations

import concurrent.futures
import json
import random
import shutil
import threading
import time
from typing import Any

import pytest
import torch
from rs_testing import make_tiny_served_model, reference_greedy

from radixserve.disaggregation.channel import decode_message, encode_message
from radixserve.disaggregation.transfer import (
    FakeTransfer,
    KVLayout,
    MooncakeTransfer,
    contiguous_runs,
)
from radixserve.mem_cache.memory_pool import MHATokenToKVPool
from radixserve.utils import free_port

NEW_TOKENS = 10
LENGTHS = [5, 150, 17, 40, 9, 300]  # 150 and 300 take several 64-token chunks


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_served_model(str(tmp_path_factory.mktemp("pd_engine")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(model, prompts) -> list[list[int]]:
    return reference_greedy(model, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def engines(model):
    from radixserve import Engine

    port = free_port()
    common: dict[str, Any] = {
        "model_path": model,
        "dtype": "float32",
        "max_total_tokens": 4096,
        "enable_integrity_checks": True,
        "disaggregation_transfer_backend": "fake",
        "disaggregation_timeout": 20.0,
    }
    # One torch thread on this 2-CPU machine turns the overlap loop on (the HTTP tests run the
    # normal loop): prefill requests must not decode, arrivals join a batch in flight.
    prefill = Engine(
        disaggregation_mode="prefill",
        disaggregation_bootstrap_port=port,
        chunked_prefill_size=64,
        num_threads=1,
        **common,
    )
    try:
        decode = Engine(disaggregation_mode="decode", num_threads=1, **common)
    except BaseException:
        prefill.shutdown()
        raise
    yield prefill, decode, port
    decode.shutdown()
    prefill.shutdown()


def _pd_generate(engines, prompts, params, rooms) -> list[dict[str, Any]]:
    """Send the batch to both engines at once; the decode engine's answers."""
    prefill, decode, port = engines
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": rooms}
    out: dict[str, Any] = {}

    def run(name: str, engine: Any) -> None:
        out[name] = engine.generate(input_ids=prompts, sampling_params=params, **pd)

    threads = [threading.Thread(target=run, args=x) for x in (("p", prefill), ("d", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(out) == {"p", "d"}
    assert all(len(o["output_ids"]) == 1 for o in out["p"])  # the prefill side stops at one
    return out["d"]


def test_both_engines_run_the_overlap_loop(engines):
    for engine in engines[:2]:
        assert engine.procs.scheduler_info["overlap"] is True


def _assert_drained(engine: Any) -> None:
    info = engine.get_server_info()
    assert info["available_tokens"] + info["evictable_tokens"] == info["max_total_num_tokens"]
    assert info["protected_tokens"] == 0 and info["running"] == 0


def test_decode_engine_gives_greedy_tokens_and_reuses_the_prefill_cache(
    engines, prompts, reference
):
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0}
    first = _pd_generate(engines, prompts, params, list(range(100, 100 + len(prompts))))
    assert [o["output_ids"] for o in first] == reference
    second = _pd_generate(engines, prompts, params, list(range(200, 200 + len(prompts))))
    assert [o["output_ids"] for o in second] == reference
    # the second wave's prompts were cached on the prefill server (all but the last token)
    assert [o["meta_info"]["cached_tokens"] for o in second] == [n - 1 for n in LENGTHS]
    prefill, decode, _ = engines
    assert decode.get_server_info()["disaggregation"]["transferred"] == 2 * len(prompts)
    for engine in (prefill, decode):
        _assert_drained(engine)


def test_a_first_token_that_ends_the_request(engines, prompts, reference):
    one = _pd_generate(engines, prompts[:2], {"max_new_tokens": 1, "temperature": 0}, [300, 301])
    assert [o["output_ids"] for o in one] == [r[:1] for r in reference[:2]]
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in one)
    stops = [{"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [r[0]]} for r in reference]
    stopped = _pd_generate(engines, prompts[:2], stops[:2], [302, 303])
    assert [o["output_ids"] for o in stopped] == [r[:1] for r in reference[:2]]
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in stopped)
    for engine in engines[:2]:
        _assert_drained(engine)


def test_two_prompts_on_one_room_are_refused_not_swapped(engines):
    """A client that reuses a bootstrap room sent prompt X to the prefill server and prompt Y
    (the same length) to the decode server: they paired, and Y's answer continued X's KV."""
    from radixserve.managers.request_checks import RequestError

    prefill, decode, port = engines
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 777}
    params = {"max_new_tokens": 4, "temperature": 0}
    errors: dict[str, str] = {}

    def run(name: str, engine: Any, prompt: list[int]) -> None:
        try:
            engine.generate(input_ids=prompt, sampling_params=params, **pd)
        except RequestError as e:
            errors[name] = f"{e.status_code} {e}"

    threads = [
        threading.Thread(target=run, args=("p", prefill, [7] * 20)),
        threading.Thread(target=run, args=("d", decode, [9] * 20)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(errors) == {"p", "d"}, errors
    assert errors["p"].startswith("400 ") and "pairs two different prompts" in errors["p"]
    assert "pairs two different prompts" in errors["d"]
    for engine in engines[:2]:
        _assert_drained(engine)


# -- the transfer backends ----------------------------------------------------------------------
@pytest.mark.parametrize("refusing", ["prefill", "decode"])
def test_a_copy_one_side_refuses_before_its_scheduler_fails_its_peer_at_once(
    engines, prompts, refusing
):
    """A 400 of one side's TokenizerManager (here an adapter only the other side would have;
    a prompt past one side's --context-length, its queue bound, a duplicate rid): the other
    side's copy waited out the timeout (the client behind the router waited as long)."""
    from radixserve.managers.tokenizer_manager import RequestError

    prefill, decode, port = engines
    room = {"prefill": 7001, "decode": 7002}[refusing]
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}
    params = {"max_new_tokens": 4, "temperature": 0}
    refuser, peer = (prefill, decode) if refusing == "prefill" else (decode, prefill)
    with pytest.raises(RequestError, match="LoRA"):
        refuser.generate(input_ids=prompts[0], sampling_params=params, lora_path="x", **pd)
    start = time.monotonic()
    try:  # (a decode copy fails; a prefill copy runs, its KV sent nowhere)
        peer.generate(input_ids=prompts[0], sampling_params=params, **pd)
        assert refusing == "decode"
    except RequestError:
        assert refusing == "prefill"
    assert time.monotonic() - start < 10  # (the timeout is 20 s)
    for engine in engines[:2]:
        _assert_drained(engine)


def test_contiguous_runs_coalesce_only_where_both_sides_advance_together():
    assert contiguous_runs([4, 5, 6, 9, 10], [1, 2, 3, 7, 9]) == [(4, 1, 3), (9, 7, 1), (10, 9, 1)]
    assert contiguous_runs([], []) == []


def test_a_layout_mismatch_is_named():
    layout = KVLayout(30, 3, 64, "torch.float32", 1, 49152, "fake", "0123456789abcdef")
    assert layout.mismatch(layout.__dict__) is None
    error = layout.mismatch({**layout.__dict__, "dtype": "torch.bfloat16"})
    assert error is not None and "dtype" in error and "same model" in error
    # A decode model with fewer tokens crashed on the first token it could not embed.
    error = layout.mismatch({**layout.__dict__, "vocab_size": 280})
    assert error is not None and "vocab_size 280 vs 49152" in error
    # With the backends crossed the KV was never written (fake → mooncake: wrong output) or
    # the write failed blaming the buffers (mooncake → fake).
    error = layout.mismatch({**layout.__dict__, "transfer_backend": "mooncake"})
    assert (
        error is not None and "transfer backends differ: decode mooncake vs prefill fake" in error
    )
    # Two models of the same shapes paired: the decode side continued the KV under its own.
    error = layout.mismatch({**layout.__dict__, "model": "fedcba9876543210"})
    assert error is not None and "run different models (fingerprint decode fedcba" in error


def test_the_model_fingerprint_follows_the_weights_not_where_they_are(model, tmp_path):
    """A copy of the model elsewhere (another machine's path) pairs; another model of the same
    shapes, or the same files under --quantization, does not."""
    from rs_testing import make_tiny_model_dir

    from radixserve.args import ServerArgs
    from radixserve.disaggregation.side import model_fingerprint

    args = ServerArgs(model_path=model)
    mine = model_fingerprint(args, model)
    copy = shutil.copytree(model, tmp_path / "copy")
    (copy / "README.txt").write_text("a file that is not the model's")
    assert model_fingerprint(args, str(copy)) == mine
    other = make_tiny_served_model(str(tmp_path / "other"))  # (the same seed: equal weights)
    make_tiny_model_dir(other, "llama", seed=1)
    assert model_fingerprint(args, other) != mine
    int8 = ServerArgs(model_path=model, quantization="w8a8_int8")
    assert model_fingerprint(int8, model) != mine


def _pools(dtype) -> tuple[MHATokenToKVPool, MHATokenToKVPool]:
    src = MHATokenToKVPool(64, 2, 2, 8, dtype)
    dst = MHATokenToKVPool(64, 2, 2, 8, dtype)
    for buf in (*src.k_buffer, *src.v_buffer):
        buf.copy_(torch.randn(buf.shape).to(dtype))
    return src, dst


def _check_moved(src, dst, from_slots, to_slots) -> None:
    for a, b in zip((*src.k_buffer, *src.v_buffer), (*dst.k_buffer, *dst.v_buffer), strict=True):
        a, b = a.view(torch.uint8), b.view(torch.uint8)  # bytes (fp8 has no comparisons)
        assert torch.equal(b[to_slots], a[from_slots])
        untouched = [i for i in range(b.shape[0]) if i not in to_slots]
        assert not b[untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("backend", ["fake", "mooncake"])
def test_a_backend_moves_exactly_the_slots_asked(backend, dtype):
    """Also a one-byte pool (--kv-cache-dtype fp8_*); the fake backend's payload crosses the
    control channel's encoding, as it does between the two schedulers."""
    if backend == "mooncake":
        try:
            from mooncake.engine import TransferEngine  # noqa: F401
        except Exception as e:
            pytest.skip(f"Mooncake's transfer engine does not load: {e!r}")
    cls = {"fake": FakeTransfer, "mooncake": MooncakeTransfer}[backend]
    src_pool, dst_pool = _pools(dtype)
    sender, receiver = cls(src_pool, "127.0.0.1"), cls(dst_pool, "127.0.0.1")
    from_slots, to_slots = [3, 4, 5, 20, 7], [10, 11, 12, 13, 40]
    payload = sender.send(receiver.descriptor(), from_slots, to_slots)
    done = {"type": "done", "room": 1, "token": 5, "logprob": None, "top_logprobs": None}
    done.update(input_logprobs=None, cached_tokens=0, payload=payload)
    receiver.receive(decode_message(encode_message(done))["payload"], to_slots)
    _check_moved(src_pool, dst_pool, from_slots, to_slots)
    sender.close()
    receiver.close()


def test_mooncake_moves_a_fragmented_transfer_of_many_runs():
    """Every slot its own run: 1,500 tokens x 4 KV buffers in one batch_transfer_sync_write
    failed (status -1: its TCP lane refuses batches past ~2,100 copies), and the pair could
    stay broken for later transfers."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as e:
        pytest.skip(f"Mooncake's transfer engine does not load: {e!r}")
    src_pool = MHATokenToKVPool(3200, 2, 2, 8, torch.float32)
    dst_pool = MHATokenToKVPool(3200, 2, 2, 8, torch.float32)
    for buf in (*src_pool.k_buffer, *src_pool.v_buffer):
        buf.copy_(torch.randn(buf.shape))
    sender = MooncakeTransfer(src_pool, "127.0.0.1")
    receiver = MooncakeTransfer(dst_pool, "127.0.0.1")
    try:
        for n in (1500, 3):  # the pair still works after the big one
            from_slots, to_slots = list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))
            sender.send(receiver.descriptor(), from_slots, to_slots)
            for a, b in zip(
                (*src_pool.k_buffer, *src_pool.v_buffer),
                (*dst_pool.k_buffer, *dst_pool.v_buffer),
                strict=True,
            ):
                assert torch.equal(b[to_slots], a[from_slots])
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"bootstrap_room": [1]}, "one per prompt"),  # two prompts, one room
        ({"bootstrap_room": -1}, "non-negative"),
        ({"bootstrap_room": 1, "bootstrap_port": 0}, "a port"),
        ({"bootstrap_room": 1, "bootstrap_host": ""}, "a host name"),
    ],
)
def test_bad_pairing_fields_are_refused_before_anything_runs(engines, prompts, fields, match):
    from radixserve.managers.tokenizer_manager import RequestError

    with pytest.raises(RequestError, match=match) as e:
        engines[1].generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 2}, **fields)
    assert e.value.status_code == 400


def test_each_sub_request_pairs_on_a_room_of_its_own():
    from radixserve.io_struct import GenerateReqInput
    from radixserve.managers.request_checks import RequestError, verify_request_fields

    def rooms(room, prompts=2, n=3):
        obj = GenerateReqInput(
            input_ids=[[1, 2]] * prompts, sampling_params={"n": n}, bootstrap_room=room
        )
        verify_request_fields(obj)
        return [obj.pairing(k)["bootstrap_room"] for k in range(prompts * n)]

    # SGLang's order: sub-request k is choice k // prompts of prompt k % prompts
    assert rooms(100) == [100, 101, 102, 103, 104, 105]
    assert rooms([100, 200]) == [100, 200, 101, 201, 102, 202]  # a room per prompt: + choice
    assert rooms(list(range(6))) == list(range(6))  # one per sub-request
    assert rooms([100, 200], n=1) == [100, 200]
    for bad, match in (([5, 6], "need different rooms"), ([7, 7, 8, 9, 10, 11], "different")):
        with pytest.raises(RequestError, match=match):
            rooms(bad)
    with pytest.raises(RequestError, match="one per prompt or per choice"):
        rooms([1, 2, 3])
    one = GenerateReqInput(input_ids=[1, 2], bootstrap_room=[9], bootstrap_host=["h"])
    verify_request_fields(one)
    assert one.pairing(0) == {"bootstrap_host": "h", "bootstrap_port": None, "bootstrap_room": 9}


def test_host_names_and_addresses():
    from radixserve.managers.request_checks import is_host

    for host in ("127.0.0.1", "localhost", "prefill-0.svc.cluster.local", "::1", "[fe80::1]"):
        assert is_host(host), host
    for host in ("", " ", "a b", "http://127.0.0.1", "host:8998", "-a.b", "a..b", 5, None):
        assert not is_host(host), host


class _RoutedSocket:
    """A UDP socket whose connect picks `address` as the local end (None: no route)."""

    address: str | None = "192.0.2.2"

    def __init__(self, *args: Any) -> None:
        pass

    def __enter__(self) -> _RoutedSocket:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def connect(self, peer: tuple[str, int]) -> None:
        if self.address is None:
            raise OSError("Network is unreachable")

    def getsockname(self) -> tuple[str, int]:
        return (self.address or "0.0.0.0", 40000)


def test_a_wildcard_bind_advertises_the_address_peers_reach(monkeypatch, caplog):
    """--host 0.0.0.0 advertised what the host name resolves to: 127.0.1.1 on Debian,
    127.0.0.1 in most containers, so a peer on another machine sent its pongs, `done` and
    Mooncake's writes to its own loopback. Now the routed interface's address, unless
    RADIXSERVE_HOST_IP says otherwise; a loopback fallback is warned about."""
    from radixserve.disaggregation import transfer

    monkeypatch.delenv("RADIXSERVE_HOST_IP", raising=False)
    monkeypatch.setattr(transfer.socket, "socket", _RoutedSocket)
    monkeypatch.setattr(transfer.socket, "gethostbyname", lambda name: "127.0.1.1")
    assert transfer.transfer_host("10.1.2.3") == "10.1.2.3"  # an address as given
    for wildcard in ("0.0.0.0", "::", ""):
        assert transfer.transfer_host(wildcard) == "192.0.2.2"
    monkeypatch.setenv("RADIXSERVE_HOST_IP", "10.9.8.7")
    assert transfer.transfer_host("0.0.0.0") == "10.9.8.7"
    monkeypatch.delenv("RADIXSERVE_HOST_IP")
    monkeypatch.setattr(_RoutedSocket, "address", None)  # no route off this machine
    with caplog.at_level("WARNING", logger=transfer.__name__):
        assert transfer.transfer_host("0.0.0.0") == "127.0.1.1"
    assert "RADIXSERVE_HOST_IP" in caplog.text


def test_an_address_zmq_refuses_fails_one_request_not_the_scheduler():
    from radixserve.disaggregation.channel import ControlChannel

    channel = ControlChannel("127.0.0.1", 0, "127.0.0.1")
    try:
        with pytest.raises(ValueError, match="cannot connect to tcp://http://x:1"):
            channel.connect("tcp://http://x:1")
        assert channel.peers == {}
    finally:
        channel.close()


def test_more_requests_than_the_decode_pool_holds(model):
    """150 requests at once into a decode engine whose pool holds a fraction of them: they wait
    for slots (prealloc), decode with retraction when the pool runs out, and all finish with
    greedy tokens; nothing leaks on either side."""
    from radixserve import Engine

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(20, 120))] for _ in range(150)]
    new = 24
    reference = reference_greedy(model, prompts, new)
    port = free_port()
    common: dict[str, Any] = {
        "model_path": model,
        "dtype": "float32",
        "enable_integrity_checks": True,
        "disaggregation_transfer_backend": "fake",
    }
    prefill = Engine(
        disaggregation_mode="prefill",
        disaggregation_bootstrap_port=port,
        max_total_tokens=8192,
        **common,
    )
    decode = None
    try:
        # A small reservation ratio: the decode side admits until its pool holds little more
        # than the prompts, so decoding must retract however the transfers are timed (at the
        # default ratio 0.7 that hung on timing and was not always reached)
        decode = Engine(
            disaggregation_mode="decode",
            max_total_tokens=1536,
            schedule_conservativeness=0.1,
            **common,
        )
        engines = (prefill, decode, port)
        # min_new_tokens: transformers' reference never stops at EOS (it masks it)
        params = {"max_new_tokens": new, "min_new_tokens": new, "temperature": 0}
        outs = _pd_generate(engines, prompts, params, list(range(1000, 1150)))
        assert [o["output_ids"] for o in outs] == reference
        info = decode.get_server_info()
        assert info["disaggregation"]["transferred"] == 150
        assert info["num_retractions"] > 0  # the pool ran out while decoding
        for engine in (prefill, decode):
            _assert_drained(engine)
    finally:
        if decode is not None:
            decode.shutdown()
        prefill.shutdown()


def test_requests_queued_for_a_dead_prefill_server_fail_together(model):
    """No prefill server answers at the bootstrap address: the requests holding reservations
    fail once its pings go unanswered (PEER_SILENT_S), and so, at that moment, do the ones
    still queued for slots behind them (each once reserved in turn and waited out the pings
    again: 20 requests in a pool that holds 4 took five rounds)."""
    from radixserve import Engine
    from radixserve.disaggregation.decode import PEER_SILENT_S

    decode = Engine(
        model_path=model,
        dtype="float32",
        max_total_tokens=512,
        enable_integrity_checks=True,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="fake",
        disaggregation_timeout=120.0,
    )
    try:
        from radixserve.managers.request_checks import RequestError

        pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": free_port()}

        def one(i: int) -> str:
            try:
                decode.generate(
                    input_ids=[5 + i] * 100,
                    sampling_params={"max_new_tokens": 4},
                    bootstrap_room=i,
                    **pd,
                )
            except RequestError as e:
                return f"{e.status_code} {e}"
            return "finished"

        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            errors = list(pool.map(one, range(20)))
        took = time.monotonic() - start
        # (named as never reached: a wrong bootstrap_port was blamed on a server that stopped)
        never = f"no prefill server answers at tcp://127.0.0.1:{pd['bootstrap_port']} (check"
        assert all(e.startswith("503 ") and never in e for e in errors), errors
        assert took < 3 * PEER_SILENT_S, took
        _assert_drained(decode)
    finally:
        decode.shutdown()


def test_no_more_tries_to_a_decode_server_that_went_silent_after_a_failed_transfer():
    """A dead decode server's queued transfers each once tried a write (about 1 s with Mooncake)
    on the one transfer thread, holding every other decode server's KV behind them; after a
    failed one, a transfer waits at most PING_WAIT_S for the server's ping, and without it
    fails at once."""
    from radixserve.disaggregation.prefill import PING_WAIT_S, PrefillBootstrap, SilentPeer

    sent = []

    class Transfer:
        def send(self, desc, src, dst):
            sent.append(desc)

    side = object.__new__(PrefillBootstrap)  # only what _send reads
    side.transfer, side.failed_peers, side.pinged = Transfer(), {}, {}
    side.transfer_seconds, side.transfer_bytes, side.token_bytes = 0.0, 0, 1
    side._send("a", [1], [2], "tcp://dead:1")
    assert sent == ["a"]
    side.failed_peers["tcp://dead:1"] = time.monotonic()  # a write to it failed just now
    start = time.monotonic()
    with pytest.raises(SilentPeer, match="has not answered"):
        side._send("b", [1], [2], "tcp://dead:1")
    assert PING_WAIT_S <= time.monotonic() - start < PING_WAIT_S + 5
    start = time.monotonic()
    with pytest.raises(SilentPeer):  # the next ones at once
        side._send("c", [1], [2], "tcp://dead:1")
    assert time.monotonic() - start < 0.5
    side._send("d", [1], [2], "tcp://other:1")  # other decode servers are tried as ever
    side.pinged["tcp://dead:1"] = time.monotonic()  # it was alive after all
    side._send("e", [1], [2], "tcp://dead:1")
    assert sent == ["a", "d", "e"]


def test_the_prefill_side_answers_pings_while_its_loop_is_busy():
    """A ping was answered by the prefill scheduler's loop, between forwards: one long forward
    (or a starved CPU) left the decode side 5 s without a pong, and it failed every request
    on a live prefill server. Its channel's own thread answers now, the loop still sees each
    ping; a pong names the answering process."""
    from radixserve.disaggregation.channel import ControlChannel

    prefill = ControlChannel("127.0.0.1", 0, "127.0.0.1", answer_pings=True)
    decode = ControlChannel("127.0.0.1", 0, "127.0.0.1")
    try:
        decode.send(prefill.address, {"type": "ping", "reply_to": decode.address, "to": "p"})
        got: list = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:  # the prefill loop never polls here
            got = decode.recv_all()
            time.sleep(0.01)
        assert got == [{"type": "pong", "from": "p", "instance": prefill.instance}]
        assert decode.inbound.poll(0) == 0
        deadline = time.monotonic() + 10
        while not (seen := prefill.recv_all()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [{"type": "ping", "reply_to": decode.address, "to": "p"}]
    finally:
        decode.close()
        prefill.close()


class _RunsWhenUnpickled:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


@pytest.mark.parametrize("answer_pings", [True, False])
def test_the_channel_reads_only_its_own_messages_and_never_unpickles(tmp_path, answer_pings):
    """The bootstrap port listens on the network (--host 0.0.0.0 across machines), and both
    sides unpickled whatever reached it: one message ran its sender's code in the scheduler.
    A message short of its fields ended the scheduler (KeyError 'room'). Each is dropped with
    a warning now; the well-formed one after them is read."""
    import pickle

    import zmq

    from radixserve.disaggregation.channel import ControlChannel

    marker = tmp_path / "ran"
    ping = {"type": "ping", "reply_to": "tcp://127.0.0.1:1", "to": "p"}
    bad = [
        [pickle.dumps(_RunsWhenUnpickled(str(marker)))],
        [pickle.dumps({"type": "reserve", "room": 1})],
        [b"0"],
        [b"[]"],
        [b"\xff"],
        [json.dumps({"type": "reserve"}).encode()],  # (each field missing)
        [json.dumps({"type": "failed", "room": [1], "error": "x"}).encode()],  # unhashable
        [json.dumps({"type": "abort", "room": True, "reply_to": "x"}).encode()],
        [json.dumps({"type": "queued", "room": 1, "reply_to": 5, "layout": {}}).encode()],
        [json.dumps({"type": "done", "room": 1, "token": 3, "cached_tokens": 0}).encode(), b"x"],
        [
            json.dumps(
                {
                    "type": "done",
                    "room": 1,
                    "token": 3,
                    "cached_tokens": 0,
                    "payload": {"shape": [4]},
                }
            ).encode(),
            b"xyz",
        ],  # fmt: skip
        [
            json.dumps(
                {"type": "done", "room": 1, "token": 3, "cached_tokens": 0, "top_logprobs": [[0.5]]}
            ).encode()
        ],  # fmt: skip
        [json.dumps({"type": "ping", "to": "p"}).encode()],
    ]
    channel = ControlChannel("127.0.0.1", 0, "127.0.0.1", answer_pings=answer_pings)
    ctx = zmq.Context()
    sender = ctx.socket(zmq.PUSH)
    sender.setsockopt(zmq.LINGER, 0)
    try:
        sender.connect(channel.address)
        for frames in [*bad, [json.dumps(ping).encode()]]:
            sender.send_multipart(frames)
        seen: list = []
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            seen = channel.recv_all()
            time.sleep(0.01)
        assert seen == [ping]
        assert not marker.exists()
    finally:
        sender.close()
        ctx.term()
        channel.close()


def test_a_silent_prefill_server_that_writes_here_keeps_its_slots_until_it_is_known_gone(
    model, monkeypatch
):
    """A prefill server that writes into the decode pool itself (Mooncake) and stops answering
    pings is not known to be gone: a stopped process wakes up and writes what it was asked
    to. Its request fails (503) and the prefill server is told to abort, but the slots wait in
    quarantine (they were freed at once and handed to another request, whose KV a late write
    then corrupted) until it answers for the room or another process answers at its address."""
    from rs_testing import SchedulerHarness

    from radixserve.disaggregation import decode as decode_side
    from radixserve.disaggregation.channel import ControlChannel
    from radixserve.io_struct import TokenizedGenerateReqInput
    from radixserve.sampling_params import SamplingParams

    monkeypatch.setattr(decode_side, "PEER_SILENT_S", 0.5)
    monkeypatch.setattr(decode_side, "PING_INTERVAL_S", 0.05)
    prefill = ControlChannel("127.0.0.1", 0, "127.0.0.1")  # answered by hand below
    h = SchedulerHarness(
        model_path=model,
        max_total_tokens=512,
        disable_overlap_schedule=True,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="fake",
    )
    try:
        s = h.scheduler
        s.disagg.transfer.remote_writes = True  # as Mooncake's
        free = s.allocator.available_size()
        prompt = list(range(5, 45))
        req = TokenizedGenerateReqInput(
            "a",
            None,
            prompt,
            SamplingParams(max_new_tokens=4),
            bootstrap_host="127.0.0.1",
            bootstrap_port=prefill.port,
            bootstrap_room=7,
        )
        s.process_input_requests([req])
        seen: list = []

        def step_until(done, what: str) -> None:
            deadline = time.monotonic() + 20
            while not done():
                assert time.monotonic() < deadline, f"no {what}: {seen}"
                h.step()
                seen.extend(prefill.recv_all())
                time.sleep(0.01)

        step_until(lambda: any(m["type"] == "ping" for m in seen), "ping")
        ping = next(m for m in seen if m["type"] == "ping")
        prefill.send(ping["reply_to"], {"type": "pong", "from": ping["to"], "instance": "first"})
        step_until(lambda: "a" in h.finish_reasons(), "failure")  # then silence
        reason = h.finish_reasons()["a"]
        assert reason["status_code"] == 503 and "stopped answering" in reason["message"]
        deadline = time.monotonic() + 20  # (ZMQ delivers in the background)
        while not any(m["type"] == "abort" and m["room"] == 7 for m in seen):
            assert time.monotonic() < deadline, f"no abort: {seen}"
            seen.extend(prefill.recv_all())
            time.sleep(0.01)
        assert s.disagg.stats()["quarantined_slots"] == len(prompt)
        assert s.allocator.available_size() + s.tree_cache.evictable_size() == free - len(prompt)
        # It keeps pinging the address; the same process answering frees nothing ...
        seen.clear()
        step_until(lambda: any(m["type"] == "ping" for m in seen), "ping")
        ping = next(m for m in seen if m["type"] == "ping")
        prefill.send(ping["reply_to"], {"type": "pong", "from": ping["to"], "instance": "first"})
        for _ in range(5):
            h.step()
            time.sleep(0.01)
        assert s.disagg.stats()["quarantined_slots"] == len(prompt)
        # ... another process there (a restart) writes nothing for the old rooms.
        prefill.send(ping["reply_to"], {"type": "pong", "from": ping["to"], "instance": "second"})
        step_until(lambda: not s.disagg.quarantine, "release")
        h.run_until_idle()
        s.assert_drained()
        assert s.allocator.available_size() + s.tree_cache.evictable_size() == free
    finally:
        prefill.close()
        h.scheduler.disagg.close()
