"""Greedy generation with the real default model equals transformers' greedy generate, token for
token, however the requests are batched, in the overlap loop (torch-native attention) and in the
normal loop (cpu_paged attention), so loops and backends are token-identical; every run drains
with no slot, row or lock left. The module's Schedulers share one load of the model's weights
(shared_model_loads) and the references come from reference_greedy (kept on disk)."""

from __future__ import annotations

import random

import pytest
from rs_testing import SchedulerHarness, make_prompts, reference_greedy, shared_model_loads

pytestmark = pytest.mark.real_model

NEW_TOKENS = 32
LENGTHS = [5, 300, 17, 120, 64, 9, 250, 33, 80, 200, 12, 150, 45, 7, 99, 180]


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return default_tokenizer  # the session's (see conftest.py)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return make_prompts(tokenizer, LENGTHS)


@pytest.fixture(scope="module", autouse=True)
def _one_model_load():
    with shared_model_loads():
        yield


@pytest.fixture(scope="module")
def reference(default_model_path, prompts):
    return reference_greedy(default_model_path, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def shared_prefix_prompts(tokenizer):
    """Five prompts on one 200-token prefix."""
    base = make_prompts(tokenizer, [200])[0]
    return [base + t for t in make_prompts(tokenizer, [6, 9, 14, 20, 11])]


@pytest.fixture(scope="module")
def shared_prefix_reference(default_model_path, shared_prefix_prompts):
    return reference_greedy(default_model_path, shared_prefix_prompts, 16)


def _params():
    return dict(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _check(h: SchedulerHarness, rids: list[str], reference: list[list[int]]) -> None:
    results = h.results()
    for i, rid in enumerate(rids):
        assert results[rid] == reference[i], f"prompt {i} (len {LENGTHS[i]}) differs"
    h.scheduler.assert_drained()


# The overlap loop runs the portable torch-native attention; the normal loop runs cpu_paged
# (decode attention reading the KV pool in place, a C++ kernel). Both must equal transformers.
@pytest.fixture(scope="module", params=["overlap", "normal-cpu_paged"])
def harness_factory(request, default_model_path):
    def make(**kwargs):
        kwargs.setdefault("max_total_tokens", 12000)
        kwargs.setdefault("disable_overlap_schedule", request.param != "overlap")
        backend = "torch_native" if request.param == "overlap" else "cpu_paged"
        kwargs.setdefault("attention_backend", backend)
        return SchedulerHarness(model_path=default_model_path, **kwargs)

    return make


def test_submitted_together(harness_factory, prompts, reference):
    h = harness_factory()
    rids = [h.submit(p, **_params()) for p in prompts]
    h.run_until_idle()
    _check(h, rids, reference)


def test_submitted_staggered_while_others_decode(harness_factory, prompts, reference):
    h = harness_factory()
    rng = random.Random(1)
    rids: list[str] = []
    pending = list(enumerate(prompts))
    while pending or h.scheduler.has_work():
        if pending and (not rids or rng.random() < 0.4):
            _, p = pending.pop(0)
            rids.append(h.submit(p, **_params()))
        h.step()
    _check(h, rids, reference)


def test_queue_with_max_running_requests_4(harness_factory, prompts, reference):
    h = harness_factory(max_running_requests=4)
    rids = [h.submit(p, **_params()) for p in prompts]
    max_running = 0
    while h.scheduler.has_work():
        h.step()
        max_running = max(max_running, len(h.scheduler.running_batch.reqs))
    assert max_running <= 4
    _check(h, rids, reference)


def test_second_wave_hits_the_radix_cache(harness_factory, prompts, reference):
    h = harness_factory()
    first = [h.submit(p, **_params()) for p in prompts]
    h.run_until_idle()
    second = [h.submit(p, **_params()) for p in prompts]
    h.run_until_idle()
    _check(h, first, reference)
    _check(h, second, reference)
    # Every second-wave prompt (but its last token) is served from the cache.
    assert h.scheduler.stats.cached_tokens >= sum(len(p) - 1 for p in prompts)


@pytest.mark.parametrize(
    "config",
    [
        {"disable_radix_cache": True},
        {"chunked_prefill_size": 64},
        {"chunked_prefill_size": 64, "enable_mixed_chunk": True},
        {"enable_mixed_chunk": True, "chunked_prefill_size": -1},
        {"page_size": 16, "chunked_prefill_size": 64},
    ],
    ids=["radix-off", "chunk-64", "chunk-64-mixed", "mixed", "page-16"],
)
def test_configurations_are_token_exact(harness_factory, prompts, reference, config):
    # Half of the prompts (5 to 300 tokens) keep this affordable on two cores.
    h = harness_factory(**config)
    rng = random.Random(2)
    rids: list[str] = []
    pending = list(prompts[:8])
    while pending or h.scheduler.has_work():
        if pending and (not rids or rng.random() < 0.5):
            rids.append(h.submit(pending.pop(0), **_params()))
        h.step()
    _check(h, rids, reference[:8])


def test_retraction_under_a_small_pool_is_token_exact(harness_factory, prompts, reference):
    # The first 8 prompts need 798 tokens and their outputs 256 more; the pool holds 900 and
    # admission is made reckless (tiny new_token_ratio; EOS is not ignored, since ignore_eos
    # requests reserve their whole budget) so that decoding runs out of slots and must retract.
    h = harness_factory(
        max_total_tokens=900, schedule_conservativeness=0.05, chunked_prefill_size=-1
    )
    params = {**_params(), "ignore_eos": False}
    rids = [h.submit(p, **params) for p in prompts[:8]]
    h.run_until_idle()
    assert h.scheduler.stats.num_retractions > 0
    results = h.results()
    eos = h.scheduler.model_config.eos_token_ids
    for i, rid in enumerate(rids):
        got = results[rid]
        assert got == reference[i][: len(got)], f"prompt {i} differs"
        assert len(got) == NEW_TOKENS or got[-1] in eos
    h.scheduler.assert_drained()


def test_requests_sharing_a_cached_prefix_decode_exactly(
    harness_factory, shared_prefix_prompts, shared_prefix_reference
):
    """Several requests decode together on one cached 200-token prefix (cascade attention)."""
    prompts = shared_prefix_prompts
    h = harness_factory()
    first = h.submit(prompts[0], **{**_params(), "max_new_tokens": 16})
    h.step()  # the prefix is in the tree before the others arrive
    rids = [first] + [h.submit(p, **{**_params(), "max_new_tokens": 16}) for p in prompts[1:]]
    h.run_until_idle()
    results = h.results()
    assert [results[r] for r in rids] == shared_prefix_reference
    assert h.scheduler.stats.cached_tokens >= 4 * 200
    h.scheduler.assert_drained()
