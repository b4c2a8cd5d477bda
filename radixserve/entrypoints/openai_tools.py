"""Function calling and reasoning on /v1/chat/completions (SGLang's behaviour).

Request side (`openai_api.chat_to_generate` calls these): the tools go to the chat template
unless tool_choice is "none", and then special tokens stay in the output's text (a call's
marker may be one: Llama 3's <|python_tag|>); tool_choice "required" or naming a function adds
a JSON schema constraint, `[{"name": <a tool>, "parameters": <its schema>}, ...]` (one item when
named or parallel_tool_calls is false), so the grammar backend makes the output a list of valid
calls.

Response side (`openai_serving`): `ChatParsing` says, per request, which parsers apply, and
makes one `ChoiceParser` per choice. The reasoning parser (--reasoning-parser, unless
separate_reasoning is false, or chat_template_kwargs.enable_thinking is false where the output
would open the reasoning itself) runs first; where the prompt ends inside a `<think>` it opened,
the output starts inside the reasoning whatever the parser. The tool-call parser then reads the
content after the reasoning: the JSON-array parser for required / named, the --tool-call-parser
for auto. Without --tool-call-parser, auto answers in plain text (as SGLang does); required and
named do not need it. Constrained output (forced calls, response_format, json_schema, regex,
ebnf) has reasoning only where it opens `<think>` itself, whatever the parser: the grammar
applies from the first token, so a JSON answer is content even where the template opened the
reasoning (deepseek-r1, qwen3-thinking).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from radixserve.entrypoints.openai_protocol import ChatCompletionRequest, ToolChoice
from radixserve.entrypoints.openai_responses import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionResponse,
    ToolCall,
)
from radixserve.managers.tokenizer_manager import RequestError
from radixserve.parser.function_call_parser import CallDelta, FormatDetector, make_detector
from radixserve.parser.json_detectors import JsonArrayDetector
from radixserve.parser.reasoning_parser import REASONING_PARSERS, ReasoningParser


# -- request side --------------------------------------------------------------------------------
def tool_choice_of(req: ChatCompletionRequest) -> str | ToolChoice:
    """tool_choice with OpenAI's default filled in: auto with tools, none without."""
    if req.tool_choice is not None:
        return req.tool_choice
    return "auto" if req.tools else "none"


def is_forced(req: ChatCompletionRequest) -> bool:
    """tool_choice required or naming a function: the grammar forces the call(s)."""
    choice = tool_choice_of(req)
    return choice == "required" or isinstance(choice, ToolChoice)


