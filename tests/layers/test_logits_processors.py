"""The sampler's logits processors against reference implementations, one request and batched.

References: transformers' RepetitionPenaltyLogitsProcessor (prompt and output tokens); OpenAI's
documented formula for frequency / presence penalties (output tokens only):
    logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0);
logit_bias added to the logit; min_new_tokens forbids EOS and stop_token_ids until that many
tokens are out. The processors run in the order the sampler documents: repetition, frequency /
presence, logit_bias, min_new_tokens, then the grammar's vocab mask.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

from radixserve.layers.sampler import (
    Sampler,
    SamplingBatchInfo,
    apply_request_processors,
    inverse_cdf_draw,
)
from radixserve.sampling_params import SamplingParams

V = 64
EOS = 2
NEG_INF = float("-inf")


def make_req(prompt=(5, 6, 7, 5), output=(8, 8, 9, 5), eos=(EOS,), **params) -> SimpleNamespace:
    return SimpleNamespace(
        sampling_params=SamplingParams(**params),
        origin_input_ids=list(prompt),
        output_ids=list(output),
        eos_token_ids=list(eos),
    )


def random_logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3  # positive and negative logits


# -- references ----------------------------------------------------------------------------------
def ref_repetition(logits: torch.Tensor, r) -> torch.Tensor:
    penalty = r.sampling_params.repetition_penalty
    ids = torch.tensor([r.origin_input_ids + r.output_ids])
    return RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.view(1, -1).clone()).view(-1)


def ref_frequency_presence(logits: torch.Tensor, r) -> torch.Tensor:
    sp, out = r.sampling_params, logits.clone()
    for token, count in Counter(r.output_ids).items():
        out[token] -= sp.frequency_penalty * count + sp.presence_penalty
    return out


def ref_logit_bias(logits: torch.Tensor, r) -> torch.Tensor:
    out = logits.clone()
    for key, bias in (r.sampling_params.logit_bias or {}).items():
        out[int(key)] += bias
    return out


def ref_min_new_tokens(logits: torch.Tensor, r) -> torch.Tensor:
    sp, out = r.sampling_params, logits.clone()
    if len(r.output_ids) < sp.min_new_tokens:
        banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(r.eos_token_ids))
        out[banned] = NEG_INF
    return out


def reference(logits: torch.Tensor, r) -> torch.Tensor:
    if r.sampling_params.repetition_penalty != 1.0:
        logits = ref_repetition(logits, r)
    for step in (ref_frequency_presence, ref_logit_bias, ref_min_new_tokens):
        logits = step(logits, r)
    return logits


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# -- one request ----------------------------------------------------------------------------------
@pytest.mark.parametrize("penalty", [0.5, 0.9, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    logits = random_logits()[0]
    r = make_req(repetition_penalty=penalty)
    got = apply_request_processors(logits, r)
    assert torch.equal(got, ref_repetition(logits, r))
    seen = set(r.origin_input_ids + r.output_ids)
    untouched = [t for t in range(V) if t not in seen]
    assert torch.equal(got[untouched], logits[untouched])
    assert not torch.equal(got[sorted(seen)], logits[sorted(seen)])


@pytest.mark.parametrize("frequency,presence", [(0.5, 0.0), (0.0, 1.5), (1.2, -0.7), (-2.0, 2.0)])
def test_frequency_presence_penalty_formula(frequency, presence):
    logits = random_logits()[0]
    r = make_req(frequency_penalty=frequency, presence_penalty=presence)
    got = apply_request_processors(logits, r)
    assert_close(got, ref_frequency_presence(logits, r))
    # Output tokens only: 6 and 7 appear in the prompt alone.
    assert torch.equal(got[[6, 7]], logits[[6, 7]])
    assert_close(got[8], logits[8] - 2 * frequency - presence)


def test_frequency_presence_without_output_is_identity():
    logits = random_logits()[0]
    r = make_req(output=(), frequency_penalty=1.0, presence_penalty=1.0)
    assert torch.equal(apply_request_processors(logits, r), logits)


def test_logit_bias_is_added():
    logits = random_logits()[0]
    r = make_req(logit_bias={"3": 100.0, "10": -100, "11": 0.25})
    got = apply_request_processors(logits, r)
    assert_close(got, ref_logit_bias(logits, r))
    assert got.argmax().item() == 3


@pytest.mark.parametrize("num_out", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_new_tokens_masks_stop_tokens_until_reached(num_out, ignore_eos):
    logits = random_logits()[0]
    r = make_req(
        output=range(20, 20 + num_out),
        eos=(EOS, 0),
        min_new_tokens=3,
        stop_token_ids=[40, 41],
        ignore_eos=ignore_eos,
    )
    got = apply_request_processors(logits, r)
    assert torch.equal(got, ref_min_new_tokens(logits, r))
    active = num_out < 3
    assert bool(torch.isinf(got[[40, 41]]).all()) == active
    assert bool(torch.isinf(got[[EOS, 0]]).all()) == (active and not ignore_eos)
    others = [t for t in range(V) if t not in (EOS, 0, 40, 41)]
    assert torch.equal(got[others], logits[others])


def test_all_processors_compose_in_documented_order():
    logits = random_logits()[0]
    r = make_req(
        repetition_penalty=1.5,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        logit_bias={"8": 1.0, "30": -3.0},
        min_new_tokens=10,
        stop_token_ids=[31],
    )
    assert_close(apply_request_processors(logits, r), reference(logits, r))


# -- batched ----------------------------------------------------------------------------------
token_ids = st.lists(st.integers(0, V - 1), max_size=12)
req_strategy = st.builds(
    lambda prompt, output, rep, freq, pres, bias, min_new, stop, ignore_eos: make_req(
        prompt=[1, *prompt],
        output=output,
        repetition_penalty=rep,
        frequency_penalty=freq,
        presence_penalty=pres,
        logit_bias={str(k): v for k, v in bias.items()} or None,
        min_new_tokens=min_new,
        stop_token_ids=stop,
        ignore_eos=ignore_eos,
    ),
    token_ids,
    token_ids,
    st.sampled_from([1.0, 0.7, 1.2, 2.0]),
    st.sampled_from([0.0, 0.5, -1.0]),
    st.sampled_from([0.0, 0.8, -0.3]),
    st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100, width=32), max_size=3),
    st.integers(0, 6),
    st.lists(st.integers(0, V - 1), max_size=2),
    st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(req_strategy, min_size=1, max_size=5), seed=st.integers(0, 1000))
def test_batch_equals_each_row_alone(reqs, seed):
    logits = random_logits(len(reqs), seed)
    before = logits.clone()
    got = SamplingBatchInfo.from_reqs(reqs, V, "cpu").apply_logits_processors(logits)
    assert torch.equal(logits, before), "the caller's logits were modified"
    for i, r in enumerate(reqs):
        alone = SamplingBatchInfo.from_reqs([r], V, "cpu").apply_logits_processors(
            logits[i : i + 1]
        )
        assert torch.equal(got[i], alone[0])
        assert_close(got[i], reference(logits[i], r))


def test_vocab_mask_applies_after_processors():
    reqs = [make_req(logit_bias={"4": 100.0}), make_req()]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    info.vocab_mask = torch.zeros(2, V, dtype=torch.bool)
    info.vocab_mask[0, 4] = True  # the grammar forbids what the bias prefers
    logits = random_logits(2)
    got = info.apply_logits_processors(logits)
    assert got[0, 4] == NEG_INF
    assert torch.equal(got[1], logits[1])
    assert torch.equal(got[0, 5:], reference(logits[0], reqs[0])[5:])


@pytest.mark.parametrize("grammar_allows_more", [True, False])
def test_min_new_tokens_bans_eos_after_a_grammar_mask_that_allows_another_token(
    grammar_allows_more,
):
    """min_new_tokens was ignored with a grammar: regex (ab|cd|ef)+ and min 20 ended at 3
    tokens, at the grammar's first EOS (SGLang's and vLLM's ban applies with grammars too).
    Where the grammar allows nothing but EOS and the stop ids (a closed JSON object), they
    stay allowed: a row with no token left cannot be sampled."""
    r = make_req(output=(20,), min_new_tokens=3, stop_token_ids=[40])
    r.grammar = object()
    info = SamplingBatchInfo.from_reqs([r, make_req()], V, "cpu")
    mask = torch.ones(2, V, dtype=torch.bool)
    mask[1] = False
    mask[0, [EOS, 40, *([9] if grammar_allows_more else [])]] = False
    info.vocab_mask = mask
    logits = random_logits(2)
    logits[0, EOS] = 50.0
    got = info.apply_logits_processors(logits)
    allowed = torch.isfinite(got[0]).nonzero().view(-1).tolist()
    assert allowed == ([9] if grammar_allows_more else [EOS, 40])
    assert torch.equal(got[1], logits[1])


def test_greedy_sampler_picks_argmax_of_processed_row():
    reqs = [
        make_req(temperature=0.0, repetition_penalty=2.0),
        make_req(temperature=0.0, logit_bias={"50": 100.0}),
        make_req(temperature=0.0, min_new_tokens=8, logit_bias={str(EOS): 100.0}),
        make_req(temperature=0.0),
    ]
    logits = random_logits(len(reqs), seed=3)
    out = Sampler()(logits, SamplingBatchInfo.from_reqs(reqs, V, "cpu"))
    want = [reference(logits[i], r).argmax().item() for i, r in enumerate(reqs)]
    assert out.next_token_ids.tolist() == want
    assert out.next_token_ids[1] == 50 and out.next_token_ids[2] != EOS


def _seeded_token(reqs, logits) -> int:
    return Sampler()(logits, SamplingBatchInfo.from_reqs(reqs, V, "cpu")).next_token_ids[0].item()


def test_seeded_row_reproduces_alone_and_batched_with_unfiltered_rows():
    logits = random_logits(2, seed=5)
    for seed in range(20):
        r = make_req(seed=seed, repetition_penalty=1.3)
        alone = _seeded_token([r], logits[:1])
        assert alone == _seeded_token([r, make_req(temperature=0.5)], logits)
        assert alone == _seeded_token([r, make_req(temperature=0.0)], logits)


def test_seeded_row_reproduces_when_batched_with_filtered_rows():
    logits = random_logits(2, seed=5)
    for seed in range(20):
        r = make_req(seed=seed)
        assert _seeded_token([r], logits[:1]) == _seeded_token([r, make_req(top_p=0.5)], logits)


@pytest.mark.parametrize(
    "params",
    [
        {"repetition_penalty": 5e-324},
        {"temperature": 1e300, "min_new_tokens": 2},
        {"temperature": 1e39, "logit_bias": {"3": -100}},
        {"temperature": 1e39, "seed": 5},
    ],
)
def test_extreme_parameters_never_break_the_draw(params):
    """Values inside the accepted ranges that overflow float32 (found by fuzzing the server:
    each one crashed the scheduler in torch.multinomial)."""
    torch.manual_seed(0)
    reqs = [make_req(max_new_tokens=4, **params), make_req(max_new_tokens=4, temperature=0.7)]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    logits = random_logits(rows=2) * 2
    logits[0, 7] = float("-inf")  # a banned token, as a grammar mask leaves it
    out = Sampler()(logits, info, return_logprob=True)
    assert out.next_token_ids.shape == (2,)
    assert all(0 <= t < V for t in out.next_token_ids.tolist())


def test_unseeded_draws_follow_the_distribution_and_never_pick_a_token_without_mass():
    """inverse_cdf_draw against the distribution it is given (unnormalized, zeros at both ends
    and inside): Pearson's chi-square over 40,000 draws, at p ≈ 1e-4 (5 degrees of freedom)."""
    torch.manual_seed(0)
    mass = torch.tensor([0.0, 0.2, 0.4, 0.0, 0.6, 0.3, 0.5, 0.0])  # sums to 2
    n = 40_000
    drawn = inverse_cdf_draw(mass.expand(n, -1).contiguous())
    counts = torch.bincount(drawn, minlength=len(mass)).double()
    assert counts[mass == 0].sum() == 0
    expected = n * mass.double() / mass.sum()
    keep = mass > 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert chi2 < 25.7, (chi2, counts.tolist(), expected.tolist())
    one_hot = torch.zeros(3, 5)
    one_hot[0, 0], one_hot[1, 4], one_hot[2, 2] = 1.0, 3.0, 1e-30
    assert inverse_cdf_draw(one_hot).tolist() == [0, 4, 2]


def test_sampled_rows_keep_to_their_filters_next_to_seeded_and_greedy_rows():
    torch.manual_seed(1)
    logits = random_logits(4, seed=7)
    top3 = set(logits[0].topk(3).indices.tolist())
    reqs = [
        make_req(top_k=3),
        make_req(seed=11),
        make_req(temperature=0.0),
        make_req(temperature=0.8, min_p=0.5),
    ]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    processed = info.apply_logits_processors(logits.clone())
    probs = torch.softmax(processed[3] / 0.8, dim=-1)
    allowed = set(torch.nonzero(probs >= probs.max() * 0.5).view(-1).tolist())
    seen: list[set[int]] = [set() for _ in reqs]
    for _ in range(300):
        out = Sampler()(logits, info).next_token_ids.tolist()
        for i, t in enumerate(out):
            seen[i].add(t)
    assert seen[0] <= top3 and len(seen[0]) > 1
    assert len(seen[1]) == 1  # seeded at a fixed step: the same token every time
    assert seen[2] == {processed[2].argmax().item()}
    assert seen[3] <= allowed
