"""OpenAI's Responses API, its wire models: the body of `POST /v1/responses`
(`ResponsesRequest`), the Response object (`ResponseObject`), and the request as the Chat
Completions request that serves it (`to_chat_request`): `instructions` is the system message,
input items become messages (a `function_call` joins the assistant message before it as a tool
call, a `function_call_output` is a tool message, a `reasoning` item is the next assistant
message's reasoning_content), and tools, tool_choice, text.format and reasoning.effort take
their chat names. Served by `responses_serving`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from radixserve.entrypoints.http_utils import validation_message
from radixserve.entrypoints.openai_protocol import (
    MAX_LOGPROBS,
    RANGES,
    ChatCompletionRequest,
    RequestModel,
    RoutingFields,
    null_is_the_default,
)
from radixserve.managers.tokenizer_manager import RequestError

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# What stateless clients (store false: Codex-style agents, the Vercel AI SDK) include on every
# turn, to send the reasoning back in the next one. Our reasoning items carry their text and no
# encrypted_content, and come back as they are (an input item's encrypted_content is ignored):
# a no-op.
ENCRYPTED_REASONING_INCLUDE = "reasoning.encrypted_content"
INCLUDES = (LOGPROBS_INCLUDE, ENCRYPTED_REASONING_INCLUDE)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}
PART_KEYS = {"type", "text", "annotations", "logprobs"}


# -- request -------------------------------------------------------------------------------------
class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # (no-op, as the chat path's verbosity)


class ReasoningConfig(RequestModel):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesStreamOptions(RequestModel):
    include_obfuscation: bool | None = None  # (a no-op: no stream of ours is obfuscated)


class ResponsesRequest(RoutingFields):
    """The body of POST /v1/responses. Input items and their content parts are checked when
    they are turned into messages (`input_messages`), with messages that name the item."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: Annotated[float | None, RANGES["temperature"]] = None
    top_p: Annotated[float | None, RANGES["top_p"]] = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    # OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512 (stored with the response)
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    background: bool = False
    # Accepted only where the model cannot make more calls than that (see `_supported`).
    max_tool_calls: int | None = Field(None, ge=0)
    # SGLang's extras (as on the chat endpoint)
    top_k: Annotated[int | None, RANGES["top_k"]] = None
    min_p: Annotated[float | None, RANGES["min_p"]] = None
    repetition_penalty: Annotated[float | None, RANGES["repetition_penalty"]] = None
    presence_penalty: Annotated[float | None, RANGES["presence_penalty"]] = None
    frequency_penalty: Annotated[float | None, RANGES["frequency_penalty"]] = None
    stop: str | list[str] | None = None
    seed: int | None = None

    _null_is_the_default = null_is_the_default("stream", "store", "background")

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, v: Any) -> Any:
        for i, tool in enumerate(v if isinstance(v, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                msg = "item {i} is a '{kind}' tool, which is not supported (only function tools)"
                raise PydanticCustomError("unsupported", msg, {"i": i, "kind": kind})
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != "function":
            msg = "tool_choice of type '{kind}' is not supported (only function tools)"
            raise PydanticCustomError("unsupported", msg, {"kind": str(v.get("type"))})
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > MAX_METADATA_PAIRS:
            msg = "at most {n} key-value pairs, got {got}"
            raise PydanticCustomError("metadata", msg, {"n": MAX_METADATA_PAIRS, "got": len(v)})
        for key, value in v.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                msg = "keys of at most {k} characters and values of at most {v}: '{key}'"
                bounds = {"k": MAX_METADATA_KEY, "v": MAX_METADATA_VALUE, "key": key[:80]}
                raise PydanticCustomError("metadata", msg, bounds)
        return v

    @field_validator("truncation", mode="before")
    @classmethod
    def _no_truncation(cls, v: Any) -> Any:
        if v not in (None, "disabled"):
            msg = "truncation '{v}' is not supported (only 'disabled')"
            raise PydanticCustomError("unsupported", msg, {"v": str(v)})
        return v

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        other = [x for x in self.include or [] if x not in INCLUDES]
        if other:
            msg = "include {names} is not supported (only {ok})"
            ok = " and ".join(f"'{x}'" for x in INCLUDES)
            raise PydanticCustomError("unsupported", msg, {"names": other, "ok": ok})
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise PydanticCustomError("format", "text.format.schema is required for json_schema")
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise PydanticCustomError("tools", "tools has two functions with the same name")
        choice = self.tool_choice
        most = self._most_tool_calls()
        if self.max_tool_calls is not None and (most is None or most > self.max_tool_calls):
            msg = "max_tool_calls {n} is not supported: nothing caps the calls the model makes "
            msg += "but parallel_tool_calls false (one at most) or tool_choice none (none)"
            raise PydanticCustomError("unsupported", msg, {"n": self.max_tool_calls})
        if choice in (None, "none", "auto"):
            return self
        if isinstance(choice, NamedToolChoice) and choice.name not in names:
            msg = "tool_choice names function '{name}', which is not one of tools"
            raise PydanticCustomError("tools", msg, {"name": choice.name})
        if not names:
            raise PydanticCustomError("tools", "tool_choice required needs tools")
        if fmt is not None and fmt.type != "text":
            msg = "tool_choice required or a named function constrains the output itself; "
            raise PydanticCustomError("tools", msg + "drop text.format")
        return self

    def _most_tool_calls(self) -> int | None:
        """The most calls the model can make (None: any number)."""
        if not self.tools or self.tool_choice == "none":
            return 0
        return 1 if self.parallel_tool_calls is False else None

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])


