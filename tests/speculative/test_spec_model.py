"""Speculative decoding with real models (tiny random Llamas): greedy outputs are identical
with and without speculation, for NGRAM and STANDALONE, across batching, chunking, the radix
cache on and off, pages, mixed steps and retraction; a draft that is the target accepts every
draft token, a draft with other random weights changes nothing; penalties and logprobs match
plain decoding; a draft with another tokenizer is refused at start-up."""

from __future__ import annotations

import os

import pytest
from rs_testing import SchedulerHarness, make_tiny_model_dir, save_byte_tokenizer

from radixserve.io_struct import AbortReq

NEW = 40


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory) -> str:
    """Same architecture and vocabulary as tiny_llama_dir, other random weights."""
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_draft")), "llama", seed=5)


def _prompts() -> list[list[int]]:
    # Some repetition (NGRAM finds matches), some not; lengths around the chunk sizes used.
    out = []
    for i in range(8):
        head = [(i * 11 + j * 7) % 300 + 3 for j in range(9 + 13 * i)]
        out.append(head + [40, 41, 42, 43] * (1 + i % 3) + head[:5])
    return out


GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


def _harness(model: str, tokenizer=None, **kwargs) -> SchedulerHarness:
    kwargs.setdefault("max_total_tokens", 4096)
    kwargs.setdefault("disable_overlap_schedule", True)
    return SchedulerHarness(tokenizer, model_path=model, **kwargs)


def _run(model: str, prompts, params=None, **kwargs):
    h = _harness(model, **kwargs)
    p = {**GREEDY, **(params or {})}
    rids = [h.submit(x, **p) for x in prompts]
    h.run_until_idle()
    h.scheduler.assert_drained()
    res = h.results()
    return [res[r] for r in rids], h


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return _run(tiny_llama_dir, _prompts())[0]


def _spec(algo: str, tiny: str, draft: str | None = None) -> dict:
    if algo == "NGRAM":
        return {"speculative_algorithm": "NGRAM", "speculative_disable_adaptive": True}
    return {
        "speculative_algorithm": "STANDALONE",
        "speculative_draft_model_path": draft or tiny,
        "speculative_num_steps": 3,
        "speculative_disable_adaptive": True,
    }


CONFIGS = {
    "default": {},
    "torch-native": {"attention_backend": "torch_native"},
    "radix-off": {"disable_radix_cache": True},
    "chunk-16": {"chunked_prefill_size": 16},
    "chunk-16-mixed": {"chunked_prefill_size": 16, "enable_mixed_chunk": True},
    "page-16": {"page_size": 16, "chunked_prefill_size": 32},
    "max-running-3": {"max_running_requests": 3},
}


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_greedy_outputs_are_identical(tiny_llama_dir, plain, algo, config):
    if algo == "STANDALONE" and CONFIGS[config].get("enable_mixed_chunk"):
        # (the draft model's KV of the decoding rows mixed into a prefill was marked written)
        with pytest.raises(ValueError, match="--enable-mixed-chunk does not run with STANDALONE"):
            _run(tiny_llama_dir, _prompts(), **_spec(algo, tiny_llama_dir), **CONFIGS[config])
        return
    got, h = _run(tiny_llama_dir, _prompts(), **_spec(algo, tiny_llama_dir), **CONFIGS[config])
    assert got == plain
    st = h.scheduler.stats
    assert st.spec_verify_ct > 0
    if algo == "STANDALONE":  # the draft is the target itself: every draft is accepted
        assert st.spec_accepted_tokens == st.spec_draft_tokens > 0


