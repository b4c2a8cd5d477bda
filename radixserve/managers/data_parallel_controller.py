"""DataParallelController: one server, `--dp-size N` scheduler replicas (SGLang's
DataParallelController), each with its own model, KV pool and radix cache.

It lives in the TokenizerManager's process and stands in for its socket to the scheduler
(`send_pyobj`): a request goes to one replica, chosen by `--load-balance-method`; an abort goes
to the replica that holds the rid (every replica for abort_all or an unknown rid); a control
request (flush, server info, dashboard) goes to every replica, and `control` merges their N
replies into one. Every replica's outputs reach the one detokenizer and so the TokenizerManager,
which shows each output to `on_output`: that is how the controller knows which requests are
still in flight where (its load figure), without asking the schedulers. SGLang runs the
controller as a process of its own; here dispatch costs a dict walk per request, and a process
hop would cost a core on a small machine. With `--dp-size 1` there is no controller at all.

Methods: round_robin; shortest_queue (fewest requests in flight); prefix_affinity (the
default): keep, per replica, an approximate index of the prompt prefixes sent to it (a chain
of hashes of 16-token blocks: a trie of blocks, bounded by the replica's KV pool and evicted
leaf-first, like sgl-router's cache_aware tree of text), and send a request to the replica
that matches the largest share of it, when that share reaches CACHE_THRESHOLD; otherwise to
the replica with the smallest index (new prefixes spread over the caches). When the replicas'
loads drift apart (BALANCE_ABS/REL_THRESHOLD, sgl-router's rule) the least loaded wins.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.args import LOAD_BALANCE_METHODS
from radixserve.io_struct import (
    AbortReq,
    BatchStrOutput,
    BatchTokenizedGenerateReqInput,
    DashboardSnapshotReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetServerInfoReq,
    LoRAUpdateReqOutput,
    TokenizedGenerateReqInput,
)
from radixserve.managers.live_stats import merge_snapshots
from radixserve.mem_cache.radix_stats import merge_tree_stats

logger = logging.getLogger(__name__)

BLOCK_TOKENS = 16  # granularity of the prefix index
CACHE_THRESHOLD = 0.3  # share of the prompt a replica must hold to win on its cache (sgl-router)
# The loads count as imbalanced when max − min > ABS and max > min × REL (sgl-router's rule;
# its ABS is 64 for a whole cluster, one replica of a CPU server runs far fewer requests).
BALANCE_ABS_THRESHOLD = 32
BALANCE_REL_THRESHOLD = 1.5
# get_server_info keys that are not sums over the replicas (recomputed or averaged in merge).
NON_ADDITIVE = (
    "dp_rank",
    "hicache_storage_blocks",  # one storage directory, which every replica counts
    "token_usage",
    "cache_hit_rate",
    "new_token_ratio",
    "spec_accept_length",
    "spec_accept_rate",
)


class PrefixIndex:
    """An approximate radix cache of one replica: the chained hashes of the full
    BLOCK_TOKENS-token blocks of the prompts sent there, in LRU order, at most `capacity_tokens`
    tokens' worth. A block's hash covers everything before it, so the hashes of a prompt are a
    path in a trie, and a match is the number of leading hashes present."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_blocks = max(1, capacity_tokens // BLOCK_TOKENS)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    @property
    def size_tokens(self) -> int:
        return len(self.blocks) * BLOCK_TOKENS

    def match(self, hashes: Sequence[int]) -> int:
        """Tokens of the prompt (whose block hashes these are) that this replica holds."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n * BLOCK_TOKENS

    def insert(self, hashes: Sequence[int]) -> None:
        # Deepest block first, so that a parent is always more recent than its children and
        # eviction (oldest first) takes leaves before the prefixes they hang from.
        for h in reversed(hashes):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()


def block_hashes(input_ids: Sequence[int], extra_key: str | None = None) -> list[int]:
    """The chained hash of each full block; extra_key namespaces them as it does the cache."""
    h = hash(("radixserve-prefix", extra_key))
    out = []
    for start in range(0, len(input_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        h = hash((h, tuple(input_ids[start : start + BLOCK_TOKENS])))
        out.append(h)
    return out


@dataclass
class _FanIn:
    """One control request broadcast to every replica, waiting for their replies."""

    future: asyncio.Future
    reply_type: type
    shared: type | None = None  # the request type whose later calls join this one
    replies: list[Any] = field(default_factory=list)
    waiters: int = 0


# Control requests that ask the same of every caller: one made while another is in flight
# shares its answer. (A LoRA load or unload is each caller's own.)
_SHARED_CALLS = (FlushCacheReq, GetServerInfoReq, DashboardSnapshotReq)


class DataParallelController:
    def __init__(
        self,
        senders: Sequence[Any],
        method: str = "prefix_affinity",
        capacity_tokens: Sequence[int] | int = 1 << 20,
        max_running_requests: int | None = None,
        balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
        cache_threshold: float = CACHE_THRESHOLD,
    ) -> None:
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load balance method must be one of {LOAD_BALANCE_METHODS}")
        self.senders = list(senders)  # one zmq PUSH socket (or anything with send_pyobj) each
        self.dp_size = len(self.senders)
        self.method = method
        if isinstance(capacity_tokens, int):
            capacity_tokens = [capacity_tokens] * self.dp_size
        self.indexes = [PrefixIndex(c) for c in capacity_tokens]
        self.max_running_requests = max_running_requests  # per replica (None: unknown)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold
        self.rid_to_rank: dict[str, int] = {}
        self.loads = [0] * self.dp_size  # requests dispatched and not finished, per replica
        self.dispatched = [0] * self.dp_size  # since start, per replica
        self._next = 0  # round_robin
        self._calls: dict[int, _FanIn] = {}  # control requests in flight, by call id
        self._shared: dict[type, int] = {}  # a shared request type -> its call in flight
        self._next_call_id = 0

    # -- the TokenizerManager's socket ----------------------------------------------------------
    def send_pyobj(self, msg: Any) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.dispatch(msg)
        elif isinstance(msg, BatchTokenizedGenerateReqInput):
            for req in msg.batch:  # each replica gets its share as one message
                self.dispatch(req, send=False)
            for rank in range(self.dp_size):
                mine = [r for r in msg.batch if self.rid_to_rank[r.rid] == rank]
                if mine:
                    self.senders[rank].send_pyobj(BatchTokenizedGenerateReqInput(mine))
        elif isinstance(msg, AbortReq) and not msg.abort_all and msg.rid in self.rid_to_rank:
            self.senders[self.rid_to_rank[msg.rid]].send_pyobj(msg)
        else:  # abort_all, an abort of an unknown rid, a control request
            self.broadcast(msg)

    def broadcast(self, msg: Any) -> None:
        for sender in self.senders:
            sender.send_pyobj(msg)

    def close(self, linger: int | None = None) -> None:
        for sender in self.senders:
            sender.close(linger=linger)

    # -- requests -------------------------------------------------------------------------------
    def dispatch(self, req: TokenizedGenerateReqInput, send: bool = True) -> int:
        rank = self.select(req)
        self.rid_to_rank[req.rid] = rank
        self.loads[rank] += 1
        self.dispatched[rank] += 1
        if send:
            self.senders[rank].send_pyobj(req)
        return rank

    def select(self, req: TokenizedGenerateReqInput) -> int:
        if req.data_parallel_rank is not None:  # the router chose (its --dp-aware)
            rank = req.data_parallel_rank
            if self.method == "prefix_affinity":  # its cache will hold the prefix
                self.indexes[rank].insert(block_hashes(req.input_ids, req.extra_key))
            return rank
        if self.method == "round_robin":
            rank, self._next = self._next, (self._next + 1) % self.dp_size
            return rank
        if self.method == "shortest_queue":
            return self._least_loaded()
        hashes = block_hashes(req.input_ids, req.extra_key)
        rank = self._prefix_affinity(hashes, len(req.input_ids))
        self.indexes[rank].insert(hashes)
        return rank

    def _least_loaded(self) -> int:
        return min(range(self.dp_size), key=lambda r: (self.loads[r], r))

    def _imbalanced(self) -> bool:
        hi, lo = max(self.loads), min(self.loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def _prefix_affinity(self, hashes: list[int], prompt_len: int) -> int:
        if self._imbalanced() or not hashes:  # (a prompt shorter than a block: no cache to use)
            return self._least_loaded()
        matched = [index.match(hashes) for index in self.indexes]
        best = max(range(self.dp_size), key=lambda r: (matched[r], -self.loads[r], -r))
        if not (matched[best] > 0 and matched[best] >= self.cache_threshold * prompt_len):
            sizes = [index.size_tokens for index in self.indexes]
            best = min(range(self.dp_size), key=lambda r: (sizes[r], self.loads[r], r))
        # A replica whose running batch is full queues the request while another has room:
        # that one computes the prefix sooner than the full one would start it.
        cap = self.max_running_requests
        if cap and self.loads[best] >= cap and min(self.loads) < cap:
            return self._least_loaded()
        return best

    def on_output(self, out: BatchStrOutput) -> None:
        """Every output the TokenizerManager receives: a finished rid leaves its replica."""
        for rid, reason in zip(out.rids, out.finished_reasons, strict=True):
            if reason is not None and (rank := self.rid_to_rank.pop(rid, None)) is not None:
                self.loads[rank] -= 1

    # -- control requests -----------------------------------------------------------------------
    async def control(self, req: Any, reply_type: type, timeout: float) -> Any:
        """Broadcast `req` and return the merge of the N replies of that broadcast (its call
        id, which the replies echo: a late reply to a call that timed out was counted as an
        answer to the next one). A flush or info request made while one of its kind is in
        flight shares that call's answer."""
        shared = type(req) if isinstance(req, _SHARED_CALLS) else None
        call_id = self._shared.get(shared) if shared is not None else None
        call = self._calls.get(call_id) if call_id is not None else None
        if call is None:
            self._next_call_id += 1
            call_id = req.call_id = self._next_call_id
            call = _FanIn(asyncio.get_running_loop().create_future(), reply_type, shared)
            self._calls[call_id] = call
            if shared is not None:
                self._shared[shared] = call_id
            self.broadcast(req)
        call.waiters += 1
        try:
            return await asyncio.wait_for(asyncio.shield(call.future), timeout)
        finally:
            call.waiters -= 1
            if call.waiters == 0 and not call.future.done():  # the last waiter gave up
                self._forget(call_id)

    def _forget(self, call_id: int) -> None:
        call = self._calls.pop(call_id, None)
        if (
            call is not None
            and call.shared is not None
            and self._shared.get(call.shared) == call_id
        ):
            del self._shared[call.shared]

    def fail_calls(self, error: BaseException) -> None:
        """A replica is gone: no call in flight can get its N replies; each fails now."""
        for call in self._calls.values():
            if not call.future.done():
                call.future.set_exception(error)
        self._calls.clear()
        self._shared.clear()

    def on_reply(self, msg: Any) -> None:
        call = self._calls.get(msg.call_id)
        if call is None or not isinstance(msg, call.reply_type):
            return  # the answer to a call that timed out
        call.replies.append(msg)
        if len(call.replies) < self.dp_size:
            return
        self._forget(msg.call_id)
        merged = merge_replies(call.replies)
        if isinstance(merged, FlushCacheReqOutput) and merged.success:
            for index in self.indexes:  # every replica's cache is empty now
                index.clear()
        if not call.future.done():
            call.future.set_result(merged)


