"""Scaling out: data parallelism (`--dp-size 2`, two scheduler replicas behind the
DataParallelController) and SGLang's real router in front of two radixserve servers.

Every server serves a tiny random Llama with a byte-level tokenizer (one token per ASCII
character, so text prompts are exact token sequences; real servers, seconds to start). The
shared-prefix workload: GROUPS groups of PER_GROUP prompts that share a long random prefix,
sent as a server sees them after a warm system prompt: the first prompt of every group
(concurrently), then all the others (concurrently, shuffled); greedy, EOS ignored.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import string
import threading
import time
from typing import Any

import httpx
import psutil
import pytest
from rs_testing import SglangRouter, make_tiny_served_model
from test_http_server import ServerProcess, sse_events

GROUPS, PER_GROUP = 6, 4
PREFIX_CHARS, QUESTION_CHARS = 384, 24
NEW_TOKENS = 8
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
LONG = {"max_new_tokens": 6000, "ignore_eos": True}  # runs until aborted
CONTEXT = 8192


# -- servers ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_served_model(str(tmp_path_factory.mktemp("tiny_served")), CONTEXT)


def _start(tmp_path_factory, tiny_model: str, name: str, *flags: str) -> ServerProcess:
    proc = ServerProcess(str(tmp_path_factory.mktemp(name)), "--model-path", tiny_model, *flags)
    proc.wait_ready()
    return proc


@pytest.fixture(scope="module")
def dp1(tmp_path_factory, tiny_model):
    proc = None
    try:
        proc = _start(tmp_path_factory, tiny_model, "dp1")
        yield proc
    finally:
        if proc is not None:
            proc.stop()


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, tiny_model):
    proc = None
    try:
        proc = _start(
            tmp_path_factory,
            tiny_model,
            "dp2",
            "--dp-size",
            "2",
            "--load-balance-method",
            "prefix_affinity",
        )
        yield proc
    finally:
        if proc is not None:
            proc.stop()


# -- workload -----------------------------------------------------------------------------------
def shared_prefix_groups(seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)

    def text(n: int) -> str:
        return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(n))

    groups = []
    for _ in range(GROUPS):
        prefix = text(PREFIX_CHARS)
        groups.append([f"{prefix} Q{q}: {text(QUESTION_CHARS)}" for q in range(PER_GROUP)])
    return groups


def _generate(url: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"text": prompt, "sampling_params": GREEDY, **extra}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def run_workload(url: str, seed: int = 0) -> dict[str, dict[str, Any]]:
    """prompt → /generate's reply: the groups' first prompts, then the rest."""
    groups = shared_prefix_groups(seed)
    followers = [p for g in groups for p in g[1:]]
    random.Random(seed).shuffle(followers)
    out: dict[str, dict[str, Any]] = {}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for wave in ([g[0] for g in groups], followers):
            out.update(zip(wave, pool.map(lambda p: _generate(url, p), wave), strict=True))
    return out


def cached_ratio(replies: dict[str, dict[str, Any]]) -> float:
    metas = [r["meta_info"] for r in replies.values()]
    return sum(m["cached_tokens"] for m in metas) / sum(m["prompt_tokens"] for m in metas)


def replicas(server: ServerProcess) -> list[dict[str, Any]]:
    """Each replica's server info (the one server's own with --dp-size 1)."""
    info = server.server_info()
    return info.get("replicas", [info])


def wait_drained_all(server: ServerProcess, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Every replica idle, every KV slot free or evictable, no lock, every request row free."""
    deadline = time.monotonic() + timeout
    while True:
        reps = replicas(server)
        if all(_drained(r) for r in reps):
            return reps
        if time.monotonic() > deadline:
            pytest.fail(f"the replicas did not drain within {timeout} s: {reps}")
        time.sleep(0.2)


def _drained(info: dict[str, Any]) -> bool:
    free = info["available_tokens"] + info["evictable_tokens"]
    return (
        info["running"] == 0
        and info["queued"] == 0
        and free == info["max_total_num_tokens"]
        and info["protected_tokens"] == 0
        and info["free_request_rows"] == info["max_running_requests"]
    )


