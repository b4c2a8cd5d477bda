"""The `pythonic` tool-call format (Llama 3.2 / 4 style): a Python list of calls with keyword
arguments whose values are literals, `[get_weather(city="Paris"), get_time(tz="CET")]`, anywhere
in the output. The arguments become a JSON object; a list that is not such a list of calls to
known tools stays normal text. The whole list is parsed once it has closed, so a call streams as
its name and then its arguments in one piece. Llama 4 wraps the list in the special tokens
`<|python_start|>` and `<|python_end|>`, which the text holds when tools are given (the chat
endpoint keeps special tokens then); they are dropped wherever they are, as SGLang does."""

from __future__ import annotations

import ast
import re
from collections.abc import Collection

from radixserve.parser.function_call_parser import (
    CallDelta,
    FormatDetector,
    ParseResult,
    Piece,
    StreamingParseResult,
    ToolCallItem,
    dump_arguments,
    partial_suffix,
)

_LIST_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_MAYBE_LIST_START = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?")  # could still become one
_CLOSERS = {"(": ")", "[": "]", "{": "}"}
_MARKERS = ("<|python_start|>", "<|python_end|>")
_MARKER = re.compile("|".join(map(re.escape, _MARKERS)))


class PythonicDetector(FormatDetector):
    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        super().__init__(tool_names)
        self._scan: _ListScan | None = None  # of the list that opens at the buffer's start
        self._marker_start = ""  # the end of the text so far, where a marker may be opening

    def parse(self, text: str) -> ParseResult:
        text = _MARKER.sub("", text)
        normal: list[str] = []
        calls: list[ToolCallItem] = []
        pos = 0
        while (m := _LIST_START.search(text, pos)) is not None:
            end = _list_end(text, m.start())
            found = self._calls(text[m.start() : end]) if end is not None else None
            if found is None:
                normal.append(text[pos : m.start() + 1])
                pos = m.start() + 1
                continue
            normal.append(text[pos : m.start()])
            calls.extend(found)
            pos = end  # type: ignore[assignment]
        normal.append(text[pos:])
        return ParseResult("".join(normal), calls)

    def parse_streaming(self, delta: str) -> StreamingParseResult:
        # The markers dropped as `parse` drops them from the whole text: what may still be
        # one waits (no marker that starts before it can end after it).
        text = self._marker_start + delta
        keep = max(partial_suffix(text, m) for m in _MARKERS)
        self._marker_start = text[len(text) - keep :]
        return super().parse_streaming(_MARKER.sub("", text[: len(text) - keep]))

    def finish(self) -> StreamingParseResult:
        self._buf += self._marker_start  # it was no marker
        self._marker_start = ""
        return super().finish()

    def _drain(self, out: list[Piece], final: bool) -> None:
        while True:
            m = _LIST_START.search(self._buf)
            if m is None:  # no list here; keep only what may still become one
                keep = self._held_from(final)
                out.append(self._buf[:keep])
                self._buf = self._buf[keep:]
                return
            if m.start() > 0:
                out.append(self._buf[: m.start()])
                self._buf = self._buf[m.start() :]
                self._scan = None
            if self._scan is None:
                self._scan = _ListScan()
            end = self._scan.advance(self._buf)  # reads only what is new since the last time
            if end is None and not final:
                return
            self._scan = None
            found = self._calls(self._buf[:end]) if end is not None else None
            if found is None:
                out.append("[")
                self._buf = self._buf[1:]
                continue
            for call in found:
                out.append(CallDelta(self._num_calls, name=call.name))
                out.append(CallDelta(self._num_calls, arguments=call.arguments))
                self._num_calls += 1
            self._buf = self._buf[end:]

    def _held_from(self, final: bool) -> int:
        """Where the text that may still open a call list starts (len(buf): none)."""
        if final:
            return len(self._buf)
        i = self._buf.rfind("[")
        while i >= 0:
            if _MAYBE_LIST_START.fullmatch(self._buf, i):
                return i
            i = self._buf.rfind("[", 0, i)
        return len(self._buf)

    def _calls(self, source: str) -> list[ToolCallItem] | None:
        """The calls of a list's source text, or None when it is not a list of known calls."""
        try:
            tree = ast.parse(source, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            call = self._call(node)
            if call is None:
                return None
            calls.append(call)
        return calls

    def _call(self, node: ast.expr) -> ToolCallItem | None:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        if not isinstance(node.func, ast.Name | ast.Attribute) or not self._known(name):
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
            if len(args) != len(node.keywords):
                return None  # **kwargs
            return ToolCallItem(name, dump_arguments(args))
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None


def _list_end(text: str, i: int) -> int | None:
    """End (past the `]`) of the bracketed Python expression opening at text[i], or None."""
    return _ListScan(i).advance(text)


class _ListScan:
    """Finds the end of a bracketed Python expression as its text grows, reading each
    character once (a long list streamed token by token costs its length, not its square)."""

    def __init__(self, start: int = 0) -> None:
        self.j = start
        self.expected: list[str] = []
        self.quote: str | None = None  # inside a string literal opened by this quote
        self.escaped = False

    def advance(self, text: str) -> int | None:
        """End (past the closing bracket) of the expression, or None when not there yet."""
        j, expected = self.j, self.expected
        while j < len(text):
            c = text[j]
            j += 1
            if self.quote is not None:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == self.quote:
                    self.quote = None
            elif c in "'\"":
                self.quote = c
            elif c in _CLOSERS:
                expected.append(_CLOSERS[c])
            elif c in ")]}":
                if not expected or c != expected.pop() or not expected:
                    self.j = j
                    return j  # the list ends here (a mismatch makes it invalid Python)
        self.j = j
        return None
