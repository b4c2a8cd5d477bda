"""Unknown and unsupported request fields (issue 9, item 13): a field that would change the
answer and is not implemented is an HTTP 400 whose message names it; harmless metadata and the
fields SGLang's router adds to every request are accepted; numbers must be finite and of the
right type. Runs the real app around the fake TokenizerManager of conftest.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
USER = {"role": "user", "content": "hi"}
BASE = {CHAT: {"messages": [USER]}, COMPLETIONS: {"prompt": "ab"}, GENERATE: {"text": "ab"}}


def _post(client: Any, path: str, body: dict[str, Any] | bytes) -> Any:
    if isinstance(body, bytes):
        return client.post(path, content=body)
    return client.post(path, json=body)


def _assert_400_naming(resp: Any, *words: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]


@pytest.fixture
def client(fake_tm, make_client):
    with make_client(fake_tm) as c:
        yield c


# -- fields nobody declared ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "path,field,value",
    [
        (COMPLETIONS, "prompt_logprobs", 1),
        (COMPLETIONS, "prompt_adapter_request", "a"),
        (CHAT, "web_search_options", {}),
        (CHAT, "logprob_start_len", 0),
        (CHAT, "best_of", 2),
        (CHAT, "suffix", "x"),
        (GENERATE, "image_data", "x.png"),
        (GENERATE, "max_new_tokens", 4),  # belongs inside sampling_params
    ],
)
def test_unknown_field_is_400_naming_it(client, path, field, value):
    r = _post(client, path, {**BASE[path], field: value})
    _assert_400_naming(r, "unsupported field(s)", field)
    two = _post(client, path, {**BASE[path], field: value, "zzz": 1})
    _assert_400_naming(two, field, "zzz")
    assert _post(client, path, BASE[path]).status_code == 200  # the server keeps serving


@pytest.mark.parametrize(
    "path,body,field",
    [
        (GENERATE, {"text": "a", "sampling_params": {"temprature": 0.5}}, "sampling_params.temp"),
        (CHAT, {"messages": [{**USER, "weight": 1}]}, "messages.0.weight"),
        (CHAT, {"messages": [USER], "stream_options": {"every": 1}}, "stream_options.every"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
            "x",
        ),
    ],
)
def test_unknown_nested_field_is_400_naming_it(client, path, body, field):
    r = _post(client, path, body)
    _assert_400_naming(r, "unsupported field", field)
    # Only the field itself: not also the union member it was not (once "sampling_params:
    # Input should be a valid list", about a dict nobody sent as a list).
    assert "valid list" not in r.json()["error"]["message"]


# -- function calling (the rest is in test_tool_calls.py) ---------------------------------------
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"functions": [TOOL["function"]]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
    ],
)
def test_legacy_function_calling_is_400(client, extra, field):
    r = client.post(CHAT, json={"messages": [USER], **extra})
    _assert_400_naming(r, f"{field} is not supported", "use tools and tool_choice")


def test_function_calling_no_op_values_pass(client, fake_tm):
    body = {"messages": [USER], "tools": [], "tool_choice": "none", "parallel_tool_calls": True}
    assert client.post(CHAT, json=body).status_code == 200
    assert client.post(CHAT, json={"messages": [USER], "tool_choice": None}).status_code == 200
    calls = {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}
    r = client.post(CHAT, json={"messages": [USER, calls]})
    _assert_400_naming(r, "messages.1.tool_calls.0.function", "Field required")


# -- harmless metadata ---------------------------------------------------------------------------
METADATA = {
    "user": "u-1",
    "metadata": {"team": "a"},
    "store": False,
    "service_tier": "auto",
    "safety_identifier": "s",
    "prompt_cache_key": "conversation-7",
    "verbosity": "low",
}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_harmless_metadata_passes(client, fake_tm, path):
    r = client.post(path, json={**BASE[path], **METADATA})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text" if path == COMPLETIONS else "message"]


def test_replayed_assistant_message_passes(client, fake_tm):
    """What the openai client sends back when a caller appends the message it received."""
    reply = {
        "role": "assistant",
        "content": "Hi!",
        "refusal": None,
        "annotations": [],
        "audio": None,
        "function_call": None,
        "tool_calls": None,
    }
    body = {"messages": [USER, reply, {"role": "user", "content": "more"}]}
    assert client.post(CHAT, json=body).status_code == 200
    prompt = fake_tm.tokenizer.decode(fake_tm.requests[-1].input_ids)
    assert prompt == "<user>hi<assistant>Hi!<user>more<assistant>"


def test_messages_from_the_sdks_parse_helpers_replay(client, fake_tm):
    """openai's chat.completions.parse / .stream return ParsedChatCompletionMessage, whose
    `parsed` and each call's `function.parsed_arguments` a replay sends back: 400 before."""
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": 1}', "parsed_arguments": {"a": 1}},
    }
    reply = {"role": "assistant", "content": '{"x": 1}', "parsed": {"x": 1}, "tool_calls": [call]}
    tool = {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    r = client.post(CHAT, json={"messages": [USER, reply, tool]})
    assert r.status_code == 200, r.text


def test_an_assistant_refusal_part_is_its_text(client, fake_tm):
    """OpenAI's assistant content parts are text or refusal (vLLM renders a refusal's text)."""
    refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}
    r = client.post(CHAT, json={"messages": [USER, refusal, {"role": "user", "content": "ok"}]})
    assert r.status_code == 200, r.text
    prompt = fake_tm.tokenizer.decode(fake_tm.requests[-1].input_ids)
    assert prompt == "<user>hi<assistant>No.<user>ok<assistant>"
    user_refusal = {"role": "user", "content": [{"type": "refusal", "refusal": "No."}]}
    r = client.post(CHAT, json={"messages": [user_refusal]})
    assert r.status_code == 400 and "'refusal'" in r.text


