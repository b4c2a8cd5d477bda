"""--tp-size 2 through the real multi-process Engine (two scheduler ranks in one gloo group)
gives transformers' greedy tokens — the same tokens as one rank — however requests are
batched: together, staggered while others decode, a second wave served from the radix cache,
chunked and mixed prefill, page 16 with the radix cache off, retraction under a small pool,
the overlap loop and the normal one, KV heads split and replicated. Integrity checks are on,
so the ranks compare a digest of their schedule every step. A rank that cannot start fails
the start-up with its error; a rank that dies fails the requests instead of hanging them."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from rs_testing import make_tiny_served_model, reference_greedy

from radixserve.managers.tokenizer_manager import RequestError

NEW_TOKENS = 24
LENGTHS = [5, 70, 17, 40, 9, 100, 33, 12]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_served_model(str(tmp_path_factory.mktemp("tp_tiny")))


@pytest.fixture(scope="module")
def mqa_model(tmp_path_factory) -> str:
    """The tiny model with one KV head: with tp 2 each rank holds a replica of it."""
    path = make_tiny_served_model(str(tmp_path_factory.mktemp("tp_mqa")))
    import torch
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        cfg = transformers.LlamaConfig(**{**json.load(f), "num_key_value_heads": 1})
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny_model, prompts) -> list[list[int]]:
    return reference_greedy(tiny_model, prompts, NEW_TOKENS)


def _engine(model: str, **kwargs):
    from radixserve import Engine

    kwargs.setdefault("max_total_tokens", 4096)
    return Engine(
        model_path=model, tp_size=2, dtype="float32", enable_integrity_checks=True, **kwargs
    )


def _params(**extra):
    return {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, **extra}


def _assert_drained(engine) -> None:
    info = engine.get_server_info()
    assert info["running"] == 0 and info["queued"] == 0
    assert info["available_tokens"] + info["evictable_tokens"] == info["max_total_num_tokens"]
    assert info["protected_tokens"] == 0


@pytest.fixture(scope="module")
def overlap_engine(tiny_model):
    """The overlap loop (one torch thread per rank leaves a CPU for each forward thread),
    chunks of 32 tokens and mixed chunks."""
    with _engine(tiny_model, chunked_prefill_size=32, enable_mixed_chunk=True) as e:
        yield e


def test_tp2_batched_equals_greedy(overlap_engine, prompts, reference):
    outs = overlap_engine.generate(input_ids=prompts, sampling_params=_params())
    assert [o["output_ids"] for o in outs] == reference
    # Each rank runs one torch thread on this 2-CPU box, which leaves a CPU for the forward
    # thread: the overlap loop runs (its collectives and the request broadcast use two groups).
    assert overlap_engine.procs.scheduler_info["overlap"] is True
    _assert_drained(overlap_engine)


def test_tp2_staggered_and_second_wave(overlap_engine, prompts, reference):
    rng = random.Random(1)
    with ThreadPoolExecutor(len(prompts)) as pool:
        futs = []
        for p in prompts:
            futs.append(
                pool.submit(overlap_engine.generate, input_ids=p, sampling_params=_params())
            )
            time.sleep(rng.random() * 0.05)
        outs = [f.result(timeout=120) for f in futs]
    assert [o["output_ids"] for o in outs] == reference
    # The prompts are in every rank's radix tree now: all but the last token comes from it.
    again = overlap_engine.generate(input_ids=prompts, sampling_params=_params())
    assert [o["output_ids"] for o in again] == reference
    assert all(
        o["meta_info"]["cached_tokens"] >= len(p) - 1 for o, p in zip(again, prompts, strict=True)
    )
    _assert_drained(overlap_engine)


def test_tp2_grammar_requests_beside_plain_ones(overlap_engine, prompts, reference):
    """Constrained requests compile on each rank; the ranks admit each one in the same round
    (they agree on whose compile is done, without waiting for one) while the plain requests
    decode: the constrained outputs match their grammars, the plain ones keep their tokens."""
    import re

    patterns = [f"(ab|cd){{2}}[0-9]{{{n}}}x" for n in range(1, 7)]
    with ThreadPoolExecutor(len(prompts) + len(patterns)) as pool:
        plain = pool.submit(overlap_engine.generate, input_ids=prompts, sampling_params=_params())
        constrained = [
            pool.submit(
                overlap_engine.generate,
                input_ids=prompts[i % len(prompts)],
                sampling_params={"max_new_tokens": 32, "temperature": 0, "regex": pattern},
            )
            for i, pattern in enumerate(patterns)
        ]
        assert [o["output_ids"] for o in plain.result(timeout=120)] == reference
        for pattern, fut in zip(patterns, constrained, strict=True):
            out = fut.result(timeout=120)
            assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])
    _assert_drained(overlap_engine)


def test_tp2_normal_loop_page16_radix_off_retraction(tiny_model, prompts, reference):
    """cpu_paged attention in the normal loop, pages of 16, no radix cache, and a pool too
    small for every request's output, admitted recklessly so that decoding must retract."""
    with _engine(
        tiny_model,
        disable_overlap_schedule=True,
        attention_backend="cpu_paged",
        page_size=16,
        disable_radix_cache=True,
        max_total_tokens=352,
        schedule_conservativeness=0.05,
        chunked_prefill_size=-1,
    ) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=_params(ignore_eos=False))
        for i, o in enumerate(outs):
            got = o["output_ids"]
            assert got == reference[i][: len(got)], f"prompt {i} differs"
            assert len(got) == NEW_TOKENS or got[-1] == 2
        info = engine.get_server_info()
        assert info["num_retractions"] > 0
        _assert_drained(engine)


