"""Reasoning separation on /v1/chat/completions (--reasoning-parser).

Fast tests run the real app around the fake TokenizerManager (its reply is the "model output"):
message and delta shapes, separate_reasoning, stream_reasoning, enable_thinking, deepseek-r1's
reasoning that the prompt opened, and reasoning followed by a tool call. The real-model tests
serve the default model with a Qwen3-style template (templates/qwen3_thinking.jinja) and
--reasoning-parser qwen3; a model this small does not think on its own, so a regex makes its
output open with a <think> block.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import openai
import pytest
from test_http_server import MODEL, ServerProcess

from radixserve.args import ServerArgs

CHAT = "/v1/chat/completions"
TEMPLATE = os.path.join(os.path.dirname(__file__), "templates", "qwen3_thinking.jinja")
USER = {"role": "user", "content": "Is the sky blue?"}
REPLY = "<think>\nThe sky scatters blue light.\n</think>\n\nYes."


def _sse_deltas(resp: Any) -> list[dict[str, Any]]:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[len("data: ") :])
            out += [c["delta"] for c in chunk["choices"]]
    return out


@pytest.fixture
def make_reasoning_client(fake_tm, make_client):
    def make(reply: str = REPLY, **args: Any) -> Any:
        fake_tm.reply = reply
        fake_tm.server_args = ServerArgs(**args)
        return make_client(fake_tm)

    return make


def test_reasoning_goes_to_reasoning_content(make_reasoning_client):
    with make_reasoning_client(reasoning_parser="qwen3") as client:
        message = client.post(CHAT, json={"messages": [USER]}).json()["choices"][0]["message"]
        assert message == {
            "role": "assistant",
            "content": "Yes.",
            "reasoning_content": "The sky scatters blue light.",
        }
        deltas = _sse_deltas(client.post(CHAT, json={"messages": [USER], "stream": True}))
        reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
        content = [d["content"] for d in deltas if d.get("content")]
        assert "".join(reasoning) == "The sky scatters blue light." and len(reasoning) > 1
        assert "".join(content) == "Yes."
        last_reasoning = max(i for i, d in enumerate(deltas) if "reasoning_content" in d)
        assert all(not d.get("content") for d in deltas[:last_reasoning])


def test_stream_reasoning_false_sends_it_whole(make_reasoning_client):
    with make_reasoning_client(reasoning_parser="qwen3") as client:
        body = {"messages": [USER], "stream": True, "stream_reasoning": False}
        deltas = _sse_deltas(client.post(CHAT, json=body))
        reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
        assert reasoning == ["The sky scatters blue light."]
        assert "".join(d.get("content") or "" for d in deltas) == "Yes."


@pytest.mark.parametrize(
    "extra", [{"separate_reasoning": False}, {"chat_template_kwargs": {"enable_thinking": False}}]
)
def test_no_separation_when_not_asked(make_reasoning_client, extra):
    with make_reasoning_client(reasoning_parser="qwen3") as client:
        r = client.post(CHAT, json={"messages": [USER], **extra})
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
        deltas = _sse_deltas(client.post(CHAT, json={"messages": [USER], "stream": True, **extra}))
        assert "".join(d.get("content") or "" for d in deltas) == REPLY
        assert not any("reasoning_content" in d for d in deltas)


def test_without_a_parser_everything_is_content(make_reasoning_client):
    with make_reasoning_client() as client:
        message = client.post(CHAT, json={"messages": [USER]}).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": REPLY}


def test_deepseek_r1_output_starts_inside_the_reasoning(make_reasoning_client):
    with make_reasoning_client("Thinking hard.</think>Done.", reasoning_parser="deepseek-r1") as c:
        message = c.post(CHAT, json={"messages": [USER]}).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Thinking hard.", "Done.")


def test_a_reasoning_the_prompt_opened_is_split_for_qwen3(make_reasoning_client, fake_tm):
    """Qwen3-Thinking-2507's and QwQ's templates end the prompt with `<think>\n`: the output
    starts inside the reasoning, and qwen3's parser (reasoning only where the output opens
    it) sent it all as content, `</think>` included."""
    render = fake_tm.tokenizer.apply_chat_template
    fake_tm.tokenizer.apply_chat_template = lambda m, **kw: render(m, **kw) + "<think>\n"
    with make_reasoning_client("Plan it.\n</think>\n\nHello!", reasoning_parser="qwen3") as c:
        message = c.post(CHAT, json={"messages": [USER]}).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Plan it.", "Hello!")
        deltas = _sse_deltas(c.post(CHAT, json={"messages": [USER], "stream": True}))
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Plan it."
        assert "".join(d.get("content") or "" for d in deltas) == "Hello!"


def test_an_answer_that_is_all_reasoning_has_null_content(make_reasoning_client):
    """A reply cut inside its reasoning has no content: null, as SGLang answers ("" here)."""
    with make_reasoning_client("Thinking hard and", reasoning_parser="deepseek-r1") as c:
        message = c.post(CHAT, json={"messages": [USER]}).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Thinking hard and", None)


def test_tool_call_after_the_reasoning(make_reasoning_client):
    reply = '<think>Use the tool.</think>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "f"}}]
    with make_reasoning_client(reply, reasoning_parser="qwen3", tool_call_parser="hermes") as c:
        message = c.post(CHAT, json={"messages": [USER], "tools": tools}).json()["choices"][0][
            "message"
        ]
        assert message["reasoning_content"] == "Use the tool." and message["content"] is None
        assert [t["function"] for t in message["tool_calls"]] == [{"name": "f", "arguments": "{}"}]


def test_history_reasoning_reaches_the_template(make_reasoning_client, fake_tm):
    with make_reasoning_client(reasoning_parser="qwen3") as client:
        said = {"role": "assistant", "content": "Yes.", "reasoning_content": "Because."}
        body = {"messages": [USER, said, {"role": "user", "content": "Why?"}]}
        assert client.post(CHAT, json=body).status_code == 200
        assert fake_tm.template_calls[-1][0][1]["reasoning_content"] == "Because."


# -- the real model --------------------------------------------------------------------------------
THINK_REGEX = r"<think>\n[a-z]{1,10}( [a-z]{1,10}){1,3}\.\n</think>\n\nThe answer is (yes|no)\."
GREEDY = {"temperature": 0.0, "max_tokens": 60}


@pytest.fixture(scope="module")
def client(tmp_path_factory, default_model_path):
    proc = ServerProcess(
        str(tmp_path_factory.mktemp("reasoning")),
        *("--chat-template", TEMPLATE, "--reasoning-parser", "qwen3"),
    )
    try:
        proc.wait_ready()
        yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def thinking(client):
    """One greedy answer with reasoning (the tests compare others against it)."""
    return _ask(client)


def _ask(client: Any, stream: bool = False, **extra: Any) -> Any:
    body = {"regex": THINK_REGEX, **extra}
    return client.chat.completions.create(
        model=MODEL, messages=[USER], extra_body=body, stream=stream, **GREEDY
    )


@pytest.mark.real_model
class TestServedReasoning:
    def test_reasoning_is_separated_streamed_or_not(self, client, thinking):
        message = thinking.choices[0].message
        reasoning = message.model_extra["reasoning_content"]
        assert re.fullmatch(r"[a-z]+( [a-z]+)+\.", reasoning)
        assert message.content in ("The answer is yes.", "The answer is no.")
        pieces = {"reasoning_content": [], "content": []}
        for chunk in _ask(client, stream=True):
            for choice in chunk.choices:
                extra = choice.delta.model_extra or {}
                if extra.get("reasoning_content"):
                    assert not pieces["content"], "reasoning after content"
                    pieces["reasoning_content"].append(extra["reasoning_content"])
                if choice.delta.content:
                    pieces["content"].append(choice.delta.content)
        assert len(pieces["reasoning_content"]) > 1  # it streamed
        assert "".join(pieces["reasoning_content"]) == reasoning  # greedy: the same output
        assert "".join(pieces["content"]) == message.content

    def test_enable_thinking_false(self, client, thinking):
        r = _ask(client, chat_template_kwargs={"enable_thinking": False})
        message = r.choices[0].message
        assert message.content.startswith("<think>\n")  # not parsed: all content
        assert (message.model_extra or {}).get("reasoning_content") is None
        # the template closed an empty reasoning block in the prompt
        assert r.usage.prompt_tokens > thinking.usage.prompt_tokens

    def test_separate_reasoning_false(self, client):
        message = _ask(client, separate_reasoning=False).choices[0].message
        assert message.content.startswith("<think>\n") and "</think>" in message.content
        assert (message.model_extra or {}).get("reasoning_content") is None
