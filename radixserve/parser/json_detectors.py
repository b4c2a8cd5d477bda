"""The tool-call formats written as JSON objects: Hermes / Qwen2.5 tags, Llama 3 JSON, and the
JSON array that tool_choice required / named forces. See `function_call_parser` for the
contract they share."""

from __future__ import annotations

import re
from collections.abc import Collection

from radixserve.parser.function_call_parser import (
    FormatDetector,
    NotACall,
    ObjectCall,
    ParseResult,
    Piece,
    ToolCallItem,
    partial_suffix,
)
from radixserve.parser.json_scan import skip_ws


class HermesDetector(FormatDetector):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Hermes); the
    closing tag may be missing at the end of the output."""

    START, END = "<tool_call>", "</tool_call>"
    ARG_KEYS = ("arguments", "parameters")
    _CLOSING = re.compile(r"[ \t\r\n]*" + re.escape(END))  # JSON's whitespace, as streaming

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        super().__init__(tool_names)
        self._mode = "text"  # text | call | after (a call ended; its closing tag may follow)
        self._call: ObjectCall | None = None

    def parse(self, text: str) -> ParseResult:
        normal: list[str] = []
        calls: list[ToolCallItem] = []
        pos = 0
        while (i := text.find(self.START, pos)) >= 0:
            normal.append(text[pos:i])
            pos = i + len(self.START)
            try:
                call, end = self._decode(text, skip_ws(text, pos), self.ARG_KEYS)
            except NotACall:
                normal.append(self.START)
                continue
            calls.append(call)
            closing = self._CLOSING.match(text, end)
            pos = closing.end() if closing else end
        normal.append(text[pos:])
        return ParseResult("".join(normal), calls)

    def _drain(self, out: list[Piece], final: bool) -> None:
        while True:
            if self._mode == "text":
                i = self._buf.find(self.START)
                if i < 0:
                    keep = 0 if final else partial_suffix(self._buf, self.START)
                    out.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                out.append(self._buf[:i])
                self._buf = self._buf[i + len(self.START) :]
                self._mode = "call"
                self._call = ObjectCall(self, self._num_calls, self.ARG_KEYS)
            elif self._mode == "call":
                if not self._step_call(out, final):
                    return
            else:
                rest = self._buf[skip_ws(self._buf, 0) :]
                if rest.startswith(self.END):
                    self._buf = rest[len(self.END) :]
                elif self.END.startswith(rest) and not final:
                    return
                self._mode = "text"

    def _step_call(self, out: list[Piece], final: bool) -> bool:
        """Advance the current call; False when it needs more text."""
        assert self._call is not None
        status = self._advance_call(self._call, out, final)
        if status == "not_a_call":
            out.append(self.START)  # the tag was text; look again after it
            self._mode = "text"
        elif status == "done":
            self._mode = "after"
        return status != "wait"


class Llama3Detector(FormatDetector):
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}` at the start of the output or
    after `<|python_tag|>`, several separated by `;`."""

    TAG = "<|python_tag|>"
    ARG_KEYS = ("parameters", "arguments")
    _SEPARATOR = re.compile(r"[ \t\r\n]*;")  # JSON's whitespace, as streaming

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        super().__init__(tool_names)
        self._mode = "start"  # start | text | call | after
        self._prefix = ""  # consumed text that is normal text if the next call is not one
        self._call: ObjectCall | None = None

    def parse(self, text: str) -> ParseResult:
        normal: list[str] = []
        calls: list[ToolCallItem] = []
        pos = skip_ws(text, 0)
        if text.startswith("{", pos):
            normal.append(text[:pos])
            pos = self._parse_region(text, pos, "", normal, calls)
        else:
            pos = 0
        while (i := text.find(self.TAG, pos)) >= 0:
            normal.append(text[pos:i])
            pos = self._parse_region(text, i + len(self.TAG), self.TAG, normal, calls)
        normal.append(text[pos:])
        return ParseResult("".join(normal), calls)

    def _parse_region(
        self, text: str, pos: int, prefix: str, normal: list[str], calls: list[ToolCallItem]
    ) -> int:
        """Calls separated by `;` from `pos`; return where the normal text resumes."""
        while True:
            try:
                call, end = self._decode(text, skip_ws(text, pos), self.ARG_KEYS)
            except NotACall:
                normal.append(prefix)
                return pos
            calls.append(call)
            sep = self._SEPARATOR.match(text, end)
            if sep is None:
                return end
            prefix, pos = sep.group(), sep.end()

    def _drain(self, out: list[Piece], final: bool) -> None:
        while True:
            if self._mode == "start":
                j = skip_ws(self._buf, 0)
                if j == len(self._buf) and not final:
                    return
                if self._buf.startswith("{", j):
                    out.append(self._buf[:j])
                    self._buf = self._buf[j:]
                    self._enter_call("")
                else:
                    self._mode = "text"
            elif self._mode == "text":
                i = self._buf.find(self.TAG)
                if i < 0:
                    keep = 0 if final else partial_suffix(self._buf, self.TAG)
                    out.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                out.append(self._buf[:i])
                self._buf = self._buf[i + len(self.TAG) :]
                self._enter_call(self.TAG)
            elif self._mode == "call":
                if not self._step_call(out, final):
                    return
            else:
                sep = self._SEPARATOR.match(self._buf)
                if sep is not None:
                    self._buf = self._buf[sep.end() :]
                    self._enter_call(sep.group())
                elif skip_ws(self._buf, 0) == len(self._buf) and not final:
                    return
                else:
                    self._mode = "text"

    def _enter_call(self, prefix: str) -> None:
        self._mode, self._prefix = "call", prefix
        self._call = ObjectCall(self, self._num_calls, self.ARG_KEYS)

    def _step_call(self, out: list[Piece], final: bool) -> bool:
        assert self._call is not None
        status = self._advance_call(self._call, out, final)
        if status == "not_a_call":
            out.append(self._prefix)
            self._mode = "text"
        elif status == "done":
            self._mode = "after"
        return status != "wait"


