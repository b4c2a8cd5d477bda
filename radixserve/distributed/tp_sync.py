"""The scheduler's side of tensor parallelism: every rank runs the same schedule.

Rank 0 alone receives requests from the TokenizerManager; `broadcast_requests` hands each loop
iteration's messages to every rank (SGLang's broadcast of recv_reqs, on the gloo cpu group), so
every rank's Scheduler sees the same inputs in the same order and — holding its own radix tree,
pools and waiting queue — makes the same decisions. Sampled tokens agree because the worker
broadcasts rank 0's (TpModelWorker.sample). Only rank 0 sends outputs to the detokenizer.

With --enable-integrity-checks, `check_schedule` compares a digest of each step's schedule
(forward mode, rids, sequence and prefix lengths, allocated slots, free and evictable slot
counts) across ranks and fails loudly on the first step where they differ (invariant 10).
"""

from __future__ import annotations

import hashlib
from typing import Any

from radixserve.distributed.parallel_state import TpGroup

INT63 = (1 << 63) - 1


class ScheduleDivergedError(RuntimeError):
    """The TP ranks scheduled different steps: their outputs can no longer be trusted."""


class TpSync:
    def __init__(self, group: TpGroup) -> None:
        self.group = group
        self.step_no = 0

    def broadcast_requests(self, msgs: list[Any] | None) -> list[Any]:
        """Rank 0's messages of this iteration on every rank (others pass None)."""
        return self.group.broadcast_object(msgs)

    def agree(self, error: str | None) -> str | None:
        """The ranks' verdict on something each did alone (e.g. loading an adapter): None when
        every rank succeeded, else every failed rank's message, the same on all ranks."""
        errors = self.group.all_gather_object(error)
        failed = [f"TP rank {rank}: {e}" for rank, e in enumerate(errors) if e is not None]
        return "; ".join(failed) or None

    def check_schedule(self, batch: Any, allocator: Any, tree_cache: Any) -> None:
        self.step_no += 1
        mine = schedule_digest(batch, allocator.available_size(), tree_cache.evictable_size())
        everyone = self.group.all_gather_ints(mine)
        if any(row != everyone[0] for row in everyone):
            table = "; ".join(
                f"rank {r}: digest {d[0]:x}, {d[1]} reqs, {d[2]} free, {d[3]} evictable"
                for r, d in enumerate(everyone)
            )
            raise ScheduleDivergedError(
                f"TP ranks scheduled different steps at step {self.step_no} ({table}); "
                "every rank must make the same scheduling decisions"
            )


def schedule_digest(batch: Any, available: int, evictable: int) -> list[int]:
    """[hash, number of requests, free slots, evictable slots] of one step's schedule."""
    h = hashlib.blake2b(digest_size=8)
    if batch is not None:
        h.update(str(batch.forward_mode).encode())
        h.update(repr([r.rid for r in batch.reqs]).encode())
        h.update(repr(list(batch.seq_lens)).encode())
        h.update(repr(list(batch.prefix_lens)).encode())
        h.update(batch.out_cache_loc.cpu().numpy().tobytes())
    n = len(batch.reqs) if batch is not None else 0
    return [int.from_bytes(h.digest(), "little") & INT63, n, available, evictable]
