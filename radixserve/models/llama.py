"""The Llama family: Llama / SmolLM2 (GQA, RoPE, RMSNorm, SiLU-gated MLP), Qwen2 (qkv bias) and
Qwen3 (per-head q/k RMSNorm), with fused qkv and gate_up projections.

`forward` returns hidden states for the packed tokens; the LogitsProcessor in the ModelRunner
applies lm_head only to the rows that are sampled. `load_weights` takes Hugging Face names.

Tensor parallelism (`tp`, --tp-size > 1): each rank holds its share of the attention heads
(KV heads replicated where tp exceeds them) and of the MLP columns, column-parallel qkv and
gate_up, row-parallel o_proj and down_proj (all-reduce), a vocab-parallel embedding and head
(parallel_layers). `load_weights` narrows each full checkpoint tensor to the rank's shard.
At tp 1 the layers are the dense ones and the loader copies whole tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel_state import TpGroup, kv_head_start, local_head_counts
from radixserve.layers.attention.base import AttentionLayer
from radixserve.layers.decode_step import CpuDecodeStep
from radixserve.layers.fused_ops import FusedOp
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import Linear, linear
from radixserve.layers.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_logits,
    vocab_shard,
)
from radixserve.layers.quantization import QuantizedLinear
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.lora.manager import LoRALinear
from radixserve.model_executor.forward_batch import ForwardBatch
from radixserve.model_loader.model_config import ModelConfig

RopeTables = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) rows of this step's positions


def _column(in_features: int, out_features: int, bias: bool, tp: TpGroup) -> Linear:
    """`out_features` are this rank's rows."""
    if tp.world_size == 1:
        return Linear(in_features, out_features, bias=bias)
    return ColumnParallelLinear(in_features, out_features, bias=bias)


def _row(in_features: int, out_features: int, bias: bool, tp: TpGroup) -> Linear:
    """`in_features` are this rank's columns."""
    if tp.world_size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


class LlamaAttention(FusedOp, nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TpGroup) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = local_head_counts(
            cfg.num_attention_heads, cfg.num_key_value_heads, tp.world_size
        )
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = _column(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, tp
        )
        self.o_proj = _row(self.q_size, cfg.hidden_size, cfg.o_proj_bias, tp)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = AttentionLayer(
            layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5
        )

    def forward(self, rope: RopeTables, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        if self.can_fuse(q) and cos.dtype == q.dtype:  # in place, on the qkv output
            torch.ops.radixserve.rotary_embedding(q, k, cos.squeeze(1), sin.squeeze(1))
        else:
            q, k = RotaryEmbedding.apply(rope, q, k)
        assert fb.attn_backend is not None
        out = fb.attn_backend.forward(q, k, v, self.attn, fb)
        return self.o_proj(out)


class LlamaMLP(FusedOp, nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TpGroup) -> None:
        super().__init__()
        start, end = tp.shard_range(cfg.intermediate_size, "the MLP's intermediate size")
        inter = self.local_intermediate_size = end - start
        self.gate_up_proj = _column(cfg.hidden_size, 2 * inter, cfg.mlp_bias, tp)
        self.down_proj = _row(inter, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.can_fuse(x)
            and x.dim() == 2
            and isinstance(self.gate_up_proj, (QuantizedLinear, Linear, LoRALinear))
        ):
            fused = self.gate_up_proj.silu_and_mul(x)  # the product and the SiLU in one kernel
            if fused is not None:
                return self.down_proj(fused)
        gate_up = self.gate_up_proj(x)
        if self.can_fuse(gate_up) and gate_up.dim() == 2:
            return self.down_proj(torch.ops.radixserve.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TpGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, rope: RopeTables, x: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings for the first layer, which has
        no residual yet); returns this layer's MLP output and the residual stream before it.
        The residual adds are folded into the norms (RMSNorm with a residual)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, fb)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TpGroup) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = (
            nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            if tp.world_size == 1
            else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        )
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The C++ decode step (layers/decode_step.py), set by the ModelRunner on the CPU fast
        # path: eligible decode steps run every layer in one call, with the same results.
        self.decode_step: CpuDecodeStep | None = None

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(fb.input_ids)
        rope = self.rotary.cos_sin(fb.positions, x.dtype)
        residual = None
        if self.decode_step is not None and self.decode_step.applies(fb, x):
            x, residual = self.decode_step.run(x, rope, fb)
        else:
            for layer in self.layers:
                x, residual = layer(rope, x, residual, fb)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]


