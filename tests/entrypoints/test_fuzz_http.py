"""Fuzz the HTTP API with schemathesis, from the server's own OpenAPI document, against a real
server (scheduler and detokenizer subprocesses, integrity checks on) serving a tiny random
model with a byte-level tokenizer and a 256-token context, so that any request ends quickly.

Checked: no 5xx status and no 5xx error event inside a 200 stream, no hang (every request has a
timeout), and afterwards the server is healthy and every KV slot is free or evictable with
nothing locked. Bounded for `make test`: MAX_EXAMPLES per operation, derandomized, no
shrinking. Deeper runs: RADIXSERVE_FUZZ_EXAMPLES=300 and RADIXSERVE_FUZZ_SEED=<n> (random
examples from that seed).
"""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from rs_testing import make_tiny_served_model
from schemathesis.generation import GenerationMode
from test_http_server import ServerProcess

from radixserve.args import ServerArgs
from radixserve.entrypoints.http_server import build_app

pytestmark = pytest.mark.fuzz

CONTEXT_LENGTH = 256  # every request ends within 256 tokens
MAX_EXAMPLES = int(os.environ.get("RADIXSERVE_FUZZ_EXAMPLES", "15"))  # per operation
SEED = os.environ.get("RADIXSERVE_FUZZ_SEED")
GENERATION = ("POST /generate", "POST /v1/completions", "POST /v1/chat/completions")
REQUEST_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    model = make_tiny_served_model(str(tmp_path_factory.mktemp("fuzz_model")))
    extra = ["--model-path", model, "--context-length", str(CONTEXT_LENGTH)]
    proc = ServerProcess(str(tmp_path_factory.mktemp("fuzz_server")), *extra)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def api_document() -> dict[str, Any]:
    """The server's OpenAPI document, built from the same app the server runs (cases are
    generated per operation at collection time, before any server starts)."""
    return build_app(ServerArgs(model_path="tiny"), lambda metrics: None).openapi()


STATUSES: dict[str, collections.Counter] = {}
SCHEMA = schemathesis.openapi.from_dict(api_document())
OPERATIONS = {op.label: op for op in (r.ok() for r in SCHEMA.get_all_operations())}


@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_no_server_error_and_no_hang(label, fuzz_server):
    """Valid and invalid requests (schemathesis' positive and negative modes) per operation.
    No shrinking: every example is a real request, and after a crash all of them fail."""
    assert fuzz_server.proc.poll() is None, "the server died earlier in the fuzz"
    operation = OPERATIONS[label]

    def check(case: Any) -> None:
        response = _call(case, fuzz_server)
        STATUSES.setdefault(label, collections.Counter())[response.status_code] += 1
        repro = f"{response.status_code} {response.text[:500]}\n{case.as_curl_command()}"
        assert response.status_code < 500, repro
        if "text/event-stream" in str(response.headers.get("content-type")):
            assert not _server_error_events(response.text), repro

    run = given(case=st.one_of(operation.as_strategy(mode) for mode in GenerationMode))(check)
    if SEED is not None:
        run = seed(int(SEED))(run)
    settings(
        max_examples=MAX_EXAMPLES,
        derandomize=SEED is None,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
    )(run)()


def _call(case: Any, server: ServerProcess) -> Any:
    """The response; a timeout (hang) or a dropped connection fails with the request."""
    try:
        return case.call(base_url=server.url, timeout=REQUEST_TIMEOUT_S)
    except requests.RequestException as e:
        alive = "alive" if server.proc.poll() is None else "dead"
        log = server.log()[-3000:]
        pytest.fail(f"{type(e).__name__} (server {alive}) on\n{case.as_curl_command()}\n{log}")


def _server_error_events(body: str) -> list[Any]:
    """Error events of a 5xx code inside a stream (the status was sent before they happened)."""
    events = []
    for line in body.splitlines():
        if line.startswith("data: {"):
            error = json.loads(line[len("data: ") :]).get("error")
            if isinstance(error, dict) and error.get("code", 0) >= 500:
                events.append(error)
    return events


def test_server_healthy_and_drained_after_fuzz(fuzz_server):
    """Runs after the fuzz (file order): alive, and every slot free with nothing locked."""
    statuses = {label: dict(counts) for label, counts in STATUSES.items()}
    if any(label in STATUSES for label in GENERATION):  # the model ran, not just validation
        assert any(STATUSES.get(label, {}).get(200) for label in GENERATION), statuses
    assert fuzz_server.proc.poll() is None, fuzz_server.log()[-3000:]
    assert httpx.get(fuzz_server.url + "/health", timeout=30).status_code == 200
    served = httpx.get(fuzz_server.url + "/openapi.json", timeout=30).json()
    assert served["paths"].keys() == SCHEMA.raw_schema["paths"].keys()  # the fuzzed document
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        info = fuzz_server.server_info()
        free = info["available_tokens"] + info["evictable_tokens"]
        idle = info["running"] == 0 and info["queued"] == 0
        if idle and free == info["max_total_num_tokens"] and info["protected_tokens"] == 0:
            return
        assert time.monotonic() < deadline, f"not drained after {DRAIN_TIMEOUT_S} s: {info}"
        time.sleep(0.2)
