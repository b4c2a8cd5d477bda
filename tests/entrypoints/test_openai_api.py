"""Fast tests of the OpenAI adapters and of the HTTP app around a fake TokenizerManager: request
mapping, response and stream shapes, HTTP status codes and error bodies, the API key."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from radixserve.args import ServerArgs
from radixserve.entrypoints.openai_api import (
    chat_to_generate,
    completion_to_generate,
    finish_reason,
    make_usage,
    model_aliases,
    served_model_name,
)
from radixserve.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from radixserve.managers.tokenizer_manager import RequestError


def _completion(**kw):
    return completion_to_generate(CompletionRequest(**kw))


def _sse(resp) -> list:
    """The data payloads of an SSE body; [DONE] as the string itself."""
    events = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# -- request mapping -----------------------------------------------------------------------------
def test_completion_prompt_forms():
    obj = _completion(prompt="hello")
    assert obj.text == "hello" and obj.input_ids is None and obj.is_single
    obj = _completion(prompt=["a", "b"])
    assert obj.text == ["a", "b"] and obj.batch_size == 2
    obj = _completion(prompt=[5, 6, 7])
    assert obj.input_ids == [5, 6, 7] and obj.text is None and obj.is_single
    obj = _completion(prompt=[[5], [6, 7]])
    assert obj.input_ids == [[5], [6, 7]] and obj.batch_size == 2


@pytest.mark.parametrize("prompt", ["", [], [""], ["a", ""], [[]], [[1], []]])
def test_completion_empty_prompt_is_rejected(prompt):
    with pytest.raises(RequestError, match="empty"):
        _completion(prompt=prompt)


@pytest.mark.parametrize("prompt", [[True, False], [[5, True]], [5, "6"], [5.0]])
def test_completion_token_ids_are_integers_only(prompt):
    """JSON true is not token id 1 (pydantic's lax mode would take it), nor "6" id 6."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        CompletionRequest(prompt=prompt)


def test_completion_sampling_params_mapping():
    obj = _completion(
        prompt="x",
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        presence_penalty=0.2,
        frequency_penalty=-0.3,
        repetition_penalty=1.1,
        stop=["\n", "END"],
        stop_token_ids=[7],
        seed=3,
        logit_bias={"12": -100},
        ignore_eos=True,
        min_tokens=2,
        skip_special_tokens=False,
        n=2,
        logprobs=3,
    )
    sp = obj.sampling_params
    assert sp["max_new_tokens"] == 16  # OpenAI's completions default
    assert sp["temperature"] == 0.5 and sp["top_p"] == 0.9 and sp["top_k"] == 5
    assert sp["min_p"] == 0.1 and sp["presence_penalty"] == 0.2
    assert sp["frequency_penalty"] == -0.3 and sp["repetition_penalty"] == 1.1
    assert sp["stop"] == ["\n", "END"] and sp["stop_token_ids"] == [7]
    assert sp["seed"] == 3 and sp["logit_bias"] == {"12": -100}
    assert sp["ignore_eos"] is True and sp["min_new_tokens"] == 2 and sp["n"] == 2
    assert sp["skip_special_tokens"] is False
    assert obj.return_logprob is True and obj.top_logprobs_num == 3
    # Unset fields are left out so SamplingParams keeps SGLang's defaults.
    assert "json_schema" not in _completion(prompt="x").sampling_params
    assert "temperature" not in _completion(prompt="x").sampling_params


def test_response_format_becomes_json_schema():
    obj = _completion(prompt="x", response_format={"type": "json_object"})
    assert json.loads(obj.sampling_params["json_schema"]) == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    obj = _completion(prompt="x", response_format=fmt)
    assert json.loads(obj.sampling_params["json_schema"]) == schema
    assert (
        "json_schema"
        not in _completion(prompt="x", response_format={"type": "text"}).sampling_params
    )
    with pytest.raises(RequestError):
        _completion(prompt="x", response_format={"type": "json_schema", "json_schema": {}})
    obj = _completion(prompt="x", regex="[ab]+")
    assert obj.sampling_params["regex"] == "[ab]+"


def test_the_clients_rid_reaches_the_engine_for_n_choices_and_batches(fake_tm):
    """With n > 1 or a list prompt the rid was dropped: /abort_request by it did nothing."""
    assert _completion(prompt="a", n=2, rid="r").rid == "r"
    assert _completion(prompt=["a", "b"], rid="r").rid == "r"  # the prompts: r_0, r_1
    assert _completion(prompt=["a", "b"], rid=["x", "y"]).rid == ["x", "y"]
    for prompt, rid in (("a", ["x"]), (["a", "b"], ["x"]), ([[5], [6]], ["x", "y", "z"])):
        with pytest.raises(RequestError, match="rid is a list of"):
            _completion(prompt=prompt, rid=rid)
    chat = {"messages": [{"role": "user", "content": "hi"}], "rid": "c"}
    assert chat_to_generate(ChatCompletionRequest(**chat, n=3), fake_tm).rid == "c"
    with pytest.raises(RequestError, match="rid is a list of 2 for 1 prompt"):
        chat_to_generate(ChatCompletionRequest(**{**chat, "rid": ["c", "d"]}), fake_tm)


def test_chat_request_mapping(fake_tm):
    req = ChatCompletionRequest(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        max_tokens=9,
        max_completion_tokens=5,
        logprobs=True,
        top_logprobs=2,
    )
    obj = chat_to_generate(req, fake_tm)
    assert fake_tm.tokenizer.decode(obj.input_ids) == "<system>be brief<user>hi<assistant>"
    assert obj.sampling_params["max_new_tokens"] == 5  # max_completion_tokens wins
    assert obj.return_logprob and obj.top_logprobs_num == 2
    plain = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    # OpenAI's chat default: no limit but the context window (None → the scheduler's room).
    assert chat_to_generate(plain, fake_tm).sampling_params["max_new_tokens"] is None


def test_chat_request_errors(fake_tm):
    no_logprobs = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(RequestError, match="logprobs"):
        chat_to_generate(no_logprobs, fake_tm)
    image = [{"type": "image_url"}]
    with pytest.raises(RequestError, match="messages.0.content.0: unsupported .* 'image_url'"):
        chat_to_generate(
            ChatCompletionRequest(messages=[{"role": "user", "content": image}]), fake_tm
        )
    no_text = [{"type": "text", "text": "a"}, {"type": "text"}]  # was "unsupported type 'text'"
    with pytest.raises(RequestError, match=r"messages.0.content.1.text is required"):
        chat_to_generate(
            ChatCompletionRequest(messages=[{"role": "user", "content": no_text}]), fake_tm
        )


def test_finish_reason_and_usage():
    assert finish_reason({"finish_reason": None}) == (None, None)
    assert finish_reason({"finish_reason": {"type": "stop", "matched": 2}}) == ("stop", 2)
    assert finish_reason({"finish_reason": {"type": "length", "length": 4}})[0] == "length"
    assert finish_reason({"finish_reason": {"type": "abort", "message": "x"}})[0] == "abort"
    metas = [
        {"prompt_tokens": 10, "completion_tokens": 3, "cached_tokens": 0},
        {"prompt_tokens": 10, "completion_tokens": 4, "cached_tokens": 9},
        {"prompt_tokens": 6, "completion_tokens": 5, "cached_tokens": 0},
        {"prompt_tokens": 6, "completion_tokens": 1, "cached_tokens": 5},
    ]
    usage = make_usage(metas, n=2)  # two prompts × two samples
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (16, 13, 29)
    assert usage.prompt_tokens_details.cached_tokens == 14


def test_model_names():
    assert served_model_name(ServerArgs()) == "SmolLM2-135M-Instruct"
    args = ServerArgs(model_path="/m/Foo-1B.Q4_1.gguf")
    assert served_model_name(args) == "Foo-1B.Q4_1"
    assert {"Foo-1B.Q4_1", "Foo-1B.Q4_1.gguf", "/m/Foo-1B.Q4_1.gguf"} <= model_aliases(args)
    assert served_model_name(ServerArgs(model_path="/m/Qwen2.5-0.5B/")) == "Qwen2.5-0.5B"
    assert served_model_name(ServerArgs(served_model_name="mine")) == "mine"


def test_the_models_generation_config_fills_the_sampling_fields_a_request_leaves_unset(
    fake_tm, make_client, tmp_path, caplog
):
    """--sampling-defaults model (SGLang's and vLLM's default): an HF Instruct model's
    recommended temperature / top_p / top_k / min_p / repetition_penalty apply where an OpenAI
    request sets none (they were ignored: temperature 1 and no top-k); a request's own value
    wins; values out of range (and HF's top_k 0, no top-k) are skipped; /generate keeps its
    own defaults; --sampling-defaults openai turns it off."""
    gen = {
        "do_sample": True,
        "temperature": 0.05,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 5.0,  # out of range: skipped with a warning
        "min_p": float("nan"),
        "eos_token_id": 2,
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    from radixserve.model_loader.weights import load_sampling_defaults

    with caplog.at_level("WARNING"):
        assert load_sampling_defaults(str(tmp_path)) == {
            "temperature": 0.05,
            "top_p": 0.8,
            "top_k": 20,
        }
    assert "repetition_penalty 5.0 is out of range" in caplog.text
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 0, "top_p": True}))
    assert load_sampling_defaults(str(tmp_path)) == {}
    assert load_sampling_defaults(str(tmp_path / "model.gguf")) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with make_client(fake_tm, model_path=str(tmp_path)) as client:
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        own = {**chat, "temperature": 0.7}
        assert client.post("/v1/chat/completions", json=own).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "a", "top_k": 3}).status_code == 200
        body = {"text": "a", "sampling_params": {"max_new_tokens": 2}}
        assert client.post("/generate", json=body).status_code == 200
    sps = [r.sampling_params for r in fake_tm.requests]
    assert [(sp["temperature"], sp["top_p"], sp["top_k"]) for sp in sps[:3]] == [
        (0.05, 0.8, 20),
        (0.7, 0.8, 20),
        (0.05, 0.8, 3),
    ]
    assert "repetition_penalty" not in sps[0] and "min_p" not in sps[0]
    assert "temperature" not in sps[3]
    fake_tm.requests.clear()
    with make_client(fake_tm, model_path=str(tmp_path), sampling_defaults="openai") as client:
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert "temperature" not in fake_tm.requests[0].sampling_params


