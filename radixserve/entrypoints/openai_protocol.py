"""Pydantic models of the OpenAI Completions / Chat Completions requests (and the native
`/generate` body), plus the OpenAI error body; the responses are in `openai_responses`.

Requests are validated here (types, simple ranges, finite numbers → HTTP 400 through
`http_utils.parse_body`); what needs the tokenizer or the model is checked in `openai_api`.
Fields beyond OpenAI's (top_k, min_p, regex, ...) are SGLang's, sent through `extra_body`.
An unknown field is a 400 naming it: dropping one that changes the meaning of a request (best_of,
functions, ...) would answer another question than the one asked. Harmless metadata (user, store,
...) and what SGLang's router adds to every request are accepted; a field in NOOP_ONLY is
accepted only with a value that asks for nothing (false, null, the default). Tools, tool_choice
and tool_calls are checked here for shape and consistency; `openai_tools` uses them.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, get_args, get_type_hints

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    create_model,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from radixserve.io_struct import PER_PROMPT_LOGPROB_FIELDS
from radixserve.sampling_params import (
    UNIMPLEMENTED_PARAMS,
    SamplingParams,
    logit_bias_key_error,
)

MAX_LOGPROBS = 20
MAX_N = 128
# SGLang's ranges of the sampling params shared by all APIs (SamplingParams.verify checks them
# again for the Engine; top_k 0 is refused there). Temperature above 2 is accepted, as in SGLang.
RANGES = {
    "n": Field(ge=1, le=MAX_N),
    "temperature": Field(ge=0.0),
    "top_p": Field(gt=0.0, le=1.0),
    "top_k": Field(ge=-1),
    "min_p": Field(ge=0.0, le=1.0),
    "presence_penalty": Field(ge=-2.0, le=2.0),
    "frequency_penalty": Field(ge=-2.0, le=2.0),
    "repetition_penalty": Field(gt=0.0, le=2.0),
    "max_new_tokens": Field(ge=0),
    "min_new_tokens": Field(ge=0),
}
TokenId = Annotated[int, Field(ge=0, strict=True)]  # (strict: JSON true is not id 1)
LEGACY_FUNCTIONS = "the deprecated functions API; use tools and tool_choice"
# Fields we know but do not implement: (the values that ask for nothing, why another is a 400).
NOOP_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), LEGACY_FUNCTIONS),
    "function_call": ((None, "none"), LEGACY_FUNCTIONS),
    "suffix": ((None, ""), "insertion is not implemented"),
    "audio": ((None,), "text only"),
    "modalities": ((None, ["text"]), "text only"),
    "return_hidden_states": ((False,), ""),
    "background": ((False,), ""),
    "return_bytes": ((False,), ""),
    "return_entropy": ((False,), ""),
    **UNIMPLEMENTED_PARAMS,
}


def error_body(message: str, status_code: int, err_type: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape: {"error": {"message", "type", "param", "code"}}."""
    if err_type is None:
        err_type = {
            401: "authentication_error",
            404: "invalid_request_error",
            503: "service_unavailable",
        }.get(status_code, "invalid_request_error" if status_code < 500 else "internal_error")
    return {"error": {"message": message, "type": err_type, "param": None, "code": status_code}}


def unsupported(field: str, why: str = "") -> PydanticCustomError:
    """The validation error of a field we know but do not implement (the message names it)."""
    message = f"{field} is not supported" + (f" ({why})" if why else "")
    return PydanticCustomError("unsupported", message)


def null_is_the_default(*fields: str) -> Any:
    """A validator of `fields`, which OpenAI's spec types "... or null": null is the default.
    (check_fields=False: a base class may name fields that only its subclasses have.)"""

    def default_for_null(cls: type[BaseModel], v: Any, info: Any) -> Any:
        return cls.model_fields[info.field_name].default if v is None else v

    return field_validator(*fields, mode="before", check_fields=False)(default_for_null)


# -- requests ------------------------------------------------------------------------------------
def _document_noop_values(schema: dict[str, Any]) -> None:
    """Say in the JSON schema (so in /openapi.json) which values a NOOP_ONLY field accepts."""
    for name, prop in schema.get("properties", {}).items():
        if name in NOOP_ONLY:
            noop, why = NOOP_ONLY[name]
            prop.clear()  # the declared type says what a client may send, not what we accept
            prop.update(enum=list(noop), description=f"accepted only as a no-op. {why}".strip())


class RequestModel(BaseModel):
    """Base of every request body: unknown fields and non-finite numbers are rejected; a field
    named in NOOP_ONLY must hold one of its no-op values."""

    model_config = ConfigDict(
        extra="forbid", allow_inf_nan=False, json_schema_extra=_document_noop_values
    )

    @model_validator(mode="after")
    def _only_noop_values(self) -> RequestModel:
        for name in type(self).model_fields.keys() & NOOP_ONLY.keys():
            noop, why = NOOP_ONLY[name]
            if getattr(self, name) not in noop:
                raise unsupported(name, why)
        return self


