"""Reasoning parsers: `<think>...</think>` split one-shot and streamed (in any chunking, edges
inside the tags included, the streamed pieces join to the one-shot result), forced reasoning
(deepseek-r1) against reasoning only when the output opens it (qwen3), stream_reasoning."""

from __future__ import annotations

import random

import pytest

from radixserve.args import REASONING_PARSERS as FLAG_NAMES
from radixserve.parser.reasoning_parser import REASONING_PARSERS, ReasoningParser

THINK = "<think>\nLet me think.\nStep two.\n</think>\n\nThe answer is 4."

CASES = [
    ("qwen3", THINK, "Let me think.\nStep two.", "The answer is 4."),
    ("qwen3", "No reasoning here.", None, "No reasoning here."),
    ("qwen3", "  <think>a  b </think>  c ", "a  b", "c "),
    ("qwen3", "text</think>more", None, "text</think>more"),  # closes what never opened
    ("qwen3", "<think>cut short  ", "cut short", ""),
    ("qwen3", "<thin", None, "<thin"),
    (
        "deepseek-r1",
        "Let me think.\n</think>\n\nThe answer is 4.",
        "Let me think.",
        "The answer is 4.",
    ),
    ("deepseek-r1", THINK, "Let me think.\nStep two.", "The answer is 4."),
    ("deepseek-r1", "never closed </thi", "never closed </thi", ""),
    ("qwen3-thinking", "x</think>y", "x", "y"),
]


def _stream(parser: ReasoningParser, text: str, rng: random.Random) -> tuple[list, list]:
    reasoning, content, i = [], [], 0
    while i < len(text):
        k = rng.randint(1, 5)
        r, c = parser.parse_streaming(text[i : i + k])
        reasoning.append(r)
        content.append(c)
        i += k
    r, c = parser.finish()
    return reasoning + [r], content + [c]


@pytest.mark.parametrize("kind,text,reasoning,content", CASES)
def test_parse(kind, text, reasoning, content):
    assert ReasoningParser(kind).parse(text) == (reasoning, content)


@pytest.mark.parametrize("kind,text,reasoning,content", CASES)
def test_streaming_joins_to_parse(kind, text, reasoning, content):
    rng = random.Random(text)
    for _ in range(50):
        r, c = _stream(ReasoningParser(kind), text, rng)
        assert ("".join(r), "".join(c)) == (reasoning or "", content)


def test_reasoning_streams_before_its_end_and_holds_a_partial_tag():
    parser = ReasoningParser("qwen3")
    assert parser.parse_streaming("<thi") == ("", "")
    assert parser.parse_streaming("nk>\nStep one") == ("Step one", "")
    assert parser.parse_streaming(" two</th") == (" two", "")
    assert parser.parse_streaming("ink>\n\nDone") == ("", "Done")


def test_stream_reasoning_false_sends_the_reasoning_once_complete():
    parser = ReasoningParser("qwen3", stream_reasoning=False)
    pieces = [parser.parse_streaming(c) for c in ["<think>a", " b", " c</think>", "x", "y"]]
    assert pieces == [("", ""), ("", ""), ("a b c", ""), ("", "x"), ("", "y")]
    unfinished = ReasoningParser("deepseek-r1", stream_reasoning=False)
    assert unfinished.parse_streaming("still thinking") == ("", "")
    assert unfinished.finish() == ("still thinking", "")


@pytest.mark.parametrize("kind", ["qwen3", "deepseek-r1"])
def test_a_reasoning_the_prompt_opened_is_split_whatever_the_kind(kind):
    """A template whose generation prompt ends in `<think>\n` (Qwen3-Thinking-2507, QwQ) with
    --reasoning-parser qwen3: the reasoning, `</think>` included, came back as content."""
    text = "Plan it.\n</think>\n\nHello!"
    assert ReasoningParser(kind, opened=True).parse(text) == ("Plan it.", "Hello!")
    r, c = _stream(ReasoningParser(kind, opened=True), text, random.Random(0))
    assert ("".join(r), "".join(c)) == ("Plan it.", "Hello!")
    # constrained output (forced=False) opens its reasoning itself, prompt or not
    assert ReasoningParser(kind, forced=False, opened=True).parse(text) == (None, text)


def test_parser_names_match_the_flag():
    assert set(REASONING_PARSERS) == set(FLAG_NAMES)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("nope")