# -- the app around a fake TokenizerManager ------------------------------------------------------
def test_completion_response_shape(fake_tm, make_client):
    with make_client(fake_tm) as client:
        r = client.post("/v1/completions", json={"prompt": ["ab", "c"], "n": 2, "max_tokens": 2})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "tiny-llama"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "Hi" and c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 8,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_completion_logprobs_and_echo(fake_tm, make_client):
    req = {"prompt": "ab", "logprobs": 2, "max_tokens": 3}
    with make_client(fake_tm) as client:
        choice = client.post("/v1/completions", json=req).json()["choices"][0]
        echoed = client.post("/v1/completions", json={**req, "logprobs": None, "echo": True})
        both = client.post("/v1/completions", json={**req, "echo": True})
    lp = choice["logprobs"]
    assert choice["text"] == "Hi!" and lp["tokens"] == ["H", "i", "!"]
    assert lp["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert lp["top_logprobs"][0] == {"H": -0.5, "x": -1.5}
    assert lp["text_offset"] == [0, 1, 2]
    assert echoed.json()["choices"][0]["text"] == "abHi!"
    # echo + logprobs: the prompt's tokens first, the first without a logprob or top.
    assert fake_tm.requests[-1].logprob_start_len == 0
    assert fake_tm.requests[0].logprob_start_len == -1
    blp = both.json()["choices"][0]["logprobs"]
    assert both.json()["choices"][0]["text"] == "abHi!"
    assert blp["tokens"] == ["a", "b", "H", "i", "!"]
    assert blp["token_logprobs"] == [None, -0.25, -0.5, -0.5, -0.5]
    assert blp["top_logprobs"][:2] == [None, {"b": -0.25}]
    assert blp["text_offset"] == [0, 1, 2, 3, 4]


def test_streamed_text_offsets_equal_the_whole_responses(fake_tm, make_client, monkeypatch):
    """A token that adds no text yet (it ends inside a UTF-8 character): the stream's
    text_offset counted the text sent, the whole response the tokens' strings ([0, 0, 2]
    against [0, 1, 2])."""
    whole_output = fake_tm._output

    def lagging(single, k, total):
        out = whole_output(single, k, total)
        return {**out, "text": "" if k == 1 else out["text"]}

    monkeypatch.setattr(fake_tm, "_output", lagging)
    for echo in (False, True):
        req = {"prompt": "ab", "logprobs": 1, "max_tokens": 3, "echo": echo}
        with make_client(fake_tm) as client:
            whole = client.post("/v1/completions", json=req).json()["choices"][0]["logprobs"]
            events = _sse(client.post("/v1/completions", json={**req, "stream": True}))
        offsets = [o for e in events[:-1] for o in e["choices"][0]["logprobs"]["text_offset"]]
        assert offsets == whole["text_offset"] == list(range(5 if echo else 3))


def test_legacy_top_logprobs_keep_the_likeliest_of_tokens_sharing_a_text():
    """Partial UTF-8 tokens all read "\ufffd": the least likely one's logprob won the key."""
    from radixserve.entrypoints.openai_api import completion_logprobs

    def tok(t: int) -> str:
        return "\ufffd" if t in (5, 6) else chr(t)

    top = [(-0.1, 5, None), (-0.2, 65, None), (-0.3, 6, None)]
    meta = {"output_token_logprobs": [(-0.1, 5)], "output_top_logprobs": [top]}
    lp = completion_logprobs(tok, meta, 0, 0)
    assert lp.top_logprobs == [{"\ufffd": -0.1, "A": -0.2}]


def test_completion_stream_shape(fake_tm, make_client):
    req = {"prompt": ["a", "b"], "n": 2, "stream": True, "echo": True}
    req["stream_options"] = {"include_usage": True}
    with make_client(fake_tm) as client:
        events = _sse(client.post("/v1/completions", json=req))
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    chunks = events[:-2]
    for i in range(4):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == "ab"[i // 2] + "Hi!"
        assert [c["finish_reason"] for c in mine].count("length") == 1
        assert mine[-1]["finish_reason"] == "length"


def test_chat_stream_shape(fake_tm, make_client):
    req = {
        "messages": [{"role": "user", "content": "hey"}],
        "n": 2,
        "stream": True,
        "logprobs": True,
        "stream_options": {"include_usage": True},
    }
    with make_client(fake_tm) as client:
        events = _sse(client.post("/v1/chat/completions", json=req))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"]["content"] or "" for c in mine[1:]) == "Hi!"
        assert [c["finish_reason"] for c in mine].count("length") == 1
        tokens = [t["token"] for c in mine[1:] for t in c["logprobs"]["content"]]
        assert tokens == ["H", "i", "!"]
    assert events[-2]["usage"]["completion_tokens"] == 6


def test_chat_response_logprobs(fake_tm, make_client):
    req = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}
    with make_client(fake_tm) as client:
        body = client.post("/v1/chat/completions", json=req).json()
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hi!"}
    first = choice["logprobs"]["content"][0]
    assert first["token"] == "H" and first["bytes"] == [72] and first["logprob"] == -0.5
    assert [t["token"] for t in first["top_logprobs"]] == ["H", "x"]


BAD_COMPLETIONS = [
    ({"prompt": "x", "n": 0}, 400),
    ({"prompt": "x", "max_tokens": -3}, 400),
    ({"prompt": "x", "temperature": -0.1}, 400),
    ({"prompt": "x", "top_p": 0}, 400),
    ({"prompt": "x", "top_p": 1.5}, 400),
    ({"prompt": ""}, 400),
    ({"prompt": []}, 400),
    ({"prompt": 5}, 400),
    ({"prompt": "x", "max_tokens": "many"}, 400),
    ({"prompt": "x", "stop": 3}, 400),
    ({"prompt": "x", "logprobs": 50}, 400),
    ({"prompt": "x", "model": "gpt-9"}, 404),
]


@pytest.mark.parametrize("body,status", BAD_COMPLETIONS)
def test_bad_completion_requests(fake_tm, make_client, body, status):
    with make_client(fake_tm) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == status
        err = r.json()["error"]
        assert err["code"] == status and err["message"] and err["type"]
        assert client.post("/v1/completions", json={"prompt": "ok"}).status_code == 200


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"[1, 2]", b'{"messages": []}', b'{"messages": "hi"}', b"", b'{"x": 1}'],
)
def test_bad_chat_bodies(fake_tm, make_client, raw):
    with make_client(fake_tm) as client:
        r = client.post("/v1/chat/completions", content=raw)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == 400


