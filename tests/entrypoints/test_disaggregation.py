"""Prefill/decode disaggregation: a prefill server and a decode server (real `python -m
radixserve serve` processes) behind SGLang's real router in PD mode give one server's greedy
outputs on every endpoint, streamed and not; the KV moves through Mooncake's transfer engine
over TCP where it is installed (else through the `fake` backend: the bytes on the control
channel). Killing the prefill server while KV is on its way fails exactly the
requests that waited for it and leaves the decode server healthy, every slot free; pairing
that never completes times out on both sides with an error.

Every server serves a tiny random Llama with a byte-level tokenizer (one token per ASCII
character), fp32, integrity checks on.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import string
import time
from typing import Any

import httpx
import pytest
from rs_testing import SglangRouter, make_tiny_served_model
from test_http_server import ServerProcess, sse_events, wait_drained

from radixserve.utils import free_port

NEW_TOKENS = 12
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
TIMEOUT_S = 8  # --disaggregation-timeout of the servers here
CONTEXT = 8192


def _mooncake_available() -> str | None:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as e:  # ImportError, or the library's own libibverbs missing
        return f"Mooncake's transfer engine does not load ({e!r}); `make mooncake` installs it"
    return None


def _backend() -> str:
    """Mooncake where it loads (CI installs it: RADIXSERVE_REQUIRE_MOONCAKE=1 makes its absence
    a failure), else the fake backend; tests/disaggregation runs the fake one everywhere."""
    why = _mooncake_available()
    if why is None:
        return "mooncake"
    if os.environ.get("RADIXSERVE_REQUIRE_MOONCAKE") == "1":
        pytest.fail(why)
    return "fake"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_served_model(str(tmp_path_factory.mktemp("pd_tiny")), CONTEXT)


def _ready(*servers: ServerProcess) -> None:
    """Wait for servers started together (they load at the same time); stop all on failure."""
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise


def _prefill_flags(backend: str) -> tuple[list[str], int]:
    port = free_port()
    flags = ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port)]
    flags += ["--disaggregation-transfer-backend", backend]
    return flags + ["--disaggregation-timeout", str(TIMEOUT_S)], port


def _decode_flags(backend: str) -> list[str]:
    flags = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", backend]
    return flags + ["--disaggregation-timeout", str(TIMEOUT_S)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model) -> Any:
    """(single server, prefill server, its bootstrap port, decode server, transfer backend),
    started together."""
    backend = _backend()
    log_dir = str(tmp_path_factory.mktemp("pd"))
    prefill_flags, port = _prefill_flags(backend)
    single = ServerProcess(log_dir, "--model-path", tiny_model)
    prefill = ServerProcess(log_dir, "--model-path", tiny_model, *prefill_flags)
    decode = ServerProcess(log_dir, "--model-path", tiny_model, *_decode_flags(backend))
    _ready(single, prefill, decode)
    yield single, prefill, port, decode, backend
    for server in (decode, prefill, single):
        server.stop()


@pytest.fixture(scope="module")
def single(servers) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def pd(servers, tmp_path_factory) -> Any:
    """(router, prefill, bootstrap port, decode, transfer backend)."""
    _, prefill, port, decode, backend = servers
    log_dir = str(tmp_path_factory.mktemp("pd_router"))
    router = SglangRouter(
        log_dir,
        "pd",
        "--pd-disaggregation",
        "--prefill",
        prefill.url,
        str(port),
        "--decode",
        decode.url,
    )
    try:
        router.model = router.wait_ready()
        yield router, prefill, port, decode, backend
    finally:
        router.stop()


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_letters + " ") for _ in range(n))


def _requests(seed: int, model: str) -> list[tuple[str, dict[str, Any]]]:
    """(endpoint, body) of every kind, streamed and not."""
    rng = random.Random(seed)
    out: list[tuple[str, dict[str, Any]]] = []
    for stream in (False, True):
        for n in (7, 90, 300):
            out.append(("/generate", {"text": _text(rng, n), "sampling_params": GREEDY}))
            out[-1][1]["stream"] = stream
        completion = {"prompt": _text(rng, 60), "max_tokens": NEW_TOKENS, "temperature": 0}
        out.append(("/v1/completions", {**completion, "stream": stream, "model": model}))
        chat = {"messages": [{"role": "user", "content": _text(rng, 40)}], "temperature": 0}
        chat["max_tokens"] = NEW_TOKENS
        out.append(("/v1/chat/completions", {**chat, "stream": stream, "model": model}))
    return out


def _answer(url: str, path: str, body: dict[str, Any]) -> str:
    """The generated text (streamed answers joined)."""
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        data = r.json()
        if path == "/generate":
            return data["text"]
        choice = data["choices"][0]
        return choice["text"] if path == "/v1/completions" else choice["message"]["content"]
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    if path == "/generate":
        return events[-2]["text"]
    parts = []
    for e in events[:-1]:
        for c in e.get("choices", []):
            parts.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(parts)


def _pool_free(server: ServerProcess) -> None:
    info = wait_drained(server, timeout=30)
    assert info["protected_tokens"] == 0


def test_pd_pair_behind_the_router_answers_like_one_server(pd, single):
    router, prefill, _, decode, backend = pd
    requests = _requests(seed=1, model=router.model)
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        got = list(pool.map(lambda req: _answer(router.url, *req), requests))
    want = [_answer(single.url, *req) for req in requests]
    assert got == want
    stats = decode.server_info()["disaggregation"]
    assert stats["mode"] == "decode" and stats["transfer_backend"] == backend
    assert stats["transferred"] >= len(requests) and stats["failed"] == 0
    assert prefill.server_info()["disaggregation"]["transferred"] >= len(requests)
    for server in (prefill, decode):
        _pool_free(server)


@pytest.mark.parametrize(
    "extra",
    [{}, {"top_logprobs_num": 2}, {"n": 2}, {"stream": True}],
    ids=["plain", "top", "n2", "stream"],
)
def test_pd_logprobs_come_from_both_servers(pd, single, extra):
    """The first token's logprob is sampled on the prefill server, the rest on the decode
    server; the router copies the prompt's token logprobs from the prefill server's answer
    (one prompt, n = 1, not streamed). The decode server left out its own copy of the top
    ones, and of the token ones where the router merges nothing: they were lost."""
    router = pd[0]
    body = {
        "text": "The quick brown fox jumps",
        "sampling_params": {**GREEDY, "n": extra.pop("n", 1)},
        "return_logprob": True,
        "logprob_start_len": 0,
        **extra,
    }

    def metas(url: str) -> list[dict[str, Any]]:
        if not body.get("stream"):
            data = httpx.post(url + "/generate", json=body, timeout=60).json()
            return [d["meta_info"] for d in (data if isinstance(data, list) else [data])]
        with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
            return [sse_events(r.iter_lines())[-2]["meta_info"]]

    keys = ["output_token_logprobs", "input_token_logprobs"]
    if body.get("top_logprobs_num"):
        keys += ["input_top_logprobs", "output_top_logprobs"]
    for got, want in zip(metas(router.url), metas(single.url), strict=True):
        for key in keys:
            flat = [_flat(t) for t in got[key]], [_flat(t) for t in want[key]]
            assert [t[1] for t in flat[0]] == [t[1] for t in flat[1]] and flat[1], key
            for a, b in zip(*flat, strict=True):
                assert (a[0] is None) == (b[0] is None) and abs((a[0] or 0) - (b[0] or 0)) < 1e-4


def _flat(entry: Any) -> tuple[Any, Any]:
    """A (logprob, token id) of a logprob triple, or of a position's top list (its first)."""
    if entry is None or not entry:
        return (None, None)
    return (entry[0][0], entry[0][1]) if isinstance(entry[0], list) else (entry[0], entry[1])


