"""LoRA adapters (--lora-paths): PEFT adapters read and checked, applied per request in mixed
batches with exactly transformers' greedy tokens (the adapter's delta added unmerged, as PEFT
does), the batch cap, the cache namespaces, and the errors a user can hit."""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import pytest
import torch
from rs_testing import (
    SchedulerHarness,
    greedy_step_logits,
    hf_greedy,
    load_hf_reference,
    make_prompts,
    make_tiny_served_model,
)

from radixserve.args import ServerArgs
from radixserve.io_struct import TokenizedGenerateReqInput
from radixserve.lora.adapter import LoRAAdapter, LoRAError, ModelShape, adapter_key
from radixserve.model_loader.model_config import ModelConfig
from radixserve.sampling_params import SamplingParams

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NEW = 12


def write_adapter(
    path: str,
    model_dir: str,
    r: int,
    targets: tuple[str, ...] = ALL,
    seed: int = 0,
    alpha: float = 16.0,
    config: dict[str, Any] | None = None,
    fmt: str = "safetensors",
    extra: dict[str, torch.Tensor] | None = None,
    scale: float = 0.2,
) -> str:
    """A PEFT adapter for the model at `model_dir`: random A and B (PEFT starts B at zero; a
    trained adapter's is not), every layer, `targets`."""
    shape = _shape_of(model_dir)  # (a wrong shape would fail the transformers reference)
    sizes, layers = shape.sizes, shape.num_layers
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj in targets:
            sub = "self_attn" if proj in ALL[:4] else "mlp"
            fan_in, fan_out = sizes[proj]
            prefix = f"base_model.model.model.layers.{i}.{sub}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * scale
    tensors.update(extra or {})
    os.makedirs(path, exist_ok=True)
    conf = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": False,
        **(config or {}),
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(conf, f)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    else:
        torch.save(tensors, os.path.join(path, "adapter_model.bin"))
    return path


def _hf_config(model_path: str) -> dict[str, Any]:
    """The HF config of a model directory, or of the default model's GGUF."""
    if model_path.endswith(".gguf"):
        return load_hf_reference(model_path).config.to_dict()
    with open(os.path.join(model_path, "config.json")) as f:
        return json.load(f)


def _shape_of(model_path: str) -> ModelShape:
    return ModelShape.of(ModelConfig.from_hf_config(_hf_config(model_path)))


def peft_greedy(
    model_path: str, adapter_dir: str | None, prompts: list[list[int]], new: int = NEW
) -> list[list[int]]:
    """transformers' greedy tokens with the adapter applied as PEFT applies it unmerged:
    each adapted Linear's output plus scaling · lora_B(lora_A(x)). (The shared reference
    model of `model_path`, its hooks removed after.)"""
    model = load_hf_reference(model_path)
    hooks = []
    if adapter_dir is not None:
        adapter = LoRAAdapter.load("ref", adapter_dir, _shape_of(model_path))
        s = adapter.config.scaling
        for (layer, proj), (a, b) in adapter.weights.items():
            block = model.model.layers[layer]
            module = getattr(block.self_attn if proj in ALL[:4] else block.mlp, proj)

            def hook(mod, args, out, a=a.float(), b=b.float()):
                return out + (args[0] @ a.t()) @ b.t() * s

            hooks.append(module.register_forward_hook(hook))
    try:
        return hf_greedy(model, prompts, new)
    finally:
        for h in hooks:
            h.remove()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_served_model(str(root / "model"))
    adapters = {
        "a": write_adapter(str(root / "a"), model, r=4, seed=1),
        # rsLoRA scaling, a subset of projections, a .bin file
        "b": write_adapter(
            str(root / "b"),
            model,
            r=8,
            targets=("q_proj", "v_proj", "down_proj"),
            seed=2,
            config={"use_rslora": True},
            fmt="bin",
        ),
        "c": write_adapter(str(root / "c"), model, r=2, targets=("k_proj", "gate_proj"), seed=5),
    }
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 17, 33, 9, 24, 40)]
    refs = {name: peft_greedy(model, path, prompts) for name, path in adapters.items()}
    refs[None] = peft_greedy(model, None, prompts)
    return {"model": model, "adapters": adapters, "prompts": prompts, "refs": refs}


def _paths(tiny: dict[str, Any]) -> tuple[str, ...]:
    return tuple(f"{n}={p}" for n, p in tiny["adapters"].items())


def _submit(h: SchedulerHarness, rid: str, ids: list[int], lora: str | None) -> None:
    path = h.args_lora.get(lora)
    key = None if path is None else adapter_key(lora, path)
    sp = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, temperature=0)
    h.scheduler.process_input_requests(
        [TokenizedGenerateReqInput(rid, None, list(ids), sp, extra_key=key, lora_id=lora)]
    )


NAMES = (None, "a", "b", "c")  # the tiny fixture's adapters and the base model


def _submit_each(
    h: SchedulerHarness, tag: str, prompts: list[list[int]], refs: dict[Any, list[list[int]]]
) -> dict[str, list[int]]:
    """Every prompt under every adapter and under none (rids f"{tag}{i}-{lora}"); returns
    each request's expected tokens (refs[lora][i])."""
    expected = {}
    for i, p in enumerate(prompts):
        for lora in NAMES:
            rid = f"{tag}{i}-{lora}"
            _submit(h, rid, p, lora)
            expected[rid] = refs[lora][i]
    return expected