# (fused parameter, HF parameter, shard id) — how HF's separate projections pack into ours.
_STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TpGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp or TpGroup.single()
        self.model = LlamaModel(cfg, self.tp)
        self.lm_head: nn.Module | None = None
        self.packed_head: torch.Tensor | None = None  # a tied head's prepacked copy (linear.py)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        elif self.tp.world_size == 1:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        else:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the given hidden rows (the head is the embedding when tied); with TP, the
        full vocabulary on every rank (ParallelLMHead / gather_logits all-gather it)."""
        if self.lm_head is None:
            logits = linear(hidden, self.model.embed_tokens.weight, packed=self.packed_head)
            if self.tp.world_size > 1:
                logits = gather_logits(logits, self.config.vocab_size, self.tp)
            return logits
        return self.lm_head(hidden)

    def quantize_tied_head(self, quantize: Callable[[torch.Tensor], nn.Module]) -> nn.Module | None:
        """With tied embeddings, give the head its own quantized copy of the embedding (the
        lookup stays dense). Returns the new head, or None when the head is not tied."""
        if self.lm_head is not None:
            return None
        self.lm_head = quantize(self.model.embed_tokens.weight)
        return self.lm_head

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters; every one must arrive."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            if self.tp.world_size > 1:
                tensor = self.shard_weight(name, tensor)
            target, offset = self.weight_location(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter")
            param = params[target]
            with torch.no_grad():
                if offset is None:
                    if param.shape != tensor.shape:
                        raise ValueError(
                            f"{name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}"
                        )
                    param.copy_(tensor)
                else:
                    rows = self._shard_rows(name)
                    if tensor.shape != (rows, *param.shape[1:]):
                        raise ValueError(
                            f"{name}: shape {tuple(tensor.shape)} != {(rows, *param.shape[1:])} "
                            "(the config's head counts or sizes do not match the checkpoint)"
                        )
                    param.narrow(0, offset, rows).copy_(tensor)
            loaded.add(f"{target}@{offset}")
        self._check_all_loaded(params, loaded)

    def weight_location(self, name: str) -> tuple[str, int | None]:
        """Our parameter for HF tensor `name`, and its first row there (None: the whole);
        rows are this rank's (at tp 1, all of them)."""
        fused = self._fused_part(name)
        return (name, None) if fused is None else fused[:2]

    def _shard_rows(self, name: str) -> int:
        """The rows of fused part `name` (q, k, v, gate or up) in its parameter on this rank."""
        fused = self._fused_part(name)
        if fused is None:
            raise KeyError(name)
        return fused[2]

    def _fused_part(self, name: str) -> tuple[str, int, int] | None:
        """(our fused parameter, first row, rows) of HF tensor `name` where it is one part of
        a fused parameter (q/k/v of qkv_proj, gate/up of gate_up_proj), else None."""
        attn, mlp = self.model.layers[0].self_attn, self.model.layers[0].mlp
        for fused, part, shard in _STACKED:
            if f".{part}." not in name:
                continue
            target = name.replace(f".{part}.", f".{fused}.")
            if shard == "q":
                return target, 0, attn.q_size
            if shard == "k":
                return target, attn.q_size, attn.kv_size
            if shard == "v":
                return target, attn.q_size + attn.kv_size, attn.kv_size
            rows = mlp.local_intermediate_size
            return target, shard * rows, rows
        return None

    def shard_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full checkpoint tensor `name` (replicated ones whole)."""
        cfg, tp = self.config, self.tp
        hd = cfg.head_dim
        leaf = name.split(".")[-2] if name.count(".") else name
        if leaf == "q_proj":
            start, end = tp.shard_range(cfg.num_attention_heads, "the attention heads")
            return tensor[start * hd : end * hd]
        if leaf in ("k_proj", "v_proj"):
            _, local_kv = local_head_counts(
                cfg.num_attention_heads, cfg.num_key_value_heads, tp.world_size
            )
            first = kv_head_start(cfg.num_key_value_heads, tp.world_size, tp.rank)
            return tensor[first * hd : (first + local_kv) * hd]
        if leaf in ("gate_proj", "up_proj"):
            start, end = tp.shard_range(cfg.intermediate_size, "the MLP's intermediate size")
            return tensor[start:end]
        if leaf in ("o_proj", "down_proj") and name.endswith(".weight"):
            n = tensor.shape[1]
            start, end = tp.shard_range(n, f"{leaf}'s input columns")
            return tensor[:, start:end]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, rows = vocab_shard(cfg.vocab_size, tp)
            shard = tensor.new_zeros(rows, *tensor.shape[1:])
            part = tensor[start : start + rows]
            shard[: part.shape[0]] = part
            return shard
        return tensor  # norms, down_proj's bias: replicated

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        """Every parameter arrived, and every part of a fused one (a checkpoint without k_proj
        loaded, its rows left as initialised)."""
        missing = []
        for name in params:
            parts = [
                (f".{fused}.", f".{part}.") for fused, part, _ in _STACKED if f".{fused}." in name
            ]
            if not parts:
                if f"{name}@None" not in loaded:
                    missing.append(name)
                continue
            for fused, part in parts:
                hf_name = name.replace(fused, part)
                target, offset = self.weight_location(hf_name)
                if f"{target}@{offset}" not in loaded:
                    missing.append(hf_name)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