# -- input items → chat messages ----------------------------------------------------------------
def _fail(where: str, why: str) -> RequestError:
    return RequestError(f"{where}: {why}")


def _check_keys(item: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise _fail(where, f"unsupported field(s): {', '.join(unknown)}")


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _fail(f"{where}.{key}", "required, a string")
    return value


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or input_text / output_text parts (joined by lines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail(where, "a string or a list of input_text parts")
    texts = []
    for k, part in enumerate(content):
        loc = f"{where}.{k}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise _fail(loc, f"content part type {kind!r} is not supported (text only)")
        _check_keys(part, PART_KEYS, loc)
        texts.append(_string(part, "text", loc))
    return "\n".join(texts)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise _fail(where, "content is a list of reasoning_text parts")
    return "".join(_string(p, "text", f"{where}.content") for p in parts if isinstance(p, dict))


def input_messages(items: list[Any], where: str = "input") -> list[dict[str, Any]]:
    """Input items as chat messages (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        loc = f"{where}.{i}"
        if not isinstance(item, dict):
            raise _fail(loc, "an input item is an object")
        kind = item.get("type", "message")
        if not isinstance(kind, str) or kind not in ITEM_KEYS:
            raise _fail(loc, f"input item type {kind!r} is not supported")
        _check_keys(item, ITEM_KEYS[kind], loc)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _fail(f"{loc}.role", f"one of {', '.join(ROLES)}")
            msg = {"role": role, "content": _text_of(item.get("content"), f"{loc}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            messages.append(msg)
        elif kind == "function_call":
            arguments = _string(item, "arguments", loc)
            try:
                json.loads(arguments)
            except (ValueError, RecursionError):
                raise _fail(f"{loc}.arguments", "not valid JSON") from None
            fn = {"name": _string(item, "name", loc), "arguments": arguments}
            call = {"id": _string(item, "call_id", loc), "type": "function", "function": fn}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = _text_of(item.get("output"), f"{loc}.output")
            call_id = _string(item, "call_id", loc)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            reasoning = _reasoning_text(item, loc)
    return messages


def to_chat_request(
    req: ResponsesRequest, history: list[dict[str, Any]], items: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request that serves `req`: `history` (earlier items) and `items` (its input)."""
    messages = input_messages(history, "previous_response") + input_messages(items)
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise RequestError("input: give at least one input item")
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None:
        response_format = {"type": fmt.type}
        if fmt.type == "json_schema":
            schema = {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}
            response_format["json_schema"] = schema
    choice: Any = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    tools = [
        {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
        for t in req.tools or []
    ]
    same = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user", "top_k")
    same += ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop")
    same += ("seed", "service_tier", "data_parallel_rank", "bootstrap_host", "bootstrap_port")
    body: dict[str, Any] = {name: getattr(req, name) for name in (*same, "bootstrap_room")}
    body.update(
        messages=messages,
        max_completion_tokens=req.max_output_tokens,
        tools=tools or None,
        tool_choice=choice,
        response_format=response_format,
        reasoning_effort=req.reasoning.effort if req.reasoning is not None else None,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs if req.logprobs else None,
    )
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise RequestError(validation_message(e.errors())) from None


# -- output --------------------------------------------------------------------------------------
class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class ResponseObject(BaseModel):
    """The Response object; output items are the dicts `OutputBuilder` builds."""

    id: str
    object: str = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed", "cancelled"]
    background: bool = False
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=dict)
    service_tier: str | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=dict)
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