def test_native_generate(fake_tm, make_client):
    with make_client(fake_tm) as client:
        out = client.post("/generate", json={"text": "ab", "sampling_params": {"n": 1}}).json()
        assert out["text"] == "Hi!" and out["meta_info"]["finish_reason"]["type"] == "length"
        batch = client.post("/generate", json={"input_ids": [[1], [2, 3]]}).json()
        assert [o["meta_info"]["prompt_tokens"] for o in batch] == [1, 2]
        events = _sse(client.post("/generate", json={"text": "ab", "stream": True}))
        assert [e["text"] for e in events[:-1]] == ["H", "Hi", "Hi!"] and events[-1] == "[DONE]"
        assert client.post("/generate", json={}).status_code == 400
        assert client.post("/generate", json={"text": "a", "input_ids": [1]}).status_code == 400
        assert client.post("/generate", json={"text": ""}).status_code == 400


def test_info_routes(fake_tm, make_client):
    with make_client(fake_tm) as client:
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny-llama"]
        assert client.get("/v1/models/tiny-llama.gguf").json()["id"] == "tiny-llama"
        assert client.get("/v1/models//models/tiny-llama.gguf").status_code == 200
        assert client.get("/v1/models/other").status_code == 404
        info = client.get("/model_info").json()
        assert info["is_generation"] is True and info["served_model_name"] == "tiny-llama"
        assert client.get("/server_info").json()["max_total_num_tokens"] == 100
        assert client.get("/health").status_code == 200
        assert client.post("/flush_cache").status_code == 200
        assert client.get("/flush_cache").status_code == 200
        client.post("/v1/completions", json={"prompt": "ab"})
        metrics = client.get("/metrics")
        assert metrics.status_code == 200
        assert "sglang:num_running_reqs" in metrics.text
        assert client.get("/nope").json()["error"]["code"] == 404


