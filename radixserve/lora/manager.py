"""Serving LoRA adapters over one base model (`--lora-paths`; SGLang's S-LoRA-style batching).

The LoRAManager lives in the ModelRunner. At start-up it wraps each decoder layer's four
projections (qkv_proj, o_proj, gate_up_proj, down_proj) in a `LoRALinear` and loads every
adapter, kept in memory in the layout the layers use: per (layer, projection) the adapter's A
matrices side by side, transposed ([in, ΣR]; q, k and v share one product), and one
block-diagonal [ΣR, out] matrix of the parts' Bᵀ times the scaling, each in the columns of
the fused output its part adds to; so a projection's delta is two products whatever it fuses.
They are kept in the model's dtype, plus, where the decode kernel below runs, A untransposed
and B in column tiles for it, else in fp32 too (the small steps' products). A step of up to
KERNEL_ROWS rows on a CPU with radixserve's kernels adds every adapter's deltas to a projection
in one call, `lora_delta` (csrc/lora_ops.cpp: each row gathers its own adapter's matrices, in
the model's dtype, accumulating in fp32; bf16 by vdpbf16ps where the CPU has AVX512-BF16),
whatever the number of adapters in the step. In larger steps (prefills), where the base
projection runs on radixserve's bf16 tiles (layers/linear.py), the deltas join the base
product itself: every row's first product x Aᵀ by one call (bf16_tiled_lora_shrink), then
the base product whose sums also take each row's xa times its adapter's B before the one
rounding (bf16_tiled_linear_lora / bf16_tiled_silu_mul_lora, csrc/bf16_linear.cpp), so the
output is never re-read to add a delta and the MLP keeps its fused SiLU. Elsewhere (GPUs,
CPUs without the kernels, other weight forms) each adapter's rows take two products: up to
FP32_ROWS rows in fp32 (a bf16 product of these small shapes costs oneDNN ≈ 20 µs a call
against ≈ 3-5 µs in fp32, for a cast of the few input rows), beyond in the model's dtype (at
6,400 rows 7× faster than in fp32). With tensor parallelism
each rank keeps its shard: column-parallel projections (qkv, gate_up) narrow B's rows as their
weight's, row-parallel ones (o, down) narrow A's columns, and their delta joins the partial
product before the all-reduce (the sum over ranks of (xᵢ Aᵢᵀ) Bᵀ is (x Aᵀ) Bᵀ). Under
w8a8_int8, A's columns take SmoothQuant's factors as the base weights did.

Per step, `prepare` turns the batch's per-request adapter names into groups: for each adapter
in the batch, the packed token rows that use it (None when they are all of them), and for the
kernel each row's group (-1: the base model). Each wrapped projection then computes its base
output as before and adds `(x[rows] Aᵀ) (scaling · Bᵀ)` to each group's rows. A step without
adapter rows runs the base layers untouched (CUDA graphs, the fused SiLU kernel). The CPU's C++
decode step takes decode steps with adapters too (`run_lora`: the same deltas by the same
calls, bitwise, the groups' rows and weights in `LoRABatch.step_*`). The scheduler caps the
distinct adapters in one batch at --max-loras-per-batch (base-model requests do not count).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from radixserve.layers.cpu_kernels import cpu_kernels_available
from radixserve.layers.linear import Linear, tile_layout
from radixserve.layers.parallel_layers import RowParallelLinear
from radixserve.lora.adapter import LoRAAdapter, LoRAError, ModelShape, parse_lora_paths
from radixserve.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)
_NONE = torch.empty(0)  # an adapter's matrices where it leaves the projection alone

# Up to KERNEL_ROWS rows a step's deltas take the one-call kernel (lora_delta) where it is built
# (SmolLM2-135M in bf16, rank 16, one adapter: a decode step of 128 rows 1.05x faster than by
# the products, of 256 as fast; four adapters mixed 1.24x and 1.09x); elsewhere they run by
# two products per adapter, up to FP32_ROWS rows in fp32 for a model in another dtype.
KERNEL_ROWS = 128
FP32_ROWS = 32
TILE = 64  # columns of B per tile in lora_delta's layout (csrc/lora_ops.cpp's kTile)

# (module path in a decoder layer, the adapter projections it fuses, row-parallel)
WRAPPED = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj"), False),
    ("self_attn", "o_proj", ("o_proj",), True),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj"), False),
    ("mlp", "down_proj", ("down_proj",), True),
)


@dataclass
class _Packed:
    """One adapter's weights for one wrapped projection of one layer."""

    # (a_t and b are fp32, or the model's dtype's where the kernel takes the small steps)
    a_t: torch.Tensor  # [in (this rank's), ΣR]: the parts' A, transposed, side by side
    b: torch.Tensor  # [ΣR, out (this rank's)]: scaling · each part's Bᵀ in its block
    a_t_model: torch.Tensor | None = None  # the two in the model's dtype (None: it is fp32)
    b_model: torch.Tensor | None = None
    # lora_delta's two (the kernel, model's dtype; kernel_weights): A untransposed [ΣR, in],
    # and B in tiles of TILE columns (each a contiguous read)
    a_rows: torch.Tensor | None = None
    b_tiles: torch.Tensor | None = None
    # Where the base projection runs on radixserve's bf16 tiles (layers/linear.py), the two in
    # that tile layout, ranks padded to a multiple of 32 (the tile unit's step): A [ΣR, in]
    # for bf16_tiled_lora_shrink, B [ΣR, out] for the base product's own (bf16_tiled_*_lora).
    shrink_tiles: torch.Tensor | None = None
    expand_tiles: torch.Tensor | None = None


