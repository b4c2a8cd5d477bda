"""ForwardMode and ForwardBatch: the model-facing view of one scheduler step.

The Scheduler builds a ScheduleBatch (requests, policies, memory); TpModelWorker turns it into
a ForwardBatch, which holds only tensors and the few CPU lists the attention backend needs.
Layout: tokens of all requests are packed back to back ("ragged"); request b owns tokens
[extend_start_loc[b], extend_start_loc[b] + extend_seq_lens[b]).
"""

from __future__ import annotations

from dataclasses import dataclass
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
    req_to_token_pool: ReqToTokenPool | None = None
    token_to_kv_pool: MHATokenToKVPool | None = None
    attn_backend: AttentionBackend | None = None
    attn_metadata: object | None = None  # filled by the attention backend once per step

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
