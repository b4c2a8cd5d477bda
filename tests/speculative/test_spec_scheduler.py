"""Speculative decoding in the scheduler, over the fake worker: outputs equal plain decoding
token for token (the fake model's next token is a function of the sequence read back through
the KV slots, so a wrong slot, a wrong tree row or an uncompacted path changes the output),
EOS / stop tokens / max_new_tokens landing inside an accepted run, retraction, aborts at every
point, many more requests than any threshold; every run drains with integrity checks on."""

from __future__ import annotations

import pytest
from rs_fake_worker import FakeRun, expected_output

WINDOW = 2  # the fake model's text repeats: NGRAM drafts get accepted


def _prompts(n: int, base: int = 10) -> dict[str, list[int]]:
    return {f"r{i}": [(i * 7 + j * 3) % 90 + 3 for j in range(base + i % 13)] for i in range(n)}


def _run(prompts, max_new=48, adaptive=False, params=None, **kwargs) -> FakeRun:
    run = FakeRun(
        speculative_algorithm="NGRAM",
        speculative_disable_adaptive=not adaptive,
        overlap=False,
        window=WINDOW,
        **kwargs,
    )
    for rid, p in prompts.items():
        run.submit(rid, p, max_new, **(params or {}))
    run.drain()
    return run


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"page_size": 4},
        {"page_size": 16, "chunked_prefill_size": 32},
        {"disable_radix_cache": True},
        {"chunked_prefill_size": 16, "enable_mixed_chunk": True},
        {"speculative_num_draft_tokens": 2},
        {"speculative_num_draft_tokens": 16, "speculative_ngram_max_bfs_breadth": 8},
    ],
    ids=["default", "page-4", "page-16-chunk-32", "radix-off", "chunk-16-mixed", "k1", "wide"],
)
def test_outputs_equal_plain_decoding_and_drafts_are_accepted(config):
    prompts = _prompts(12)
    run = _run(prompts, **config)
    got = run.tokens()
    for rid, p in prompts.items():
        assert got[rid] == expected_output(p, 48, WINDOW), rid
    st = run.s.stats
    assert st.spec_verify_ct > 0 and st.spec_accepted_tokens > 0.5 * st.spec_verify_ct
    # Fewer decode steps than tokens: several tokens per verify.
    assert st.num_decode_batches < 48


def test_trees_with_branches_are_verified_and_compacted():
    """Wide trees whose accepted path leaves the chain order: the accepted KV is moved onto
    the request's position-ordered slots (else the next steps read wrong tokens)."""
    prompts = _prompts(8)
    run = _run(
        prompts,
        speculative_num_draft_tokens=12,
        speculative_ngram_max_bfs_breadth=6,
        speculative_ngram_branch_length=2,
        page_size=4,
    )
    for rid, p in prompts.items():
        assert run.tokens()[rid] == expected_output(p, 48, WINDOW)


def test_stop_token_and_max_new_tokens_inside_an_accepted_run():
    prompts = _prompts(6)
    plain = {rid: expected_output(p, 60, WINDOW) for rid, p in prompts.items()}
    run = FakeRun(
        speculative_algorithm="NGRAM",
        speculative_disable_adaptive=True,
        overlap=False,
        window=WINDOW,
    )
    stops = {}
    for i, (rid, p) in enumerate(prompts.items()):
        if i % 2:
            stop = plain[rid][25]  # its first occurrence ends the output
            stops[rid] = plain[rid][: plain[rid].index(stop) + 1]
            run.submit(rid, p, 60, stop_token_ids=[stop])
        else:
            stops[rid] = plain[rid][:23]
            run.submit(rid, p, 23)
    run.drain()
    got, reasons = run.tokens(), run.reasons()
    for rid in prompts:
        assert got[rid] == stops[rid], rid
        assert reasons[rid]["type"] in ("stop", "length")
    assert run.s.stats.spec_accepted_tokens > 0


def test_retraction_under_a_small_pool():
    prompts = _prompts(16, base=30)
    # EOS is not ignored (ignore_eos requests reserve their whole budget); the fake never
    # emits it, so admission is reckless and decoding runs out of slots.
    run = _run(
        prompts,
        max_new=60,
        params={"ignore_eos": False},
        total_tokens=700,
        schedule_conservativeness=0.05,
    )
    assert run.s.stats.num_retractions > 0
    got = run.tokens()
    for rid, p in prompts.items():
        assert got[rid] == expected_output(p, 60, WINDOW)


@pytest.mark.parametrize("abort_step", [0, 1, 2, 3, 5, 8, 13])
def test_aborts_at_every_point(abort_step):
    prompts = _prompts(6)
    run = FakeRun(
        speculative_algorithm="NGRAM",
        speculative_disable_adaptive=True,
        overlap=False,
        window=WINDOW,
        chunked_prefill_size=8,
    )
    for rid, p in prompts.items():
        run.submit(rid, p, 40)
    for _ in range(abort_step):
        run.step()
    run.abort("r1")
    run.abort("r4")
    run.drain()
    got, reasons = run.tokens(), run.reasons()
    for rid, p in prompts.items():
        want = expected_output(p, 40, WINDOW)
        if rid in ("r1", "r4") and reasons[rid]["type"] == "abort":
            assert got.get(rid, []) == want[: len(got.get(rid, []))]
        else:
            assert got[rid] == want


def test_more_requests_than_every_threshold():
    """200 requests (more than lpm's 128 and the running limit), adaptive on."""
    prompts = _prompts(200)
    run = _run(prompts, max_new=24, adaptive=True, max_running=64, schedule_policy="lpm")
    got = run.tokens()
    for rid, p in prompts.items():
        assert got[rid] == expected_output(p, 24, WINDOW)


def test_adaptive_falls_back_to_plain_decode_when_drafts_are_rejected():
    """The fake's full-sequence hash never repeats: drafts are rejected, acceptance history
    drops, and most steps run as plain decode."""
    prompts = _prompts(4)
    run = FakeRun(speculative_algorithm="NGRAM", overlap=False)  # adaptive, no window
    for rid, p in prompts.items():
        run.submit(rid, p, 60)
    run.drain()
    for rid, p in prompts.items():
        assert run.tokens()[rid] == expected_output(p, 60)
    st = run.s.stats
    assert st.spec_verify_ct < 0.5 * st.num_decode_batches * len(prompts)
