"""Tool-call parsers: one detector per output format, each turning generated text into normal
text and tool calls, either in one go (`parse`) or as the text streams (`parse_streaming`, then
`finish` at the end of the output).

Formats (`--tool-call-parser`, SGLang's names):
  hermes / qwen25 / qwen  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
                          with normal text around them
  llama3                  `{"name": ..., "parameters": {...}}` at the start of the output or
                          after `<|python_tag|>`; several separated by `;`
  pythonic                `[f(a=1), g(b="x")]` anywhere in the text (`pythonic_detector`)
and, for tool_choice required / named (never a flag): the JSON array that the grammar enforces,
`[{"name": ..., "parameters": {...}}, ...]`. The JSON formats live in `json_detectors`.

A call counts only when its name is one of the request's tools and its arguments are a JSON
object; anything else stays normal text. Streaming contract: the pieces of one output come in
order (text, then a call's name, then its arguments in pieces), and their join equals `parse`
of the whole text (arguments compared as JSON: `parse` re-serialises them, the stream forwards
the model's own text). A call is committed once its name is complete and its arguments have
opened (or the object closed without any); text held back until then (a possible tag prefix, a
call not yet recognised) is released as normal text if it turns out not to be a call. A call
that breaks after it was committed cannot be taken back: the stream keeps what it sent, and the
text after it is normal text (`parse` would call the whole block normal text).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from radixserve.parser.json_scan import INCOMPLETE, JsonScanner, ScanError, skip_ws


@dataclass(frozen=True)
class ToolCallItem:
    """A complete call: the function's name and its arguments as a JSON object's text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class CallDelta:
    """A piece of the `index`-th call of an output: its name (first piece), then arguments."""

    index: int
    name: str | None = None
    arguments: str = ""


Piece = str | CallDelta  # normal text, or a piece of a call


@dataclass
class ParseResult:
    normal_text: str
    calls: list[ToolCallItem]


@dataclass
class StreamingParseResult:
    pieces: list[Piece] = field(default_factory=list)

    @property
    def normal_text(self) -> str:
        return "".join(p for p in self.pieces if isinstance(p, str))

    @property
    def calls(self) -> list[CallDelta]:
        return [p for p in self.pieces if isinstance(p, CallDelta)]


class NotACall(ValueError):
    """The text being scanned is not a tool call (raised only before the call is committed)."""


class FormatDetector(ABC):
    """One output format. `tool_names`: the names a call may have (None: any name).
    A detector holds the state of one output: use a fresh one per choice."""

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self._buf = ""
        self._num_calls = 0

    @abstractmethod
    def parse(self, text: str) -> ParseResult:
        """Split a whole output into normal text and calls."""

    def parse_streaming(self, delta: str) -> StreamingParseResult:
        """Feed the next piece of output; return what can be sent now."""
        self._buf += delta
        pieces: list[Piece] = []
        self._drain(pieces, final=False)
        return StreamingParseResult(merge_text(pieces))

    def finish(self) -> StreamingParseResult:
        """The output has ended: release whatever is still held back."""
        pieces: list[Piece] = []
        self._drain(pieces, final=True)
        self._buf = ""
        return StreamingParseResult(merge_text(pieces))

    @abstractmethod
    def _drain(self, out: list[Piece], final: bool) -> None:
        """Consume self._buf as far as it can be decided (all of it when final)."""

    def _advance_call(self, call: ObjectCall, out: list[Piece], final: bool) -> str:
        """Feed the buffer (whitespace, then the call's object) to `call`. Return "wait" (more
        text needed), "not_a_call" (the buffer is untouched) or "done" (consumed)."""
        j = skip_ws(self._buf, 0)
        try:
            deltas, end = call.step(self._buf[j:]) if j < len(self._buf) else ([], None)
        except NotACall:
            return "not_a_call"
        out.extend(deltas)
        if end is None and not final:
            return "wait"
        if end is None and not call.committed:
            return "not_a_call"
        self._num_calls += 1
        self._buf = "" if end is None else self._buf[j + end :]
        return "done"

    def _known(self, name: object) -> bool:
        return isinstance(name, str) and (self.tool_names is None or name in self.tool_names)

    def _decode(self, text: str, i: int, arg_keys: tuple[str, ...]) -> tuple[ToolCallItem, int]:
        """The call at text[i] as a whole output's parse reads it: whole JSON, else cut."""
        try:
            return self.decode_call(text, i, arg_keys)
        except NotACall:
            return self.decode_cut_call(text, i, arg_keys)

    def decode_call(self, text: str, i: int, arg_keys: tuple[str, ...]) -> tuple[ToolCallItem, int]:
        """The call whose JSON object starts at text[i] and where it ends; NotACall if none."""
        top: list[list[tuple[str, object]]] = []  # the last object decoded is the outermost

        def pairs_hook(pairs: list[tuple[str, object]]) -> dict[str, object]:
            top[:] = [pairs]
            return dict(pairs)

        try:
            decoder = json.JSONDecoder(object_pairs_hook=pairs_hook, parse_constant=not_json)
            obj, end = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            raise NotACall(text[i : i + 20]) from None
        if isinstance(obj, dict) and len(obj) != len(top[0]):  # a key twice: which counts?
            raise NotACall(text[i : i + 20])  # (streaming would have taken the first)
        if not isinstance(obj, dict) or not self._known(obj.get("name")):
            raise NotACall(text[i : i + 20])
        # The first argument key written (streaming sends that one's value).
        key = next((k for k, _ in top[0] if k in arg_keys), None)
        args = obj[key] if key else {}
        if not isinstance(args, dict):
            raise NotACall(text[i : i + 20])
        try:
            return ToolCallItem(obj["name"], dump_arguments(args)), end
        except (ValueError, RecursionError):  # decode_cut_call keeps the model's own text
            raise NotACall(text[i : i + 20]) from None

    def decode_cut_call(
        self, text: str, i: int, arg_keys: tuple[str, ...]
    ) -> tuple[ToolCallItem, int]:
        """A call whose object is not whole JSON, or whose arguments cannot be re-serialised,
        read as streaming reads it: one the output ends inside (max_tokens) after its
        arguments object closed is that call. NotACall unless the arguments are a whole JSON
        object (streaming sent a call whose arguments do not parse)."""
        call = ObjectCall(self, 0, arg_keys)
        deltas, end = call.step(text[i:])
        if not call.committed:
            raise NotACall(text[i : i + 20])
        name = next(d.name for d in deltas if d.name is not None)
        raw = "".join(d.arguments for d in deltas)
        try:
            args = json.loads(raw, parse_constant=not_json)
        except (ValueError, RecursionError):
            raise NotACall(text[i : i + 20]) from None
        return ToolCallItem(name, arguments_text(args, raw)), len(text) if end is None else i + end


