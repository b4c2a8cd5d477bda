"""The soak driver (`radixserve.bench.soak`): its judging rules, and a short soak of a live server.

The live test serves a tiny random Llama with a byte-level BPE tokenizer and a chat template
(built here, no downloads) with --enable-integrity-checks on a free 127.0.0.1 port, runs ~20 s
of every kind of request with more clients than the server runs and queues, and asserts the
driver's invariants: no 5xx but 503, every acknowledged abort aborted, nothing leaked after the
drain, and no traceback in the server's log. The server is always stopped, and killed with its children if it does not stop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixserve.bench import soak
from radixserve.bench.soak_actions import (
    ABORT_LOST,
    ABORT_UNACKED,
    ABORTED,
    ACTIONS,
    DISCONNECTED,
    EXPECTED_4XX,
    FINISHED_BEFORE_ABORT,
    HTTP_503,
    INVALID,
    OK,
    OTHER_5XX,
    RESULTS,
    check_reply,
    classify_abort,
)
from radixserve.bench.soak_client import Reply, exchange
from radixserve.bench.soak_inputs import SHARED_PREFIX, SYSTEM_PROMPT, WORDS, matches_schema
from radixserve.bench.soak_report import evaluate, print_report

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


# -- judging rules -------------------------------------------------------------------------------
def _reply(finish: str | None = "length", end: float = 10.0, **kw) -> Reply:
    return Reply(status=200, finish=finish, finishes=1, tokens=5, end=end, **kw)


@pytest.mark.parametrize(
    "reply,ack,finished_unacked,expected",
    [
        (_reply("abort"), 9.0, False, ABORTED),
        (_reply("length", end=10.0), 9.0, False, FINISHED_BEFORE_ABORT),  # within the grace
        (_reply("length", end=20.0), 9.0, False, ABORT_LOST),  # ran on after the ack
        (_reply("length"), None, True, FINISHED_BEFORE_ABORT),  # the rid was already gone
        (_reply("length"), None, False, ABORT_UNACKED),  # never acknowledged while running
        (_reply("abort"), None, True, INVALID),  # aborted though nobody's abort landed
        (Reply(status=500, error="boom"), 9.0, False, OTHER_5XX),
    ],
)
def test_classify_abort(reply, ack, finished_unacked, expected):
    assert classify_abort(reply, ack, finished_unacked, grace=5.0)[0] == expected


def test_check_reply_catches_broken_streams():
    assert check_reply(_reply("stop"), True, True, 5) == (OK, "")
    assert check_reply(_reply("stop", done=False), True, True, 5)[0] == INVALID
    assert check_reply(Reply(200, "stop", finishes=2), True, True, 5)[0] == INVALID
    assert check_reply(_reply("stop"), False, True, 4)[0] == INVALID  # 5 tokens for 4
    assert check_reply(_reply(None), False, True, 5)[0] == INVALID
    assert check_reply(Reply(200, error="x", error_code=500), True, True, 5)[0] == OTHER_5XX


def test_sse_lines_split_at_lf_only():
    """U+2028 and U+0085 travel unescaped inside JSON strings; httpx's aiter_lines would cut
    the event there."""
    events = [{"text": "a\u2028b\x85c", "meta_info": {"completion_tokens": 3}}]
    raw = b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n" for e in events)
    raw += b"data: [DONE]\n\n"

    async def body():
        for i in range(0, len(raw), 7):  # chunk boundaries inside events and characters
            yield raw[i : i + 7]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    async def go() -> Reply:
        async with httpx.AsyncClient(
            base_url="http://fake", transport=httpx.MockTransport(handler)
        ) as client:
            return await exchange(client, "/generate", {"text": "x"}, stream=True)

    reply = asyncio.run(go())
    assert reply.malformed is None and reply.done
    assert reply.text == "a\u2028b\x85c" and reply.tokens == 3


def test_matches_schema():
    assert matches_schema('{"name": "Ann", "age": 3}')
    assert not matches_schema('{"name": "Ann"}')
    assert not matches_schema('{"name": "A\x01", "age": 3}')  # raw control character
    assert not matches_schema('{"name": "Ann", "age": true}')


def _fake_report(**info) -> dict:
    server_info = dict(
        max_total_num_tokens=100,
        available_tokens=60,
        evictable_tokens=40,
        protected_tokens=0,
        max_running_requests=4,
        free_request_rows=4,
    )
    server_info.update(info)
    totals = dict.fromkeys(RESULTS, 0)
    totals[OK] = 3
    return {
        "totals": totals,
        "rss": {"pids": [1], "start": {"1": 1000}, "end": {"1": 1040}},
        "server_info_end": server_info,
        "drained": True,
        "health_status_end": 200,
    }


def test_evaluate_reports_leaks_and_rss_growth():
    assert evaluate(_fake_report(), 0.05)["passed"]
    report = evaluate(_fake_report(available_tokens=57, protected_tokens=3), 0.05)
    assert report["leaks"] == {"leaked_slots": 3, "locked_tokens": 3, "leaked_rows": 0}
    assert not report["passed"]
    report = evaluate(_fake_report(free_request_rows=3), 0.05)
    assert report["leaks"]["leaked_rows"] == 1 and not report["passed"]
    report = evaluate(_fake_report(), 0.03)  # 4% growth
    assert report["rss_total"]["growth"] == pytest.approx(0.04) and not report["passed"]


def test_a_dead_server_fails_the_leak_checks():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def go() -> tuple[dict, bool]:
        async with httpx.AsyncClient(
            base_url="http://fake", transport=httpx.MockTransport(handler)
        ) as client:
            return await soak.wait_drained(client, timeout=1.0)

    info, drained = asyncio.run(go())
    assert not drained and "ConnectError" in info["error"]
    report = evaluate({**_fake_report(), "server_info_end": info, "drained": False}, 0.05)
    failed = {c["name"] for c in report["checks"] if c["ok"] is False}
    assert {"workload drained", "0 leaked KV slots", "0 leaked request rows"} <= failed


def test_cli_registers_soak(capsys):
    from radixserve.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "soak", "--help"])
    assert exc.value.code == 0
    assert "--max-rss-growth" in capsys.readouterr().out


# -- a short soak of a live server ---------------------------------------------------------------
def _save_byte_level_tokenizer(path: str) -> None:
    """A byte-level BPE (vocab 300 < the tiny model's 320; <s>=1 and </s>=2 as its config)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([" ".join(WORDS), SHARED_PREFIX, SYSTEM_PROMPT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) <= 320 and fast.eos_token_id == 2
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory) -> Iterator[Any]:
    from entrypoints.test_http_server import ServerProcess
    from rs_testing import make_tiny_model_dir

    model_dir = make_tiny_model_dir(str(tmp_path_factory.mktemp("soak_model")))
    _save_byte_level_tokenizer(model_dir)
    server = ServerProcess(
        str(tmp_path_factory.mktemp("soak_server")),
        *("--model-path", model_dir, "--log-level", "warning"),
        *("--max-running-requests", "16", "--max-queued-requests", "4"),
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_short_soak_keeps_every_invariant(tiny_server):
    cfg = soak.SoakConfig(
        base_url=tiny_server.url,
        duration=20.0,
        warmup=4.0,
        concurrency=24,  # more than 16 running + 4 queued: some wait, some get a 503
        seed=0,
        max_new_tokens=32,
        abort_new_tokens=200,
        abort_delay_max=1.0,
        request_timeout=90.0,
        drain_timeout=30.0,
        progress_interval=0.0,
    )
    report = asyncio.run(soak.soak(cfg))
    print_report(report)
    failed = [c for c in report["checks"] if c["ok"] is False]
    assert report["passed"], (failed, report["failures"][:5])
    totals = report["totals"]
    assert totals[ABORTED] > 0 and totals[DISCONNECTED] > 0 and totals[EXPECTED_4XX] > 0
    assert totals[HTTP_503] > 0  # overload is refused, not queued without bound
    assert totals[ABORT_LOST] == totals[ABORT_UNACKED] == totals[OTHER_5XX] == 0
    assert all(sum(report["counts"][kind].values()) > 0 for kind in ACTIONS), report["counts"]
    assert report["leaks"] == {"leaked_slots": 0, "locked_tokens": 0, "leaked_rows": 0}
    assert report["rss_total"]["growth"] is not None  # the server's pids were found
    # Every failure was answered, none escaped as an unhandled exception (scripts/soak.sh
    # fails on the same).
    log = tiny_server.log()
    assert "Traceback" not in log, log[log.index("Traceback") :][:3000]