def kernel_weights(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [R, in] and B [R, out] in lora_delta's layout: A as it is, B in column tiles
    [ceil(out / TILE), R, TILE] (zeros past `out`); where bf16 adapters take vdpbf16ps
    (lora_delta_pairs), R padded to even with zeros and each tile's ranks in pairs
    ([R / 2, TILE, 2] in memory)."""
    rank, out = b.shape
    pairs = b.dtype == torch.bfloat16 and torch.ops.radixserve.lora_delta_pairs()
    padded_rank = rank + rank % 2 if pairs else rank
    tiles = -(-out // TILE)
    padded = b.new_zeros(padded_rank, tiles * TILE)
    padded[:rank, :out] = b
    a = a.contiguous()
    if padded_rank != rank:
        a = torch.cat([a, a.new_zeros(1, a.shape[1])])
    if not pairs:
        return a, padded.view(rank, tiles, TILE).transpose(0, 1).contiguous()
    paired = padded.view(padded_rank // 2, 2, tiles, TILE).permute(2, 0, 3, 1).contiguous()
    return a, paired.view(tiles, padded_rank, TILE)


def tiled_weights(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [R, in] and B [R, out] in the bf16 tiles' layout (layers/linear.py's tile_layout),
    R padded with zero ranks to a multiple of 32: A as a weight [R, in] (the first product
    x Aᵀ), B as the second product's weight Bᵀ [out, R]."""
    rank = a.shape[0]
    padded = -(-rank // 32) * 32
    a_pad = a.new_zeros(padded, a.shape[1])
    a_pad[:rank] = a
    bt_pad = b.new_zeros(b.shape[1], padded)
    bt_pad[:, :rank] = b.t()
    return tile_layout(a_pad), tile_layout(bt_pad)


def _tiled_base(base: nn.Module) -> bool:
    """Whether a projection's product runs on radixserve's bf16 tiles (prepack's own layout),
    which take the adapters' deltas inside the product (bf16_tiled_*_lora)."""
    packed = getattr(base, "packed", None)
    return type(base) is Linear and packed is not None and not packed.is_mkldnn


@dataclass
class LoRABatch:
    """Which packed token rows use which adapter in this step (rows None: all of them)."""

    groups: list[tuple[dict[tuple[int, str], _Packed], torch.Tensor | None]]
    # Each packed row's group (-1: no adapter) on a CPU with radixserve's kernels, else None;
    # `kernel`: whether lora_delta takes the step (else the tiled products where the base
    # projection is tiled, and the per-adapter products elsewhere).
    slots: torch.Tensor | None
    kernel: bool
    # The same for the C++ decode step (csrc/decode_step.cpp's run_lora): each group's rows
    # (empty: all) and its weights, 8 per layer and projection.
    step_rows: list[torch.Tensor]
    step_weights: list[torch.Tensor]
    fp32_rows: int = FP32_ROWS


class LoRALinear(nn.Module):
    """A projection of the base model plus the deltas of the adapters in the current step."""

    def __init__(self, base: nn.Module, manager: LoRAManager, key: tuple[int, str], row: bool):
        super().__init__()
        self.base = base
        self.key = key
        self.row_parallel = row and isinstance(base, RowParallelLinear)
        self.tiled = _tiled_base(base)
        self._manager = [manager]  # a list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self._manager[0].batch
        if batch is None:
            return self.base(x)
        if self.row_parallel:
            return self.base(x, lambda y: self._add_deltas(y, x, batch))
        operands = self._tiled_operands(x, batch)
        if operands is not None:  # the deltas inside the base product
            flat, xa, expand = operands
            y = torch.ops.radixserve.bf16_tiled_linear_lora(
                flat, self.base.packed, self.base.bias, xa, batch.slots, expand
            )
            return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)
        y = self.base(x)
        self._add_deltas(y, x, batch)
        return y

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu_and_mul of this projection in one kernel where the base has one (its fused SiLU
        kernel, with the step's deltas inside the product where they apply), else None."""
        fused = getattr(self.base, "silu_and_mul", None)
        batch = self._manager[0].batch
        if fused is None:
            return None
        if batch is None or not any(self.key in w for w, _ in batch.groups):
            return fused(x)
        if not self.tiled or self.base.bias is not None or self.base.out_features % 32:
            return None
        operands = self._tiled_operands(x, batch)
        if operands is None:
            return None
        flat, xa, expand = operands
        y = torch.ops.radixserve.bf16_tiled_silu_mul_lora(
            flat, self.base.packed, xa, batch.slots, expand
        )
        return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)

    def _tiled_operands(
        self, x: torch.Tensor, batch: LoRABatch
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None:
        """Where this step's deltas join the base's tiled product (a step lora_delta does not
        take, the base in bf16 tiles): x's rows in bf16, their first products xa, and each
        group's B in tiles; else None."""
        if batch.kernel or batch.slots is None or not self.tiled:
            return None
        ws = [weights.get(self.key) for weights, _ in batch.groups]
        if any(w is not None and w.shrink_tiles is None for w in ws):
            return None
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        xa = torch.ops.radixserve.bf16_tiled_lora_shrink(
            flat, [_NONE if w is None else w.shrink_tiles for w in ws], batch.slots
        )
        return flat, xa, [_NONE if w is None else w.expand_tiles for w in ws]

    def _add_deltas(self, y: torch.Tensor, x: torch.Tensor, batch: LoRABatch) -> None:
        flat_x = x.reshape(-1, x.shape[-1])
        flat_y = y.view(-1, y.shape[-1])
        if batch.kernel:
            ws = [weights.get(self.key) for weights, _ in batch.groups]
            torch.ops.radixserve.lora_delta(
                flat_y,
                flat_x,
                [_NONE if w is None else w.a_rows for w in ws],
                [_NONE if w is None else w.b_tiles for w in ws],
                batch.slots,
            )
            return
        for weights, rows in batch.groups:
            w = weights.get(self.key)
            if w is None:
                continue
            xs = flat_x if rows is None else flat_x.index_select(0, rows)
            if w.a_t_model is not None and xs.shape[0] > FP32_ROWS:
                xa = torch.mm(xs, w.a_t_model)
                if rows is None:
                    flat_y.addmm_(xa, w.b_model)
                else:
                    flat_y.index_add_(0, rows, torch.mm(xa, w.b_model))
                continue
            delta = torch.mm(torch.mm(xs.to(w.a_t.dtype), w.a_t), w.b).to(y.dtype)
            if rows is None:
                flat_y.add_(delta)
            else:
                flat_y.index_add_(0, rows, delta)


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        lora_paths: tuple[str, ...],
        max_lora_rank: int | None,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        self.model = model
        self.shape = ModelShape.of(model.config)
        self.max_lora_rank = max_lora_rank
        self.dtype, self.device = dtype, device
        self.adapters: dict[str, dict[tuple[int, str], _Packed]] = {}
        self.step_weights: dict[str, list[torch.Tensor]] = {}  # LoRABatch.step_weights' part
        self.batch: LoRABatch | None = None  # the step running now (read by the LoRALinears)
        # Whether small steps take the one-call kernel (radixserve's CPU kernels).
        self.kernel = torch.device(device).type == "cpu" and cpu_kernels_available()
        self._sizes = self._wrap(model)
        for name, path in parse_lora_paths(lora_paths).items():
            self.load(name, path)

    # -- adapters --------------------------------------------------------------------------------
    def load(self, name: str, path: str) -> None:
        """Read, check and pack one adapter (LoRAError says what is wrong with it)."""
        if name in self.adapters:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded")
        adapter = LoRAAdapter.load(name, path, self.shape, self.max_lora_rank)
        packed = self.adapters[name] = self._pack(adapter)
        none = torch.empty(0)
        flat = []
        for layer in range(self.shape.num_layers):
            for _, fused, _, _ in WRAPPED:
                w = packed.get((layer, fused))
                if w is None:
                    flat += [none] * 8
                else:
                    model = (w.a_t_model, w.b_model) if w.a_t_model is not None else (none, none)
                    kernel = (w.a_rows, w.b_tiles) if w.a_rows is not None else (none, none)
                    tiled = (w.shrink_tiles, w.expand_tiles)
                    tiled = tiled if w.shrink_tiles is not None else (none, none)
                    flat += [w.a_t, w.b, *model, *kernel, *tiled]
        self.step_weights[name] = flat
        targets = sorted({proj for _, proj in adapter.weights})
        logger.info(
            "LoRA adapter %r: rank %d, scaling %.4g, %s (%s)",
            name,
            adapter.rank,
            adapter.config.scaling,
            ", ".join(targets),
            path,
        )

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded")
        del self.step_weights[name]

    def _pack(self, adapter: LoRAAdapter) -> dict[tuple[int, str], _Packed]:
        tp = getattr(self.model, "tp", None)
        sharded = tp is not None and tp.world_size > 1
        packed: dict[tuple[int, str], _Packed] = {}
        for layer in range(self.shape.num_layers):
            block = self.model.model.layers[layer]
            # w8a8_int8's SmoothQuant divided the norms' outputs by s (quantization.py
            # smooth_model): A's columns take s as the base weight's did.
            smoothed = {
                "qkv_proj": getattr(block.input_layernorm, "smoothed_by", None),
                "gate_up_proj": getattr(block.post_attention_layernorm, "smoothed_by", None),
            }
            for sub, fused, projs, row in WRAPPED:
                a_list, b_list = [], []
                offsets = self._sizes[fused]
                for proj, (start, end) in zip(projs, offsets, strict=True):
                    ab = adapter.weights.get((layer, proj))
                    if ab is None:
                        continue
                    a, b = (t.float() for t in ab)
                    if sharded:  # this rank's share, as the base weight's
                        name = f"model.layers.{layer}.{sub}.{proj}.weight"
                        if row:
                            a = self.model.shard_weight(name, a)
                        else:
                            b = self.model.shard_weight(name, b)
                    s = smoothed.get(fused)
                    a_list.append(a if s is None else a * s.to(a.device))
                    b_block = b.new_zeros(a.shape[0], offsets[-1][1])
                    b_block[:, start:end] = b.t() * adapter.config.scaling
                    b_list.append(b_block)
                if not a_list:
                    continue
                w = _Packed(
                    torch.cat(a_list).t().contiguous().to(self.device),
                    torch.cat(b_list).to(self.device),
                )
                if self.dtype != torch.float32:
                    w.a_t_model, w.b_model = w.a_t.to(self.dtype), w.b.to(self.dtype)
                for t in (w.b, w.b_model):
                    if t is not None and not torch.isfinite(t).all():
                        raise LoRAError(
                            f"LoRA adapter {adapter.name!r}, layer {layer} {fused}: lora_B "
                            f"times the scaling ({adapter.config.scaling:g}) overflows {t.dtype}"
                        )
                if getattr(getattr(block, sub), fused).tiled:
                    w.shrink_tiles, w.expand_tiles = tiled_weights(
                        w.a_t.t().to(torch.bfloat16), w.b.to(torch.bfloat16)
                    )
                if self.kernel:
                    w.a_rows, w.b_tiles = kernel_weights(
                        w.a_t.t().to(self.dtype), w.b.to(self.dtype)
                    )
                    if w.a_t_model is not None:  # the fp32 pair would serve only the kernel's
                        w.a_t, w.b = w.a_t_model, w.b_model  # steps: not kept
                packed[(layer, fused)] = w
        return packed

    def _wrap(self, model: nn.Module) -> dict[str, list[tuple[int, int]]]:
        """Wrap the projections; returns each fused projection's parts as output slices of
        this rank."""
        first = model.model.layers[0]
        attn, mlp = first.self_attn, first.mlp
        q, kv, inter = attn.q_size, attn.kv_size, mlp.local_intermediate_size
        hidden = self.shape.sizes["o_proj"][1]
        sizes = {
            "qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
            "o_proj": [(0, hidden)],
            "gate_up_proj": [(0, inter), (inter, 2 * inter)],
            "down_proj": [(0, hidden)],
        }
        for i, layer in enumerate(model.model.layers):
            for sub, fused, _, row in WRAPPED:
                parent = getattr(layer, sub)
                base = getattr(parent, fused)
                setattr(parent, fused, LoRALinear(base, self, (i, fused), row))
        return sizes

    # -- steps -----------------------------------------------------------------------------------
    def prepare(self, fb: ForwardBatch) -> LoRABatch | None:
        """The step's adapter groups, or None when no request of it uses an adapter."""
        if not fb.uses_lora:
            return None
        names = fb.lora_ids
        assert names is not None
        rows: dict[str, list[int]] = {}
        start = 0
        for name, n in zip(names, fb.extend_seq_lens_cpu, strict=True):
            if name is not None:
                rows.setdefault(name, []).extend(range(start, start + n))
            start += n
        groups, step_rows, step_weights = [], [], []
        slots = torch.full((start,), -1, dtype=torch.int64) if self.kernel else None
        for g, (name, idx) in enumerate(rows.items()):
            weights = self.adapters.get(name)
            if weights is None:
                raise LoRAError(f"no LoRA adapter named {name!r} is loaded")
            picked = None if len(idx) == start else torch.tensor(idx, device=self.device)
            groups.append((weights, picked))
            step_rows.append(torch.empty(0, dtype=torch.int64) if picked is None else picked)
            step_weights += self.step_weights[name]
            if slots is not None and picked is None:
                slots.fill_(g)
            elif slots is not None:
                slots.index_fill_(0, picked, g)
        kernel = slots is not None and start <= KERNEL_ROWS
        return LoRABatch(groups, slots, kernel, step_rows, step_weights)

    def run(self, batch: LoRABatch | None, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """forward() with `batch`'s adapters applied by the wrapped projections."""
        self.batch = batch
        try:
            return forward()
        finally:
            self.batch = None
