"""ChatParsing and ChoiceParser: a chat choice streamed through its parsers, split anywhere, joins
to the message `ChatParsing.parse` makes of the whole output (content, reasoning_content,
tool calls); and which requests are parsed at all."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixserve.entrypoints.openai_protocol import ChatCompletionRequest
from radixserve.entrypoints.openai_tools import ChatParsing, ReasoningText
from radixserve.parser.function_call_parser import CallDelta

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_weather", "get_time")
]
NAMES = ("get_weather", "get_time")
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'

HERMES = ChatParsing(tool_call_parser="hermes", tool_names=NAMES)
HERMES_QWEN3 = ChatParsing(reasoning_parser="qwen3", tool_call_parser="hermes", tool_names=NAMES)
LLAMA3 = ChatParsing(tool_call_parser="llama3", tool_names=NAMES)
CASES = [
    (HERMES, WEATHER + "\nIt is done now."),
    (HERMES, WEATHER + "It  is\n\ndone now.\n"),
    (HERMES, "Let me look.\n" + WEATHER + "\n\n" + TIME + "\nDone.  Bye.\n\n"),
    (HERMES, "\n\n" + WEATHER + "  \n" + TIME + " \n "),
    (HERMES, "Hello  world \n\n"),  # no call: the content is the text as it is
    (HERMES, "\n Hello"),
    (HERMES_QWEN3, "<think> hmm </think>\n\n" + WEATHER + " It is\tdone "),
    (HERMES_QWEN3, "<think>x</think>  plain  text "),
    (LLAMA3, '{"name": "get_time", "parameters": {"tz": "UTC"}}\n\nThe  end.'),
    # Cut by max_tokens after the arguments closed: streamed as a call, and the whole output
    # was text.
    (HERMES, WEATHER[: WEATHER.index("}") + 1]),
    (HERMES, TIME + WEATHER[: WEATHER.index("}") + 1] + "  \n"),
    (LLAMA3, '{"name": "get_time", "parameters": {"tz": "UTC"} '),
    (ChatParsing(tool_call_parser="json_array", tool_names=NAMES), '[{"name": "get_time"'),
]


def _message(parsing: ChatParsing, text: str) -> tuple[str, str, list[Any]]:
    msg = parsing.parse(text)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    return msg.content or "", msg.reasoning_content or "", calls


def _streamed(parsing: ChatParsing, deltas: list[str]) -> tuple[str, str, list[Any]]:
    choice = parsing.new_choice()
    content, reasoning, names, args = [], [], {}, {}
    for k, delta in enumerate(deltas):
        for p in choice.feed(delta, final=k == len(deltas) - 1):
            if isinstance(p, ReasoningText):
                reasoning.append(p.text)
            elif isinstance(p, CallDelta):
                if p.name is not None:
                    names[p.index] = p.name
                args[p.index] = args.get(p.index, "") + p.arguments
            else:
                content.append(p)
    calls = [(names[i], json.loads(args[i])) for i in sorted(names)]
    return "".join(content), "".join(reasoning), calls


@pytest.mark.parametrize("parsing,text", CASES)
def test_streaming_split_anywhere_joins_to_the_whole_message(parsing, text):
    """Whitespace-only deltas after a call were dropped: "It is done now." streamed as
    "Itisdonenow." when each word came in its own token."""
    want = _message(parsing, text)
    splits = [[text], list(text) + [""]]
    splits += [[text[:i], text[i:]] for i in range(1, len(text))]
    words = []  # word by word, each space its own delta, as tokenizers often send them
    for part in text.replace(" ", "\0 \0").split("\0"):
        words.append(part)
    splits.append(words + [""])
    for deltas in splits:
        assert _streamed(parsing, deltas) == want, deltas


def _request(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


@pytest.mark.parametrize(
    "constraint",
    [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        {"json_schema": '{"type": "object"}'},
        {"regex": "[a-z]+"},
        {"ebnf": 'root ::= "a"'},
        {"tools": TOOLS, "tool_choice": "required"},
    ],
)
def test_constrained_output_has_reasoning_only_where_it_opens_it(constraint):
    """The grammar applies from the first token: with deepseek-r1 (whose template opens the
    reasoning in the prompt) a json_object answer came back as reasoning_content, content
    empty. A grammar that writes `<think>...</think>` itself still has its reasoning split."""
    parsing = ChatParsing.for_request(_request(**constraint), None, "deepseek-r1")
    if "tools" not in constraint:
        assert _message(parsing, '{"a": 1}') == ('{"a": 1}', "", [])
        assert _message(parsing, "<think>x</think>\n{}") == ("{}", "x", [])
        assert _streamed(parsing, list('{"a": 1}') + [""]) == ('{"a": 1}', "", [])
    plain = ChatParsing.for_request(_request(response_format={"type": "text"}), None, "deepseek-r1")
    assert _message(plain, '{"a": 1}') == ("", '{"a": 1}', [])  # unconstrained: all reasoning
