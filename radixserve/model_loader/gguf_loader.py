"""GGUF checkpoints: a Hugging Face config, float32 weights under Hugging Face names, a tokenizer.

The model loader calls ``gguf_to_hf_config`` (fed to ``ModelConfig.from_hf_config``) and
``iter_gguf_weights`` (fed to the model's ``load_weights``); the tokenizer processes call
``load_gguf_tokenizer``. Supported GGUF architectures: llama, qwen2, qwen3.

Weights are dequantized with ``gguf.quants.dequantize`` (every type gguf-py implements) one tensor
at a time. llama.cpp's converter permutes the rows of Llama q/k projections so that rotary pairs
are adjacent (GPT-J style); we undo that so the weights match the Hugging Face (NeoX style)
layout. qwen2/qwen3 are not permuted by llama.cpp.

torch and transformers are imported lazily: the tokenizer processes import this module.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

if TYPE_CHECKING:
    import torch
    from gguf.gguf_reader import ReaderTensor
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# GGUF architecture -> (HF architectures entry, HF model_type)
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_MODULES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama-3 rope scaling, as llama.cpp stores it: a factor per rotary frequency (it divides each
# frequency by its factor), read into rope_scaling {"rope_type": "freq_factors"}.
_ROPE_FREQS = "rope_freqs.weight"

# llama.cpp rope-scaling metadata suffix -> HF rope_scaling key
_ROPE_SCALING_KEYS = {
    "factor": "factor",
    "original_context_length": "original_max_position_embeddings",
    "attn_factor": "attention_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}


def open_gguf(path: str) -> GGUFReader:
    """Open a GGUF file (memory-mapped; tensors are read lazily).

    Parsing the metadata takes seconds for a 49k-token vocabulary, and a load reads it twice
    (config, then weights), so the last readers are kept, keyed by the file's identity.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    st = os.stat(path)
    return _cached_reader(os.path.abspath(path), st.st_mtime_ns, st.st_size, st.st_ino)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int, inode: int) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as e:  # (numpy's "cannot reshape", "GGUF magic invalid")
        raise ValueError(
            f"{path} is not a readable GGUF file (a truncated or corrupt download?): {e}"
        ) from None