def _cached_slots_with_stale_draft_kv(h: SchedulerHarness) -> tuple[int, int]:
    """(slots the radix cache holds, those whose draft KV differs from the target's): with the
    draft model the target itself, the two pools agree wherever both were written."""
    import torch

    s = h.scheduler
    tree, values, stack = s.tree_cache, [], [s.tree_cache.root_node]
    while stack:
        node = stack.pop()
        if node is not tree.root_node and node.value is not None:
            values.append(node.value)
        stack.extend(node.children.values())
    slots = torch.cat(values)
    target = s.tp_worker.model_runner.token_to_kv_pool.k_buffer[0][slots]
    draft = s.spec_worker.draft_runner.token_to_kv_pool.k_buffer[0][slots]
    stale = (target - draft).abs().flatten(1).amax(1) > 1e-4
    return len(slots), int(stale.sum())


@pytest.mark.parametrize("end", ["plain_step", "abort"])
def test_the_cache_gets_only_tokens_with_the_draft_models_kv(tiny_llama_dir, end):
    """A request that ended in a plain decode step (its last token had no draft budget) or
    was aborted put its last tokens into the cache with the target's KV and not the draft's:
    a later request reusing them drafted from stale KV, and drafts were rejected."""
    h = _harness(tiny_llama_dir, **_spec("STANDALONE", tiny_llama_dir))
    prompt = _prompts()[2]
    if end == "plain_step":
        h.submit(prompt, max_new_tokens=30, temperature=0.0, ignore_eos=True)
        h.run_until_idle()
    else:
        rid = h.submit(prompt, max_new_tokens=300, temperature=0.0, ignore_eos=True)
        for _ in range(12):
            h.step()
        h.scheduler.process_input_requests([AbortReq(rid)])
        h.run_until_idle()
    cached, stale = _cached_slots_with_stale_draft_kv(h)
    assert cached > len(prompt) and stale == 0


def test_drafts_past_a_stop_token_are_not_counted_as_accepted(tiny_llama_dir, plain):
    """A stop token inside an accepted run drops the drafts after it; they were counted as
    accepted, so a verify step could "accept" more drafts than it committed tokens."""
    h = _harness(tiny_llama_dir, **_spec("STANDALONE", tiny_llama_dir))
    calls = []
    on_verify = h.scheduler.stats.on_verify
    h.scheduler.stats.on_verify = lambda *a: (calls.append(a), on_verify(*a))
    prompt, want = _prompts()[0], plain[0]
    rids = []
    for p in range(4, 12):  # the stop lands at every place in a run of 3 drafts + 1
        if want[p] in want[:p]:
            continue
        rids.append((h.submit(prompt, **{**GREEDY, "stop_token_ids": [want[p]]}), p))
    h.run_until_idle()
    h.scheduler.assert_drained()
    res = h.results()
    assert [len(res[r]) for r, _ in rids] == [p + 1 for _, p in rids] and len(rids) >= 4
    assert calls and all(accepted <= committed for _, accepted, committed in calls), calls
    st = h.scheduler.stats
    assert st.spec_accepted_tokens <= st.spec_committed_tokens


def test_a_random_draft_model_changes_nothing(tiny_llama_dir, other_draft_dir, plain):
    got, h = _run(tiny_llama_dir, _prompts(), **_spec("STANDALONE", "", other_draft_dir))
    assert got == plain
    st = h.scheduler.stats
    assert st.spec_accepted_tokens < st.spec_draft_tokens


def test_second_wave_hits_the_cache_and_stays_exact(tiny_llama_dir, plain):
    h = _harness(tiny_llama_dir, **_spec("STANDALONE", tiny_llama_dir))
    first = [h.submit(x, **GREEDY) for x in _prompts()]
    h.run_until_idle()
    second = [h.submit(x, **GREEDY) for x in _prompts()]
    h.run_until_idle()
    res = h.results()
    assert [res[r] for r in first] == plain and [res[r] for r in second] == plain
    assert h.scheduler.stats.cached_tokens > 0
    st = h.scheduler.stats  # the cached draft KV is right too: still every draft accepted
    assert st.spec_accepted_tokens == st.spec_draft_tokens
    h.scheduler.assert_drained()