def _flush(server: ServerProcess) -> None:
    deadline = time.monotonic() + 30
    while httpx.post(server.url + "/flush_cache", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the cache never flushed"
        time.sleep(0.2)


class LongRequests:
    """Requests that run until aborted, each on its own thread; `outputs[rid]` is the final
    output once it has returned. Not streamed: a stream of SGLang's cumulative /generate
    events is O(tokens²) bytes, and parsing it starved the polls that these tests make."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.threads: list[threading.Thread] = []
        self.outputs: dict[str, Any] = {}

    def start(self, rid: str, prompt: str) -> None:
        body = {"text": prompt, "sampling_params": LONG, "rid": rid}

        def run() -> None:
            r = httpx.post(self.server.url + "/generate", json=body, timeout=120)
            self.outputs[rid] = r.json()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
            assert not t.is_alive(), "a request did not end"

    def finish_type(self, rid: str) -> str:
        return self.outputs[rid]["meta_info"]["finish_reason"]["type"]


def wait_running(server: ServerProcess, expected: list[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := [r["running"] for r in replicas(server)]) != expected:
        assert time.monotonic() < deadline, f"running per replica {got}, expected {expected}"
        time.sleep(0.05)


# -- data parallelism -----------------------------------------------------------------------------
def test_dp2_prefix_affinity_keeps_the_cache_ratio_and_the_outputs(dp1, dp2):
    one = run_workload(dp1.url)
    before = [r["num_requests"] for r in replicas(dp2)]
    two = run_workload(dp2.url)
    after = [r["num_requests"] for r in replicas(dp2)]
    r1, r2 = cached_ratio(one), cached_ratio(two)
    print(f"cached-token ratio: dp1 {r1:.3f}, dp2 prefix_affinity {r2:.3f}")
    assert r1 > 0.5, r1  # the workload does share prefixes
    assert abs(r2 - r1) <= 0.05 * r1, (r1, r2)
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(served) == GROUPS * PER_GROUP and min(served) > 0, served
    assert {p: o["text"] for p, o in two.items()} == {p: o["text"] for p, o in one.items()}
    assert all(o["meta_info"]["completion_tokens"] == NEW_TOKENS for o in two.values())
    wait_drained_all(dp2)


def test_dp2_server_info_and_get_load(dp2):
    info = dp2.server_info()
    assert info["dp_size"] == 2 and len(info["replicas"]) == 2
    assert [r["dp_rank"] for r in info["replicas"]] == [0, 1]
    # The server's figures are the replicas' sums.
    for key in ("max_total_num_tokens", "available_tokens", "num_requests", "cached_tokens"):
        assert info[key] == sum(r[key] for r in info["replicas"]), key
    assert len(info["scheduler_pids"]) == 2
    load = httpx.get(dp2.url + "/get_load", timeout=30).json()
    assert [entry["dp_rank"] for entry in load] == [0, 1]
    assert all(entry["num_reqs"] == 0 and entry["num_tokens"] == 0 for entry in load), load


def test_dp2_aborts_reach_both_replicas(dp2):
    _flush(dp2)  # empty caches, and so empty prefix indexes
    longs = LongRequests(dp2)
    # Prompts that share no prefix: each goes to the replica with the least cached.
    longs.start("abort-a", "A: tell me a story.")
    wait_running(dp2, [1, 0])
    longs.start("abort-b", "B: tell me a story.")
    wait_running(dp2, [1, 1])
    load = httpx.get(dp2.url + "/get_load", timeout=30).json()
    assert [(e["dp_rank"], e["num_reqs"]) for e in load] == [(0, 1), (1, 1)], load
    assert all(e["num_tokens"] > 0 for e in load), load
    for rid in ("abort-a", "abort-b"):  # one on each replica
        r = httpx.post(dp2.url + "/abort_request", json={"rid": rid}, timeout=30)
        assert r.json() == {"success": True}
    longs.join()
    assert [longs.finish_type(rid) for rid in ("abort-a", "abort-b")] == ["abort", "abort"]
    wait_drained_all(dp2)

    longs = LongRequests(dp2)
    for i in range(4):
        longs.start(f"all-{i}", f"{i}: tell me a story.")
    wait_running(dp2, [2, 2])
    r = httpx.post(dp2.url + "/abort_request", json={"abort_all": True}, timeout=30)
    assert r.json() == {"success": True, "aborted": 4}
    longs.join()
    assert {longs.finish_type(f"all-{i}") for i in range(4)} == {"abort"}
    wait_drained_all(dp2)
    _flush(dp2)
    assert all(r["evictable_tokens"] == 0 for r in replicas(dp2))  # both replicas flushed


def _admitted(server: ServerProcess) -> list[int]:
    return [r["num_requests"] for r in replicas(server)]


def test_dp2_honours_data_parallel_rank_and_the_routers_dp_aware(tmp_path_factory, dp2):
    """A request naming its replica goes there (SGLang's router with --dp-aware registers
    url@0 and url@1 and names the rank in each body); a rank the server lacks is a 400."""
    body = {"text": "which replica?", "sampling_params": GREEDY}
    r = httpx.post(dp2.url + "/generate", json={**body, "data_parallel_rank": 2}, timeout=30)
    assert r.status_code == 400 and "data_parallel_rank 2 is out of range" in r.text, r.text
    before = _admitted(dp2)
    for rank in (1, 1, 0):  # the same prompt: prefix affinity alone would keep one replica
        r = httpx.post(dp2.url + "/generate", json={**body, "data_parallel_rank": rank}, timeout=30)
        assert r.status_code == 200, r.text
    assert [a - b for a, b in zip(_admitted(dp2), before, strict=True)] == [1, 2]

    log_dir = str(tmp_path_factory.mktemp("dp_aware"))
    args = ["--worker-urls", dp2.url, "--policy", "round_robin", "--dp-aware"]
    router = SglangRouter(log_dir, "dp-aware", *args)
    try:
        router.wait_ready()
        before = _admitted(dp2)
        for i in range(6):
            body = {"text": f"{i} through the router", "sampling_params": GREEDY}
            r = httpx.post(router.url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
        assert [a - b for a, b in zip(_admitted(dp2), before, strict=True)] == [3, 3]
    finally:
        router.stop()
    wait_drained_all(dp2)


def test_dp2_round_robin_alternates_and_caches_less(tmp_path_factory, tiny_model, dp2):
    flags = ("--dp-size", "2", "--load-balance-method", "round_robin")
    rr = _start(tmp_path_factory, tiny_model, "dp2rr", *flags)
    try:
        _flush(dp2)
        affinity = cached_ratio(run_workload(dp2.url, seed=1))
        before = [r["num_requests"] for r in replicas(rr)]
        replies = run_workload(rr.url, seed=1)
        after = [r["num_requests"] for r in replicas(rr)]
        ratio = cached_ratio(replies)
        print(f"cached-token ratio, dp2: prefix_affinity {affinity:.3f}, round_robin {ratio:.3f}")
        half = GROUPS * PER_GROUP // 2
        assert [a - b for a, b in zip(after, before, strict=True)] == [half, half]
        assert ratio < affinity, (ratio, affinity)
        wait_drained_all(rr)
    finally:
        rr.stop()


def test_dp2_shortest_queue_then_a_dead_replica_takes_the_server_down(tmp_path_factory, tiny_model):
    sq = _start(
        tmp_path_factory,
        tiny_model,
        "dp2sq",
        "--dp-size",
        "2",
        "--load-balance-method",
        "shortest_queue",
    )
    try:
        longs = LongRequests(sq)
        longs.start("long-1", "A long story, one.")
        wait_running(sq, [1, 0])
        _generate(sq.url, "short")  # to replica 1 (fewer in flight), and done
        longs.start("long-2", "A long story, two.")
        wait_running(sq, [1, 1])  # round_robin would have put it on replica 0
        r = httpx.post(sq.url + "/abort_request", json={"abort_all": True}, timeout=30)
        assert r.json()["aborted"] == 2
        longs.join()
        wait_drained_all(sq)

        info = sq.server_info()
        children = {p.pid for p in psutil.Process(sq.proc.pid).children()}
        assert set(info["scheduler_pids"]) | {info["detokenizer_pid"]} <= children
        survivors = [psutil.Process(p) for p in children - {info["scheduler_pids"][1]}]
        start = time.monotonic()
        os.kill(info["scheduler_pids"][1], signal.SIGKILL)
        assert sq.proc.wait(15) != 0
        assert time.monotonic() - start < 10
        _, alive = psutil.wait_procs(survivors, timeout=5)
        assert not alive, alive
        assert "radixserve-scheduler-dp1 exited with code -9" in sq.log()
    finally:
        sq.stop()


# -- SGLang's router in front of two servers --------------------------------------------------------
def _workers(workers: list[ServerProcess], policy: str) -> list[str]:
    return ["--worker-urls", *(w.url for w in workers), "--policy", policy]


def _metric(server: ServerProcess, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def _router_ratio(
    router: SglangRouter, workers: list[ServerProcess]
) -> tuple[float, dict[str, dict[str, Any]]]:
    """Cached prompt tokens / prompt tokens over the workload sent through `router`, from the
    workers' Prometheus counters (caches flushed first), and the workload's replies."""
    names = ("sglang:cached_tokens_total", "sglang:prompt_tokens_total")
    for w in workers:
        _flush(w)
    before = [[_metric(w, n) for n in names] for w in workers]
    replies = run_workload(router.url, seed=2)
    for w in workers:
        wait_drained_all(w)
    after = [[_metric(w, n) for n in names] for w in workers]
    cached = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    prompt = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return cached / prompt, replies


def test_real_router_cache_aware_in_front_of_two_servers(dp1, dp2, tmp_path_factory):
    """The two servers of the tests above: one plain, one with two replicas."""
    workers = [dp1, dp2]
    log_dir = str(tmp_path_factory.mktemp("routers"))
    aware = SglangRouter(log_dir, "cache_aware", *_workers(workers, "cache_aware"))
    rr = SglangRouter(log_dir, "round_robin", *_workers(workers, "round_robin"))
    try:
        model = aware.wait_ready()
        rr.wait_ready()
        _every_api_through(aware.url, model)
        loads = httpx.get(aware.url + "/get_loads", timeout=30)
        assert loads.status_code == 200, loads.text
        assert all(w.url.split("//")[1] in loads.text for w in workers), loads.text
        for path in ("/get_server_info", "/get_model_info"):
            assert httpx.get(aware.url + path, timeout=30).status_code == 200, path
        aware_ratio, aware_replies = _router_ratio(aware, workers)
        rr_ratio, _ = _router_ratio(rr, workers)
        print(
            f"cached-token ratio via the router: cache_aware {aware_ratio:.3f}, "
            f"round_robin {rr_ratio:.3f}"
        )
        # cache_aware sends every follower to the worker (and replica) that holds its group's
        # prefix: each finds its prefix cached. Round robin splits the groups between the
        # workers, so some followers miss (how many depends on the arrival order and timing:
        # a fixed margin between the two ratios failed on a faster machine, 0.70 vs 0.62).
        followers = {p for g in shared_prefix_groups(2) for p in g[1:]}
        for prompt in followers:
            meta = aware_replies[prompt]["meta_info"]
            assert meta["cached_tokens"] >= 0.8 * meta["prompt_tokens"], (prompt[:40], meta)
        assert aware_ratio >= rr_ratio, (aware_ratio, rr_ratio)
        assert httpx.post(aware.url + "/flush_cache", timeout=30).status_code == 200
        assert all(w.server_info()["evictable_tokens"] == 0 for w in workers)
    finally:
        aware.stop()
        rr.stop()


def _every_api_through(url: str, model: str) -> None:
    """/generate, /v1/completions and /v1/chat/completions, streamed and not, via the router."""
    gen = {"text": "Hello there", "sampling_params": GREEDY}
    r = httpx.post(url + "/generate", json=gen, timeout=120)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == NEW_TOKENS
    with httpx.stream("POST", url + "/generate", json={**gen, "stream": True}, timeout=120) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"]["type"] == "length"
    assert events[-2]["text"] == httpx.post(url + "/generate", json=gen, timeout=120).json()["text"]
    bodies = {
        "/v1/completions": {"prompt": "Once upon", "max_tokens": 4},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    }
    for path, body in bodies.items():
        body = {**body, "model": model, "temperature": 0}
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 4
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and len(events) >= 2, events
        assert events[-2]["choices"] == [] or events[-2]["choices"][0]["finish_reason"], events
