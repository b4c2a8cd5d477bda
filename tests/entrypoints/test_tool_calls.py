"""Function calling on /v1/chat/completions.

Fast tests run the real app around the fake TokenizerManager (its reply is the "model output"):
the response and stream shapes, what reaches the template and the sampling params, and every
malformed request answered with a 400. The real-model tests serve the default model with a
Qwen2.5-style template (templates/qwen25_tools.jinja) and --tool-call-parser qwen25, and talk
to it with the official openai client: required and named tool_choice must yield calls whose
arguments validate against the schema; auto is driven through the parser by a regex that makes
the model write a Hermes call.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jsonschema
import openai
import pytest
from test_http_server import MODEL, ServerProcess, wait_drained

from radixserve.args import ServerArgs

CHAT = "/v1/chat/completions"
TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")
QWEN25_TEMPLATE = os.path.join(TEMPLATES, "qwen25_tools.jinja")
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "maxLength": 8}},
    "required": ["tz"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a time zone",
            "parameters": TIME,
        },
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = {"role": "user", "content": "What is the weather in Paris?"}
CALL_TEXT = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
REPLY = "Let me look.\n" + CALL_TEXT


def _sse(resp: Any) -> list[Any]:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


@pytest.fixture
def tools_client(fake_tm, make_client):
    """A client of the app around a fake TM that replies with text and then a Hermes call."""
    tm = fake_tm
    tm.reply = REPLY
    tm.server_args = ServerArgs(tool_call_parser="qwen25", chat_template=QWEN25_TEMPLATE)
    with make_client(tm) as client:
        yield client, tm


# -- fast: shapes, template, sampling params, 400s -------------------------------------------------
def test_auto_parses_the_call(tools_client):
    client, tm = tools_client
    r = client.post(CHAT, json={"messages": [USER], "tools": TOOLS})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (
        choice["finish_reason"] == "length"
    )  # the fake stops by length: not turned into tool_calls
    message = choice["message"]
    assert message["content"] == "Let me look."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {"tz": "CET"}
    _, kwargs = tm.template_calls[-1]
    assert kwargs["tools"] == TOOLS
    assert kwargs["chat_template"] == open(QWEN25_TEMPLATE).read()
    assert "json_schema" not in tm.requests[-1].sampling_params


def test_auto_stream_sends_content_then_name_then_arguments(tools_client):
    client, _ = tools_client
    r = client.post(CHAT, json={"messages": [USER], "tools": TOOLS, "stream": True})
    chunks = _sse(r)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert content == "Let me look."  # as the whole message has it: the "\n" before the call
    first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    assert all(not d.get("content") for d in deltas[first_call:])  # no text after the call
    assert calls[0]["function"] == {"name": "get_time", "arguments": ""} and calls[0]["id"]
    assert all("name" not in tc["function"] and "id" not in tc for tc in calls[1:])
    assert len(calls) > 2  # the arguments came in pieces
    assert json.loads("".join(tc["function"].get("arguments", "") for tc in calls)) == {"tz": "CET"}
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [x for x in reasons if x] == ["length"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_a_stop_string_does_not_finish_with_tool_calls(tools_client, stream):
    """A stop string (or EOS) inside a call's arguments: the stream finished with
    "tool_calls" and arguments that are not JSON (a client's json.loads failed), where the
    whole message is the text, finishing with "stop". Both say "stop" and the match now."""
    client, tm = tools_client
    tm.reply = 'Ok.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "'
    tm.finish = {"type": "stop", "matched": "CET"}
    body = {"messages": [USER], "tools": TOOLS, "stream": stream}
    r = client.post(CHAT, json=body)
    if stream:
        choices = [c["choices"][0] for c in _sse(r) if c["choices"]]
        [last] = [c for c in choices if c["finish_reason"]]
        calls = [tc for c in choices for tc in c["delta"].get("tool_calls") or []]
        assert calls  # (a call once committed is sent: it cannot be taken back)
    else:
        last = r.json()["choices"][0]
        assert "tool_calls" not in last["message"]
    assert (last["finish_reason"], last["matched_stop"]) == ("stop", "CET")
    tm.reply = CALL_TEXT  # a whole call, then EOS: "tool_calls"
    tm.finish = {"type": "stop", "matched": 2}
    r = client.post(CHAT, json=body)
    reasons = (
        [c["choices"][0]["finish_reason"] for c in _sse(r) if c["choices"]]
        if stream
        else [r.json()["choices"][0]["finish_reason"]]
    )
    assert [x for x in reasons if x] == ["tool_calls"]


@pytest.mark.parametrize(
    "extra,skip",
    [
        ({"tools": TOOLS}, False),
        ({"tools": TOOLS, "tool_choice": "required"}, False),
        ({"tools": TOOLS, "tool_choice": "none"}, True),
        ({}, True),
        ({"skip_special_tokens": False}, False),
    ],
)
def test_tools_keep_the_special_tokens_for_the_parser(tools_client, extra, skip):
    """Llama 3's <|python_tag|> (Llama 4's <|python_start|>) is a special token: skipped by
    default, the detokenized text reached the parser without it and the call came back as
    content. With tools (and tool_choice not "none") special tokens are kept, as in SGLang."""
    client, tm = tools_client
    assert client.post(CHAT, json={"messages": [USER], **extra}).status_code == 200
    assert tm.requests[-1].sampling_params["skip_special_tokens"] is skip


def test_none_leaves_the_text_and_the_template_without_tools(tools_client):
    client, tm = tools_client
    r = client.post(CHAT, json={"messages": [USER], "tools": TOOLS, "tool_choice": "none"})
    message = r.json()["choices"][0]["message"]
    assert message["content"] == REPLY and "tool_calls" not in message
    assert "tools" not in tm.template_calls[-1][1]


@pytest.mark.parametrize(
    "choice,parallel,names,max_items",
    [
        ("required", None, ["get_weather", "get_time"], None),
        ("required", False, ["get_weather", "get_time"], 1),
        ({"type": "function", "function": {"name": "get_time"}}, None, ["get_time"], 1),
    ],
)
def test_required_and_named_constrain_to_a_schema_of_calls(
    tools_client, choice, parallel, names, max_items
):
    client, tm = tools_client
    body = {"messages": [USER], "tools": TOOLS, "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    assert client.post(CHAT, json=body).status_code == 200
    schema = json.loads(tm.requests[-1].sampling_params["json_schema"])
    assert schema.get("maxItems") == max_items and schema["minItems"] == 1
    validator = jsonschema.Draft202012Validator(schema)
    for name in names:
        params = {"tz": "UTC"} if name == "get_time" else {"city": "Oslo", "unit": "celsius"}
        assert validator.is_valid([{"name": name, "parameters": params}])
        assert not validator.is_valid([{"name": name, "parameters": {"bogus": 1}}])
    assert validator.is_valid(
        [{"name": "get_weather", "parameters": {"city": "a", "unit": "celsius"}}]
    ) == ("get_weather" in names)
    assert not validator.is_valid([{"name": "rm", "parameters": {}}])
    assert not validator.is_valid([])


def test_a_named_tool_choice_puts_only_that_tool_in_the_prompt(tools_client):
    """Every tool reached the template though only the named one can be called (SGLang keeps
    the named one only)."""
    client, tm = tools_client
    named = {"type": "function", "function": {"name": "get_time"}}
    body = {"messages": [USER], "tools": TOOLS, "tool_choice": named}
    assert client.post(CHAT, json=body).status_code == 200
    assert [t["function"]["name"] for t in tm.template_calls[-1][1]["tools"]] == ["get_time"]
    assert client.post(CHAT, json={**body, "tool_choice": "required"}).status_code == 200
    assert len(tm.template_calls[-1][1]["tools"]) == 2


TREE = {  # refers to itself ("#"), to its $defs and to an older-style definitions entry
    "type": "object",
    "properties": {
        "label": {"type": "string"},
        "child": {"$ref": "#"},
        "item": {"$ref": "#/$defs/Item"},
        "flag": {"$ref": "#/definitions/Flag"},
        "same": {"$ref": "#/properties/label"},
        "tag": {"const": {"$ref": "#"}},  # data, not a reference
    },
    "required": ["label"],
    "$defs": {"Item": {"type": "integer"}},
    "definitions": {"Flag": {"type": "boolean"}},
}
LIST = {  # its own, different $defs/Item
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
    "required": ["items"],
    "$defs": {"Item": {"type": "string"}},
}


def test_local_refs_of_each_function_keep_meaning_its_own_schema(tools_client):
    """A `$ref` of a function's parameters resolves inside them, not in the schema of calls
    around them: "#" made `child` a list of tool calls, "#/definitions/..." and two functions'
    `$defs/Item` were refused."""
    import xgrammar

    client, tm = tools_client
    tools = [
        {"type": "function", "function": {"name": "tree", "parameters": TREE}},
        {"type": "function", "function": {"name": "list", "parameters": LIST}},
    ]
    r = client.post(CHAT, json={"messages": [USER], "tools": tools, "tool_choice": "required"})
    assert r.status_code == 200, r.text
    text = tm.requests[-1].sampling_params["json_schema"]
    validator = jsonschema.Draft202012Validator(json.loads(text))
    tree = {"label": "a", "child": {"label": "b", "item": 3, "flag": True}, "same": "x"}
    assert validator.is_valid([{"name": "tree", "parameters": tree}])
    assert validator.is_valid([{"name": "list", "parameters": {"items": ["x", "y"]}}])
    for bad_tree in (
        {"label": "a", "child": [{"name": "tree", "parameters": {"label": "b"}}]},
        {"label": "a", "item": "3"},
        {"label": "a", "flag": 1},
        {"label": "a", "same": 1},
    ):
        assert not validator.is_valid([{"name": "tree", "parameters": bad_tree}]), bad_tree
    assert not validator.is_valid([{"name": "list", "parameters": {"items": [1]}}])
    info = xgrammar.TokenizerInfo([f"t{i}" for i in range(64)])
    xgrammar.GrammarCompiler(info).compile_json_schema(text)  # xgrammar resolves them too


def test_refs_under_properties_named_like_data_keywords_are_rebased(tools_client):
    """A property may be called "default", "enum", "const" or "examples": its `$ref` was left
    as it was (the property map was read as that keyword's data) and the schema refused."""
    import xgrammar

    client, tm = tools_client
    names = ("default", "enum", "const", "examples")
    params = {
        "type": "object",
        "properties": {n: {"$ref": "#/$defs/V"} for n in names},
        "required": list(names),
        "$defs": {"V": {"type": "integer"}},
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    r = client.post(CHAT, json={"messages": [USER], "tools": tools, "tool_choice": "required"})
    assert r.status_code == 200, r.text
    text = tm.requests[-1].sampling_params["json_schema"]
    validator = jsonschema.Draft202012Validator(json.loads(text))
    assert validator.is_valid([{"name": "f", "parameters": dict.fromkeys(names, 3)}])
    assert not validator.is_valid(
        [{"name": "f", "parameters": {**dict.fromkeys(names, 3), "enum": "x"}}]
    )
    info = xgrammar.TokenizerInfo([f"t{i}" for i in range(64)])
    xgrammar.GrammarCompiler(info).compile_json_schema(text)


def test_history_with_calls_and_results_reaches_the_template(tools_client):
    client, tm = tools_client
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"tz": "CET"}'},
    }
    messages = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    assert client.post(CHAT, json={"messages": messages, "tools": TOOLS}).status_code == 200
    rendered, _ = tm.template_calls[-1]
    assert rendered[1]["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_time", "arguments": {"tz": "CET"}},
        }
    ]
    assert rendered[2] == {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}