def merge_replies(replies: list[Any]) -> Any:
    """One reply from N replicas' replies of one type: a flush succeeds when every replica's
    does; an info dict (`info` field) is merged by merge_server_infos."""
    first = replies[0]
    if isinstance(first, (FlushCacheReqOutput, LoRAUpdateReqOutput)):
        failed = [r.message for r in replies if not r.success]
        return type(first)(not failed, "; ".join(dict.fromkeys(failed)))
    if hasattr(first, "info"):
        return dataclasses.replace(first, info=merge_server_infos([r.info for r in replies]))
    return first


def merge_server_infos(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """The server's figures from its replicas' (each carries its dp_rank): numbers are summed
    (counters, gauges, capacities), ratios recomputed from the sums or averaged, the dashboard's
    views (steps, tokens per second, the tree) merged, anything else is replica 0's; `replicas`
    lists each one's own dict in rank order."""
    infos = sorted(infos, key=lambda i: i.get("dp_rank", 0))
    out: dict[str, Any] = {}
    for key, value in infos[0].items():
        values = [i.get(key) for i in infos]
        if key not in NON_ADDITIVE and all(_is_number(v) for v in values):
            out[key] = sum(values)
        else:
            out[key] = value
    out.pop("dp_rank", None)
    total = out.get("max_total_num_tokens")
    if total:
        free = out.get("available_tokens", 0) + out.get("evictable_tokens", 0)
        out["token_usage"] = (total - free) / total
    if "hicache_storage_blocks" in out:  # (each lists it at its own moment: take the freshest)
        out["hicache_storage_blocks"] = max(i.get("hicache_storage_blocks", 0) for i in infos)
    if "new_token_ratio" in out:
        out["new_token_ratio"] = sum(i["new_token_ratio"] for i in infos) / len(infos)
    if out.get("cache_window_prompt_tokens"):  # (a replica that served nothing weighs nothing)
        out["cache_hit_rate"] = (
            out["cache_window_cached_tokens"] / out["cache_window_prompt_tokens"]
        )
    if out.get("spec_verify_ct"):
        out["spec_accept_length"] = out["spec_committed_tokens"] / out["spec_verify_ct"]
    if out.get("spec_draft_tokens"):
        out["spec_accept_rate"] = out["spec_accepted_tokens"] / out["spec_draft_tokens"]
    if all("steps" in i and "throughput" in i for i in infos):  # dashboard snapshots
        out.update(merge_snapshots(infos))
    if all("tree" in i for i in infos):
        out["tree"] = merge_tree_stats([i["tree"] for i in infos])
    out["replicas"] = infos
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# -- launching the replicas ----------------------------------------------------------------------
def replica_cpus(dp_size: int) -> list[list[int] | None]:
    """On CPU, each replica's share of this process's CPUs (disjoint, so that N models do not
    fight over the same cores and each sizes its torch threads to its share); None each when
    there are fewer CPUs than replicas."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return [None] * dp_size
    share = len(cpus) // dp_size
    if share < 1:
        logger.warning(
            "--dp-size %d on %d CPUs: the replicas share the cores, so each starts and decodes "
            "slower than one model with all of them would",
            dp_size,
            len(cpus),
        )
        return [None] * dp_size
    return [cpus[r * share : (r + 1) * share] for r in range(dp_size)]


def replica_processes(ctx: Any, server_args: Any, port_args: Any) -> tuple[list, list, list]:
    """One scheduler process per replica (not started yet), named radixserve-scheduler-dp<r>,
    with the read end of its "ready" pipe and its heartbeat (see scheduler_process)."""
    dp_size = server_args.dp_size
    pin = server_args.device == "cpu" and server_args.num_threads is None
    cpus = replica_cpus(dp_size) if pin else [None] * dp_size
    procs, pipes, heartbeats = [], [], []
    for rank in range(dp_size):
        ready_r, ready_w = ctx.Pipe(duplex=False)
        heartbeat = ctx.Value("d", time.monotonic(), lock=False)
        args = (server_args, replica_port_args(port_args, rank), ready_w, heartbeat, rank)
        procs.append(
            ctx.Process(
                target=run_replica_process,
                args=(*args, cpus[rank]),
                name=f"radixserve-scheduler-dp{rank}",
                daemon=True,
            )
        )
        pipes.append(ready_r)
        heartbeats.append(heartbeat)
    return procs, pipes, heartbeats


def replica_port_args(port_args: Any, dp_rank: int) -> Any:
    """The replica's own input endpoint; the detokenizer's and the tokenizer's are shared."""
    return dataclasses.replace(
        port_args, scheduler_input_ipc=f"{port_args.scheduler_input_ipc}-dp{dp_rank}"
    )


def run_replica_process(
    server_args: Any,
    port_args: Any,
    ready: Any,
    heartbeat: Any,
    dp_rank: int,
    cpus: list[int] | None,
) -> None:
    """A replica's scheduler process: its CPUs (CPU) or its GPU (CUDA), then the scheduler.
    Replicas that share a memory share its fraction: on a CPU all of them share the host's
    (each took the whole --mem-fraction-static of the memory available: 20% per replica, and
    --dp-size 5 asked for all of it); on CUDA those that share a GPU (fewer GPUs than
    replicas)."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # physical_core_count() then sizes the threads to them
    if server_args.device == "cpu" and server_args.mem_fraction_static is not None:
        server_args = dataclasses.replace(
            server_args, mem_fraction_static=server_args.mem_fraction_static / server_args.dp_size
        )
    if server_args.device == "cuda":
        import torch

        gpus = max(1, torch.cuda.device_count())
        torch.cuda.set_device(dp_rank % gpus)
        per_gpu = -(-server_args.dp_size // gpus)
        if per_gpu > 1 and server_args.mem_fraction_static is not None:
            server_args = dataclasses.replace(
                server_args, mem_fraction_static=server_args.mem_fraction_static / per_gpu
            )
    from radixserve.managers.scheduler_process import run_scheduler_process

    run_scheduler_process(server_args, port_args, ready, heartbeat, dp_rank=dp_rank)