def test_litellms_cache_control_and_vllms_add_generation_prompt(client, fake_tm):
    """A text part with Anthropic's cache_control mark (LiteLLM passes it on) and vLLM's
    add_generation_prompt were 400s; vLLM takes both. Other extra keys still are."""
    part = {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}
    r = client.post(CHAT, json={"messages": [{"role": "user", "content": [part]}]})
    assert r.status_code == 200, r.text
    assert fake_tm.template_calls[-1][0] == [{"role": "user", "content": "hi"}]
    assert "add_generation_prompt" not in fake_tm.template_calls[-1][1]  # (true: the default)
    r = client.post(CHAT, json={"messages": [USER], "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    assert fake_tm.template_calls[-1][1]["add_generation_prompt"] is False
    part = {**part, "cache_contrl": 1}
    r = client.post(CHAT, json={"messages": [{"role": "user", "content": [part]}]})
    assert r.status_code == 400 and "cache_contrl" in r.text


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_null_is_the_default_where_openai_allows_it(client, fake_tm, path):
    """OpenAI's spec types n, stream, logprobs and echo as "... or null": 400 before."""
    nulls = {"n": None, "stream": None, "logprobs": None}
    if path == COMPLETIONS:
        nulls["echo"] = None
    r = client.post(path, json={**BASE[path], **nulls})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stream_options_take_null_as_the_default_and_include_obfuscation(client, path):
    """SGLang's stream options are "bool or null", and OpenAI's include_obfuscation is a
    no-op here (we never obfuscate): each was a 400."""
    for options, usage in [
        ({"include_usage": None, "continuous_usage_stats": None}, False),
        ({"include_usage": True, "include_obfuscation": False}, True),
        ({"include_obfuscation": True}, False),
    ]:
        r = client.post(path, json={**BASE[path], "stream": True, "stream_options": options})
        assert r.status_code == 200, r.text
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if "data: {" in line]
        assert any(c.get("usage") for c in chunks) == usage, options


def test_generate_takes_null_as_the_default_and_sglangs_frontend_fields(client, fake_tm):
    """SGLang's /generate reads null as the default (its frontend language sends stop_regex:
    [] in every request, and sampling_seed): each was a 400 here."""
    nulls = {"temperature": None, "top_p": None, "top_k": None, "n": None, "ignore_eos": None}
    nulls |= {"min_new_tokens": None, "frequency_penalty": None, "skip_special_tokens": None}
    top = {"return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None}
    body = {"text": "ab", "stream": None, **top}
    r = client.post(GENERATE, json={**body, "sampling_params": {"max_new_tokens": 3, **nulls}})
    assert r.status_code == 200, r.text
    req = fake_tm.requests[-1]
    assert req.sampling_params == {"max_new_tokens": 3}  # SamplingParams' defaults apply
    assert req.return_logprob is False and req.logprob_start_len == -1
    # max_new_tokens' null is a value of its own: up to the context's end
    assert client.post(GENERATE, json={"text": "ab", "sampling_params": {"max_new_tokens": None}})
    assert fake_tm.requests[-1].sampling_params == {"max_new_tokens": None}
    frontend = {"stop": [], "stop_token_ids": [], "stop_regex": [], "regex": None}
    frontend |= {"json_schema": None, "sampling_seed": 7, "custom_params": None}
    r = client.post(GENERATE, json={"text": "ab", "sampling_params": frontend})
    assert r.status_code == 200, r.text
    sp = fake_tm.requests[-1].sampling_params
    assert sp == {"stop": [], "stop_token_ids": [], "seed": 7, "regex": None, "json_schema": None}
    for asks, field in (
        ({"stop_regex": ["\\d"]}, "stop_regex"),
        ({"custom_params": {"a": 1}}, "custom_params"),
    ):
        r = client.post(GENERATE, json={"text": "ab", "sampling_params": asks})
        _assert_400_naming(r, field, "not implemented")


def test_generate_takes_the_logprob_fields_per_prompt(client, fake_tm):
    body = {"text": ["ab", "cd"], "return_logprob": [True, False], "top_logprobs_num": [2, 0]}
    r = client.post(GENERATE, json={**body, "logprob_start_len": [0, -1]})
    assert r.status_code == 200, r.text
    req = fake_tm.requests[-1]
    assert req.return_logprob == [True, False] and req.logprob_start_len == [0, -1]
    assert req[0].top_logprobs_num == 2 and req[1].top_logprobs_num == 0
    r = client.post(GENERATE, json={"text": ["ab", "cd"], "return_logprob": [True]})
    _assert_400_naming(r, "return_logprob is a list of 1 for 2 prompt(s)")
    r = client.post(GENERATE, json={"text": ["ab", "cd"], "top_logprobs_num": [2, 10**6]})
    _assert_400_naming(r, "top_logprobs_num")


def test_text_modalities_and_reasoning_effort_pass(fake_tm, make_client, template_kwargs):
    seen = template_kwargs
    with make_client(fake_tm) as client:
        body = {"messages": [USER], "modalities": ["text"], "reasoning_effort": "low"}
        assert client.post(CHAT, json=body).status_code == 200
        assert seen == [{"reasoning_effort": "low"}]  # a template variable (gpt-oss's)
        body["chat_template_kwargs"] = {"reasoning_effort": "high"}
        assert client.post(CHAT, json=body).status_code == 200
        assert seen[-1] == {"reasoning_effort": "high"}
        for extra in ({"modalities": ["text", "audio"]}, {"audio": {"voice": "alloy"}}):
            r = client.post(CHAT, json={"messages": [USER], **extra})
            _assert_400_naming(r, next(iter(extra)), "text only")


# -- the fields SGLang's router adds (sglang-router 0.3.2, see shared/notes/sglang-router.md) ----
ROUTER_GENERATE = {
    "text": "ab",
    "sampling_params": {"max_new_tokens": 2, "temperature": 0},
    "rid": "r-1",
    "return_logprob": False,
    "model": None,
    "return_text_in_logprobs": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}
ROUTER_CHAT = {
    "model": "tiny-llama",
    "messages": [USER],
    "max_completion_tokens": 2,
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
ROUTER_COMPLETIONS = {
    "model": "tiny-llama",
    "prompt": "ab",
    "max_tokens": 2,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
# PD mode adds these to all three kinds; --dp-aware adds the rank (this server has one: 0;
# tests/entrypoints/test_scaling.py sends other ranks to a --dp-size 2 server).
PD_FIELDS = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 2**62 + 5}
ROUTER_BODIES = [
    (GENERATE, ROUTER_GENERATE),
    (CHAT, ROUTER_CHAT),
    (COMPLETIONS, ROUTER_COMPLETIONS),
]


@pytest.mark.parametrize("path,body", ROUTER_BODIES)
@pytest.mark.parametrize(
    "extra", [{}, PD_FIELDS, {"bootstrap_port": None}, {"data_parallel_rank": 0}]
)
def test_router_bodies_pass(client, fake_tm, path, body, extra):
    r = client.post(path, json={**body, **extra})
    assert r.status_code == 200, r.text
    sent = fake_tm.requests[-1]
    assert sent.sampling_params["max_new_tokens"] == 2  # max_completion_tokens is honoured


def test_router_generate_stream_and_only_set_sampling_params(client, fake_tm):
    r = client.post(GENERATE, json={**ROUTER_GENERATE, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    # Only what the client set reaches SamplingParams, which keeps its own defaults.
    assert fake_tm.requests[-1].sampling_params == {"max_new_tokens": 2, "temperature": 0}
    assert fake_tm.requests[-1].rid == "r-1"


@pytest.mark.parametrize(
    "path,extra,message",
    [
        (GENERATE, {"return_hidden_states": True}, "return_hidden_states is not supported"),
        (CHAT, {"return_hidden_states": True}, "return_hidden_states is not supported"),
        (COMPLETIONS, {"return_hidden_states": True}, "return_hidden_states is not supported"),
        (GENERATE, {"background": True}, "background is not supported"),
        (GENERATE, {"return_bytes": True}, "return_bytes is not supported"),
        (GENERATE, {"return_entropy": True}, "return_entropy is not supported"),
    ],
)
def test_router_field_asking_for_more_is_400(client, path, extra, message):
    _assert_400_naming(_post(client, path, {**BASE[path], **extra}), message)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, fake_tm, path):
    """stream_options.continuous_usage_stats (SGLang's and vLLM's) was a 400."""
    fake_tm.reply = "abc"
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**BASE[path], "stream": True, "stream_options": options}
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 3 and len(counts) >= 3
    prompt = chunks[-1]["usage"]["prompt_tokens"]  # (the final usage chunk)
    assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
    assert all(
        c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in chunks
    )


def test_prompt_logprob_fields_reach_the_tokenizer_manager(client, fake_tm):
    body = {"text": "ab", "return_logprob": True, "logprob_start_len": 0}
    body["return_text_in_logprobs"] = True
    assert client.post(GENERATE, json=body).status_code == 200
    sent = fake_tm.requests[-1]
    assert sent.logprob_start_len == 0 and sent.return_text_in_logprobs is True
    _assert_400_naming(
        _post(client, GENERATE, {"text": "ab", "logprob_start_len": -2}), "logprob_start_len"
    )


def test_router_no_op_fields_with_other_no_op_values_pass(client):
    body = {"messages": [USER], "separate_reasoning": False, "stream_reasoning": False}
    assert client.post(CHAT, json=body).status_code == 200
    body = {"text": "ab", "log_metrics": False, "no_logs": True, "model": "anything"}
    assert client.post(GENERATE, json=body).status_code == 200


# -- completions-only behaviours -----------------------------------------------------------------
@pytest.mark.parametrize(
    "extra,message",
    [
        ({"suffix": "end"}, "suffix is not supported"),
        ({"best_of": 3}, "best_of is not supported"),
        ({"best_of": 1, "n": 2}, "best_of is not supported"),
    ],
)
def test_unsupported_completion_behaviours_are_400(client, extra, message):
    _assert_400_naming(client.post(COMPLETIONS, json={"prompt": "ab", **extra}), message)


def test_completion_no_op_values_pass(client):
    for extra in ({"suffix": ""}, {"suffix": None}, {"best_of": 2, "n": 2}, {"echo": True}):
        r = client.post(COMPLETIONS, json={"prompt": "ab", **extra})
        assert r.status_code == 200, (extra, r.text)


# -- numbers: finite, right type -----------------------------------------------------------------
@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
@pytest.mark.parametrize(
    "path,template,field",
    [
        (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": %s}', "temp"),
        (COMPLETIONS, b'{"prompt": "ab", "top_p": %s}', "top_p"),
        (COMPLETIONS, b'{"prompt": "ab", "presence_penalty": %s}', "presence_penalty"),
        (COMPLETIONS, b'{"prompt": "ab", "logit_bias": {"5": %s}}', "logit_bias.5"),
        (GENERATE, b'{"text": "ab", "sampling_params": {"temperature": %s}}', "temperature"),
        (GENERATE, b'{"text": "ab", "sampling_params": {"min_p": %s}}', "min_p"),
    ],
)
def test_non_finite_numbers_are_400_naming_the_field(client, path, template, field, literal):
    r = _post(client, path, template % literal)
    _assert_400_naming(r, field)
    assert "JSON" not in r.json()["error"]["message"]  # refused by validation, not the parser


def test_temperature_above_two_is_accepted_as_sglang_does(client, fake_tm):
    r = client.post(CHAT, json={"messages": [USER], "temperature": 3.5})
    assert r.status_code == 200
    assert fake_tm.requests[-1].sampling_params["temperature"] == 3.5
    _assert_400_naming(client.post(CHAT, json={"messages": [USER], "temperature": -1}), "temp")


@pytest.mark.parametrize(
    "path,extra,field",
    [
        (CHAT, {"temperature": "hot"}, "temperature"),
        (CHAT, {"n": 1.5}, "n"),
        (CHAT, {"stream": "maybe"}, "stream"),
        (CHAT, {"logprobs": 3}, "logprobs"),
        (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        (COMPLETIONS, {"max_tokens": [1]}, "max_tokens"),
        (COMPLETIONS, {"seed": "x"}, "seed"),
        (COMPLETIONS, {"stop_token_ids": ["a"]}, "stop_token_ids"),
        (COMPLETIONS, {"logit_bias": {"hello": 1}}, "logit_bias"),
        (COMPLETIONS, {"logit_bias": {"5": 101}}, "logit_bias"),
        (COMPLETIONS, {"logit_bias": {"5": 100, "005": 100}}, "logit_bias"),
        (COMPLETIONS, {"logit_bias": {"+5": 1}}, "logit_bias"),
        (COMPLETIONS, {"response_format": {"type": "grammar"}}, "response_format.type"),
        (GENERATE, {"sampling_params": {"top_k": "x"}}, "sampling_params.top_k"),
        (GENERATE, {"sampling_params": {"logit_bias": []}}, "sampling_params.logit_bias"),
        (GENERATE, {"sampling_params": {"stop": 3}}, "sampling_params.stop"),
        (GENERATE, {"sampling_params": {"temperature": "0.5"}}, "sampling_params.temperature"),
        (GENERATE, {"sampling_params": {"ignore_eos": 1}}, "sampling_params.ignore_eos"),
        (GENERATE, {"return_logprob": []}, "return_logprob"),
        (GENERATE, {"top_logprobs_num": -1}, "top_logprobs_num"),
    ],
)
def test_wrong_types_are_400_naming_the_field(client, path, extra, field):
    _assert_400_naming(_post(client, path, {**BASE[path], **extra}), field)


# -- /generate batches ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body,words",
    [
        ({"text": ["a", "b"], "sampling_params": [{}]}, ("sampling_params", "1 for 2")),
        ({"text": "a", "sampling_params": [{}]}, ("sampling_params", "1 prompt")),
        ({"input_ids": [[5], [6]], "rid": ["x"]}, ("rid",)),
        ({"input_ids": [5, 6], "rid": ["x", "y"]}, ("rid",)),
        ({"text": "a", "input_ids": [5]}, ("exactly one of text and input_ids",)),
    ],
)
def test_generate_batch_shape_errors(client, body, words):
    _assert_400_naming(client.post(GENERATE, json=body), *words)


def test_generate_batch_with_per_prompt_params(client, fake_tm):
    body = {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]}
    assert client.post(GENERATE, json=body).status_code == 200
    assert fake_tm.requests[-1].sampling_params == body["sampling_params"]


def test_continue_final_message_continues_the_assistants_message(client, fake_tm):
    """It was a 400 "not implemented yet" (SGLang and vLLM serve it)."""
    prefill = {"role": "assistant", "content": "The answer is"}
    body = {"messages": [USER, prefill], "continue_final_message": True}
    assert client.post(CHAT, json=body).status_code == 200
    assert fake_tm.template_calls[-1][1] == {
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    r = client.post(CHAT, json={"messages": [USER], "continue_final_message": True})
    _assert_400_naming(r, "continue_final_message needs the last message")


# -- chat_template_kwargs ------------------------------------------------------------------------
@pytest.fixture
def template_kwargs(fake_tm, monkeypatch) -> list[dict[str, Any]]:
    """The keyword arguments of each apply_chat_template call the fake makes from now on."""
    seen: list[dict[str, Any]] = []
    render = fake_tm.apply_chat_template

    def apply_chat_template(messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        seen.append(kwargs)
        return render(messages)

    monkeypatch.setattr(fake_tm, "apply_chat_template", apply_chat_template)
    return seen


def test_chat_template_kwargs_reach_the_template(fake_tm, make_client, template_kwargs):
    seen = template_kwargs
    with make_client(fake_tm) as client:
        body = {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False}}
        assert client.post(CHAT, json=body).status_code == 200
        assert seen == [{"enable_thinking": False}]
        for reserved in ("tokenize", "add_generation_prompt", "tools", "sanitize_control_tokens"):
            body = {"messages": [USER], "chat_template_kwargs": {reserved: True}}
            _assert_400_naming(client.post(CHAT, json=body), "chat_template_kwargs", reserved)
        assert len(seen) == 1


def test_lone_surrogate_is_still_a_json_error(client):
    """The fallback parser that names a NaN's field must not let in what orjson refuses."""
    r = client.post(COMPLETIONS, content=b'{"prompt": "\\ud800"}')
    _assert_400_naming(r, "not valid JSON")
