"""OpenAI's Responses API, served: `POST /v1/responses`, `GET|DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items` and `POST /v1/responses/{id}/cancel`, for text models.

A request runs as its Chat Completions request (`responses_protocol.to_chat_request`) through
the chat path's machinery: `chat_to_generate` (template, tool schemas, json_schema), the
TokenizerManager, and the chat parsers (`ChatParsing`), whose pieces `OutputBuilder` turns into
output items (reasoning, message, function_call) and, when streamed, into the Responses SSE
events with increasing sequence_numbers. A stored response (`store`, the default) keeps its
input items and output in a bounded in-memory LRU; `previous_response_id` puts them before the
new input (not their instructions, as OpenAI). Called by `http_server`, which registers the
routes with `install_responses_api`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from radixserve.entrypoints.http_utils import (
    SSE_HEADERS,
    ClientDisconnected,
    chain,
    collect,
    error_response,
    first_item,
    install_request_bodies,
    json_response,
    parse_body,
)
from radixserve.entrypoints.openai_api import (
    chat_logprobs,
    chat_to_generate_off_loop,
    finish_reason,
)
from radixserve.entrypoints.openai_tools import (
    ChatParsing,
    ReasoningText,
    arguments_complete,
    new_call_id,
)
from radixserve.entrypoints.responses_protocol import (
    InputTokensDetails,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    to_chat_request,
)
from radixserve.managers.tokenizer_manager import RequestError

logger = logging.getLogger(__name__)

MAX_STORED_RESPONSES = 1024
ITEM_ID_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """Parser pieces → output items, and the stream events that build them (in `events`,
    without sequence numbers). One item is open at a time: a piece of another kind closes it.
    A message's logprobs are those of the tokens of its text (`_place`)."""

    def __init__(self, logprobs: bool = False) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # the parser's call index → its item
        self.reasoning = ""
        self.fed = ""  # the output text fed so far
        self.logprobs = logprobs  # (include message.output_text.logprobs)
        # The tokens fed but not yet placed in a piece (`_place`): (where the token starts
        # and ends in the output's UTF-8 bytes, its logprob entry); where the fed tokens end;
        # and where the last piece placed ends in the output (a character, a byte).
        self.tokens: deque[tuple[int, int, dict[str, Any]]] = deque()
        self.token_end = 0
        self.placed, self.placed_byte = 0, 0

    def feed(self, pieces: list[Any], logprobs: list[dict[str, Any]]) -> None:
        for lp in logprobs:
            start, self.token_end = self.token_end, self.token_end + len(lp["bytes"])
            self.tokens.append((start, self.token_end, lp))
        for p in pieces:
            if isinstance(p, ReasoningText):
                self.reasoning += p.text
                self._place(p.text, False)  # (its tokens are no message's)
                self._text(self._ensure("reasoning"), p.text, [])
            elif isinstance(p, str):
                item = self._ensure("message")
                self._text(item, p, self._place(p, not item["content"][0]["text"]))
            elif p.name is not None:
                self._close("completed")
                item = {"id": _item_id(ITEM_ID_PREFIX["function_call"])}
                item.update(type="function_call", status="in_progress")
                item.update(call_id=new_call_id(), name=p.name, arguments="")
                self.calls[p.index] = self._add(item)
                if p.arguments:
                    self._arguments(self.calls[p.index], p.arguments)
            elif p.index in self.calls:
                self._arguments(self.calls[p.index], p.arguments)

    def _place(self, text: str, first: bool) -> list[dict[str, Any]]:
        """The logprob entries of the tokens of `text`, a piece of the output text that the
        parser cut out (none where logprobs were not asked for): the tokens not yet placed
        that start before the piece ends, less, for the `first` piece of an item, those that
        end before it starts (a call's markup, the tags and whitespace the parser drops). So
        a message has the tokens with a byte in its text (one that straddles the whitespace
        after `</think>` and the text too), but for those placed before it: a token with
        bytes in the reasoning is the reasoning's. The piece is found in the output after the
        pieces before it (where the parser changed the text: right there); a token's bytes
        follow those of the tokens before it, as in the output (but where a broken character
        reads U+FFFD). A token's place does not depend on how the output came, in one chunk
        or in many: a stream's message has the logprobs of the whole response's."""
        if not self.logprobs:
            return []
        at = max(self.fed.find(text, self.placed), self.placed)
        start = self.placed_byte + len(self.fed[self.placed : at].encode())
        self.placed, self.placed_byte = at + len(text), start + len(text.encode())
        while first and self.tokens and self.tokens[0][1] <= start:
            self.tokens.popleft()
        mine = []
        while self.tokens and self.tokens[0][0] < self.placed_byte:
            mine.append(self.tokens.popleft()[2])
        return mine

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close the open item (`status`); a response without calls has a message."""
        if not any(it["type"] in ("message", "function_call") for it in self.items):
            self._ensure("message")
        self._close(status)
        return self.items

    def _ensure(self, kind: str) -> dict[str, Any]:
        if self.open is not None and self.open["type"] == kind:
            return self.open
        self._close("completed")
        item: dict[str, Any] = {"id": _item_id(ITEM_ID_PREFIX[kind])}
        item.update(type=kind, status="in_progress")
        if kind == "message":
            item.update(role="assistant", content=[])
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item.update(summary=[], content=[])
            part = {"type": "reasoning_text", "text": ""}
        self._add(item)
        self._event("response.content_part.added", item, content_index=0, part=_copy(part))
        item["content"].append(part)
        return item

    def _add(self, item: dict[str, Any]) -> dict[str, Any]:
        self.open = item
        self.items.append(item)
        self._event("response.output_item.added", None, item=_copy(item))
        return item

    def _index(self, item: dict[str, Any] | None) -> int:
        return len(self.items) - 1 if item is None else self.items.index(item)

    def _event(self, kind: str, of: dict[str, Any] | None, **fields: Any) -> None:
        event = {"type": kind, "output_index": self._index(of)}
        if of is not None:
            event["item_id"] = of["id"]
        self.events.append({**event, **fields})

    def _text(self, item: dict[str, Any], delta: str, logprobs: list[dict[str, Any]]) -> None:
        item["content"][0]["text"] += delta
        if item["type"] == "message":
            item["content"][0]["logprobs"] += logprobs
            kind, extra = "response.output_text.delta", {"logprobs": logprobs}
        else:
            kind, extra = "response.reasoning_text.delta", {}
        self._event(kind, item, content_index=0, delta=delta, **extra)

    def _arguments(self, item: dict[str, Any], delta: str) -> None:
        item["arguments"] += delta
        self._event("response.function_call_arguments.delta", item, delta=delta)

    def _close(self, status: str) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = status
        if item["type"] == "function_call":
            if not arguments_complete(item["arguments"]):  # (cut by a stop string, say)
                item["status"] = "incomplete"
            done = {"arguments": item["arguments"], "name": item["name"]}
            self._event("response.function_call_arguments.done", item, **done)
        else:
            part = item["content"][0]
            if item["type"] == "message":
                kind, extra = "response.output_text.done", {"logprobs": part["logprobs"]}
            else:
                kind, extra = "response.reasoning_text.done", {}
            self._event(kind, item, content_index=0, text=part["text"], **extra)
            self._event("response.content_part.done", item, content_index=0, part=_copy(part))
        self._event("response.output_item.done", item, item=_copy(item))


def _copy(data: Any) -> Any:
    return orjson.loads(orjson.dumps(data))


# -- serving ------------------------------------------------------------------------------------
class ResponsesServing:
    """Runs Responses requests through the chat path of `OpenAIServing` and keeps the stored
    responses (an LRU of MAX_STORED_RESPONSES: id → (response, its input items))."""

    def __init__(self, openai: Any) -> None:
        self.openai = openai
        self.tm = openai.tm
        self.stored: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def get(self, response_id: str) -> dict[str, Any]:
        if response_id not in self.stored:
            raise RequestError(f"Response with id '{response_id}' not found.", 404)
        self.stored.move_to_end(response_id)
        return self.stored[response_id][0]

    def delete(self, response_id: str) -> dict[str, Any]:
        self.get(response_id)
        del self.stored[response_id]
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def input_items(self, response_id: str, query: Any) -> dict[str, Any]:
        """A page of the items a stored response was generated from (those of the responses
        before it too), newest first unless `order` is asc; `after` / `before` name an item."""
        self.get(response_id)
        items = self.stored[response_id][1]
        limit = query.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise RequestError(f"limit: an integer from 1 to 100, got {limit!r}")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise RequestError(f"order: 'asc' or 'desc', got {order!r}")
        if order == "desc":
            items = items[::-1]
        ids = [it["id"] for it in items]
        start, end = 0, len(items)
        for name in ("after", "before"):
            if name in query and query[name] not in ids:
                raise RequestError(f"{name}: no input item {query[name]!r} in this response")
        if "after" in query:
            start = ids.index(query["after"]) + 1
        if "before" in query:
            end = ids.index(query["before"])
        page = items[start:end][: int(limit)]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + len(page) < end,
        }

    def cancel(self, response_id: str) -> dict[str, Any]:
        self.get(response_id)  # (responses run in the request that creates them)
        raise RequestError("Cannot cancel a synchronous response: only background ones can be.")

    def _store(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        self.stored[response["id"]] = (response, items)
        while len(self.stored) > MAX_STORED_RESPONSES:
            self.stored.popitem(last=False)

    def _history(self, previous_id: str | None) -> list[dict[str, Any]]:
        """The items of the conversation so far: the previous response's input and output."""
        if previous_id is None:
            return []
        if previous_id not in self.stored:
            raise RequestError(f"Previous response with id '{previous_id}' not found.")
        self.stored.move_to_end(previous_id)
        response, items = self.stored[previous_id]
        # A call cut by max_output_tokens has half its arguments: not a call to answer (its
        # arguments, not JSON, made the conversation impossible to continue: a 400).
        return items + [it for it in response["output"] if not _is_cut_call(it)]

    async def create(self, req: ResponsesRequest, request: Request | None) -> Response:
        history = self._history(req.previous_response_id)
        items = (
            [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
        )
        chat = to_chat_request(req, history, items)
        serving = self.openai
        lora = serving._lora_of(chat)
        model = serving._model_name(chat)
        obj = await chat_to_generate_off_loop(
            chat, self.tm, serving.chat_template, serving.sampling_defaults
        )
        obj.lora_path = lora
        parsing = serving._chat_parsing(chat, obj)
        response = self._response(req, model)
        gen = self.tm.generate_request(obj, None)
        context = history + [listed_item(it) for it in items]
        if not req.stream:
            out = await collect(gen, request)
            if out is None:
                raise ClientDisconnected
            builder = OutputBuilder(req.logprobs)
            self._feed(builder, parsing.new_choice(), out, 0)
            return json_response(self._finish(response, builder, out["meta_info"], context))
        first = await first_item(gen, request)
        builder = OutputBuilder(req.logprobs)
        events = self._stream(response, builder, parsing, first, gen, context)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)

    def _response(self, req: ResponsesRequest, model: str) -> ResponseObject:
        defaults = self.openai.sampling_defaults
        fmt = req.text.format if req.text is not None and req.text.format else None
        choice = req.tool_choice or "auto"
        return ResponseObject(
            id=_item_id("resp"),
            created_at=int(time.time()),
            status="in_progress",
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            max_tool_calls=req.max_tool_calls,
            model=model,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id,
            reasoning=req.reasoning.model_dump() if req.reasoning else {"effort": None},
            service_tier=req.service_tier,
            store=req.store,
            temperature=_first(req.temperature, defaults.get("temperature"), 1.0),
            text={
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt
                else {"type": "text"}
            },
            tool_choice=choice.model_dump() if isinstance(choice, BaseModel) else choice,
            tools=[t.model_dump() for t in req.tools or []],
            top_logprobs=req.top_logprobs,
            top_p=_first(req.top_p, defaults.get("top_p"), 1.0),
            user=req.user,
            metadata=req.metadata or {},
        )

    def _feed(self, builder: OutputBuilder, parser: Any, out: dict[str, Any], sent: int) -> int:
        """Feed the text and logprobs of `out` past what was fed (`sent` logprobs)."""
        meta = out["meta_info"]
        reason, _ = finish_reason(meta)
        delta, builder.fed = out["text"][len(builder.fed) :], out["text"]
        logprobs = []
        if meta.get("output_token_logprobs") is not None:
            logprobs = chat_logprobs(self.openai.tok, meta, sent).model_dump()["content"] or []
        builder.feed(parser.feed(delta, final=reason is not None), logprobs)
        return sent + len(logprobs)

    def _finish(
        self,
        response: ResponseObject,
        builder: OutputBuilder,
        meta: dict[str, Any],
        context: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """The response as it ends (status, output, usage), stored if asked."""
        reason, _ = finish_reason(meta)
        if reason == "length":
            response.status = "incomplete"
            response.incomplete_details = {"reason": "max_output_tokens"}
        elif reason in ("stop", None):
            response.status = "completed"
        else:  # abort
            response.status = "failed"
            response.error = {"code": "request_aborted", "message": "the request was aborted"}
        response.output = builder.finish("incomplete" if reason == "length" else "completed")
        prompt, completion = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
        reasoning = 0  # (re-encoded: its tokens; no BOS a tokenizer adds to a prompt)
        if builder.reasoning:
            reasoning = len(self.tm.tokenizer.encode(builder.reasoning, add_special_tokens=False))
        response.usage = ResponseUsage(
            input_tokens=prompt,
            input_tokens_details=InputTokensDetails(
                cached_tokens=min(prompt, meta.get("cached_tokens", 0))
            ),
            output_tokens=completion,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=min(reasoning, completion)),
            total_tokens=prompt + completion,
        )
        body = response.model_dump(mode="json")
        if response.store and response.status != "failed":
            self._store(body, context)
        return body

    async def _stream(
        self,
        response: ResponseObject,
        builder: OutputBuilder,
        parsing: ChatParsing,
        first: Any,
        gen: AsyncIterator[Any],
        context: list[dict[str, Any]],
    ) -> AsyncIterator[bytes]:
        """The SSE events of one response; an error after the start is an `error` event and
        a response.failed; the generator's close (the client left) aborts the request."""
        seq = iter(range(1 << 62))

        def event(data: dict[str, Any]) -> bytes:
            data = {**data, "sequence_number": next(seq)}
            return f"event: {data['type']}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"

        snapshot = response.model_dump(mode="json")
        yield event({"type": "response.created", "response": snapshot})
        yield event({"type": "response.in_progress", "response": snapshot})
        parser, sent, meta = parsing.new_choice(), 0, {}
        try:
            async for out in chain(first, gen):
                sent = self._feed(builder, parser, out, sent)
                meta = out["meta_info"]
                for e in builder.events:
                    yield event(e)
                builder.events.clear()
        except Exception as e:
            if not isinstance(e, RequestError):
                logger.exception("streaming a response failed")
            code = getattr(e, "status_code", 500)
            yield event({"type": "error", "code": str(code), "message": str(e), "param": None})
            response.status, response.error = "failed", {"code": str(code), "message": str(e)}
            response.output = builder.items
            yield event({"type": "response.failed", "response": response.model_dump(mode="json")})
            return
        finally:
            await gen.aclose()
        if finish_reason(meta)[0] is None:  # (ended without a finish: as an abort)
            meta = {**meta, "finish_reason": {"type": "abort"}}
        body = self._finish(response, builder, meta, context)
        for e in builder.events:
            yield event(e)
        kind = {"incomplete": "response.incomplete", "failed": "response.failed"}
        yield event({"type": kind.get(body["status"], "response.completed"), "response": body})


