"""The load a P/D server reports counts the requests its P/D side holds (waiting for a
reservation or for their KV): /metrics' num_queue_reqs and /get_load read 0 while a decode
server held 60 of them, and SGLang's router balanced onto it as if it were idle."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
from rs_testing import make_tiny_served_model

from radixserve.managers.request_checks import RequestError
from radixserve.utils import free_port


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_served_model(str(tmp_path_factory.mktemp("pd_load_model")))


def test_requests_waiting_for_their_prefill_peer_count_as_queued(model):
    from radixserve import Engine

    decode = Engine(
        model_path=model,
        dtype="float32",
        max_total_tokens=512,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="fake",
    )
    try:
        pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": free_port()}  # nobody there

        def one(i: int) -> None:
            try:
                decode.generate(
                    input_ids=[5 + i] * 40,
                    sampling_params={"max_new_tokens": 4},
                    bootstrap_room=i,
                    **pd,
                )
            except RequestError:
                pass  # (fails once the silent peer is taken for dead)

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(one, i) for i in range(3)]
            seen = None
            deadline = time.monotonic() + 4  # before PEER_SILENT_S fails them
            while time.monotonic() < deadline:
                seen = decode.get_server_info()
                if seen["queued"] == 3:
                    break
                time.sleep(0.05)
            for f in futures:
                f.result(timeout=60)
        assert seen is not None and seen["queued"] == 3, seen
        assert seen["queued_tokens"] == 3 * 40
        assert decode.get_server_info()["queued"] == 0
    finally:
        decode.shutdown()
