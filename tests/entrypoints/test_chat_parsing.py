"""ChatParsing and ChoiceParser: a chat choice streamed through its parsers, split anywhere, joins
to the message `ChatParsing.parse` makes of the whole output (content, reasoning_content,
tool calls); and which requests are parsed at all."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixserve.entrypoints.openai_api import prompt_opens_reasoning
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
    (HERMES, "\n\nLet me check.\n" + TIME),  # leading whitespace, then text, then a call
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


def test_leading_whitespace_of_the_content_never_goes_out():
    """The stream sent "\n\nLet me check." where the whole message had "Let me check.": it
    cannot know, when the text comes, whether a call follows."""
    for parsing in (HERMES, HERMES_QWEN3):
        assert parsing.parse("\n\nLet me check.\n" + TIME).content == "Let me check."
        assert parsing.parse(" \n Hello ").content == "Hello "


def test_an_output_that_is_all_reasoning_has_null_content_with_a_tool_parser_too():
    """It was null without a tool-call parser, and "" with one."""
    assert HERMES_QWEN3.parse("<think>still thinking, cut by max_tokens").content is None
    assert HERMES_QWEN3.parse("<think>done</think>\n\n").content is None


@pytest.mark.parametrize(
    "parsing,text",
    [
        (HERMES, TIME + "\n" + WEATHER[: WEATHER.index("Paris")]),  # the 2nd call cut
        (HERMES, "Ok. " + WEATHER[: WEATHER.index("Paris")]),  # the only call cut
        (HERMES, TIME),
        (
            ChatParsing(tool_call_parser="json_array", tool_names=NAMES),
            '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"',
        ),
    ],
)
def test_the_stream_finishes_by_calling_where_the_whole_message_has_calls(parsing, text):
    """A stop string inside the 2nd call after a whole 1st one: the message had the 1st call
    and finished with "tool_calls", the stream "stop" (it wanted every call sent whole)."""
    choice = parsing.new_choice()
    for k, c in enumerate(text):
        choice.feed(c, final=k == len(text) - 1)
    assert choice.made_calls  # (a call once committed is sent, cut or not)
    assert choice.made_whole_call == bool(parsing.parse(text).tool_calls)


@pytest.mark.parametrize("kind", ["qwen3", "deepseek-r1"])
def test_a_reasoning_the_prompt_opened_is_split(kind):
    """A template whose generation prompt opens `<think>` (Qwen3-Thinking-2507, QwQ) served
    with --reasoning-parser qwen3: the reasoning, `</think>` included, was content."""
    text, want = "Plan it.\n</think>\n\nHello!", ("Hello!", "Plan it.", [])
    parsing = ChatParsing.for_request(_request(), None, kind, prompt_opens_reasoning=True)
    assert _message(parsing, text) == want
    assert _streamed(parsing, list(text) + [""]) == want
    off = _request(chat_template_kwargs={"enable_thinking": False})  # the template opened it
    assert _message(ChatParsing.for_request(off, None, kind, True), text) == want


def test_which_prompts_open_the_reasoning(fake_tm):
    def opens(prompt: str) -> bool:
        return prompt_opens_reasoning(fake_tm, fake_tm.tokenizer.encode(prompt))

    assert opens("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert opens("<｜Assistant｜><think>")
    assert not opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not opens("<|im_start|>assistant\n")
    assert not opens("<think>a</think>\n" + "x" * 100)


@pytest.mark.parametrize(
    "kind,split", [("qwen3-thinking", True), ("deepseek-r1", True), ("qwen3", False)]
)
def test_enable_thinking_false_turns_off_only_a_reasoning_the_output_opens(kind, split):
    """qwen3-thinking's template opens the reasoning whatever enable_thinking says: with it
    false the parser was off, and `</think>` reached the content."""
    text = "Plan it.\n</think>\n\nHello!"
    req = _request(chat_template_kwargs={"enable_thinking": False})
    want = ("Hello!", "Plan it.", []) if split else (text, "", [])
    assert _message(ChatParsing.for_request(req, None, kind), text) == want
