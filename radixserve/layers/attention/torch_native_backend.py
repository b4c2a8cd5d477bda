"""Portable attention: gather each request's KV through req_to_token into a padded batch and
run one scaled_dot_product_attention call for the whole step.

Metadata (built once per step, shared by all layers): the KV slot matrix [B, L] (the step's
req_to_token rows, copied at launch), the padded query index [B, Q] into the packed tokens,
and the boolean mask [B, 1, Q, L], causal inside the extend part, open over the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.layers.attention.base import AttentionBackend, AttentionLayer
from radixserve.layers.attention.cascade_decode import (
    CascadePlan,
    build_cascade_plan,
    cascade_decode,
)
from radixserve.model_executor.forward_batch import ForwardBatch, int64_on


@dataclass
class TorchNativeMetadata:
    kv_index: torch.Tensor  # [B, L] KV slots (padding -> slot 0)
    q_index: torch.Tensor  # [B, Q] packed token index (padding -> T, a zero row)
    token_pos: torch.Tensor  # [T] index of each packed token inside the flattened [B*Q]
    mask: torch.Tensor  # [B, 1, Q, L] True = attend
    cascade: CascadePlan | None = None  # decode only: requests that share a cached prefix


class TorchNativeAttnBackend(AttentionBackend):
    name = "torch_native"

    def __init__(self, device: str) -> None:
        self.device = device

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        dev = fb.input_ids.device
        bs = fb.batch_size
        seq_lens = int64_on(fb.seq_lens_cpu, dev.type)
        prefix_lens = int64_on(fb.extend_prefix_lens_cpu, dev.type)
        ext_lens = int64_on(fb.extend_seq_lens_cpu, dev.type)
        max_kv = max(fb.seq_lens_cpu)
        max_q = max(fb.extend_seq_lens_cpu)
        kv_index = fb.kv_rows[:, :max_kv]  # the rows the scheduler copied at launch
        kv_pos = torch.arange(max_kv, device=dev)
        kv_index = torch.where(kv_pos[None, :] < seq_lens[:, None], kv_index, 0)

        q_pos = torch.arange(max_q, device=dev)
        starts = torch.cumsum(ext_lens, 0) - ext_lens
        q_valid = q_pos[None, :] < ext_lens[:, None]
        q_index = torch.where(q_valid, starts[:, None] + q_pos[None, :], fb.num_tokens)
        token_pos = (torch.arange(bs, device=dev)[:, None] * max_q + q_pos[None, :])[q_valid]

        # Query i of request b sits at absolute position prefix_len + i and sees keys <= it.
        abs_q = prefix_lens[:, None] + q_pos[None, :]
        mask = kv_pos[None, None, :] <= abs_q[:, :, None]
        mask = mask & (kv_pos[None, None, :] < seq_lens[:, None, None])
        mask[:, :, 0] |= ~q_valid  # padded query rows attend slot 0 so softmax stays finite
        cascade = build_cascade_plan(kv_index, seq_lens) if fb.forward_mode.is_decode() else None
        fb.attn_metadata = TorchNativeMetadata(
            kv_index, q_index, token_pos, mask.unsqueeze(1), cascade
        )

    def init_forward_metadata_graph(self, fb: ForwardBatch) -> None:
        """Decode metadata from the batch's device tensors alone (no host lists, no host sync),
        so a CUDA graph can capture it (model_executor/cuda_graph_runner.py): the KV width is
        fb.kv_rows's (the graph's KV-length bucket), each row masked by fb.seq_lens."""
        width = fb.kv_rows.shape[1]
        valid = torch.arange(width, device=fb.kv_rows.device)[None, :] < fb.seq_lens[:, None]
        kv_index = torch.where(valid, fb.kv_rows, 0)
        none = kv_index.new_empty(0)  # decode reads no query index
        fb.attn_metadata = TorchNativeMetadata(kv_index, none, none, valid[:, None, None, :])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        md: TorchNativeMetadata = fb.attn_metadata  # type: ignore[assignment]
        pool = fb.token_to_kv_pool
        assert pool is not None
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)

        if md.cascade is not None:
            return cascade_decode(q, k_buf, v_buf, md.cascade, layer)
        keys = k_buf[md.kv_index].to(q.dtype)  # [B, L, Hkv, D]
        values = v_buf[md.kv_index].to(q.dtype)
        if fb.forward_mode.is_decode():
            return self._decode(q, keys, values, layer, md.mask)
        q = q.view(-1, layer.num_heads, layer.head_dim)
        zero = q.new_zeros(1, layer.num_heads, layer.head_dim)
        q_padded = torch.cat([q, zero])[md.q_index].transpose(1, 2)  # [B, H, Q, D]
        out = F.scaled_dot_product_attention(
            q_padded,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=md.mask,
            scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        bs, _, max_q, _ = out.shape
        out = out.transpose(1, 2).reshape(bs * max_q, layer.num_heads * layer.head_dim)
        return out[md.token_pos]

    @staticmethod
    def _decode(
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        layer: AttentionLayer,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """One query per request as two batched matmuls: the CPU flash kernel is slow for
        q_len 1. Query heads are grouped under their KV head (GQA) so K/V are never repeated."""
        bs, hkv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        q = q.view(bs, hkv, layer.num_heads // hkv, d)  # [B, Hkv, G, D]
        scores = torch.matmul(q, keys.permute(0, 2, 3, 1)).float() * layer.scaling  # [B,Hkv,G,L]
        scores = scores.masked_fill(~mask, float("-inf"))  # mask: [B, 1, 1, L]
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values.transpose(1, 2))  # [B, Hkv, G, D]
        return out.reshape(bs, layer.num_heads * d)
