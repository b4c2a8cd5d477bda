"""Resolve a model path and format, build the model, load its weights.

Formats: a Hugging Face directory (config.json + *.safetensors), a GGUF file (dequantized on
load), or `dummy` (random weights from a config.json, for tests and benchmarks). With no
--model-path the default model (SmolLM2-135M-Instruct GGUF) is fetched once into the cache.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.model_loader.model_config import ModelConfig, rope_scaling_type

if TYPE_CHECKING:
    from radixserve.distributed.parallel_state import TpGroup

logger = logging.getLogger(__name__)
ALLOW_LONGER_CONTEXT_ENV = "RADIXSERVE_ALLOW_LONGER_CONTEXT"

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e5m2": torch.float8_e5m2,  # KV cache only (args.KV_CACHE_DTYPES)
    "fp8_e4m3": torch.float8_e4m3fn,
}


def to_torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def resolve_model_path(model_path: str | None, flag: str = "--model-path") -> str:
    """The model's path: the given one, which must exist, or the default model's (fetched on
    first use)."""
    if model_path is None:
        from radixserve.model_loader.default_model import ensure_default_model

        return ensure_default_model()
    _require_exists(model_path, flag)
    return model_path


def check_model_path(
    path: str | None, flag: str = "--model-path", load_format: str = "auto"
) -> None:
    """Refuse, before any process starts, a path that holds no model (or, for
    --tokenizer-path, no tokenizer): missing, a file that is not a .gguf (unless --load-format
    gguf says it is one), a model directory without config.json, or a path of the other kind
    than --load-format names. None is the default model."""
    if path is None:
        return
    _require_exists(path, flag)
    if flag == "--tokenizer-path":  # a tokenizer's directory, or the GGUF file that holds one
        from radixserve.model_loader.weights import is_gguf_file

        if not os.path.isdir(path) and not path.endswith(".gguf") and not is_gguf_file(path):
            raise FileNotFoundError(f"{flag} {path!r} is neither a .gguf file nor a directory")
        return
    if os.path.isdir(path):
        if load_format == "gguf":
            raise ValueError(
                f"--load-format gguf needs a .gguf file; {flag} {path!r} is a directory"
            )
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(
                f"{flag} {path!r} is a directory without config.json: not a Hugging Face model"
            )
    elif load_format in ("safetensors", "dummy"):
        raise ValueError(
            f"--load-format {load_format} needs a model directory (config.json); {flag} "
            f"{path!r} is a file"
        )
    elif load_format == "auto" and not path.endswith(".gguf"):
        raise FileNotFoundError(f"{flag} {path!r} is neither a .gguf file nor a directory")


# Files one of which a Hugging Face tokenizer directory holds (fast, SentencePiece, byte-level
# BPE, WordPiece, tiktoken): AutoTokenizer without any of them fails with a message about
# converting slow tokenizers, after the weights have loaded.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def check_tokenizer_path(model_path: str | None, tokenizer_path: str | None) -> None:
    """Refuse, before any process starts, a tokenizer directory (--tokenizer-path, or the
    model's directory without it) that holds no tokenizer files."""
    path, flag = (tokenizer_path, "--tokenizer-path") if tokenizer_path else (model_path, None)
    if path is None or not os.path.isdir(path):
        return
    names = os.listdir(path)
    if any(n in _TOKENIZER_FILES or n.endswith(".tiktoken") for n in names):
        return
    where = f"{flag} {path!r}" if flag else f"the model directory {path!r}"
    hint = "" if flag else "; pass --tokenizer-path with a tokenizer's directory or .gguf file"
    raise FileNotFoundError(
        f"{where} holds no tokenizer files ({', '.join(_TOKENIZER_FILES)} or *.tiktoken){hint}"
    )


def check_model_files(server_args: Any) -> None:
    """Everything the serve command and the Engine refuse before a process starts: the model
    path, its config (and --context-length), --tokenizer-path, the tokenizer's files, the
    draft model's path."""
    path, load_format = server_args.model_path, server_args.load_format
    check_model_path(path, load_format=load_format)
    if path is None:  # the default model, where it is fetched already (else the scheduler does)
        from radixserve.model_loader.default_model import cached_default_model

        path = cached_default_model()
    check_model_config(path, load_format, server_args.context_length, server_args.tp_size)
    check_weight_files(path, load_format)
    check_model_path(server_args.tokenizer_path, "--tokenizer-path")
    check_tokenizer_path(path, server_args.tokenizer_path)
    draft = server_args.speculative_draft_model_path
    check_model_path(draft, "--speculative-draft-model-path", load_format)


def check_weight_files(path: str | None, load_format: str) -> None:
    """Refuse, before any process starts, a model directory without weight files or with a
    safetensors file cut short (a copy or download that did not finish): found by the
    scheduler instead, it was a traceback after the model began to load."""
    if path is None or not os.path.isdir(path) or load_format not in ("auto", "safetensors"):
        return
    from radixserve.model_loader.weights import (
        check_safetensors_file,
        safetensors_shards,
        torch_bin_files,
    )

    shards = safetensors_shards(path)
    if not shards and not torch_bin_files(path):
        raise FileNotFoundError(
            f"the model directory {path!r} holds no weights (*.safetensors or pytorch_model*.bin)"
        )
    for shard in shards:
        check_safetensors_file(shard)


def _require_exists(path: str, flag: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{flag} {path!r} does not exist (give a Hugging Face directory or a .gguf file; "
            "weights are never downloaded from a hub)"
        )


def check_model_config(
    model_path: str | None, load_format: str, context_length: int | None, tp_size: int = 1
) -> None:
    """Refuse, before any process starts, a model config that cannot be served (an unknown
    architecture, a missing field, heads that --tp-size cannot split, a GGUF cut short) or a
    --context-length past its positions: found by the scheduler instead, it was a traceback
    after seconds of start-up. A GGUF's full metadata takes seconds to read, so it is read
    here only when --context-length needs it; its header is enough for the rest."""
    if model_path is None:
        return
    fmt = detect_load_format(model_path, load_format)
    if fmt == "gguf":
        from radixserve.model_loader.gguf_loader import check_gguf_header

        check_gguf_header(model_path, tp_size)
        if context_length is None:
            return
    cfg = load_model_config(model_path, fmt)
    check_context_length(cfg, context_length, warn=False)
    if tp_size > 1:
        from radixserve.distributed.parallel_state import local_head_counts

        local_head_counts(cfg.num_attention_heads, cfg.num_key_value_heads, tp_size)


def detect_load_format(model_path: str, load_format: str) -> str:
    if load_format != "auto":
        return load_format
    if model_path.endswith(".gguf"):
        return "gguf"
    if os.path.isdir(model_path):
        return "safetensors"
    raise ValueError(f"cannot tell the format of {model_path!r}; pass --load-format")


def load_model_config(model_path: str, load_format: str) -> ModelConfig:
    if load_format == "gguf":
        from radixserve.model_loader.gguf_loader import gguf_to_hf_config

        return ModelConfig.from_hf_config(gguf_to_hf_config(model_path))
    from radixserve.model_loader.weights import load_hf_config

    return ModelConfig.from_hf_config(load_hf_config(model_path))


def _iter_weights(
    model_path: str, load_format: str, q4_blocks: dict | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    if load_format == "gguf":
        from radixserve.model_loader.gguf_loader import iter_gguf_weights

        return iter_gguf_weights(model_path, q4_blocks=q4_blocks)
    from radixserve.model_loader.weights import iter_safetensors_weights

    return iter_safetensors_weights(model_path)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights (normal, std 0.02; norms at 1) so a dummy model produces varied tokens."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def load_model(
    model_path: str,
    load_format: str,
    dtype: str,
    device: str,
    seed: int = 0,
    context_length: int | None = None,
    quantization: str | None = None,
    tp: TpGroup | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Build the model for `model_path` and load its weights; returns (model, config).

    With `quantization` (int8 / int4) the linear layers are quantized from the fp32 weights
    before the dtype cast; GGUF Q4 tensors keep their own codes under int4. With `tp` (more
    than one rank) the model holds this rank's shard: its load_weights narrows each full tensor
    (the dummy format draws random shards).
    """
    from radixserve.models.registry import get_model_class

    cfg = load_model_config(model_path, load_format)
    if check_context_length(cfg, context_length):
        cfg = _with_max_positions(cfg, context_length)  # type: ignore[arg-type]
    model = get_model_class(cfg)(cfg) if tp is None else get_model_class(cfg)(cfg, tp)
    q4_blocks: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = (
        {} if quantization == "int4" else None
    )
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        logger.info("loading weights from %s (%s)", model_path, load_format)
        model.load_weights(_iter_weights(model_path, load_format, q4_blocks))
    if load_format == "gguf" and not quantization and tp is None and device == "cpu":
        _hint_stored_quantization(model_path, dtype)
    if quantization:
        from radixserve.layers.quantization import quantize_model

        quantize_model(model, quantization, _block_params_by_weight(model, q4_blocks or {}))
    model = model.to(device=device, dtype=to_torch_dtype(dtype)).eval()
    return model, cfg


def _hint_stored_quantization(model_path: str, dtype: str) -> None:
    """Say so when a GGUF's weights could run as stored: they were just dequantized. On a CPU
    with AMX, bf16 multiplies on the tile unit and the stored codes on VNNI, so there bf16
    stays the faster form for prompts and full batches (docs/performance.md: int4 prefills at
    about half bf16's rate on a 2-core Xeon, and its decode step falls behind from ~64 rows)."""
    from radixserve import args as rs_args
    from radixserve.model_loader.gguf_loader import stored_quantization

    method, kinds = stored_quantization(model_path)
    if method:
        amx = dtype == "bfloat16" and rs_args.cpu_has_amx()
        logger.info(
            "this GGUF stores its block weights as %s, dequantized here to %s; "
            "--quantization %s runs them as stored, as llama.cpp does (a fraction of the "
            "weight bytes per step: faster for few users%s)",
            "/".join(kinds),
            dtype,
            method,
            "; with AMX, as here, bf16 runs prompts and full batches faster" if amx else "",
        )


def _block_params_by_weight(model: nn.Module, q4_blocks: dict) -> dict[str, list]:
    """GGUF Q4 block parameters keyed by HF tensor name -> by our (fused) weight name and row."""
    from radixserve.layers.quantization import BlockParams

    out: dict[str, list[BlockParams]] = {}
    for hf_name, (scale, minimum) in q4_blocks.items():
        target, offset = model.weight_location(hf_name)
        out.setdefault(target, []).append(BlockParams(offset or 0, scale, minimum))
    return out


def check_context_length(cfg: ModelConfig, context_length: int | None, warn: bool = True) -> bool:
    """Whether --context-length extends the model's positions. Past what it was trained for
    its output degrades (and its rotary table grows with the length: 10**8 positions took
    tens of GB), so that is refused unless RADIXSERVE_ALLOW_LONGER_CONTEXT=1 says it is meant
    (SGLang's SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN)."""
    trained = cfg.max_position_embeddings
    window = cfg.attention_window
    if window is not None and (context_length or trained) > window:
        raise ValueError(
            f"sliding-window attention ({cfg.architecture}, sliding_window {window}) is not "
            f"implemented: every layer here attends to the whole context, which is the same "
            f"within the window only; serve --context-length {window} or less"
        )
    if not context_length or context_length <= trained:
        return False
    if rope_scaling_type(cfg.rope_scaling) == "dynamic":
        raise ValueError(
            f"--context-length {context_length} is longer than the model's {trained} positions, "
            "past which its dynamic NTK rope_scaling rescales every position as the sequence "
            "grows: not supported"
        )
    if os.environ.get(ALLOW_LONGER_CONTEXT_ENV) != "1":
        raise ValueError(
            f"--context-length {context_length} is longer than the model's "
            f"{trained} positions; set {ALLOW_LONGER_CONTEXT_ENV}=1 to serve it anyway"
        )
    if warn:
        logger.warning(
            "--context-length %d extends the model's %d positions: quality past them is not "
            "what it was trained for",
            context_length,
            trained,
        )
    return True


def _with_max_positions(cfg: ModelConfig, n: int) -> ModelConfig:
    from dataclasses import replace

    return replace(cfg, max_position_embeddings=n)
