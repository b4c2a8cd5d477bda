"""Tool-call parsers: what `parse` makes of whole outputs (calls, normal text, malformed output
left as text), and that streaming the same text in any chunking (chunk edges inside tags, names
and arguments included) sends pieces that join to the one-shot result, a call's name first."""

from __future__ import annotations

import json
import random

import pytest

from radixserve.args import TOOL_CALL_PARSERS
from radixserve.parser.function_call_parser import (
    CallDelta,
    FormatDetector,
    detector_classes,
    make_detector,
)
from radixserve.parser.json_detectors import JsonArrayDetector

TOOLS = ["get_weather", "get_time"]
W_ARGS = '{"city": "Paris", "days": [1, {"k": "}]"}]}'
W = '{"name": "get_weather", "arguments": ' + W_ARGS + "}"

# (parser, text, expected normal text, expected calls as (name, arguments as JSON))
CASES = [
    ("hermes", "plain text, no call", "plain text, no call", []),
    ("hermes", f"Sure.\n<tool_call>\n{W}\n</tool_call>", "Sure.\n", [("get_weather", W_ARGS)]),
    (
        "qwen25",
        '<tool_call>{"arguments": {}, "name": "get_time"}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "a\\"b"}}</tool_call> ok',
        "\n ok",
        [("get_time", "{}"), ("get_weather", '{"city": "a\\"b"}')],
    ),
    ("hermes", '<tool_call>{"name": "get_time"}', "", [("get_time", "{}")]),  # no end tag
    ("hermes", "a < b <tool_call", "a < b <tool_call", []),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    (
        "hermes",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not one of the tools
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": "x"}</tool_call>',  # not an object
        '<tool_call>{"name": "get_time", "arguments": "x"}</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "get_time"}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [("get_time", "{}")],
    ),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", '
        '"parameters": {"tz": "CET"}}',
        "",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"tz": "CET"}')],
    ),
    (
        "llama3",
        'Let me check.<|python_tag|>{"name": "get_time", "parameters": {}}',
        "Let me check.",
        [("get_time", "{}")],
    ),
    ("llama3", '{"a": 1} is JSON', '{"a": 1} is JSON', []),
    (
        "llama3",
        'text first {"name": "get_time", "parameters": {}}',  # a call only at the start
        'text first {"name": "get_time", "parameters": {}}',
        [],
    ),
    (
        "llama3",
        '{"name": "get_time", "parameters": {}}; not a call',
        "; not a call",
        [("get_time", "{}")],
    ),
    (
        "pythonic",
        'Calling [get_weather(city="Paris]", days=[1, 2]), get_time(tz=None)] now',
        "Calling  now",
        [("get_weather", '{"city": "Paris]", "days": [1, 2]}'), ("get_time", '{"tz": null}')],
    ),
    ("pythonic", "a list [1, 2] and [x", "a list [1, 2] and [x", []),
    ("pythonic", "[get_time(1)]", "[get_time(1)]", []),  # positional arguments
    ("pythonic", "[unknown(a=1)]", "[unknown(a=1)]", []),
    ("pythonic", "[get_time(tz=", "[get_time(tz=", []),
    # Llama 4's special tokens around the list (the text keeps special tokens with tools)
    (
        "pythonic",
        'Ok.<|python_start|>[get_time(tz="CET")]<|python_end|> <|python_end',
        "Ok. <|python_end",
        [("get_time", '{"tz": "CET"}')],
    ),
    # only JSON's whitespace goes between a call and its closing tag or separator, as streamed
    (
        "hermes",
        '<tool_call>{"name": "get_time"}\u00a0</tool_call>x',
        "\u00a0</tool_call>x",
        [("get_time", "{}")],
    ),
    (
        "llama3",
        '{"name": "get_time", "parameters": {}}\u3000; {"name": "get_time", "parameters": {}}',
        '\u3000; {"name": "get_time", "parameters": {}}',
        [("get_time", "{}")],
    ),
    # a key twice (json.loads keeps the last, a stream would have sent the first): not a call
    (
        "hermes",
        '<tool_call>{"name": "get_time", "name": "get_weather", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_time", "name": "get_weather", "arguments": {}}</tool_call>',
        [],
    ),
    (
        "llama3",
        '{"parameters": {"a": 1}, "parameters": {"b": 2}, "name": "get_time"}',
        '{"parameters": {"a": 1}, "parameters": {"b": 2}, "name": "get_time"}',
        [],
    ),
    # both argument keys: the first written counts, streamed or not
    (
        "hermes",
        '<tool_call>{"name": "get_time", "parameters": {"a": 1}, "arguments": {}}</tool_call>',
        "",
        [("get_time", '{"a": 1}')],
    ),
    (
        "llama3",
        '{"name": "get_time", "arguments": {"a": 1}, "parameters": {"b": 2}}',
        "",
        [("get_time", '{"a": 1}')],
    ),
]


