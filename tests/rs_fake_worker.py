"""A fake TpModelWorker for scheduler tests: no model, but a "KV pool" that stores the token id
written at each slot, so every step can check that each request's req_to_token row points at
slots holding exactly its tokens (prefix cache hits included). The next token is a fixed
function of the whole sequence, so outputs do not depend on batching or caching."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.managers.tp_worker import GenerationBatchResult
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

VOCAB = 97
EOS = 2


def next_token(seq: list[int]) -> int:
    h = 0
    for t in seq:
        h = (h * 31 + t) % 1_000_003
    return 3 + h % (VOCAB - 3)


@dataclass
class FakeConfig:
    vocab_size: int = VOCAB
    eos_token_ids: tuple[int, ...] = (EOS,)


class FakeModelRunner:
    def __init__(
        self, total_tokens: int, max_running: int, context_len: int, page_size: int
    ) -> None:
        self.device = "cpu"
        self.model_config = FakeConfig()
        self.max_total_num_tokens = total_tokens
        self.max_running_requests = max_running
        self.context_len = context_len
        self.req_to_token_pool = ReqToTokenPool(max_running, context_len + 8)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(total_tokens, page_size)
        self.kv = torch.full((total_tokens + page_size,), -1, dtype=torch.int64)


class FakeWorker:
    def __init__(
        self,
        total_tokens: int = 4096,
        max_running: int = 16,
        context_len: int = 2048,
        page_size: int = 1,
    ) -> None:
        self.model_runner = FakeModelRunner(total_tokens, max_running, context_len, page_size)
        self.steps = 0

    def forward_batch_generation(self, batch) -> GenerationBatchResult:
        mr = self.model_runner
        loc = batch.out_cache_loc
        assert len(loc) == len(batch.input_ids)
        assert len(torch.unique(loc)) == len(loc), "two new tokens share a slot"
        mr.kv[loc] = torch.tensor(batch.input_ids, dtype=torch.int64)
        table = mr.req_to_token_pool.req_to_token
        out = []
        for r, seq_len in zip(batch.reqs, batch.seq_lens, strict=True):
            seq = (r.origin_input_ids + r.output_ids)[:seq_len]
            slots = table[r.req_pool_idx, :seq_len].long()
            got = mr.kv[slots].tolist()
            assert got == seq, f"{r.rid}: KV slots hold {got[:8]}... expected {seq[:8]}..."
            # Ignored for intermediate chunks; otherwise seq_len covers prompt + outputs.
            out.append(next_token(r.origin_input_ids + r.output_ids))
        self.steps += 1
        return GenerationBatchResult(out)

    def get_memory_info(self) -> dict:
        mr = self.model_runner
        return {
            "max_total_num_tokens": mr.max_total_num_tokens,
            "max_running_requests": mr.max_running_requests,
            "context_len": mr.context_len,
            "vocab_size": VOCAB,
        }


def expected_output(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    out = []
    for _ in range(n):
        t = next_token(seq)
        out.append(t)
        seq.append(t)
    return out