def not_json(constant: str) -> Any:
    """json's parse_constant: NaN and Infinity, which Python reads and JSON has not (a call
    holding one is no call, as streaming reads it: JSON.parse would refuse its arguments)."""
    raise ValueError(f"{constant} is not JSON")


def dump_arguments(args: dict[str, Any]) -> str:
    """A call's arguments as JSON text, characters as they are; a lone surrogate (the escape
    \\ud83d, which JSON allows and UTF-8 cannot hold: the response failed to serialise, a
    500) stays escaped."""
    text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(args, allow_nan=False)
    return text


def arguments_text(args: dict[str, Any], raw: str) -> str:
    """A call's arguments re-serialised, or `raw` (the model's own text of them, valid JSON,
    what the stream sent) where they cannot be: a number past a float's range (1e999 reads as
    inf, which dump_arguments refuses) or nesting too deep for json.dumps (a 500 it was)."""
    try:
        return dump_arguments(args)
    except (ValueError, RecursionError):
        return raw


class ObjectCall:
    """Streams one call written as a JSON object (`{"name": ..., <arg key>: {...}}`)."""

    def __init__(self, detector: FormatDetector, index: int, arg_keys: tuple[str, ...]) -> None:
        self.detector = detector
        self.index = index
        self.arg_keys = arg_keys
        self.committed = False
        self.args_sent = 0
        self.consumed = 0  # how far into the object the pieces sent so far reach
        self.scan = JsonScanner()  # reads each character of the object once

    def step(self, text: str) -> tuple[list[CallDelta], int | None]:
        """`text` starts at the object's `{` (and only grows between calls). Return the new
        pieces and, once the call is over, where its text ends (None: not yet). NotACall while
        not committed and not a call."""
        scan, broken = self.scan, False
        try:
            scan.feed(text)
        except ScanError:
            if not self.committed:
                raise NotACall(text[:20]) from None
            broken = True  # what precedes scan.pos is JSON still: send it, the rest is text
        out: list[CallDelta] = []
        if not self.committed and not self._commit(text, scan, out):
            return out, None
        key = next((k for k in self.arg_keys if k in scan.values), None)
        if key is not None:
            start, end = scan.values[key]
            stop = scan.pos if end == INCOMPLETE else end
            if stop - start > self.args_sent:
                out.append(CallDelta(self.index, arguments=text[start + self.args_sent : stop]))
                self.args_sent = stop - start
                self.consumed = max(self.consumed, stop)
        if broken:
            return out, self.consumed  # broken after commit: what follows is normal text
        if scan.end is None:
            return out, None
        if key is None:
            out.append(CallDelta(self.index, arguments="{}"))
        return out, scan.end

    def _commit(self, text: str, scan: JsonScanner, out: list[CallDelta]) -> bool:
        """Commit once the name is known and the arguments opened with `{` (or are absent)."""
        if not scan.closed("name"):
            if scan.end is not None:
                raise NotACall("no name")
            return False
        start, end = scan.values["name"]
        name = json.loads(text[start:end])
        if not self.detector._known(name):
            raise NotACall(f"unknown function {name!r}")
        key = next((k for k in self.arg_keys if k in scan.values), None)
        if key is not None:
            if text[scan.values[key][0]] != "{":
                raise NotACall("arguments are not an object")
        elif scan.end is None:
            return False
        self.committed = True
        self.consumed = end
        out.append(CallDelta(self.index, name=name))
        return True


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def merge_text(pieces: list[Piece]) -> list[Piece]:
    """Join adjacent text pieces and drop empty ones."""
    merged: list[Piece] = []
    for p in pieces:
        if isinstance(p, str):
            if not p:
                continue
            if merged and isinstance(merged[-1], str):
                merged[-1] += p
                continue
        merged.append(p)
    return merged


def detector_classes() -> dict[str, type[FormatDetector]]:
    """The --tool-call-parser names and their detectors."""
    from radixserve.parser.json_detectors import HermesDetector, Llama3Detector
    from radixserve.parser.pythonic_detector import PythonicDetector

    return {
        "hermes": HermesDetector,
        "qwen25": HermesDetector,
        "qwen": HermesDetector,
        "llama3": Llama3Detector,
        "pythonic": PythonicDetector,
    }


def make_detector(name: str, tool_names: Collection[str] | None = None) -> FormatDetector:
    """A fresh detector (the state of one output) for a --tool-call-parser name."""
    classes = detector_classes()
    if name not in classes:
        raise ValueError(f"unknown tool-call parser {name!r}; expected one of {sorted(classes)}")
    return classes[name](tool_names)
