"""The hierarchical cache through the real multi-process Engine on a tiny fp32 Llama:
greedy tokens are transformers' and identical with and without the cache while multi-turn
prefixes several times the device pool are demoted to the host and loaded back; the file
storage tier serves a prefix to a restarted engine, never serves it to another model (or the
same path's replaced weights, or a quantized run), and recomputes and rewrites blocks damaged on
disk; integrity checks run every step."""

from __future__ import annotations

import os
import random
import time

import pytest
from rs_testing import (
    file_storage_flags,
    make_tiny_model_dir,
    make_tiny_served_model,
    reference_greedy,
)

from radixserve.mem_cache.hicache_storage import BLOCK_HEADER, HiCacheFile

NEW_TOKENS = 8
DEVICE_TOKENS = 384


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_served_model(str(tmp_path_factory.mktemp("hicache_tiny")))


def _conversations() -> list[list[list[int]]]:
    """4 conversations × 3 turns, 90 new tokens a turn: ~4× the device pool in prefixes."""
    rng = random.Random(0)
    convs = []
    for _ in range(4):
        prompt, turns = [], []
        for _ in range(3):
            prompt = prompt + [rng.randrange(3, 320) for _ in range(90)]
            turns.append(list(prompt))
        convs.append(turns)
    return convs


def _engine(model: str, **kwargs):
    from radixserve import Engine

    kwargs.setdefault("max_total_tokens", DEVICE_TOKENS)
    kwargs.setdefault("chunked_prefill_size", 128)
    return Engine(model_path=model, dtype="float32", enable_integrity_checks=True, **kwargs)