BAD_CALL = {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}
DEEP_CALL = {
    "id": "c",
    "type": "function",
    "function": {"name": "get_time", "arguments": "[" * 100_000 + "]" * 100_000},
}


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope', which is not one of tools",
        ),
        ({"tool_choice": "required"}, "tool_choice required needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "same name"),
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools.0.function.name",
        ),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools.0.function.name",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "a"}, "drop response_format"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ],
                "tool_choice": "required",
            },
            "must be an object schema",
        ),
        ({"messages": [USER, {"role": "tool", "content": "x"}]}, "needs its tool_call_id"),
        (
            {"messages": [USER, {"role": "assistant", "tool_calls": [BAD_CALL]}]},
            "arguments is not valid JSON",
        ),
        ({"messages": [{**USER, "tool_calls": [BAD_CALL]}]}, "only an assistant message"),
        (  # nested past Python's recursion limit inside the string (a 500 RecursionError)
            {"messages": [USER, {"role": "assistant", "tool_calls": [DEEP_CALL]}]},
            "arguments is not valid JSON",
        ),
    ],
)
def test_malformed_tool_requests_are_400(tools_client, extra, message):
    client, _ = tools_client
    r = client.post(CHAT, json={"messages": [USER], **extra})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


# -- the real model --------------------------------------------------------------------------------
AUTO_REGEX = (
    r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Lyon)", "unit": "celsius"\}\}\n</tool_call>'
)
GREEDY = {"temperature": 0.0, "max_tokens": 80}


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_path):
    yield from ServerProcess(
        str(tmp_path_factory.mktemp("tools")),
        *("--chat-template", QWEN25_TEMPLATE, "--tool-call-parser", "qwen25"),
    ).running()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)


