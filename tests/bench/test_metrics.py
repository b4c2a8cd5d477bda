"""Metric arithmetic of `radixserve.bench.metrics` on hand-made timestamps.

Expected values are worked out by hand in the comments (percentiles use numpy's linear
interpolation, as SGLang's bench_serving does).
"""

from __future__ import annotations

import json
import math

import pytest

from radixserve.bench.metrics import (
    RequestRecord,
    append_jsonl,
    compute_metrics,
    first_error,
    format_metrics,
)


def _record(start, chunks, end, output_len, prompt_len, cached=None, success=True, error=""):
    rec = RequestRecord(prompt_len=prompt_len, start_time=start, end_time=end)
    for t, n in chunks:
        rec.add_chunk(t, n)
    rec.output_len, rec.cached_tokens, rec.success, rec.error = output_len, cached, success, error
    return rec


@pytest.fixture
def records():
    return [
        # A: ttft 0.5; ITL 0.2, then a 2-token chunk after 0.3 s -> 0.15, 0.15; e2e 1.1;
        #    tpot (1.1 - 0.5) / 3 = 0.2
        _record(0.0, [(0.5, 1), (0.7, 1), (1.0, 2)], 1.1, 4, 10, cached=4),
        # B: ttft 0.2; ITL 0.4; e2e 0.6; tpot (0.6 - 0.2) / 1 = 0.4
        _record(1.0, [(1.2, 1), (1.6, 1)], 1.6, 2, 20, cached=0),
        # C: one token: ttft 0.8 = e2e, no ITL, no TPOT; cached tokens not reported
        _record(0.2, [(1.0, 1)], 1.0, 1, 5),
        # D: failed; must not count anywhere but in `failed`
        _record(0.0, [(0.1, 1)], 5.0, 0, 100, cached=50, success=False, error="boom"),
    ]


def test_per_request_timings(records):
    a = records[0]
    assert a.ttft == pytest.approx(0.5)
    assert a.itl == pytest.approx([0.2, 0.15, 0.15])
    assert a.latency == pytest.approx(1.1)
    assert a.tpot == pytest.approx(0.2)
    assert records[2].tpot is None and records[2].itl == []


