"""A request between its arrival and its registration (tokenizing, the grammar check, the wait
for its rid): what /abort_request and /unload_lora_adapter find of it there. The "scheduler" is
the test, as in test_tokenizer_manager."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from test_tokenizer_manager import (
    LENGTH,
    FakeSockets,
    _CheckThat,
    _collect,
    _make_tm,
    _output,
    _req,
    _settle,
    _with_adapter,
    run,
)

from radixserve.io_struct import (
    AbortReq,
    GenerateReqInput,
    LoadLoRAAdapterReq,
    LoRAUpdateReqOutput,
    UnloadLoRAAdapterReq,
)
from radixserve.lora.adapter import adapter_key
from radixserve.managers.tokenizer_manager import RequestError, TokenizerManager

SCHEMA = '{"type": "string"}'
ABORTED = {"type": "abort", "message": "aborted by the client"}  # the scheduler's, when queued


async def _until(cond: Any) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def _gate(tm: TokenizerManager) -> tuple[_CheckThat, threading.Event]:
    """The grammar check blocks (on its worker thread, as a large schema's compile does) until
    the returned event is set."""
    release = threading.Event()
    tm._grammar_check = check = _CheckThat(during=lambda: release.wait(15))
    return check, release


def _sent_after_the_request(sockets: FakeSockets) -> list[str]:
    """The rids aborted after the (first) request was sent: the scheduler ends those queued."""
    first = next(i for i, m in enumerate(sockets.sent) if not isinstance(m, AbortReq))
    return [m.rid for m in sockets.sent[first:] if isinstance(m, AbortReq)]


def _batch(rid: str | list[str]) -> GenerateReqInput:
    return GenerateReqInput(input_ids=[[5], [6]], rid=rid, sampling_params={"regex": "a"})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "make, abort, aborted",
    [
        (lambda: _req("r", json_schema=SCHEMA), "r", ["r"]),
        (lambda: _req("r", json_schema=SCHEMA, n=2), "r", ["r_0", "r_1"]),  # the choices' rid
        (lambda: _batch("b"), "b", ["b_0", "b_1"]),  # a batch's group rid
        (lambda: _batch(["p", "q"]), "q", ["q"]),  # one prompt's own
    ],
    ids=["single", "n=2", "batch", "batch prompt"],
)
def test_an_abort_by_rid_during_the_grammar_check_ends_the_request(make, abort, aborted, stream):
    """/abort_request sent while the request's grammar was checked (seconds for a large
    schema) answered success false, and the request ran to its end: its rid was registered
    only after the check. It is aborted as it registers, as a queued request is."""

    async def body():
        tm, sockets = _make_tm()
        check, release = _gate(tm)
        obj = make()
        obj.stream = stream
        task = asyncio.create_task(_collect_all(tm, obj))
        try:
            assert await asyncio.to_thread(check.entered.wait, 5)
            assert tm.request_abort(abort)
            assert not tm.request_abort("other")
        finally:
            release.set()
        await _until(lambda: sockets.requests())
        rids = [t.rid for t in sockets.requests()]
        assert sorted(_sent_after_the_request(sockets)) == sorted(aborted)
        for rid in rids:  # what the scheduler answers: the aborted ones end queued
            await sockets.inbox.put(_output(rid, "", [], ABORTED if rid in aborted else LENGTH))
        reasons = {o["meta_info"]["id"]: o["meta_info"]["finish_reason"] for o in await task}
        assert reasons == {r: ABORTED if r in aborted else LENGTH for r in rids}
        assert tm.rid_to_state == {}

    run(body())


async def _collect_all(tm: TokenizerManager, obj: GenerateReqInput) -> list[dict[str, Any]]:
    """Each sub-request's last output (a single request's, a batch's, or a stream's)."""
    last: dict[Any, dict[str, Any]] = {}
    async for item in tm.generate_request(obj):
        for out in item if isinstance(item, list) else [item]:
            last[out["meta_info"].get("id")] = out
    return list(last.values())


def test_abort_all_during_the_grammar_check_ends_the_request():
    """abort_all answered "aborted": 0 for a request in its grammar check, and it ran to its
    end (the scheduler-wide abort came before the request). One without a client rid too."""

    async def body():
        tm, sockets = _make_tm()
        check, release = _gate(tm)
        task = asyncio.create_task(_collect(tm, _req(json_schema=SCHEMA)))
        try:
            assert await asyncio.to_thread(check.entered.wait, 5)
            assert tm.request_abort_all() == 1
        finally:
            release.set()
        await _until(lambda: sockets.requests())
        rid = sockets.requests()[0].rid
        assert _sent_after_the_request(sockets) == [rid]
        await sockets.inbox.put(_output(rid, "", [], ABORTED))
        assert (await task)["meta_info"]["finish_reason"] == ABORTED
        refused = _req(json_schema=SCHEMA)
        refused.lora_path = "none"
        with pytest.raises(RequestError, match="unknown LoRA adapter"):
            await _collect(tm, refused)
        assert tm.request_abort_all() == 0  # nothing left behind

    run(body())


@pytest.mark.parametrize("user_key", [None, "tenant"])
@pytest.mark.parametrize("window", ["grammar check", "rid wait"])
def test_an_unload_waits_for_a_request_of_the_adapter_still_arriving(window, user_key):
    """A request of the adapter in its grammar check (or waiting for its rid's aborted request
    to drain) when the unload came was not counted: the unload went ahead at once, and the
    request got a 400 "unknown LoRA adapter". As in SGLang it counts from its arrival: the
    unload waits, and it is served with the adapter's cache namespace (as resolved when it
    arrived: no load of other files under the name can come before it ends)."""

    async def body():
        tm, sockets = _make_tm()
        _with_adapter(tm)
        release = threading.Event()
        if window == "grammar check":
            check, release = _gate(tm)
            obj = _req("r", json_schema=SCHEMA)
        else:
            tm._draining["r"] = None  # aborted here, not yet finished in the scheduler
            obj = _req("r")
        obj.lora_path, obj.extra_key = "a", user_key
        running = asyncio.create_task(_collect(tm, obj))
        try:
            if window == "grammar check":
                assert await asyncio.to_thread(check.entered.wait, 5)
            else:
                await _settle()  # (in its rid wait)
            unload = asyncio.create_task(tm.unload_lora_adapter("a"))
            await _settle()  # (an unload with no users sends its request on its first step)
            assert not any(isinstance(m, UnloadLoRAAdapterReq) for m in sockets.sent)
        finally:
            release.set()
            tm._draining.pop("r", None)
        await _until(lambda: sockets.requests() or running.done())
        sent = sockets.requests()[0]
        assert sent.lora_id == "a"
        assert sent.extra_key == "lora:a" + ("" if user_key is None else "|user:tenant")
        assert not unload.done()  # the request runs: it still waits
        await sockets.inbox.put(_output("r", "x", [1], LENGTH))
        assert (await running)["text"] == "x"
        await _until(lambda: isinstance(sockets.sent[-1], UnloadLoRAAdapterReq))
        tm._dispatch(LoRAUpdateReqOutput(True, ""))
        assert (await unload).success and "a" not in tm.lora_keys

    run(body())


def test_an_adapter_reloaded_from_other_files_during_the_check_waits_for_the_request(tmp_path):
    """An unload and a load of the name from other files, both sent during a request's grammar
    check: the request is served by the files it arrived with, under their cache namespace
    (the new weights were once served from the old files' KV), and the reload comes after."""

    async def body():
        tm, sockets = _make_tm(enable_lora=True)
        _with_adapter(tm)
        check, release = _gate(tm)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (tmp_path / name).write_text("{}")  # only hashed: the scheduler is the test
        obj = _req("r", json_schema=SCHEMA)
        obj.lora_path = "a"
        running = asyncio.create_task(_collect(tm, obj))
        try:
            assert await asyncio.to_thread(check.entered.wait, 5)
            unload = asyncio.create_task(tm.unload_lora_adapter("a"))
            load = asyncio.create_task(tm.load_lora_adapter("a", str(tmp_path)))
            await _settle()
        finally:
            release.set()
        await _until(lambda: sockets.requests() or running.done())
        assert sockets.requests()[0].extra_key == "lora:a"
        await sockets.inbox.put(_output("r", "x", [1], LENGTH))
        assert (await running)["text"] == "x"
        for task, sent in ((unload, UnloadLoRAAdapterReq), (load, LoadLoRAAdapterReq)):
            await _until(lambda sent=sent: isinstance(sockets.sent[-1], sent))
            tm._dispatch(LoRAUpdateReqOutput(True, ""))
            assert (await task).success
        assert tm.lora_keys["a"] == adapter_key("a", str(tmp_path)) != "lora:a"

    run(body())
