"""SGLang's worker API, driven the way SGLang's router and clients drive it (the calls recorded
in ../shared/notes/sglang-router.md), on the real default model; then the real `sglang-router`
in front of two radixserve workers.

Registration: two raw HTTP/2 preface probes, /health, /server_info and /model_info (and their
/get_* names) with the fields the router reads. Serving: /get_load, the request bodies the
router rebuilds (with the fields it adds), X-Request-Id, /flush_cache, /metrics under SGLang's
names. Clients: /tokenize and /detokenize, /abort_request with abort_all, /health_generate
under load, prompt logprobs (logprob_start_len, return_text_in_logprobs, SGLang's triples).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import time
from typing import Any

import httpx
import pytest
from rs_testing import sglang_router_command
from test_http_server import MODEL, ServerProcess, sse_events, wait_drained
from test_unknown_fields import ROUTER_CHAT, ROUTER_COMPLETIONS, ROUTER_GENERATE

from radixserve.utils import free_port

pytestmark = pytest.mark.real_model

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_path):
    proc = ServerProcess(str(tmp_path_factory.mktemp("worker_api")), "--max-running-requests", "4")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _get(server: ServerProcess, path: str, **kw: Any) -> httpx.Response:
    return httpx.get(server.url + path, timeout=kw.pop("timeout", 60), **kw)


def _post(server: ServerProcess, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=kw.pop("timeout", 120), **kw)


# -- start-up ------------------------------------------------------------------------------------
def test_startup_summary_and_warm_up_come_before_ready(server):
    deadline = time.monotonic() + 30
    while "radixserve ready on" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log()
    warm, summary = log.find("warm-up request done"), log.find("serving model " + MODEL)
    ready = log.find("radixserve ready on")
    assert 0 <= warm < summary < ready, log[-3000:]
    line = log[summary:].splitlines()[0]
    for part in (
        "dtype float32",
        "device cpu",
        "threads",
        "context ",
        "KV pool ",
        "max running 4",
        "chunk ",
        "overlap o",
        "speculation off",
        "attention cpu_paged",
    ):
        assert part in line, line


# -- registration --------------------------------------------------------------------------------
def test_http2_preface_probes_are_answered_at_once(server):
    """The router probes for a gRPC server twice before registering; an HTTP/1.1 worker must
    answer or close at once rather than hold the connection."""
    for _ in range(2):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.settimeout(5)
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            start = time.monotonic()
            data = sock.recv(4096)  # a 4xx/505 status line, or b"" when it closes
            assert time.monotonic() - start < 2.0
            assert data == b"" or data.startswith(b"HTTP/1.1 4") or data.startswith(b"HTTP/1.1 5")


def test_info_routes_have_what_the_router_reads(server):
    assert _get(server, "/health").status_code == 200
    for path in ("/model_info", "/get_model_info"):
        info = _get(server, path).json()
        assert info["served_model_name"] == MODEL
        assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
        assert info["is_generation"] is True
        # The router loads its tokenizer from here: a directory, not the GGUF file.
        assert os.path.isfile(os.path.join(info["tokenizer_path"], "tokenizer_config.json"))
    for path in ("/server_info", "/get_server_info"):
        info = _get(server, path).json()
        assert info["served_model_name"] == MODEL
        assert info["model_path"] and info["tokenizer_path"]
        assert (info["tp_size"], info["dp_size"], info["disaggregation_mode"]) == (1, 1, "null")
        assert info["max_total_num_tokens"] > 0


def test_models_list_shows_no_local_paths(server):
    models = _get(server, "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert "/" not in json.dumps(models), models


def test_get_load_is_one_rank_with_the_tokens_in_use(server):
    body = {
        "text": "Count to a hundred:",
        "sampling_params": {"max_new_tokens": 64, "ignore_eos": True},
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        # Keep the line iterator alive: a dropped one is closed, and closing it closes the
        # response, which the server takes as a disconnect and aborts the request.
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        load = _get(server, "/get_load").json()
        assert len(load) == 1 and load[0]["dp_rank"] == 0
        assert load[0]["num_reqs"] == 1 and load[0]["num_tokens"] > 0
        assert load[0]["num_waiting_reqs"] == 0
        assert sse_events(lines)[-1] == "[DONE]"  # it ran to its end, not aborted
    wait_drained(server)
    assert _get(server, "/get_load").json()[0]["num_tokens"] == 0


# -- the bodies the router sends ------------------------------------------------------------------
def test_generate_with_the_router_fields_and_request_id(server):
    body = {**ROUTER_GENERATE, "text": "The capital of France is", "rid": "router-rid-1"}
    r = _post(server, "/generate", body, headers={"X-Request-Id": "abc"})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 2
    with httpx.stream(
        "POST", server.url + "/generate", json={**body, "rid": "router-rid-2", "stream": True}
    ) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"] is not None


def test_openai_routes_with_the_router_fields(server):
    chat = {**ROUTER_CHAT, "model": MODEL, "messages": [{"role": "user", "content": "Say hi."}]}
    r = _post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2
    r = _post(server, "/v1/completions", {**ROUTER_COMPLETIONS, "model": MODEL})
    assert r.status_code == 200, r.text


# -- client routes --------------------------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip(server, tokenizer):
    text = "Hello, radix world!"
    out = _post(server, "/tokenize", {"prompt": text}).json()
    assert out["tokens"] == tokenizer.encode(text) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] > 0
    batch = _post(server, "/tokenize", {"prompt": [text, "x"], "add_special_tokens": False}).json()
    assert batch["tokens"][0] == tokenizer.encode(text, add_special_tokens=False)
    assert batch["count"] == [len(t) for t in batch["tokens"]]
    back = _post(server, "/detokenize", {"tokens": out["tokens"]}).json()
    assert back["text"] == tokenizer.decode(out["tokens"], skip_special_tokens=True)
    assert _post(server, "/detokenize", {"tokens": batch["tokens"]}).json()["text"][1] == "x"
    # Bad input is a 400 (404 for another model), never a 500.
    assert _post(server, "/detokenize", {"tokens": [10**9]}).status_code == 400
    assert _post(server, "/detokenize", {"tokens": [-1]}).status_code == 400
    assert _post(server, "/tokenize", {"prompt": 5}).status_code == 400
    assert _post(server, "/tokenize", {"text": "x"}).status_code == 400
    assert _post(server, "/tokenize", {"prompt": "x", "model": "gpt-4"}).status_code == 404
    # SGLang's documented names (/tokenize and /detokenize are its aliases)
    assert _post(server, "/v1/tokenize", {"prompt": text}).json() == out
    assert _post(server, "/v1/detokenize", {"tokens": out["tokens"]}).json() == back


def test_a_prompt_too_long_for_any_tokenization_is_refused_unread(server):
    """A text longer than the context times the longest token cannot fit: refused before it
    is tokenized (a 4 MB prompt held the serving loop 8 s to be refused for its length)."""
    r = _post(server, "/v1/completions", {"prompt": "a " * 3_000_000, "max_tokens": 1})
    assert r.status_code == 400 and "characters: more than the" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return default_tokenizer  # the session's (see conftest.py)


def _stream_first_event(server: ServerProcess, body: dict, results: list, i: int) -> None:
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        results[i] = sse_events(r.iter_lines())


def test_abort_all_ends_every_request_with_abort(server):
    """Six streams on a server running four at a time: running and queued ones all end."""
    body = {"text": "Write a long essay.", "stream": True}
    body["sampling_params"] = {"max_new_tokens": 2000, "ignore_eos": True}
    results: list[Any] = [None] * 6
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_stream_first_event, server, body, results, i) for i in range(6)]
        deadline = time.monotonic() + 60
        while True:  # four running, two waiting: all six registered before the abort
            info = server.server_info()
            if info["running"] >= 4 and info["running"] + info["queued"] == 6:
                break
            assert time.monotonic() < deadline, "the load never started"
            time.sleep(0.1)
        r = _post(server, "/abort_request", {"abort_all": True})
        assert r.json() == {"success": True, "aborted": 6}
        for f in futures:
            f.result(timeout=60)
    for events in results:
        assert events[-1] == "[DONE]"
        assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    wait_drained(server)
    assert _post(server, "/abort_request", {}).status_code == 400  # neither rid nor abort_all


def test_health_generate_answers_under_load(server):
    """With every running slot busy and requests queued, the probe's own request waits; the
    outputs the server streams meanwhile prove it healthy."""
    body = {"text": "Write a long essay.", "stream": True}
    body["sampling_params"] = {"max_new_tokens": 400, "ignore_eos": True}
    results: list[Any] = [None] * 8
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_stream_first_event, server, body, results, i) for i in range(8)]
        deadline = time.monotonic() + 60
        while server.server_info()["queued"] < 4:
            assert time.monotonic() < deadline, "the load never queued"
            time.sleep(0.1)
        r = _get(server, "/health_generate", timeout=30)
        assert r.status_code == 200
        info = server.server_info()
        assert info["queued"] >= 3, "the probe had to wait behind the queue to be meaningful"
        _post(server, "/abort_request", {"abort_all": True})
        for f in futures:
            f.result(timeout=60)
    wait_drained(server)


def test_prompt_logprobs_as_sglang_triples(server, tokenizer):
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text)
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 3, **GREEDY},
        "return_logprob": True,
        "logprob_start_len": 2,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    meta = _post(server, "/generate", body).json()["meta_info"]
    inp = meta["input_token_logprobs"]
    assert [t[1] for t in inp] == ids[2:]
    assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in inp)
    assert [t[2] for t in inp] == [tokenizer.decode([i]) for i in ids[2:]]
    assert len(meta["input_top_logprobs"]) == len(ids) - 2
    assert all(len(top) == 2 and len(top[0]) == 3 for top in meta["input_top_logprobs"])
    out = meta["output_token_logprobs"]
    assert len(out) == 3 and all(len(t) == 3 and isinstance(t[2], str) for t in out)
    # Without text, the third element is null; with no start, no prompt logprobs.
    meta = _post(server, "/generate", {**body, "return_text_in_logprobs": False}).json()
    assert all(t[2] is None for t in meta["meta_info"]["input_token_logprobs"])
    meta = _post(server, "/generate", {**body, "logprob_start_len": -1}).json()["meta_info"]
    assert meta["input_token_logprobs"] == [] and len(meta["output_token_logprobs"]) == 3
    for bad in (len(ids) + 1, -2, "x"):
        r = _post(server, "/generate", {**body, "logprob_start_len": bad})
        assert r.status_code == 400 and "logprob_start_len" in r.text, r.text
    wait_drained(server)


def test_metrics_use_sglang_names(server):
    text = _get(server, "/metrics").text
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:generation_tokens_total",
        "sglang:time_to_first_token_seconds_bucket",
        # what SGLang's Grafana dashboard plots besides
        "sglang:gen_throughput",
        "sglang:cache_hit_rate",
        "sglang:num_used_tokens",
        "sglang:num_grammar_queue_reqs",
        "sglang:num_aborted_requests_total",
        "sglang:num_retracted_requests_total",
    ):
        assert name in text, name
    assert "radixserve:" not in text
    # (SGLang's sglang:num_retractions is a histogram: a counter of that name clashed)
    assert "sglang:num_retractions" not in text and "num_aborted_reqs" not in text


def test_server_info_has_sglang_s_internal_states_and_version(server):
    """SGLang's bench_serving and the router's mini load balancer read
    internal_states[i]["avg_spec_accept_length"] / ["last_gen_throughput"] (a KeyError)."""
    info = _get(server, "/get_server_info").json()
    assert isinstance(info["version"], str)
    (state,) = info["internal_states"]
    assert state["dp_rank"] == 0 and state["avg_spec_accept_length"] is None
    assert state["last_gen_throughput"] >= 0


# -- the real router -----------------------------------------------------------------------------
def test_real_sglang_router_in_front_of_two_workers(server, tmp_path):
    launch = sglang_router_command()
    second = ServerProcess(str(tmp_path))
    router = None
    try:
        second.wait_ready()
        port, metrics_port = free_port(), free_port()
        log = open(tmp_path / "router.log", "w")
        router = subprocess.Popen(
            [
                *launch,
                *("--worker-urls", server.url, second.url),
                *("--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port)),
                *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)),
                "--log-level",
                "warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None, (tmp_path / "router.log").read_text()[-3000:]
            try:
                models = httpx.get(url + "/v1/models", timeout=5).json()
                if models.get("data"):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, (tmp_path / "router.log").read_text()[-3000:]
            time.sleep(0.5)
        assert [m["id"] for m in models["data"]] == [MODEL]
        before = [_num_requests(w) for w in (server, second)]
        gen = {"text": "Hello, my name is", "sampling_params": {"max_new_tokens": 4, **GREEDY}}
        outs = [httpx.post(url + "/generate", json=gen, timeout=120).json() for _ in range(4)]
        assert len({o["text"] for o in outs}) == 1  # the same greedy text from both workers
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": True},
            timeout=120,
        ) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and len(events) >= 2
        after = [_num_requests(w) for w in (server, second)]
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    finally:
        if router is not None:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
        second.stop()


def _num_requests(server: ServerProcess) -> float:
    for line in _get(server, "/metrics").text.splitlines():
        if line.startswith("sglang:num_requests_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no sglang:num_requests_total")