def _harness(tiny: dict[str, Any], **kwargs: Any) -> SchedulerHarness:
    kwargs.setdefault("max_total_tokens", 4096)  # (the integrity checks walk the whole pool)
    h = SchedulerHarness(model_path=tiny["model"], lora_paths=_paths(tiny), **kwargs)
    h.args_lora = dict(tiny["adapters"])  # type: ignore[attr-defined]
    return h


def _assert_drained(h: SchedulerHarness) -> None:
    s = h.scheduler
    assert s.allocator.available_size() + s.tree_cache.evictable_size() == s.max_total_num_tokens
    assert s.tree_cache.protected_size() == 0


def test_the_adapters_change_the_output(tiny):
    """The references differ: each adapter moves greedy tokens (else the tests prove nothing)."""
    refs = tiny["refs"]
    for name in ("a", "b", "c"):
        assert refs[name] != refs[None], name
    assert refs["a"] != refs["b"] != refs["c"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attention_backend": "torch_native"},
        {"attention_backend": "cpu_paged"},
        {"attention_backend": "cpu_paged", "disable_overlap_schedule": True, "page_size": 16},
        {"attention_backend": "cpu_paged", "chunked_prefill_size": 16, "enable_mixed_chunk": True},
        {"attention_backend": "torch_native", "disable_radix_cache": True},
    ],
    ids=["torch_native", "cpu_paged", "normal-loop-page16", "chunked-mixed", "radix-off"],
)
def test_mixed_adapters_in_one_batch_give_each_adapters_greedy_tokens(tiny, kwargs):
    """Every prompt under every adapter and under none, all at once (so prefill and decode
    batches mix adapters), and again staggered: each request gets the tokens of its own
    adapter; nothing leaks."""
    h = _harness(tiny, **kwargs)
    expected = _submit_each(h, "", tiny["prompts"], tiny["refs"])
    h.run_until_idle()
    assert h.results() == expected
    for i, p in enumerate(tiny["prompts"]):  # staggered: arriving while others decode
        for lora in NAMES:
            _submit(h, f"again-{i}-{lora}", p, lora)
            h.step()
            h.step()
    h.run_until_idle()
    got = h.results()
    for i in range(len(tiny["prompts"])):
        for lora in NAMES:
            assert got[f"again-{i}-{lora}"] == tiny["refs"][lora][i], (i, lora)
    _assert_drained(h)


def test_more_adapter_rows_than_the_kernel_takes(tiny):
    """168 requests at once under three adapters and none, then 24: steps of more rows than
    KERNEL_ROWS take the per-adapter products, smaller ones lora_delta (where it is built);
    every request gets its adapter's tokens, and the pool drains."""
    from radixserve.lora.manager import KERNEL_ROWS

    h = _harness(tiny, attention_backend="cpu_paged", max_total_tokens=12288)
    manager = h.scheduler.tp_worker.model_runner.lora_manager
    prepare, steps = manager.prepare, []

    def spy(fb):
        batch = prepare(fb)
        if batch is not None:
            steps.append((sum(fb.extend_seq_lens_cpu), batch.kernel))
        return batch

    manager.prepare = spy
    expected = {}
    for copies in (7, 1):  # 168 requests at once, then 24
        for k in range(copies):
            expected.update(_submit_each(h, f"{copies}-{k}-", tiny["prompts"], tiny["refs"]))
        h.run_until_idle()
    assert len(expected) > KERNEL_ROWS
    assert h.results() == expected
    _assert_drained(h)
    assert any(rows > KERNEL_ROWS and not kernel for rows, kernel in steps)
    assert all(kernel == manager.kernel for rows, kernel in steps if rows <= KERNEL_ROWS)
    assert any(rows <= KERNEL_ROWS for rows, _ in steps)


@pytest.fixture(scope="module")
def doubled(tiny) -> tuple[list[list[int]], dict[Any, list[list[int]]]]:
    """Each prompt twice over (its n-grams recur, so NGRAM proposes drafts) and its greedy
    tokens under each adapter and none."""
    prompts = [p + p for p in tiny["prompts"]]
    return prompts, {n: peft_greedy(tiny["model"], tiny["adapters"].get(n), prompts) for n in NAMES}