def test_tp2_replicated_kv_head_and_dead_rank(mqa_model, prompts):
    """One KV head on two ranks (replicated); then a rank is killed mid-generation: the
    requests fail with a clear error within seconds instead of hanging."""
    ref = reference_greedy(mqa_model, prompts[:4], NEW_TOKENS)
    engine = _engine(mqa_model, attention_backend="torch_native")
    try:
        outs = engine.generate(input_ids=prompts[:4], sampling_params=_params())
        assert [o["output_ids"] for o in outs] == ref
        pool = ThreadPoolExecutor(1)
        fut = pool.submit(
            engine.generate, input_ids=prompts, sampling_params=_params(max_new_tokens=800)
        )
        time.sleep(0.5)
        assert not fut.done(), "the generation must still be running when the rank dies"
        os.kill(engine.procs.schedulers[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RequestError) as e:
            fut.result(timeout=30)
        assert e.value.status_code == 503 and "tp1" in str(e.value)
        assert time.monotonic() - start < 15
    finally:
        engine.shutdown()


def test_tp_size_that_does_not_divide_the_heads_fails_start_up(tiny_model, monkeypatch):
    """Refused from the config before any process starts. Past that check, the ranks' failed
    start leaves no process behind: ranks 1 and 2, waiting for rank 0 in the process group's
    rendezvous, are stopped too (left running, they joined the next group that listened on
    that port)."""
    import multiprocessing

    from radixserve import Engine
    from radixserve.model_loader import loader

    before = set(multiprocessing.active_children())  # other tests' engines may be running
    args = {"model_path": tiny_model, "tp_size": 3, "dtype": "float32", "max_total_tokens": 1024}
    with pytest.raises(ValueError, match="4 attention heads"):
        Engine(**args)
    assert [p.name for p in set(multiprocessing.active_children()) - before] == []
    monkeypatch.setattr(loader, "check_model_files", lambda server_args: None)
    with pytest.raises(RuntimeError, match="4 attention heads"):
        Engine(**args)
    assert [p.name for p in set(multiprocessing.active_children()) - before] == []
