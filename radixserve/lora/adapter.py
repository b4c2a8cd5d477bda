"""LoRA adapters in PEFT's format, read and checked against the model they adapt.

An adapter is a directory with `adapter_config.json` (r, lora_alpha, use_rslora, ...) and
`adapter_model.safetensors` (or `adapter_model.bin`) holding, for each adapted projection of
each decoder layer, `...layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight` [r, in] and
`lora_B.weight` [out, r]. A token's output gains `scaling · (x Aᵀ) Bᵀ`, scaling = alpha / r
(alpha / √r with rsLoRA), as PEFT computes it unmerged.

Adapted projections: q/k/v/o_proj and gate/up/down_proj (the fused qkv_proj and gate_up_proj
take their parts' deltas in their slices of the output). Anything else an adapter could hold
(DoRA, embedding or head adapters, modules_to_save, per-module ranks, trained biases) is refused
at load with the reason, never silently ignored.

`adapter_key` names an adapter's contents (a hash of its files): the radix cache and the
hierarchical cache's storage namespace a request's KV by it (DESIGN §3 extra_key), so two
adapters never share KV, and one adapter's KV stays valid across restarts and reloads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
ATTENTION_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_PROJS + MLP_PROJS
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.default)?\.weight$"
)


class LoRAError(ValueError):
    """An adapter that cannot be served (the message says which and why)."""


NO_LORA = "this server serves no LoRA adapters (start it with --enable-lora or --lora-paths)"


def is_adapter_name(name: str) -> bool:
    """Whether requests can name an adapter so: not empty, no whitespace, and no "|" (the
    separator of a request's cache namespace after its adapter's key: a P/D pair compares the
    part before it, and a name holding one was cut there, so two servers with different files
    under it paired)."""
    return bool(name) and "|" not in name and not any(c.isspace() for c in name)


def parse_lora_paths(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """--lora-paths items (`name=path`, or a path that names itself) as {name: path}."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            name = path = item
        name, path = name.strip(), path.strip()
        if not path or not is_adapter_name(name):
            raise LoRAError(
                f"--lora-paths: {item!r} is not name=path or a path "
                "(a name has no whitespace or '|')"
            )
        if name in out:
            raise LoRAError(f"--lora-paths: the name {name!r} is given twice")
        out[name] = path
    return out


def check_adapter_dir(path: str) -> None:
    """A LoRAError unless `path` holds an adapter's config and weights."""
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter {path!r} is not a directory")
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise LoRAError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    if _weight_file(path) is None:
        raise LoRAError(f"LoRA adapter {path!r} has none of {', '.join(WEIGHT_FILES)}")


def check_adapter_config(name: str, path: str, max_rank: int | None = None) -> LoRAConfig:
    """The adapter's config, read from its directory alone (what the serve command checks
    before any process starts): a LoRAError where it is not one this serves."""
    check_adapter_dir(path)
    config = LoRAConfig.load(path)
    if max_rank is not None and config.r > max_rank:
        raise LoRAError(
            f"LoRA adapter {name!r} has rank {config.r}, above --max-lora-rank {max_rank}"
        )
    return config


def _weight_file(path: str) -> str | None:
    for name in WEIGHT_FILES:
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    return None


def adapter_key(name: str, path: str) -> str:
    """The cache namespace of an adapter: its name and a hash of its config and weights."""
    h = hashlib.sha256()
    for file in (os.path.join(path, CONFIG_FILE), _weight_file(path)):
        assert file is not None
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return f"lora:{name}:{h.hexdigest()[:16]}"


