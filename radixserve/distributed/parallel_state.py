"""The TP process groups of one scheduler rank, and the collectives the model layers use.

Every scheduler rank builds one `TpGroup` at start-up (`init_tp_group`) and hands it to the
components that need it (ModelRunner, the parallel layers, the scheduler's TpSync); nothing
reads it from a global. Two groups over the same ranks:

* `device_group` — the model's collectives (all-reduce after row-parallel layers and the
  vocab-parallel embedding, all-gather of the logits, the broadcast of sampled tokens): nccl
  on CUDA, gloo on CPU. In the overlap loop these run on the forward thread.
* `cpu_group` — gloo, the scheduler's control traffic (the broadcast of received requests,
  the integrity digest), on the scheduler's main thread.

Keeping them apart means a collective of the forward thread and one of the main thread never
interleave on one communicator (each group sees its calls in the same order on every rank).

`TpGroup.single()` is the one-rank group: its collectives are never called (the layers are
the dense ones at tp 1).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from radixserve.args import dist_init_method, parse_dist_init_addr

logger = logging.getLogger(__name__)

INIT_TIMEOUT = timedelta(minutes=10)
RENDEZVOUS_LOG_S = 30.0  # how often a rank waiting for the others says so


@dataclass(frozen=True)
class TpGroup:
    rank: int
    world_size: int
    device_group: Any = None
    cpu_group: Any = None

    @classmethod
    def single(cls) -> TpGroup:
        return cls(0, 1)

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    # -- model collectives (device group) -------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (returns x)."""
        torch.distributed.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., world_size * n], rank order along the last dim."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=-1)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's values of x on every rank (in place)."""
        torch.distributed.broadcast(x, src=0, group=self.device_group)
        return x

    # -- control collectives (cpu group) --------------------------------------------------------
    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` (pickled) on every rank; other ranks pass anything (e.g. None)."""
        box = [obj if self.rank == 0 else None]
        torch.distributed.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (same length on all ranks), in rank order."""
        x = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x, group=self.cpu_group)
        return [p.tolist() for p in parts]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (pickled), in rank order."""
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (e.g. the KV pool size every rank can hold)."""
        x = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MIN, group=self.cpu_group)
        return int(x.item())

    # -- sharding ---------------------------------------------------------------------------
    def shard_range(self, n: int, what: str) -> tuple[int, int]:
        """This rank's [start, end) of `n` rows split evenly (a clear error when they cannot)."""
        if n % self.world_size != 0:
            raise ValueError(
                f"--tp-size {self.world_size} does not divide {what} ({n}); choose a tp size "
                f"that divides it"
            )
        size = n // self.world_size
        return self.rank * size, (self.rank + 1) * size


def local_head_counts(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) held by each rank. KV heads are split when tp divides them and
    replicated (one per rank, shared by tp / num_kv_heads ranks) when tp exceeds them."""
    if num_heads % tp_size != 0:
        raise ValueError(
            f"the model has {num_heads} attention heads, which --tp-size {tp_size} does not "
            "divide; choose a tp size that divides the number of attention heads"
        )
    if num_kv_heads % tp_size == 0:
        return num_heads // tp_size, num_kv_heads // tp_size
    if tp_size % num_kv_heads == 0:
        return num_heads // tp_size, 1
    raise ValueError(
        f"the model has {num_kv_heads} KV heads: --tp-size {tp_size} must divide them or be a "
        "multiple of them (KV heads are then replicated)"
    )


def kv_head_start(num_kv_heads: int, tp_size: int, rank: int) -> int:
    """The first KV head of `rank` (with replication, ranks that share a KV head hold the same)."""
    if num_kv_heads % tp_size == 0:
        return rank * (num_kv_heads // tp_size)
    return rank // (tp_size // num_kv_heads)


def init_tp_group(
    tp_rank: int, tp_size: int, dist_init_addr: str, device: str, local_rank: int = 0
) -> TpGroup:
    """Join the TP process group (all ranks call it, each with its rank). On CUDA the rank
    first selects its GPU (`local_rank`), so "cuda" means that device from here on."""
    import torch.distributed as dist

    if tp_size == 1:
        return TpGroup.single()
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    host, port = parse_dist_init_addr(dist_init_addr)
    logger.info(
        "TP rank %d of %d: waiting for the other ranks at %s:%d", tp_rank, tp_size, host, port
    )
    joined = threading.Event()

    def still_waiting() -> None:  # a wrong --dist-init-addr would otherwise wait in silence
        started = time.monotonic()
        while not joined.wait(RENDEZVOUS_LOG_S):
            logger.warning(
                "TP rank %d of %d: still waiting for the other ranks at %s:%d after %.0f s "
                "(every node needs the same --dist-init-addr, --nnodes and --tp-size, and a --node-rank "
                "of its own)",
                tp_rank,
                tp_size,
                host,
                port,
                time.monotonic() - started,
            )

    threading.Thread(target=still_waiting, daemon=True).start()
    try:
        dist.init_process_group(
            backend=backend,
            init_method=dist_init_method(dist_init_addr),
            rank=tp_rank,
            world_size=tp_size,
            timeout=INIT_TIMEOUT,
        )
    finally:
        joined.set()
    ranks = list(range(tp_size))
    device_group = dist.new_group(ranks, backend=backend)
    cpu_group = dist.new_group(ranks, backend="gloo")
    logger.info("TP rank %d of %d joined (%s)", tp_rank, tp_size, backend)
    return TpGroup(tp_rank, tp_size, device_group, cpu_group)