def test_retraction_is_exact(tiny_llama_dir):
    prompts = _prompts()
    params = {"ignore_eos": False}
    want, _ = _run(tiny_llama_dir, prompts, params, max_total_tokens=4096, chunked_prefill_size=-1)
    for algo in ("NGRAM", "STANDALONE"):
        got, h = _run(
            tiny_llama_dir,
            prompts,
            params,
            max_total_tokens=400,
            schedule_conservativeness=0.05,
            chunked_prefill_size=-1,
            **_spec(algo, tiny_llama_dir),
        )
        assert h.scheduler.stats.num_retractions > 0, algo
        assert got == want, algo


@pytest.mark.parametrize("tops", ["mixed", "none"])
@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_penalties_and_logprobs_match_plain_decoding(tiny_llama_dir, algo, tops):
    prompts = _prompts()[:4]
    params = {
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.4,
        "presence_penalty": 0.2,
        "min_new_tokens": 30,
        "ignore_eos": False,
    }

    def run(**kw):
        h = _harness(tiny_llama_dir, **kw)
        for i, x in enumerate(prompts):
            top = 2 if i % 2 and tops == "mixed" else 0  # top-logprob counts in one batch
            h.scheduler.process_input_requests([_logprob_req(f"r{i}", x, params, top)])
        h.run_until_idle()
        reqs = {}
        for msg in h.outputs:
            for j, rid in enumerate(msg.rids):
                st = reqs.setdefault(rid, ([], [], []))
                st[0].extend(msg.output_ids[j])
                st[1].extend(msg.output_token_logprobs[j] or [])
                st[2].extend(msg.output_top_logprobs[j] or [])
        return reqs, h

    want, _ = run()
    got, h = run(**_spec(algo, tiny_llama_dir))
    assert h.scheduler.stats.spec_verify_ct > 0
    for rid, (ids, lps, tops) in want.items():
        assert got[rid][0] == ids, rid
        assert [t for _, t in got[rid][1]] == ids
        assert [v for v, _ in got[rid][1]] == pytest.approx([v for v, _ in lps], abs=1e-4)
        assert [[t for _, t in row] for row in got[rid][2]] == [[t for _, t in row] for row in tops]


@pytest.mark.parametrize(
    "params",
    [{"logit_bias": {"44": 3.0}}, {"frequency_penalty": 0.8}, {"repetition_penalty": 1.5}],
)
def test_the_draft_model_drafts_with_the_requests_logits_processors(tiny_llama_dir, params):
    """The draft model drafted without the request's penalties and logit_bias, which the
    target's verify applies: with the target as its own draft, 2% of drafts were accepted
    with a logit_bias, about 20% with a penalty, instead of all."""
    got, h = _run(tiny_llama_dir, _prompts()[:4], params, **_spec("STANDALONE", tiny_llama_dir))
    want, _ = _run(tiny_llama_dir, _prompts()[:4], params)
    assert got == want
    stats = h.scheduler.stats
    assert stats.spec_draft_tokens > 50
    assert stats.spec_accepted_tokens / stats.spec_draft_tokens > 0.9, params


def _logprob_req(rid, ids, params, top):
    from radixserve.io_struct import TokenizedGenerateReqInput
    from radixserve.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=NEW, temperature=0.0, **params)
    return TokenizedGenerateReqInput(rid, None, list(ids), sp, False, True, top)


