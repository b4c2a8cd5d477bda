"""SchedulePolicy (the order of the waiting queue) and PrefillAdder (admission under budgets).

SchedulePolicy.calc_priority sorts waiting requests; the cache-aware policies (lpm, dfs-weight)
first match every waiting request against the radix tree. With lpm, in-batch prefix caching
holds back a request that shares >= 32 tokens with one already chosen this round, so one
representative computes the shared prefix and the rest hit the cache next round.

PrefillAdder admits requests in that order while every budget holds (DESIGN §4):
rem_input_tokens (max_prefill_tokens), rem_chunk_tokens (chunked_prefill_size),
rem_total_tokens = available + evictable − reservations of running and admitted requests,
and request rows. It locks a request's matched node, then re-checks (locking shrinks evictable).
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from radixserve.managers.schedule_batch import Req
from radixserve.mem_cache.radix_cache import RadixCache, RadixKey

CLIP_MAX_NEW_TOKENS = 4096
LPM_FALLBACK_QUEUE_LEN = 128
IN_BATCH_PREFIX_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_DEPRIORITIZE_THRESHOLD = 32
CACHE_AWARE = ("lpm", "dfs-weight")


@dataclass
class RoundOrder:
    """What calc_priority decided for this round, besides the order of the queue."""

    held: set[str] = field(default_factory=set)  # rids held back (in-batch prefix caching)
    # Every waiting request was matched against the tree this round; otherwise (no cache-aware
    # policy, or lpm's fallback on a long queue) the scheduler matches each one before admission.
    matched: bool = False


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache: Any, seed: int = 0) -> None:
        if policy in CACHE_AWARE and getattr(tree_cache, "disabled", False):
            policy = "fcfs"  # nothing to be aware of
        self.policy = policy
        self.tree_cache = tree_cache
        self.rng = random.Random(seed)

    def effective_policy(self, queue_len: int) -> str:
        if self.policy == "lpm" and queue_len > LPM_FALLBACK_QUEUE_LEN:
            return "fcfs"  # matching every request each round costs too much
        return self.policy

    def calc_priority(
        self, waiting: list[Req], running: list[Req] | None = None, chunked: Req | None = None
    ) -> RoundOrder:
        """Sort `waiting` in place; say which requests are held back and whether all were
        matched against the tree (a match from an earlier round is stale: nodes move)."""
        policy = self.effective_policy(len(waiting))
        order = RoundOrder(matched=policy in CACHE_AWARE)
        if order.matched:
            for r in waiting:
                r.init_next_round_input(self.tree_cache)
        if policy == "lpm":
            order.held = self._in_batch_prefix_caching(waiting, chunked)
            waiting.sort(key=lambda r: (r.rid in order.held, -len(r.prefix_indices)))
        elif policy == "dfs-weight":
            self._sort_dfs_weight(waiting)
        elif policy == "lof":
            waiting.sort(key=lambda r: -r.max_new_tokens)
        elif policy == "random":
            self.rng.shuffle(waiting)
        elif policy == "priority":
            waiting.sort(key=lambda r: (-(r.priority or 0), r.arrival_time))
        elif policy == "routing-key":
            counts = Counter(r.routing_key for r in running or [] if r.routing_key is not None)
            waiting.sort(key=lambda r: -counts.get(r.routing_key, 0))
        return order

    def _in_batch_prefix_caching(self, waiting: list[Req], chunked: Req | None) -> set[str]:
        """Hold back requests that would recompute, in this round, >= 32 tokens that a request
        placed before them (or the chunked request in flight) computes too.

        SGLang checks only requests whose tree match is <= 32 tokens; we compare the part beyond
        each request's own tree match, which reduces to that rule for uncached requests and also
        covers a group whose prefix is half in the tree (a chunk boundary split it)."""
        sim = RadixCache(None, None, page_size=1)
        if chunked is not None:
            sim.insert(RadixKey(chunked.origin_input_ids, chunked.extra_key), _ids(chunked))
        held: set[str] = set()
        for r in waiting:
            key = RadixKey(r.origin_input_ids, r.extra_key)
            shared = len(sim.match_prefix(key).device_indices)
            if shared - len(r.prefix_indices) >= IN_BATCH_PREFIX_DEPRIORITIZE_THRESHOLD:
                held.add(r.rid)
            elif len(r.origin_input_ids) - len(r.prefix_indices) > IN_BATCH_PREFIX_CHECK_THRESHOLD:
                # Only a request that computes more than 32 tokens can make others repeat 32.
                sim.insert(key, _ids(r))
        return held

    def _sort_dfs_weight(self, waiting: list[Req]) -> None:
        """Post-order walk of the tree, heavier subtrees (more waiting requests) first, so
        requests sharing the deepest prefixes run back to back."""
        by_node: dict[int, list[Req]] = defaultdict(list)
        weight: dict[int, int] = defaultdict(int)
        for r in waiting:
            by_node[id(r.last_node)].append(r)
            node = r.last_node
            while node is not None:
                weight[id(node)] += 1
                node = node.parent
        ordered: list[Req] = []
        stack: list[tuple[Any, bool]] = [(self.tree_cache.root_node, False)]
        while stack:
            node, children_done = stack.pop()
            if children_done:
                ordered.extend(by_node.get(id(node), []))
                continue
            stack.append((node, True))
            kids = [c for c in node.children.values() if weight.get(id(c))]
            kids.sort(key=lambda c: weight[id(c)])  # the heaviest is pushed last, visited first
            stack.extend((c, False) for c in kids)
        waiting[:] = ordered


def _ids(r: Req) -> torch.Tensor:
    return torch.tensor(r.origin_input_ids, dtype=torch.int64)


def lora_fits(req: Req, loras: set[str], max_loras: int | None) -> bool:
    """Whether a batch holding adapters `loras` can take `req`'s LoRA adapter
    (--max-loras-per-batch distinct adapters at most; requests without one always fit)."""
    if req.lora_id is None or req.lora_id in loras or max_loras is None:
        return True
    return len(loras) < max_loras


class AddReqResult(Enum):
    CONTINUE = auto()  # admitted; try the next one
    NO_TOKEN = auto()  # the KV budget is exhausted
    OTHER = auto()  # another budget (input tokens, chunk, rows) is exhausted


class PrefillAdder:
    def __init__(
        self,
        tree_cache: Any,
        allocator: Any,
        running_reqs: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        max_running_requests: int,
        page_size: int = 1,
        mixed_decode_tokens: int = 0,
        max_loras: int | None = None,
    ) -> None:
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.new_token_ratio = new_token_ratio
        self.page_size = page_size
        self.rem_input_tokens = max_prefill_tokens - mixed_decode_tokens
        self.rem_chunk_tokens = chunked_prefill_size
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= mixed_decode_tokens
        self.rem_rows = max_running_requests - len(running_reqs)
        self.reserved = mixed_decode_tokens + sum(self.reserve_for(r) for r in running_reqs)
        self.num_running = len(running_reqs)
        self.max_loras = max_loras
        self.loras = {r.lora_id for r in running_reqs if r.lora_id is not None}
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None

    def ratio_for(self, req: Req) -> float:
        return 1.0 if req.sampling_params.ignore_eos else self.new_token_ratio

    def reserve_for(self, req: Req) -> float:
        remaining = max(req.max_new_tokens - len(req.output_ids), 0)
        return min(remaining, CLIP_MAX_NEW_TOKENS) * self.ratio_for(req)

    @property
    def rem_total_tokens(self) -> float:
        return self.allocator.available_size() + self.tree_cache.evictable_size() - self.reserved

    def _ceil_page(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    @contextmanager
    def _lock_node(self, node: Any) -> Iterator[None]:
        self.tree_cache.inc_lock_ref(node)
        try:
            yield
        finally:
            self.tree_cache.dec_lock_ref(node)

    def add_chunked_req(self, req: Req) -> Req | None:
        """Continue a chunked request first; returns it again if it is still not complete (it
        is in can_run_list only when this round computes part of it)."""
        chunk = req.extend_input_len if self.rem_chunk_tokens is None else self.rem_chunk_tokens
        budget = int(min(chunk, self.rem_total_tokens))
        budget = budget // self.page_size * self.page_size
        if budget <= 0:
            return req
        truncated = req.extend_input_len > budget
        req.extend_input_len = min(req.extend_input_len, budget)
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + req.extend_input_len]
        self.can_run_list.append(req)
        if req.lora_id is not None:
            self.loras.add(req.lora_id)
        self._spend(req.extend_input_len, 0 if truncated else self.reserve_for(req))
        return req if truncated else None

    def add_one_req(self, req: Req) -> AddReqResult:
        if self.rem_rows - len(self.can_run_list) <= 0:
            return AddReqResult.OTHER
        input_tokens = self._ceil_page(req.extend_input_len)
        reserve = self.reserve_for(req)
        if self.num_running == 0 and not self.can_run_list:
            reserve = 0.0  # never starve the only request: retraction guards its decode
        total = input_tokens + reserve
        if total > self.rem_total_tokens:
            return AddReqResult.NO_TOKEN
        if input_tokens > self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER
        with self._lock_node(req.last_node):
            if total > self.rem_total_tokens:
                return AddReqResult.NO_TOKEN
            chunk = self.rem_chunk_tokens
            if chunk is None or input_tokens <= chunk:
                self._admit(req)
                self._spend(input_tokens, reserve)
                return AddReqResult.CONTINUE
            trunc = chunk // self.page_size * self.page_size
            if trunc <= 0:
                return AddReqResult.OTHER
            req.extend_input_len = trunc
            req.fill_ids = req.fill_ids[: len(req.prefix_indices) + trunc]
            self._admit(req)
            self.new_chunked_req = req
            self._spend(trunc, 0.0)
            return AddReqResult.OTHER  # a chunk fills the batch

    def lora_fits(self, req: Req) -> bool:
        return lora_fits(req, self.loras, self.max_loras)

    def _admit(self, req: Req) -> None:
        if req.lora_id is not None:
            self.loras.add(req.lora_id)
        self.can_run_list.append(req)
        self.tree_cache.inc_lock_ref(req.last_node)
        req.cache_protected_len = len(req.prefix_indices)

    def _spend(self, input_tokens: int, reserve: float) -> None:
        self.reserved += input_tokens + reserve
        self.rem_input_tokens -= input_tokens
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= input_tokens