def test_api_key(fake_tm, make_client):
    with make_client(fake_tm, api_key="sekret") as client:
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        wrong = {"Authorization": "Bearer nope"}
        assert client.get("/v1/models", headers=wrong).status_code == 401
        assert client.get("/server_info").status_code == 401
        assert client.get("/health").status_code == 200
        assert client.get("/health_generate").status_code == 200  # open, as in SGLang
        assert client.get("/metrics").status_code == 200
        good = {"Authorization": "Bearer sekret"}
        assert client.post("/v1/completions", json={"prompt": "x"}, headers=good).status_code == 200
        assert client.get("/v1/models", headers=good).status_code == 200
        info = client.get("/server_info", headers=good).json()
        assert info["api_key"] == "<set>" and "sekret" not in json.dumps(info)  # not shown


def test_cors_preflight_and_headers_with_and_without_a_key(fake_tm, make_client):
    """A browser page on another origin could not call the server: the preflight was a 405
    (a 401 with --api-key), and no answer carried Access-Control-Allow-Origin. SGLang allows
    every origin; so do we, and a preflight needs no key."""
    origin = {"Origin": "http://localhost:5173"}
    preflight = {
        **origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    for key in (None, "sekret"):
        with make_client(fake_tm, api_key=key) as client:
            r = client.options("/v1/chat/completions", headers=preflight)
            assert r.status_code == 200, (key, r.status_code)
            assert r.headers["access-control-allow-origin"] == origin["Origin"]
            assert "POST" in r.headers["access-control-allow-methods"]
            assert "authorization" in r.headers["access-control-allow-headers"].lower()
            auth = {"Authorization": f"Bearer {key}"} if key else {}
            r = client.post("/v1/completions", json={"prompt": "x"}, headers={**origin, **auth})
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == origin["Origin"]
            if key:  # (the refusal is readable by the page too)
                r = client.post("/v1/completions", json={"prompt": "x"}, headers=origin)
                assert r.status_code == 401 and "access-control-allow-origin" in r.headers


def test_a_body_past_the_limit_is_413_and_a_405_says_what_is_allowed(fake_tm, make_client):
    """A body of any size was read whole (with a 50 MB prompt the server was killed for its
    memory); a 405 had no Allow header (RFC 9110 requires it; plain FastAPI sends it)."""
    from radixserve.entrypoints import http_utils

    with make_client(fake_tm) as client:
        big = b'{"prompt": "' + b"a" * http_utils.MAX_BODY_BYTES + b'"}'
        r = client.post("/v1/completions", content=big)
        assert r.status_code == 413 and "larger than 64 MiB" in r.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": "ab"}).status_code == 200
        r = client.get("/v1/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_health_is_503_while_the_warm_up_runs(fake_tm, make_client):
    """/health answered 200 before the warm-up request had finished: a router or readiness
    probe sent traffic into the warm-up and its cache flush. 503 until it is done, as SGLang
    answers while starting."""
    with make_client(fake_tm) as client:
        state = client.app.state.rs
        state.warming_up = True
        for path in ("/health", "/health_generate"):
            r = client.get(path)
            assert r.status_code == 503 and "warm-up" in r.json()["error"]["message"]
        state.warming_up = False
        assert client.get("/health").status_code == 200
        assert client.get("/health_generate").status_code == 200


@pytest.mark.parametrize("outputs_meanwhile", [True, False])
def test_health_generate_when_the_queue_is_full(
    fake_tm, make_client, monkeypatch, outputs_meanwhile
):
    """The probe refused for load (--max-queued-requests) is no failure while the requests in
    flight stream output; with none arriving it is 503 at the time limit."""
    import radixserve.entrypoints.http_server as http_server

    monkeypatch.setattr(http_server, "HEALTH_GENERATE_TIMEOUT_S", 0.5)

    async def refused(obj, request=None):
        fake_tm.last_output_time = time.monotonic() + (0.2 if outputs_meanwhile else -1)
        raise RequestError("the server is overloaded", 503)
        yield

    monkeypatch.setattr(fake_tm, "generate_request", refused)
    with make_client(fake_tm) as client:
        r = client.get("/health_generate")
    assert r.status_code == (200 if outputs_meanwhile else 503)
    if not outputs_meanwhile:
        assert "time limit" in r.json()["error"]["message"]


def test_health_generate_fails_on_a_failed_generation(fake_tm, make_client, monkeypatch):
    async def broken(obj, request=None):
        raise RequestError("the scheduler is gone", 500)
        yield

    monkeypatch.setattr(fake_tm, "generate_request", broken)
    with make_client(fake_tm) as client:
        r = client.get("/health_generate")
    assert r.status_code == 503 and "the scheduler is gone" in r.json()["error"]["message"]


def test_health_generate_is_503_at_once_when_the_scheduler_is_dead(
    fake_tm, make_client, monkeypatch
):
    """The TokenizerManager's 503 for a dead scheduler was read as a full queue: the probe
    waited for other output until the shutdown cancelled it, a 500 with a traceback. It is
    marked as no user request (log_metrics): probes were counted in the request metrics."""
    import radixserve.entrypoints.http_server as http_server

    monkeypatch.setattr(http_server, "HEALTH_GENERATE_TIMEOUT_S", 30)
    probes = []

    async def dead(obj, request=None):
        probes.append(obj)
        fake_tm.dead = "radixserve-scheduler exited with code -9"
        raise RequestError(fake_tm.dead, 503)
        yield

    monkeypatch.setattr(fake_tm, "generate_request", dead)
    with make_client(fake_tm) as client:
        start = time.monotonic()
        r = client.get("/health_generate")
    assert r.status_code == 503 and "exited with code -9" in r.json()["error"]["message"]
    assert time.monotonic() - start < 10
    assert [p.log_metrics for p in probes] == [False]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_of_token_ids_outside_the_vocabulary_is_400(fake_tm, make_client, monkeypatch, stream):
    """The echo decodes the prompt only after the TokenizerManager has checked its ids (found
    by the HTTP fuzz: decoding 10**17 first was a 500)."""
    generate = fake_tm.generate_request

    async def checked(obj, request=None):
        if any(t >= fake_tm.vocab_size for t in obj.input_ids):
            raise RequestError("input_ids must be token ids in [0, vocab_size)")
        async for out in generate(obj, request):
            yield out

    monkeypatch.setattr(fake_tm, "generate_request", checked)
    body = {"prompt": [5, 10**17], "echo": True, "stream": stream}
    with make_client(fake_tm) as client:
        r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and "vocab_size" in r.json()["error"]["message"]


async def _refuse_overloaded(obj: Any, request: Any = None):
    """What the real TokenizerManager does past --max-queued-requests."""
    raise RequestError("the server is overloaded; retry later", 503, {"Retry-After": "1"})
    yield  # an async generator, like the real one


@pytest.mark.parametrize(
    "path, body",
    [
        ("/generate", {"text": "hi"}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ],
)
def test_overload_is_a_503_with_retry_after(make_client, fake_tm, path, body):
    fake_tm.generate_request = _refuse_overloaded
    with make_client(fake_tm) as client:
        resp = client.post(path, json=body)
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
    assert resp.json()["error"]["type"] == "service_unavailable"
    assert "overloaded" in resp.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_priority_reaches_the_scheduler_and_must_be_an_integer(fake_tm, make_client, path):
    """SGLang's completion and chat requests take `priority` (--schedule-policy priority): a
    400 here ("unsupported field"); /generate took true, "5" and 2.0 as integers."""
    body = {
        "/v1/completions": {"prompt": "ab", "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        "/generate": {"text": "ab"},
    }[path]
    with make_client(fake_tm) as client:
        r = client.post(path, json={**body, "priority": -7})
        assert r.status_code == 200, r.text
        assert fake_tm.requests[-1].priority == -7
        for bad in (True, "5", 2.0):
            r = client.post(path, json={**body, "priority": bad})
            assert r.status_code == 400 and "priority" in r.text, (bad, r.text)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", ["bootstrap_port", "bootstrap_room", "data_parallel_rank"])
def test_pairing_and_routing_fields_must_be_integers(fake_tm, make_client, path, field):
    """The router's fields: true was taken as 1 (room 1, port 1, replica 1), where /generate
    and the Engine refuse it."""
    body = {
        "/v1/completions": {"prompt": "ab", "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    }[path]
    with make_client(fake_tm) as client:
        for bad in (True, "5", 2.0, [True]):
            if field == "data_parallel_rank" and isinstance(bad, list):
                continue
            r = client.post(path, json={**body, field: bad})
            assert r.status_code == 400 and field in r.text, (bad, r.text)
