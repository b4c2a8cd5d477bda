"""ModelConfig: the architecture numbers the engine needs, read from a Hugging Face config dict.

Built by the loader from config.json, from GGUF metadata, or (for the dummy format) from a
config dict; consumed by the model, the memory pools and the TokenizerManager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",  # Llama's computation, where no layer slides (Mistral 7B v0.2 on)
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v biases
    o_proj_bias: bool = False  # Llama's and Qwen3's attention_bias biases o_proj too (Qwen2's not)
    qk_norm: bool = False
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # A sliding window (some layer slides): up to this many tokens its attention is the full
    # attention computed here, which is as far as it is served (check_context_length).
    attention_window: int | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        try:
            return cls._from_hf_config(cfg)
        except KeyError as e:  # (a bare KeyError: 'num_attention_heads' named nothing else)
            raise ValueError(f"the model's config lacks {e.args[0]!r}") from None
        except (TypeError, ZeroDivisionError) as e:  # a field of the wrong type, a zero
            raise ValueError(f"the model's config is invalid: {e}") from None

    @classmethod
    def _from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        max_positions = cfg.get("max_position_embeddings", 4096)
        rope_scaling = _pin_original_positions(
            rope_scaling, max_positions, cfg.get("original_max_position_embeddings")
        )
        _refuse_what_the_model_does_not_compute(cfg, arch, rope_scaling)
        linear = rope_scaling if rope_scaling_type(rope_scaling) == "linear" else {}
        if linear and linear.get("original_max_position_embeddings") is None:
            # Linear scaling stretches the positions it was trained on by its factor: that is
            # its context (SGLang's and vLLM's rule; Vicuna 16k says 4096 positions, factor 4).
            max_positions = int(max_positions * float(linear["factor"]))
        window = cfg.get("sliding_window") if any(sliding_layers(cfg)) else None
        attention_bias = bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and arch != "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_scaling=rope_scaling,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            attention_window=window,
            hf_config=dict(cfg),
        )

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


def _pin_original_positions(
    scaling: dict[str, Any] | None, max_positions: int, top_level: int | None = None
) -> dict[str, Any] | None:
    """llama3 and YaRN read the context they were trained for from
    original_max_position_embeddings: the config's top-level field where it has one (it wins
    over rope_scaling's, as in transformers' standardize_rope_params), else rope_scaling's,
    else max_position_embeddings. Pin that now, so that a longer --context-length (which
    raises max_position_embeddings) leaves the frequencies alone; a missing YaRN factor is
    transformers' max / original."""
    kind = rope_scaling_type(scaling)
    if kind not in ("llama3", "yarn"):
        return scaling
    scaling = dict(scaling)  # type: ignore[arg-type]
    if top_level is not None:
        scaling["original_max_position_embeddings"] = top_level
    scaling.setdefault("original_max_position_embeddings", max_positions)
    if kind == "yarn" and scaling.get("factor") is None:
        scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]
    return scaling


def rope_scaling_type(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"


# What RotaryEmbedding computes ("freq_factors" is a GGUF's rope_freqs tensor). "dynamic"
# (dynamic NTK) is the default rotation at every position up to max_position_embeddings,
# which is as far as it is served (check_context_length refuses it past them).
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "freq_factors")


def sliding_layers(cfg: dict[str, Any]) -> list[bool]:
    """Which layers attend through a sliding window, as transformers' configs decide: the
    explicit layer_types; Mistral's every layer where it has a window; else Qwen2/Qwen3's
    rule, with use_sliding_window and a window the layers from max_window_layers (default
    28) on."""
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return [t == "sliding_attention" for t in cfg["layer_types"]]
    if "MistralForCausalLM" in (cfg.get("architectures") or []):  # every layer, given a window
        return [cfg.get("sliding_window") is not None] * n
    if not cfg.get("use_sliding_window") or cfg.get("sliding_window") is None:
        return [False] * n
    first = cfg.get("max_window_layers")
    first = 28 if first is None else first
    return [i >= first for i in range(n)]


def _refuse_what_the_model_does_not_compute(
    cfg: dict[str, Any], arch: str, scaling: dict[str, Any] | None
) -> None:
    """Config fields of these architectures that change the model's output and that the model
    here does not implement: refused at load rather than served with other tokens."""
    quant = cfg.get("quantization_config")
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
    method = str(getattr(method, "value", method))  # (transformers' QuantizationMethod enum)
    # Its tensors (scales, packed ints) were a KeyError in the scheduler. ("gguf": the weights
    # transformers dequantized from a GGUF file, saved plain.)
    if quant and method != "gguf":
        raise ValueError(
            f"pre-quantized checkpoints (quantization_config, quant_method {method!r}) are not "
            "supported: serve the unquantized weights (with --quantization int8, int4 or "
            "w8a8_int8) or a GGUF file"
        )
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported: the MLP here is SiLU-gated")
    rope_params = cfg.get("rope_parameters") or {}
    partial = cfg.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0
    if float((scaling or {}).get("partial_rotary_factor", partial)) != 1.0:
        raise ValueError("partial_rotary_factor < 1 is not supported: RoPE rotates every dim")
    rope_type = rope_scaling_type(scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; supported: "
            + ", ".join(SUPPORTED_ROPE_TYPES[:-1])
        )
    # Sliding-window attention: the full attention here computes it within the window only
    # (check_context_length serves no more).
    window = cfg.get("sliding_window")
    if any(sliding_layers(cfg)) and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding-window layers ({arch}) need a sliding_window, got {window!r}")
