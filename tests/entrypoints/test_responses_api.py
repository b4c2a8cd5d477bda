"""OpenAI's Responses API (/v1/responses).

Fast tests run the real app around the fake TokenizerManager (its reply is the "model output"):
what reaches the chat template (instructions, input items, a tool round trip, the previous
response), the response and stream shapes, tool calls and reasoning through the chat parsers,
stored responses, and bad bodies answered with a 400 that names the field. The served tests
start one server on a tiny random model and compare with /v1/chat/completions (greedy text and
prompt tokens), drive `client.responses.create` / `.stream` of the official openai client, and
check that a stream closed early frees its KV slots.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from test_http_server import ServerProcess, wait_drained
from test_tool_calls import CALL_TEXT, QWEN25_TEMPLATE, TIME

from radixserve.args import ServerArgs
from radixserve.entrypoints import responses_serving
from radixserve.entrypoints.openai_tools import ChatParsing

RESPONSES = "/v1/responses"
USER = {"role": "user", "content": "What is the time in Paris?"}
TIME_TOOL = {"type": "function", "name": "get_time", "description": "The time", "parameters": TIME}
STREAM_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
TEXT_END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def _events(resp: Any) -> list[dict[str, Any]]:
    """The events of an SSE body, checking that each `event:` line names its data's type."""
    events, name = [], None
    for line in resp.text.splitlines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            event = json.loads(line[len("data: ") :])
            assert event["type"] == name
            events.append(event)
    return events


@pytest.fixture
def responses_client(fake_tm, make_client):
    def make(reply: str = "Hi!", **args: Any) -> Any:
        fake_tm.reply = reply
        fake_tm.server_args = ServerArgs(**args)
        return make_client(fake_tm)

    return make


# -- fast: the request as the template sees it ----------------------------------------------------
def test_instructions_are_the_system_message_and_a_string_input_the_user_message(
    responses_client, fake_tm
):
    with responses_client() as client:
        r = client.post(RESPONSES, json={"input": "hello", "instructions": "Be brief."})
        assert r.status_code == 200, r.text
        messages, _ = fake_tm.template_calls[-1]
        assert messages == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello"},
        ]


def test_input_items_become_messages_with_a_tool_round_trip(responses_client, fake_tm):
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Time?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Ask."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_time",
         "arguments": '{"tz": "CET"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
    ]  # fmt: skip
    with responses_client() as client:
        r = client.post(RESPONSES, json={"input": items, "tools": [TIME_TOOL]})
        assert r.status_code == 200, r.text
    messages, kwargs = fake_tm.template_calls[-1]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}  # fmt: skip
    assert messages == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Ask.",
            "tool_calls": [call],
        },  # fmt: skip
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1"},
    ]
    tool = {"type": "function", "function": {k: v for k, v in TIME_TOOL.items() if k != "type"}}
    assert kwargs["tools"] == [tool]


def test_previous_response_continues_the_conversation_without_its_instructions(
    responses_client, fake_tm
):
    with responses_client() as client:
        first = client.post(RESPONSES, json={"input": "one", "instructions": "Sys."}).json()
        r = client.post(RESPONSES, json={"input": "two", "previous_response_id": first["id"]})
        assert r.json()["previous_response_id"] == first["id"]
        messages, _ = fake_tm.template_calls[-1]
        assert messages == [
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": "two"},
        ]
        # a chain of three: the second's context is kept too
        client.post(RESPONSES, json={"input": "three", "previous_response_id": r.json()["id"]})
        assert [m["content"] for m in fake_tm.template_calls[-1][0]] == [
            "one", "Hi!", "two", "Hi!", "three"
        ]  # fmt: skip