@pytest.mark.parametrize(
    "spec",
    [
        {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
        {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 8},
        {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3},
    ],
    ids=["ngram-4", "ngram-8", "standalone"],
)
def test_speculative_decoding_verifies_under_each_requests_adapter(tiny, doubled, spec):
    """Speculative decoding with mixed adapters: each verify step runs every draft node under
    its request's adapter (the rows of a request's tree share it), so each request still gets
    its adapter's greedy tokens; a draft model (here the base model itself) drafts without
    adapters. The pool drains."""
    if spec["speculative_algorithm"] == "STANDALONE":
        spec = {**spec, "speculative_draft_model_path": tiny["model"]}
    h = _harness(tiny, attention_backend="cpu_paged", speculative_disable_adaptive=True, **spec)
    worker = h.scheduler.spec_worker
    node_batch, trees = worker.node_batch, []

    def spy(mwb, spec):
        nodes = node_batch(mwb, spec)
        trees.append((len(mwb.rids), len(nodes.rids), nodes.lora_ids))
        return nodes

    worker.node_batch = spy
    expected = _submit_each(h, "", *doubled)
    h.run_until_idle()
    assert h.results() == expected
    _assert_drained(h)
    assert any(n > r for r, n, _ in trees)  # verify steps with draft nodes
    assert all(loras is not None and set(loras) == set(NAMES) for r, n, loras in trees if r == 24)


def test_at_most_max_loras_per_batch_adapters_in_a_step(tiny):
    """--max-loras-per-batch 1: requests of three adapters and of none, sent together, all
    finish right; no step ever holds two adapters (base-model rows join any step)."""
    h = _harness(tiny, max_loras_per_batch=1)
    runner = h.scheduler.tp_worker.model_runner
    seen: list[set] = []
    prepare = runner.lora_manager.prepare

    def spy(fb):
        seen.append({n for n in (fb.lora_ids or []) if n is not None})
        return prepare(fb)

    runner.lora_manager.prepare = spy
    expected = {}
    for i, p in enumerate(tiny["prompts"]):
        for lora in ("a", "b", "c", None):
            _submit(h, f"{i}-{lora}", p, lora)
            expected[f"{i}-{lora}"] = tiny["refs"][lora][i]
    h.run_until_idle()
    assert h.results() == expected
    assert max(len(s) for s in seen) == 1
    assert {frozenset(s) for s in seen} >= {frozenset({x}) for x in "abc"}
    _assert_drained(h)


def test_a_steady_stream_of_one_adapter_does_not_starve_another(tiny):
    """--max-loras-per-batch 1: a request of adapter c behind running requests of a waited
    while a's later requests, one a step, were admitted past it (300 steps, no token); now
    a's requests behind it wait and c runs once the running ones finish."""
    h = _harness(tiny, max_loras_per_batch=1)
    prompt = tiny["prompts"][0]
    _submit(h, "a0", prompt, "a")
    h.step()
    _submit(h, "c0", prompt, "c")
    _submit(h, "base0", prompt, None)  # base-model requests join any step
    done = None  # the step c0 finished at
    for i in range(1, 6 * NEW):
        _submit(h, f"a{i}", prompt, "a")
        h.step()
        if h.results().get("c0"):
            done = i
            break
    assert done is not None and done <= 3 * NEW, done  # a0's turn, then its own
    h.run_until_idle()
    res = h.results()
    assert res["c0"] == tiny["refs"]["c"][0] and res["base0"] == tiny["refs"][None][0]
    assert all(res[f"a{i}"] == tiny["refs"]["a"][0] for i in range(done + 1))
    _assert_drained(h)


def test_adapters_never_share_cached_kv(tiny):
    """One prompt under a, then b, then a and none: b and none reuse nothing of a's KV (it was
    computed with a's deltas); the second a reuses its own."""
    h = _harness(tiny)
    prompt = tiny["prompts"][5]
    cached = {}
    for rid, lora in (("a1", "a"), ("b1", "b"), ("a2", "a"), ("base", None)):
        _submit(h, rid, prompt, lora)
        h.run_until_idle()
    for msg in h.outputs:
        for rid, n, reason in zip(msg.rids, msg.cached_tokens, msg.finished_reasons, strict=True):
            if reason is not None:
                cached[rid] = n
    assert cached["a1"] == 0 and cached["b1"] == 0 and cached["base"] == 0
    assert cached["a2"] >= len(prompt) - 1
    res = h.results()
    assert res["a1"] == res["a2"] == tiny["refs"]["a"][5]
    assert res["b1"] == tiny["refs"]["b"][5] and res["base"] == tiny["refs"][None][5]
    _assert_drained(h)


def test_an_unknown_adapter_is_refused_with_400(tiny):
    h = _harness(tiny)
    _submit(h, "x", tiny["prompts"][0], "zz")
    h.run_until_idle()
    reason = h.finish_reasons()["x"]
    assert reason["status_code"] == 400 and "zz" in reason["message"]
    _assert_drained(h)


# -- adapters that cannot be served: refused at load, with the reason ---------------------------
def _shape(tiny) -> ModelShape:
    return _shape_of(tiny["model"])


@pytest.mark.parametrize(
    "config,extra,match",
    [
        ({"use_dora": True}, None, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 8}}, None, "rank_pattern"),
        ({"bias": "all"}, None, "biases"),
        ({"r": 0}, None, "positive integer"),
        ({"r": True}, None, "positive integer"),  # (bool is an int: it was rank 1)
        ({"lora_alpha": "16"}, None, "lora_alpha must be a number"),
        ({"use_rslora": "false"}, None, "use_rslora must be true or false"),  # (it was true)
        ({"lora_alpha": float("inf")}, None, "lora_alpha must be finite"),
        ({"lora_alpha": float("nan")}, None, "lora_alpha must be finite"),
        ({"lora_alpha": 10**400}, None, "lora_alpha must be finite"),  # (OverflowError)
        (
            None,  # float8 has no isfinite (NotImplementedError)
            {
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.full(
                    (4, 64), float("nan")
                ).to(torch.float8_e4m3fn)
            },
            "weights hold NaN",
        ),
        (None, {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, "lm_head"),
        (
            None,
            {"base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(4, 64)},
            "layer 9",
        ),
    ],
)
def test_unservable_adapters_are_refused(tiny, tmp_path, config, extra, match):
    path = write_adapter(str(tmp_path / "x"), tiny["model"], r=4, config=config, extra=extra)
    with pytest.raises(LoRAError, match=match):
        LoRAAdapter.load("x", path, _shape(tiny))


def test_a_config_without_lora_alpha_scales_as_peft_does(tiny, tmp_path):
    """PEFT's default lora_alpha is 8 (the scale was taken as r / r = 1)."""
    path = write_adapter(str(tmp_path / "x"), tiny["model"], r=16)
    with open(os.path.join(path, "adapter_config.json")) as f:
        conf = json.load(f)
    del conf["lora_alpha"]
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(conf, f)
    assert LoRAAdapter.load("x", path, _shape(tiny)).config.alpha == 8.0


def test_an_adapter_failing_as_no_check_foresaw_is_refused_not_fatal(tiny, monkeypatch):
    """An exception other than LoRAError while loading (float8 weights raised
    NotImplementedError) ended the scheduler's loop: the whole server went down."""
    from radixserve.io_struct import LoadLoRAAdapterReq

    h = _harness(tiny)
    manager = h.scheduler.tp_worker.model_runner.lora_manager

    def load(name: str, path: str) -> None:
        raise NotImplementedError('"isfinite" not implemented for this dtype')

    monkeypatch.setattr(manager, "load", load)
    out = h.scheduler.load_lora_adapter(LoadLoRAAdapterReq("x", "/somewhere"))
    assert not out.success
    assert out.message == (
        "cannot load LoRA adapter 'x': NotImplementedError: "
        '"isfinite" not implemented for this dtype'
    )


def test_undoing_an_update_on_a_replica_is_a_no_op_where_it_was_not_done(tiny):
    """A data-parallel replica asked to undo a LoRA unload the others refused still holds
    the adapter (success, nothing reloaded); one asked to undo a load that failed on it has
    none to unload (success)."""
    from radixserve.io_struct import LoadLoRAAdapterReq, UnloadLoRAAdapterReq

    h = _harness(tiny)
    manager = h.scheduler.tp_worker.model_runner.lora_manager
    packed = manager.adapters["a"]
    undo_unload = LoadLoRAAdapterReq("a", tiny["adapters"]["a"], restore=True)
    assert h.scheduler.load_lora_adapter(undo_unload).success
    assert manager.adapters["a"] is packed
    assert not h.scheduler.load_lora_adapter(LoadLoRAAdapterReq("a", "/a")).success
    assert h.scheduler.unload_lora_adapter(UnloadLoRAAdapterReq("x", restore=True)).success
    assert not h.scheduler.unload_lora_adapter(UnloadLoRAAdapterReq("x")).success
    assert h.scheduler.unload_lora_adapter(UnloadLoRAAdapterReq("a")).success
    assert h.scheduler.load_lora_adapter(undo_unload).success  # the replica that did unload
    assert "a" in h.scheduler.lora_names and manager.adapters["a"] is not packed


def test_adapter_shapes_and_halves_are_checked(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_adapter(str(tmp_path / "x"), tiny["model"], r=4, targets=("q_proj",))
    file = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(file)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    save_file({**tensors, key: torch.zeros(64, 3)}, file)
    with pytest.raises(LoRAError, match="do not fit rank 4"):
        LoRAAdapter.load("x", path, _shape(tiny))
    del tensors[key]
    save_file(tensors, file)
    with pytest.raises(LoRAError, match="must both be present"):
        LoRAAdapter.load("x", path, _shape(tiny))
    with pytest.raises(LoRAError, match="above --max-lora-rank 2"):
        LoRAAdapter.load("x", tiny["adapters"]["a"], _shape(tiny), max_rank=2)
    for bad in (float("nan"), float("inf")):
        tensors[key] = torch.full((64, 4), 0.1)
        tensors[key][3, 1] = bad
        save_file(tensors, file)
        with pytest.raises(LoRAError, match="layer 0 q_proj: weights hold NaN or infinite"):
            LoRAAdapter.load("x", path, _shape(tiny))


def test_the_flags(tiny, tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    a, b = tiny["adapters"]["a"], tiny["adapters"]["b"]
    ns = parser.parse_args(["--lora-paths", f"one={a}", b, "--max-loras-per-batch", "2"])
    args = ServerArgs.from_cli_args(ns)
    assert args.lora_paths == (f"one={a}", b) and args.max_loras_per_batch == 2
    assert ServerArgs(lora_paths=a).lora_paths == (a,)
    dora = str(tmp_path / "dora")
    shutil.copytree(a, dora)
    with open(os.path.join(dora, "adapter_config.json")) as f:
        conf = json.load(f)
    with open(os.path.join(dora, "adapter_config.json"), "w") as f:
        json.dump({**conf, "use_dora": True}, f)
    for bad, match in [
        ({"lora_paths": (f"x={a}", f"x={b}")}, "given twice"),
        # (read from the config before start: they were tracebacks after the model loaded)
        ({"lora_paths": (f"x={a}",), "max_lora_rank": 1}, "'x' has rank .*-max-lora-rank 1"),
        ({"lora_paths": (dora,)}, "DoRA"),
        ({"lora_paths": (str(tmp_path),)}, "adapter_config.json"),
        ({"lora_paths": ("x=" + str(tmp_path / "nope"),)}, "not a directory"),
        # (a request's cache namespace is "<adapter key>|<its extra key>")
        ({"lora_paths": (f"x|y={a}",)}, "no whitespace or '|'"),
        ({"max_loras_per_batch": 0}, "max-loras-per-batch"),
    ]:
        with pytest.raises(ValueError, match=match):
            ServerArgs(**bad)


def test_adapter_key_names_the_contents(tiny, tmp_path):
    a = tiny["adapters"]["a"]
    assert adapter_key("a", a) == adapter_key("a", a)
    assert adapter_key("a", a) != adapter_key("a", tiny["adapters"]["c"])
    assert adapter_key("a", a) != adapter_key("other", a)


# -- through the Engine: the TokenizerManager's checks and namespaces, the scheduler process --
def test_the_engine_serves_adapters_per_prompt(tiny):
    from radixserve import Engine
    from radixserve.managers.tokenizer_manager import RequestError

    prompts, refs = tiny["prompts"], tiny["refs"]
    params = {"max_new_tokens": NEW, "min_new_tokens": NEW, "temperature": 0}
    with Engine(
        model_path=tiny["model"],
        dtype="float32",
        lora_paths=_paths(tiny),
        max_total_tokens=4096,
        enable_integrity_checks=True,
    ) as e:
        loras = ["a", None, "b", "c", "a", None]
        outs = e.generate(input_ids=prompts, sampling_params=params, lora_path=loras)
        assert [o["output_ids"] for o in outs] == [refs[x][i] for i, x in enumerate(loras)]
        one = e.generate(input_ids=prompts[0], sampling_params=params, lora_path=["c"])  # (SGLang)
        assert one["output_ids"] == refs["c"][0]
        assert one["meta_info"]["cached_tokens"] == 0  # a's KV of this prompt is not c's
        again = e.generate(input_ids=prompts[0], sampling_params=params, lora_path="a")
        assert again["output_ids"] == refs["a"][0]
        assert again["meta_info"]["cached_tokens"] >= len(prompts[0]) - 1
        # A client's extra_key spelling the adapter's namespace reads (and writes) only its own
        # (it got a's KV, and a base request's KV could be served to a's requests).
        a_key = adapter_key("a", tiny["adapters"]["a"])
        for key in (a_key, f"{a_key}|x"):
            base = e.generate(input_ids=prompts[0], sampling_params=params, extra_key=key)
            assert base["output_ids"] == refs[None][0]
            assert base["meta_info"]["cached_tokens"] == 0
        for bad, match in [
            ({"lora_path": "zz"}, "unknown LoRA adapter 'zz'; loaded: a, b, c"),
            ({"lora_path": 3}, "lora_path must be an adapter name"),
            ({"lora_path": ["a", "b"]}, "one \\(or null\\) per prompt"),
        ]:
            with pytest.raises(RequestError, match=match) as err:
                e.generate(input_ids=prompts[0], sampling_params=params, **bad)
            assert err.value.status_code == 400
        info = e.get_server_info()
        assert info["running"] == 0 and info["queued"] == 0
        assert info["available_tokens"] + info["evictable_tokens"] == info["max_total_num_tokens"]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal-loop"])
def test_tensor_parallel_ranks_apply_their_shards(tiny, overlap):
    """--tp-size 2: each rank keeps its shard of every adapter (B's rows of q/k/v and
    gate/up, A's columns of o and down, whose deltas join the partial sums before the
    all-reduce): the same tokens as transformers with the whole adapter."""
    from radixserve import Engine

    prompts, refs = tiny["prompts"], tiny["refs"]
    params = {"max_new_tokens": NEW, "min_new_tokens": NEW, "temperature": 0}
    with Engine(
        model_path=tiny["model"],
        tp_size=2,
        dtype="float32",
        lora_paths=_paths(tiny),
        max_total_tokens=4096,
        enable_integrity_checks=True,
        disable_overlap_schedule=not overlap,
    ) as e:
        loras = ["b", "a", None, "c", "b", "a"]
        outs = e.generate(input_ids=prompts, sampling_params=params, lora_path=loras)
        assert [o["output_ids"] for o in outs] == [refs[x][i] for i, x in enumerate(loras)]
        info = e.get_server_info()
        assert info["running"] == 0 and info["queued"] == 0
        assert info["available_tokens"] + info["evictable_tokens"] == info["max_total_num_tokens"]


@pytest.mark.real_model
def test_the_default_model_with_an_adapter_gives_transformers_tokens(default_model_path, tmp_path):
    """The real model (fp32), an adapter of rank 8 on every projection: the adapted requests
    get transformers' unmerged-PEFT greedy tokens and the base request the base model's, in
    one batch; in bf16 (the default dtype on CPUs with native bf16) the adapter moves the
    output the same way: its first tokens are the fp32 reference's."""
    from radixserve import Engine

    adapter = write_adapter(str(tmp_path / "a"), default_model_path, r=8, seed=3, scale=0.03)
    new = 16
    params = {"max_new_tokens": new, "min_new_tokens": new, "temperature": 0}
    with Engine(
        model_path=default_model_path,
        dtype="float32",
        lora_paths=(f"a={adapter}",),
        max_total_tokens=4096,
        enable_integrity_checks=True,
    ) as e:
        prompts = make_prompts(e.tokenizer, [40, 24])
        with_a = peft_greedy(default_model_path, adapter, prompts, new)
        base = peft_greedy(default_model_path, None, prompts, new)
        assert with_a != base
        outs = e.generate(
            input_ids=[prompts[0], prompts[1], prompts[0]],
            sampling_params=params,
            lora_path=["a", "a", None],
        )
        assert [o["output_ids"] for o in outs] == [with_a[0], with_a[1], base[0]]
    with Engine(
        model_path=default_model_path,
        dtype="bfloat16",
        lora_paths=(f"a={adapter}",),
        max_total_tokens=4096,
    ) as e:
        outs = e.generate(input_ids=prompts, sampling_params=params, lora_path="a")
        assert [o["output_ids"][0] for o in outs] == [w[0] for w in with_a]


@pytest.mark.parametrize(
    "dtype,quantization,n",
    [
        ("float32", None, 5),
        ("bfloat16", None, 5),
        ("bfloat16", None, 130),  # above KERNEL_ROWS: inside the bf16 tiled products
        ("float32", "int4", 7),
        ("bfloat16", "int8", 40),
    ],
)
@pytest.mark.parametrize("mix", ["mixed", "one-adapter"])
def test_the_cpp_decode_step_adds_the_deltas_as_the_python_layers(
    tiny, dtype, quantization, n, mix
):
    """Decode steps with adapters take the C++ step (run_lora), bitwise the logits of the
    Python layers with their LoRALinears; a step with one adapter for every row too."""
    from radixserve.args import ServerArgs
    from radixserve.layers.decode_step import CpuDecodeStep
    from radixserve.model_executor.model_runner import ModelRunner

    args = ServerArgs(
        model_path=tiny["model"],
        device="cpu",
        dtype=dtype,
        quantization=quantization,
        attention_backend="cpu_paged",
        max_total_tokens=8192,
        lora_paths=_paths(tiny),
    ).resolve()
    runner = ModelRunner(args)
    step = runner.model.model.decode_step
    if step is None:
        pytest.skip("no C++ decode step on this machine (radixserve's CPU kernels not built)")
    assert isinstance(step, CpuDecodeStep)
    g = torch.Generator().manual_seed(n)
    prompts = [
        torch.randint(3, 320, (int(k),), generator=g).tolist()
        for k in torch.randint(1, 60, (n,), generator=g)
    ]
    names = ["a", None, "b", "c", "a"]
    loras = [names[i % 5] for i in range(n)] if mix == "mixed" else ["b"] * n
    calls = []
    run_lora = step.step.run_lora

    class Spy:
        def __getattr__(self, name):
            return getattr(step.step, name)

        def run_lora(self, *a):
            calls.append(1)
            return run_lora(*a)

    real = step.step
    step.step = Spy()
    fast = greedy_step_logits(runner, prompts, 3, loras)
    step.step = real
    runner.model.model.decode_step = None
    slow = greedy_step_logits(runner, prompts, 3, loras)
    assert len(calls) == 3  # every decode step took it
    for got, want in zip(fast, slow, strict=True):
        assert torch.equal(got, want)
    alloc = runner.token_to_kv_pool_allocator
    assert alloc.available_size() == runner.max_total_num_tokens


def test_large_steps_sum_the_deltas_inside_the_bf16_tiled_products(tiny, monkeypatch):
    """A prefill of more rows than KERNEL_ROWS in bf16, the projections in radixserve's
    tiles: each adapter's second product joins the base product's sums (bf16_tiled_*_lora).
    The logits are as near the fp32 model's as the per-adapter bf16 products' are (the tiny
    random model amplifies bf16's roundings: the two paths differ from each other about as
    much as each from fp32), the base rows' are the base model's bitwise."""
    from radixserve.layers.linear import bf16_tiles_supported
    from radixserve.lora.manager import KERNEL_ROWS, LoRALinear
    from radixserve.model_executor.model_runner import ModelRunner

    if not bf16_tiles_supported():
        pytest.skip("no bf16 tiles here (radixserve's kernels without AVX512-BF16)")

    def runner(dtype: str) -> ModelRunner:
        return ModelRunner(
            ServerArgs(
                model_path=tiny["model"],
                device="cpu",
                dtype=dtype,
                attention_backend="cpu_paged",
                max_total_tokens=4096,
                lora_paths=_paths(tiny),
            ).resolve()
        )

    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, 320, (int(k),), generator=g).tolist()
        for k in torch.randint(8, 40, (16,), generator=g)
    ]
    assert sum(map(len, prompts)) > KERNEL_ROWS
    loras = [NAMES[i % len(NAMES)] for i in range(len(prompts))]
    want = greedy_step_logits(runner("float32"), prompts, 0, loras)[0].double()
    bf16 = runner("bfloat16")
    wrapped = [m for m in bf16.model.modules() if isinstance(m, LoRALinear)]
    assert wrapped and all(m.tiled for m in wrapped)
    taken = []
    operands = LoRALinear._tiled_operands

    def spy(self, x, batch):
        out = operands(self, x, batch)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(LoRALinear, "_tiled_operands", spy)
    fused = greedy_step_logits(bf16, prompts, 0, loras)[0].double()
    assert taken and all(taken)
    base = greedy_step_logits(bf16, prompts, 0)[0].double()
    for m in wrapped:
        m.tiled = False
    products = greedy_step_logits(bf16, prompts, 0, loras)[0].double()
    # mean |error| (here ≈ 0.012 and 0.011; without the deltas it would be ≈ 0.5)
    err_fused, err_products = (fused - want).abs().mean(), (products - want).abs().mean()
    assert err_fused < 0.03 and err_fused < 1.5 * err_products, (err_fused, err_products)
    plain = [i for i, name in enumerate(loras) if name is None]
    assert torch.equal(fused[plain], base[plain])


# -- adapters loaded into a running server ------------------------------------------------------
def test_adapters_load_and_unload_while_serving(tiny):
    """--enable-lora without paths: an adapter loads (then serves its tokens), a name cannot
    load twice, a bad path is refused, an adapter in use unloads once its request ends, an
    unloaded name is refused, and a name loaded again with other files serves those (its
    cached KV was the old files': a new namespace)."""
    from radixserve import Engine
    from radixserve.managers.tokenizer_manager import RequestError

    prompts, refs, ads = tiny["prompts"], tiny["refs"], tiny["adapters"]
    params = {"max_new_tokens": NEW, "min_new_tokens": NEW, "temperature": 0}
    with Engine(
        model_path=tiny["model"],
        dtype="float32",
        enable_lora=True,
        max_total_tokens=4096,
        enable_integrity_checks=True,
    ) as e:
        with pytest.raises(RequestError, match="unknown LoRA adapter 'a'; loaded: none"):
            e.generate(input_ids=prompts[0], sampling_params=params, lora_path="a")
        assert e.load_lora_adapter("a", ads["a"]) == {"success": True, "message": ""}
        out = e.generate(input_ids=prompts[0], sampling_params=params, lora_path="a")
        assert out["output_ids"] == refs["a"][0]
        assert not e.load_lora_adapter("a", ads["b"])["success"]
        bad = e.load_lora_adapter("x", "/nonexistent")
        assert not bad["success"] and "not a directory" in bad["message"]
        bad = e.load_lora_adapter("x|y", ads["b"])
        assert not bad["success"] and "not an adapter name" in bad["message"]
        huge = write_adapter(os.path.join(os.path.dirname(ads["a"]), "huge"), tiny["model"], 4)
        with open(os.path.join(huge, "adapter_config.json")) as f:
            conf = json.load(f)
        with open(os.path.join(huge, "adapter_config.json"), "w") as f:
            json.dump({**conf, "lora_alpha": 1e300}, f)  # finite, but B times it is not
        bad = e.load_lora_adapter("x", huge)
        assert not bad["success"] and "overflows torch.float32" in bad["message"]
        stream = e.generate(
            input_ids=prompts[1],
            sampling_params={**params, "max_new_tokens": 200, "min_new_tokens": 200},
            lora_path="a",
            stream=True,
        )
        next(iter(stream))
        # (as in SGLang: the unload waits for the request in flight, which ends under it)
        assert e.unload_lora_adapter("a")["success"]
        assert [o["meta_info"]["completion_tokens"] for o in stream][-1] == 200
        assert not e.unload_lora_adapter("a")["success"]
        with pytest.raises(RequestError, match="unknown LoRA adapter 'a'"):
            e.generate(input_ids=prompts[0], sampling_params=params, lora_path="a")
        assert e.load_lora_adapter("a", ads["c"])["success"]  # the same name, other files
        out = e.generate(input_ids=prompts[0], sampling_params=params, lora_path="a")
        assert out["output_ids"] == refs["c"][0] and out["meta_info"]["cached_tokens"] == 0
        base = e.generate(input_ids=prompts[0], sampling_params=params)
        assert base["output_ids"] == refs[None][0]
        info = e.get_server_info()
        assert info["running"] == 0 and info["queued"] == 0
        assert info["available_tokens"] + info["evictable_tokens"] == info["max_total_num_tokens"]


def test_an_adapter_unloaded_while_a_launched_step_holds_its_last_request(tiny):
    """The overlap loop launches step N+1 before it reads step N's tokens: a request that ends
    at step N by a stop token is in step N+1 too. Unloaded then (it had no users left), the
    adapter was gone when that step's forward looked it up: "no LoRA adapter named 'a'", and
    the scheduler died. The unload waits for that forward now."""
    from radixserve.io_struct import UnloadLoRAAdapterReq

    h = _harness(tiny, attention_backend="cpu_paged")
    assert h.scheduler.enable_overlap
    ref = tiny["refs"]["a"][0]
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])  # (ends it at a decode)
    sp = SamplingParams(max_new_tokens=NEW, temperature=0, stop_token_ids=[ref[k]])
    key = adapter_key("a", tiny["adapters"]["a"])
    ids = list(tiny["prompts"][0])
    h.scheduler.process_input_requests(
        [TokenizedGenerateReqInput("R", None, ids, sp, extra_key=key, lora_id="a")]
    )
    for _ in range(50):
        h.step()
        if "R" in h.finish_reasons():
            break
    assert "R" in h.finish_reasons() and h.scheduler.result_queue  # (a step still in flight)
    assert h.scheduler.unload_lora_adapter(UnloadLoRAAdapterReq("a")).success
    h.run_until_idle(max_steps=50)
    assert h.results()["R"] == ref[: k + 1]
    _assert_drained(h)


