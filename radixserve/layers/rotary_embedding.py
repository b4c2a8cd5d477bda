"""Rotary position embedding (neox / rotate-half layout) with Llama-family rope_scaling.

The cos/sin table is computed once for all positions in fp32 exactly as transformers computes
it (inv_freq times position, then cos/sin times the attention scaling), so positions index it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from radixserve.model_loader.model_config import rope_scaling_type


def _default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = s["factor"]
    low_freq_factor = s["low_freq_factor"]
    high_freq_factor = s["high_freq_factor"]
    old_context_len = s["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_inv_freq(
    head_dim: int, base: float, s: dict[str, Any], max_pos: int
) -> tuple[torch.Tensor, float]:
    """YaRN as transformers computes it (ModelConfig pins original_max_position_embeddings and
    the factor): the attention factor from factor, or from mscale / mscale_all_dim where both
    are given; the correction range truncated to whole dims unless truncate is false."""
    factor = s["factor"]
    orig = s.get("original_max_position_embeddings") or max_pos
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1
    mscale = s.get("attention_factor")
    if mscale is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        mscale = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else None
        mscale = _yarn_mscale(factor) if mscale is None else mscale

    def correction_dim(num_rot: float) -> float:
        return (head_dim * math.log(orig / (num_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    extra_factor = 1 - ramp
    return inv_inter * (1 - extra_factor) + inv_extra * extra_factor, float(mscale)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def compute_inv_freq(
    head_dim: int, base: float, scaling: dict[str, Any] | None, max_pos: int
) -> tuple[torch.Tensor, float]:
    """Return (inv_freq, attention_scaling) for the rope type in `scaling`."""
    rope_type = rope_scaling_type(scaling)
    inv_freq = _default_inv_freq(head_dim, base)
    if rope_type in ("default", "dynamic"):  # dynamic NTK: the default within the positions
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "freq_factors":  # a GGUF's rope_freqs tensor: llama.cpp divides by them
        factors = torch.tensor(scaling["factors"], dtype=inv_freq.dtype)
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"rope frequency factors: {factors.numel()} for {inv_freq.numel()} frequencies"
            )
        return inv_freq / factors, 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, scaling, max_pos)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported")


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        inv_freq, attn_scale = compute_inv_freq(head_dim, base, scaling, max_position)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Plain attributes, not buffers: model.to(dtype) must not round the fp32 table.
        self.cos_cached = emb.cos() * attn_scale
        self.sin_cached = emb.sin() * attn_scale

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The [T, 1, D] cos and sin rows of `positions`; computed once per step, used by all
        layers."""
        if self.cos_cached.device != positions.device:
            self.cos_cached = self.cos_cached.to(positions.device)
            self.sin_cached = self.sin_cached.to(positions.device)
        cos = self.cos_cached[positions].to(dtype).unsqueeze(1)
        sin = self.sin_cached[positions].to(dtype).unsqueeze(1)
        return cos, sin

    @staticmethod
    def apply(
        cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; returns rotated copies."""
        cos, sin = cos_sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
