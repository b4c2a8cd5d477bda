"""A fake TokenizerManager (char-level tokenizer, canned replies) for fast HTTP/adapter tests.

It follows the real TokenizerManager's output contract: cumulative dicts with meta_info;
single non-stream → one dict; batch or n > 1 non-stream → one list; streaming batch → dicts
tagged with "index"; RequestError for an empty prompt.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from radixserve.args import ServerArgs
from radixserve.io_struct import FlushCacheReqOutput, GenerateReqInput, new_rid
from radixserve.managers.tokenizer_manager import RequestError

REPLY = "Hi!"
TOP_ALT = "x"


class FakeTokenizer:
    """One token per character; token id = code point."""

    chat_template = "fake"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tokenize: bool = False, **kwargs: Any
    ) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class FakeTokenizerManager:
    def __init__(self, reply: str = REPLY) -> None:
        self.tokenizer = FakeTokenizer()
        self.context_len = 256
        self.vocab_size = 0x3000
        self.reply = reply
        self.finish: dict[str, Any] | None = None  # how the reply ends (None: by length)
        self.requests: list[GenerateReqInput] = []
        self.template_calls: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []
        self.rid_to_state: dict[str, Any] = {}
        self.last_receive_time = 0.0
        self.started = False

    def start(self) -> None:
        self.started = True

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        self.template_calls.append((messages, kwargs))  # tools, chat_template, ... are not rendered
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))

    async def get_server_info(self) -> dict[str, Any]:
        return {"running": 0, "queued": 0, "token_usage": 0.0, "max_total_num_tokens": 100}

    async def flush_cache(self) -> FlushCacheReqOutput:
        return FlushCacheReqOutput(True)

    def _prompt_ids(self, single: GenerateReqInput) -> list[int]:
        if single.input_ids is not None:
            return list(single.input_ids)  # type: ignore[arg-type]
        return self.tokenizer.encode(single.text)  # type: ignore[arg-type]

    def _prompt_len(self, single: GenerateReqInput) -> int:
        return len(self._prompt_ids(single))

    def _output(self, single: GenerateReqInput, k: int, total: int) -> dict[str, Any]:
        ids = [ord(c) for c in self.reply[:k]]
        meta: dict[str, Any] = {
            "id": new_rid(),
            "prompt_tokens": self._prompt_len(single),
            "completion_tokens": k,
            "cached_tokens": 0,
            "finish_reason": (self.finish or {"type": "length", "length": k})
            if k == total
            else None,
            "e2e_latency": 0.01,
        }
        if single.return_logprob:
            meta["output_token_logprobs"] = [(-0.5, t) for t in ids]
            alt = (-1.5, ord(TOP_ALT))
            meta["output_top_logprobs"] = [[(-0.5, t), alt][: single.top_logprobs_num] for t in ids]
            prompt = self._prompt_ids(single)[max(single.logprob_start_len, 0) :]
            if single.logprob_start_len < 0:
                prompt = []
            meta["input_token_logprobs"] = [(-0.25, t, None) for t in prompt]
            meta["input_top_logprobs"] = [[(-0.25, t, None)] for t in prompt]
            if single.logprob_start_len == 0 and prompt:  # the first token has no logprob
                meta["input_token_logprobs"][0] = (None, prompt[0], None)
                meta["input_top_logprobs"][0] = None
        return {"text": self.reply[:k], "output_ids": ids, "meta_info": meta}

    async def generate_request(self, obj: GenerateReqInput, request: Any = None):
        self.requests.append(obj)
        sp = obj.sampling_params if isinstance(obj.sampling_params, dict) else {}
        n = sp.get("n", 1)
        singles = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
        if any(self._prompt_len(s) == 0 for s in singles):
            raise RequestError("the prompt is empty")
        total = min(sp.get("max_new_tokens") or len(self.reply), len(self.reply))
        runs = [s for s in singles for _ in range(n)]
        tagged = len(runs) > 1 or not obj.is_single
        if not obj.stream:
            await asyncio.sleep(0)
            outs = [self._output(s, total, total) for s in runs]
            yield outs if tagged else outs[0]
            return
        for k in range(1, total + 1):
            await asyncio.sleep(0)
            for index, s in enumerate(runs):
                out = self._output(s, k, total)
                yield {**out, "index": index} if tagged else out


@pytest.fixture
def fake_tm() -> FakeTokenizerManager:
    return FakeTokenizerManager()


@pytest.fixture
def make_client():
    """make_client(tm, **server_args): a TestClient around the real app with `tm` as its
    TokenizerManager (use it as a context manager so the app's lifespan runs)."""
    from fastapi.testclient import TestClient

    from radixserve.entrypoints.http_server import build_app

    def make(tm: Any, **args: Any) -> TestClient:
        args.setdefault("model_path", "/models/tiny-llama.gguf")
        return TestClient(build_app(ServerArgs(**args), lambda metrics: tm))

    return make