def test_seeded_sampling_gives_the_tokens_of_plain_decoding(tiny_llama_dir, other_draft_dir):
    """A seeded request reproduces whatever it is batched with, so also whether or not it
    drafts: NGRAM's verify draws the plain sampler's token at each position (its residual walk
    once drew others), and a draft model drafts with that position's noise (it once drew from
    torch's global generator: STANDALONE's seeded tokens changed from call to call)."""
    prompts = _prompts()
    params = {**GREEDY, "temperature": 0.5, "top_p": 0.95, "top_k": 3}
    hs = []

    def run(**spec):
        h = _harness(tiny_llama_dir, **spec)
        rids = [h.submit(x, **params, seed=100 + i) for i, x in enumerate(prompts)]
        h.run_until_idle()
        h.scheduler.assert_drained()
        hs.append(h)
        return [h.results()[r] for r in rids]

    want = run()
    for spec in (
        _spec("NGRAM", tiny_llama_dir),
        _spec("STANDALONE", tiny_llama_dir),
        _spec("STANDALONE", "", other_draft_dir),
    ):
        assert run(**spec) == want, spec
        assert run(**spec) == want, spec  # and again, in a fresh scheduler
    st = [h.scheduler.stats for h in hs]
    assert st[1].spec_accepted_tokens > 0  # NGRAM's drafts were verified, some accepted
    # The draft that is the target shares the target's noise: every draft is accepted.
    assert st[3].spec_accepted_tokens == st[3].spec_draft_tokens > 0


def test_sampling_runs_and_drains(tiny_llama_dir):
    for algo in ("NGRAM", "STANDALONE"):
        got, _ = _run(
            tiny_llama_dir,
            _prompts(),
            {"temperature": 0.8, "top_p": 0.9, "top_k": 50},
            **_spec(algo, tiny_llama_dir),
        )
        assert all(len(x) == NEW for x in got)


def test_a_draft_with_another_tokenizer_is_refused(tmp_path, tiny_llama_dir):
    from radixserve.args import ServerArgs
    from radixserve.managers.scheduler import Scheduler
    from radixserve.model_loader.weights import load_tokenizer

    target = str(tmp_path / "target")
    draft = str(tmp_path / "draft")
    for d, vocab in ((target, 320), (draft, 300)):
        make_tiny_model_dir(d, "llama")
        save_byte_tokenizer(d, vocab)
    args = ServerArgs(
        model_path=target,
        device="cpu",
        dtype="float32",
        max_total_tokens=512,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=draft,
    ).resolve()
    with pytest.raises(ValueError, match="tokenizer differs"):
        Scheduler(args, lambda _: None, load_tokenizer(target))
    assert os.path.isdir(draft)


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_aborts_mid_generation_leave_the_others_exact(tiny_llama_dir, plain, algo):
    from radixserve.io_struct import AbortReq

    h = _harness(tiny_llama_dir, **_spec(algo, tiny_llama_dir))
    rids = [h.submit(x, **GREEDY) for x in _prompts()]
    for step in range(40):
        h.step()
        if step in (0, 3, 9):  # after the prefill, early and mid decode
            h.scheduler.process_input_requests([AbortReq(rids[step % len(rids)])])
    h.run_until_idle()
    h.scheduler.assert_drained()
    res, reasons = h.results(), h.finish_reasons()
    aborted = {rids[0], rids[3], rids[1]}
    for i, rid in enumerate(rids):
        if rid in aborted:
            assert reasons[rid]["type"] == "abort"
            assert res.get(rid, []) == plain[i][: len(res.get(rid, []))]
        else:
            assert res[rid] == plain[i]


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_stop_strings_inside_an_accepted_run(tmp_path, algo):
    """A stop string matched inside an accepted run ends the output exactly where plain
    decoding ends it (a byte-level tokenizer, so a string can end at any token)."""
    from rs_testing import make_tiny_served_model

    from radixserve.model_loader.weights import load_tokenizer

    model = make_tiny_served_model(str(tmp_path / "served"))
    tok = load_tokenizer(model)
    prompts = _prompts()[:4]

    def run(stops, **kw):
        h = _harness(model, tok, **kw)
        rids = [
            h.submit(x, max_new_tokens=NEW, temperature=0.0, stop=stops[i])
            for i, x in enumerate(prompts)
        ]
        h.run_until_idle()
        h.scheduler.assert_drained()
        res, reasons = h.results(), h.finish_reasons()
        return [res[r] for r in rids], [reasons[r] for r in rids], h

    free, _, _ = run([None] * 4)
    # Each request's stop string: the text of two of its own tokens, 20 tokens in.
    stops = [[tok.decode(out[20:22])] for out in free]
    want, want_reasons, _ = run(stops)
    got, got_reasons, h = run(stops, **_spec(algo, model))
    assert got == want and got_reasons == want_reasons
    assert any(r["type"] == "stop" for r in got_reasons)
    assert h.scheduler.stats.spec_verify_ct > 0


