"""The serving event loop stays free while a request is tokenized: a long prompt, or a batch's
prompts past the first few, are encoded on a worker thread (and /detokenize decodes on one),
and a batch's prompt too long for the context is refused before any is tokenized. A prompt of
2.6 MB, or a batch of 8 MB, held /health and every other stream of the server for 5 to 15 s."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest
from test_tokenizer_manager import LENGTH, ByteTokenizer, _collect, _make_tm, _output, run

from radixserve.args import ServerArgs
from radixserve.entrypoints.http_server import build_app
from radixserve.io_struct import GenerateReqInput
from radixserve.managers.tokenizer_manager import (
    ENCODE_ON_LOOP_CHARS,
    RequestError,
    TokenizerManager,
)

BLOCK_S = 5.0  # how long a gated call waits for the loop before it says the loop is held


class GatedTokenizer(ByteTokenizer):
    """Its encode of a text, or decode of ids, that starts with one of `gated` waits until a
    coroutine on the loop opens the gate: run on the loop's thread, it waits in vain (BLOCK_S)
    and fails."""

    def __init__(self, gated: str = "") -> None:
        self.gated = set(gated)
        self.waiting = threading.Event()
        self.gate = threading.Event()
        self.on_loop: list[bool] = []  # per call: whether it ran on the loop's thread

    def encode(self, text: str, **kw: Any) -> list[int]:
        self._pass(text[0])
        return super().encode(text[:3], **kw)  # (a few ids: the context is 256 tokens)

    def decode(self, ids: list[int], **kw: Any) -> str:
        self._pass(chr(ids[0]))
        return super().decode(ids, **kw)

    def _pass(self, first: str) -> None:
        self.on_loop.append(threading.current_thread() is threading.main_thread())
        if first in self.gated:
            self.waiting.set()
            if not self.gate.wait(BLOCK_S):
                raise AssertionError("the event loop did not run while the tokenizer worked")


async def _open_the_gate(tok: GatedTokenizer) -> None:
    """Another task on the loop: it opens the gate once a call waits at it."""
    assert await asyncio.to_thread(tok.waiting.wait, BLOCK_S)
    tok.gate.set()


async def _answer(tm: TokenizerManager, sockets: Any, obj: GenerateReqInput, count: int) -> Any:
    """The request's output, once its `count` sub-requests have reached the scheduler."""
    task = asyncio.create_task(_collect(tm, obj))
    for _ in range(500):  # (bounded: a failed encode ends the task instead)
        if len(sockets.requests()) == count or task.done():
            break
        await asyncio.sleep(0.01)
    for t in sockets.requests():
        await sockets.inbox.put(_output(t.rid, "hi", [1], LENGTH))
    return await task


def test_a_long_prompt_is_tokenized_while_the_loop_serves_others():
    tok = GatedTokenizer("x")

    async def body():
        tm, sockets = _make_tm()
        tm.tokenizer = tok
        opener = asyncio.create_task(_open_the_gate(tok))
        obj = GenerateReqInput(text="x" * (ENCODE_ON_LOOP_CHARS + 1), rid="long")
        assert (await _answer(tm, sockets, obj, 1))["text"] == "hi"
        await opener

    run(body())
    assert tok.on_loop == [False]


def test_a_short_prompt_is_still_tokenized_on_the_loop():
    """A hop to a thread would cost more than its encode: the cost of batch 1 stays."""
    tok = GatedTokenizer()

    async def body():
        tm, sockets = _make_tm()
        tm.tokenizer = tok
        obj = GenerateReqInput(text="x" * ENCODE_ON_LOOP_CHARS, rid="short")
        assert (await _answer(tm, sockets, obj, 1))["text"] == "hi"

    run(body())
    assert tok.on_loop == [True]


def test_a_batch_of_short_prompts_is_tokenized_on_a_thread_past_its_first_ones():
    """Only the first ENCODE_ON_LOOP_CHARS characters of a batch are encoded on the loop: 2000
    prompts of 4000 characters each held it for 15 s."""
    tok = GatedTokenizer("bc")  # (the second and third prompts wait for the loop)

    async def body():
        tm, sockets = _make_tm()
        tm.tokenizer = tok
        opener = asyncio.create_task(_open_the_gate(tok))
        half = ENCODE_ON_LOOP_CHARS // 2 + 1
        obj = GenerateReqInput(text=["a" * half, "b" * half, "c" * half], rid="batch")
        outs = await _answer(tm, sockets, obj, 3)
        assert [o["text"] for o in outs] == ["hi"] * 3
        await opener

    run(body())
    assert tok.on_loop == [True, False, False]


def test_a_batch_prompt_too_long_for_the_context_is_refused_before_any_is_tokenized():
    tok = GatedTokenizer()

    async def body():
        tm, sockets = _make_tm()
        tm.tokenizer = tok
        too_long = "z" * (256 * 64 * 4 + 1)  # (a tokenizer without get_vocab: 64 characters)
        with pytest.raises(RequestError, match="characters: more than the 256 tokens"):
            await _collect(tm, GenerateReqInput(text=["a", "b", too_long]))
        assert sockets.sent == []

    run(body())
    assert tok.on_loop == []


def test_detokenize_decodes_while_the_loop_serves_others():
    """/detokenize decoded on the loop: the ids of a 19 MB body held the server for 0.7 s."""
    tok = GatedTokenizer("x")

    async def body():
        tm, _ = _make_tm()
        tm.tokenizer = tok
        app = build_app(ServerArgs(model_path="/models/tiny.gguf"), lambda metrics: tm)
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://server") as client,
        ):
            opener = asyncio.create_task(_open_the_gate(tok))
            reply = await client.post("/detokenize", json={"tokens": [ord("x"), ord("y")]})
            await opener
        assert reply.json() == {"text": "xy"}

    run(body())
    assert tok.on_loop == [False]


class GatedChatTokenizer(GatedTokenizer):
    def apply_chat_template(self, messages: list[dict[str, Any]], **_: Any) -> str:
        return "".join(m["content"] for m in messages)


@pytest.mark.parametrize("size,on_loop", [(ENCODE_ON_LOOP_CHARS + 1, False), (100, True)])
def test_a_long_chat_is_rendered_and_tokenized_while_the_loop_serves_others(size, on_loop):
    """The chat template and its tokens ran on the loop: a 2.4 MB message held the server
    1.5 s. A short conversation stays there (a thread costs more than its encode)."""
    tok = GatedChatTokenizer("x" if not on_loop else "")

    async def body():
        tm, sockets = _make_tm()
        tm.tokenizer = tok
        app = build_app(ServerArgs(model_path="/models/tiny.gguf"), lambda metrics: tm)
        transport = httpx.ASGITransport(app=app)
        chat = {"messages": [{"role": "user", "content": "x" * size}], "max_tokens": 1}
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://server") as client,
        ):
            opener = asyncio.create_task(_open_the_gate(tok)) if not on_loop else None
            post = asyncio.create_task(client.post("/v1/chat/completions", json=chat))
            for _ in range(500):  # (bounded: a failed encode ends the post instead)
                if sockets.requests() or post.done():
                    break
                await asyncio.sleep(0.01)
            for t in sockets.requests():
                await sockets.inbox.put(_output(t.rid, "hi", [1], LENGTH))
            reply = await post
            if opener is not None:
                await opener
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == "hi"

    run(body())
    assert tok.on_loop[:1] == [on_loop]