def gguf_to_hf_config(path: str | GGUFReader) -> dict[str, Any]:
    """Build a Hugging Face-style config dict from the GGUF metadata."""
    reader = path if isinstance(path, GGUFReader) else open_gguf(path)
    arch = _architecture(reader)
    tensors = {t.name: t for t in reader.tensors}

    def meta(suffix: str, default: Any = None) -> Any:
        value = _metadata(reader, f"{arch}.{suffix}")
        return default if value is None else value

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    head_dim = meta("attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = meta("rope.dimension_count")
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch][0]],
        "model_type": GGUF_ARCHITECTURES[arch][1],
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        # The embedding's row count is authoritative; metadata vocab_size is often absent.
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        "hidden_act": "silu",
    }
    rope_scaling = _rope_scaling(reader, arch)
    if _ROPE_FREQS in tensors:  # (Llama 3.1/3.2: their outputs differed from the model's)
        factors = _dequantize(tensors[_ROPE_FREQS]).reshape(-1)
        rope_scaling = {"rope_type": "freq_factors", "factors": factors.tolist()}
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    for key in ("bos", "eos", "padding"):
        token_id = _metadata(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token_id)
    # End-of-turn and end-of-message tokens end generation too (llama.cpp's end-of-generation
    # set; Llama 3's <|eot_id|> ends each chat reply, its eos is <|end_of_text|>).
    eos = [config["eos_token_id"]] if "eos_token_id" in config else []
    for key in ("eot", "eom"):
        token_id = _metadata(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and int(token_id) not in eos:
            eos.append(int(token_id))
    if len(eos) > 1:
        config["eos_token_id"] = eos
    return config


def iter_gguf_weights(
    path: str | GGUFReader,
    show_progress: bool = True,
    q4_blocks: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, float32 tensor in [out, in] layout) for every GGUF tensor.

    ``lm_head.weight`` is yielded only when the file has ``output.weight`` (else it is tied).
    With ``q4_blocks`` given, each Q4_0 / Q4_1 tensor's block parameters are stored there
    under its HF name (see ``q4_block_params``), so int4 quantization can keep its codes.
    """
    import torch

    from radixserve.utils import progress_bar

    reader = path if isinstance(path, GGUFReader) else open_gguf(path)
    config = gguf_to_hf_config(reader)
    unpermute = config["model_type"] == "llama"
    start = time.perf_counter()
    logger.info("dequantizing %d GGUF tensors", len(reader.tensors))
    bar = progress_bar(
        reader.tensors,
        desc="Dequantizing GGUF",
        unit="tensor",
        file=sys.stderr,
        disable=None if show_progress else True,  # None: show only on a terminal
    )
    for tensor in bar:
        if tensor.name == _ROPE_FREQS:
            continue  # read into the config's rope_scaling
        hf_name = gguf_to_hf_name(tensor.name)
        array = _dequantize(tensor)
        blocks = q4_block_params(tensor) if q4_blocks is not None else None
        if unpermute and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            is_q = ".q_proj." in hf_name
            n_head = config["num_attention_heads" if is_q else "num_key_value_heads"]
            array = unpermute_llama_qk(array, n_head)
            if blocks is not None:
                blocks = tuple(unpermute_llama_qk(b, n_head) for b in blocks)
        if blocks is not None and q4_blocks is not None:
            q4_blocks[hf_name] = (torch.from_numpy(blocks[0]), torch.from_numpy(blocks[1]))
        yield hf_name, torch.from_numpy(array)
    logger.info("dequantized GGUF weights in %.1f s", time.perf_counter() - start)


# A block's linear layers: the layer modules that map to an HF *_proj.
_LINEAR_MODULES = {gg for gg, hf in _LAYER_MODULES.items() if hf.endswith("_proj")}
_Q4 = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)


def _is_block_linear_weight(gguf_name: str) -> bool:
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    return match is not None and match[2] in _LINEAR_MODULES and match[3] == "weight"


def stored_quantization(path: str | GGUFReader) -> tuple[str | None, list[str]]:
    """(the `--quantization` that runs a GGUF's block linear weights as stored, their types):
    int4 when every one is Q4_0 / Q4_1 (int4 keeps their codes), int8 when every one is Q8_0
    or Q4 (Q8_0's codes come back exactly from int8's groups of 32), else None."""
    reader = path if isinstance(path, GGUFReader) else open_gguf(path)
    kinds = [t.tensor_type for t in reader.tensors if _is_block_linear_weight(t.name)]
    names = sorted({k.name for k in kinds})
    if kinds and all(k in _Q4 for k in kinds):
        return "int4", names
    if kinds and all(k in (*_Q4, GGMLQuantizationType.Q8_0) for k in kinds):
        return "int8", names
    return None, names


def q4_block_params(tensor: ReaderTensor) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, minimum) of each 32-column block of a Q4_0 / Q4_1 tensor, [rows, K / 32] fp32,
    such that a block's value is code * scale + minimum; None for other types.

    Block layouts (ggml-common.h): Q4_0 = fp16 d + 16 bytes of codes, value (q - 8) * d;
    Q4_1 = fp16 d, fp16 m + 16 bytes of codes, value q * d + m.
    """
    kind = tensor.tensor_type
    if kind not in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        return None
    rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
    block_bytes = 18 if kind == GGMLQuantizationType.Q4_0 else 20
    raw = np.ascontiguousarray(tensor.data).reshape(rows, -1, block_bytes)

    def half(offset: int) -> np.ndarray:
        return np.ascontiguousarray(raw[..., offset : offset + 2]).view(np.float16)[..., 0]

    scale = half(0).astype(np.float32)
    if kind == GGMLQuantizationType.Q4_0:
        return scale, -8.0 * scale
    return scale, half(2).astype(np.float32)


def gguf_to_hf_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name (``blk.3.attn_q.weight``) to its HF parameter name."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_MODULES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r} (no Hugging Face equivalent)")
    layer, module, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_MODULES[module]}.{kind}"


