"""The soak run's verdict and its printed report (`bench.soak`).

`evaluate` derives the leak numbers from the final /server_info (leaked KV slots =
max_total_num_tokens − available − evictable; locked tokens = protected_tokens; leaked request
rows = max_running_requests − free_request_rows), the RSS growth over the server's processes,
and one pass/fail line per invariant. `print_report` prints all of it as a table.
"""

from __future__ import annotations

from typing import Any

from radixserve.bench.soak_actions import (
    ABORT_LOST,
    ABORT_UNACKED,
    ABORTED,
    DISCONNECTED,
    FINISHED_BEFORE_ABORT,
    INVALID,
    OK,
    OTHER_5XX,
    RESULTS,
    TIMEOUT,
    TRANSPORT,
    UNEXPECTED_4XX,
)

SERVED = (OK, ABORTED, FINISHED_BEFORE_ABORT, DISCONNECTED)
MIB = 1 << 20


def rss_growth(rss: dict[str, Any]) -> tuple[int | None, int | None, float | None]:
    """(total at start, total at end, growth fraction) over pids sampled both times."""
    pids = [p for p in rss["start"] if rss["start"][p] and rss["end"].get(p)]
    if not pids:
        return None, None, None
    start = sum(rss["start"][p] for p in pids)
    end = sum(rss["end"][p] for p in pids)
    return start, end, end / start - 1.0


def _diff(info: dict[str, Any], whole: str, *parts: str) -> int | None:
    if not all(k in info for k in (whole, *parts)):
        return None  # /server_info did not say (e.g. the server is gone)
    return int(info[whole]) - sum(int(info[k]) for k in parts)


def rows_key(info: dict[str, Any]) -> str:
    """The key of the server's request rows, every replica's: max_running_requests is one
    replica's (as SGLang reports it); a server without the total gives only that."""
    total = "max_running_requests_total"
    return total if total in info else "max_running_requests"


def leaks(info: dict[str, Any]) -> dict[str, int | None]:
    return {
        "leaked_slots": _diff(info, "max_total_num_tokens", "available_tokens", "evictable_tokens"),
        "locked_tokens": info.get("protected_tokens"),
        "leaked_rows": _diff(info, rows_key(info), "free_request_rows"),
    }


def _check(name: str, ok: bool | None, value: Any) -> dict[str, Any]:
    return {"name": name, "ok": ok, "value": value}


def evaluate(report: dict[str, Any], max_growth: float) -> dict[str, Any]:
    """Add `leaks`, `rss_total`, `checks` and `passed` to the report; returns it."""
    t = report["totals"]
    start, end, growth = rss_growth(report["rss"])
    found = leaks(report["server_info_end"])
    report["leaks"] = found
    report["rss_total"] = {"start": start, "end": end, "growth": growth}
    report["served"] = sum(t[r] for r in SERVED)
    report["requests"] = sum(t.values())
    lost = t[ABORT_LOST] + t[ABORT_UNACKED]
    checks = [
        _check("no 5xx other than 503", t[OTHER_5XX] == 0, t[OTHER_5XX]),
        _check("every acknowledged abort aborted", lost == 0, lost),
        _check("no invalid responses", t[INVALID] == 0, t[INVALID]),
        _check("no unexpected 4xx", t[UNEXPECTED_4XX] == 0, t[UNEXPECTED_4XX]),
        _check("no timeouts", t[TIMEOUT] == 0, t[TIMEOUT]),
        _check("no transport errors", t[TRANSPORT] == 0, t[TRANSPORT]),
        _check("workload drained", report["drained"], report["drained"]),
        _check("0 leaked KV slots", found["leaked_slots"] == 0, found["leaked_slots"]),
        _check("0 locked radix tokens", found["locked_tokens"] == 0, found["locked_tokens"]),
        _check("0 leaked request rows", found["leaked_rows"] == 0, found["leaked_rows"]),
        _check(
            f"RSS growth <= {max_growth:.0%}",
            None if growth is None else growth <= max_growth,
            None if growth is None else round(growth, 4),
        ),
        _check(
            "healthy at the end", report["health_status_end"] == 200, report["health_status_end"]
        ),
    ]
    report["checks"] = checks
    report["passed"] = all(c["ok"] is not False for c in checks)
    return report


# -- printing --------------------------------------------------------------------------------------
def _latency(report: dict[str, Any], kind: str) -> str:
    lat = report.get("latency_s", {}).get(kind)
    if not lat:
        return " " * 24
    return "".join(f"{lat[k]:8.1f}" for k in ("p50", "p99", "max"))


def _table(report: dict[str, Any]) -> list[str]:
    counts, totals = report["counts"], report["totals"]
    cols = [r for r in RESULTS if totals.get(r)]
    width = max(len(c) for c in cols) + 2 if cols else 4
    head = "".join(c.rjust(width) for c in cols) + "total".rjust(8)
    lines = ["kind".ljust(16) + head + "   ok latency s: p50     p99     max"]
    for kind, c in counts.items():
        row = "".join(str(c.get(r, 0)).rjust(width) for r in cols)
        lines.append(kind.ljust(16) + row + str(sum(c.values())).rjust(8) + _latency(report, kind))
    row = "".join(str(totals[r]).rjust(width) for r in cols)
    lines.append("total".ljust(16) + row + str(report["requests"]).rjust(8))
    return lines


def _rss_lines(report: dict[str, Any]) -> list[str]:
    rss, total = report["rss"], report["rss_total"]
    if total["growth"] is None:
        return ["RSS: not readable (is the server on this machine? pass --pids)"]
    per_pid = ", ".join(
        f"{pid}: {rss['start'][pid] / MIB:.1f} -> {(rss['end'].get(pid) or 0) / MIB:.1f}"
        for pid in rss["start"]
        if rss["start"][pid]
    )
    return [
        f"RSS (MiB): {total['start'] / MIB:.1f} -> {total['end'] / MIB:.1f} "
        f"({total['growth']:+.2%})   per pid: {per_pid}"
    ]


def _kv_line(report: dict[str, Any]) -> str:
    info, found = report["server_info_end"], report["leaks"]
    if found["leaked_slots"] is None:
        return f"KV after drain: unknown ({info.get('error', info)})"
    return (
        f"KV after drain: {info['available_tokens']} free + {info['evictable_tokens']} evictable "
        f"of {info['max_total_num_tokens']} -> {found['leaked_slots']} leaked slots, "
        f"{found['locked_tokens']} locked tokens, {info.get('free_request_rows')}/"
        f"{info.get('max_running_requests')} request rows free"
    )


def print_report(report: dict[str, Any], max_failures: int = 10) -> None:
    cfg, wall = report["config"], report["wall_s"]
    print("=" * 30 + " Soak result " + "=" * 30)
    print(
        f"server {cfg['base_url']} model {cfg['model']}; concurrency {cfg['concurrency']}, "
        f"seed {cfg['seed']}; warm-up {wall['warmup']:.0f} s + soak {wall['soak']:.0f} s"
    )
    print(f"requests {report['requests']}, served {report['served']}")
    print("\n".join(_table(report)))
    print("\n".join(_rss_lines(report)))
    print(_kv_line(report))
    for check in report["checks"]:
        mark = {True: "PASS", False: "FAIL", None: "SKIP"}[check["ok"]]
        print(f"  [{mark}] {check['name']}: {check['value']}")
    for failure in report["failures"][:max_failures]:
        body = str(failure["body"])[:300]
        print(f"  {failure['kind']} {failure['result']}: {failure['detail']}\n      body: {body}")
    print("PASSED" if report["passed"] else "FAILED")
