"""TpSync: the schedule digest (equal schedules pass; any difference in what a step runs (rids,
lengths, slots, free or evictable counts) fails loudly with every rank's view), and the ranks'
agreement on what each did alone (an adapter is served only where every rank loaded it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from radixserve.distributed.tp_sync import ScheduleDivergedError, TpSync, schedule_digest
from radixserve.model_executor.forward_batch import ForwardMode


class EchoGroup:
    """A 2-rank group whose other rank reports `other` (or this rank's own values)."""

    def __init__(self, other: list[int] | None = None) -> None:
        self.other = other

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return [values, self.other if self.other is not None else list(values)]


def _batch(**changes):
    fields = dict(
        forward_mode=ForwardMode.DECODE,
        reqs=[SimpleNamespace(rid="a"), SimpleNamespace(rid="b")],
        seq_lens=[7, 9],
        prefix_lens=[6, 8],
        out_cache_loc=torch.tensor([11, 12]),
    )
    fields.update(changes)
    return SimpleNamespace(**fields)


def _pools(available=100, evictable=5):
    return SimpleNamespace(available_size=lambda: available), SimpleNamespace(
        evictable_size=lambda: evictable
    )


def test_equal_schedules_pass():
    TpSync(EchoGroup()).check_schedule(_batch(), *_pools())
    TpSync(EchoGroup()).check_schedule(None, *_pools())  # an idle step


@pytest.mark.parametrize(
    "changes",
    [
        {"forward_mode": ForwardMode.EXTEND},
        {"reqs": [SimpleNamespace(rid="b"), SimpleNamespace(rid="a")]},
        {"seq_lens": [7, 10]},
        {"prefix_lens": [6, 7]},
        {"out_cache_loc": torch.tensor([11, 13])},
    ],
    ids=["mode", "rids", "seq-lens", "prefix-lens", "slots"],
)
def test_a_different_schedule_on_another_rank_fails(changes):
    theirs = schedule_digest(_batch(**changes), 100, 5)
    with pytest.raises(ScheduleDivergedError, match="rank 1"):
        TpSync(EchoGroup(theirs)).check_schedule(_batch(), *_pools())


def test_different_free_slot_counts_fail():
    theirs = schedule_digest(_batch(), 99, 5)
    with pytest.raises(ScheduleDivergedError, match="99 free"):
        TpSync(EchoGroup(theirs)).check_schedule(_batch(), *_pools())


class ObjectGroup:
    """A 2-rank group whose other rank reports `other` for all_gather_object."""

    def __init__(self, other):
        self.other = other

    def all_gather_object(self, obj):
        return [obj, self.other]


class FakeLoRAManager:
    def __init__(self, fail: bool) -> None:
        self.fail, self.loaded = fail, set()

    def load(self, name, path):
        from radixserve.lora.adapter import LoRAError

        if self.fail:
            raise LoRAError(f"cannot read {path}")
        self.loaded.add(name)

    def unload(self, name):
        self.loaded.remove(name)


@pytest.mark.parametrize(
    "mine_fails, theirs, served",
    [(False, None, True), (False, "no such file", False), (True, None, False)],
    ids=["both-load", "the-other-rank-fails", "this-rank-fails"],
)
def test_an_adapter_is_served_only_when_every_rank_loaded_it(mine_fails, theirs, served):
    """A rank that could not load an adapter (a node without its files) once answered nothing
    while rank 0 answered success: its requests then hung in the forward's all-reduce."""
    from radixserve.io_struct import LoadLoRAAdapterReq
    from radixserve.managers.scheduler import Scheduler

    manager = FakeLoRAManager(mine_fails)
    host = SimpleNamespace(
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager)),
        tp_sync=TpSync(ObjectGroup(theirs)),
        lora_names=set(),
    )
    out = Scheduler.load_lora_adapter(host, LoadLoRAAdapterReq("a", "/adapters/a"))
    assert out.success == served
    assert (host.lora_names, manager.loaded) == (({"a"}, {"a"}) if served else (set(), set()))
    if theirs is not None:
        assert out.message == "TP rank 1: no such file"
    if mine_fails:
        assert out.message == "TP rank 0: cannot read /adapters/a"


def test_ranks_that_run_other_flags_or_weights_are_refused_at_start(tmp_path):
    """A node started with other weights (same shapes) served garbage, and other flags failed
    in a collective with a bare gloo error: every rank now compares what it runs with rank 0."""
    from rs_testing import make_tiny_model_dir

    from radixserve.args import ServerArgs
    from radixserve.distributed.tp_sync import check_ranks_agree, rank_fingerprint

    a = make_tiny_model_dir(str(tmp_path / "a"), seed=0)
    b = make_tiny_model_dir(str(tmp_path / "b"), seed=7)  # the same shapes, other weights
    args = ServerArgs(model_path=a, tp_size=2, chunked_prefill_size=64)
    mine = rank_fingerprint(args, a)

    def check(theirs_args, theirs_path):
        check_ranks_agree(ObjectGroup(rank_fingerprint(theirs_args, theirs_path)), args, a)

    # Where the files are, and what only node 0 or this machine uses, may differ.
    check(
        ServerArgs(
            model_path="/elsewhere",
            tp_size=2,
            chunked_prefill_size=64,
            port=1234,
            log_level="debug",
            num_threads=1,
        ),
        a,
    )
    with pytest.raises(ValueError, match=r"TP rank 1 .*--chunked-prefill-size 32 \(rank 0: 64\)"):
        check(ServerArgs(model_path=a, tp_size=2, chunked_prefill_size=32), a)
    with pytest.raises(ValueError, match="model files differ from rank 0's: model.safetensors"):
        check(args, b)
    assert mine == rank_fingerprint(args, a)  # deterministic


@pytest.mark.parametrize(
    "mine, theirs, runs", [(True, 1, True), (True, 0, False), (False, 1, False)]
)
def test_every_rank_runs_the_loop_all_can_run(mine, theirs, runs):
    """Each rank chose its loop from its own machine's CPUs and --num-threads: a node that
    chose the normal loop beside one running the overlap loop freed finished requests a step
    earlier, their schedules diverged and a collective failed (gloo's "preamble" abort)."""
    from radixserve.managers.scheduler import overlap_on_every_rank

    assert overlap_on_every_rank(TpSync(EchoGroup([theirs])), mine) is runs
