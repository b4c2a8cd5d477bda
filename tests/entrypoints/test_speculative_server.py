"""A served engine with NGRAM speculative decoding and the real default model: greedy output
equals plain decoding's (token ids in, token ids out; plain decoding equals transformers in
test_greedy_real_model), meta_info and /metrics report acceptance,
streaming, the openai client, logprobs, stop strings, JSON-schema requests and client
disconnects all work under concurrency, and the server drains."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from rs_testing import SchedulerHarness
from test_http_server import MODEL, ServerProcess, wait_drained

pytestmark = pytest.mark.real_model

PASSAGE = (
    "The radix cache keeps the KV of every prompt in a tree keyed by token ids, so that a "
    "request whose prompt starts like an earlier one reuses its KV instead of computing it."
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        str(tmp_path_factory.mktemp("spec")),
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-draft-tokens",
        "6",
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from radixserve.model_loader.weights import load_tokenizer

    return load_tokenizer(default_model_path)


def _rewrite_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Repeat this text exactly:\n\n" + PASSAGE}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return tokenizer.encode(text, add_special_tokens=False)


def test_greedy_equals_plain_decoding_and_reports_acceptance(server, tokenizer, default_model_path):
    ids = _rewrite_ids(tokenizer)
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True},
    }
    out = httpx.post(server.url + "/generate", json=body, timeout=300).json()
    plain = SchedulerHarness(
        model_path=default_model_path, max_total_tokens=2048, disable_overlap_schedule=True
    )
    plain.submit(ids, rid="plain", **body["sampling_params"])
    plain.run_until_idle()
    want = plain.results()["plain"]
    assert out["output_ids"] == want
    meta = out["meta_info"]
    assert meta["spec_verify_ct"] > 0
    assert meta["spec_accept_length"] > 1.5  # the answer quotes the prompt
    assert 0 < meta["spec_accept_rate"] <= 1
    assert meta["spec_accept_rate"] == meta["spec_accepted_tokens"] / meta["spec_draft_tokens"]
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert "sglang:spec_verify_steps_total" in metrics
    assert "sglang:spec_accept_length" in metrics
    costs = server.server_info()["spec_step_cost_ms"]["forward"]
    assert costs and all(ms > 0 for ms in costs.values())  # measured, by tokens per step
    wait_drained(server)


def test_openai_streaming_equals_non_streaming(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    msgs = [{"role": "user", "content": "Repeat this text exactly:\n\n" + PASSAGE}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=40, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content
    assert full.usage.completion_tokens <= 40
    wait_drained(server)


async def _mixed_load(url: str) -> list[httpx.Response]:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    bodies = []
    for i in range(40):
        sp: dict = {"max_new_tokens": 24, "temperature": 0 if i % 2 else 0.8}
        if i % 5 == 0:
            sp["json_schema"] = json.dumps(schema)
        if i % 7 == 0:
            sp["stop"] = [" the"]
        if i % 3 == 0:
            sp["repetition_penalty"] = 1.2
        bodies.append(
            {
                "text": f"Request {i}. Repeat this text exactly: {PASSAGE}",
                "sampling_params": sp,
                "return_logprob": i % 4 == 0,
                "stream": i % 6 == 0,
            }
        )
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def disconnect(i: int) -> None:  # clients that go away mid-generation
            try:
                await client.post(
                    "/generate",
                    json={
                        "text": f"Cancelled {i}: {PASSAGE}",
                        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
                    },
                    timeout=0.5 + 0.3 * i,
                )
            except httpx.TimeoutException:
                pass

        results = await asyncio.gather(
            *(client.post("/generate", json=b) for b in bodies),
            *(disconnect(i) for i in range(6)),
        )
    return [r for r in results if r is not None], bodies


def test_concurrent_mixed_requests_and_disconnects(server):
    responses, bodies = asyncio.run(_mixed_load(server.url))
    assert len(responses) == len(bodies)
    for body, r in zip(bodies, responses, strict=True):
        assert r.status_code == 200, r.text
        if body["stream"]:
            continue
        out = r.json()
        if "json_schema" in body["sampling_params"]:
            if out["meta_info"]["finish_reason"]["type"] == "stop":
                parsed = json.loads(out["text"])
                assert set(parsed) >= {"name", "age"}
        if body["return_logprob"]:
            lps = out["meta_info"]["output_token_logprobs"]
            assert len(lps) == out["meta_info"]["completion_tokens"]
    wait_drained(server, timeout=60)
    assert server.proc.poll() is None