def _params():
    return {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def _serve_turns(engine, convs) -> tuple[list[list[int]], int]:
    """Every conversation's turn t, then turn t+1 (the others push its prefix out)."""
    outs, cached = [], 0
    for t in range(3):
        batch = [conv[t] for conv in convs]
        for o in engine.generate(input_ids=batch, sampling_params=[_params()] * len(batch)):
            outs.append(o["output_ids"])
            cached += o["meta_info"]["cached_tokens"]
    return outs, cached


def _wait_for_storage_writes(engine, tokens: int) -> None:
    deadline = time.monotonic() + 30
    while engine.get_server_info()["hicache_storage_write_tokens"] < tokens:
        assert time.monotonic() < deadline, "the storage writes did not finish"
        time.sleep(0.05)


def _assert_drained(engine) -> None:
    """No request left and every slot back. The host copies of finished requests' KV
    (write-through) run in the background and hold their slots until they land, which on a
    loaded machine can be after the last reply: wait for them, a bounded time."""
    deadline = time.monotonic() + 30
    while True:
        info = engine.get_server_info()
        back = info["available_tokens"] + info["evictable_tokens"] == info["max_total_num_tokens"]
        if (back and info["protected_tokens"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert info["running"] == 0 and info["queued"] == 0
    assert info["available_tokens"] + info["evictable_tokens"] == info["max_total_num_tokens"]
    assert info["protected_tokens"] == 0


def test_greedy_identical_with_and_without_hierarchical_cache(tiny_model):
    convs = _conversations()
    with _engine(tiny_model) as plain:
        base, base_cached = _serve_turns(plain, convs)
    with _engine(tiny_model, enable_hierarchical_cache=True, hicache_ratio=4.0) as hi:
        got, hi_cached = _serve_turns(hi, convs)
        info = hi.get_server_info()
        _assert_drained(hi)
    assert got == base
    ref = reference_greedy(tiny_model, [c[2] for c in convs], NEW_TOKENS)
    assert got[-len(convs) :] == ref
    assert info["hicache_host_hit_tokens"] > 0
    assert hi_cached > base_cached


def test_a_load_back_within_a_full_round_never_overdraws_the_pool(tiny_model):
    """Loading a prefix back locks its device ancestors too, out of the evictable tokens the
    round had already admitted requests against: 20 concurrent requests on three shared
    prefixes, a 300-token pool and 32-token chunks killed the scheduler ("KV pool exhausted
    after admission control") every time."""
    rng = random.Random(11)
    bases = [[rng.randrange(3, 319) for _ in range(80)] for _ in range(3)]
    prompts, params = [], []
    for _ in range(20):
        prompts.append(
            rng.choice(bases) + [rng.randrange(3, 319) for _ in range(rng.randint(1, 40))]
        )
        n = rng.randint(1, 30)
        params.append({"temperature": 0, "max_new_tokens": n, "min_new_tokens": n})
    with _engine(
        tiny_model,
        max_total_tokens=300,
        chunked_prefill_size=32,
        enable_hierarchical_cache=True,
        hicache_ratio=1.0,
    ) as e:
        outs = e.generate(input_ids=prompts, sampling_params=params)
        assert [len(o["output_ids"]) for o in outs] == [p["max_new_tokens"] for p in params]
        assert e.get_server_info()["hicache_host_hit_tokens"] > 0  # loads did happen
        _assert_drained(e)


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_file_storage_serves_a_restarted_engine(tiny_model, tmp_path, kv):
    """Also with a one-byte KV cache (--kv-cache-dtype fp8_e4m3): its blocks are its bytes, in
    a directory of their own (the namespace names the dtype)."""
    flags = {**file_storage_flags(tmp_path), "kv_cache_dtype": kv}
    prompt = [random.Random(9).randrange(3, 320) for _ in range(150)]
    with _engine(tiny_model, **flags) as first:
        a = first.generate(input_ids=prompt, sampling_params=_params())
        _wait_for_storage_writes(first, 128)  # written in the background after the reply
    with _engine(tiny_model, **flags) as second:
        b = second.generate(input_ids=prompt, sampling_params=_params())
        info = second.get_server_info()
        _assert_drained(second)
    assert b["output_ids"] == a["output_ids"]
    assert b["meta_info"]["cached_tokens"] == 128  # four whole blocks, read from storage
    assert info["hicache_storage_hit_tokens"] == 128
    (namespace,) = os.listdir(tmp_path)
    blocks = [f for f in os.listdir(tmp_path / namespace) if f.endswith(".kv")]
    # a block: its header, then 32 tokens x 2 layers x K and V x 2 KV heads x 16 dims
    element = 1 if kv == "fp8_e4m3" else 4
    assert {(tmp_path / namespace / f).stat().st_size for f in blocks} == {
        BLOCK_HEADER.size + 32 * 2 * 2 * 32 * element
    }


def _write_blocks(model: str, root, prompt: list[int], **kwargs) -> None:
    """A first engine serves the prompt and writes its four whole blocks to storage."""
    with _engine(model, **file_storage_flags(root), **kwargs) as first:
        first.generate(input_ids=prompt, sampling_params=_params())
        _wait_for_storage_writes(first, 128)


@pytest.mark.parametrize("change", ["weights_replaced", "int4"])
def test_storage_never_serves_kv_of_other_weights(tmp_path, change):
    """The same --model-path after its weights were replaced in place, or served with
    --quantization int4 after an fp32 run, computes different KV: it must not read the
    blocks of the first run (same tokens, same KV layout) but compute its own."""
    model = make_tiny_served_model(str(tmp_path / "model"))
    prompt = [random.Random(11).randrange(3, 320) for _ in range(150)]
    _write_blocks(model, tmp_path / "storage", prompt)
    kwargs = {}
    if change == "weights_replaced":
        make_tiny_model_dir(model, "llama", seed=1)  # same path, files and shapes
    else:
        kwargs["quantization"] = "int4"
    with _engine(model, **kwargs) as plain:
        want = plain.generate(input_ids=prompt, sampling_params=_params())["output_ids"]
    with _engine(model, **file_storage_flags(tmp_path / "storage"), **kwargs) as second:
        got = second.generate(input_ids=prompt, sampling_params=_params())
        info = second.get_server_info()
        _assert_drained(second)
    assert got["output_ids"] == want
    assert info["hicache_storage_hit_tokens"] == 0
    assert len(os.listdir(tmp_path / "storage")) == 2  # a namespace each


@pytest.fixture(scope="module")
def damage_prompt_and_plain(tiny_model) -> tuple[list[int], list[int]]:
    prompt = [random.Random(12).randrange(3, 320) for _ in range(150)]
    with _engine(tiny_model) as plain:
        return prompt, plain.generate(input_ids=prompt, sampling_params=_params())["output_ids"]


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "swap"])
def test_damaged_blocks_are_recomputed_and_rewritten(
    tiny_model, tmp_path, damage, damage_prompt_and_plain
):
    """Block files damaged between runs (random bytes of the right size; cut in half; each
    one another block's well-formed file): the restarted engine reads none of them, computes
    the prompt (outputs equal a plain engine's) and writes its blocks again, whole and
    readable."""
    prompt, want = damage_prompt_and_plain
    _write_blocks(tiny_model, tmp_path, prompt)
    (namespace,) = os.listdir(tmp_path)
    files = [tmp_path / namespace / f for f in os.listdir(tmp_path / namespace)]
    assert len(files) == 4
    rng = random.Random(0)
    contents = [f.read_bytes() for f in files]
    for i, f in enumerate(files):
        size = f.stat().st_size
        if damage == "corrupt":
            f.write_bytes(bytes(rng.randrange(256) for _ in range(size)))
        elif damage == "truncate":
            f.write_bytes(f.read_bytes()[: size // 2])
        else:  # (served as its own, it gave wrong outputs on every later server)
            f.write_bytes(contents[(i + 1) % len(files)])
    with _engine(tiny_model, **file_storage_flags(tmp_path)) as second:
        got = second.generate(input_ids=prompt, sampling_params=_params())
        _wait_for_storage_writes(second, 128)  # the recomputed blocks, written again
        info = second.get_server_info()
        _assert_drained(second)
    assert got["output_ids"] == want
    assert got["meta_info"]["cached_tokens"] == 0
    assert info["hicache_storage_hit_tokens"] == 0
    store = HiCacheFile(str(tmp_path), namespace)
    assert store.num_blocks() == 4
    assert all(store.get(f.name[: -len(".kv")]) is not None for f in files)
