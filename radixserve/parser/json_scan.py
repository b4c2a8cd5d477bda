"""Scanning JSON that is still being generated. The streaming tool-call parsers use it to find a
call's name as soon as its string closes and to forward the raw text of its arguments piece by
piece.

`JsonScanner` reads the text as it grows, each character once (feed it the whole text so far:
it reads only what is new), so a call's cost is linear in its length however finely it
streams. It checks strict JSON as `json.loads` reads it (escapes, no control characters inside
strings, numbers and literals, brackets, commas, colons) and stops at the first character that
cannot continue a JSON value: everything before `pos` is then a valid beginning of one. For an
object at the top it records where each top-level value starts and ends.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

INCOMPLETE = -1  # a span end: the value has not closed yet
_WS = " \t\r\n"  # JSON's whitespace (not Python's: str.isspace and re's \s take more)
_LITERAL_START = frozenset("-0123456789tfn")
_LITERAL_CHARS = frozenset("-+.0123456789eEtrufalsn")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
_PLAIN_RUN = re.compile(r'[^"\\\x00-\x1f]*')  # string characters that need no attention


class ScanError(ValueError):
    """The text cannot be the beginning of a JSON value (of an object, for an object scan)."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


@dataclass
class JsonScanner:
    """Incremental strict-JSON reader of one value (an object when `object_only`)."""

    object_only: bool = True
    pos: int = 0  # characters read; after a ScanError, where the text stopped being JSON
    end: int | None = None  # just past the value, once it has ended
    values: dict[str, tuple[int, int]] = field(default_factory=dict)  # top-level key → span
    _closers: list[str] = field(default_factory=list)
    _expect: str = "value"  # value | first_key | key | colon | first_item | comma
    _string_start: int | None = None  # inside a string that opened here
    _escape: int = 0  # inside a string: 1 after a backslash, 2..5 hex digits to come (\uXXXX)
    _literal_start: int | None = None  # inside a number or true / false / null
    _key: str | None = None  # the top-level key whose value comes or is being read
    _error: str | None = None

    def value_text(self, text: str, key: str) -> str | None:
        """The raw text of a top-level value so far (all of it once closed), or None."""
        if key not in self.values:
            return None
        start, end = self.values[key]
        return text[start : self.pos if end == INCOMPLETE else end]

    def closed(self, key: str) -> bool:
        return key in self.values and self.values[key][1] != INCOMPLETE

    def feed(self, text: str) -> None:
        """Read `text[pos:]` (the text so far; it only ever grows). ScanError at the first
        character that no JSON value could have there, and at every call after."""
        if self._error is not None:
            raise ScanError(self._error)
        try:
            self._read(text)
            if self._literal_start is not None and self.end is None:
                self._check_literal_prefix(text[self._literal_start : self.pos])
        except ScanError as e:
            self._error = str(e)
            raise

    def _read(self, text: str) -> None:
        i, n = self.pos, len(text)
        while i < n and self.end is None:
            if self._string_start is not None:
                i = self._string_char(text, i)
                continue
            c = text[i]
            if self._literal_start is not None:
                if c in _LITERAL_CHARS:
                    i += 1
                    continue
                self.pos = i
                self._end_literal(text, i)
                continue
            self.pos = i
            if c in _WS:
                i += 1
                continue
            self._structural(c, i)
            i += 1
        self.pos = i if self.end is None else self.end

    def _string_char(self, text: str, i: int) -> int:
        if self._escape == 1:
            if text[i] not in _ESCAPES:
                self.pos = i
                raise ScanError(f"bad escape \\{text[i]}")
            self._escape = 5 if text[i] == "u" else 0
            return i + 1
        if self._escape:
            if text[i] not in _HEX:
                self.pos = i
                raise ScanError("bad \\u escape")
            self._escape = 0 if self._escape == 2 else self._escape - 1
            return i + 1
        c = text[i]
        if c == "\\":
            self._escape = 1
            return i + 1
        if c == '"':
            start, self._string_start = self._string_start, None
            assert start is not None
            self._string_end(text, start, i + 1)
            return i + 1
        if ord(c) < 0x20:
            self.pos = i
            raise ScanError("a control character inside a string")
        return _PLAIN_RUN.match(text, i).end()  # type: ignore[union-attr]

    def _structural(self, c: str, i: int) -> None:
        expect = self._expect
        if expect in ("first_key", "first_item") and c == self._closers[-1]:
            self._close(i)
        elif expect in ("first_key", "key"):
            if c != '"':
                raise ScanError("expected a key")
            self._string_start = i
        elif expect == "colon":
            if c != ":":
                raise ScanError("expected ':'")
            self._expect = "value"
        elif expect == "comma":
            if c == ",":
                self._expect = "key" if self._closers[-1] == "}" else "value"
            elif c == self._closers[-1]:
                self._close(i)
            else:
                raise ScanError(f"expected ',' or {self._closers[-1]!r}")
        else:  # a value starts
            if self.object_only and not self._closers and c != "{":
                raise ScanError("not an object")
            if len(self._closers) == 1 and self._closers[0] == "}":
                assert self._key is not None
                self.values[self._key] = (i, INCOMPLETE)
            if c in "{[":
                self._closers.append("}" if c == "{" else "]")
                self._expect = "first_key" if c == "{" else "first_item"
            elif c == '"':
                self._string_start = i
            elif c in _LITERAL_START:
                self._literal_start = i
            else:
                raise ScanError(f"unexpected {c!r}")

    def _close(self, i: int) -> None:
        self._closers.pop()
        self._value_end(i + 1)

    def _string_end(self, text: str, start: int, end: int) -> None:
        if self._expect in ("first_key", "key"):  # a key: its value comes after a colon
            self._expect = "colon"
            if len(self._closers) == 1:
                key = json.loads(text[start:end])
                if key in self.values:  # json.loads keeps the last: a stream cannot
                    self.pos = start
                    raise ScanError(f"duplicate key {key!r}")
                self._key = key
            return
        self._value_end(end)

    def _end_literal(self, text: str, end: int) -> None:
        start, self._literal_start = self._literal_start, None
        assert start is not None
        try:
            json.loads(text[start:end])
        except ValueError:
            self.pos = start
            raise ScanError(f"not a value: {text[start:end]!r}") from None
        self._value_end(end)

    def _check_literal_prefix(self, word: str) -> None:
        """A number or literal cut off by the end of the text: may it still become one?"""
        if any(lit.startswith(word) for lit in ("true", "false", "null")):
            return
        for candidate in (word, word + "0"):  # "-", "1.", "1e+" need one more digit
            try:
                json.loads(candidate)
                return
            except ValueError:
                continue
        raise ScanError(f"not a value: {word!r}")

    def _value_end(self, end: int) -> None:
        depth = len(self._closers)
        if depth == 1 and self._closers[0] == "}" and self._key is not None:
            self.values[self._key] = (self.values[self._key][0], end)
            self._key = None
        if depth == 0:
            self.end = end
        self._expect = "comma"
