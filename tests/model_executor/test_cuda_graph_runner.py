"""CudaGraphRunner (model_executor/cuda_graph_runner.py): decode steps padded to a batch-size
bucket and a KV-length bucket, run through static buffers, give transformers' greedy tokens
and the eager step's logits, however the requests are batched.

On CPU the runner is installed with capture=False: the same padded step through the same
buffers, run eagerly (everything but the capture itself). On a CUDA machine the ModelRunner
captures the graphs itself and the same tests run on them, in the overlap loop (the forward
thread replays on its own stream) and the normal one."""

from __future__ import annotations

import random

import pytest
import torch
from rs_testing import SchedulerHarness, hf_greedy, load_hf_reference

from radixserve.model_executor.cuda_graph_runner import (
    CudaGraphRunner,
    batch_size_buckets,
    kv_len_buckets,
)

NEW_TOKENS = 20
# Prompts across the KV buckets of the tiny model's 1,024-token context (256, 512, 1024).
LENGTHS = [3, 40, 250, 7, 300, 90, 17, 520, 60, 5, 130, 33]

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]


def test_buckets():
    assert batch_size_buckets(128) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(5) == [1, 2, 4, 5]
    assert batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert kv_len_buckets(1024) == [256, 512, 1024]
    assert kv_len_buckets(300) == [256, 300]
    assert kv_len_buckets(100) == [100]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompts) -> list[list[int]]:
    return hf_greedy(load_hf_reference(tiny_llama_dir), prompts, NEW_TOKENS)


class Replays:
    """Counts the runner's replays (by padded batch size) and, for each, checks the logits
    against the eager step on the same batch."""

    def __init__(self, runner, check_logits: bool, tol: float = 1e-4) -> None:
        self.count = 0
        self.padded = 0
        graphs, replay = runner.cuda_graph_runner, runner.cuda_graph_runner.replay

        def checked(fb):
            logits = replay(fb)
            self.count += 1
            self.padded += fb.batch_size not in graphs.batch_sizes
            if check_logits:
                runner.cuda_graph_runner = None  # the eager forward, same KV writes
                try:
                    eager = runner.forward(fb).next_token_logits
                finally:
                    runner.cuda_graph_runner = graphs
                torch.testing.assert_close(logits, eager, rtol=tol, atol=tol)
            return logits

        graphs.replay = checked


def _harness(model: str, device: str, check_logits: bool = True, budget=None, tol=1e-4, **kwargs):
    kwargs.setdefault("max_total_tokens", 6000)
    h = SchedulerHarness(
        model_path=model, device=device, attention_backend="torch_native", **kwargs
    )
    runner = h.scheduler.tp_worker.model_runner
    if device == "cpu":
        assert runner.cuda_graph_runner is None  # CPU steps never capture
        runner.cuda_graph_runner = CudaGraphRunner(runner, capture=False, memory_budget=budget)
    else:
        if budget is not None:
            runner.cuda_graph_runner = CudaGraphRunner(runner, memory_budget=budget)
        graphs = runner.cuda_graph_runner
        assert graphs is not None and graphs.captured
        assert sorted(graphs.graphs) == sorted(graphs.pairs)
    h.replays = Replays(runner, check_logits, tol)
    return h