def test_a_server_started_without_lora_refuses_to_load_one(tiny):
    from radixserve import Engine

    with Engine(model_path=tiny["model"], dtype="float32", max_total_tokens=2048) as e:
        out = e.load_lora_adapter("a", tiny["adapters"]["a"])
        assert not out["success"] and "--enable-lora" in out["message"]
        assert not e.unload_lora_adapter("a")["success"]


def test_the_served_endpoints(tiny, tmp_path):
    """The real server: /load_lora_adapter, the OpenAI model naming the adapter (its tokens),
    /v1/models, /unload_lora_adapter; bad bodies are 400s."""
    import httpx

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints"))
    from test_http_server import ServerProcess, wait_drained

    server = ServerProcess(str(tmp_path), "--model-path", tiny["model"], "--enable-lora")
    try:
        server.wait_ready()
        post = lambda path, body: httpx.post(server.url + path, json=body, timeout=60)  # noqa: E731
        r = post("/load_lora_adapter", {"lora_name": "b", "lora_path": tiny["adapters"]["b"]})
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {"b": tiny["adapters"]["b"]}
        body = {"prompt": tiny["prompts"][2], "max_tokens": NEW, "temperature": 0}
        body["min_tokens"] = NEW
        r = post("/v1/completions", {**body, "model": "b"})
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]
        assert r.json()["model"] == "b"
        assert got["text"] == post("/detokenize", {"tokens": tiny["refs"]["b"][2]}).json()["text"]
        ids = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
        assert ids[1:] == ["b"]
        assert post("/load_lora_adapter", {"lora_name": "b"}).status_code == 400
        for shadow in (ids[0], f"{ids[0]}:b", f"{ids[0]}:x"):  # `<model>:b` names adapter b
            r = post(
                "/load_lora_adapter", {"lora_name": shadow, "lora_path": tiny["adapters"]["a"]}
            )
            assert r.status_code == 400 and "names the served model" in r.json()["error"]["message"]
        r = post("/v1/completions", {**body, "model": f"{ids[0]}:b"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == got["text"]
        r = post("/load_lora_adapter", {"lora_name": "c", "lora_path": "/nope"})
        assert r.status_code == 400 and "not a directory" in r.json()["error"]["message"]
        assert post("/unload_lora_adapter", {"lora_name": "b"}).json()["loaded_adapters"] == {}
        r = post("/v1/completions", {**body, "model": "b"})
        assert r.status_code == 404
        wait_drained(server)
    finally:
        server.stop()


def test_an_adapter_named_like_the_served_model_is_refused_at_start(tiny):
    """A request's `model` naming the served model gets the base model, so an adapter of that
    name could never be reached by it: `serve` refuses to start (exit 2) before any child
    process."""
    import subprocess

    name = os.path.basename(tiny["model"])
    for shadow in (name, f"{name}:a"):
        out = subprocess.run(
            [sys.executable, "-m", "radixserve", "serve", "--model-path", tiny["model"]]
            + ["--lora-paths", f"{shadow}={tiny['adapters']['a']}", "--port", "1"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, out.stderr
        assert f"--lora-paths: {shadow} names the served model" in out.stderr


def test_data_parallel_replicas_load_and_serve_alike(tiny):
    """--dp-size 2: a loaded adapter reaches both replicas (the controller merges their
    answers), and requests dispatched to either get its tokens."""
    from radixserve import Engine

    prompts, refs = tiny["prompts"], tiny["refs"]
    params = {"max_new_tokens": NEW, "min_new_tokens": NEW, "temperature": 0}
    with Engine(
        model_path=tiny["model"],
        dtype="float32",
        dp_size=2,
        load_balance_method="round_robin",
        lora_paths=(f"a={tiny['adapters']['a']}",),
        max_total_tokens=4096,
    ) as e:
        assert e.load_lora_adapter("b", tiny["adapters"]["b"])["success"]
        loras = ["b", "a", None, "b", "a", "b"]
        outs = e.generate(input_ids=prompts, sampling_params=params, lora_path=loras)
        assert [o["output_ids"] for o in outs] == [refs[x][i] for i, x in enumerate(loras)]
        assert e.get_server_info()["lora_adapters"] == ["a", "b"]
        assert e.unload_lora_adapter("b")["success"]
        assert not e.load_lora_adapter("a", tiny["adapters"]["c"])["success"]
        assert e.get_server_info()["lora_adapters"] == ["a"]


def test_smoothquant_folds_into_the_adapters_a(tiny):
    """--quantization w8a8_int8 divides the norms' outputs by SmoothQuant's factors (folded
    into the weights): a wrapped qkv / gate_up projection gets the smoothed input, and its
    delta is still the adapter's on the true input."""
    from radixserve.args import ServerArgs
    from radixserve.lora.manager import LoRABatch
    from radixserve.model_executor.model_runner import ModelRunner

    args = ServerArgs(
        model_path=tiny["model"],
        device="cpu",
        dtype="float32",
        quantization="w8a8_int8",
        max_total_tokens=2048,
        lora_paths=(f"a={tiny['adapters']['a']}",),
    ).resolve()
    runner = ModelRunner(args)
    manager = runner.lora_manager
    adapter = LoRAAdapter.load("a", tiny["adapters"]["a"], _shape(tiny))
    scale = adapter.config.scaling
    layer = runner.model.model.layers[1]
    x = torch.randn(5, 64)
    for norm, wrapped, projs in (
        (layer.input_layernorm, layer.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
        (layer.post_attention_layernorm, layer.mlp.gate_up_proj, ("gate_proj", "up_proj")),
    ):
        s = norm.smoothed_by
        assert s is not None and not torch.allclose(s, torch.ones_like(s))
        want = torch.cat(
            [x @ adapter.weights[(1, p)][0].t() @ adapter.weights[(1, p)][1].t() for p in projs], 1
        )
        # by two products, and (where radixserve's CPU kernels are built) by lora_delta
        for slots in (None, torch.zeros(5, dtype=torch.int64)) if manager.kernel else (None,):
            y = torch.zeros(5, want.shape[1])
            batch = LoRABatch([(manager.adapters["a"], None)], slots, slots is not None, [], [])
            wrapped._add_deltas(y, x / s, batch)
            torch.testing.assert_close(y, want * scale, rtol=1e-4, atol=1e-4)
