"""Property-based test of the scheduler over a fake model: random arrivals, lengths, shared
prefixes, aborts, tiny KV pools and page sizes 1, 4 and 16, in the overlap loop (the fake
worker on the forward thread, future input ids) and in the normal loop, requests of three LoRA
adapters and of none (at most MAX_LORAS adapters per batch). After every step the invariants
of DESIGN §5 hold (2–6, 9, 11, 12) and the batches keep the adapter cap, and every request's
output equals the fake model's sequence."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rs_fake_worker import FakeWorker, expected_output

from radixserve.args import ServerArgs
from radixserve.io_struct import AbortReq, TokenizedGenerateReqInput
from radixserve.managers.scheduler import Scheduler
from radixserve.sampling_params import SamplingParams

request_st = st.fixed_dictionaries(
    {
        "prefix": st.integers(0, 3),  # which shared prefix (0 = none)
        "prefix_len": st.integers(0, 80),
        "tail_len": st.integers(1, 60),
        "max_new": st.integers(1, 40),
        "arrive": st.integers(0, 30),  # step at which it arrives
        "abort_at": st.one_of(st.none(), st.integers(0, 60)),
        # Abort k steps after the request first ran (0: right after the step of its first
        # prefill or chunk, while it lives only in last_batch).
        "abort_after_run": st.one_of(st.none(), st.integers(0, 6)),
        "seed": st.integers(0, 1000),
        "lora": st.sampled_from([None, None, "x", "y", "z"]),
    }
)
MAX_LORAS = 2


def _prompt(spec: dict) -> list[int]:
    prefix = (
        [(spec["prefix"] * 13 + i) % 90 + 3 for i in range(spec["prefix_len"])]
        if spec["prefix"]
        else []
    )
    tail = [(spec["seed"] * 7 + i * 3) % 90 + 3 for i in range(spec["tail_len"])]
    return prefix + tail


def _check_invariants(s: Scheduler, streamed: dict[str, list[int]], admitted: set[str]) -> None:
    s.check_integrity()
    batches = [s.running_batch] + ([s.last_batch] if s.last_batch is not None else [])
    for b in batches:
        assert len(b.seq_lens) == len(b.reqs)  # invariant 6
        for r in b.reqs:
            assert r.rid in admitted or r.admitted  # invariant 2
            assert r.kv_allocated_len >= r.kv_committed_len  # invariant 5
    loras = {r.lora_id for b in batches for r in b.reqs if r.lora_id and not r.finished()}
    assert len(loras) <= MAX_LORAS, loras  # --max-loras-per-batch
    for b in batches:
        for r in b.reqs:
            if not r.finished():
                # Invariant 11: streamed tokens never run ahead of real outputs (chunks emit none).
                assert len(streamed.get(r.rid, [])) <= len(r.output_ids)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request_st, min_size=1, max_size=12),
    page_size=st.sampled_from([1, 4, 16]),
    pool_pages=st.integers(24, 80),
    chunk=st.sampled_from([None, 16, 32, 64]),
    policy=st.sampled_from(["fcfs", "lpm", "dfs-weight", "lof", "random", "priority"]),
    radix=st.booleans(),
    mixed=st.booleans(),
    overlap=st.booleans(),
    spec=st.sampled_from([None, None, "always", "adaptive"]),
)
def test_scheduler_invariants(
    reqs, page_size, pool_pages, chunk, policy, radix, mixed, overlap, spec
):
    _drive(reqs, page_size, pool_pages * 16, chunk, policy, radix, mixed, 6, overlap, spec)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request_st, min_size=140, max_size=200),
    page_size=st.sampled_from([1, 16]),
    chunk=st.sampled_from([None, 16]),
    policy=st.sampled_from(["lpm", "dfs-weight", "fcfs"]),
    mixed=st.booleans(),
    overlap=st.booleans(),
    spec=st.sampled_from([None, "always"]),
)
def test_scheduler_invariants_at_load(reqs, page_size, chunk, policy, mixed, overlap, spec):
    """More waiting requests than lpm's fallback threshold (128) and more running requests
    than the chunk holds, on a pool that forces eviction and retraction."""
    _drive(reqs, page_size, 2048, chunk, policy, True, mixed, 40, overlap, spec)


def _drive(
    reqs, page_size, total, chunk, policy, radix, mixed, max_running, overlap, spec=None
) -> None:
    """`spec`: NGRAM speculative decoding, drafting at every step ("always") or as the
    adaptive controller decides; the fake model then repeats itself (a window of 2 tokens)
    so that drafts are accepted, and the normal loop runs."""
    window = 2 if spec else None
    worker = FakeWorker(
        total_tokens=total,
        max_running=max_running,
        context_len=512,
        page_size=page_size,
        window=window,
    )
    args = ServerArgs(
        device="cpu",
        dtype="float32",
        page_size=page_size,
        chunked_prefill_size=chunk if chunk else -1,
        schedule_policy=policy,
        disable_radix_cache=not radix,
        enable_mixed_chunk=mixed,
        max_prefill_tokens=256,
        disable_overlap_schedule=not overlap,
        enable_integrity_checks=True,  # invariant 9 is checked at each launch
        speculative_algorithm="NGRAM" if spec else None,
        speculative_disable_adaptive=spec == "always",
        max_loras_per_batch=MAX_LORAS,
    ).resolve()
    outputs: list = []
    s = Scheduler(args, outputs.append, tokenizer=None, tp_worker=worker)
    s.lora_names = {"x", "y", "z"}  # (the fake model ignores adapters; the scheduler does not)
    s.enable_overlap = overlap  # whatever CPUs this machine has
    try:
        _run(s, reqs, outputs, window)
    finally:
        s.close()


def _run(s: Scheduler, reqs, outputs: list, window: int | None = None) -> None:
    specs = {f"r{i}": spec for i, spec in enumerate(reqs)}
    prompts = {rid: _prompt(spec) for rid, spec in specs.items()}
    streamed: dict[str, list[int]] = {}
    finished: dict[str, dict] = {}
    first_ran: dict[str, int] = {}
    abort_sent: set[str] = set()  # aborted while not finished: must end as "abort"
    admitted: set[str] = set()
    step = 0
    while step < 5000:
        for rid, spec in specs.items():
            if spec["arrive"] == step:
                sp = SamplingParams(
                    max_new_tokens=spec["max_new"], temperature=0.0, ignore_eos=True
                )
                lora = spec["lora"]
                key = None if lora is None else f"lora:{lora}"  # the TokenizerManager's namespace
                s.process_input_requests(
                    [
                        TokenizedGenerateReqInput(
                            rid, None, prompts[rid], sp, extra_key=key, lora_id=lora
                        )
                    ]
                )
            after = spec["abort_after_run"]
            if spec["abort_at"] == step or (
                after is not None and first_ran.get(rid, -99) + after + 1 == step
            ):
                if rid not in finished and spec["arrive"] <= step:
                    abort_sent.add(rid)
                s.process_input_requests([AbortReq(rid)])
        if step > 30 and not s.has_work():
            break
        batch = s.step()
        for r in batch.reqs if batch is not None else []:
            first_ran.setdefault(r.rid, step)
        for msg in outputs:
            for rid, ids, reason in zip(
                msg.rids, msg.output_ids, msg.finished_reasons, strict=True
            ):
                assert rid not in finished, "output after finish"
                streamed.setdefault(rid, []).extend(ids)
                if reason is not None:
                    finished[rid] = reason
        outputs.clear()
        _check_invariants(s, streamed, admitted)
        step += 1
    assert not s.has_work(), "scheduler did not drain"
    s.assert_drained()  # invariant 12
    for rid, spec in specs.items():
        reason = finished.get(rid)
        assert reason is not None, f"{rid} never finished"
        want = expected_output(prompts[rid], spec["max_new"], window)
        got = streamed.get(rid, [])
        if rid in abort_sent:
            assert reason["type"] == "abort", f"{rid}: the abort was lost ({reason})"
        if reason["type"] == "abort":
            assert got == want[: len(got)]
        else:
            assert reason["type"] == "length"
            assert got == want
