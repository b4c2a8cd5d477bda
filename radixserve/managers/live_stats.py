"""Bounded live statistics for the dashboard (GET /dashboard/events).

`PerSecond` sums values per wall-clock second over the last few minutes; `LiveStats` (owned by
the Scheduler) keeps the composition of the recent steps and the tokens per second;
`LatencyWindow` (owned by the TokenizerManager) the TTFT and time per output token per second.
Every update is O(1) and every structure has a fixed maximum size; the cumulative counters
stay where they were (SchedulerStats, ServerMetrics).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

WINDOW_S = 300  # the per-second series cover the last five minutes
STEP_RING = 120  # the steps whose composition the dashboard shows
RATE_WINDOW_S = 10  # "now" rates are means over the last ten seconds


class PerSecond:
    """Per-second sums of a fixed set of fields over the last `seconds` seconds; a field whose
    name ends in "_max" keeps the maximum instead. Seconds in which nothing was added have no
    bucket (a reader fills them with zeros)."""

    def __init__(
        self,
        fields: tuple[str, ...],
        seconds: int = WINDOW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.fields = fields
        self.seconds = seconds
        self.clock = clock
        self._buckets: deque[list[float]] = deque(maxlen=seconds)  # [second, *fields]
        self._index = {name: i + 1 for i, name in enumerate(fields)}

    def add(self, **values: float) -> None:
        sec = int(self.clock())
        if not self._buckets or self._buckets[-1][0] != sec:
            self._buckets.append([sec] + [0.0] * len(self.fields))
        bucket = self._buckets[-1]
        for name, value in values.items():
            i = self._index[name]
            bucket[i] = max(bucket[i], value) if name.endswith("_max") else bucket[i] + value

    def columns(self) -> dict[str, list[float]]:
        """The buckets of the window, oldest first, as one list per field plus "t"."""
        first = int(self.clock()) - self.seconds + 1
        rows = [b for b in self._buckets if b[0] >= first]
        out: dict[str, list[float]] = {"t": [b[0] for b in rows]}
        for name, i in self._index.items():
            out[name] = [b[i] for b in rows]
        return out

    def totals(self, seconds: int) -> dict[str, float]:
        """Each field over the last `seconds` seconds, this one included (sums, or maxima)."""
        first = int(self.clock()) - seconds + 1
        out = dict.fromkeys(self.fields, 0.0)
        for b in reversed(self._buckets):
            if b[0] < first:
                break
            for name, i in self._index.items():
                out[name] = max(out[name], b[i]) if name.endswith("_max") else out[name] + b[i]
        return out


class LiveStats:
    """The scheduler's side: what each recent step ran, and tokens per second."""

    def __init__(
        self,
        steps: int = STEP_RING,
        seconds: int = WINDOW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        self.steps: deque[tuple[float, str, int, int, int]] = deque(maxlen=steps)
        self.tokens = PerSecond(("prompt", "cached", "generation"), seconds, clock)
        self._seen = (0, 0, 0)  # the counters already added to `tokens`

    def on_step(self, batch: Any, stats: Any) -> None:
        """Called once per scheduler step with the batch it ran (or None) and SchedulerStats."""
        if batch is not None:
            total = len(batch.input_ids)
            mixed = len(batch.decoding_reqs)
            if batch.forward_mode.is_decode():
                mode, decode = "decode", total
            else:
                mode, decode = ("mixed" if mixed else "prefill"), mixed
            self.steps.append((self.clock(), mode, total - decode, decode, len(batch.reqs)))
        now = (stats.prompt_tokens, stats.cached_tokens, stats.generation_tokens)
        if now != self._seen:
            prompt, cached, generation = (a - b for a, b in zip(now, self._seen, strict=True))
            self.tokens.add(prompt=prompt, cached=cached, generation=generation)
            self._seen = now

    def _rates(self, window: dict[str, float]) -> dict[str, float]:
        """The rates, from the token totals of the whole window (its caller has them)."""
        recent = self.tokens.totals(RATE_WINDOW_S)
        return {
            "prompt_tps": recent["prompt"] / RATE_WINDOW_S,
            "generation_tps": recent["generation"] / RATE_WINDOW_S,
            "window_hit_rate": _ratio(window["cached"], window["prompt"]),
        }

    def rates(self) -> dict[str, float]:
        """SGLang's two rate gauges: tokens generated per second (the last RATE_WINDOW_S
        seconds) and the prefix cache's hit rate over the window, with the window's token
        counts it is the ratio of (data-parallel replicas' rates merge through them)."""
        window = self.tokens.totals(self.tokens.seconds)
        r = self._rates(window)
        return {
            "gen_throughput": r["generation_tps"],
            "cache_hit_rate": r["window_hit_rate"],
            "cache_window_prompt_tokens": window["prompt"],
            "cache_window_cached_tokens": window["cached"],
        }

    def snapshot(self) -> dict[str, Any]:
        steps = list(self.steps)
        return {
            "steps": {
                "t": [s[0] for s in steps],
                "mode": [s[1] for s in steps],
                "prefill": [s[2] for s in steps],
                "decode": [s[3] for s in steps],
                "batch": [s[4] for s in steps],
            },
            "throughput": {
                "window_s": self.tokens.seconds,
                "rate_window_s": RATE_WINDOW_S,
                **self._rates(self.tokens.totals(self.tokens.seconds)),
                "series": self.tokens.columns(),
            },
        }


def merge_snapshots(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """LiveStats.snapshot() of the whole server from its data-parallel replicas': their steps
    in time order (each tagged with its replica, the last STEP_RING of them), their tokens per
    second summed second by second."""
    keys = list(snapshots[0]["steps"])  # "t", "mode", ... as in snapshot()
    rows = []
    for rank, snap in enumerate(snapshots):
        columns = [snap["steps"][key] for key in keys]
        rows += [(row, rank) for row in zip(*columns, strict=True)]
    rows = sorted(rows, key=lambda r: r[0][0])[-STEP_RING:]
    merged_steps = {key: [row[i] for row, _ in rows] for i, key in enumerate(keys)}
    merged_steps["replica"] = [rank for _, rank in rows]
    seconds: dict[int, dict[str, float]] = {}
    for snap in snapshots:
        series = snap["throughput"]["series"]
        for i, t in enumerate(series["t"]):
            bucket = seconds.setdefault(t, {})
            for name, column in series.items():
                if name != "t":
                    bucket[name] = bucket.get(name, 0.0) + column[i]
    names = [n for n in snapshots[0]["throughput"]["series"] if n != "t"]
    merged_series: dict[str, list[float]] = {"t": sorted(seconds)}
    for name in names:
        merged_series[name] = [seconds[t].get(name, 0.0) for t in merged_series["t"]]
    throughput = dict(snapshots[0]["throughput"])
    for key in ("prompt_tps", "generation_tps"):
        throughput[key] = sum(snap["throughput"][key] for snap in snapshots)
    throughput["window_hit_rate"] = _ratio(
        sum(merged_series.get("cached", [])), sum(merged_series.get("prompt", []))
    )
    throughput["series"] = merged_series
    return {"steps": merged_steps, "throughput": throughput}


class LatencyWindow:
    """The TokenizerManager's side, per second: end-to-end latency of every finished request;
    TTFT (arrival to first output) and time per output token after the first (the gap between
    two outputs over the tokens of the later) of streaming requests only, since a
    non-streaming request's tokens arrive all at once when it finishes. Fed with every output
    next to ServerMetrics.on_output."""

    FIELDS = ("ttft_sum", "ttft_n", "ttft_max", "tpot_sum", "tpot_n", "e2e_sum", "e2e_n")

    def __init__(self, seconds: int = WINDOW_S, clock: Callable[[], float] = time.time) -> None:
        self.window = PerSecond(self.FIELDS, seconds, clock)

    def on_output(self, state: Any, new_tokens: int, now: float, finished: Any) -> None:
        """`state.last_time` is 0.0 until the request's first output (set after this call)."""
        if finished is not None:
            self.window.add(e2e_sum=max(now - state.created, 0.0), e2e_n=1)
        if new_tokens <= 0 or not state.stream:
            return
        if state.last_time == 0.0:
            ttft = max(now - state.created, 0.0)
            self.window.add(ttft_sum=ttft, ttft_n=1, ttft_max=ttft)
        else:
            self.window.add(tpot_sum=max(now - state.last_time, 0.0), tpot_n=new_tokens)

    def snapshot(self) -> dict[str, Any]:
        total = self.window.totals(self.window.seconds)
        cols = self.window.columns()

        def means(name: str) -> list[float | None]:
            pairs = zip(cols[name + "_sum"], cols[name + "_n"], strict=True)
            return [_ratio(s, n) for s, n in pairs]

        return {
            "window_s": self.window.seconds,
            "ttft_mean": _ratio(total["ttft_sum"], total["ttft_n"]),
            "ttft_max": total["ttft_max"] if total["ttft_n"] else None,
            "tpot_mean": _ratio(total["tpot_sum"], total["tpot_n"]),
            "e2e_mean": _ratio(total["e2e_sum"], total["e2e_n"]),
            "streamed_requests": int(total["ttft_n"]),
            "finished_requests": int(total["e2e_n"]),
            "series": {
                "t": cols["t"],
                "ttft_mean": means("ttft"),
                "tpot_mean": means("tpot"),
                "e2e_mean": means("e2e"),
            },
        }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None
