"""The tensor-parallel layers on 2 ranks (a gloo group in two spawned processes) compute what
the dense layers compute: vocab-parallel embedding and head (odd vocabulary: padded split),
column-parallel qkv / gate_up, row-parallel o_proj / down_proj, KV heads split or replicated;
and head counts that cannot be split fail with a clear error."""

from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as tmp
from tp_layer_workers import compare_layers, join_at, tiny_config

from radixserve.distributed.parallel_state import TpGroup, local_head_counts
from radixserve.models.llama import LlamaForCausalLM
from radixserve.utils import free_port


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # 4 heads / 2 KV heads: one KV head per rank
        {"num_key_value_heads": 1},  # MQA: the one KV head replicated on both ranks
        {"tie_word_embeddings": True, "mlp_bias": True, "attention_bias": True},
    ],
    ids=["kv-split", "kv-replicated", "tied-bias"],
)
def test_parallel_layers_equal_dense(overrides):
    tmp.spawn(compare_layers, args=(2, free_port(), overrides), nprocs=2, join=True)


def test_ranks_meet_at_an_ipv6_address_in_brackets():
    # "[::1]:port" passed the argument check, then torch was given tcp://::1:port and every
    # start failed ("Port could not be cast to integer value as ':1:port'").
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError as e:
        pytest.skip(f"no IPv6 loopback on this machine: {e}")
    tmp.spawn(join_at, args=(2, f"[::1]:{free_port()}"), nprocs=2, join=True)


def test_head_counts_split_or_replicate():
    assert local_head_counts(32, 8, 4) == (8, 2)
    assert local_head_counts(32, 2, 8) == (4, 1)  # KV replicated, 4 ranks per KV head
    assert local_head_counts(4, 4, 1) == (4, 4)


@pytest.mark.parametrize(
    "heads,kv,tp,match",
    [(4, 2, 3, "4 attention heads"), (12, 4, 6, "4 KV heads"), (9, 3, 3, None)],
)
def test_unsplittable_head_counts_are_refused(heads, kv, tp, match):
    if match is None:
        assert local_head_counts(heads, kv, tp) == (3, 1)
        return
    with pytest.raises(ValueError, match=match):
        local_head_counts(heads, kv, tp)


def test_model_build_refuses_an_unsplittable_tp_size():
    # The model is built before any collective, so a group object without a backend will do.
    with pytest.raises(ValueError, match="--tp-size 3"):
        LlamaForCausalLM(tiny_config(), TpGroup(0, 3))
    with pytest.raises(ValueError, match="intermediate size"):
        LlamaForCausalLM(tiny_config(intermediate_size=130), TpGroup(0, 4))
