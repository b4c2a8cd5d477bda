"""The attention-backend interface every backend (torch-native now, faster CPU/GPU later) implements.

Contract: `init_forward_metadata` runs once per step and precomputes whatever indices the
backend needs from the ForwardBatch; `forward` is called by each layer with the new tokens'
q, k, v. It writes k and v into the KV pool at `forward_batch.out_cache_loc`, then attends
every query token to its request's KV (read through req_to_token): causal inside the extend
part, full over the cached prefix. It returns [T, num_heads * head_dim].
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from radixserve.model_executor.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionLayer:
    """What an attention backend needs to know about the calling layer."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


class AttentionBackend(ABC):
    name = ""  # its --attention-backend value
    # Whether the model's element-wise steps run radixserve's C++ kernels with this backend
    # (layers/fused_ops.py): the CPU fast path.
    uses_cpu_kernels = False

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor: ...