def _check_calls(tool_calls: list[Any], names: set[str]) -> None:
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _collect_stream(stream: Any) -> tuple[str, dict[int, dict[str, str]], list[str]]:
    """(content, calls by index {id, name, arguments}, finish reasons) of a streamed choice."""
    content, calls, reasons = "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name, "name comes first"
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.function.name is None and tc.id is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return content, calls, reasons


@pytest.mark.real_model
class TestServedToolCalls:
    def test_required(self, client):
        r = client.chat.completions.create(
            model=MODEL, messages=[USER], tools=TOOLS, tool_choice="required", **GREEDY
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        _check_calls(choice.message.tool_calls, set(SCHEMAS))

    def test_named_streaming(self, client):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[USER],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            stream=True,
            **GREEDY,
        )
        content, calls, reasons = _collect_stream(stream)
        assert content == "" and reasons == ["tool_calls"]
        assert [c["name"] for c in calls.values()] == ["get_time"]
        jsonschema.validate(json.loads(calls[0]["arguments"]), TIME)

    @pytest.mark.parametrize("stream", [False, True])
    def test_auto_goes_through_the_parser(self, client, stream):
        """The regex makes the model write a Hermes call after some text; the parser must turn
        it into tool_calls (without the parser it would stay content)."""
        kwargs = dict(model=MODEL, messages=[USER], tools=TOOLS, extra_body={"regex": AUTO_REGEX})
        r = client.chat.completions.create(**kwargs, stream=stream, **GREEDY)
        if stream:
            content, calls, reasons = _collect_stream(r)
            assert content.strip() == "Checking." and reasons == ["tool_calls"]
            [call] = calls.values()
            name, arguments = call["name"], call["arguments"]
        else:
            message = r.choices[0].message
            assert message.content == "Checking." and r.choices[0].finish_reason == "tool_calls"
            [call] = message.tool_calls
            name, arguments = call.function.name, call.function.arguments
        assert name == "get_weather"
        assert json.loads(arguments)["city"] in ("Paris", "Lyon")

    def test_none_is_plain_text_without_tools_in_the_prompt(self, client):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[USER],
            tools=TOOLS,
            tool_choice="none",
            extra_body={"regex": AUTO_REGEX},
            **GREEDY,
        )
        assert r.choices[0].message.tool_calls is None
        assert r.choices[0].message.content.startswith("Checking.\n<tool_call>")
        assert r.choices[0].finish_reason == "stop"
        plain = client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=1)
        assert r.usage.prompt_tokens == plain.usage.prompt_tokens  # tools not rendered

    def test_multi_turn_with_a_tool_result(self, client):
        first = client.chat.completions.create(
            model=MODEL, messages=[USER], tools=TOOLS, tool_choice="required", **GREEDY
        )
        message = first.choices[0].message
        history = [USER, message.model_dump(exclude_none=True)]
        history += [
            {"role": "tool", "tool_call_id": c.id, "content": '{"temperature": 21}'}
            for c in message.tool_calls
        ]
        r = client.chat.completions.create(
            model=MODEL, messages=history, tools=TOOLS, tool_choice="required", **GREEDY
        )
        assert r.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the turn was rendered
        assert r.choices[0].finish_reason == "tool_calls"
        _check_calls(r.choices[0].message.tool_calls, set(SCHEMAS))

    def test_bad_requests_are_400_and_the_server_keeps_serving(self, client, server):
        bad = {"type": "function", "function": {"name": "nope"}}
        with pytest.raises(openai.BadRequestError, match="not one of tools"):
            client.chat.completions.create(
                model=MODEL, messages=[USER], tools=TOOLS, tool_choice=bad
            )
        broken = [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"a": {"type": "no-such-type"}}},
                },
            }
        ]
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model=MODEL, messages=[USER], tools=broken, tool_choice="required"
            )
        wait_drained(server)
