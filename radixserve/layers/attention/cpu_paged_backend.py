"""Decode attention that reads the paged KV pool in place (C++ kernel), extend as torch-native.

`--attention-backend cpu_paged`. A decode step hands each layer's query, the pool's K/V buffers
and the step's req_to_token rows to `torch.ops.radixserve.decode_attention`
(csrc/decode_attention.cpp): every request's slots are visited in place, each slot's K and V
rows (all KV heads) read once, GQA query heads grouped under their KV head, long rows split
into segments across threads and merged by log-sum-exp. No padded copy of the context is made.
With bf16 queries and pool, head_dim 64 or 128 and a CPU with AVX512-BF16, the scores and the
probabilities-times-values product run on the bf16 dot-product instructions. "bf16 pool" here
and below includes an fp8 pool (`--kv-cache-dtype fp8_e5m2` / `fp8_e4m3`): the kernels widen
its bytes to bf16 (exactly) as they read them.

Requests that share a cached prefix (cascade): the shared slots are attended once per group,
with the group's queries stacked as extra query heads of one request, and merged with each
request's private suffix by their log-sum-exp, so the prefix is read once per group instead of
once per request. With bf16 queries and pool on a CPU with AVX512-BF16, one call of the
cascade kernel (csrc/extend_attention.cpp) attends every group's prefix, a group's queries
stacked as the rows of one tile, and merges the results into the suffixes' in place.

Extend and mixed steps are ragged, never padded to the longest request: rows that extend by
one token (a mixed step's decode rows, a one-token chunk) go through the same decode kernel;
every longer row gets one call over its own slots, causal from its cached prefix on. With bf16
queries and pool, head_dim 64 or 128 and a CPU with AVX512-BF16, that call is the extend kernel
(csrc/extend_attention.cpp: flash-attention tiles on the bf16 dot-product instructions, K/V
read through the row's slots, the causal mask computed, not stored); otherwise
scaled_dot_product_attention (plain causal, the flash path, when there is no prefix; a boolean
mask after one). A padded batch would cost every row the longest row's queries times the
longest row's keys.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from radixserve.layers.attention.base import AttentionLayer
from radixserve.layers.attention.cascade_decode import shared_prefix_groups
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixserve.layers.cpu_kernels import load_cpu_kernels
from radixserve.mem_cache.memory_pool import FP8_MAX, MHATokenToKVPool
from radixserve.model_executor.forward_batch import ForwardBatch

# KV pool dtypes the bf16 tile kernels read (fp8 widened to bf16 as it is packed).
_TILE_KV = (torch.bfloat16, *FP8_MAX)


@dataclass
class PagedDecodeMetadata:
    kv_rows: torch.Tensor  # [B, L] the step's req_to_token rows
    kv_start: torch.Tensor  # [B] first slot each request attends (after a shared prefix)
    kv_end: torch.Tensor  # [B] its sequence length
    # (member rows, shared prefix slots [1, Lp], the prefix's length [1]), built once per step
    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    group_members: torch.Tensor | None = None  # every group's member rows, in group order
    prefix_start: torch.Tensor | None = None  # [1] zero: a group attends its prefix from slot 0
    # The same groups for the bf16 cascade kernel: group g's members are
    # group_members[group_start[g] : group_start[g + 1]], its prefix prefix_rows[g, :len].
    group_start: torch.Tensor | None = None  # [NG + 1]
    prefix_rows: torch.Tensor | None = None  # [NG, longest prefix]
    prefix_lens: torch.Tensor | None = None  # [NG]


@dataclass
class ExtendSpan:
    """One request of an extend step with more than one new token."""

    q_start: int  # its first token in the step's packed tokens
    q_len: int
    slots: torch.Tensor  # [L] its KV slots, prefix and new tokens
    prefix: int  # cached tokens before the new ones

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """[q_len, L] causal from the prefix on (for SDPA); None: no prefix, plain causal."""
        if not self.prefix:
            return None
        q_pos = torch.arange(self.prefix, self.prefix + self.q_len)
        return torch.arange(self.prefix + self.q_len)[None, :] <= q_pos[:, None]


@dataclass
class PagedExtendMetadata:
    single: torch.Tensor  # packed index of each one-token row's query
    single_rows: torch.Tensor  # [n, L] those rows' slots
    single_end: torch.Tensor  # [n] their sequence lengths
    spans: list[ExtendSpan]


class CpuPagedAttnBackend(TorchNativeAttnBackend):
    name = "cpu_paged"
    uses_cpu_kernels = True

    def __init__(self, device: str) -> None:
        if device != "cpu":
            raise ValueError("--attention-backend cpu_paged runs on CPU only")
        super().__init__(device)
        load_cpu_kernels()
        self.kernel = torch.ops.radixserve.decode_attention
        # bf16 tile kernels, absent on CPUs without AVX512-BF16 (SDPA and the Python cascade then)
        self.extend_kernel = self.cascade_kernel = None
        if torch.ops.radixserve.extend_attention_supported():
            self.extend_kernel = torch.ops.radixserve.extend_attention
            self.cascade_kernel = torch.ops.radixserve.cascade_prefix_attention

    def tile_kernels_run_on(
        self, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int
    ) -> str | None:
        """Where a model of this dtype, KV pool dtype and head size attends prompts and shared
        prefixes through the bf16 tile kernels (for the start-up log), or None where they do
        not apply (SDPA and the Python cascade then)."""
        if not self._tiles_take(dtype, kv_dtype, head_dim):
            return None
        amx = torch.ops.radixserve.extend_attention_amx()
        return "AMX's tile unit" if amx else "AVX512-BF16's dot products"

    def _tiles_take(self, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the bf16 tile kernels take queries of `dtype` over a pool of `kv_dtype`."""
        return (
            self.extend_kernel is not None
            and dtype == torch.bfloat16
            and kv_dtype in _TILE_KV
            and head_dim in (64, 128)
        )

    def _bf16_tiles(self, q: torch.Tensor, k_buf: torch.Tensor, layer: AttentionLayer) -> bool:
        """Whether this layer's attention may take the bf16 tile kernels."""
        return self._tiles_take(q.dtype, k_buf.dtype, layer.head_dim)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if not fb.forward_mode.is_decode():
            fb.attn_metadata = self._extend_metadata(fb)
            return
        seq_lens = fb.seq_lens
        kv_rows = fb.kv_rows[:, : max(fb.seq_lens_cpu)].contiguous()
        found = None
        if fb.batch_size >= 2:  # it compares only slots below every member's length
            found = shared_prefix_groups(kv_rows, seq_lens)
        if found is None:
            fb.attn_metadata = PagedDecodeMetadata(
                kv_rows, torch.zeros_like(seq_lens), seq_lens, []
            )
            return
        groups = [
            (members, slots[None, :], seq_lens.new_full((1,), len(slots)))
            for members, slots in found[0]
        ]
        sizes = [len(g[0]) for g in groups]
        lens = [g[2] for g in groups]
        fb.attn_metadata = PagedDecodeMetadata(
            kv_rows,
            found[1],
            seq_lens,
            groups,
            torch.cat([g[0] for g in groups]).to(torch.int64),
            seq_lens.new_zeros(1),
            torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int64),
            torch.nn.utils.rnn.pad_sequence([g[1][0] for g in groups], batch_first=True).to(
                torch.int64
            ),
            torch.cat(lens).to(torch.int64),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        assert pool is not None
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        if type(pool) is MHATokenToKVPool:  # the C++ decode step's store: the pool's bytes
            torch.ops.radixserve.store_kv(k_buf, v_buf, fb.out_cache_loc, k, v)
        else:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        if not fb.forward_mode.is_decode():
            return self._extend(q, k_buf, v_buf, layer, fb.attn_metadata)  # type: ignore[arg-type]
        md: PagedDecodeMetadata = fb.attn_metadata  # type: ignore[assignment]
        bs, hkv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        grp = layer.num_heads // hkv
        q4 = q.reshape(bs, hkv, grp, d)
        out, lse = self.kernel(
            q4, k_buf, v_buf, md.kv_rows, md.kv_start, md.kv_end, layer.scaling, 0
        )
        if md.groups and self._bf16_tiles(q, k_buf, layer):  # merged into (out, lse) in place
            self.cascade_kernel(
                q4,
                k_buf,
                v_buf,
                md.group_members,
                md.group_start,
                md.prefix_rows,
                md.prefix_lens,
                out,
                lse,
                layer.scaling,
            )
        elif md.groups:  # each group's prefix once, merged with every member's suffix at once
            parts, part_lse = [], []
            for members, slots, length in md.groups:
                n = len(members)
                qg = q4[members].permute(1, 0, 2, 3).reshape(1, hkv, n * grp, d)
                op, lp = self.kernel(
                    qg, k_buf, v_buf, slots, md.prefix_start, length, layer.scaling, 0
                )
                parts.append(op.view(hkv, n, grp, d).transpose(0, 1))  # [n, Hkv, G, D]
                part_lse.append(lp.view(hkv, n, grp).transpose(0, 1))  # [n, Hkv, G]
            members = md.group_members
            op, lp = torch.cat(parts), torch.cat(part_lse)
            ls = lse[members]
            m = torch.maximum(ls, lp)
            ws, wp = torch.exp(ls - m), torch.exp(lp - m)
            out[members] = (out[members] * ws[..., None] + op * wp[..., None]) / (ws + wp)[
                ..., None
            ]
        return out.to(q.dtype).reshape(bs, layer.num_heads * d)

    @staticmethod
    def _extend_metadata(fb: ForwardBatch) -> PagedExtendMetadata:
        single, single_rows, spans = [], [], []
        start = 0
        for b, (n, seq, prefix) in enumerate(
            zip(fb.extend_seq_lens_cpu, fb.seq_lens_cpu, fb.extend_prefix_lens_cpu, strict=True)
        ):
            if n == 1:
                single.append(start)
                single_rows.append(b)
            elif n > 1:
                spans.append(ExtendSpan(start, n, fb.kv_rows[b, :seq], prefix))
            start += n
        ends = [fb.seq_lens_cpu[b] for b in single_rows]
        rows = fb.kv_rows[single_rows, : max(ends, default=0)].contiguous()
        return PagedExtendMetadata(
            torch.tensor(single, dtype=torch.int64), rows, torch.tensor(ends), spans
        )

    def _extend(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        layer: AttentionLayer,
        md: PagedExtendMetadata,
    ) -> torch.Tensor:
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        q3 = q.view(-1, hq, d)
        out = torch.empty_like(q3)
        n = len(md.single)
        if n:
            q4 = q3[md.single].view(n, hkv, hq // hkv, d)
            zero = torch.zeros_like(md.single_end)
            o, _ = self.kernel(
                q4, k_buf, v_buf, md.single_rows, zero, md.single_end, layer.scaling, 0
            )
            out[md.single] = o.to(q.dtype).view(n, hq, d)
        fast = self._bf16_tiles(q, k_buf, layer)
        for sp in md.spans:
            if fast:
                qs = q3[sp.q_start : sp.q_start + sp.q_len].contiguous()
                out[sp.q_start : sp.q_start + sp.q_len] = self.extend_kernel(
                    qs, k_buf, v_buf, sp.slots, layer.scaling
                )
                continue
            # 4-D inputs: with three, CPU SDPA takes its slow math path
            keys = k_buf[sp.slots].to(q.dtype).transpose(0, 1)[None]  # [1, Hkv, L, D]
            values = v_buf[sp.slots].to(q.dtype).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                q3[sp.q_start : sp.q_start + sp.q_len].transpose(0, 1)[None],  # [1, H, n, D]
                keys,
                values,
                attn_mask=sp.mask,
                is_causal=sp.mask is None,
                scale=layer.scaling,
                enable_gqa=hq != hkv,
            )
            out[sp.q_start : sp.q_start + sp.q_len] = o[0].transpose(0, 1)
        return out.view(-1, hq * d)
