"""--tp-size / --tp and the multi-machine flags: parsed from the CLI, validated with clear
errors, resolved (a free loopback rendezvous port), and the combinations TP does not serve
(quantization, speculative decoding, more than one machine) refused at start-up."""

from __future__ import annotations

import argparse

import pytest

from radixserve.args import ServerArgs


def _parse(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(list(argv)))


def test_tp_flag_and_alias():
    assert _parse("--device", "cpu").tp_size == 1
    assert _parse("--device", "cpu", "--tp-size", "2").tp_size == 2
    assert _parse("--device", "cpu", "--tp", "2").tp_size == 2


def test_a_free_loopback_rendezvous_is_picked_when_none_is_given():
    args = ServerArgs(device="cpu", tp_size=2).resolve()
    host, port = args.dist_init_addr.rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    given = ServerArgs(device="cpu", tp_size=2, dist_init_addr="10.0.0.1:5000").resolve()
    assert given.dist_init_addr == "10.0.0.1:5000"
    assert ServerArgs(device="cpu").resolve().dist_init_addr is None  # one rank: no group


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"tp_size": 0}, "--tp-size must be >= 1"),
        ({"tp_size": -2}, "--tp-size must be >= 1"),
        ({"nnodes": 0}, "--nnodes must be >= 1"),
        ({"node_rank": 1}, "--node-rank 1 needs --nnodes > 1"),
        ({"node_rank": -1}, "--node-rank"),
        ({"nnodes": 2, "node_rank": 2, "tp_size": 2, "dist_init_addr": "h:1"}, "--node-rank 2"),
        ({"nnodes": 2, "tp_size": 2}, "--dist-init-addr"),
        ({"nnodes": 2, "tp_size": 3, "dist_init_addr": "h:1"}, "divisible by --nnodes"),
        ({"tp_size": 2, "dist_init_addr": "nohost"}, "host:port"),
        ({"tp_size": 2, "dist_init_addr": "h:99999"}, "host:port"),
        # torch's "port number missing" once the model had loaded
        ({"tp_size": 2, "dist_init_addr": "tcp://127.0.0.1:1234"}, "no scheme"),
        ({"tp_size": 2, "dist_init_addr": " 127.0.0.1:1234"}, "host:port"),
        # node 0 listens on both: "address already in use" once every rank had loaded
        ({"tp_size": 2, "port": 1234, "dist_init_addr": "127.0.0.1:1234"}, "different ports"),
    ],
)
def test_invalid_parallel_flags_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(device="cpu", **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"quantization": "int8"}, "--quantization"),
        ({"speculative_algorithm": "NGRAM"}, "speculative"),
    ],
)
def test_unsupported_combinations_are_refused_at_start_up(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(device="cpu", tp_size=2, **kwargs).resolve()


def test_a_dist_init_host_that_does_not_resolve_is_refused_at_start_up():
    # Every rank, node 0's too, waited for the rendezvous (10 minutes) in silence.
    args = ServerArgs(device="cpu", tp_size=2, dist_init_addr="nosuchhost.invalid:1234")
    with pytest.raises(ValueError, match="'nosuchhost.invalid' does not resolve"):
        args.resolve()
    # The same port on another node's host is no clash: only node 0 listens on it.
    ServerArgs(device="cpu", tp_size=2, nnodes=2, node_rank=1, port=1234, dist_init_addr="h:1234")


def test_each_node_runs_its_share_of_the_ranks():
    args = [
        ServerArgs(device="cpu", tp_size=4, nnodes=2, node_rank=r, dist_init_addr="h:1")
        for r in (0, 1)
    ]
    assert [list(a.local_tp_ranks) for a in args] == [[0, 1], [2, 3]]
    assert list(ServerArgs(device="cpu", tp_size=2).local_tp_ranks) == [0, 1]
