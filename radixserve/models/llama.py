"""The Llama family: Llama / SmolLM2 (GQA, RoPE, RMSNorm, SiLU-gated MLP), Qwen2 (qkv bias) and
Qwen3 (per-head q/k RMSNorm), with fused qkv and gate_up projections.

`forward` returns hidden states for the packed tokens; the LogitsProcessor in the ModelRunner
applies lm_head only to the rows that are sampled. `load_weights` takes Hugging Face names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.attention.base import AttentionLayer
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import Linear, linear
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.model_executor.forward_batch import ForwardBatch
from radixserve.model_loader.model_config import ModelConfig

RopeTables = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) rows of this step's positions


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
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
        q, k = RotaryEmbedding.apply(rope, q, k)
        assert fb.attn_backend is not None
        out = fb.attn_backend.forward(q, k, v, self.attn, fb)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope: RopeTables, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), fb)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(fb.input_ids)
        rope = self.rotary.cos_sin(fb.positions, x.dtype)
        for layer in self.layers:
            x = layer(rope, x, fb)
        return self.norm(x)


# (fused parameter, HF parameter, shard id) — how HF's separate projections pack into ours.
_STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the given hidden rows (the head is the embedding when tied)."""
        if self.lm_head is None:
            return linear(hidden, self.model.embed_tokens.weight)
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
                    param.narrow(0, offset, tensor.shape[0]).copy_(tensor)
            loaded.add(f"{target}@{offset}")
        self._check_all_loaded(params, loaded)

    def weight_location(self, name: str) -> tuple[str, int | None]:
        """Our parameter for HF tensor `name`, and its first row there (None: the whole)."""
        cfg = self.config
        for fused, part, shard in _STACKED:
            if f".{part}." not in name:
                continue
            target = name.replace(f".{part}.", f".{fused}.")
            if shard == "q":
                return target, 0
            kv = cfg.num_key_value_heads * cfg.head_dim
            q = cfg.num_attention_heads * cfg.head_dim
            if shard == "k":
                return target, q
            if shard == "v":
                return target, q + kv
            return target, shard * cfg.intermediate_size
        return name, None

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            if not any(key.split("@")[0] == name for key in loaded):
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