@dataclass
class LoRAConfig:
    r: int
    alpha: float
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def load(cls, path: str) -> LoRAConfig:
        try:
            with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise LoRAError(f"LoRA adapter {path!r}: cannot read {CONFIG_FILE}: {e}") from None
        if not isinstance(cfg, dict):
            raise LoRAError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not an object")
        refused = {
            "use_dora": "DoRA adapters",
            "modules_to_save": "modules_to_save (fully trained modules beside the adapter)",
            "rank_pattern": "per-module ranks (rank_pattern)",
            "alpha_pattern": "per-module alphas (alpha_pattern)",
        }
        for key, what in refused.items():
            if cfg.get(key):
                raise LoRAError(f"LoRA adapter {path!r}: {what} are not supported")
        if cfg.get("bias", "none") != "none":
            raise LoRAError(f"LoRA adapter {path!r}: trained biases (bias={cfg['bias']!r})")
        # PEFT's LoraConfig writes lora_alpha; a config without it means PEFT's default, 8
        # (not r: the adapter's scale came out r / 8 times PEFT's).
        r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
        rslora = cfg.get("use_rslora", False)
        # (bool is an int to Python: "r": true was rank 1; "use_rslora": "false" was true)
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise LoRAError(f"LoRA adapter {path!r}: r must be a positive integer, got {r!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise LoRAError(f"LoRA adapter {path!r}: lora_alpha must be a number, got {alpha!r}")
        if not isinstance(rslora, bool):
            raise LoRAError(f"LoRA adapter {path!r}: use_rslora must be true or false")
        try:
            alpha = float(alpha)  # an integer beyond a float's range overflows
        except OverflowError:
            alpha = math.inf
        if not math.isfinite(alpha):
            raise LoRAError(f"LoRA adapter {path!r}: lora_alpha must be finite, got {alpha}")
        return cls(r=r, alpha=alpha, use_rslora=rslora)


@dataclass
class ModelShape:
    """What an adapter is checked against: the full (unsharded) in/out size of each target
    projection, and the number of decoder layers."""

    num_layers: int
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)  # proj -> (in, out)

    @classmethod
    def of(cls, cfg) -> ModelShape:  # a ModelConfig
        h, d = cfg.hidden_size, cfg.head_dim
        q, kv, inter = (
            cfg.num_attention_heads * d,
            cfg.num_key_value_heads * d,
            cfg.intermediate_size,
        )
        sizes = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, inter),
            "up_proj": (h, inter),
            "down_proj": (inter, h),
        }
        return cls(cfg.num_hidden_layers, sizes)


@dataclass
class LoRAAdapter:
    """One adapter's tensors as in its file: (layer, proj) -> (A [r, in], B [out, r])."""

    name: str
    path: str
    config: LoRAConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return self.config.r

    @classmethod
    def load(
        cls, name: str, path: str, shape: ModelShape, max_rank: int | None = None
    ) -> LoRAAdapter:
        config = check_adapter_config(name, path, max_rank)
        tensors = _read_tensors(_weight_file(path))  # type: ignore[arg-type]
        halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            m = _KEY.match(key) if isinstance(key, str) else None
            if m is None:
                raise LoRAError(
                    f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of "
                    f"{', '.join(TARGETS)} in a decoder layer (not supported)"
                )
            layer, proj, half = int(m.group(1)), m.group(3), m.group(4)
            if layer >= shape.num_layers:
                raise LoRAError(
                    f"LoRA adapter {name!r}: {key!r} is for layer {layer}; the model has "
                    f"{shape.num_layers}"
                )
            halves.setdefault((layer, proj), {})[half] = t
        weights = {}
        for (layer, proj), ab in halves.items():
            where = f"LoRA adapter {name!r}, layer {layer} {proj}"
            if set(ab) != {"A", "B"}:
                raise LoRAError(f"{where}: lora_A and lora_B must both be present")
            a, b = ab["A"], ab["B"]
            fan_in, fan_out = shape.sizes[proj]
            if a.shape != (config.r, fan_in) or b.shape != (fan_out, config.r):
                raise LoRAError(
                    f"{where}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit rank "
                    f"{config.r} and the model's [{fan_out}, {fan_in}] weight"
                )
            if not (a.is_floating_point() and b.is_floating_point()):
                raise LoRAError(f"{where}: weights must be floating point")
            # (float8 has no isfinite of its own)
            if not (torch.isfinite(a.float()).all() and torch.isfinite(b.float()).all()):
                raise LoRAError(f"{where}: weights hold NaN or infinite values")
            weights[(layer, proj)] = (a, b)
        if not weights:
            raise LoRAError(f"LoRA adapter {name!r} holds no LoRA weights")
        return cls(name, path, config, weights)


def _read_tensors(file: str) -> dict[str, torch.Tensor]:
    try:
        if file.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(file)
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise LoRAError(f"cannot read LoRA weights {file!r}: {e}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise LoRAError(f"LoRA weights {file!r} are not a dict of tensors")
    return state
