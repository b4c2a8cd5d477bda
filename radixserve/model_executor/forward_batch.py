"""ForwardMode and ForwardBatch: the model-facing view of one scheduler step.

The Scheduler builds a ScheduleBatch (requests, policies, memory); TpModelWorker turns it into
a ForwardBatch, which holds only tensors and the few CPU lists the attention backend needs.
Layout: tokens of all requests are packed back to back ("ragged"); request b owns tokens
[extend_start_loc[b], extend_start_loc[b] + extend_seq_lens[b]).

ModelWorkerBatch sits between the two: a snapshot of one step that the scheduler hands to the
worker. It copies everything the forward reads from shared state, including each request's
req_to_token row, so the overlap scheduler may rewrite rows (free, re-admit, dedup a prefix)
while the step runs (DESIGN §5, invariants 7 and 8). Input ids below zero are futures: the
next-token ids of the step before, resolved on the worker (FutureMap).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.layers.attention.base import AttentionBackend
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill (possibly on top of a cached prefix, possibly one chunk)
    DECODE = auto()  # one new token per request
    MIXED = auto()  # prefill requests plus decode requests in one forward
    IDLE = auto()  # nothing to run (kept so every TP rank runs the same steps)

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ModelWorkerBatch:
    forward_mode: ForwardMode
    input_ids: list[int]  # -k: the token step N-1 sampled into future slot k
    positions: list[int]
    req_pool_indices: list[int]
    seq_lens: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor  # [T] int64
    kv_rows: torch.Tensor  # [B, max(seq_lens)] int64: req_to_token rows copied at launch
    sampling_info: object | None = None  # SamplingBatchInfo; None while its sampling waits
    return_logprob: bool = False
    top_logprobs_num: int = 0
    rids: list[str] = field(default_factory=list)  # for error messages and the fake worker
    spec_info: object | None = None  # SpecVerifyInput of a speculative verify step
    # Prompt logprobs (extend steps): packed token indices whose logits are scored, the prompt
    # token each one predicts, and how many of them belong to each request of the batch.
    input_logprob_indices: list[int] | None = None
    input_logprob_targets: list[int] | None = None
    input_logprob_counts: list[int] | None = None
    lora_ids: list[str | None] | None = None  # each request's LoRA adapter (None: none use one)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    def to_forward_batch(self, device: str, input_ids: torch.Tensor | None = None) -> ForwardBatch:
        def tensor(values: list[int]) -> torch.Tensor:
            return int64_on(values, device)

        return ForwardBatch(
            forward_mode=self.forward_mode,
            batch_size=self.batch_size,
            input_ids=input_ids if input_ids is not None else tensor(self.input_ids),
            positions=tensor(self.positions),
            req_pool_indices=tensor(self.req_pool_indices),
            seq_lens=tensor(self.seq_lens),
            out_cache_loc=to_device(self.out_cache_loc, device),
            seq_lens_cpu=list(self.seq_lens),
            extend_prefix_lens_cpu=list(self.prefix_lens),
            extend_seq_lens_cpu=list(self.extend_lens),
            kv_rows=to_device(self.kv_rows, device),
            input_logprob_indices=(
                None if self.input_logprob_indices is None else tensor(self.input_logprob_indices)
            ),
            input_logprob_targets=(
                None if self.input_logprob_targets is None else tensor(self.input_logprob_targets)
            ),
            top_logprobs_num=self.top_logprobs_num,
            lora_ids=self.lora_ids,
        )


def to_device(t: torch.Tensor, device: str) -> torch.Tensor:
    """A host tensor on `device`. To a GPU through pinned memory, without waiting: a copy from
    pageable memory would block the calling thread until the stream's earlier work is done,
    so the overlap loop's forward thread could not queue a step behind the one running."""
    if device == "cpu" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def int64_on(values: list[int], device: str) -> torch.Tensor:
    """`values` as an int64 tensor on `device` (see to_device)."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, KV length after this step
    out_cache_loc: torch.Tensor  # [T] int64, slot of each new token
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]  # decode: seq_len - 1
    extend_seq_lens_cpu: list[int]  # decode: 1
    kv_rows: torch.Tensor  # [B, >= max seq len] KV slots: the req_to_token rows of the step
    req_to_token_pool: ReqToTokenPool | None = None
    token_to_kv_pool: MHATokenToKVPool | None = None
    attn_backend: AttentionBackend | None = None
    attn_metadata: object | None = None  # filled by the attention backend once per step
    input_logprob_indices: torch.Tensor | None = None  # [N] packed token indices
    input_logprob_targets: torch.Tensor | None = None  # [N] the prompt token each predicts
    top_logprobs_num: int = 0
    lora_ids: list[str | None] | None = None  # each request's LoRA adapter (None: none use one)
    lora: object | None = None  # the step's LoRABatch (lora/manager.py), set by the ModelRunner

    @property
    def uses_lora(self) -> bool:
        return bool(self.lora_ids) and any(self.lora_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def extend_start_loc_cpu(self) -> list[int]:
        starts, acc = [], 0
        for n in self.extend_seq_lens_cpu:
            starts.append(acc)
            acc += n
        return starts

    def last_token_indices(self) -> torch.Tensor:
        ends = torch.tensor(self.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.input_ids.device)
