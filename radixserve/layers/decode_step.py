"""The CPU decode step in one C++ call (csrc/decode_step.cpp): the fast path's captured step.

A batch-1 decode step of SmolLM2-135M with int4 weights spent about a third of its time
issuing its ≈ 600 small calls from Python (module calls, views, the KV write, the attention
backend) rather than computing. `CpuDecodeStep` hands the model's per-layer weights to a C++
`DecodeStep` once, at start-up, and each eligible decode step then runs every decoder layer
in one call: the same kernels and ATen ops, with the same arguments and in the same order as
the Python path of models/llama.py under the cpu_paged backend, so the two give bitwise the
same hidden states (tests/layers/test_decode_step.py). It plays the part CUDA graphs play on
a GPU: the step's shape is not captured, but its dispatch overhead is gone.

A step takes it when it is a decode step, of any number of requests (the C++ step mirrors each
linear layer's forms at every size: the q4 / q8 kernels below `dense_rows()`, their dense GEMMs
from there on), whose attention has no shared-prefix groups (the cascade merges stay in Python);
every other step, and every model it cannot hold (tensor parallelism, Qwen3's q/k norms, ATen's
int4/int8 fallback kernels, the torch-native backend), runs layer by layer. Steps with LoRA
adapters (lora/manager.py) take it through `run_lora`, which adds their deltas to the four
projections as the LoRALinears do.
`--disable-cpu-decode-step` turns it off.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from radixserve.layers.attention.cpu_paged_backend import PagedDecodeMetadata
from radixserve.layers.linear import SMALL_M_ROWS, Linear
from radixserve.layers.quantization import QuantizedLinear, dense_rows, gemm_in_bf16
from radixserve.mem_cache.memory_pool import MHATokenToKVPool
from radixserve.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)
_EMPTY = torch.empty(0, dtype=torch.int64)  # run_lora's slots where there are none

# csrc/decode_step.cpp's linear kinds
DENSE, Q4, Q8, W8A8, Q4_TILED, Q8_TILED, BF16_TILED, BIAS = 0, 1, 2, 3, 4, 5, 6, 8
# The C++ step mirrors the linear layers' forms at each size (it is given the thresholds):
# QuantizedLinear's kernels below dense_rows(), and linear()'s (W · xᵀ)ᵀ up to SMALL_M_ROWS.


class CpuDecodeStep:
    """The C++ DecodeStep of one model, and the test of whether a step may take it."""

    def __init__(self, step: torch.ScriptObject) -> None:
        self.step = step

    @classmethod
    def build(cls, model: nn.Module) -> CpuDecodeStep | None:
        """The step for `model` (a LlamaForCausalLM with its fused ops on), or None with a log
        line saying why the model's decode steps keep to Python."""
        try:
            params, kinds, attn = _collect(model)
        except _Unsupported as exc:
            logger.info("decode steps run layer by layer in Python: %s", exc)
            return None
        from radixserve.layers.cpu_kernels import load_cpu_kernels

        load_cpu_kernels()
        bf16 = gemm_in_bf16(model.model.layers[0].input_layernorm.weight.dtype)
        step = torch.classes.radixserve.DecodeStep(
            params,
            kinds,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            attn.attn.scaling,
            model.model.layers[0].input_layernorm.eps,
            SMALL_M_ROWS,
            dense_rows(bf16),
            bf16,
        )
        return cls(step)

    def applies(self, fb: ForwardBatch, x: torch.Tensor) -> bool:
        md = fb.attn_metadata
        return (
            fb.forward_mode.is_decode()
            and x.shape[0] > 0
            and isinstance(md, PagedDecodeMetadata)
            and not md.groups
            and type(fb.token_to_kv_pool) is MHATokenToKVPool
        )

    def run(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer of a decode step: (the last MLP output, the residual stream)."""
        md: PagedDecodeMetadata = fb.attn_metadata  # type: ignore[assignment]
        pool = fb.token_to_kv_pool
        assert isinstance(pool, MHATokenToKVPool) and fb.out_cache_loc is not None
        cos, sin = rope
        args = (
            x,
            cos.squeeze(1),
            sin.squeeze(1),
            pool.k_buffer,
            pool.v_buffer,
            fb.out_cache_loc,
            md.kv_rows,
            md.kv_start,
            md.kv_end,
        )
        lora = fb.lora  # a LoRABatch (lora/manager.py): its deltas join the projections
        if lora is None:
            return self.step.run(*args)
        slots = _EMPTY if lora.slots is None else lora.slots
        return self.step.run_lora(
            *args, lora.step_rows, lora.step_weights, slots, lora.kernel, lora.fp32_rows
        )


class _Unsupported(Exception):
    pass


def _collect(model: nn.Module) -> tuple[list[torch.Tensor], list[int], nn.Module]:
    """The DecodeStep's parameters and linear kinds, in csrc/decode_step.cpp's order."""
    from radixserve.models.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        raise _Unsupported(f"{type(model).__name__} is not a Llama-family model")
    if model.tp.world_size > 1:
        raise _Unsupported("tensor parallelism (the all-reduces stay in Python)")
    layers = model.model.layers
    if len(layers) == 0:
        raise _Unsupported("the model has no layers")
    dtype = layers[0].input_layernorm.weight.dtype
    params: list[torch.Tensor] = []
    kinds: list[int] = []
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_norm is not None:
            raise _Unsupported("per-head q/k norms (Qwen3)")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if (
                not norm.fused
                or norm.weight.dtype != dtype
                or norm.eps != layers[0].input_layernorm.eps
            ):
                raise _Unsupported(f"layer {i}'s norms are not the fused kernels of one dtype")
        if not (attn.fused and mlp.fused):
            raise _Unsupported("the fused kernels are off")
        params += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            kind, tensors = _linear(lin, dtype)
            kinds.append(kind)
            params += tensors
    return [p.detach() for p in params], kinds, layers[0].self_attn


def _linear(lin: nn.Module, dtype: torch.dtype) -> tuple[int, list[torch.Tensor]]:
    bias = getattr(lin, "bias", None)
    if type(lin) is QuantizedLinear and lin.kernel == "q4":
        kind, tensors = Q4, [lin.qs, lin.d, lin.m]
    elif type(lin) is QuantizedLinear and lin.kernel == "q4_tiled":
        kind, tensors = Q4_TILED, [lin.tiles]
    elif type(lin) is QuantizedLinear and lin.kernel == "q8_tiled":
        kind, tensors = Q8_TILED, [lin.tiles]
    elif type(lin) is QuantizedLinear and lin.kernel == "q8":
        kind, tensors = Q8, [lin.qs, lin.d]
    elif type(lin) is QuantizedLinear and lin.kernel == "w8a8":
        kind, tensors = W8A8, [lin.wq, lin.w_scale]
    elif type(lin) is Linear and lin.weight.dtype == dtype:
        if lin.packed is not None and not lin.packed.is_mkldnn:  # bf16 tiles (linear.py)
            kind, tensors = BF16_TILED, [lin.packed]
        else:
            kind, tensors = DENSE, [lin.weight if lin.packed is None else lin.packed]
    else:
        raise _Unsupported(f"a {lin!r} layer")
    if bias is not None:
        if bias.dtype != dtype:
            raise _Unsupported("a bias of another dtype")
        kind |= BIAS
        tensors.append(bias)
    return kind, tensors