def _params() -> dict:
    return dict(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _submit_staggered(h, prompts, seed: int, chance: float) -> list[str]:
    """Submit `prompts` in order while the scheduler steps (the first at once, then one with
    probability `chance` before each step) and step until it drains; returns their rids."""
    rng = random.Random(seed)
    rids: list[str] = []
    pending = list(prompts)
    while pending or h.scheduler.has_work():
        if pending and (not rids or rng.random() < chance):
            rids.append(h.submit(pending.pop(0), **_params()))
        h.step()
    return rids


def _check(h, rids, reference, prompts_idx=None) -> None:
    results = h.results()
    for i, rid in enumerate(rids):
        j = i if prompts_idx is None else prompts_idx[i]
        assert results[rid] == reference[j], f"prompt {j} (len {LENGTHS[j]}) differs"
    assert h.replays.count > 0
    h.scheduler.assert_drained()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_submitted_together_and_staggered(tiny_llama_dir, prompts, reference, device, overlap):
    h = _harness(tiny_llama_dir, device, disable_overlap_schedule=not overlap)
    rids = [h.submit(p, **_params()) for p in prompts[:5]]
    rids += _submit_staggered(h, prompts[5:], seed=1, chance=0.4)
    _check(h, rids, reference)
    assert h.replays.padded > 0  # batch sizes between the buckets were padded


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "config",
    [
        {"page_size": 16},
        {"disable_radix_cache": True},
        {"chunked_prefill_size": 64, "enable_mixed_chunk": True},
        {"max_running_requests": 3},
        {"cuda_graph_max_bs": 2},
    ],
    ids=["page-16", "radix-off", "chunk-64-mixed", "max-running-3", "max-bs-2"],
)
def test_configurations_are_token_exact(tiny_llama_dir, prompts, reference, device, config):
    h = _harness(tiny_llama_dir, device, **config)
    _check(h, _submit_staggered(h, prompts, seed=2, chance=0.3), reference)
    runner = h.scheduler.tp_worker.model_runner
    largest = min(config.get("cuda_graph_max_bs", 128), runner.max_running_requests)
    assert runner.cuda_graph_runner.batch_sizes[-1] == largest


@pytest.mark.parametrize("device", DEVICES)
def test_retraction_under_a_small_pool(tiny_llama_dir, prompts, reference, device):
    h = _harness(
        tiny_llama_dir,
        device,
        max_total_tokens=450,
        schedule_conservativeness=0.05,
        chunked_prefill_size=-1,
    )
    # EOS is not ignored: ignore_eos requests reserve their whole budget, and never retract.
    order = [0, 1, 3, 5, 6, 8, 9, 10, 11]  # 385 prompt tokens, up to 180 output tokens
    rids = [h.submit(prompts[i], **{**_params(), "ignore_eos": False}) for i in order]
    h.run_until_idle()
    assert h.scheduler.stats.num_retractions > 0
    results = h.results()
    for rid, i in zip(rids, order, strict=True):
        got = results[rid]
        assert got == reference[i][: len(got)], f"prompt {i} differs"
    assert h.replays.count > 0
    h.scheduler.assert_drained()


@pytest.mark.parametrize("device", DEVICES)
def test_the_second_wave_decodes_on_cached_prefixes(tiny_llama_dir, prompts, reference, device):
    h = _harness(tiny_llama_dir, device)
    first = [h.submit(p, **_params()) for p in prompts]
    h.run_until_idle()
    second = [h.submit(p, **_params()) for p in prompts]
    h.run_until_idle()
    _check(h, first, reference)
    _check(h, second, reference)