def unpermute_llama_qk(array: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf ``LlamaModel.permute``).

    Within each head, llama.cpp stores row ``2*i + h`` for HF row ``h*dim/2 + i``
    (h in {0, 1}: the two rotary halves); reshaping to [head, dim/2, 2] and swapping the last
    two axes restores HF order. Works for weights [rows, in] and biases [rows].
    """
    rows = array.shape[0]
    if rows % (2 * n_head) != 0:
        raise ValueError(f"cannot un-permute {rows} rows over {n_head} heads")
    split = array.reshape(n_head, rows // n_head // 2, 2, *array.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2).reshape(array.shape))


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Build a transformers tokenizer from the GGUF's tokenizer metadata, with its chat template."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    from transformers import AutoTokenizer

    path = os.path.abspath(path)
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    if not getattr(tokenizer, "chat_template", None):
        template = _metadata(open_gguf(path), "tokenizer.chat_template")
        if template:
            tokenizer.chat_template = template
    return tokenizer


def _architecture(reader: GGUFReader) -> str:
    arch = _metadata(reader, "general.architecture")
    check_gguf_architecture(arch)
    return arch


def check_gguf_architecture(arch: object) -> None:
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {supported}")


# GGUF metadata value types: fixed sizes, and the string (8) and array (9) ones.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclass
class GgufHeader:
    """What a GGUF's header says without reading its tensors: the scalar and string metadata
    (arrays skipped) and the size the file must have to hold every tensor it lists."""

    metadata: dict[str, Any]
    size_needed: int
    tensor_types: frozenset[GGMLQuantizationType] = frozenset()


def read_gguf_header(path: str) -> GgufHeader | None:
    """The header alone (GGUFReader maps and indexes every tensor: seconds for a large file);
    None where it is not one this reads (GGUF v2/v3, little-endian). A header that cannot be
    read is a ValueError: the header holds the vocabulary (megabytes), so a download that
    stopped early ends there (the loader failed with a raw struct error after the start)."""
    import struct

    scalars = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
    scalars.update({10: "<Q", 11: "<q", 12: "<d"})

    def take(f: Any, fmt: str) -> Any:
        data = f.read(struct.calcsize(fmt))
        if len(data) != struct.calcsize(fmt):
            raise EOFError
        return struct.unpack(fmt, data)[0]

    def text(f: Any) -> str:
        n = take(f, "<Q")
        data = f.read(n)
        if len(data) != n:
            raise EOFError
        return data.decode("utf-8", "replace")

    def skip_value(f: Any, kind: int) -> None:
        if kind == _GGUF_STRING:
            f.seek(take(f, "<Q"), os.SEEK_CUR)
        elif kind == _GGUF_ARRAY:
            item, count = take(f, "<I"), take(f, "<Q")
            if item in _GGUF_SIZES:
                f.seek(count * _GGUF_SIZES[item], os.SEEK_CUR)
            else:
                for _ in range(count):
                    skip_value(f, item)
        else:
            f.seek(_GGUF_SIZES[kind], os.SEEK_CUR)

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or take(f, "<I") not in (2, 3):
                return None
    except (OSError, EOFError, struct.error):
        return None
    types: set[GGMLQuantizationType] = set()
    try:
        with open(path, "rb") as f:
            f.seek(8)
            n_tensors, n_pairs = take(f, "<Q"), take(f, "<Q")
            metadata: dict[str, Any] = {}
            for _ in range(n_pairs):
                key, kind = text(f), take(f, "<I")
                if kind == _GGUF_STRING:
                    metadata[key] = text(f)
                elif kind in scalars:
                    metadata[key] = take(f, scalars[kind])
                else:
                    skip_value(f, kind)
            data_end = 0
            for _ in range(n_tensors):
                text(f)  # the name
                numel = 1
                for _ in range(take(f, "<I")):
                    numel *= take(f, "<Q")
                kind = GGMLQuantizationType(take(f, "<I"))
                types.add(kind)
                block, block_bytes = GGML_QUANT_SIZES[kind]
                data_end = max(data_end, take(f, "<Q") + numel // block * block_bytes)
            align = metadata.get("general.alignment", 32)
            start = -(-f.tell() // align) * align
    except (OSError, EOFError, KeyError, ValueError, struct.error, OverflowError) as e:
        why = "it ends inside it" if isinstance(e, (EOFError, struct.error)) else repr(e)
        raise ValueError(
            f"the GGUF file {path} is cut short or damaged: its header cannot be read ({why}; "
            "a download or copy that did not finish?)"
        ) from None
    return GgufHeader(metadata, start + data_end, frozenset(types))


def check_gguf_header(path: str, tp_size: int = 1) -> None:
    """Refuse, before any process starts, a GGUF whose architecture is not served, that is
    shorter than its tensors (a download that did not finish: GGUFReader said "cannot reshape
    array" after the start-up), or whose heads --tp-size cannot split."""
    header = read_gguf_header(path)
    if header is None:
        return  # (the loader says what it is)
    arch = header.metadata.get("general.architecture")
    check_gguf_architecture(arch)
    size = os.path.getsize(path)
    if size < header.size_needed:
        raise ValueError(
            f"the GGUF file {path} is cut short: {size} bytes of the {header.size_needed} its "
            "tensors need (a download or copy that did not finish?)"
        )
    for kind in sorted(header.tensor_types):
        if not _dequantizable(kind):
            raise ValueError(
                f"the GGUF file {path} holds tensors of quant type {kind.name}, which the "
                "installed gguf package cannot dequantize"
            )
    heads = header.metadata.get(f"{arch}.attention.head_count")
    if tp_size > 1 and isinstance(heads, int):
        from radixserve.distributed.parallel_state import local_head_counts

        kv_heads = header.metadata.get(f"{arch}.attention.head_count_kv", heads)
        local_head_counts(heads, kv_heads, tp_size)


@functools.cache
def _dequantizable(kind: GGMLQuantizationType) -> bool:
    """Whether _dequantize reads this type: one block of zeros tried (the loader's
    NotImplementedError came after the start-up, with a traceback)."""
    _, block_bytes = GGML_QUANT_SIZES[kind]
    try:
        dequantize(np.zeros(block_bytes, dtype=np.uint8), kind)
    except NotImplementedError:
        return False
    return True


def _metadata(reader: GGUFReader, key: str) -> Any:
    """A scalar/string/array metadata value, or None when the key is absent."""
    field = reader.get_field(key)
    if field is None:
        return None
    value = field.contents()
    if field.types and field.types[0] == GGUFValueType.FLOAT32:
        # Shortest decimal that round-trips in float32: 1e-05, not 9.999999747378752e-06.
        value = float(str(np.float32(value)))
    return value


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    rope_type = _metadata(reader, f"{arch}.rope.scaling.type")
    linear = _metadata(reader, f"{arch}.rope.scale_linear")  # legacy key
    if rope_type in (None, "none"):
        if linear is None or float(linear) == 1.0:
            return None
        return {"rope_type": "linear", "factor": float(linear)}
    scaling: dict[str, Any] = {"rope_type": rope_type}
    for suffix, hf_key in _ROPE_SCALING_KEYS.items():
        value = _metadata(reader, f"{arch}.rope.scaling.{suffix}")
        if value is not None:
            scaling[hf_key] = value
    return scaling


def _dequantize(tensor: ReaderTensor) -> np.ndarray:
    """Dequantize one tensor to a writable float32 array in PyTorch [out, in] order."""
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise NotImplementedError(
            f"GGUF tensor {tensor.name}: quant type {tensor.tensor_type.name} is not supported "
            f"by the installed gguf package ({exc})"
        ) from exc
    # GGUF shapes list the fastest-varying dimension first: [in, out] -> torch [out, in].
    shape = tuple(int(d) for d in reversed(tensor.shape))
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, copy=True)  # F32 tensors are views of the read-only memmap
    return array
