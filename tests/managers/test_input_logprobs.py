"""Prompt logprobs (`logprob_start_len`) through the scheduler, over the fake worker: every
prompt token from the start position gets the fake model's logprob of it after the tokens
before it, read back from the KV "pool" (so a wrong position, target or slot shows), once, with
the first output. Across chunked prefill, the radix cache (a cached token has no logits: the
match stops before the first scored position), pages, the overlap loop, mixed chunks and
retraction."""

from __future__ import annotations

import random

import pytest
from rs_fake_worker import VOCAB, FakeRun, expected_output, next_token, prompt_logprob


def expected_input_logprobs(prompt: list[int], start: int, k: int):
    tokens, tops = [], []
    for p in range(start, len(prompt)):
        if p == 0:
            tokens.append((None, prompt[0]))
            tops.append(None)
            continue
        tokens.append((prompt_logprob(prompt[:p], prompt[p]), prompt[p]))
        nxt = next_token(prompt[:p])
        tops.append([(-float(j + 1), (nxt + j) % VOCAB) for j in range(k)])
    return tokens, tops


def collect(run: FakeRun) -> dict[str, list]:
    """Per rid, every input_token_logprobs / input_top_logprobs it was sent (not None)."""
    got: dict[str, list] = {}
    for msg in run.outs:
        for i, rid in enumerate(msg.rids):
            if msg.input_token_logprobs and msg.input_token_logprobs[i] is not None:
                got.setdefault(rid, []).append(
                    (msg.input_token_logprobs[i], msg.input_top_logprobs[i])
                )
    return got


def _prompt(seed: int, n: int, shared: list[int]) -> list[int]:
    rng = random.Random(seed)
    return shared + [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.mark.parametrize(
    "overlap,page_size,chunk,mixed",
    [
        (False, 1, None, False),
        (False, 1, 16, False),
        (True, 1, 16, True),
        (False, 4, 16, True),
        (True, 4, None, False),
    ],
)
def test_prompt_logprobs_from_every_start_across_chunks_and_the_cache(
    overlap, page_size, chunk, mixed
):
    run = FakeRun(
        overlap=overlap,
        page_size=page_size,
        chunked_prefill_size=chunk,
        enable_mixed_chunk=mixed,
    )
    shared = [(i * 5) % 90 + 3 for i in range(24)]
    # Warm the cache with the shared prefix, so later requests would hit it.
    run.submit("warm", shared + [7, 8, 9], 4)
    run.drain()
    cases = {}
    rng = random.Random(0)
    for i in range(24):
        prompt = _prompt(i, rng.randrange(1, 40), shared if i % 2 else [])
        start = rng.choice([-1, 0, 1, 5, len(prompt) - 1, len(prompt), rng.randrange(len(prompt))])
        k = rng.choice([0, 0, 2])
        rid = f"r{i}"
        cases[rid] = (prompt, start, k)
        run.submit(rid, prompt, 5, logprob=True, logprob_start_len=start, top_logprobs_num=k)
        if i % 5 == 0:  # arrivals spread over steps: some join a running batch
            run.step()
    run.drain()
    got = collect(run)
    tokens = run.tokens()
    for rid, (prompt, start, k) in cases.items():
        assert tokens[rid] == expected_output(prompt, 5), rid
        assert len(got[rid]) == 1, f"{rid}: prompt logprobs sent {len(got[rid])} times"
        want_tokens, want_tops = expected_input_logprobs(
            prompt, len(prompt) if start < 0 else start, k
        )
        sent_tokens, sent_tops = got[rid][0]
        assert sent_tokens == want_tokens, (rid, start, len(prompt))
        assert sent_tops == (want_tops if k else []), rid
    # Requests that asked for no prompt logprobs still hit the cache.
    assert run.s.stats.cached_tokens > 0


def test_prompt_logprobs_survive_retraction():
    """Decode under a tight pool retracts requests, which re-prefill prompt + output: their
    prompt logprobs are not computed or sent again, and their output is unchanged."""
    run = FakeRun(total_tokens=160, max_running=8, overlap=False)
    cases = {}
    for i in range(8):
        prompt = _prompt(100 + i, 12, [])
        cases[f"r{i}"] = prompt
        run.submit(f"r{i}", prompt, 30, logprob=True, logprob_start_len=0)
    run.drain()
    assert run.s.stats.num_retractions > 0
    got, tokens = collect(run), run.tokens()
    for rid, prompt in cases.items():
        assert tokens[rid] == expected_output(prompt, 30)
        assert len(got[rid]) == 1
        assert got[rid][0][0] == expected_input_logprobs(prompt, 0, 0)[0]


def test_no_prompt_logprobs_without_return_logprob():
    run = FakeRun()
    run.submit("a", [5, 6, 7, 8], 2, logprob=False, logprob_start_len=0)
    run.submit("b", [5, 6, 7, 8], 2, logprob=True)
    run.drain()
    got = collect(run)
    assert "a" not in got
    assert got["b"] == [([], [])]


@pytest.mark.parametrize("overlap,chunk", [(False, None), (True, None), (False, 8), (True, 8)])
def test_max_new_tokens_0_scores_the_prompt_and_generates_nothing(overlap, chunk):
    """SGLang's prompt scoring (`max_new_tokens: 0` with prompt logprobs): the prompt is
    prefilled (in chunks too), its logprobs sent, and the request finishes by length with no
    token (the prefill's sampled token used to be returned); the pool drains."""
    run = FakeRun(overlap=overlap, chunked_prefill_size=chunk)
    prompt = _prompt(7, 20, [])
    run.submit("score", prompt, 0, logprob=True, logprob_start_len=0, top_logprobs_num=2)
    run.submit("plain", prompt[:9], 0)
    run.submit("gen", prompt, 3)
    run.drain()
    tokens, reasons, got = run.tokens(), run.reasons(), collect(run)
    assert tokens["score"] == tokens["plain"] == []
    assert reasons["score"] == reasons["plain"] == {"type": "length", "length": 0}
    assert got["score"] == [expected_input_logprobs(prompt, 0, 2)]
    assert tokens["gen"] == expected_output(prompt, 3)