def is_constrained(req: ChatCompletionRequest) -> bool:
    """A grammar shapes the output from its first token (forced calls, response_format,
    json_schema, regex, ebnf)."""
    fmt = req.response_format
    return (
        is_forced(req)
        or (fmt is not None and fmt.type != "text")
        or any((req.json_schema, req.regex, req.ebnf))
    )


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as chat templates expect them; none when tool_choice is "none", only the
    named one when tool_choice names a function (as SGLang: the others cannot be called)."""
    choice = tool_choice_of(req)
    if not req.tools or choice == "none":
        return None
    named = choice.function.name if isinstance(choice, ToolChoice) else None
    tools = [t for t in req.tools if named is None or t.function.name == named]
    return [t.model_dump(exclude_none=True) for t in tools]


def tool_call_schema(req: ChatCompletionRequest) -> str | None:
    """The JSON schema that required / named tool_choice constrains the output to. Each
    function's parameters sit whole under `$defs/__tool_<i>` (its local `$ref`s rebased there),
    so `#`, `#/$defs/...`, `#/definitions/...` and `#/properties/...` keep meaning that
    function's schema, and two functions' `$defs` never clash."""
    if not is_forced(req):
        return None
    choice = tool_choice_of(req)
    named = choice.function.name if isinstance(choice, ToolChoice) else None
    defs: dict[str, Any] = {}
    items = []
    for tool in req.tools or []:
        fn = tool.function
        if named is not None and fn.name != named:
            continue
        params = dict(fn.parameters or {"type": "object", "properties": {}})
        params.setdefault("type", "object")
        if params["type"] != "object":
            raise RequestError(f"tools: the parameters of {fn.name!r} must be an object schema")
        key = f"__tool_{len(defs)}"
        defs[key] = _rebase_refs(params, f"#/$defs/{key}")
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [fn.name]},
                    "parameters": {"$ref": f"#/$defs/{key}"},
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "$defs": defs,
    }
    if named is not None or req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return json.dumps(schema)


# Keywords whose values are JSON data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset(("enum", "const", "default", "examples"))
# Keywords whose values map names (of properties, of definitions) to schemas: the names are not
# keywords (a property may be called "default").
_NAME_MAPS = frozenset(
    ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
)


def _rebase_refs(node: Any, base: str) -> Any:
    """`node` (a schema, or a list of them) with its document-local `$ref`s ("#", "#/...")
    made relative to `base`."""
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAME_MAPS and isinstance(value, dict):
            out[key] = {name: _rebase_refs(sub, base) for name, sub in value.items()}
        else:
            out[key] = _rebase_refs(value, base)
    return out


def history_tool_calls(calls: list[Any], where: str) -> list[dict[str, Any]]:
    """Assistant tool_calls of the history for the template, arguments as a dict (what
    Hugging Face templates expect: they serialise them with tojson)."""
    out = []
    for k, call in enumerate(calls):
        try:
            arguments = json.loads(call.function.arguments)
        except (ValueError, RecursionError):  # (nested past the interpreter's depth)
            raise RequestError(
                f"{where}.tool_calls.{k}.function.arguments is not valid JSON"
            ) from None
        fn = {"name": call.function.name, "arguments": arguments}
        out.append({"id": call.id, "type": "function", "function": fn})
    return out


# -- response side -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReasoningText:
    """A piece of the reasoning (a plain str piece is content)."""

    text: str


Piece = str | ReasoningText | CallDelta


@dataclass
class ParsedMessage:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall] | None


@dataclass(frozen=True)
class ChatParsing:
    """Which parsers apply to the choices of one request (see the module docstring)."""

    reasoning_parser: str | None = None
    stream_reasoning: bool = True
    reasoning_forced: bool = True  # False: reasoning only where the output opens `<think>`
    prompt_opens_reasoning: bool = False  # the output starts inside the reasoning, any parser
    tool_call_parser: str | None = None  # "json_array" for required / named
    tool_names: tuple[str, ...] = ()
    parallel_tool_calls: bool = True

    @classmethod
    def for_request(
        cls,
        req: ChatCompletionRequest,
        tool_call_parser: str | None,
        reasoning_parser: str | None,
        prompt_opens_reasoning: bool = False,
    ) -> ChatParsing:
        """`prompt_opens_reasoning`: see `openai_api.prompt_opens_reasoning`."""
        forced = is_forced(req)
        thinking = (req.chat_template_kwargs or {}).get("enable_thinking", True) is not False
        # enable_thinking false keeps the output from opening `<think>` (Qwen3's template
        # closes an empty one in the prompt); a reasoning the prompt opened still ends in
        # the output (deepseek-r1, qwen3-thinking: their templates ignore the flag).
        opened = prompt_opens_reasoning or REASONING_PARSERS.get(reasoning_parser or "", False)
        if not req.separate_reasoning or not (thinking or opened):
            reasoning_parser = None
        names = tuple(t.function.name for t in req.tools or [])
        if forced:
            tool_call_parser = "json_array"
        elif tool_choice_of(req) == "none":
            tool_call_parser = None
        return cls(
            reasoning_parser=reasoning_parser,
            stream_reasoning=req.stream_reasoning,
            reasoning_forced=not is_constrained(req),
            prompt_opens_reasoning=prompt_opens_reasoning,
            tool_call_parser=tool_call_parser if names else None,
            tool_names=names,
            parallel_tool_calls=req.parallel_tool_calls is not False,
        )

    @property
    def active(self) -> bool:
        return self.reasoning_parser is not None or self.tool_call_parser is not None

    def _detector(self) -> FormatDetector | None:
        if self.tool_call_parser is None:
            return None
        if self.tool_call_parser == "json_array":
            return JsonArrayDetector(self.tool_names)
        return make_detector(self.tool_call_parser, self.tool_names)

    def _reasoning(self) -> ReasoningParser | None:
        if self.reasoning_parser is None:
            return None
        return ReasoningParser(
            self.reasoning_parser,
            self.stream_reasoning,
            self.reasoning_forced,
            self.prompt_opens_reasoning,
        )

    def new_choice(self) -> ChoiceParser:
        return ChoiceParser(self._reasoning(), self._detector(), self.parallel_tool_calls)

    def parse(self, text: str) -> ParsedMessage:
        """The message of a whole output."""
        reasoning_parser, detector = self._reasoning(), self._detector()
        reasoning = None
        if reasoning_parser is not None:
            reasoning, text = reasoning_parser.parse(text)
        content: str | None = text
        tool_calls = None
        if detector is not None:
            result = detector.parse(text)
            calls = result.calls if self.parallel_tool_calls else result.calls[:1]
            # As `ChoiceParser` streams it: no whitespace before the first text (whether calls
            # follow it is not known yet), and none after the last text once there are calls.
            content = result.normal_text.lstrip()
            if calls:
                content = content.rstrip()
                tool_calls = [
                    ToolCall(
                        id=new_call_id(),
                        function=FunctionResponse(name=c.name, arguments=c.arguments),
                    )
                    for c in calls
                ]
        if not content and (reasoning or tool_calls):  # (no content: null, as SGLang answers)
            content = None
        return ParsedMessage(content, reasoning or None, tool_calls)


class ChoiceParser:
    """The parsers' state for one streamed choice: text deltas in, ordered pieces out."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        detector: FormatDetector | None,
        parallel_tool_calls: bool,
    ) -> None:
        self.reasoning = reasoning
        self.detector = detector
        self.parallel_tool_calls = parallel_tool_calls
        self.made_calls = False
        self._arguments: dict[int, str] = {}  # each call sent: its arguments so far
        self._ids: dict[int, str] = {}
        self._sent_text = False  # some content other than whitespace went out
        self._held_ws = ""  # trailing whitespace of the content: sent once text follows it

    def feed(self, delta: str, final: bool) -> list[Piece]:
        """The pieces to send for `delta`; `final` at the end of the output (releases all)."""
        out: list[Piece] = []
        content = delta
        if self.reasoning is not None:
            reasoning, content = self.reasoning.parse_streaming(delta)
            if final:
                more_reasoning, more = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more
            if reasoning:
                out.append(ReasoningText(reasoning))
        if self.detector is None:
            out.extend([content] if content else [])
            return out
        pieces = self.detector.parse_streaming(content).pieces
        if final:
            pieces += self.detector.finish().pieces
        for p in pieces:
            if isinstance(p, CallDelta):
                if self.parallel_tool_calls or p.index == 0:
                    self.made_calls = True
                    self._arguments[p.index] = self._arguments.get(p.index, "") + p.arguments
                    out.append(p)
            elif text := self._content(p):
                out.append(text)
        if final and not self.made_calls and self._held_ws:
            out.append(self._held_ws)  # without calls the content ends as the text does
        return out

    @property
    def made_whole_call(self) -> bool:
        """Whether some call sent has its whole arguments: the choice finished by calling, as
        `ChatParsing.parse` of the whole output has calls (a stop string, EOS or stop token
        can end the output inside a call: that one is no call)."""
        return any(arguments_complete(a) for a in self._arguments.values())

    def _content(self, text: str) -> str:
        """What to send of a piece of content, as `ChatParsing.parse` reads the whole: the
        content starts at its first non-whitespace character, and once there are calls it
        is stripped at the end too, so whitespace waits for text after it (the whitespace
        around and between calls never goes out, that inside the content does)."""
        if not self._sent_text:
            text = text.lstrip()
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body) :]
        self._sent_text = self._sent_text or bool(body)
        return body

    def deltas(self, pieces: list[Piece]) -> list[DeltaMessage]:
        """Pieces as delta messages: each run of reasoning or content is one delta; a call's
        name is one (with its id) and each run of its arguments another."""
        out: list[DeltaMessage] = []
        for p in pieces:
            last = out[-1] if out else None
            if isinstance(p, ReasoningText):
                if last is not None and last.reasoning_content is not None:
                    last.reasoning_content += p.text
                else:
                    out.append(DeltaMessage(reasoning_content=p.text))
            elif isinstance(p, str):
                if last is not None and last.content is not None:
                    last.content += p
                else:
                    out.append(DeltaMessage(content=p))
            elif p.name is not None:
                self._ids[p.index] = new_call_id()
                fn = DeltaFunctionCall(name=p.name, arguments="")
                call = DeltaToolCall(
                    index=p.index, id=self._ids[p.index], type="function", function=fn
                )
                out.append(DeltaMessage(tool_calls=[call]))
            else:
                prev = last.tool_calls[0] if last is not None and last.tool_calls else None
                if prev is not None and prev.index == p.index and prev.function.name is None:
                    prev.function.arguments = (prev.function.arguments or "") + p.arguments
                else:
                    fn = DeltaFunctionCall(arguments=p.arguments)
                    out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=p.index, function=fn)]))
        return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def arguments_complete(arguments: str) -> bool:
    """Whether a call's arguments are whole: a JSON object, not one cut short."""
    try:
        return isinstance(json.loads(arguments), dict)
    except (ValueError, RecursionError):
        return False


def final_finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """A choice that stopped after making calls finishes with "tool_calls" (OpenAI's)."""
    return "tool_calls" if made_calls and reason == "stop" else reason