def test_counts_and_throughputs(records):
    m = compute_metrics(records, duration=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (35, 7)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["input_throughput"] == pytest.approx(17.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_throughput"] == pytest.approx(21.0)
    # (1.1 + 0.6 + 0.8) / 2.0
    assert m["concurrency"] == pytest.approx(1.25)


def test_latency_distributions(records):
    m = compute_metrics(records, duration=2.0)
    # TTFT [0.2, 0.5, 0.8]: p90 at rank 1.8 -> 0.5 + 0.8 * 0.3; p99 at rank 1.98
    assert m["mean_ttft_ms"] == pytest.approx(500.0)
    assert m["median_ttft_ms"] == pytest.approx(500.0)
    assert m["p90_ttft_ms"] == pytest.approx(740.0)
    assert m["p99_ttft_ms"] == pytest.approx(794.0)
    # ITL [0.15, 0.15, 0.2, 0.4]: mean 0.225, median 0.175, p95 at rank 2.85 -> 0.2 + 0.85 * 0.2
    assert m["mean_itl_ms"] == pytest.approx(225.0)
    assert m["median_itl_ms"] == pytest.approx(175.0)
    assert m["p95_itl_ms"] == pytest.approx(370.0)
    assert m["max_itl_ms"] == pytest.approx(400.0)
    # TPOT [0.2, 0.4] (C has one output token and is left out)
    assert m["mean_tpot_ms"] == pytest.approx(300.0)
    assert m["p90_tpot_ms"] == pytest.approx(380.0)
    # E2E [1.1, 0.6, 0.8]
    assert m["mean_e2e_latency_ms"] == pytest.approx(2500.0 / 3)
    assert m["median_e2e_latency_ms"] == pytest.approx(800.0)


def test_cached_token_ratio_uses_only_reporting_requests(records):
    m = compute_metrics(records, duration=2.0)
    # A and B report (4 + 0 cached of 10 + 20 prompt tokens); C does not; D failed.
    assert m["total_cached_tokens"] == 4
    assert m["cached_token_ratio"] == pytest.approx(4 / 30)
    none_reported = compute_metrics([records[2]], duration=1.0)
    assert none_reported["cached_token_ratio"] is None


def test_non_streamed_response_has_ttft_equal_to_latency():
    rec = _record(0.0, [(2.0, 5)], 2.0, 5, 8)
    assert rec.ttft == rec.latency == 2.0
    # The 4 tokens after the first arrived with it: no TPOT (it was reported as 0.00 ms,
    # infinitely fast decoding, where the report's own docs say n/a) and no ITL sample.
    assert rec.tpot is None and rec.itl == []
    assert compute_metrics([rec], duration=2.0)["mean_tpot_ms"] is None


def test_every_tool_reports_percentiles_interpolated_between_ranks():
    """multiturn and soak took the rank above (p90 of ten values was the maximum, and soak's
    p99 of up to 100 values always was)."""
    from radixserve.bench.multiturn import RunResult

    run = RunResult("x", ttft_s=[k / 1000 for k in range(1, 11)])
    assert (run.summary()["p50_ttft_ms"], run.summary()["p90_ttft_ms"]) == (5.5, 9.1)


def test_all_failed_gives_zeros_not_nan(records):
    m = compute_metrics([records[3]], duration=1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["output_throughput"] == 0.0
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in m.values())
    assert first_error(records) == "boom"


def test_table_and_jsonl(records, tmp_path):
    m = compute_metrics(records, duration=2.0)
    table = format_metrics(m, {"Backend": "radixserve"})
    assert "Backend:" in table and "radixserve" in table
    assert "Mean TTFT (ms):" in table and "500.00" in table
    assert "P99 ITL (ms):" in table
    path = tmp_path / "out.jsonl"
    append_jsonl(str(path), {"run": 1, **m})
    append_jsonl(str(path), {"run": 2, "rate": float("inf")})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["run"] for line in lines] == [1, 2]
    assert lines[0]["completed"] == 3


def test_speculative_metrics_are_weighted_by_verify_steps(records):
    assert "spec_accept_length" not in compute_metrics(records, duration=2.0)
    a, b = records[0], records[1]
    a.spec_verify_ct, a.spec_accept_length, a.spec_accept_rate = 3, 4.0, 0.5
    b.spec_verify_ct, b.spec_accept_length, b.spec_accept_rate = 1, 2.0, 0.1
    records[3].spec_verify_ct, records[3].spec_accept_length = 50, 9.0  # failed: ignored
    m = compute_metrics(records, duration=2.0)
    assert m["spec_verify_ct"] == 4
    assert m["spec_accept_length"] == pytest.approx((3 * 4.0 + 2.0) / 4)
    assert m["spec_accept_rate"] == pytest.approx((3 * 0.5 + 0.1) / 4)  # (no draft counts)
    table = format_metrics(m)
    assert "Accept length (tokens per verify step):" in table and "3.50" in table
    # With the draft counts radixserve reports, the share of all draft tokens accepted: the
    # rates weighted by steps said (3 * 0.5 + 0.1) / 4 = 0.4, the drafts (6 + 1) / (12 + 10).
    a.spec_draft_tokens, a.spec_accepted_tokens = 12, 6
    b.spec_draft_tokens, b.spec_accepted_tokens = 10, 1
    assert compute_metrics(records, duration=2.0)["spec_accept_rate"] == pytest.approx(7 / 22)


def test_json_lines_are_strict_json(tmp_path):
    """json.dumps writes bare NaN / Infinity, which jq and JSON.parse reject: a statistic of
    nothing measured is null."""
    from radixserve.bench.metrics import append_jsonl, json_line

    value = {"a": math.nan, "b": [1.0, math.inf, {"c": -math.inf}], "d": (2, "x"), "e": None}
    assert json.loads(json_line(value)) == {"a": None, "b": [1.0, None, {"c": None}],
                                            "d": [2, "x"], "e": None}  # fmt: skip
    path = tmp_path / "out.jsonl"
    append_jsonl(str(path), {"x": math.nan, "y": 1})
    assert path.read_text() == '{"x": null, "y": 1}\n'
