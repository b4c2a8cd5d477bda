"""OpenAI ↔ radixserve adapters: an OpenAI request becomes one `GenerateReqInput`, and the
TokenizerManager's output dicts become OpenAI choices, logprobs and usage.

Pure functions (no I/O), used by `openai_serving`. Defaults follow OpenAI: completions generate
at most 16 tokens unless `max_tokens` says otherwise (set in `openai_protocol`); chat completions
generate up to the context window. `n > 1` and prompt lists become choices in prompt-major order
(choice index = prompt index × n + sample index). `echo` with `logprobs` asks for the prompt's
logprobs too (logprob_start_len 0): the echoed prompt's tokens come first, the first one with
a null logprob, as in OpenAI's legacy API.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from radixserve.args import ServerArgs
from radixserve.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    ChatContentPart,
    CompletionRequest,
    SamplingFields,
)
from radixserve.entrypoints.openai_responses import (
    ChoiceLogprobs,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from radixserve.entrypoints.openai_tools import history_tool_calls, template_tools, tool_call_schema
from radixserve.io_struct import GenerateReqInput
from radixserve.managers.tokenizer_manager import ENCODE_ON_LOOP_CHARS, RequestError
from radixserve.managers.tokenizer_utils import TokenStrings
from radixserve.parser.reasoning_parser import ReasoningParser

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Enough of the prompt's last tokens to hold `<think>` and the whitespace after it, however the
# tokenizer splits them.
PROMPT_TAIL_TOKENS = 16
# Parameters of transformers' apply_chat_template (not template variables).
RESERVED_TEMPLATE_KWARGS = frozenset(
    "conversation tools documents chat_template add_generation_prompt continue_final_message "
    "tokenize sanitize_control_tokens padding truncation max_length return_tensors return_dict "
    "return_assistant_tokens_mask tokenizer_kwargs messages self".split()
)


# -- model names ---------------------------------------------------------------------------------
def resolved_model_path(args: ServerArgs) -> str:
    if args.model_path:
        return args.model_path
    from radixserve.model_loader.default_model import DEFAULT_MODEL_FILE, default_cache_dir

    return os.path.join(default_cache_dir(), DEFAULT_MODEL_FILE)


def served_model_name(args: ServerArgs) -> str:
    """--served-model-name, else the model's basename (a file's without its extension)."""
    if args.served_model_name:
        return args.served_model_name
    if not args.model_path:
        return DEFAULT_SERVED_MODEL_NAME
    base = os.path.basename(os.path.normpath(args.model_path))
    if os.path.isfile(args.model_path) or base.endswith(".gguf"):
        base = os.path.splitext(base)[0]
    return base


def model_aliases(args: ServerArgs) -> set[str]:
    """Names a request may use for the model: served name, model path, its basename and stem."""
    path = resolved_model_path(args)
    base = os.path.basename(os.path.normpath(path))
    names = {served_model_name(args), path, base, os.path.splitext(base)[0]}
    if args.model_path:
        names.add(args.model_path)
    return names


def adapter_name_shadows_the_model(name: str, aliases: set[str]) -> bool:
    """Whether a LoRA adapter named `name` would take over a name requests use for the model
    (an alias itself) or for another adapter (`<alias>:<adapter>`, see check_model)."""
    return name in aliases or any(name[:i] in aliases for i, c in enumerate(name) if c == ":")


# -- request → GenerateReqInput ------------------------------------------------------------------
def sampling_params(
    req: SamplingFields, max_new_tokens: int | None, defaults: dict[str, Any] | None = None
) -> dict[str, Any]:
    """OpenAI field names → SGLang sampling params; unset optional fields take `defaults` (the
    model's, --sampling-defaults model) or else keep SGLang's."""
    sp: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": req.min_tokens,
        "n": req.n,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "no_stop_trim": req.no_stop_trim,
    }
    optional = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "seed": req.seed,
        "logit_bias": req.logit_bias,
        "json_schema": json_schema_of(req),
        "regex": req.regex,
        "ebnf": req.ebnf,
    }
    for name, value in (defaults or {}).items():
        if optional.get(name) is None:
            optional[name] = value
    sp.update({k: v for k, v in optional.items() if v is not None})
    return sp


def json_schema_of(req: SamplingFields) -> str | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return req.json_schema
    if req.json_schema is not None:
        raise RequestError("set either response_format or json_schema, not both")
    if fmt.type == "json_object":
        return JSON_OBJECT_SCHEMA
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise RequestError("response_format.json_schema.schema is required")
    return json.dumps(fmt.json_schema.schema_)


def _rid(req: SamplingFields, prompts: int | None) -> str | list[str] | None:
    """The client's rid (`/abort_request` finds the request by it, n > 1 choices and a batch's
    prompts too: SGLang's): one for a single prompt (`prompts` None), one rid or one per
    prompt for a batch."""
    rid = req.rid
    if isinstance(rid, list) and (prompts is None or len(rid) != prompts):
        n = 1 if prompts is None else prompts
        raise RequestError(f"rid is a list of {len(rid)} for {n} prompt(s)")
    return rid


@dataclass
class Prompts:
    """A completions prompt as a batch: texts, or token-id lists."""

    texts: list[str] | None
    ids: list[list[int]] | None

    def __len__(self) -> int:
        return len(self.texts or self.ids or [])


def normalize_prompt(prompt: Any) -> tuple[Prompts, bool]:
    """Return (the prompts as a batch, whether the user sent a single prompt)."""
    if isinstance(prompt, str):
        prompt = [prompt]
        single = True
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
        single = True
    else:
        single = False
    if not prompt or any(len(p) == 0 for p in prompt):
        raise RequestError("the prompt must not be empty")
    if isinstance(prompt[0], str):
        return Prompts(texts=list(prompt), ids=None), single
    return Prompts(texts=None, ids=[list(p) for p in prompt]), single


def completion_to_generate(
    req: CompletionRequest, defaults: dict[str, Any] | None = None
) -> GenerateReqInput:
    prompts, single = normalize_prompt(req.prompt)
    if prompts.texts is not None:
        text: Any = prompts.texts[0] if single else prompts.texts
        ids: Any = None
    else:
        text, ids = None, (prompts.ids[0] if single else prompts.ids)  # type: ignore[index]
    return GenerateReqInput(
        text=text,
        input_ids=ids,
        sampling_params=sampling_params(req, req.max_tokens, defaults),
        rid=_rid(req, None if single else len(prompts)),
        stream=req.stream,
        return_logprob=req.logprobs is not None,
        top_logprobs_num=req.logprobs or 0,
        logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
        **routing_fields(req),
    )


def routing_fields(req: Any) -> dict[str, Any]:
    """What SGLang's router adds (see RoutingFields): the P/D pairing, the --dp-aware rank;
    and the request's priority."""
    return {
        "priority": req.priority,
        "bootstrap_host": req.bootstrap_host,
        "bootstrap_port": req.bootstrap_port,
        "bootstrap_room": req.bootstrap_room,
        "data_parallel_rank": req.data_parallel_rank,
    }


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text content only, developer → system;
    an assistant's tool_calls (arguments as dicts), a tool result's tool_call_id and an
    assistant's reasoning_content are passed on."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            content = "\n".join(
                _text_of(p, f"messages.{i}.content.{k}", m.role) for k, p in enumerate(content)
            )
        msg: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": content or "",
        }
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise RequestError(f"messages.{i}: only an assistant message has tool_calls")
            msg["tool_calls"] = history_tool_calls(m.tool_calls, f"messages.{i}")
        if m.role == "tool":
            if not m.tool_call_id:
                raise RequestError(f"messages.{i}: a tool message needs its tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        messages.append(msg)
    return messages


def _text_of(part: ChatContentPart, where: str, role: str) -> str:
    refusal = (part.model_extra or {}).get("refusal")
    if part.type == "refusal" and role == "assistant" and isinstance(refusal, str):
        return refusal  # what the model said (vLLM renders it as text too)
    if part.type != "text":
        raise RequestError(f"{where}: unsupported content part type {part.type!r}; only text")
    if part.text is None:
        raise RequestError(f"{where}.text is required (a string)")
    # (cache_control: Anthropic's prompt-caching mark, which LiteLLM passes on; the prefix
    # cache here needs none)
    extra = [k for k in part.model_extra or {} if k != "cache_control"]
    if extra:
        raise RequestError(f"unsupported field(s) in a text part: {', '.join(extra)}")
    return part.text


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """chat_template_kwargs are variables of the template (enable_thinking, ...); the names of
    apply_chat_template's own parameters would change how it runs, not what it renders."""
    kwargs = req.chat_template_kwargs or {}
    reserved = sorted(kwargs.keys() & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    if req.reasoning_effort is not None:
        kwargs = {"reasoning_effort": req.reasoning_effort, **kwargs}
    return kwargs


async def chat_to_generate_off_loop(
    req: ChatCompletionRequest,
    tokenizer_manager: Any,
    chat_template: str | None = None,
    defaults: dict[str, Any] | None = None,
) -> GenerateReqInput:
    """chat_to_generate, on a worker thread for a long conversation as for a long prompt
    (ENCODE_ON_LOOP_CHARS): its template and tokens held the serving loop, and every other
    request and stream with it (a 2.4 MB message: 1.5 s)."""
    args = (req, tokenizer_manager, chat_template, defaults)
    if _chat_chars(req) <= ENCODE_ON_LOOP_CHARS:
        return chat_to_generate(*args)
    return await asyncio.to_thread(chat_to_generate, *args)


def _chat_chars(req: ChatCompletionRequest) -> int:
    def chars(content: Any) -> int:
        if isinstance(content, str):
            return len(content)
        return sum(len(part.text or "") for part in content or ())

    return sum(chars(m.content) + len(m.reasoning_content or "") for m in req.messages)


def chat_to_generate(
    req: ChatCompletionRequest,
    tokenizer_manager: Any,
    chat_template: str | None = None,
    defaults: dict[str, Any] | None = None,
) -> GenerateReqInput:
    """`chat_template` (--chat-template's text) replaces the tokenizer's; tools reach the
    template, and tool_choice required / named becomes the output's JSON schema; `defaults`:
    the sampling fields the request leaves unset."""
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs requires logprobs to be true")
    kwargs = dict(template_kwargs(req))
    tools = template_tools(req)
    if tools is not None:
        kwargs["tools"] = tools
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if req.continue_final_message:  # (SGLang's and vLLM's field; transformers renders it)
        if req.messages[-1].role != "assistant":
            raise RequestError("continue_final_message needs the last message to be an assistant's")
        kwargs.update(add_generation_prompt=False, continue_final_message=True)
    elif not req.add_generation_prompt:
        kwargs["add_generation_prompt"] = False
    input_ids = tokenizer_manager.apply_chat_template(chat_messages(req), **kwargs)
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, max_new, defaults)
    if tools is not None:
        # A call's marker may be a special token (Llama 3's <|python_tag|>, Llama 4's
        # <|python_start|>): skipped, the parser never saw the call (SGLang's rule too).
        params["skip_special_tokens"] = False
    schema = tool_call_schema(req)
    if schema is not None:
        params["json_schema"] = schema
    return GenerateReqInput(
        input_ids=input_ids,
        sampling_params=params,
        rid=_rid(req, None),
        stream=req.stream,
        return_logprob=req.logprobs,
        top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else 0,
        **routing_fields(req),
    )


def prompt_opens_reasoning(tokenizer_manager: Any, input_ids: list[int]) -> bool:
    """Whether a rendered chat prompt ends inside a `<think>` it opened (the generation prompt of
    Qwen3-Thinking-2507's and QwQ's templates, `<|im_start|>assistant\n<think>\n`): the output
    then starts inside the reasoning, whatever the reasoning parser expects (SGLang detects
    such templates too). Read from the prompt, not the template's source, so a template that
    opens it only for some requests (enable_thinking) is read right for each."""
    tail = input_ids[-PROMPT_TAIL_TOKENS:]
    text = tokenizer_manager.tokenizer.decode(tail, skip_special_tokens=False)
    return text.rstrip().endswith(ReasoningParser.START)


# -- output dicts → OpenAI shapes ---------------------------------------------------------------------
def finish_reason(meta: dict[str, Any]) -> tuple[str | None, Any]:
    """(OpenAI finish_reason, matched stop) from meta_info; stop/length/abort keep their names."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None, None
    return reason.get("type"), reason.get("matched")


def make_usage(metas: list[dict[str, Any]], n: int) -> UsageInfo:
    """Prompt and cached tokens count once per prompt (its n samples share it; cached is the
    best hit among them, so never above the prompt); completion tokens count per choice."""
    prompt = cached = 0
    for start in range(0, len(metas), n):
        group = metas[start : start + n]
        group_prompt = group[0].get("prompt_tokens", 0)
        prompt += group_prompt
        cached += min(group_prompt, max(m.get("cached_tokens", 0) for m in group))
    completion = sum(m.get("completion_tokens", 0) for m in metas)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def completion_logprobs(
    tok: TokenStrings, meta: dict[str, Any], start: int, offset: int, echo: bool = False
) -> CompletionLogprobs:
    """Legacy logprobs of output tokens [start:], after the prompt's tokens when `echo`;
    text_offset continues from `offset`, the characters of this choice already sent."""
    out = CompletionLogprobs()
    entries: list[tuple[Any, Any]] = []  # ((logprob, token id, text), top triples or None)
    if echo:
        prompt_tops = meta.get("input_top_logprobs") or []
        for k, triple in enumerate(meta.get("input_token_logprobs") or []):
            entries.append((triple, prompt_tops[k] if k < len(prompt_tops) else None))
    # An echoed prompt's first token starts the text: decoded alone, as the echo is (a
    # SentencePiece decoder strips the text's leading space).
    first_alone = bool(entries)
    pairs = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    entries += [(pairs[k], tops[k] if k < len(tops) else None) for k in range(start, len(pairs))]
    for k, ((lp, tid, *_), top) in enumerate(entries):
        s = tok.alone(tid) if k == 0 and first_alone else tok(tid)
        out.tokens.append(s)
        out.token_logprobs.append(_finite(lp))
        out.top_logprobs.append(_top_by_text(tok, top) if top else None)
        out.text_offset.append(offset)
        offset += len(s)
    return out


def _top_by_text(tok: TokenStrings, top: list[Any]) -> dict[str, float | None]:
    """The legacy top_logprobs map, keyed by token text: where tokens share a text (partial
    UTF-8 characters all read "\ufffd"), the most likely one's logprob (the list is sorted)."""
    out: dict[str, float | None] = {}
    for v, t, *_ in top:
        out.setdefault(tok(t), _finite(v))
    return out


def _finite(lp: float | None) -> float | None:
    """A logprob as OpenAI reports it: a token the grammar forbids (-inf) as -9999.0."""
    return -9999.0 if lp is not None and not math.isfinite(lp) else lp


def chat_logprobs(tok: TokenStrings, meta: dict[str, Any], start: int) -> ChoiceLogprobs:
    def entry(lp: float, tid: int) -> TopLogprob:
        return TopLogprob(token=tok(tid), logprob=_finite(lp), bytes=tok.token_bytes(tid))

    content = []
    pairs = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    for k in range(start, len(pairs)):
        e = entry(*pairs[k][:2])  # (logprob, token id, text)
        top = [entry(v, t) for v, t, *_ in (tops[k] if k < len(tops) else None) or []]
        content.append(TokenLogprob(**e.model_dump(), top_logprobs=top))
    return ChoiceLogprobs(content=content)


def num_logprobs(meta: dict[str, Any]) -> int:
    return len(meta.get("output_token_logprobs") or [])
