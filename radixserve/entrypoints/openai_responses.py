"""Pydantic models of the OpenAI Completions / Chat Completions responses and chunks, and of
/v1/models. Built by `openai_serving` and `openai_api`; requests live in `openai_protocol`."""

from __future__ import annotations

import time
from typing import Any, ClassVar

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class OmitWhenNone(BaseModel):
    """Leaves the fields named in `_omit_when_none` out of the JSON while they are None (the
    reasoning and tool-call fields appear only where a parser produced them)."""

    _omit_when_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self._omit_when_none:
            if data.get(name, 0) is None:
                del data[name]
        return data


class FunctionResponse(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCall(BaseModel):
    id: str
    type: str = "function"
    function: FunctionResponse


class ChatResponseMessage(OmitWhenNone):
    _omit_when_none = ("reasoning_content", "tool_calls")
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaFunctionCall(OmitWhenNone):
    _omit_when_none = ("name", "arguments")
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OmitWhenNone):
    """A piece of a streamed call: the first has id, type and name; the rest arguments."""

    _omit_when_none = ("id", "type")
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall


class DeltaMessage(OmitWhenNone):
    _omit_when_none = ("reasoning_content", "tool_calls")
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


CompletionChunk = CompletionResponse  # a streamed chunk has the same shape


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "radixserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
