"""Architecture name (config.json `architectures[0]`) → model class."""

from __future__ import annotations

from torch import nn

from radixserve.model_loader.model_config import ModelConfig
from radixserve.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # (sliding windows refused by ModelConfig)
    "Qwen2ForCausalLM": LlamaForCausalLM,  # qkv bias from the config
    "Qwen3ForCausalLM": LlamaForCausalLM,  # q/k norm from the config
}


def get_model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}") from None
