"""Quantized linear layers for the CPU paths (`--quantization`): weight-only int8 / int4, and
W8A8 int8.

A batch-1 decode step on a CPU reads every weight once, so its time is mostly the weights'
bytes: SmolLM2-135M is 540 MB in fp32, 270 MB in bf16, ≈ 140 MB in int8 and ≈ 66-80 MB in
int4 (its group scales and minimums in fp16 or fp32). The layers here keep their weights packed:

- int8: GGUF's Q8_0 form, groups of `INT4_GROUP_SIZE` (32) input columns with one symmetric
  scale each. On a CPU with AVX-512 VNNI the codes are stored in tiles of 16 outputs
  (`pack_q8_tiles`) and `q8_tiled_linear` multiplies them at every row count by the
  activations quantized to int8 per group of 32, as the int4 kernels quantize them
  (llama.cpp's Q8_0 x Q8_0 product): each group's 32 products one exact integer sum, one
  function for a request alone and in any batch; on SmolLM2-135M's layers (2 Zen 4 cores)
  1.3x q8_linear at one row and 1.9x q8_dense from 64 rows, for +0.6% perplexity against
  +0.2% with float activations (docs/performance.md). Elsewhere, below `dense_rows()` rows,
  radixserve's kernel (csrc/quant_linear.cpp) widens each group's codes to floats once and
  multiplies them into every row (the activations stay fp32; 1.5x ATen's int8 kernel on the
  output head at one row, AVX2); from there on, `q8_dense` dequantizes the weight block by
  block into a dense GEMM.
  Where the C++ kernels cannot be built, or K is not a multiple of 32, one scale per output
  channel and ATen's `_weight_int8pack_mm` with bf16 activations (its fast path; fp32
  activations take a scalar path, 5-7x slower on an AVX2 CPU) take over.
- int4: groups of `INT4_GROUP_SIZE` input columns with a scale and a minimum per group
  (a weight is code * scale + minimum, code in [0, 15]: GGUF's Q4_1 form). Below
  `dense_rows()` rows, radixserve's own kernel (csrc/quant_linear.cpp) multiplies the 4-bit
  codes by the activations quantized to int8 per group of 32, in integers, as llama.cpp
  does (2x ATen's int4 kernel at batch 1 on AVX2). From `dense_rows()` rows `q4_dense`
  rounds the activations to the same int8 grid and multiplies them by the weight,
  dequantized block by block into a dense GEMM (in fp32; a bf16 model on a CPU with native
  bf16 matmuls runs this GEMM in bf16). On a CPU with AVX-512 VNNI neither runs: the codes are
  stored in tiles of 16 outputs (`pack_q4_tiles`, the same bytes reordered, with the scales
  and minimums in fp16 as GGUF keeps them: `quantize_int4` makes them fp16 values) and
  `q4_tiled_linear` computes the q4 kernel's function at every row count, in integers, as a
  register-blocked GEMM (llama.cpp's repacked-Q4 layout): one function for a request alone
  and in any batch, and on SmolLM2-135M's layers (2 Zen 4 cores) as fast as q4_linear at one
  row and as bf16's prepacked GEMM from 64 rows, where q4_dense took twice that. Where
  the C++ kernels cannot be built, ATen's `_weight_int4pack_mm_for_cpu` (bf16 activations)
  takes over.
  The kernels' group scales cost a float multiply-add per 32 products, the dense GEMM none,
  so the GEMM wins from a few rows on, even with its weight dequantized on every call: from
  `DENSE_ROWS_BF16` (12) rows when it runs in bf16 (a SmolLM2-135M decode step on 2 Zen 4
  cores, `bench one-batch`: the kernels ≈ 3 ms a row, from 11-16 ms at 4 rows; the dense
  path ≈ 25-30 ms at 4-12 rows, ≈ 50 at 32, against the kernels' 75-117), from
  `DENSE_ROWS` (64) in fp32, whose GEMM runs at a third of bf16's rate.

- w8a8_int8 (SGLang's method of that name): int8 weights with a symmetric scale per output
  channel, and the activations quantized per row (token) to int8 on the fly, so the product
  runs in integers (csrc/w8a8_linear.cpp, around ATen's `_int_mm`): from a few dozen rows on
  the GEMMs are bound by arithmetic, where int8 runs at twice bf16's rate (AVX-512 VNNI),
  1.5x bf16's prepacked GEMM over whole layers at 64 to 1,024 rows on two Zen 4 cores. It is
  one function at every row count (decode, prefill, the C++ decode step). The output head
  stays unquantized, as in SGLang. It needs the C++ kernels. Per-token rounding suffers from
  a few input channels far larger than the rest (the RMSNorms' outputs have them), so before
  quantizing, `smooth_model` moves part of those channels' range from the activations into
  the weights (SmoothQuant, Xiao et al. 2023), from activation ranges measured on a short
  calibration text (ModelRunner does this at start-up).

GGUF Q4_0 and Q4_1 blocks are int4 groups of 32 of exactly this form (Q4_1: q * d + m; Q4_0:
(q - 8) * d, minimum -8d). The GGUF loader hands their (d, m) per block to `quantize_model`,
which then recovers the file's own codes instead of choosing new ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.args import cpu_has_bf16
from radixserve.layers.cpu_kernels import cpu_kernels_available

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("int8", "int4", "w8a8_int8")
W8A8 = "w8a8_int8"
DENSE_ROWS = 64  # from here on dequantize + fp32 GEMM beats the q4 / q8 kernels (measured)
DENSE_ROWS_BF16 = 12  # the same where that GEMM runs in bf16 (a bf16 model, native bf16)
INT4_GROUP_SIZE = 32  # GGUF's Q4 block size; the ATen kernel takes 32, 64, 128 or 256
KERNEL_DTYPE = torch.bfloat16
ATEN_INT8_K_STEP = 16  # torch._weight_int8pack_mm's K must be a multiple of this
_INT4_INNER_K_TILES = 2


@dataclass
class BlockParams:
    """Exact int4 parameters of some rows of a weight, read from GGUF Q4_0 / Q4_1 blocks."""

    row_offset: int  # first row of the (possibly fused) weight these rows fill
    scale: torch.Tensor  # [rows, K // 32] fp32: the block's d
    minimum: torch.Tensor  # [rows, K // 32] fp32: the value of code 0 (Q4_1: m; Q4_0: -8d)


def int4_supported(out_features: int, in_features: int) -> bool:
    """The ATen int4 packing needs N % 16 == 0 and whole groups along K."""
    return out_features % 16 == 0 and in_features % INT4_GROUP_SIZE == 0


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: returns (codes int8 [N, K], scale fp32 [N])."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scale


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over groups of 32 columns (GGUF's Q8_0): returns (codes int8 [N, K],
    scale fp32 [N, K // 32]); a weight is codes * scale. A GGUF Q8_0 tensor dequantized and
    quantized again gets its own codes back (each block's largest code is ±127)."""
    w = weight.float()
    n, k = w.shape
    groups = w.view(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    scale = groups.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(groups / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.view(n, k), scale


def quantize_int4(
    weight: torch.Tensor, blocks: list[BlockParams] | tuple = ()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 over groups of 32 columns: returns (codes int32 [N, K] in [0, 15],
    scale fp32 [N, G], minimum fp32 [N, G]); a weight is codes * scale + minimum.

    Rows covered by `blocks` keep the GGUF file's own scale and minimum (so its codes come
    back exactly); the other rows get min/max parameters per group. Scales and minimums are
    fp16 values (GGUF's Q4_1 stores them in fp16, and so do the tiled kernels' weights), the
    codes chosen for them.
    """
    w = weight.float()
    n, k = w.shape
    groups = w.view(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    minimum = groups.amin(dim=-1)
    scale = (groups.amax(dim=-1) - minimum) / 15.0
    for b in blocks:
        rows = slice(b.row_offset, b.row_offset + b.scale.shape[0])
        scale[rows] = b.scale.float()
        minimum[rows] = b.minimum.float()
    scale, minimum = scale.half().float(), minimum.half().float()
    if not (torch.isfinite(scale).all() and torch.isfinite(minimum).all()):
        raise ValueError(
            "int4 holds its group scales and minimums in fp16, and this weight's values "
            f"exceed fp16's range (|w| up to {w.abs().max().item():.3g}); use int8"
        )
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round((groups - minimum[..., None]) / safe[..., None]).clamp(0, 15)
    codes = torch.where(scale[..., None] == 0, torch.zeros_like(codes), codes)
    return codes.to(torch.int32).view(n, k), scale, minimum


def dequantize_int4(
    codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
) -> torch.Tensor:
    """The fp32 weight that `quantize_int4`'s output stands for (the reference in tests)."""
    n, k = codes.shape
    groups = codes.float().view(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    return (groups * scale[..., None] + minimum[..., None]).view(n, k)


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b) with W held as int8 or int4 codes (`kernel` names the form and the
    kernel that multiplies it)."""

    def __init__(
        self,
        method: str,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        blocks: list[BlockParams] | tuple = (),
    ) -> None:
        super().__init__()
        if method not in QUANTIZATION_METHODS:
            raise ValueError(f"unknown quantization {method!r}; choose from {QUANTIZATION_METHODS}")
        self.out_features, self.in_features = weight.shape
        if method == "int4" and not int4_supported(self.out_features, self.in_features):
            raise ValueError(
                f"int4 needs out_features % 16 == 0 and in_features % {INT4_GROUP_SIZE} == 0, "
                f"got {self.out_features} x {self.in_features}"
            )
        self.method = method
        self.kernel = "aten"
        if method == W8A8:
            if not cpu_kernels_available():
                raise RuntimeError(
                    "--quantization w8a8_int8 needs radixserve's C++ CPU kernels, which did not "
                    "build here (see the log); use int8 or int4"
                )
            self.kernel = "w8a8"
            codes, scale = quantize_int8(weight)
            self.register_buffer("wq", codes.contiguous())
            self.register_buffer("w_scale", scale.contiguous())
        elif (
            method == "int8" and self.in_features % INT4_GROUP_SIZE == 0 and cpu_kernels_available()
        ):
            codes, scale = quantize_q8(weight)
            if self.out_features % 16 == 0 and tiled_supported():
                self.kernel = "q8_tiled"
                self.register_buffer("tiles", pack_q8_tiles(codes, scale))
            else:
                self.kernel = "q8"
                self.register_buffer("qs", codes)
                self.register_buffer("d", scale.contiguous())
        elif method == "int8":
            # ATen's kernel reads K in steps of 16 (other widths gave garbage or a SIGSEGV in
            # torch 2.13): zero columns pad the weight, forward pads the activations alike.
            self.k_pad = -self.in_features % ATEN_INT8_K_STEP
            codes, scale = quantize_int8(F.pad(weight, (0, self.k_pad)))
            self.register_buffer("packed", codes)
            self.register_buffer("scales", scale.to(KERNEL_DTYPE))
        else:
            self._pack_int4(*quantize_int4(weight, blocks))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)

    def _pack_int4(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> None:
        if tiled_supported():
            self.kernel = "q4_tiled"
            self.register_buffer("tiles", pack_q4_tiles(pack_q4(codes), scale, minimum))
            return
        if cpu_kernels_available():
            self.kernel = "q4"
            self.register_buffer("qs", pack_q4(codes))
            self.register_buffer("d", scale.contiguous())
            self.register_buffer("m", minimum.contiguous())
            return
        zero = minimum + 8 * scale  # ATen's form: (q - 8) * scale + zero
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INT4_INNER_K_TILES)
        self.register_buffer("packed", packed)
        # [G, N, 2]: (scale, zero) of group g of output row n.
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales", scales_zeros.to(KERNEL_DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "w8a8":  # its own dtype out; the bias is added in fp32 in the kernel
            bias = None if self.bias is None else self.bias.to(x2.dtype)
            y = torch.ops.radixserve.w8a8_linear(x2.contiguous(), self.wq, self.w_scale, bias)
            return y.reshape(*lead, self.out_features)
        if self.kernel == "q4_tiled":  # every row count; bf16 out for bf16 in
            y = torch.ops.radixserve.q4_tiled_linear(x2, self.tiles)
        elif self.kernel == "q8_tiled":  # likewise
            y = torch.ops.radixserve.q8_tiled_linear(x2, self.tiles)
        elif self.kernel in ("q4", "q8"):
            bf16 = gemm_in_bf16(x2.dtype)
            small = x2.shape[0] < dense_rows(bf16)
            if self.kernel == "q4" and small:
                y = torch.ops.radixserve.q4_linear(x2, self.qs, self.d, self.m)
            elif self.kernel == "q4":  # the kernel's int8 activations, through a dense GEMM
                y = torch.ops.radixserve.q4_dense(x2, self.qs, self.d, self.m, bf16)
            elif small:
                y = torch.ops.radixserve.q8_linear(x2, self.qs, self.d)
            else:
                y = torch.ops.radixserve.q8_dense(x2, self.qs, self.d, bf16)
        elif self.method == "int8":
            x2 = F.pad(x2.to(KERNEL_DTYPE), (0, self.k_pad)).contiguous()
            y = torch._weight_int8pack_mm(x2, self.packed, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(KERNEL_DTYPE).contiguous(), self.packed, INT4_GROUP_SIZE, self.scales
            )
        y = y.to(x.dtype).reshape(*lead, self.out_features)
        return y if self.bias is None else y + self.bias

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu_and_mul(self(x)) for a [gate; up] projection in tiles, in one kernel that
        applies the SiLU and the product to each pair of tiles as it finishes them (bitwise
        the same result, without the [M, 2I] product in memory); None where this layer cannot
        (other kernels, a bias, fp16, a gate that does not fill tiles of 16)."""
        if (
            self.kernel not in ("q4_tiled", "q8_tiled")
            or self.bias is not None
            or x.dtype not in (torch.bfloat16, torch.float32)
            or self.out_features % 32
        ):
            return None
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "q4_tiled":
            y = torch.ops.radixserve.q4_tiled_silu_mul(x2, self.tiles)
        else:
            y = torch.ops.radixserve.q8_tiled_silu_mul(x2, self.tiles)
        return y.reshape(*x.shape[:-1], self.out_features // 2)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # model.to(dtype) casts every floating buffer; the packed weight keeps its own dtypes
        # (bf16 scales for ATen, fp32 for the q4 kernel) and follows device moves only.
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        return self

    def extra_repr(self) -> str:
        return f"{self.method} ({self.kernel}), in={self.in_features}, out={self.out_features}"


def gemm_in_bf16(dtype: torch.dtype) -> bool:
    """Whether q4_dense / q8_dense run their GEMM in bf16 (fp32 accumulation): for a bf16
    model on a CPU with native bf16 matrix instructions, where it runs ≈ 3x the fp32 rate
    (AVX-512 BF16: 340 against 115 GFLOP/s on two Zen 4 cores). The bf16 GEMM rounds the
    dequantized weight and the activations to bf16, the model's own precision: it agrees with
    the kernels' rows to bf16's tolerance instead of fp32's."""
    return dtype == torch.bfloat16 and cpu_has_bf16()


def dense_rows(bf16: bool) -> int:
    """From how many rows q4 / q8 layers take the dense GEMM (bf16: `gemm_in_bf16`)."""
    return DENSE_ROWS_BF16 if bf16 else DENSE_ROWS


def tiled_supported() -> bool:
    """Whether int4 and int8 layers take the tiled layouts and kernels (C++ kernels built for a
    CPU with AVX-512 VNNI)."""
    return cpu_kernels_available() and bool(torch.ops.radixserve.tiled_supported())


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded to int8 per group of 32 and scaled back (fp32), with the float
    operations of quant_linear.cpp's quantize_row: what q4_dense multiplies (the reference in
    tests), so that a prompt's prefill (GEMM) and its decode (the q4 kernel) round the same
    activations the same way. (Upstream float-order
    differences between paths, e.g. attention over a cached prefix, can still move a value
    across a rounding boundary: int4 logits agree across paths to a few tenths of a nat, not
    bitwise; test_engine's int4 test.)"""
    m, k = x.shape
    groups = x.float().reshape(m, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    scale = groups.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return (torch.round(groups * inv) * scale).reshape(m, k)


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] -> the q4 kernel's bytes [N, K / 32, 16]: per group of 32, byte j holds
    element j in its low nibble and element j + 16 in its high one (GGUF Q4_1's layout)."""
    n, k = codes.shape
    groups = codes.view(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE).to(torch.uint8)
    return (groups[..., :16] | (groups[..., 16:] << 4)).contiguous()


def pack_q4_tiles(qs: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The q4 kernel's bytes [N, G, 16] and its scales and minimums [N, G] (fp16 values, as
    `quantize_int4` makes them) -> q4_tiled_linear's tiles of 16 outputs, uint8 [N/16, G, 320]:
    per tile and group, 4 vectors of 64 bytes of codes (lane t of vector q holding bytes 4q ..
    4q + 3 of output t's 16), then the 16 outputs' scales and their minimums in fp16, stored
    in pairs of tiles (`_pair_tiles`; csrc/quant_linear.cpp). The same bytes and values,
    reordered."""
    n, g, _ = qs.shape
    scale16, minimum16 = scale.half(), minimum.half()
    if not (torch.equal(scale16.float(), scale) and torch.equal(minimum16.float(), minimum)):
        raise ValueError("pack_q4_tiles: scales and minimums must be fp16 values (quantize_int4)")
    codes = qs.view(n // 16, 16, g, 4, 4).permute(0, 2, 3, 1, 4).reshape(n // 16, g, 256)
    return _pair_tiles([codes, torch.cat([_tile_values(scale16), _tile_values(minimum16)], 2)])


def pack_q8_tiles(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] and their group scales [N, G] -> q8_tiled_linear's tiles of 16 outputs,
    uint8 [N/16, G, 576]: per tile and group, codes + 128 in 8 vectors of 64 bytes (lane t of
    vector q holding elements 4q .. 4q + 3 of output t), then the 16 outputs' scales (fp32),
    stored in pairs of tiles (`_pair_tiles`; csrc/quant_linear.cpp)."""
    n, k = codes.shape
    g = k // INT4_GROUP_SIZE
    biased = (codes.to(torch.int16) + 128).to(torch.uint8)
    tiles = biased.view(n // 16, 16, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(n // 16, g, 512)
    return _pair_tiles([tiles, _tile_values(scale.float())])


def _tile_values(values: torch.Tensor) -> torch.Tensor:
    """Per-output group values [N, G] -> their bytes per tile and group [N/16, G, 16 x size]."""
    n, g = values.shape
    per_tile = values.view(n // 16, 16, g).transpose(1, 2).contiguous()
    return per_tile.view(torch.uint8)


def _pair_tiles(parts: list[torch.Tensor]) -> torch.Tensor:
    """A tiled weight's parts, each uint8 [T, G, b] (codes, scales, minimums), as the tiled
    kernels store them, [T, G, sum of b]: with F = T // 2, pair i holds tiles i and F + i
    (for a [gate; up] weight, gate tile i and its up tile), group after group: each part of
    both tiles in turn, their 64-byte vectors alternating (the order a pass loads them); an odd
    last tile follows alone, group after group. So a pass over a pair reads one run of memory,
    in order."""
    t, g = parts[0].shape[:2]
    f = t // 2
    vectors = [p.view(t, g, -1, 64) for p in parts]
    pairs = torch.cat([torch.stack([v[:f], v[f : 2 * f]], dim=3).flatten(2) for v in vectors], 2)
    runs = [pairs.reshape(-1)]
    if t % 2:
        runs.append(torch.cat([p[t - 1] for p in parts], 1).reshape(-1))
    return torch.cat(runs).view(t, g, -1)


def quantize_model(
    model: nn.Module, method: str, blocks: dict[str, list[BlockParams]] | None = None
) -> None:
    """Replace every nn.Linear of `model` (and its output head, in int8, under int8 and int4)
    by a QuantizedLinear, in place.

    `blocks` maps a linear's weight name (e.g. `model.layers.0.mlp.down_proj.weight`) to the
    GGUF Q4 rows it holds. A layer int4 cannot pack (shape, or values beyond fp16's range) is
    kept in int8, with a log line.
    Call on the fp32 weights, before the model's dtype cast.
    """
    blocks = blocks or {}
    # Under int4 the output head stays int8, as llama.cpp keeps it at 8 bits: in int4 it alone
    # costs SmolLM2-135M 4.7% perplexity (15.26 -> 15.97), in int8 0.2% (docs/performance.md).
    # Under w8a8_int8 it stays unquantized, as SGLang leaves it.
    head_method = None if method == W8A8 else "int8"
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and (name != "lm_head" or head_method)
    ]
    counts: dict[str, int] = {}
    for name, linear in targets:
        kind = head_method if name == "lm_head" else method
        layer = _quantize_linear(kind, linear.weight, linear.bias, blocks.get(f"{name}.weight"))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        counts[layer.method] = counts.get(layer.method, 0) + 1
    tie = getattr(model, "quantize_tied_head", None)
    if tie is not None and head_method:  # a tied head: quantize a copy, the embedding stays
        embed = blocks.get("model.embed_tokens.weight")
        head = tie(lambda w: _quantize_linear(head_method, w, None, embed))
        if head is not None:
            counts[head.method] = counts.get(head.method, 0) + 1
    logger.info(
        "quantization: %s",
        ", ".join(f"{n} linear layers in {m}" for m, n in sorted(counts.items())),
    )


SMOOTH_ALPHA = 0.65  # SmoothQuant's migration strength (0.5 and 0.8 measured worse here)


def smoothing_factors(act_amax: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors s_j = max|X_j|^α / max|W_j|^(1-α), rounded to
    powers of two, so that dividing the activations (a norm's weight) by s and multiplying the
    weight's columns by s are exact in any float format: the model's function is unchanged
    until it is quantized."""
    x = act_amax.float().clamp(min=1e-5)
    w = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
    s = x.pow(SMOOTH_ALPHA) / w.pow(1 - SMOOTH_ALPHA)
    return torch.exp2(torch.round(torch.log2(s)).clamp(-16, 16))


def smooth_model(model: nn.Module, act_amax: dict[nn.Module, torch.Tensor]) -> int:
    """Fold SmoothQuant's factors into each decoder layer's two RMSNorm → linear pairs
    (input_layernorm → qkv_proj, post_attention_layernorm → gate_up_proj): the norm's weight
    divided by s, the linear's input columns multiplied by s (the norm keeps s as
    `smoothed_by`: what else reads the norm's output, a LoRA adapter's A, multiplies by it
    too). `act_amax` maps each of those linears to its input's largest magnitude per channel
    (calibration). Returns the pairs smoothed."""
    count = 0
    with torch.no_grad():
        for layer in model.model.layers:
            pairs = (
                (layer.input_layernorm, layer.self_attn.qkv_proj),
                (layer.post_attention_layernorm, layer.mlp.gate_up_proj),
            )
            for norm, linear in pairs:
                amax = act_amax.get(linear)
                if amax is None or not isinstance(linear, nn.Linear):
                    continue
                s = smoothing_factors(amax, linear.weight)
                norm.weight.div_(s.to(norm.weight.dtype))
                linear.weight.mul_(s.to(linear.weight.dtype))
                norm.smoothed_by = s.float()
                count += 1
    return count


def _quantize_linear(
    method: str, weight: torch.Tensor, bias: torch.Tensor | None, blocks: list[BlockParams] | None
) -> QuantizedLinear:
    if method == "int4" and not int4_supported(*weight.shape):
        logger.info("int4 cannot pack a %d x %d weight; it stays int8", *weight.shape)
        method = "int8"
    if method == "int4" and not bool(weight.abs().amax() <= torch.finfo(torch.float16).max):
        logger.info(
            "int4's fp16 scales cannot hold a weight of values beyond fp16's; it stays int8"
        )
        method = "int8"
    with torch.no_grad():
        return QuantizedLinear(method, weight, bias, (blocks or ()) if method == "int4" else ())
