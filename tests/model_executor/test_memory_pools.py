"""The pools a ModelRunner sizes from its flags."""

from __future__ import annotations

import logging

import pytest
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


def test_the_tp_ranks_of_one_cpu_host_share_its_memory(tmp_path, monkeypatch):
    # Each TP rank took --mem-fraction-static of the host's whole free memory: --tp-size 4 at
    # the default 0.2 committed 80% of it to KV. The ranks of one machine share the fraction;
    # a rank on a machine of its own (--nnodes) has the whole of it.
    monkeypatch.setattr(
        "radixserve.model_executor.model_runner._mem_available_bytes", lambda: 2**30
    )
    path = make_tiny_model_dir(str(tmp_path / "m"))

    def pool_tokens(**kw) -> int:
        args = ServerArgs(model_path=path, device="cpu", dtype="float32", **kw)
        return ModelRunner(args.resolve()).max_total_num_tokens

    alone = pool_tokens()
    assert pool_tokens(tp_size=2, dist_init_addr="127.0.0.1:1234") == alone // 2
    two_nodes = {"nnodes": 2, "node_rank": 0, "dist_init_addr": "127.0.0.1:1234"}
    assert pool_tokens(tp_size=2, **two_nodes) == alone
    # An explicit pool is checked against the rank's share too.
    with pytest.raises(ValueError, match="a share for each of 2 TP ranks"):
        pool_tokens(tp_size=2, dist_init_addr="127.0.0.1:1234", max_total_tokens=alone * 3)
