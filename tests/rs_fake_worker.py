"""A fake TpModelWorker for scheduler tests: no model, but a "KV pool" that stores the token id
and the position written at each slot. Every step checks that the req_to_token rows it was
given point, position by position, at written slots (prefix cache hits included), and the next
token is a fixed function of the whole sequence read back from those slots: a row pointing at
a wrong slot changes that request's output, which the tests compare with `expected_output`.
It works as the real worker does, from the step's snapshot (ModelWorkerBatch) only, so the
overlap loop can run it on its forward thread with future input ids."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.layers.sampler import Sampler
from radixserve.managers.tp_worker import TpModelWorker
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.model_executor.forward_batch import ModelWorkerBatch

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
        self.kv_pos = torch.full((total_tokens + page_size,), -1, dtype=torch.int64)
        self.sampler = Sampler()

    def sample(self, logits, info, return_logprob=False, top_logprobs_num=0):
        return self.sampler(logits, info, return_logprob, top_logprobs_num)


class FakeWorker(TpModelWorker):
    def __init__(
        self,
        total_tokens: int = 4096,
        max_running: int = 16,
        context_len: int = 2048,
        page_size: int = 1,
    ) -> None:
        self.model_runner = FakeModelRunner(total_tokens, max_running, context_len, page_size)
        self.device = "cpu"
        self.vocab_size = VOCAB
        self.steps = 0

    def forward(self, mwb: ModelWorkerBatch, input_ids: torch.Tensor | None = None):
        """Logits [B, VOCAB] whose argmax is next_token(the row's sequence)."""
        mr = self.model_runner
        ids = input_ids if input_ids is not None else torch.tensor(mwb.input_ids)
        assert bool((ids >= 0).all()), "an unresolved future input id"
        loc = mwb.out_cache_loc
        assert len(loc) == len(ids)
        assert len(torch.unique(loc)) == len(loc), "two new tokens share a slot"
        mr.kv[loc] = ids
        mr.kv_pos[loc] = torch.tensor(mwb.positions, dtype=torch.int64)
        logits = torch.zeros(mwb.batch_size, VOCAB)
        for b, seq_len in enumerate(mwb.seq_lens):
            slots = mwb.kv_rows[b, :seq_len]
            pos = mr.kv_pos[slots].tolist()
            assert pos == list(range(seq_len)), (
                f"{mwb.rids[b]}: its row points at slots of positions {pos[:8]}..."
            )
            # Ignored for intermediate chunks; otherwise seq_len covers prompt + outputs.
            logits[b, next_token(mr.kv[slots].tolist())] = 1.0
        self.steps += 1
        return logits

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
