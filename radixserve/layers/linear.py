"""Linear layers for the few-row products of decode and verify steps.

On CPU in fp32, `F.linear` with a handful of rows runs a GEMM that packs the whole weight per
call (and a single row takes a GEMV): for decode that doubles the bytes read from memory, which
is what bounds a decode step. Computing (W · xᵀ)ᵀ instead packs only the small activation (a
single row is doubled so it stays a GEMM). Measured on SmolLM2-135M's 30 layers of weights
(2 cores, AVX2, weights cold in cache, one call per weight): 40 ms instead of 56 at 1 row,
42 instead of 95 at 2, 97 instead of 141 at 32, 164 instead of 250 at 64; at 128 rows the two
are even, so only up to 64 rows go this way. The output head alone (49152 × 576): 9.7 ms
instead of 13.3 at 1 row, 15.8 instead of 31.9 at 8. Other devices and dtypes keep F.linear.

In bf16 on a CPU with native bf16 matmuls (AVX512-BF16 or AMX), `F.linear` goes to oneDNN,
which reorders the weight into its blocked layout on every call. `prepack_linears` does that
once, at start-up (what vLLM's and IPEX's CPU paths do): each Linear keeps oneDNN's blocked copy
(`packed`) and lets its plain weight go, and the products run `mkldnn::_linear_pointwise` on
it. SmolLM2-135M's shapes (2 cores, Zen 4): the output head 6.3 → 2.8 ms at 1 row, 8.7 → 6.1 at
32, 14.2 → 11.1 at 64; an MLP weight (3072 × 576) 0.62 → 0.38 ms at 32 rows; about 1.1× from
300 rows on.

Where radixserve's kernels are built with AVX512-BF16 (the cpu_paged fast path), the packed
copy is radixserve's own instead (`bf16_tiles`: tiles of 16 outputs, csrc/bf16_linear.cpp),
whose one kernel serves every row count, and a row's result does not depend on the batch.
Without AMX it runs on AVX512-BF16's dot products: on Zen 4, 1.35× oneDNN's rate at 1 row (it
reads a decode step's weights at ≈ 42 GB/s), 1.27× at 8, 1.13× at 32-64, even from 256 rows
on. With AMX the same tiles are the tile unit's weight operand, and weights whose K is a
multiple of 32 run there (others keep oneDNN's copy, which uses the tile unit too): on a
2-core Xeon with AMX, SmolLM2-135M's decode step 1.39× oneDNN's rate at 1 row (oneDNN spends
≈ 20 µs a call at few rows), 1.29× at 8, 1.11-1.19× at 32-64, its 256-token prefills 1.2×
("bf16 tiles on AMX" in docs/performance.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.args import cpu_has_amx, cpu_has_bf16
from radixserve.layers.cpu_kernels import cpu_kernels_available

SMALL_M_ROWS = 64


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of a bf16 CPU weight [N, K] where bf16 matmuls are native: radixserve's
    tiles where they apply (bf16_tiles), else oneDNN's blocked copy; else None (the weight
    stays as it is)."""
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.bfloat16
        or weight.dim() != 2
        or not cpu_has_bf16()
    ):
        return None
    tiles = bf16_tiles(weight)
    if tiles is not None:
        return tiles
    onednn = torch.backends.mkldnn.is_available() and hasattr(  # torch's own oneDNN ops
        torch.ops.mkldnn, "_reorder_linear_weight"
    )
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous()) if onednn else None


def bf16_tiles(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] bf16 as bf16_linear.cpp's tiles [N/16, K/2, 32] (tile t, pair p, lane
    2i + j: weight[16t + i, 2p + j]), where that kernel runs (bf16_tiles_supported), N a
    multiple of 16 and K even; on a CPU with AMX, K a multiple of 32 (the tile unit's step).
    Else None."""
    n, k = weight.shape
    if n % 16 or k % 2 or n == 0 or not bf16_tiles_supported():
        return None
    if cpu_has_amx() and k % 32:
        return None  # vdpbf16ps would run it: oneDNN's GEMM on the tile unit is faster
    return tile_layout(weight)


def tile_layout(weight: torch.Tensor) -> torch.Tensor:
    """The tiles' layout of weight [N, K] (N a multiple of 16, K even), wherever it runs."""
    n, k = weight.shape
    w = weight.detach().to(torch.bfloat16)
    return w.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(n // 16, k // 2, 32)


def bf16_tiles_supported() -> bool:
    """Whether bf16 weights take bf16_tiles' layout here: radixserve's kernels built with
    AVX512-BF16 (loaded already on the fast path, prepack_linears' caller), and on a CPU with
    AMX built with AMX too, the process granted the tile state."""
    if not (cpu_kernels_available() and torch.ops.radixserve.bf16_tiled_supported()):
        return False
    return not cpu_has_amx() or bool(torch.ops.radixserve.bf16_tiled_amx())


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias), with the few-row CPU fp32 case as (W · xᵀ)ᵀ; through the
    prepacked bf16 weight `packed` (prepack's) when there is one."""
    if packed is not None:  # a bf16 product (neither kernel takes another input dtype)
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        if packed.is_mkldnn:
            out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
        else:
            out = torch.ops.radixserve.bf16_tiled_linear(flat, packed, bias)
        return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if (
        x.device.type != "cpu"
        or weight.dtype != torch.float32
        or x.dtype != torch.float32
        or not 0 < rows <= SMALL_M_ROWS
    ):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = torch.cat([flat, flat])
    out = torch.mm(weight, flat.t()).t()[:rows]
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear whose forward is `linear` (same parameters, same state dict, until
    prepack_linears replaces the weight with its packed copy)."""

    packed: torch.Tensor | None = None  # prepack's copy of the weight, once prepack_linears ran

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu_and_mul(self(x)) for a [gate; up] projection in bf16 tiles, in one kernel
        (bitwise the same result, without the [M, 2I] product in memory); None where this
        layer has no tiles, has a bias, or its gate does not fill tiles of 16."""
        if (
            self.packed is None
            or self.packed.is_mkldnn
            or self.bias is not None
            or self.out_features % 32
        ):
            return None
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.radixserve.bf16_tiled_silu_mul(flat, self.packed)
        return y.view(*x.shape[:-1], self.out_features // 2).to(x.dtype)


def prepack_linears(model: nn.Module) -> int:
    """Prepack every Linear's weight of `model` (see the module's docstring) and release the
    plain weights, whose memory the packed copies take over; a tied output head (the
    embedding's weight, which the embedding still reads) gets a packed copy as the model's
    `packed_head`. Returns how many weights were packed (0 where prepack does not apply)."""
    count = 0
    for module in model.modules():
        if type(module) is not Linear or module.packed is not None:
            continue
        packed = prepack(module.weight)
        if packed is None:
            continue
        module.packed = packed
        # An empty weight of the same dtype: whatever still reads it fails loudly.
        module.weight = nn.Parameter(module.weight.new_empty(0, module.in_features), False)
        count += 1
    if hasattr(model, "packed_head") and model.lm_head is None and model.packed_head is None:
        model.packed_head = prepack(model.model.embed_tokens.weight)
        count += model.packed_head is not None
    return count


def packed_form(model: nn.Module) -> str:
    """Which packed copies prepack_linears gave `model`'s Linears, for the start-up log."""
    tiles = "bf16 tiles on AMX" if cpu_has_amx() else "bf16 tiles"
    forms = {
        "oneDNN's layout" if m.packed.is_mkldnn else tiles
        for m in model.modules()
        if type(m) is Linear and m.packed is not None
    }
    return " and ".join(sorted(forms)) or "none"