@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", '<tool_call>{"name": "get_time", "arguments": {"a": "\\ud83d"}}</tool_call>'),
        ("llama3", '{"name": "get_time", "parameters": {"a": "\\ud83d"}}'),
        ("pythonic", '[get_time(a="\\ud83d")]'),
        ("json_array", '[{"name": "get_time", "parameters": {"a": "\\ud83d"}}]'),
    ],
)
def test_a_lone_surrogate_escape_stays_escaped_in_the_arguments(parser, text):
    """JSON allows the escape \\ud83d alone, UTF-8 cannot hold the character: re-serialised
    raw, the response failed to encode (a 500)."""
    detector = JsonArrayDetector(TOOLS) if parser == "json_array" else make_detector(parser, TOOLS)
    (call,) = detector.parse(text).calls
    call.arguments.encode("utf-8")
    assert json.loads(call.arguments) == {"a": "\ud83d"}


@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", '<tool_call>{"name": "get_time", "arguments": {"a": NaN}}</tool_call>'),
        ("llama3", '{"name": "get_time", "parameters": {"b": -Infinity}}'),
        ("json_array", '[{"name": "get_time", "parameters": {"a": Infinity}}]'),
    ],
)
def test_nan_and_infinity_arguments_are_no_call(parser, text):
    """Python's json reads NaN / Infinity, JSON does not: the call's arguments were not JSON
    (JSON.parse refused them), and streaming had read the text as no call."""
    detector = JsonArrayDetector(TOOLS) if parser == "json_array" else make_detector(parser, TOOLS)
    result = detector.parse(text)
    assert result.calls == [] and result.normal_text == text


@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", '<tool_call>{"name": "get_time", "arguments": {"n": 1e999}}</tool_call>'),
        ("llama3", '{"name": "get_time", "parameters": {"n": -1e400, "m": 2}}'),
        ("json_array", '[{"name": "get_time", "parameters": {"n": 1e999}}]'),
        ("json_array", '[{"name": "get_time", "parameters": {"n": 1e999}}, {"name": "get_t'),
    ],
)
def test_arguments_past_a_floats_range_keep_the_models_text(parser, text):
    """1e999 is JSON, which json.loads reads as inf and dump_arguments refuses: parse raised
    (a 500 for the non-streamed chat response) where the stream sent the call. Both now send
    the model's own text of the arguments."""
    detector = JsonArrayDetector(TOOLS) if parser == "json_array" else make_detector(parser, TOOLS)
    (call,) = detector.parse(text).calls
    stream = JsonArrayDetector(TOOLS) if parser == "json_array" else make_detector(parser, TOOLS)
    pieces = stream.parse_streaming(text).pieces + stream.finish().pieces
    assert call.arguments == "".join(p.arguments for p in pieces if isinstance(p, CallDelta))
    assert call.arguments.startswith('{"n": ')


def test_arguments_nested_too_deep_to_write_back_never_raise():
    """Nesting that json.loads still reads and json.dumps cannot write back (a narrow band of
    depths, where it lies depends on the stack) made parse raise RecursionError: a 500."""
    for depth in range(700, 1000):
        args = '{"a": ' + "[" * depth + "]" * depth + "}"
        text = f'<tool_call>{{"name": "get_time", "arguments": {args}}}</tool_call>'
        calls = make_detector("hermes", TOOLS).parse(text).calls
        assert calls == [] or [(c.name, c.arguments) for c in calls] == [("get_time", args)]


def _join(pieces: list) -> tuple[str, list[tuple[str, object]]]:
    """Streamed pieces → (normal text, calls with parsed arguments); checks the piece order."""
    text, calls = "", {}
    for p in pieces:
        if isinstance(p, str):
            text += p
        elif p.name is not None:
            assert p.index == len(calls) and not p.arguments, "a call starts with its name alone"
            calls[p.index] = [p.name, ""]
        else:
            assert p.index in calls, "arguments before the name"
            calls[p.index][1] += p.arguments
    return text, [(n, json.loads(a)) for n, a in calls.values()]