def test_stored_responses_get_delete_and_the_lru_bound(responses_client, monkeypatch):
    monkeypatch.setattr(responses_serving, "MAX_STORED_RESPONSES", 2)
    with responses_client() as client:
        ids = [client.post(RESPONSES, json={"input": str(i)}).json()["id"] for i in range(3)]
        assert client.get(f"{RESPONSES}/{ids[0]}").status_code == 404  # evicted
        got = client.get(f"{RESPONSES}/{ids[2]}")
        assert got.status_code == 200 and got.json()["id"] == ids[2]
        assert got.json()["output"][0]["content"][0]["text"] == "Hi!"
        r = client.post(RESPONSES, json={"input": "x", "previous_response_id": ids[0]})
        assert r.status_code == 400 and ids[0] in r.json()["error"]["message"]
        deleted = client.delete(f"{RESPONSES}/{ids[1]}").json()
        assert deleted == {"id": ids[1], "object": "response.deleted", "deleted": True}
        assert client.get(f"{RESPONSES}/{ids[1]}").status_code == 404
        assert client.delete(f"{RESPONSES}/{ids[1]}").status_code == 404
        unstored = client.post(RESPONSES, json={"input": "x", "store": False}).json()
        assert unstored["store"] is False
        assert client.get(f"{RESPONSES}/{unstored['id']}").status_code == 404


def test_input_items_list_the_context_with_ids_in_pages(responses_client):
    """GET /v1/responses/{id}/input_items: the items the response was generated from (the
    responses before it too), newest first by default, paged by after / before / limit; an
    item listed goes back as input unchanged."""
    items = [
        {"role": "user", "content": "one"},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
    ]
    with responses_client() as client:
        first = client.post(RESPONSES, json={"input": items, "instructions": "Sys."}).json()
        second = client.post(
            RESPONSES, json={"input": "two", "previous_response_id": first["id"]}
        ).json()
        url = f"{RESPONSES}/{second['id']}/input_items"
        listed = client.get(url, params={"order": "asc"}).json()
        assert listed["object"] == "list" and listed["has_more"] is False
        data = listed["data"]
        assert [it["type"] for it in data] == [
            "message", "function_call", "function_call_output", "message", "message"
        ]  # fmt: skip
        assert data[0]["content"] == [{"type": "input_text", "text": "one"}]
        assert data[3] == first["output"][0]  # the first response's answer
        assert data[4]["role"] == "user" and data[4]["content"][0]["text"] == "two"
        assert all(data[k]["status"] == "completed" for k in (0, 1, 2, 4))
        ids = [it["id"] for it in data]
        assert len(set(ids)) == 5 and ids[1].startswith("fc_") and ids[0].startswith("msg_")
        assert (listed["first_id"], listed["last_id"]) == (ids[0], ids[-1])
        # the same list again (ids are stable), newest first, in pages of two
        got, after = [], None
        for _ in range(5):
            page = client.get(url, params={"limit": 2, **({"after": after} if after else {})})
            page = page.json()
            got += page["data"]
            after = page["last_id"]
            if not page["has_more"]:
                break
        assert [it["id"] for it in got] == ids[::-1]
        before = client.get(url, params={"before": ids[3], "order": "asc"}).json()
        assert [it["id"] for it in before["data"]] == ids[:3]
        # listed items are input items
        r = client.post(RESPONSES, json={"input": data})
        assert r.status_code == 200, r.text
        for bad in ({"limit": 0}, {"limit": 101}, {"order": "up"}, {"after": "msg_x"}):
            r = client.get(url, params=bad)
            assert r.status_code == 400 and next(iter(bad)) in r.json()["error"]["message"]
        assert client.get(f"{RESPONSES}/resp_x/input_items").status_code == 404
        # (responses run within their request: nothing to cancel)
        assert client.post(f"{RESPONSES}/{second['id']}/cancel").status_code == 400
        assert client.post(f"{RESPONSES}/resp_x/cancel").status_code == 404


