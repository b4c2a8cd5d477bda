"""The dashboard's bounded bookkeeping (issue 13): PerSecond windows, the scheduler's step ring
and token rates (LiveStats), the TokenizerManager's latency window, and the Scheduler's
dashboard snapshot over the fake worker (GET /dashboard/events serves it; see
tests/entrypoints/test_dashboard.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from rs_fake_worker import FakeRun

from radixserve.managers.live_stats import STEP_RING, LatencyWindow, LiveStats, PerSecond
from radixserve.model_executor.forward_batch import ForwardMode


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- windows and the step ring -------------------------------------------------------------------------
def test_per_second_sums_each_second_keeps_maxima_and_forgets_old_seconds():
    clock = Clock()
    w = PerSecond(("a", "b_max"), seconds=5, clock=clock)
    w.add(a=1, b_max=3)
    w.add(a=2, b_max=1)
    clock.now += 1.5
    w.add(a=4)
    assert w.columns() == {"t": [1000, 1001], "a": [3.0, 4.0], "b_max": [3.0, 0.0]}
    assert w.totals(1) == {"a": 4.0, "b_max": 0.0}
    assert w.totals(5) == {"a": 7.0, "b_max": 3.0}
    clock.now += 5  # second 1000 and 1001 leave the 5 s window
    assert w.columns()["t"] == []
    for _ in range(100):
        clock.now += 1
        w.add(a=1)
    assert len(w._buckets) == 5, "one bucket per second of the window at most"
    assert w.totals(5)["a"] == 5.0


def _batch(mode: ForwardMode, tokens: int, reqs: int, decoding: int = 0) -> Any:
    return SimpleNamespace(
        forward_mode=mode, input_ids=[0] * tokens, reqs=[None] * reqs, decoding_reqs=[0] * decoding
    )


def test_live_stats_records_each_steps_composition_in_a_bounded_ring():
    clock = Clock()
    live = LiveStats(steps=3, clock=clock)
    stats = SimpleNamespace(prompt_tokens=0, cached_tokens=0, generation_tokens=0)
    live.on_step(_batch(ForwardMode.EXTEND, 100, 2), stats)
    live.on_step(_batch(ForwardMode.MIXED, 40, 6, decoding=4), stats)
    live.on_step(_batch(ForwardMode.DECODE, 5, 5), stats)
    live.on_step(None, stats)  # an idle step adds no record
    steps = live.snapshot()["steps"]
    assert steps["mode"] == ["prefill", "mixed", "decode"]
    assert steps["prefill"] == [100, 36, 0] and steps["decode"] == [0, 4, 5]
    assert steps["batch"] == [2, 6, 5]
    for _ in range(50):
        live.on_step(_batch(ForwardMode.DECODE, 5, 5), stats)
    assert len(live.snapshot()["steps"]["mode"]) == 3


def test_live_stats_counts_new_tokens_per_second_once():
    clock = Clock()
    live = LiveStats(clock=clock)
    stats = SimpleNamespace(prompt_tokens=100, cached_tokens=60, generation_tokens=5)
    live.on_step(None, stats)
    live.on_step(None, stats)  # nothing new: nothing added twice
    clock.now += 1
    stats.generation_tokens = 25
    live.on_step(None, stats)
    tp = live.snapshot()["throughput"]
    assert tp["series"] == {
        "t": [1000, 1001],
        "prompt": [100.0, 0.0],
        "cached": [60.0, 0.0],
        "generation": [5.0, 20.0],
    }
    assert tp["generation_tps"] == pytest.approx(25 / tp["rate_window_s"])
    assert tp["window_hit_rate"] == pytest.approx(0.6)


def test_latency_window_takes_ttft_and_tpot_from_streaming_requests_and_e2e_from_all():
    clock = Clock()
    lw = LatencyWindow(clock=clock)
    streamed = SimpleNamespace(stream=True, created=10.0, last_time=0.0)
    lw.on_output(streamed, 1, 10.5, None)  # first token after 0.5 s
    streamed.last_time = 10.5
    lw.on_output(streamed, 2, 10.7, {"type": "length"})  # 2 tokens in 0.2 s
    plain = SimpleNamespace(stream=False, created=10.0, last_time=0.0)
    lw.on_output(plain, 8, 13.0, {"type": "length"})  # all at once: only its e2e counts
    snap = lw.snapshot()
    assert snap["ttft_mean"] == pytest.approx(0.5) and snap["ttft_max"] == pytest.approx(0.5)
    assert snap["tpot_mean"] == pytest.approx(0.1)
    assert snap["e2e_mean"] == pytest.approx((0.7 + 3.0) / 2)
    assert (snap["streamed_requests"], snap["finished_requests"]) == (1, 2)
    assert LatencyWindow().snapshot()["ttft_mean"] is None


# -- the scheduler's snapshot --------------------------------------------------------------------
def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7 + i * 3) % 90 + 3 for i in range(n)]


def test_scheduler_snapshot_under_load_and_after_it_drains():
    run = FakeRun(
        total_tokens=4096, overlap=False, enable_mixed_chunk=True, chunked_prefill_size=32
    )
    shared = _prompt(1, 40)
    for i in range(6):
        run.submit(f"r{i}", shared + _prompt(10 + i, 6), max_new=12, stream=True)
    for _ in range(4):
        run.step()
    busy = run.s.dashboard_snapshot()
    assert busy["running"] + busy["queued"] + busy["chunked"] > 0
    assert busy["protected_tokens"] > 0
    free = busy["available_tokens"] + busy["evictable_tokens"] + busy["protected_tokens"]
    assert free <= busy["max_total_num_tokens"]
    run.drain()
    snap = run.s.dashboard_snapshot()
    steps = snap["steps"]
    assert {"prefill", "decode"} <= set(steps["mode"])
    assert len(steps["mode"]) <= STEP_RING
    # Every sampled token came out of some step; the ring (not yet full) saw every step.
    assert sum(steps["prefill"]) == snap["prompt_tokens"] - snap["cached_tokens"]
    assert snap["generation_tokens"] == 6 * 12
    assert sum(snap["throughput"]["series"]["generation"]) == 6 * 12
    assert sum(snap["throughput"]["series"]["prompt"]) == snap["prompt_tokens"] == 6 * 46
    assert snap["cached_tokens"] > 0
    top = snap["tree"]["top_prefixes"][0]
    assert (top["leaves"], top["tokens"], top["locks"]) == (6, 40, 0)
    assert (top["head_ids"], top["tail_ids"]) == (shared, [])  # 40 <= 2 x 24 tokens
    assert snap["running"] == snap["queued"] == snap["chunked"] == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_request_prefilling_in_chunks_counts_as_running_and_the_queue_as_load(overlap):
    """For all the steps of a chunked prefill the server said it ran nothing (running 0 and
    nothing queued: /get_load's num_reqs 0), and the queue's prompts were not in /get_load's
    num_tokens, which SGLang's router balances on (a long queue looked like an idle server)."""
    from radixserve.entrypoints.http_server import _load

    run = FakeRun(total_tokens=4096, overlap=overlap, chunked_prefill_size=16, max_running=1)
    run.submit("long", _prompt(1, 100), max_new=4)
    run.submit("next", _prompt(2, 30), max_new=4)
    for _ in range(3):
        run.step()
        info = run.s.get_server_info()
        assert (info["running"], info["queued"], info["queued_tokens"]) == (1, 1, 30)
        load = _load(info)
        assert load["num_reqs"] == 2 and load["num_waiting_reqs"] == 1
        used = info["max_total_num_tokens"] - info["available_tokens"] - info["evictable_tokens"]
        assert load["num_tokens"] == used + 30 and used > 0
    run.drain()
    info = run.s.get_server_info()
    assert (info["running"], info["queued"], info["queued_tokens"]) == (0, 0, 0)


def test_the_step_ring_stays_bounded_over_a_long_run():
    run = FakeRun(total_tokens=4096, overlap=False)
    run.submit("long", _prompt(3, 8), max_new=STEP_RING + 50)
    run.drain()
    snap = run.s.dashboard_snapshot()
    assert len(snap["steps"]["mode"]) == STEP_RING
    assert set(snap["steps"]["mode"]) == {"decode"}