def test_the_engine_refuses_a_missing_draft_before_starting(tmp_path):
    """A draft path that holds no model is the Engine's FileNotFoundError at once (as for the
    serve command), not a traceback from a child after the target loaded."""
    from radixserve.entrypoints.engine import Engine

    target = str(tmp_path / "target")
    make_tiny_model_dir(target, "llama")
    save_byte_tokenizer(target, 320)
    with pytest.raises(FileNotFoundError, match="--speculative-draft-model-path"):
        Engine(
            model_path=target,
            device="cpu",
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(tmp_path / "no-such-draft"),
        )


def test_the_draft_models_kv_and_weights_fit_the_memory_budget(tiny_llama_dir, monkeypatch):
    """The KV pool was sized from free memory for the target alone; the draft model's
    weights and its own pool of as many tokens came on top, past --mem-fraction-static (on a
    GPU: out of memory at start). Both come out of the budget now."""
    import torch

    from radixserve.args import ServerArgs
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool
    from radixserve.model_executor import model_runner

    free = 256 * 2**20
    monkeypatch.setattr(model_runner, "_mem_available_bytes", lambda: free)

    def runner(**kw):
        args = ServerArgs(
            model_path=tiny_llama_dir, device="cpu", dtype="float32", mem_fraction_static=0.5, **kw
        )
        return model_runner.ModelRunner(args.resolve())

    plain = runner()
    target = runner(**_spec("STANDALONE", tiny_llama_dir))
    cfg = target.model_config
    per_token = MHATokenToKVPool.bytes_per_token(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32
    )
    weights = sum(p.numel() * p.element_size() for p in target.model.parameters())
    budget = free // 2
    assert (
        plain.max_total_num_tokens * per_token
        <= budget
        < (plain.max_total_num_tokens + 1) * per_token
    )
    # the draft (the target itself here): its KV per token and its weights, within the budget
    used = target.max_total_num_tokens * 2 * per_token + weights
    assert budget - 2 * per_token < used <= budget + weights // 20  # (weights: estimated)


def test_a_draft_with_a_padded_vocabulary_drafts_for_the_same_tokenizer(tmp_path):
    """A draft whose embedding table is padded to another size than the target's, one
    tokenizer (Qwen2.5-0.5B: 151936 rows, for Qwen2.5-7B: 152064), was refused as "they must
    share a tokenizer". Its logits take the target's width; an id past its table (a target
    padding row) reads its last row. One smaller than the tokenizer is still refused."""
    from radixserve.model_loader.weights import load_tokenizer

    target = make_tiny_model_dir(str(tmp_path / "target"), "llama")  # (320 rows)
    save_byte_tokenizer(target, 300)
    tok = load_tokenizer(target)
    prompts = [[*p[:-1], 315] for p in _prompts()[:4]]  # (315: a padding row of the target)
    want, _ = _run(target, prompts, tokenizer=tok)
    for rows in (384, 310):
        draft = make_tiny_model_dir(str(tmp_path / f"d{rows}"), "llama", vocab_size=rows)
        save_byte_tokenizer(draft, 300)
        got, h = _run(target, prompts, tokenizer=tok, **_spec("STANDALONE", "", draft))
        assert got == want and h.scheduler.stats.spec_verify_ct > 0, rows
    draft = make_tiny_model_dir(str(tmp_path / "d290"), "llama", vocab_size=290)
    save_byte_tokenizer(draft, 300)
    with pytest.raises(ValueError, match=r"\(290 tokens\) differs .* the tokenizer has 300"):
        _run(target, prompts, tokenizer=tok, **_spec("STANDALONE", "", draft))
