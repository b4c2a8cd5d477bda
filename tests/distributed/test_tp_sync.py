"""TpSync's schedule digest: equal schedules pass; any difference in what a step runs (rids,
lengths, slots, free or evictable counts) fails loudly with every rank's view."""

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