@pytest.mark.parametrize("device", DEVICES)
def test_pairs_over_the_memory_budget_run_eagerly(tiny_llama_dir, prompts, reference, device):
    """A budget of 4 rows × 512 KV positions' gather: pairs past it (16 rows at any length,
    4 rows past 512 positions) are not captured and their steps run eagerly; the tokens are
    the same."""
    from radixserve.model_executor.cuda_graph_runner import gather_bytes_per_slot

    h = _harness(tiny_llama_dir, device)  # only to size the budget from the tiny model
    budget = 4 * 512 * gather_bytes_per_slot(h.scheduler.tp_worker.model_runner)
    h = _harness(tiny_llama_dir, device, budget=budget)
    graphs = h.scheduler.tp_worker.model_runner.cuda_graph_runner
    assert (4, 512) in graphs.pairs and (4, 1024) not in graphs.pairs
    assert (16, 256) not in graphs.pairs and (1, 1024) in graphs.pairs
    decode_steps = []
    forward = h.scheduler.tp_worker.forward

    def counting(mwb, input_ids=None):
        decode_steps.append(mwb.forward_mode.is_decode())
        return forward(mwb, input_ids)

    h.scheduler.tp_worker.forward = counting
    _check(h, _submit_staggered(h, prompts, seed=3, chance=0.3), reference)
    assert 0 < h.replays.count < sum(decode_steps)  # some decode steps ran eagerly


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_disable_cuda_graph_runs_eagerly(tiny_llama_dir, prompts, reference):
    h = SchedulerHarness(
        model_path=tiny_llama_dir, device="cuda", max_total_tokens=6000, disable_cuda_graph=True
    )
    assert h.scheduler.tp_worker.model_runner.cuda_graph_runner is None
    rids = [h.submit(p, **_params()) for p in prompts]
    h.run_until_idle()
    results = h.results()
    assert [results[r] for r in rids] == reference
    h.scheduler.assert_drained()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_kv_cache_replays_as_the_eager_steps(tiny_llama_dir, prompts, device, kv):
    """--kv-cache-dtype fp8_*: the replayed steps write and read the one-byte pool as the eager
    steps do (each step's logits against the eager step's on the same batch), and every slot
    comes back. The tolerance allows what fp8's rounding makes of float order: a key that the
    padded and the unpadded step compute 1e-7 apart may round to neighbouring fp8 values."""
    h = _harness(tiny_llama_dir, device, tol=2e-2, kv_cache_dtype=kv)
    assert h.scheduler.tp_worker.model_runner.token_to_kv_pool.k_buffer[0].element_size() == 1
    rids = _submit_staggered(h, prompts, seed=5, chance=0.4)
    results = h.results()
    assert all(len(results[r]) == NEW_TOKENS for r in rids)
    assert h.replays.count > 0 and h.replays.padded > 0
    h.scheduler.assert_drained()


def test_the_startup_line_says_whether_decode_steps_replay_cuda_graphs():
    from radixserve.args import ServerArgs
    from radixserve.entrypoints.http_server import startup_summary

    args = ServerArgs(model_path="some/model")
    assert "CUDA graphs up to batch 128" in startup_summary(
        args, {"device": "cuda", "cuda_graph_max_bs": 128}
    )
    assert "CUDA graphs off" in startup_summary(args, {"device": "cuda"})
    assert "CUDA graphs" not in startup_summary(args, {"device": "cpu"})


@pytest.mark.parametrize("device", DEVICES)
def test_more_running_requests_than_the_largest_graph(tiny_llama_dir, device):
    """160 requests decode at once (above the 128-row bucket: those steps run eagerly), then
    fewer as they finish at different lengths (replayed, padded): the tokens are those of the
    eager runs, and every slot comes back."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 40))] for _ in range(160)]
    lengths = [rng.randrange(1, 25) for _ in prompts]

    def run(h) -> list[list[int]]:
        rids = [
            h.submit(p, max_new_tokens=n, temperature=0.0, ignore_eos=True)
            for p, n in zip(prompts, lengths, strict=True)
        ]
        h.run_until_idle()
        h.scheduler.assert_drained()
        results = h.results()
        return [results[r] for r in rids]

    eager = run(
        SchedulerHarness(
            model_path=tiny_llama_dir,
            device=device,
            attention_backend="torch_native",
            max_total_tokens=12000,
            disable_cuda_graph=True,
        )
    )
    h = _harness(tiny_llama_dir, device, check_logits=False, max_total_tokens=12000)
    sizes: list[int] = []
    forward = h.scheduler.tp_worker.forward

    def recording(mwb, input_ids=None):
        if mwb.forward_mode.is_decode():
            sizes.append(mwb.batch_size)
        return forward(mwb, input_ids)

    h.scheduler.tp_worker.forward = recording
    assert run(h) == eager
    assert max(sizes) > 128  # some steps were too large for a graph
    assert h.replays.count == sum(1 for n in sizes if n <= 128) > 0