def listed_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item (checked by `to_chat_request`) as an item object, as stored and listed:
    with an id, a status and, for a message, content parts (still a valid input item)."""
    kind = item.get("type", "message")
    listed = {"id": _item_id(ITEM_ID_PREFIX[kind]), "type": kind, **item}
    if kind == "message" and isinstance(item["content"], str):
        assistant = item["role"] == "assistant"
        part = {"type": "output_text", "text": item["content"], "annotations": []}
        listed["content"] = [part if assistant else {"type": "input_text", "text": item["content"]}]
    if kind == "reasoning":
        listed.setdefault("summary", [])
    listed.setdefault("status", "completed")
    return listed


def _is_cut_call(item: dict[str, Any]) -> bool:
    return item.get("type") == "function_call" and item.get("status") == "incomplete"


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


# -- routes --------------------------------------------------------------------------------------
router = APIRouter()


def _serving(request: Request) -> ResponsesServing:
    state = request.app.state
    serving = getattr(state, "responses", None)
    if serving is None or serving.openai is not state.rs.openai:
        serving = state.responses = ResponsesServing(state.rs.openai)
    return serving


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    body = await parse_body(request, ResponsesRequest)
    return await _serving(request).create(body, request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> Response:
    return _stored(_serving(request).get, response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    return _stored(_serving(request).delete, response_id)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request) -> Response:
    return _stored(_serving(request).input_items, response_id, request.query_params)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    return _stored(_serving(request).cancel, response_id)


def _stored(call: Any, response_id: str, *args: Any) -> Response:
    try:
        return json_response(call(response_id, *args))
    except RequestError as e:  # (an unknown id: 404)
        return error_response(str(e), e.status_code)


def install_responses_api(app: FastAPI) -> None:
    """Serve the routes above, their request body in the OpenAPI document."""
    app.include_router(router)
    install_request_bodies(app, {"/v1/responses": ResponsesRequest})
