"""Scanning a JSON object that is still being generated: where its top-level values start and
end, without parsing what is inside them. The streaming tool-call parsers use it to find a call's
name as soon as its string closes and to forward the raw text of its arguments piece by piece.

The scanner checks the structure at the top level only (keys, colons, commas, matching
brackets); the caller parses the finished object with `json.loads` before trusting it, and
`is_value_prefix` checks a value's text in full before it is forwarded (so text that no JSON
value can hold, such as a closing tag after a broken call, never reaches the arguments).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

INCOMPLETE = -1  # a span end: the value has not closed yet
_CLOSERS = {"{": "}", "[": "]"}
_LITERAL_CHARS = frozenset("-+.0123456789eEtrufalsn")
_WS = " \t\r\n"


class ScanError(ValueError):
    """The text cannot be the beginning of a JSON object."""


@dataclass
class ObjectScan:
    """What is known of a JSON object that starts at `start` of some text."""

    start: int
    values: dict[str, tuple[int, int]] = field(default_factory=dict)  # key → (start, end)
    end: int | None = None  # index just past the closing brace, once it has closed

    def value_text(self, text: str, key: str) -> str | None:
        """The raw text of a value so far (all of it once closed), or None when absent."""
        if key not in self.values:
            return None
        start, end = self.values[key]
        return text[start : len(text) if end == INCOMPLETE else end]

    def closed(self, key: str) -> bool:
        return key in self.values and self.values[key][1] != INCOMPLETE


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int:
    """End (past the closing quote) of the JSON string opening at text[i], or INCOMPLETE."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return INCOMPLETE


def value_end(text: str, i: int) -> int:
    """End of the JSON value starting at text[i], or INCOMPLETE; ScanError if none starts."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in _CLOSERS:
        return _container_end(text, i)
    j = i
    while j < len(text) and text[j] in _LITERAL_CHARS:
        j += 1
    if j == i:
        raise ScanError(f"unexpected {c!r}")
    return INCOMPLETE if j == len(text) else j


def _container_end(text: str, i: int) -> int:
    expected = [_CLOSERS[text[i]]]
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == '"':
            j = string_end(text, j)
            if j == INCOMPLETE:
                return INCOMPLETE
            continue
        if c in _CLOSERS:
            expected.append(_CLOSERS[c])
        elif c in "}]":
            if c != expected.pop():
                raise ScanError("mismatched brackets")
            if not expected:
                return j + 1
        j += 1
    return INCOMPLETE


def scan_object(text: str, start: int) -> ObjectScan:
    """Scan the (possibly unfinished) JSON object at text[start]; ScanError if it is not one."""
    scan = ObjectScan(start)
    if start >= len(text):
        return scan
    if text[start] != "{":
        raise ScanError("not an object")
    i = skip_ws(text, start + 1)
    if i < len(text) and text[i] == "}":
        scan.end = i + 1
        return scan
    while i < len(text):
        if text[i] != '"':
            raise ScanError("expected a key")
        key_end = string_end(text, i)
        if key_end == INCOMPLETE:
            return scan
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            return scan
        if text[i] != ":":
            raise ScanError("expected ':'")
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return scan
        end = value_end(text, i)
        scan.values.setdefault(key, (i, end))
        if end == INCOMPLETE:
            return scan
        i = skip_ws(text, end)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            raise ScanError("expected ',' or '}'")
        i = skip_ws(text, i + 1)
    return scan


class _Eof(Exception):
    """The text ended inside the value: what came so far may begin one."""


def is_value_prefix(text: str) -> bool:
    """Whether `text` is one JSON value, or the beginning of one (strict JSON, as json.loads
    reads it: no control characters inside strings)."""
    try:
        end = _value(text, skip_ws(text, 0))
    except _Eof:
        return True
    except (ScanError, ValueError, RecursionError):
        return False
    return skip_ws(text, end) == len(text)


def _value(text: str, i: int) -> int:
    """Index past the JSON value at text[i]; _Eof where the text ends first."""
    if i >= len(text):
        raise _Eof
    c = text[i]
    if c == "{" or c == "[":
        return _container(text, i)
    if c == '"':
        return _string(text, i)
    j = i
    while j < len(text) and text[j] in _LITERAL_CHARS:
        j += 1
    word = text[i:j]
    if j == len(text):  # it may go on: a prefix of a literal or of a number
        if any(lit.startswith(word) for lit in ("true", "false", "null")) or _number_prefix(word):
            raise _Eof
        raise ScanError(f"not a value: {word!r}")
    if not word:
        raise ScanError(f"unexpected {c!r}")
    json.loads(word)  # (ValueError: not a literal or a number)
    return j


def _number_prefix(word: str) -> bool:
    """Whether `word` can begin a JSON number: it is one, or one more digit makes it one
    ("-", "1.", "1e+")."""
    for candidate in (word, word + "0"):
        try:
            json.loads(candidate)
            return True
        except ValueError:
            continue
    return False


def _string(text: str, i: int) -> int:
    end = string_end(text, i)
    if end == INCOMPLETE:
        body = text[i + 1 :]
        if any(ord(ch) < 0x20 for ch in body):
            raise ScanError("a control character inside a string")
        raise _Eof
    json.loads(text[i:end])  # escapes, control characters (ValueError)
    return end


def _container(text: str, i: int) -> int:
    obj = text[i] == "{"
    close = "}" if obj else "]"
    j = skip_ws(text, i + 1)
    if j >= len(text):
        raise _Eof
    if text[j] == close:
        return j + 1
    while True:
        if obj:
            if text[j] != '"':
                raise ScanError("expected a key")
            j = skip_ws(text, _string(text, j))
            if j >= len(text):
                raise _Eof
            if text[j] != ":":
                raise ScanError("expected ':'")
            j = skip_ws(text, j + 1)
        j = skip_ws(text, _value(text, j))
        if j >= len(text):
            raise _Eof
        if text[j] == close:
            return j + 1
        if text[j] != ",":
            raise ScanError(f"expected ',' or {close!r}")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            raise _Eof
