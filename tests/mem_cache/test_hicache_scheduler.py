"""The hierarchical cache inside the real Scheduler, over the fake worker (whose "KV" is the
token id and position written at each slot, and whose every step checks that a request's row
points at the right KV): multi-turn prefixes far beyond the device pool are demoted to the
host and loaded back, outputs stay exact, nothing leaks in any tier (integrity checks on)."""

from __future__ import annotations

import random

import pytest
from rs_fake_worker import FakeRun, expected_output

DEVICE_TOKENS = 512


def _conversations(n: int, turns: int, seed: int = 0) -> list[list[list[int]]]:
    """n conversations; turn t's prompt is turn t-1's prompt plus 80 new tokens."""
    rng = random.Random(seed)
    convs = []
    for _ in range(n):
        prompt, turns_of = [], []
        for _ in range(turns):
            prompt = prompt + [rng.randrange(3, 97) for _ in range(80)]
            turns_of.append(list(prompt))
        convs.append(turns_of)
    return convs


def _run(overlap: bool, **flags) -> tuple[FakeRun, dict[str, int]]:
    run = FakeRun(
        total_tokens=DEVICE_TOKENS,
        max_running=4,
        overlap=overlap,
        chunked_prefill_size=256,
        **flags,
    )
    convs = _conversations(6, 4)
    cached: dict[str, int] = {}
    for t in range(4):  # round-robin over conversations: each one's prefix is evicted between
        for c, conv in enumerate(convs):
            rid = f"c{c}t{t}"
            run.submit(rid, conv[t], max_new=8)
            run.drain()
    got = run.tokens()
    for c, conv in enumerate(convs):
        for t in range(4):
            assert got[f"c{c}t{t}"] == expected_output(conv[t], 8), f"c{c}t{t}"
    for msg in run.outs:
        for rid, n in zip(msg.rids, msg.cached_tokens, strict=True):
            cached[rid] = n
    return run, cached


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_host_tier_serves_prefixes_evicted_from_the_device(policy, overlap):
    base, base_cached = _run(overlap)
    hi, hi_cached = _run(overlap, enable_hierarchical_cache=True, hicache_write_policy=policy)
    # 6 conversations × up to 320 tokens ≈ 4× the device pool: the plain cache loses them.
    assert sum(hi_cached.values()) > 2 * sum(base_cached.values())
    info = hi.s.get_server_info()
    assert info["hicache_host_hit_tokens"] > 0
    assert info["hicache_device_to_host_tokens"] > 0
    hi.s.hicache.check_integrity()
    assert info["available_tokens"] + info["evictable_tokens"] == info["max_total_num_tokens"]
