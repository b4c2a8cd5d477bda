"""The pools a ModelRunner sizes from its flags."""

from __future__ import annotations

import logging

from rs_testing import make_tiny_model_dir

from radixserve.args import ServerArgs
from radixserve.model_executor.model_runner import ModelRunner


def test_more_running_requests_than_pool_tokens_are_capped_to_the_pool(tmp_path, caplog):
    # --max-running-requests 10**9 once allocated 10**9 request rows of the context's width
    # (terabytes) and the scheduler died at start; no more requests than the pool's tokens can
    # ever run, since each holds at least one.
    path = make_tiny_model_dir(str(tmp_path / "m"))
    args = ServerArgs(
        model_path=path,
        device="cpu",
        dtype="float32",
        max_total_tokens=96,
        max_running_requests=10**9,
    )
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(args.resolve())
    assert runner.max_running_requests == 96
    assert runner.req_to_token_pool.size == 96
    assert "running at most 96" in caplog.text
