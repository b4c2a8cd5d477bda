"""The OpenAI endpoints: /v1/completions, /v1/chat/completions, /v1/models.

`OpenAIServing` validates the model name, converts the request (`openai_api`), runs it through
the TokenizerManager and answers with JSON or an SSE stream: chat streams open with one
role="assistant" delta per choice; text deltas come from the cumulative text; every choice gets
exactly one finish_reason; a usage chunk follows when stream_options.include_usage; then
`data: [DONE]`. With a reasoning or tool-call parser in play (`openai_tools.ChatParsing`), a
chat choice's text goes through its `ChoiceParser` and streams as reasoning_content, content
and tool_calls deltas in the order they occur (a call: its id, type and name first, then its
arguments in pieces); a choice that made calls finishes with "tool_calls". Called by
`http_server`'s routes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from radixserve.entrypoints.chat_templates import chat_template_source
from radixserve.entrypoints.http_utils import (
    SSE_DONE,
    SSE_HEADERS,
    ClientDisconnected,
    chain,
    collect,
    first_item,
    json_response,
    sse_event,
)
from radixserve.entrypoints.openai_api import (
    Prompts,
    chat_logprobs,
    chat_to_generate_off_loop,
    completion_logprobs,
    completion_to_generate,
    finish_reason,
    make_usage,
    normalize_prompt,
    num_logprobs,
    prompt_opens_reasoning,
)
from radixserve.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    error_body,
)
from radixserve.entrypoints.openai_responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
)
from radixserve.entrypoints.openai_tools import ChatParsing, ChoiceParser, final_finish_reason
from radixserve.io_struct import GenerateReqInput, new_rid
from radixserve.managers.tokenizer_manager import RequestError
from radixserve.managers.tokenizer_utils import TokenStrings

logger = logging.getLogger(__name__)


@dataclass
class ChoiceCursor:
    """What one streamed choice has sent so far."""

    text_len: int = 0  # characters of the cumulative output text already sent
    num_logprobs: int = 0
    # text_offset of the next logprob entry: the token strings sent so far (an echoed prompt's
    # included), as the whole response counts them (not the text: a token that ends inside a
    # character has a string but adds no text yet)
    next_offset: int = 0
    started: bool = False
    finished: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    def advance(self, out: dict[str, Any], reason: str | None) -> None:
        self.started = True
        self.text_len = len(out["text"])
        self.meta = out["meta_info"]
        self.num_logprobs = num_logprobs(self.meta)
        self.finished = reason is not None


# -- the endpoints -------------------------------------------------------------------------------
def model_sampling_defaults(server_args: Any) -> dict[str, Any]:
    """The model's recommended sampling values for OpenAI requests (--sampling-defaults model),
    logged once, as users should know why an unset temperature is not 1."""
    if server_args.sampling_defaults != "model":
        return {}
    from radixserve.model_loader.weights import load_sampling_defaults

    defaults = load_sampling_defaults(server_args.model_path)
    if defaults:
        logger.info(
            "OpenAI requests take the model's generation_config.json sampling values where "
            "they leave a field unset: %s (--sampling-defaults openai turns this off)",
            ", ".join(f"{k}={v}" for k, v in defaults.items()),
        )
    return defaults


class OpenAIServing:
    def __init__(
        self,
        tokenizer_manager: Any,
        served_model_name: str,
        model_names: set[str],
        model_root: str | None = None,
        sampling_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.tm = tokenizer_manager
        self.served_model_name = served_model_name
        self.model_names = model_names | {served_model_name}
        self.model_root = model_root or served_model_name  # (the default model: its name)
        self.tok = TokenStrings(tokenizer_manager.tokenizer)
        self.created = int(time.time())
        args = getattr(tokenizer_manager, "server_args", None)
        self.tool_call_parser: str | None = getattr(args, "tool_call_parser", None)
        self.reasoning_parser: str | None = getattr(args, "reasoning_parser", None)
        self.sampling_defaults = dict(sampling_defaults or {})  # model_sampling_defaults
        self.chat_template: str | None = None
        if getattr(args, "chat_template", None):
            self.chat_template = chat_template_source(args.chat_template)  # type: ignore[union-attr]

    def check_model(self, name: str | None) -> str | None:
        """None for the base model (or no name); the adapter's name where `name` names a LoRA
        adapter, as `name` or `<served-model-name>:name`; else 404."""
        if name is None or name in self.model_names:
            return None
        adapters = self.lora_paths
        if name in adapters:
            return name
        # (either side may hold colons: a served name "llama3:8b", an adapter "team:v2")
        for i, c in enumerate(name):
            if c == ":" and name[:i] in self.model_names and name[i + 1 :] in adapters:
                return name[i + 1 :]
        raise RequestError(f"The model `{name}` does not exist.", 404)

    @property
    def lora_paths(self) -> dict[str, str]:
        """The served LoRA adapters: name -> path."""
        return dict(getattr(self.tm, "lora_paths", None) or {})

    def _lora_of(self, req: CompletionRequest | ChatCompletionRequest) -> Any:
        """The request's adapter: the one its `model` names, else its `lora_path`."""
        by_model = self.check_model(req.model)
        if by_model is None:
            return req.lora_path
        if req.lora_path is not None and req.lora_path != by_model:
            raise RequestError(
                f"model names the LoRA adapter {by_model!r} but lora_path is {req.lora_path!r}"
            )
        return by_model

    def _model_name(self, req: CompletionRequest | ChatCompletionRequest) -> str:
        """The `model` of the response: the adapter's name as asked, else the served model."""
        return req.model if self.check_model(req.model) is not None else self.served_model_name  # type: ignore[return-value]

    def model_card(self, name: str | None = None) -> ModelCard:
        ctx = getattr(self.tm, "context_len", None)
        if name is not None:  # a LoRA adapter
            path = self.lora_paths[name]
            return ModelCard(
                id=name,
                created=self.created,
                root=path,
                parent=self.served_model_name,
                max_model_len=ctx,
            )
        return ModelCard(
            id=self.served_model_name, created=self.created, root=self.model_root, max_model_len=ctx
        )

    def list_models(self) -> ModelList:
        return ModelList(data=[self.model_card(), *map(self.model_card, self.lora_paths)])

    # -- completions ------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request: Request | None) -> Response:
        lora = self._lora_of(req)
        # Named now: the adapter may be unloaded once the request has ended, before its
        # response is written (a served request was answered 404 "does not exist").
        model = self._model_name(req)
        obj = completion_to_generate(req, self.sampling_defaults)
        obj.lora_path = lora
        prompts, _ = normalize_prompt(req.prompt)
        rid, created = "cmpl-" + new_rid(), int(time.time())
        gen = self.tm.generate_request(obj, None)
        # The echo decodes the prompt ids, so only once the TokenizerManager has checked them.
        if not req.stream:
            outs = _as_list(await collect(gen, request))
            echo = self._echo_parts(prompts) if req.echo else None
            response = self._completion_response(req, rid, created, model, outs, echo)
            return json_response(response)
        first = await first_item(gen, request)
        echo = self._echo_parts(prompts) if req.echo else None

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> BaseModel:
            return CompletionChunk(
                id=rid, created=created, model=model, choices=choices, usage=usage
            )

        def on_output(i: int, c: ChoiceCursor, out: dict[str, Any]) -> list[BaseModel]:
            choice = self._completion_delta(req, echo, i, c, out)
            return [chunk([choice])] if choice is not None else []

        def finish(i: int) -> BaseModel:
            return chunk([CompletionChoice(index=i, text="", finish_reason="abort")])

        events = self._stream(
            req, first, gen, req.n * len(prompts), on_output, finish, lambda u: chunk([], u)
        )
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)

    def _echo_parts(self, prompts: Prompts) -> list[str]:
        """Per prompt: the text to prepend to its choices."""
        if prompts.texts is not None:
            return prompts.texts
        return [self.tm.tokenizer.decode(ids) for ids in prompts.ids or []]

    def _completion_response(
        self,
        req: CompletionRequest,
        rid: str,
        created: int,
        model: str,
        outs: list[dict[str, Any]],
        echo: list[str] | None,
    ) -> CompletionResponse:
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            prefix = echo[i // req.n] if echo else ""
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(self.tok, meta, 0, 0, echo=bool(echo))
            reason, matched = finish_reason(meta)
            choices.append(
                CompletionChoice(
                    index=i,
                    text=prefix + out["text"],
                    logprobs=logprobs,
                    finish_reason=reason,
                    matched_stop=matched,
                )
            )
        usage = make_usage([o["meta_info"] for o in outs], req.n)
        return CompletionResponse(
            id=rid, created=created, model=model, choices=choices, usage=usage
        )

    def _completion_delta(
        self,
        req: CompletionRequest,
        echo: list[str] | None,
        i: int,
        c: ChoiceCursor,
        out: dict[str, Any],
    ) -> CompletionChoice | None:
        meta = out["meta_info"]
        prefix = echo[i // req.n] if echo and not c.started else ""
        delta = prefix + out["text"][c.text_len :]
        reason, matched = finish_reason(meta)
        logprobs = None
        if req.logprobs is not None:  # the echoed prompt's logprobs come with its text
            first = bool(echo) and not c.started
            logprobs = completion_logprobs(self.tok, meta, c.num_logprobs, c.next_offset, first)
            if logprobs.tokens:
                c.next_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        if not delta and reason is None and not (logprobs and logprobs.tokens):
            return None
        c.advance(out, reason)
        return CompletionChoice(
            index=i, text=delta, logprobs=logprobs, finish_reason=reason, matched_stop=matched
        )

    # -- chat -------------------------------------------------------------------------------------
    def _chat_parsing(self, req: ChatCompletionRequest, obj: GenerateReqInput) -> ChatParsing:
        """The parsers of a chat request's output; `obj` holds its rendered prompt."""
        opened = self.reasoning_parser is not None and prompt_opens_reasoning(
            self.tm, obj.input_ids
        )
        return ChatParsing.for_request(req, self.tool_call_parser, self.reasoning_parser, opened)

    async def chat_completions(
        self, req: ChatCompletionRequest, request: Request | None
    ) -> Response:
        lora = self._lora_of(req)
        obj = await chat_to_generate_off_loop(
            req, self.tm, self.chat_template, self.sampling_defaults
        )
        obj.lora_path = lora
        parsing = self._chat_parsing(req, obj)
        rid, created = "chatcmpl-" + new_rid(), int(time.time())
        model = self._model_name(req)  # (now: as for completions)
        gen = self.tm.generate_request(obj, None)
        if not req.stream:
            outs = _as_list(await collect(gen, request))
            return json_response(self._chat_response(req, rid, created, model, outs, parsing))
        first = await first_item(gen, request)
        parsers = [parsing.new_choice() if parsing.active else None for _ in range(req.n)]

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> BaseModel:
            return ChatCompletionChunk(
                id=rid, created=created, model=model, choices=choices, usage=usage
            )

        def on_output(i: int, c: ChoiceCursor, out: dict[str, Any]) -> list[BaseModel]:
            return [chunk([choice]) for choice in self._chat_delta(req, i, c, out, parsers[i])]

        def finish(i: int) -> BaseModel:
            return chunk([ChatStreamChoice(index=i, delta=DeltaMessage(), finish_reason="abort")])

        roles = [
            chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            for i in range(req.n)
        ]
        events = self._stream(
            req, first, gen, req.n, on_output, finish, lambda u: chunk([], u), roles
        )
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)

    def _chat_response(
        self,
        req: ChatCompletionRequest,
        rid: str,
        created: int,
        model: str,
        outs: list[dict[str, Any]],
        parsing: ChatParsing,
    ) -> ChatCompletionResponse:
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            reason, matched = finish_reason(meta)
            message = ChatResponseMessage(content=out["text"])
            if parsing.active:
                parsed = parsing.parse(out["text"])
                message = ChatResponseMessage(**vars(parsed))
                if parsed.tool_calls:
                    reason, matched = final_finish_reason(reason, True), None
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=chat_logprobs(self.tok, meta, 0) if req.logprobs else None,
                    finish_reason=reason,
                    matched_stop=matched,
                )
            )
        usage = make_usage([o["meta_info"] for o in outs], req.n)
        return ChatCompletionResponse(
            id=rid, created=created, model=model, choices=choices, usage=usage
        )

    def _chat_delta(
        self,
        req: ChatCompletionRequest,
        i: int,
        c: ChoiceCursor,
        out: dict[str, Any],
        parser: ChoiceParser | None,
    ) -> list[ChatStreamChoice]:
        """The chunks of one output of choice i: the parsed deltas in order (logprobs on the
        first, finish_reason on the last), or one content delta without a parser."""
        meta = out["meta_info"]
        delta = out["text"][c.text_len :]
        reason, matched = finish_reason(meta)
        logprobs = chat_logprobs(self.tok, meta, c.num_logprobs) if req.logprobs else None
        if not delta and reason is None and not (logprobs and logprobs.content):
            return []
        c.advance(out, reason)
        if parser is None:
            deltas = [DeltaMessage(content=delta or None)]
        else:
            deltas = parser.deltas(parser.feed(delta, final=reason is not None))
            # (whether the calls are whole matters at the finish only: not parsed per chunk)
            if reason is not None and parser.made_whole_call:
                reason, matched = final_finish_reason(reason, True), None
        chunks = [ChatStreamChoice(index=i, delta=d) for d in deltas or [DeltaMessage()]]
        chunks[0].logprobs = logprobs
        chunks[-1].finish_reason, chunks[-1].matched_stop = reason, matched
        return [ch for ch in chunks if _worth_sending(ch)]

    # -- SSE driver shared by both endpoints ------------------------------------------------------
    async def _stream(
        self,
        req: SamplingFields,
        first: Any,
        gen: AsyncIterator[Any],
        num_choices: int,
        on_output: Callable[[int, ChoiceCursor, dict[str, Any]], list[BaseModel]],
        finish: Callable[[int], BaseModel],
        usage: Callable[[UsageInfo], BaseModel],
        preamble: list[BaseModel] = (),  # type: ignore[assignment]
    ) -> AsyncIterator[bytes]:
        """Chunks per output; then exactly one finish_reason per choice (an "abort" chunk for a
        choice that ended without one), the usage chunk if asked for, and [DONE]. Errors after
        the first byte become an error event."""
        cursors = [ChoiceCursor() for _ in range(num_choices)]
        # (SGLang's and vLLM's: each chunk says the usage of its choice so far)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        try:
            for chunk in preamble:
                if continuous:  # (the role's chunk: nothing generated yet)
                    chunk.usage = make_usage([{**first["meta_info"], "completion_tokens": 0}], 1)
                yield sse_event(chunk)
            async for out in chain(first, gen):
                for chunk in on_output(out.get("index", 0), cursors[out.get("index", 0)], out):
                    if continuous:
                        chunk.usage = make_usage([out["meta_info"]], 1)
                    yield sse_event(chunk)
        except RequestError as e:
            yield sse_event(error_body(str(e), e.status_code))
            yield SSE_DONE
            return
        except Exception as e:
            logger.exception("streaming failed")
            yield sse_event(error_body(f"internal error: {type(e).__name__}: {e}", 500))
            yield SSE_DONE
            return
        finally:
            await gen.aclose()
        for i, c in enumerate(cursors):
            if not c.finished:
                yield sse_event(finish(i))
        if req.stream_options and req.stream_options.include_usage:
            yield sse_event(usage(make_usage([c.meta for c in cursors], req.n)))
        yield SSE_DONE


def _worth_sending(ch: ChatStreamChoice) -> bool:
    d = ch.delta
    return (
        ch.finish_reason is not None
        or (ch.logprobs is not None and bool(ch.logprobs.content))
        or any(v is not None for v in (d.content, d.reasoning_content, d.tool_calls))
    )


def _as_list(out: Any) -> list[dict[str, Any]]:
    if out is None:
        raise ClientDisconnected
    return out if isinstance(out, list) else [out]
