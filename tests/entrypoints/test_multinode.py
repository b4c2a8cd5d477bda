"""Tensor parallelism across machines, on one machine: `--nnodes 2` with one TP rank per
"node", node 0 a full server and node 1 (`--node-rank 1`) running only its scheduler rank.
They meet at --dist-init-addr (gloo on loopback) and serve transformers' greedy tokens; when
node 0 stops, node 1's rank fails in its next collective and node 1 exits. Nodes started
with other flags are refused at start."""

from __future__ import annotations

import concurrent.futures
import random
import subprocess

import httpx
import pytest
from rs_testing import make_tiny_served_model, reference_greedy
from test_http_server import ServerProcess

from radixserve.utils import free_port

NEW_TOKENS = 16
LENGTHS = [5, 70, 17, 40, 9, 33]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_served_model(str(tmp_path_factory.mktemp("multinode_tiny")))


def test_two_nodes_serve_greedy_tokens_and_node_1_stops_with_node_0(tmp_path, tiny_model):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in LENGTHS]
    reference = reference_greedy(tiny_model, prompts, NEW_TOKENS)
    flags = ["--model-path", tiny_model, "--tp-size", "2", "--nnodes", "2"]
    flags += ["--dist-init-addr", f"127.0.0.1:{free_port()}"]
    node1 = ServerProcess(str(tmp_path), *flags, "--node-rank", "1")
    node0 = ServerProcess(str(tmp_path), *flags, "--node-rank", "0")
    try:
        node0.wait_ready()
        info = node0.server_info()
        assert info["tp_size"] == 2

        def generate(ids: list[int]) -> list[int]:
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0},
            }
            r = httpx.post(node0.url + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["output_ids"]

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(generate, prompts)) == reference
        assert "node 1 of 2 ready: TP ranks 1-1" in node1.log()
        assert node1.proc.poll() is None

        node0.stop()
        try:
            code = node1.proc.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 1 kept running after node 0 stopped:\n{node1.log()[-3000:]}")
        assert code != 0 and "node 1 stops" in node1.log()
    finally:
        node0.stop()
        node1.stop()


def test_a_node_started_with_other_flags_is_refused(tmp_path, tiny_model):
    """Node 1 with another --chunked-prefill-size: both nodes stop at start with the flag named
    (they used to fail in a collective with a bare gloo error)."""
    flags = ["--model-path", tiny_model, "--tp-size", "2", "--nnodes", "2"]
    flags += ["--dist-init-addr", f"127.0.0.1:{free_port()}", "--chunked-prefill-size", "64"]
    node1 = ServerProcess(str(tmp_path), *flags, "--node-rank", "1", "--chunked-prefill-size", "32")
    node0 = ServerProcess(str(tmp_path), *flags, "--node-rank", "0")
    try:
        for node in (node0, node1):
            try:
                node.proc.wait(180)
            except subprocess.TimeoutExpired:
                pytest.fail(f"a node kept running:\n{node.log()[-3000:]}")
            assert node.proc.returncode != 0
        message = "TP rank 1 does not run what rank 0 runs: --chunked-prefill-size 32 (rank 0: 64)"
        assert message in node0.log() and message in node1.log()
    finally:
        node0.stop()
        node1.stop()


def test_a_worker_node_stops_at_a_signal_during_its_start_up(tmp_path, tiny_model):
    """Node 1 waiting for node 0 (or loading the model): SIGTERM and Ctrl-C only set a flag
    that was read once the start-up was over, so it ran on for up to 10 minutes."""
    import os
    import signal
    import time

    flags = ["--model-path", tiny_model, "--tp-size", "2", "--nnodes", "2"]
    flags += ["--dist-init-addr", f"127.0.0.1:{free_port()}", "--node-rank", "1"]
    node1 = ServerProcess(str(tmp_path), *flags)  # node 0 never comes
    try:
        deadline = time.monotonic() + 120
        while "waiting for the other ranks" not in node1.log():
            assert node1.proc.poll() is None, node1.log()[-3000:]
            assert time.monotonic() < deadline, node1.log()[-3000:]
            time.sleep(0.2)
        os.kill(node1.proc.pid, signal.SIGTERM)  # the main process only, as `kill` sends it
        try:
            code = node1.proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 1 ignored SIGTERM during start-up:\n{node1.log()[-3000:]}")
        assert code == 0 and "signal received during start-up" in node1.log()
        # ... and took its scheduler rank with it.
        out = subprocess.run(
            ["ps", "-o", "pid=,args=", "-s", str(node1.proc.pid)], capture_output=True, text=True
        )
        running = [line for line in out.stdout.splitlines() if "<defunct>" not in line]
        assert running == [], out.stdout
    finally:
        node1.stop()