# -- fast: response and stream shapes -----------------------------------------------------------
def test_response_shape_and_echoed_parameters(responses_client, fake_tm):
    body = {
        "input": "hello",
        "instructions": "Sys.",
        "max_output_tokens": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "metadata": {"k": "v"},
        "user": "u1",
        "text": {"format": {"type": "json_object"}},
        "reasoning": {"effort": "low"},
    }
    with responses_client() as client:
        r = client.post(RESPONSES, json=body).json()
    assert r["id"].startswith("resp_") and r["object"] == "response"
    assert r["status"] == "incomplete"  # the fake stops by length
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    for name in ("instructions", "max_output_tokens", "temperature", "top_p", "metadata", "user"):
        assert r[name] == body[name], name
    assert r["text"] == body["text"] and r["reasoning"]["effort"] == "low"
    assert r["store"] is True and r["parallel_tool_calls"] is True and r["tool_choice"] == "auto"
    [message] = r["output"]
    assert message["id"].startswith("msg_") and message["role"] == "assistant"
    assert message["status"] == "incomplete"
    assert message["content"] == [
        {"type": "output_text", "text": "Hi", "annotations": [], "logprobs": []}
    ]
    prompt = len("<system>Sys.<user>hello<assistant>")  # the fake's template, one char a token
    assert r["usage"] == {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + 2,
    }
    sp = fake_tm.requests[-1].sampling_params
    assert sp["max_new_tokens"] == 2 and sp["temperature"] == 0.5 and sp["top_p"] == 0.9
    assert json.loads(sp["json_schema"]) == {"type": "object"}
    assert fake_tm.template_calls[-1][1]["reasoning_effort"] == "low"