class RoutingFields(RequestModel):
    """What SGLang's router adds to every kind of request. The bootstrap fields pair a prefill
    server with a decode server (--disaggregation-mode); a server without disaggregation
    ignores them, as SGLang's does."""

    # The router's --dp-aware: which --dp-size replica serves the request (checked against
    # this server's dp_size by the TokenizerManager).
    data_parallel_rank: StrictInt | None = Field(None, ge=0)
    # One value, or (a batch, or n > 1) one per prompt or per choice; checked with the rest of
    # the request (request_checks._verify_bootstrap).
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: StrictInt | list[StrictInt] | None = None
    bootstrap_room: StrictInt | list[StrictInt] | None = None
    return_hidden_states: bool = Field(False, exclude=True)


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None  # (a no-op: no stream of ours is obfuscated)

    _null_is_the_default = null_is_the_default("include_usage", "continuous_usage_stats")


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(RequestModel):
    """A tool's function. `parameters` is the JSON schema of its arguments (absent: none);
    tool_choice required / named enforces it whatever `strict` says, auto does not."""

    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(RequestModel):
    name: str


class ToolChoice(RequestModel):
    """tool_choice naming the one function the model must call."""

    type: Literal["function"]
    function: ToolChoiceFunction


class FunctionCallIn(RequestModel):
    name: str
    arguments: str  # a JSON object's text, as the model wrote it
    parsed_arguments: Any = None  # the openai SDK's parse helpers add it; not used


class ToolCallIn(RequestModel):
    """A call in an assistant message of the history (`index` is what a streamed one keeps)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn
    index: int | None = None


class SamplingFields(RoutingFields):
    """Fields shared by both endpoints; `openai_api.sampling_params` maps them to SGLang names."""

    model: str | None = None
    # A LoRA adapter by name (SGLang's field; `model` may name it too), one per prompt or one.
    lora_path: str | list[str | None] | None = None
    priority: StrictInt | None = None  # SGLang's: --schedule-policy priority, larger first
    n: Annotated[int, RANGES["n"]] = 1
    temperature: Annotated[float | None, RANGES["temperature"]] = None
    top_p: Annotated[float | None, RANGES["top_p"]] = None
    top_k: Annotated[int | None, RANGES["top_k"]] = None
    min_p: Annotated[float | None, RANGES["min_p"]] = None
    presence_penalty: Annotated[float | None, RANGES["presence_penalty"]] = None
    frequency_penalty: Annotated[float | None, RANGES["frequency_penalty"]] = None
    repetition_penalty: Annotated[float | None, RANGES["repetition_penalty"]] = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}}
    )
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    response_format: ResponseFormat | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    rid: str | list[str] | None = None  # a list: one per prompt of a completions batch
    # Metadata that changes nothing about the answer.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # (the radix cache finds shared prefixes by itself)
    verbosity: str | None = None

    _null_is_the_default = null_is_the_default("n", "stream", "echo", "logprobs")

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        error = logit_bias_key_error(v or {})
        if error is not None:
            raise PydanticCustomError("token_id", error)
        return v


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    # OpenAI's default for the legacy completions endpoint is 16 tokens; None = up to the context.
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _supported_combinations(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", "only best_of == n, which returns every sample")
        return self


class ChatContentPart(BaseModel):
    """A content part; `openai_api.chat_messages` rejects all but plain text parts."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    # What clients send back when they replay an assistant message as they received it.
    refusal: str | None = None
    annotations: list[Any] | None = None
    tool_calls: list[ToolCallIn] | None = None
    function_call: Any = None
    audio: Any = None
    parsed: Any = None  # the openai SDK's parse helpers add it
    reasoning_content: str | None = None  # passed to the template (Qwen3's renders it)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    # OpenAI's chat default: no limit other than the context window.
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    # A template variable where the template has it (gpt-oss's), as in SGLang and vLLM.
    reasoning_effort: str | None = None
    tools: list[Tool] | None = None
    # None: "auto" with tools, else "none" (OpenAI's defaults).
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None = true; false: at most one call
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    # The last message, the assistant's, is continued: no end of turn, no generation prompt.
    continue_final_message: bool = False
    add_generation_prompt: bool = True  # (vLLM's) false: the template's assistant opening too
    # With --reasoning-parser: false puts the reasoning in content; stream_reasoning false
    # sends the reasoning as one delta once it is complete. Without one: no-ops.
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    @model_validator(mode="after")
    def _tool_choice_matches_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise PydanticCustomError("tools", "tools has two functions with the same name")
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return self
        if not names:
            label = choice if isinstance(choice, str) else "naming a function"
            msg = "tool_choice {choice} needs tools"
            raise PydanticCustomError("tools", msg, {"choice": label})
        if isinstance(choice, ToolChoice) and choice.function.name not in names:
            msg = "tool_choice names function '{name}', which is not one of tools"
            raise PydanticCustomError("tools", msg, {"name": choice.function.name})
        fmt = self.response_format
        if (fmt is not None and fmt.type != "text") or self.json_schema or self.regex or self.ebnf:
            msg = "tool_choice required or a named function constrains the output itself; "
            msg += "drop response_format / json_schema / regex / ebnf"
            raise PydanticCustomError("tools", msg)
        return self