def _stream(detector: FormatDetector, text: str, rng: random.Random) -> list:
    pieces, i = [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        pieces += detector.parse_streaming(text[i : i + k]).pieces
        i += k
    return pieces + detector.finish().pieces


@pytest.mark.parametrize("parser,text,normal,calls", CASES)
def test_parse(parser, text, normal, calls):
    result = make_detector(parser, TOOLS).parse(text)
    assert result.normal_text == normal
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == [
        (n, json.loads(a)) for n, a in calls
    ]


@pytest.mark.parametrize("parser,text,normal,calls", CASES)
def test_streaming_joins_to_parse(parser, text, normal, calls):
    rng = random.Random(text)
    expected = (normal, [(n, json.loads(a)) for n, a in calls])
    for _ in range(40):
        assert _join(_stream(make_detector(parser, TOOLS), text, rng)) == expected
    # one character at a time: every tag and key is cut at every position
    detector = make_detector(parser, TOOLS)
    pieces = [p for c in text for p in detector.parse_streaming(c).pieces]
    assert _join(pieces + detector.finish().pieces) == expected


def test_streaming_sends_text_before_the_call_and_arguments_incrementally():
    detector = make_detector("hermes", TOOLS)
    assert detector.parse_streaming("Sure. <tool").pieces == ["Sure. "]  # the tag prefix waits
    first = detector.parse_streaming('_call>{"name": "get_time", "arguments": {"tz": "C').pieces
    assert first == [CallDelta(0, name="get_time"), CallDelta(0, arguments='{"tz": "C')]
    assert detector.parse_streaming('ET"}}</tool_call> done').pieces == [
        CallDelta(0, arguments='ET"}'),
        " done",
    ]


def test_a_call_waits_for_its_arguments_to_open():
    """The name alone does not commit the call: the arguments might not be an object."""
    detector = make_detector("hermes", TOOLS)
    assert detector.parse_streaming('<tool_call>{"name": "get_time", ').pieces == []
    assert detector.parse_streaming('"arguments": 5}').pieces == [
        '<tool_call>{"name": "get_time", "arguments": 5}'
    ]


def test_malformed_after_commit_does_not_crash():
    """A call broken after its name was sent keeps what was sent; the rest is text."""
    detector = make_detector("hermes", TOOLS)
    text = '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"} oops</tool_call> end'
    pieces = _stream(detector, text, random.Random(0))
    assert [p.name for p in pieces if isinstance(p, CallDelta) and p.name] == ["get_time"]
    assert "end" in "".join(p for p in pieces if isinstance(p, str))
    assert make_detector("hermes", TOOLS).parse(text).calls == []


def is_value_prefix(text: str) -> bool:
    """Whether `text` is one JSON value, or the beginning of one (strict JSON, as json.loads
    reads it: no control characters inside strings)."""
    from radixserve.parser.json_scan import JsonScanner, ScanError, skip_ws

    scanner = JsonScanner(object_only=False)
    try:
        scanner.feed(text)
    except ScanError:
        return False
    return scanner.end is None or skip_ws(text, scanner.end) == len(text)


@pytest.mark.parametrize("parser", ["hermes", "qwen25"])
def test_arguments_that_stop_being_json_are_never_streamed(parser):
    """Arguments broken mid-value (here a closing tag where a value should be): what is
    streamed as arguments is only ever a beginning of a JSON value, and the rest is text; a
    call whose arguments are already broken when it would commit is text whole, as parse()
    reads it."""
    text = '<tool_call>\n{"name": "get_time", "arguments": {"tz": \n</tool_call> after'
    detector = make_detector(parser, TOOLS)
    pieces = [p for c in text for p in detector.parse_streaming(c).pieces]
    pieces += detector.finish().pieces
    args = "".join(p.arguments or "" for p in pieces if isinstance(p, CallDelta))
    assert args and is_value_prefix(args) and "<" not in args
    assert "".join(p for p in pieces if isinstance(p, str)).endswith(" after")
    detector = make_detector(parser, TOOLS)
    whole = detector.parse_streaming(text).pieces + detector.finish().pieces
    assert whole == [text] and make_detector(parser, TOOLS).parse(text).calls == []


@pytest.mark.parametrize(
    "text,prefix",
    [
        ('{"a": [1, {"b": "c\\u00', True),
        ('{"a": -', True),
        ('{"a": 1.5e+', True),
        ('{"a": fal', True),
        ('{"a": {"b": null}}', True),
        ('{"a": \n</tool_call>', False),
        ('{"a": "x\ny"}', False),  # a raw newline inside a string: json.loads refuses it
        ('{"a": 01', False),
        ('{"a": 1,}', False),
        ('{"a": 1} extra', False),
        ('{"a": [1 2]', False),
        ('{"a": tx', False),
    ],
)
def test_is_value_prefix(text, prefix):
    assert is_value_prefix(text) is prefix


def test_any_name_without_a_tool_list():
    assert (
        make_detector("hermes").parse('<tool_call>{"name": "x"}</tool_call>').calls[0].name == "x"
    )


JSON_ARRAY = (
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
    '{"name": "get_time", "parameters": {"tz": "UTC"}}]'
)


def test_json_array_parse_and_stream():
    result = JsonArrayDetector(TOOLS).parse(JSON_ARRAY)
    assert result.normal_text == ""
    expected = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == expected
    rng = random.Random(1)
    for _ in range(40):
        assert _join(_stream(JsonArrayDetector(TOOLS), JSON_ARRAY + "\n", rng)) == ("", expected)


@pytest.mark.parametrize(
    "text", ['[{"name": "get_weather", "parameters": {"ci', "[]", '{"name": "get_time"}']
)
def test_json_array_that_is_not_a_list_of_calls_is_text(text):
    result = JsonArrayDetector(TOOLS).parse(text)
    assert result.calls == [] and result.normal_text == text


def test_json_array_cut_inside_a_call_keeps_the_complete_calls_before_it():
    """max_tokens ends the output inside the 2nd call's arguments: parse made all of it text,
    losing the 1st call, which the stream had sent whole. As hermes reads it now: the
    complete calls, then the broken one as text."""
    text = JSON_ARRAY[: JSON_ARRAY.index('"UTC"')]
    result = JsonArrayDetector(TOOLS).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert result.normal_text == ', {"name": "get_time", "parameters": {"tz": '


@pytest.mark.parametrize(
    "text,normal,calls",
    [
        ("[]", "[]", []),
        ('[{"name": "nope", "parameters": {}}]', '[{"name": "nope", "parameters": {}}]', []),
        ('[{"na', '[{"na', []),
        # cut by max_tokens after a complete call: the call stays a call, the rest is text
        (
            '[{"name": "get_time", "parameters": {"tz": "UTC"}}, {"name": "get_w',
            ', {"name": "get_w',
            [("get_time", {"tz": "UTC"})],
        ),
        ('[{"name": "get_time", "parameters": {}}] and more', " and more", [("get_time", {})]),
    ],
)
def test_json_array_streaming_joins_to_parse(text, normal, calls):
    """The `[` or `,` before an item that is no call was dropped from the stream, and parse()
    made a list cut after a complete call all text while the stream had sent the call."""
    result = JsonArrayDetector(TOOLS).parse(text)
    assert (result.normal_text, [(c.name, json.loads(c.arguments)) for c in result.calls]) == (
        normal,
        calls,
    )
    rng = random.Random(text)
    for _ in range(20):
        assert _join(_stream(JsonArrayDetector(TOOLS), text, rng)) == (normal, calls)
    detector = JsonArrayDetector(TOOLS)
    pieces = [p for c in text for p in detector.parse_streaming(c).pieces]
    assert _join(pieces + detector.finish().pieces) == (normal, calls)


@pytest.mark.parametrize("parser", ["hermes", "llama3", "pythonic", "json_array"])
def test_streaming_reads_each_character_of_a_call_about_once(parser, monkeypatch):
    """Each delta rescanned the call from its start: 32k characters of arguments in 4-character
    deltas took ~50 s of the event loop."""
    from radixserve.parser import json_scan, pythonic_detector

    read = [0]
    json_read, list_advance = json_scan.JsonScanner._read, pythonic_detector._ListScan.advance

    def counting_read(self, text):
        read[0] += len(text) - self.pos
        return json_read(self, text)

    def counting_advance(self, text):
        read[0] += len(text) - self.j
        return list_advance(self, text)

    monkeypatch.setattr(json_scan.JsonScanner, "_read", counting_read)
    monkeypatch.setattr(pythonic_detector._ListScan, "advance", counting_advance)
    value = "x" * 20_000
    if parser == "pythonic":
        text = f'[get_time(tz="{value}")]'
    else:
        text = json.dumps({"name": "get_time", "arguments": {"tz": value}})
        text = {"hermes": f"<tool_call>{text}</tool_call>", "json_array": f"[{text}]"}.get(
            parser, text
        )
    detector = JsonArrayDetector(TOOLS) if parser == "json_array" else make_detector(parser, TOOLS)
    pieces = [
        p for i in range(0, len(text), 4) for p in detector.parse_streaming(text[i : i + 4]).pieces
    ]
    assert _join(pieces + detector.finish().pieces) == ("", [("get_time", {"tz": value})])
    assert read[0] < 2 * len(text)


def test_parser_names_match_the_flag():
    assert set(detector_classes()) == set(TOOL_CALL_PARSERS)
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        make_detector("nope")