class JsonArrayDetector(FormatDetector):
    """`[{"name": ..., "parameters": {...}}, ...]`: the output that tool_choice required or a
    named tool_choice forces through the grammar. Anything else is normal text; so is what
    follows the calls that are complete where the list breaks (an output cut by max_tokens
    keeps its complete calls)."""

    ARG_KEYS = ("parameters", "arguments")

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        super().__init__(tool_names)
        self._mode = "open"  # open | call | sep | end | text
        self._call: ObjectCall | None = None
        self._prefix = ""  # the `[` or `,` before the call being read: text if it is none

    def parse(self, text: str) -> ParseResult:
        """The calls up to the first item that is none, then text from that item's `[` or
        `,` on (the whitespace before it included), as streaming reads the list; a call whose
        arguments were cut or broke is none, as the other formats read one (the stream has
        sent it, and keeps the complete calls before it all the same)."""
        calls: list[ToolCallItem] = []
        j = skip_ws(text, 0)
        if not text.startswith("[", j):
            return ParseResult(text, [])
        rest = 0  # where the text starts if the next item is no call (at its `[` or `,`)
        while True:
            try:
                call, end = self._decode(text, skip_ws(text, j + 1), self.ARG_KEYS)
            except NotACall:
                return ParseResult(text[rest:], calls)
            calls.append(call)
            rest, j = end, skip_ws(text, end)
            if not text.startswith(",", j):
                break
        if text.startswith("]", j):  # the list closed: what follows it is text, unless blank
            rest = j + 1 if skip_ws(text, j + 1) < len(text) else len(text)
        return ParseResult(text[rest:], calls)

    def _drain(self, out: list[Piece], final: bool) -> None:
        while True:
            if self._mode == "text":
                out.append(self._buf)
                self._buf = ""
                return
            if self._mode == "call":
                assert self._call is not None
                status = self._advance_call(self._call, out, final)
                if status == "wait":
                    return
                if status == "not_a_call":
                    out.append(self._prefix)
                self._mode = "sep" if status == "done" else "text"
                continue
            j = skip_ws(self._buf, 0)
            if j == len(self._buf):
                if final and self._mode == "end":
                    self._buf = ""  # trailing whitespace
                elif final:
                    self._mode = "text"
                    continue
                return
            c = self._buf[j]
            if (self._mode, c) in (("open", "["), ("sep", ",")):
                self._prefix = self._buf[: j + 1]
                self._buf = self._buf[j + 1 :]
                self._mode = "call"
                self._call = ObjectCall(self, self._num_calls, self.ARG_KEYS)
            elif (self._mode, c) == ("sep", "]"):
                self._buf = self._buf[j + 1 :]
                self._mode = "end"  # only whitespace may follow; anything else is text
            else:
                self._mode = "text"
