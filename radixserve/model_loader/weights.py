"""Hugging Face model directories: config.json, weight files, and the tokenizer dispatcher.

The model loader calls ``load_hf_config`` and ``iter_safetensors_weights`` for a directory
checkpoint; ``load_tokenizer`` picks the right tokenizer for either a directory or a GGUF file and
is what the tokenizer/detokenizer processes call. torch and transformers are imported lazily so
that importing this module stays cheap for those processes.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from radixserve.model_loader.gguf_loader import load_gguf_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"


def load_hf_config(model_dir: str) -> dict[str, Any]:
    """The parsed config.json of a Hugging Face model directory, its eos_token_id a list that
    also holds generation_config.json's (as transformers' generate stops: Llama 3 Instruct's
    config names <|end_of_text|>, its generation config <|eot_id|> too, which ends each
    chat reply)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    eos = _token_ids(cfg.get("eos_token_id"))
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        try:
            with open(gen_path, encoding="utf-8") as f:
                gen = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{gen_path} is not valid JSON: {e}") from None
        if isinstance(gen, dict):
            eos += [t for t in _token_ids(gen.get("eos_token_id")) if t not in eos]
    if eos:
        cfg["eos_token_id"] = eos
    return cfg


# generation_config.json's sampling fields that OpenAI requests take as their defaults, with the
# values each may hold (as the API's own ranges; HF's top_k 0 means no top-k and is skipped).
SAMPLING_DEFAULT_FIELDS: dict[str, Any] = {
    "temperature": lambda v: 0 <= v,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: isinstance(v, int) and v >= 1,
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: 0 < v <= 2,
}


def load_sampling_defaults(model_path: str | None) -> dict[str, Any]:
    """The sampling fields a Hugging Face model directory's generation_config.json sets (the
    values its authors recommend), those in range; {} for a GGUF file or no such file."""
    if model_path is None or not os.path.isdir(model_path):
        return {}
    path = os.path.join(model_path, "generation_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    except (OSError, ValueError):  # none (a bad one is refused at start by load_hf_config)
        return {}
    out: dict[str, Any] = {}
    for name, ok in SAMPLING_DEFAULT_FIELDS.items():
        value = gen.get(name) if isinstance(gen, dict) else None
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and math.isfinite(value) and ok(value):
            out[name] = value
        elif not (name == "top_k" and value == 0):
            logger.warning("generation_config.json: %s %r is out of range; ignored", name, value)
    return out


def _token_ids(value: Any) -> list[int]:
    """A config's token id field (an id, a list of them, or null) as a list."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def iter_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every *.safetensors in ``model_dir`` (pytorch_model*.bin if none).

    With a ``model.safetensors.index.json`` only the shards it names are read, so stray files
    (e.g. a ``consolidated.safetensors`` next to the HF shards) are not loaded twice.
    """
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    shards = safetensors_shards(model_dir)
    if shards:
        yield from _iter_safetensors(shards)
        return
    bins = torch_bin_files(model_dir)
    if not bins:
        raise FileNotFoundError(
            f"no *.safetensors or pytorch_model*.bin weight files in {model_dir}"
        )
    yield from _iter_torch_bins(bins)


def load_tokenizer(
    path: str, gguf_file: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a HF directory, a GGUF file (by its name or, named otherwise, its
    magic: --load-format gguf serves such a file), or ``gguf_file`` inside ``path``.
    `trust_remote_code` (--trust-remote-code) runs a directory's own tokenizer class."""
    if gguf_file is not None:
        path = os.path.join(path, gguf_file)
    if path.endswith(".gguf") or is_gguf_file(path):
        return load_gguf_tokenizer(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer path not found (expected a directory or .gguf): {path}")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # (a damaged tokenizer.json said only "JSONDecodeError: line 111")
        hint = " (--trust-remote-code runs it)" if "trust_remote_code" in str(e) else ""
        message = f"cannot load the tokenizer from {path}{hint}: {type(e).__name__}: {e}"
        raise ValueError(message) from e


def is_gguf_file(path: str) -> bool:
    """A file that starts with GGUF's magic, whatever its name."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:  # a directory, or not there
        return False


def torch_bin_files(model_dir: str) -> list[str]:
    """A directory's PyTorch weight files (read where it has no safetensors)."""
    return sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin")))


def safetensors_shards(model_dir: str) -> list[str]:
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if not os.path.isfile(index_path):
        return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    with open(index_path, encoding="utf-8") as f:
        names = sorted(set(json.load(f)["weight_map"].values()))
    shards = [os.path.join(model_dir, name) for name in names]
    missing = [s for s in shards if not os.path.isfile(s)]
    if missing:
        raise FileNotFoundError(f"{SAFETENSORS_INDEX} names missing shards: {', '.join(missing)}")
    return shards


def check_safetensors_file(path: str) -> None:
    """Raise ValueError where a safetensors file is not whole: its header (an 8-byte length,
    then JSON) or the tensor data it describes runs past the file's end."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if 8 + n > size:
                raise ValueError(f"its header needs {8 + n} bytes")
            header = json.loads(f.read(n))
        end = max(
            (t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0
        )
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{path} is not a whole safetensors file ({e})") from None
    if 8 + n + end > size:
        raise ValueError(
            f"{path} is cut short: its tensors end at byte {8 + n + end}, the file at {size} "
            "(a copy or download that did not finish?)"
        )


def _iter_safetensors(shards: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the shards, with a progress bar over all of them on a terminal."""
    import sys

    from safetensors import safe_open

    from radixserve.utils import progress_bar

    total = 0
    for shard in shards:
        with safe_open(shard, framework="pt", device="cpu") as f:
            total += len(f.keys())
    with progress_bar(
        total=total, desc="Loading weights", unit="tensor", file=sys.stderr, disable=None
    ) as bar:
        for shard in shards:
            logger.info("loading %s", os.path.basename(shard))
            with safe_open(shard, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update()


def _iter_torch_bins(bins: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    import torch

    for path in bins:
        logger.info("loading %s", os.path.basename(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
        yield from state.items()
        del state
