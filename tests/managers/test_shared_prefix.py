"""Cache-aware scheduling on the shared-prefix workload: 8 groups × 8 requests, a 512-token group
prefix plus a 32-token question, 32 new tokens, all arriving at once in shuffled order."""

from __future__ import annotations

import random

from rs_fake_worker import FakeWorker, expected_output

from radixserve.args import ServerArgs
from radixserve.io_struct import TokenizedGenerateReqInput
from radixserve.managers.scheduler import Scheduler
from radixserve.sampling_params import SamplingParams


def _workload(seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    prompts = {}
    for g in range(8):
        prefix = [rng.randrange(3, 97) for _ in range(512)]
        for q in range(8):
            prompts[f"g{g}q{q}"] = prefix + [rng.randrange(3, 97) for _ in range(32)]
    items = list(prompts.items())
    rng.shuffle(items)
    return dict(items)


def _run(policy: str, chunk: int) -> tuple[float, Scheduler]:
    worker = FakeWorker(total_tokens=40_000, max_running=64, context_len=1024)
    args = ServerArgs(
        device="cpu",
        dtype="float32",
        schedule_policy=policy,
        chunked_prefill_size=chunk,
        max_prefill_tokens=4096,
    ).resolve()
    outs: list = []
    s = Scheduler(args, outs.append, None, worker)
    prompts = _workload()
    for rid, p in prompts.items():
        sp = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
        s.process_input_requests([TokenizedGenerateReqInput(rid, None, p, sp)])
    while s.has_work():
        s.step()
    s.assert_drained()
    got: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for m in outs:
        for i, rid in enumerate(m.rids):
            got.setdefault(rid, []).extend(m.output_ids[i])
            cached[rid] = m.cached_tokens[i]
    for rid, p in prompts.items():
        assert got[rid] == expected_output(p, 32)
    stats = s.stats
    assert stats.prompt_tokens == 64 * 544
    assert stats.cached_tokens == sum(cached.values())
    return stats.cached_tokens / stats.prompt_tokens, s


def test_lpm_reaches_the_cache_ratio_and_beats_fcfs():
    lpm, _ = _run("lpm", chunk=4096)
    fcfs, _ = _run("fcfs", chunk=4096)
    assert lpm >= 0.8
    assert lpm > fcfs


def test_lpm_with_default_cpu_chunking():
    ratio, _ = _run("lpm", chunk=512)
    assert ratio >= 0.8