def test_json_schema_format_becomes_the_json_schema_constraint(responses_client, fake_tm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    with responses_client() as client:
        r = client.post(RESPONSES, json={"input": "x", "text": {"format": fmt}})
    assert r.status_code == 200 and r.json()["text"] == {"format": fmt}
    assert json.loads(fake_tm.requests[-1].sampling_params["json_schema"]) == schema


def test_stream_events_order_and_sequence_numbers(responses_client):
    with responses_client() as client:
        whole = client.post(RESPONSES, json={"input": "hello"}).json()
        events = _events(client.post(RESPONSES, json={"input": "hello", "stream": True}))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert types == STREAM_ORDER + [d["type"] for d in deltas] + TEXT_END + ["response.incomplete"]
    item_id = events[2]["item"]["id"]
    assert all(d["item_id"] == item_id and d["output_index"] == 0 for d in deltas)
    assert all(d["content_index"] == 0 and d["logprobs"] == [] for d in deltas)
    assert "".join(d["delta"] for d in deltas) == "Hi!" and len(deltas) == 3
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    final = events[-1]["response"]
    assert final["output"] == [events[-2]["item"]]
    assert final["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]
    assert final["usage"] == whole["usage"]


def test_function_call_parsed_from_the_output(responses_client):
    reply = "Let me look.\n" + CALL_TEXT
    args = dict(tool_call_parser="qwen25", chat_template=QWEN25_TEMPLATE)
    with responses_client(reply, **args) as client:
        r = client.post(RESPONSES, json={"input": [USER], "tools": [TIME_TOOL]}).json()
        events = _events(
            client.post(RESPONSES, json={"input": [USER], "tools": [TIME_TOOL], "stream": True})
        )
    message, call = r["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Let me look."
    assert call["type"] == "function_call" and call["name"] == "get_time"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert json.loads(call["arguments"]) == {"tz": "CET"}
    arg_deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(arg_deltas) > 1 and all(e["output_index"] == 1 for e in arg_deltas)
    assert json.loads("".join(e["delta"] for e in arg_deltas)) == {"tz": "CET"}
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["name"] == "get_time" and json.loads(done["arguments"]) == {"tz": "CET"}
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["message", "function_call"]
    final = events[-1]["response"]["output"]
    assert [o["type"] for o in final] == ["message", "function_call"]
    assert final[0]["content"][0]["text"] == "Let me look."


def test_reasoning_becomes_a_reasoning_item(responses_client):
    reply = "<think>The sky scatters blue light.</think>Yes."
    with responses_client(reply, reasoning_parser="qwen3") as client:
        r = client.post(RESPONSES, json={"input": "Why is the sky blue?"}).json()
        events = _events(client.post(RESPONSES, json={"input": "Why?", "stream": True}))
    reasoning, message = r["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [
        {"type": "reasoning_text", "text": "The sky scatters blue light."}
    ]
    assert message["content"][0]["text"] == "Yes."
    assert (
        0 < r["usage"]["output_tokens_details"]["reasoning_tokens"] <= r["usage"]["output_tokens"]
    )
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "The sky scatters blue light."
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["reasoning", "message"]


def test_a_reasoning_the_prompt_opened_becomes_a_reasoning_item(responses_client, fake_tm):
    """A template whose prompt ends with `<think>\n` (Qwen3-Thinking-2507, QwQ): the output
    starts inside the reasoning, which qwen3's parser sent as the message, `</think>` too."""
    render = fake_tm.tokenizer.apply_chat_template
    fake_tm.tokenizer.apply_chat_template = lambda m, **kw: render(m, **kw) + "<think>\n"
    with responses_client("Plan it.\n</think>\n\nHello!", reasoning_parser="qwen3") as client:
        reasoning, message = client.post(RESPONSES, json={"input": "Hi"}).json()["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Plan it."}]
    assert message["content"][0]["text"] == "Hello!"


@pytest.mark.parametrize("by", ["length", "stop"])
def test_a_response_cut_inside_a_call_can_be_continued(responses_client, fake_tm, by):
    """A call cut by max_output_tokens is stored with half its arguments: continuing that
    response was a 400 'previous_response.1.arguments: not valid JSON'. The cut call is left
    out of the conversation; the text before it stays. So is one cut by a stop string (it
    was stored "completed", and the next turn was that 400)."""
    reply = "Let me look.\n" + CALL_TEXT[: CALL_TEXT.index('"tz"') + 3]
    args = dict(tool_call_parser="qwen25", chat_template=QWEN25_TEMPLATE)
    with responses_client(reply, **args) as client:
        if by == "stop":
            fake_tm.finish = {"type": "stop", "matched": "CET"}
        body = {"input": [USER], "tools": [TIME_TOOL], "max_output_tokens": 500}
        first = client.post(RESPONSES, json=body).json()
        assert first["status"] == ("incomplete" if by == "length" else "completed")
        assert [(o["type"], o["status"]) for o in first["output"]] == [
            ("message", "completed"),
            ("function_call", "incomplete"),
        ]
        more = {"input": "go on", "previous_response_id": first["id"], "tools": [TIME_TOOL]}
        r = client.post(RESPONSES, json=more)
        assert r.status_code == 200, r.text
        messages, _ = fake_tm.template_calls[-1]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == "Let me look." and "tool_calls" not in messages[1]


def test_reasoning_tokens_count_no_bos(responses_client, fake_tm, monkeypatch):
    """Re-encoded with the prompt's special tokens, a Llama-style tokenizer counted its BOS."""
    seen = []
    encode = fake_tm.tokenizer.encode

    def spy(text, **kwargs):
        seen.append(kwargs)
        return encode(text)

    monkeypatch.setattr(fake_tm.tokenizer, "encode", spy)
    with responses_client("<think>Blue.</think>Yes.", reasoning_parser="qwen3") as client:
        client.post(RESPONSES, json={"input": "Why?"})
    assert {"add_special_tokens": False} in seen


def test_logprobs_when_included(responses_client):
    body = {"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    with responses_client() as client:
        r = client.post(RESPONSES, json=body).json()
        events = _events(client.post(RESPONSES, json={**body, "stream": True}))
    logprobs = r["output"][0]["content"][0]["logprobs"]
    assert [lp["token"] for lp in logprobs] == list("Hi!")
    assert all(lp["logprob"] == -0.5 and len(lp["top_logprobs"]) == 2 for lp in logprobs)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [lp["token"] for d in deltas for lp in d["logprobs"]] == list("Hi!")
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == logprobs


@pytest.mark.parametrize(
    "reply, text, args",
    [
        ("<think>Blé, bleu.</think>\n\nOui, café.", "Oui, café.", {"reasoning_parser": "qwen3"}),
        (
            "Let me look.\n" + CALL_TEXT,
            "Let me look.",
            dict(tool_call_parser="qwen25", chat_template=QWEN25_TEMPLATE),
        ),
    ],
)
def test_message_logprobs_are_those_of_its_text(responses_client, reply, text, args):
    """The message part's logprobs held every output token's, the reasoning's (and its tags)
    or a call's too; streamed, the deltas carried only some of what output_text.done did."""
    body = {"input": [USER], "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    body["tools"] = [TIME_TOOL]
    with responses_client(reply, **args) as client:
        r = client.post(RESPONSES, json=body).json()
        events = _events(client.post(RESPONSES, json={**body, "stream": True}))
    [message] = [o for o in r["output"] if o["type"] == "message"]
    part = message["content"][0]
    assert part["text"] == text and [lp["token"] for lp in part["logprobs"]] == list(text)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    assert [lp for d in deltas for lp in d["logprobs"]] == done["logprobs"] == part["logprobs"]
    [final] = [o for o in events[-1]["response"]["output"] if o["type"] == "message"]
    assert final["content"][0]["logprobs"] == part["logprobs"]


# The tokens of an output: two straddle the reasoning's end and the text's start.
TOKENS = ["<think>", "Bl", "é", ".</", "think>\n", "\nOui", ",", " caf", "é."]


@pytest.mark.parametrize("size", [1, 2, 4, len(TOKENS)])
def test_message_logprobs_do_not_depend_on_how_the_output_came(size):
    """Chunks of `size` tokens, as a stream (one chunk: a whole response): the message has
    the tokens with a byte in its text, however the tokens that straddle its start came."""
    parser = ChatParsing(reasoning_parser="qwen3").new_choice()
    builder = responses_serving.OutputBuilder(logprobs=True)
    for k in range(0, len(TOKENS), size):
        chunk = TOKENS[k : k + size]
        builder.fed += "".join(chunk)
        entries = [{"token": t, "bytes": list(t.encode())} for t in chunk]
        builder.feed(parser.feed("".join(chunk), final=k + size >= len(TOKENS)), entries)
    reasoning, message = builder.finish("completed")
    assert (
        reasoning["content"][0]["text"] == "Blé." and message["content"][0]["text"] == "Oui, café."
    )
    assert [lp["token"] for lp in message["content"][0]["logprobs"]] == TOKENS[-4:]


def test_an_error_mid_stream_is_an_error_event_then_response_failed(
    responses_client, fake_tm, monkeypatch
):
    from radixserve.managers.tokenizer_manager import RequestError

    generate = fake_tm.generate_request

    async def failing(obj: Any, request: Any = None) -> Any:
        async for out in generate(obj, request):
            yield out
            raise RequestError("the scheduler went away", 503)

    monkeypatch.setattr(fake_tm, "generate_request", failing)
    with responses_client() as client:
        r = client.post(RESPONSES, json={"input": "x", "stream": True})
    assert r.status_code == 200
    events = _events(r)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    error, failed = events[-2:]
    assert error["type"] == "error" and error["message"] == "the scheduler went away"
    assert error["code"] == "503"
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == "the scheduler went away"
    with responses_client() as client:  # a failed response is not stored
        assert client.get(f"{RESPONSES}/{failed['response']['id']}").status_code == 404


# -- fast: bad bodies ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, message",
    [
        ({"foo": 1}, "unsupported field(s): foo"),
        ({"tools": [{"type": "web_search"}]}, "'web_search' tool"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice of type 'file_search'"),
        ({"tool_choice": "required"}, "tool_choice required needs tools"),
        ({"tools": [TIME_TOOL], "tool_choice": {"type": "function", "name": "x"}}, "'x'"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation 'auto'"),
        ({"include": ["file_search_call.results"]}, "file_search_call.results"),
        # (nothing caps the calls a model writes: only one with parallel_tool_calls false)
        ({"tools": [TIME_TOOL], "max_tool_calls": 5}, "max_tool_calls 5 is not supported"),
        (
            {"tools": [TIME_TOOL], "parallel_tool_calls": False, "max_tool_calls": 0},
            "max_tool_calls 0 is not supported",
        ),
        ({"stream_options": {"include_usage": True}}, "stream_options.include_usage"),
        ({"temperature": -1}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "schema is required"),
        ({"previous_response_id": "resp_nope"}, "resp_nope"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input_image"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "'item_reference'"),
        ({"input": [{"type": ["message"], "role": "user", "content": "x"}]}, "input.0"),
        ({"input": [{"role": "user", "content": {"text": "x"}}]}, "input.0.content"),
        ({"input": [{"role": "user", "content": "x", "bad": 1}]}, "input.0: unsupported field"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0.arguments"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "not valid JSON",
        ),  # fmt: skip
        ({"input": []}, "at least one input item"),
        # OpenAI's metadata bounds (a client pinned 4 MB per stored response)
        ({"metadata": {str(i): "v" for i in range(17)}}, "at most 16 key-value pairs"),
        ({"metadata": {"k" * 65: "v"}}, "keys of at most 64"),
        ({"metadata": {"k": "v" * 513}}, "values of at most 512"),
        ({"model": "no-such-model"}, "does not exist"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(responses_client, extra, message):
    with responses_client() as client:
        r = client.post(RESPONSES, json={"input": "x", **extra})
    assert r.status_code in (400, 404), r.text
    assert message in r.json()["error"]["message"], r.text


def test_null_is_the_default_and_the_no_op_options_pass(responses_client):
    """OpenAI types stream, store and background "boolean or null", and a stream's
    stream_options.include_obfuscation (we never obfuscate); each was a 400."""
    with responses_client() as client:
        body = {"input": "x", "stream": None, "store": None, "background": None}
        r = client.post(RESPONSES, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["store"] is True and r.json()["background"] is False
        assert client.get(f"{RESPONSES}/{r.json()['id']}").status_code == 200
        for obfuscation in (False, True, None):
            options = {"include_obfuscation": obfuscation}
            r = client.post(
                RESPONSES, json={"input": "x", "stream": True, "stream_options": options}
            )
            assert r.status_code == 200, r.text
            assert _events(r)[-1]["type"] == "response.incomplete"


@pytest.mark.parametrize(
    "extra",
    [
        {"max_tool_calls": 0},
        {"max_tool_calls": 0, "tools": [TIME_TOOL], "tool_choice": "none"},
        {"max_tool_calls": 1, "tools": [TIME_TOOL], "parallel_tool_calls": False},
        {"max_tool_calls": 3, "tools": [TIME_TOOL], "parallel_tool_calls": False},
    ],
)
def test_max_tool_calls_passes_where_it_cannot_be_exceeded(responses_client, extra):
    """max_tool_calls was refused whatever its value, as 'Input should be None'."""
    with responses_client() as client:
        r = client.post(RESPONSES, json={"input": "x", **extra})
    assert r.status_code == 200, r.text
    assert r.json()["max_tool_calls"] == extra["max_tool_calls"]


def test_include_encrypted_reasoning_is_a_no_op(responses_client):
    """What stateless clients send on every turn was a 400: reasoning items come as ever,
    without encrypted_content, and go back in the next turn's input."""
    include = ["reasoning.encrypted_content", "message.output_text.logprobs"]
    with responses_client("<think>Blue.</think>Yes.", reasoning_parser="qwen3") as client:
        body = {"input": "Why?", "store": False, "include": include}
        r = client.post(RESPONSES, json=body)
        assert r.status_code == 200, r.text
        reasoning, message = r.json()["output"]
        assert reasoning["type"] == "reasoning" and "encrypted_content" not in reasoning
        assert [lp["token"] for lp in message["content"][0]["logprobs"]] == list("Yes.")
        more = {**body, "input": [{"role": "user", "content": "Why?"}, reasoning, message]}
        assert client.post(RESPONSES, json=more).status_code == 200


def test_the_route_is_in_the_openapi_document(responses_client):
    with responses_client() as client:
        paths = client.get("/openapi.json").json()["paths"]
    assert "requestBody" in paths[RESPONSES]["post"]
    assert {"get", "delete"} <= paths[RESPONSES + "/{response_id}"].keys()


# -- served: a tiny model -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from rs_testing import make_tiny_served_model

    # (room for 4000 tokens: a long request is still running when its client leaves)
    model = make_tiny_served_model(str(tmp_path_factory.mktemp("tiny")), context=8192)
    logs = str(tmp_path_factory.mktemp("server"))
    yield from ServerProcess(logs, "--model-path", model, "--served-model-name", MODEL).running()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


MODEL = "tiny"
GREEDY = {"temperature": 0.0}
# A grammar that ends: the tiny random model then finishes with "stop".
ENUM = {
    "type": "object",
    "properties": {"a": {"type": "string", "enum": ["x", "yy"]}},
    "required": ["a"],
    "additionalProperties": False,
}
ENUM_FORMAT = {"format": {"type": "json_schema", "name": "enum", "schema": ENUM, "strict": True}}


class TestServed:
    def test_greedy_text_and_prompt_equal_the_chat_endpoints(self, client):
        r = client.responses.create(
            model=MODEL,
            instructions="Be brief.",
            input="Hello there",
            max_output_tokens=12,
            **GREEDY,
        )
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"},
            ],
            max_tokens=12,
            **GREEDY,
        )
        assert r.output_text == chat.choices[0].message.content
        assert r.usage.input_tokens == chat.usage.prompt_tokens
        assert r.usage.output_tokens == chat.usage.completion_tokens
        if chat.choices[0].finish_reason == "length":
            assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        else:
            assert r.status == "completed"
        without = client.responses.create(
            model=MODEL, input="Hello there", max_output_tokens=1, **GREEDY
        )
        assert without.usage.input_tokens < r.usage.input_tokens  # the instructions counted

    def test_length_cut_is_incomplete(self, client):
        body = {"model": MODEL, "input": "Tell me a story", "max_output_tokens": 3}
        r = client.responses.create(**body, **GREEDY)
        # (the tiny random model does not end by itself within 3 tokens)
        assert r.usage.output_tokens == 3
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[0].status == "incomplete"

    def test_previous_response_id_continues_the_conversation(self, client):
        first = client.responses.create(
            model=MODEL, input="Hi", max_output_tokens=6, instructions="Sys.", **GREEDY
        )
        second = client.responses.create(
            model=MODEL,
            input="And then?",
            previous_response_id=first.id,
            max_output_tokens=6,
            **GREEDY,
        )
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And then?"},
            ],
            max_tokens=6,
            **GREEDY,
        )
        assert second.usage.input_tokens == chat.usage.prompt_tokens
        assert second.output_text == chat.choices[0].message.content
        assert client.responses.retrieve(second.id).output_text == second.output_text

    def test_sdk_lists_input_items(self, client):
        first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, **GREEDY)
        second = client.responses.create(
            model=MODEL, input="More", previous_response_id=first.id, max_output_tokens=3
        )
        pages = client.responses.input_items.list(second.id, limit=1, order="asc")
        items = list(pages)  # (the SDK follows the pages)
        assert [it.type for it in items] == ["message"] * 3
        assert [it.role for it in items] == ["user", "assistant", "user"]
        assert items[1].id == first.output[0].id and items[2].content[0].text == "More"

    def test_json_schema_format_gives_valid_json(self, client):
        r = client.responses.create(
            model=MODEL, input="Pick one", text=ENUM_FORMAT, max_output_tokens=64, **GREEDY
        )
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), ENUM)

    def test_required_tool_choice_gives_a_valid_function_call(self, client):
        tool = dict(TIME_TOOL, parameters={**TIME, "additionalProperties": False})
        r = client.responses.create(
            model=MODEL,
            input="Time?",
            tools=[tool],
            tool_choice="required",
            parallel_tool_calls=False,  # one call: the grammar ends after it
            max_output_tokens=128,
            **GREEDY,
        )
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and calls[0].name == "get_time" and calls[0].call_id.startswith("call_")
        jsonschema.validate(json.loads(calls[0].arguments), TIME)
        # the round trip: the call and its output go back as input items
        follow = client.responses.create(
            model=MODEL,
            previous_response_id=r.id,
            input=[
                {"type": "function_call_output", "call_id": calls[0].call_id, "output": "12:00"}
            ],
            tools=[tool],
            max_output_tokens=4,
            **GREEDY,
        )
        assert follow.usage.input_tokens > r.usage.input_tokens

    def test_sdk_stream_parses_our_events(self, client):
        whole = client.responses.create(
            model=MODEL, input="Pick one", text=ENUM_FORMAT, max_output_tokens=64, **GREEDY
        )
        with client.responses.stream(
            model=MODEL, input="Pick one", text=ENUM_FORMAT, max_output_tokens=64, **GREEDY
        ) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        assert kinds[:4] == STREAM_ORDER and kinds[-4:] == TEXT_END + ["response.completed"]
        assert final.output_text == whole.output_text and final.status == "completed"
        events = list(
            client.responses.create(
                model=MODEL, input="Hello", max_output_tokens=5, stream=True, **GREEDY
            )
        )
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert events[-1].response.output_text == text

    def test_sdk_stream_of_a_function_call(self, client):
        tool = dict(TIME_TOOL, parameters={**TIME, "additionalProperties": False})
        kwargs = dict(model=MODEL, input="Time?", tools=[tool], tool_choice="required")
        kwargs.update(parallel_tool_calls=False, max_output_tokens=128, **GREEDY)
        whole = client.responses.create(**kwargs)
        with client.responses.stream(**kwargs) as stream:
            deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
            final = stream.get_final_response()
        [call] = [o for o in final.output if o.type == "function_call"]
        assert call.name == "get_time" and "".join(deltas) == call.arguments
        assert (
            call.arguments == next(o for o in whole.output if o.type == "function_call").arguments
        )
        jsonschema.validate(json.loads(call.arguments), TIME)

    def test_raw_stream_matches_the_whole_response(self, server):
        body = {"model": MODEL, "input": "Hello", "max_output_tokens": 8, **GREEDY}
        whole = httpx.post(server.url + RESPONSES, json=body, timeout=60).json()
        r = httpx.post(server.url + RESPONSES, json={**body, "stream": True}, timeout=60)
        events = _events(r)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        final = events[-1]["response"]
        assert final["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]
        assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
        assert events[-1]["type"] == {"completed": "response.completed"}.get(
            whole["status"], "response.incomplete"
        )

    def test_closing_a_stream_frees_its_slots(self, server):
        body = {"model": MODEL, "input": "Go", "max_output_tokens": 4000, "stream": True, **GREEDY}
        with httpx.stream("POST", server.url + RESPONSES, json=body, timeout=60) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 6:
                    break
        wait_drained(server, timeout=15)

    def test_a_client_timeout_on_a_whole_response_frees_its_slots(self, server):
        body = {"model": MODEL, "input": "Go", "max_output_tokens": 4000, **GREEDY}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + RESPONSES, json=body, timeout=2)
        wait_drained(server, timeout=15)

    def test_bad_body_is_400_and_the_server_keeps_serving(self, server, client):
        r = httpx.post(
            server.url + RESPONSES, json={"input": "x", "tools": [{"type": "web_search"}]}
        )
        assert r.status_code == 400 and "web_search" in r.json()["error"]["message"]
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model=MODEL, input="x", truncation="auto")
        assert client.responses.create(model=MODEL, input="x", max_output_tokens=1).usage
        assert os.path.exists(server.log_path)
