"""The offline Engine over a tiny model: a stream its consumer stops reading (closed, or an
async iterator's aclose) aborts its request at once rather than generating to the end; the
default max_new_tokens never refuses a prompt that fits the context (the scheduler caps it to
the room left, as SGLang's); an explicit one that overflows it is a clear error."""

from __future__ import annotations

import asyncio
import time

import pytest
from rs_testing import make_tiny_served_model

from radixserve.managers.tokenizer_manager import RequestError

CONTEXT = 8192
LONG = {"max_new_tokens": 8000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from radixserve import Engine

    model = make_tiny_served_model(str(tmp_path_factory.mktemp("tiny") / "m"), context=CONTEXT)
    with Engine(model_path=model, dtype="float32", max_total_tokens=CONTEXT + 512) as e:
        yield e


def _drained(engine, before: dict) -> dict:
    for _ in range(600):  # (bounded: 60 s)
        info = engine.get_server_info()
        if info["running"] == 0 and info["queued"] == 0:
            break
        time.sleep(0.1)
    assert info["running"] == 0 and info["queued"] == 0
    assert info["available_tokens"] + info["evictable_tokens"] == info["max_total_num_tokens"]
    assert info["num_aborted"] == before["num_aborted"] + 1
    # aborted long before its 8,000 tokens
    assert info["generation_tokens"] - before["generation_tokens"] < LONG["max_new_tokens"] // 2
    return info


def test_closing_a_stream_aborts_its_request(engine):
    before = engine.get_server_info()
    it = engine.generate("hello", LONG, stream=True)
    assert next(it)["meta_info"]["finish_reason"] is None
    it.close()
    _drained(engine, before)


def test_closing_an_async_stream_aborts_its_request(engine):
    async def read_one() -> None:
        it = await engine.async_generate("hello", LONG, stream=True)
        assert (await it.__anext__())["meta_info"]["finish_reason"] is None
        await it.aclose()

    before = engine.get_server_info()
    asyncio.run(read_one())
    _drained(engine, before)


def test_the_default_max_new_tokens_never_refuses_a_prompt_that_fits(engine):
    prompt = [5] * (CONTEXT - 40)  # room for 40 tokens, fewer than the default 128
    out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert 0 < out["meta_info"]["completion_tokens"] <= 40
    with pytest.raises(RequestError, match="exceeds the model's context length"):
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 128})