def _choices(data: dict[str, Any]) -> list[Any]:
    if "choices" not in data:  # /generate: a list for n > 1 or a batch
        return [d["text"] for d in (data if isinstance(data, list) else [data])]
    return [(c.get("message") or {}).get("content") or c.get("text") for c in data["choices"]]


@pytest.mark.parametrize(
    "path,extra",
    [
        ("/generate", {"text": "hello world", "sampling_params": {**GREEDY, "n": 2}}),
        # (the router refuses a list of texts: a batch comes as token ids)
        (
            "/generate",
            {"input_ids": [[104, 105], [97, 98, 99]], "sampling_params": {**GREEDY, "n": 3}},
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
        ("/v1/completions", {"prompt": ["hello", "abc", "xyz"]}),
        ("/v1/completions", {"prompt": ["hello", "abc"], "n": 2}),
    ],
)
def test_every_choice_and_prompt_pairs_on_its_own_room(pd, single, path, extra):
    """The router sends one room for n > 1 on /generate and one per choice on the OpenAI
    endpoints; each sub-request once shared a room and all but one were refused (400)."""
    router, prefill, _, decode, _ = pd
    body = dict(extra)
    if path != "/generate":
        body.update(model=router.model, max_tokens=NEW_TOKENS, temperature=0)
    got = httpx.post(router.url + path, json=body, timeout=120)
    assert got.status_code == 200, got.text
    want = httpx.post(single.url + path, json=body, timeout=120).json()
    assert _choices(got.json()) == _choices(want) and len(_choices(want)) > 1
    for server in (prefill, decode):
        _pool_free(server)


def test_echoed_prompt_logprobs_come_through_the_pair(pd, single):
    """/v1/completions with echo: the router merges nothing there, so the decode server gives
    the prompt's logprobs the prefill server sent with the KV (they were once dropped)."""
    router = pd[0]
    body = {"prompt": "abcdefgh", "max_tokens": 3, "temperature": 0, "echo": True}
    body["logprobs"] = 2
    body["model"] = router.model
    got = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
    want = httpx.post(single.url + "/v1/completions", json=body, timeout=60)
    assert got.status_code == want.status_code == 200, got.text
    a, b = got.json()["choices"][0], want.json()["choices"][0]
    assert a["text"] == b["text"]
    assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"] and len(b["logprobs"]["tokens"]) == 11
    for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"], strict=True):
        assert (x is None) == (y is None) and abs((x or 0) - (y or 0)) < 1e-4


def test_a_request_without_a_bootstrap_room_is_served_alone(pd, single):
    _, prefill, _, decode, _ = pd
    body = {"text": "hello there", "sampling_params": GREEDY}
    want = httpx.post(single.url + "/generate", json=body, timeout=60).json()["text"]
    for server in (prefill, decode):
        assert httpx.post(server.url + "/generate", json=body, timeout=60).json()["text"] == want


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"bootstrap_room": -3, "bootstrap_host": "127.0.0.1"}, "bootstrap_room"),
        ({"bootstrap_room": 5}, "bootstrap_host"),
        ({"bootstrap_room": 5, "bootstrap_host": "127.0.0.1", "bootstrap_port": 70000}, "port"),
        # Hosts ZMQ cannot parse once took the decode scheduler down (ZMQError on connect).
        ({"bootstrap_room": 5, "bootstrap_host": "http://127.0.0.1"}, "a host name or IP"),
        ({"bootstrap_room": 5, "bootstrap_host": "a b"}, "a host name or IP"),
        ({"bootstrap_room": 5, "bootstrap_host": " "}, "a host name or IP"),
    ],
)
def test_bad_bootstrap_fields_are_a_400(pd, extra, match):
    decode = pd[3]
    body = {"text": "hi", "sampling_params": GREEDY, **extra}
    r = httpx.post(decode.url + "/generate", json=body, timeout=30)
    assert r.status_code == 400 and match in r.text, r.text
    assert httpx.get(decode.url + "/health", timeout=30).status_code == 200