class _StrictRequestModel(RequestModel):
    model_config = ConfigDict(strict=True)  # SGLang's own API: "0.5" is not a number


def _sampling_params_body() -> type[RequestModel]:
    """`sampling_params` of /generate: a model of the fields of `SamplingParams` (built from
    them, so the two never drift apart) with RANGES; SamplingParams.verify() checks the rest.
    Null is the default for every field (SGLang's rule, what its frontend sends), and SGLang's
    `sampling_seed` is `seed`; its stop regexes and custom params are accepted empty only."""
    hints = get_type_hints(SamplingParams)
    fields: dict[str, Any] = {
        f.name: (Annotated[hints[f.name] | None, RANGES.get(f.name, Field())], _default(f))
        for f in dataclasses.fields(SamplingParams)
        if f.init
    }
    fields["sampling_seed"] = (int | None, Field(None, exclude=True))
    fields["stop_regex"] = (Any, Field(None, exclude=True))
    fields["custom_params"] = (Any, Field(None, exclude=True))
    return create_model("SamplingParamsBody", __base__=_StrictRequestModel, **fields)


# Sampling params whose null is a value of their own (max_new_tokens: up to the context's end)
# rather than "the default".
NULLABLE_SAMPLING_PARAMS = frozenset(
    f.name
    for f in dataclasses.fields(SamplingParams)
    if f.init and type(None) in get_args(get_type_hints(SamplingParams)[f.name])
)


def sampling_params_set(body: BaseModel) -> dict[str, Any]:
    """The sampling params a /generate body set (null is the default: left out)."""
    sp = body.model_dump(exclude_unset=True)
    sp = {k: v for k, v in sp.items() if v is not None or k in NULLABLE_SAMPLING_PARAMS}
    seed = getattr(body, "sampling_seed", None)
    if seed is not None and sp.get("seed") is None:
        sp["seed"] = seed
    return sp


def _default(f: dataclasses.Field) -> Any:
    missing = f.default is dataclasses.MISSING
    return Field(default_factory=f.default_factory) if missing else f.default


SamplingParamsBody = _sampling_params_body()


def _one_prompt_source(schema: dict[str, Any]) -> None:
    _document_noop_values(schema)
    given = {"not": {"type": "null"}}
    schema["oneOf"] = [
        {"required": [name], "properties": {name: given}} for name in ("text", "input_ids")
    ]


TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
LogprobStart = Annotated[int, Field(ge=-1)]


class GenerateRequest(RoutingFields):
    """Body of the native `/generate` endpoint. `model_dump()` gives fields of `GenerateReqInput`
    (not the accepted no-op fields), with only the sampling params the client set, so that
    SamplingParams keeps its own defaults."""

    model_config = ConfigDict(json_schema_extra=_one_prompt_source)
    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    # (a value for every prompt, or a list of one per prompt of a batch: SGLang's)
    return_logprob: bool | list[bool] = False
    top_logprobs_num: TopLogprobs | list[TopLogprobs] = 0
    logprob_start_len: LogprobStart | list[LogprobStart] = -1  # -1: no prompt logprobs
    return_text_in_logprobs: bool = False
    priority: StrictInt | None = None  # (true, "5" and 2.0 were taken: the Engine refuses them)
    lora_path: str | list[str | None] | None = None  # a LoRA adapter's name, or one per prompt
    # Added by SGLang's router; no-ops here (the model is the one this server serves).
    model: str | None = Field(None, exclude=True)
    log_metrics: bool = Field(True, exclude=True)
    no_logs: bool = Field(False, exclude=True)
    background: bool = Field(False, exclude=True)
    return_bytes: bool = Field(False, exclude=True)
    return_entropy: bool = Field(False, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """As SGLang: null for a field with a default (what its frontend sends) is the default."""
        if isinstance(data, dict):
            defaulted = ("stream", "return_text_in_logprobs", *PER_PROMPT_LOGPROB_FIELDS)
            data = {k: v for k, v in data.items() if v is not None or k not in defaulted}
        return data

    @field_serializer("sampling_params")
    def _set_fields_only(self, sp: Any) -> Any:
        if isinstance(sp, list):
            return [sampling_params_set(p) for p in sp]
        return sampling_params_set(sp) if sp is not None else None

    @model_validator(mode="after")
    def _batch_shape(self) -> GenerateRequest:
        """One prompt source; per-prompt lists (sampling_params, rid) match the prompts."""
        if (self.text is None) == (self.input_ids is None):
            raise PydanticCustomError("prompt", "give exactly one of text and input_ids")
        prompts: Any = self.text if self.text is not None else self.input_ids
        single = isinstance(prompts, str) or not prompts or isinstance(prompts[0], int)
        for name in ("sampling_params", "rid", *PER_PROMPT_LOGPROB_FIELDS):
            value = getattr(self, name)
            if isinstance(value, list) and (single or len(value) != len(prompts)):
                n = 1 if single else len(prompts)
                msg = f"{name} is a list of {len(value)} for {n} prompt(s)"
                raise PydanticCustomError("batch", msg)
        return self
