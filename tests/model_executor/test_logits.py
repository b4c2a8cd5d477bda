"""Logits of a ragged batch (prefill, prefill on a cached prefix, decode) match transformers."""

from __future__ import annotations

import json
import os

import pytest
import torch
from rs_testing import load_hf_reference, make_tiny_model_dir

from radixserve.args import ServerArgs
from radixserve.managers.schedule_batch import Req, ScheduleBatch
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.sampling_params import SamplingParams

ATOL = 1e-3


def _runner(model_path: str, **kwargs) -> ModelRunner:
    args = ServerArgs(
        model_path=model_path, dtype="float32", device="cpu", max_total_tokens=2048, **kwargs
    )
    return ModelRunner(args.resolve())


def _forward(runner: ModelRunner, cache: ChunkCache, reqs: list[Req], decode: bool) -> torch.Tensor:
    batch = ScheduleBatch(reqs, runner.req_to_token_pool, runner.token_to_kv_pool_allocator, cache)
    if decode:
        batch.prepare_for_decode()
    else:
        batch.prepare_for_extend()
    return runner.forward(batch.get_forward_batch("cpu")).next_token_logits


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _check_model(model_path: str, vocab: int, **kwargs) -> None:
    runner = _runner(model_path, **kwargs)
    hf = load_hf_reference(model_path)
    cache = ChunkCache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 37, 120)]
    reqs = [Req(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    for r in reqs:
        r.init_next_round_input(cache)
    logits = _forward(runner, cache, reqs, decode=False)
    for i, p in enumerate(prompts):
        ref = _hf_logits(hf, p)[-1]
        assert torch.allclose(logits[i], ref, atol=ATOL), (logits[i] - ref).abs().max()

    # Two ragged decode steps with chosen tokens.
    seqs = [list(p) for p in prompts]
    for step in range(2):
        for i, r in enumerate(reqs):
            tok = (17 * (i + 1) + step) % vocab
            r.output_ids.append(tok)
            seqs[i].append(tok)
        logits = _forward(runner, cache, reqs, decode=True)
        for i in range(len(reqs)):
            ref = _hf_logits(hf, seqs[i])[-1]
            assert torch.allclose(logits[i], ref, atol=ATOL), (logits[i] - ref).abs().max()

    # Extend on top of a cached prefix: reuse request 2's first 64 slots for a new request.
    prefix_slots = runner.req_to_token_pool.req_to_token[reqs[2].req_pool_idx, :64].long()
    new_ids = prompts[2][:64] + torch.randint(3, vocab, (20,), generator=gen).tolist()
    r = Req("prefixed", new_ids, SamplingParams())
    r.fill_ids = list(new_ids)
    r.prefix_indices = prefix_slots.clone()
    r.extend_input_len = len(new_ids) - 64
    logits = _forward(runner, cache, [r], decode=False)
    ref = _hf_logits(hf, new_ids)[-1]
    assert torch.allclose(logits[0], ref, atol=ATOL), (logits[0] - ref).abs().max()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_models_match_transformers(tmp_path, arch):
    path = make_tiny_model_dir(str(tmp_path / arch), arch)
    _check_model(path, vocab=320)


def _rope(kind: str, **fields) -> dict:
    return {"rope_parameters": {"rope_type": kind, "rope_theta": 10000.0, **fields}}


YARN = {"factor": 4.0, "original_max_position_embeddings": 256}
# Config fields real checkpoints set, each once served with other tokens than transformers'
# (or refused with a KeyError): o_proj's bias under attention_bias, YaRN's mscale /
# mscale_all_dim and truncate.
VARIANTS = {
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "llama-mlp-bias": ("llama", {"mlp_bias": True}),
    "llama-tied-mha": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "llama-gqa-4-head-dim-32": ("llama", {"num_key_value_heads": 1, "head_dim": 32}),
    "llama-rope-llama3": (
        "llama",
        _rope(
            "llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "llama-rope-linear": ("llama", _rope("linear", factor=4.0)),
    "llama-yarn": ("llama", _rope("yarn", **YARN)),
    "llama-yarn-no-original": ("llama", _rope("yarn", factor=4.0)),
    "llama-yarn-mscale": ("llama", _rope("yarn", **YARN, mscale=1.0, mscale_all_dim=0.5)),
    "llama-yarn-no-truncate": ("llama", _rope("yarn", **YARN, truncate=False)),
    "qwen3-attention-bias": ("qwen3", {"attention_bias": True}),
    "qwen2-window-off": ("qwen2", {"use_sliding_window": False, "sliding_window": 32}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_match_transformers(tmp_path, variant):
    arch, fields = VARIANTS[variant]
    _check_model(make_tiny_model_dir(str(tmp_path / variant), arch, **fields), vocab=320)


def _edit_config(path: str, drop: tuple[str, ...] = (), **fields) -> str:
    """Rewrite a saved config.json the way checkpoints on the hub have it (transformers'
    save_pretrained writes its own normalised form)."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for key in drop:
        cfg.pop(key, None)
    cfg.update(fields)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return path


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# Layouts of config.json that transformers reads one way and that were served another (or
# refused): the pre-training length as a top-level original_max_position_embeddings (it wins
# over rope_scaling's; YaRN took max_position_embeddings instead and changed every frequency,
# llama3 was a KeyError); Qwen2's max_window_layers missing (transformers' default 28: no layer
# slides) or a null window; dynamic NTK (the default rotation within the positions).
RAW_VARIANTS = {
    "yarn-top-level-original": (
        "llama",
        {"rope_scaling": {"type": "yarn", "factor": 4.0}, "original_max_position_embeddings": 64},
    ),
    "llama3-top-level-original": (
        "llama",
        {"rope_scaling": LLAMA3, "original_max_position_embeddings": 64},
    ),
    "qwen2-window-without-max-window-layers": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 32, "drop": ("max_window_layers",)},
    ),
    "qwen2-null-window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
    ),
    "dynamic-ntk": ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
}


@pytest.mark.parametrize("variant", list(RAW_VARIANTS))
def test_config_json_layouts_match_transformers(tmp_path, variant):
    arch, fields = RAW_VARIANTS[variant]
    fields = dict(fields)
    drop = ("rope_parameters", "layer_types", *fields.pop("drop", ()))
    path = make_tiny_model_dir(str(tmp_path / variant), arch)
    _check_model(_edit_config(path, drop, **fields), vocab=320)


def test_a_pre_quantized_checkpoint_is_refused_before_start(tmp_path):
    # Its scales and packed weights were a KeyError in the scheduler after start-up.
    from radixserve.model_loader.loader import load_model_config

    path = make_tiny_model_dir(str(tmp_path / "m"), "llama")
    _edit_config(path, quantization_config={"quant_method": "fp8", "weight_block_size": [128]})
    with pytest.raises(ValueError, match="pre-quantized checkpoints .* 'fp8'"):
        load_model_config(path, "safetensors")
    # What transformers saves after dequantizing a GGUF file: plain weights.
    _edit_config(path, quantization_config={"quant_method": "gguf"})
    assert load_model_config(path, "safetensors").architecture == "LlamaForCausalLM"


def test_an_unknown_rope_type_is_refused_before_start(tmp_path):
    # Found only when the scheduler built the model: a traceback after start-up.
    from radixserve.model_loader.loader import load_model_config

    path = make_tiny_model_dir(str(tmp_path / "m"), "llama")
    _edit_config(path, ("rope_parameters",), rope_scaling={"type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_scaling type 'longrope' is not supported"):
        load_model_config(path, "safetensors")


def test_dynamic_ntk_past_the_positions_is_refused(tmp_path, monkeypatch):
    # Past max_position_embeddings dynamic NTK rescales every position as the sequence grows.
    from radixserve.model_loader.loader import (
        ALLOW_LONGER_CONTEXT_ENV,
        check_context_length,
        load_model_config,
    )

    monkeypatch.setenv(ALLOW_LONGER_CONTEXT_ENV, "1")
    path = make_tiny_model_dir(str(tmp_path / "m"), "llama")
    _edit_config(path, ("rope_parameters",), rope_scaling={"type": "dynamic", "factor": 2.0})
    cfg = load_model_config(path, "safetensors")
    assert not check_context_length(cfg, 1024)
    with pytest.raises(ValueError, match="dynamic NTK"):
        check_context_length(cfg, 2048)


@pytest.mark.parametrize(
    "arch, fields, message",
    [
        ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ("llama", _rope("default", partial_rotary_factor=0.5), "partial_rotary_factor"),
    ],
)
def test_configs_the_model_cannot_compute_are_refused(tmp_path, arch, fields, message):
    # Each was served with full attention / SiLU / full rotation: other tokens than its own.
    from radixserve.model_loader.loader import load_model_config

    path = make_tiny_model_dir(str(tmp_path / "m"), arch, **fields)
    with pytest.raises(ValueError, match=message):
        load_model_config(path, "safetensors")


@pytest.mark.parametrize(
    "arch, fields",
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 200, "max_window_layers": 0}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 200, "max_window_layers": 1}),
        ("mistral", {"sliding_window": 200}),  # (Mistral 7B v0.1: 4096 of 32768 positions)
    ],
)
def test_a_sliding_window_model_is_served_within_its_window(tmp_path, monkeypatch, arch, fields):
    """The full attention here is the sliding one within the window: such a model was refused
    whatever --context-length (Mistral 7B v0.1 could not be served), and one whose window
    was its positions was served past the window with --context-length (other logits than
    transformers' from there). It is served up to the window, refused past it."""
    from radixserve.model_loader.loader import (
        ALLOW_LONGER_CONTEXT_ENV,
        check_context_length,
        load_model_config,
    )

    monkeypatch.setenv(ALLOW_LONGER_CONTEXT_ENV, "1")
    path = make_tiny_model_dir(str(tmp_path / "m"), arch, **fields)  # (1024 positions)
    cfg = load_model_config(path, "safetensors")
    for context in (None, 201, 2048):
        with pytest.raises(ValueError, match="sliding-window .* --context-length 200 or less"):
            check_context_length(cfg, context)
    assert not check_context_length(cfg, 200)
    _check_model(path, vocab=320, context_length=200)


def test_linear_rope_scaling_serves_its_factor_times_the_positions(tmp_path):
    """Linear scaling stretches the trained positions by its factor (Vicuna 16k: 4096
    positions, factor 4): the context was the positions alone, 16k prompts refused that
    transformers runs. SGLang and vLLM serve the factor times them."""
    path = make_tiny_model_dir(
        str(tmp_path / "m"), "llama", max_position_embeddings=40, **_rope("linear", factor=4.0)
    )
    runner = _runner(path)
    assert runner.context_len == 160
    _check_model(path, vocab=320)  # (prompts of up to 122 tokens)


def test_a_longer_context_leaves_yarns_frequencies_alone(tmp_path, monkeypatch):
    """--context-length raises max_position_embeddings; YaRN without an explicit original
    length once took the raised one as the original and changed every frequency."""
    from radixserve.model_loader.loader import ALLOW_LONGER_CONTEXT_ENV

    monkeypatch.setenv(ALLOW_LONGER_CONTEXT_ENV, "1")
    path = make_tiny_model_dir(str(tmp_path / "m"), "llama", **_rope("yarn", factor=4.0))
    want = _runner(path).model
    args = ServerArgs(
        model_path=path, dtype="float32", device="cpu", max_total_tokens=2048, context_length=4096
    )
    got = ModelRunner(args.resolve()).model
    a, b = (m.model.rotary for m in (want, got))
    assert torch.equal(a.cos_cached, b.cos_cached[: a.cos_cached.shape[0]])


@pytest.mark.real_model
def test_default_model_matches_transformers(default_model_path):
    _check_model(default_model_path, vocab=49152)
