"""Greedy generation with the real default model equals transformers' greedy generate, token for
token, however the requests are batched; every run drains with no slot, row or lock left."""

from __future__ import annotations

import random

import pytest
from rs_testing import SchedulerHarness, hf_greedy, load_hf_reference, make_prompts

pytestmark = pytest.mark.real_model

NEW_TOKENS = 32
LENGTHS = [5, 300, 17, 120, 64, 9, 250, 33, 80, 200, 12, 150, 45, 7, 99, 180]


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from radixserve.model_loader.weights import load_tokenizer

    return load_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return make_prompts(tokenizer, LENGTHS)


@pytest.fixture(scope="module")
def reference(default_model_path, prompts):
    return hf_greedy(load_hf_reference(default_model_path), prompts, NEW_TOKENS)


def _params():
    return dict(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _check(h: SchedulerHarness, rids: list[str], reference: list[list[int]]) -> None:
    results = h.results()
    for i, rid in enumerate(rids):
        assert results[rid] == reference[i], f"prompt {i} (len {LENGTHS[i]}) differs"
    h.scheduler.assert_drained()


@pytest.fixture(scope="module")
def harness_factory(default_model_path):
    def make(**kwargs):
        kwargs.setdefault("max_total_tokens", 12000)
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