def test_a_pairing_that_never_completes_fails_on_both_sides(pd):
    """The prefill server gets a room no decode server reserves, the decode server one the
    prefill server never gets: both answer with an error after --disaggregation-timeout."""
    _, prefill, port, decode, _ = pd
    pd_fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
    body = {"text": "lonely", "sampling_params": GREEDY, **pd_fields}
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        only_p = pool.submit(
            httpx.post, prefill.url + "/generate", json={**body, "bootstrap_room": 11}, timeout=60
        )
        only_d = pool.submit(
            httpx.post, decode.url + "/generate", json={**body, "bootstrap_room": 12}, timeout=60
        )
        rp, rd = only_p.result(), only_d.result()
    assert rp.status_code == 503 and "no decode server reserved" in rp.text, rp.text
    # whichever notices first: the prefill server's expired reservation or the decode
    # server's own deadline
    assert rd.status_code == 503 and "prefill server" in rd.text, rd.text
    assert time.monotonic() - start < 3 * TIMEOUT_S
    for server in (prefill, decode):
        _pool_free(server)


def test_killing_the_prefill_server_mid_transfer(pd, tmp_path, tiny_model):
    """A second prefill server is killed while the decode server waits for KV from it: those
    requests fail with an error naming the prefill server, the others are unaffected, and the
    decode server ends with every slot free and keeps serving."""
    router, _, _, decode, backend = pd
    flags, port = _prefill_flags(backend)
    victim = ServerProcess(str(tmp_path), "--model-path", tiny_model, *flags)
    _ready(victim)
    rng = random.Random(3)
    n = 8
    prompts = [_text(rng, 1500) for _ in range(n)]
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}

    def send(i: int) -> tuple[httpx.Response, httpx.Response | None]:
        body = {"text": prompts[i], "sampling_params": GREEDY, **fields, "bootstrap_room": i}
        with concurrent.futures.ThreadPoolExecutor(1) as one:
            to_prefill = one.submit(httpx.post, victim.url + "/generate", json=body, timeout=60)
            rd = httpx.post(decode.url + "/generate", json=body, timeout=60)
            try:
                rp = to_prefill.result()
            except httpx.HTTPError:
                rp = None  # the prefill server died
        return rd, rp

    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(send, i) for i in range(n)]
            deadline = time.monotonic() + 60
            while decode.server_info()["disaggregation"]["waiting_for_kv"] == 0:
                assert time.monotonic() < deadline, "no request ever waited for KV"
                time.sleep(0.02)
            os.killpg(victim.proc.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            answers = [f.result()[0] for f in futures]
    finally:
        victim.stop()
    failed = [r for r in answers if r.status_code != 200]
    assert failed, "every request finished before the kill; the test proves nothing"
    for r in failed:
        assert r.status_code == 503 and "prefill server" in r.text, r.text
    assert time.monotonic() - killed_at < 2 * TIMEOUT_S
    _pool_free(decode)
    assert httpx.get(decode.url + "/health", timeout=10).status_code == 200
    body = {"text": "still alive", "sampling_params": GREEDY}
    assert httpx.post(router.url + "/generate", json=body, timeout=60).status_code == 200


def test_a_client_abort_while_waiting_for_kv_frees_the_reservation(pd):
    """The decode server reserved slots for a room whose prefill never comes; the client goes
    away: the slots are free again at once, not after --disaggregation-timeout."""
    _, prefill, port, decode, _ = pd
    body = {
        "text": "x" * 500,
        "sampling_params": GREEDY,
        "stream": True,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
        "bootstrap_room": 77,
    }
    failed = decode.server_info()["disaggregation"]["failed"]
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream("POST", decode.url + "/generate", json=body, timeout=1.5) as r:
            r.read()
    info = wait_drained(decode, timeout=2 * TIMEOUT_S)
    assert info["disaggregation"]["waiting_for_kv"] == 0
    # Freed by the abort: the timeout would have failed it (a loaded machine may take a
    # while to notice the disconnect, so this checks why, not how fast).
    assert info["disaggregation"]["failed"] == failed
    _pool_free(prefill)  # its reservation for room 77 expires there on its own


def _abort_while_waiting(server: ServerProcess, body: dict[str, Any], state: str) -> None:
    """Send `body` to one side of the pair, abort it by its rid once the side's disaggregation
    stats count it in `state` (waiting for its peer), and check that it ended aborted."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, server.url + "/generate", json=body, timeout=60)
        deadline = time.monotonic() + 30
        while server.server_info()["disaggregation"][state] == 0:
            assert time.monotonic() < deadline and not waiting.done()
            time.sleep(0.05)
        r = httpx.post(server.url + "/abort_request", json={"rid": body["rid"]}, timeout=30)
        assert r.status_code == 200
        assert waiting.result().json()["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.parametrize("first", ["decode", "prefill"])
def test_a_side_that_aborts_a_request_before_pairing_ends_the_other_at_once(pd, first):
    """decode first: the decode side aborted room 78 before its prefill request arrived; that
    request once waited out --disaggregation-timeout for a reservation that could never come.
    prefill first: aborted there while it waited for its reservation, room 79; the decode side
    reserved slots for it anyway, held them until the timeout and then said the prefill server
    never received the request."""
    _, prefill, port, decode, _ = pd
    room, state, other = {
        "decode": (78, "waiting_for_kv", prefill),
        "prefill": (79, "waiting_for_decode", decode),
    }[first]
    pairing = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}
    body = {"text": "y" * 300, "sampling_params": GREEDY, "rid": f"{first}-first", **pairing}
    _abort_while_waiting(decode if first == "decode" else prefill, body, state)
    # (whether the abort reaches the other side before this request or after, it ends so)
    start = time.monotonic()
    r = httpx.post(other.url + "/generate", json={**body, "rid": None}, timeout=60)
    assert time.monotonic() - start < TIMEOUT_S, "waited for the timeout"
    if first == "decode":
        message = r.json()["meta_info"]["finish_reason"]["message"]
        assert message == "the decode server aborted the request"
    else:
        assert r.status_code == 503 and "prefill server failed" in r.text, r.text
    _pool_free(prefill)
    _pool_free(decode)


def test_a_decode_request_that_ends_before_reserving_stops_its_prefill_copy(
    pd, tmp_path, tiny_model
):
    """Aborted on the decode side while it queued for a reservation: the prefill copy waited
    --disaggregation-timeout for a reservation that could never come (behind SGLang's router,
    the client waited as long)."""
    _, prefill, port, _, backend = pd
    decode = ServerProcess(
        str(tmp_path),
        "--model-path",
        tiny_model,
        *_decode_flags(backend),
        "--max-running-requests",
        "1",
    )
    _ready(decode)
    try:
        pairing = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 81}
        body = {"text": "w" * 200, "sampling_params": GREEDY, "rid": "queued", **pairing}
        busy = {"text": "busy", "sampling_params": {**GREEDY, "max_new_tokens": 4000}}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            occupying = pool.submit(httpx.post, decode.url + "/generate", json=busy, timeout=120)
            deadline = time.monotonic() + 30
            while decode.server_info()["running"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            queued = pool.submit(httpx.post, decode.url + "/generate", json=body, timeout=60)
            while decode.server_info()["disaggregation"]["waiting_for_slots"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            copy = pool.submit(
                httpx.post, prefill.url + "/generate", json={**body, "rid": None}, timeout=60
            )
            while prefill.server_info()["disaggregation"]["waiting_for_decode"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            start = time.monotonic()
            httpx.post(decode.url + "/abort_request", json={"rid": "queued"}, timeout=30)
            assert queued.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
            r = copy.result()
            assert time.monotonic() - start < TIMEOUT_S, "the prefill copy waited the timeout"
            assert r.json()["meta_info"]["finish_reason"]["message"] == (
                "the decode server aborted the request"
            )
            httpx.post(decode.url + "/abort_request", json={"abort_all": True}, timeout=30)
            occupying.result()
        _pool_free(prefill)
        _pool_free(decode)
    finally:
        decode.stop()
