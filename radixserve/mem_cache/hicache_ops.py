"""The hierarchical cache's copy operations as the scheduler sees them (mixed into HiRadixCache).

* `prepare(req)`: before admission. If the request's match continues past the device into
  host nodes, lock that path, give the nodes device slots and issue a load; if it continues
  into storage blocks, issue a read into host slots. The request waits (prepare returns False)
  until the copy is done; then it is matched again and admitted with the loaded prefix. A
  request whose nodes are loading, or whose blocks are being read, waits for that copy: each
  node or block is copied once, however many requests share it.
* `poll()`: every step, apply the effect of finished operations on the tree (clear the
  loading/backup marks, insert blocks read from storage as host nodes, release the locks).
* backups: `backup_async` (write-through, in the background) and `backup_now` (eviction).
* `cache_finished_req`: also writes the request's whole blocks to storage.

Every operation holds a lock on its tree path until `poll` finishes it, so nothing it reads
or writes is evicted meanwhile; a request aborted while it waits leaves the operation to
finish on its own, and its effect (a prefix in the tree) stays as evictable cache.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from radixserve.mem_cache.cache_controller import (
    BACKUP,
    LOAD,
    STORAGE_READ,
    STORAGE_WRITE,
    CacheOperation,
)
from radixserve.mem_cache.hicache_storage import HiCacheStorage, block_hashes
from radixserve.mem_cache.radix_cache import RadixKey

MAX_LOADS_PER_REQUEST = 3  # then it recomputes: never thrash between load and eviction


@dataclass
class HiCacheStats:
    host_hit_tokens: int = 0  # loaded back host → device for a waiting request
    storage_hit_tokens: int = 0  # read storage → host for a waiting request
    device_to_host_tokens: int = 0  # demoted by device eviction
    backup_tokens: int = 0  # copied device → host (write-through or on eviction)
    storage_write_tokens: int = 0  # blocks written device → storage (failed writes not counted)
    load_ops: int = 0


@dataclass
class _ReqTiers:
    loads: int = 0
    storage_checked: bool = False


class HiCacheRequestOps:
    # Provided by HiRadixCache / RadixCache.
    root_node: Any
    host_pool: Any
    controller: Any
    token_to_kv_pool_allocator: Any
    page_size: int

    def init_request_ops(self, storage: HiCacheStorage | None, block_size: int) -> None:
        self.storage = storage
        self.block_size = block_size
        self.ops: list[CacheOperation] = []
        self.stats = HiCacheStats()
        self.fence_fn: Callable[[], Any] = lambda: None
        self._waiting: dict[Any, list[CacheOperation]] = {}  # a loading request → its copies
        self._tiers: weakref.WeakKeyDictionary[Any, _ReqTiers] = weakref.WeakKeyDictionary()
        self._reading: dict[str, CacheOperation] = {}  # a storage block → its read in flight

    def set_compute_fence(self, fence_fn: Callable[[], Any]) -> None:
        """fence_fn() returns something with .wait() that returns once every forward launched
        so far has written its KV (None when none is in flight)."""
        self.fence_fn = fence_fn

    def has_pending(self) -> bool:
        return bool(self.ops)

    def holds_device_slots(self) -> bool:
        """Copies in flight that hold device slots: waiting for the others frees no room. A
        storage write lets go of them once its bytes are read off the device; a storage read
        holds them only through the lock on its matched path (one from the root holds host
        slots only, and a slow disk would stall a decode short of room for nothing)."""
        return any(self._holds_device(op) for op in self.ops)

    def _holds_device(self, op: CacheOperation) -> bool:
        if op.kind == STORAGE_WRITE:
            return not op.device_read.is_set()
        if op.kind == STORAGE_READ:
            return op.node is not self.root_node
        return True

    def wait_idle(self, timeout: float) -> None:
        if self.ops:
            self.controller.wait_any(timeout)

    def tier_stats(self) -> dict[str, Any]:
        out = {f"hicache_{k}": v for k, v in asdict(self.stats).items()}
        out["hicache_host_total_tokens"] = self.host_pool.size
        out["hicache_host_available_tokens"] = self.host_pool.available_size()
        out["hicache_storage_blocks"] = self.storage.num_blocks() if self.storage else 0
        return out

    # ---- admission -----------------------------------------------------------------------------

    def prepare(self, req: Any, budget: float) -> bool:
        """True when req can be admitted now: its match is on the device, or loading more
        would not help (no room within `budget` device tokens, or it tried enough)."""
        self.poll()
        if req in self._waiting:
            return False
        tiers = self._tiers.setdefault(req, _ReqTiers())
        req.init_next_round_input(self)
        key = req.prefix_match_key()
        path = self._walk(key, device_only=False)
        beyond = [n for n in path if not n.on_device]
        ops: list[CacheOperation] = []
        if beyond and tiers.loads < MAX_LOADS_PER_REQUEST:
            ops = list({id(n.loading): n.loading for n in beyond if n.loading}.values())
            if not ops and (op := self._load_back(beyond, budget)) is not None:
                ops, tiers.loads = [op], tiers.loads + 1
        elif not beyond and self.storage is not None and not tiers.storage_checked:
            op, tiers.storage_checked = self._prefetch(key, path, budget)
            ops = [op] if op is not None else []
        if ops:
            self._waiting[req] = ops
            return False
        return True

    def _load_back(self, nodes: list[Any], budget: float) -> CacheOperation | None:
        """Load the host-only `nodes` (the end of a path) to the device. Within `budget`: the
        tokens loaded, and the device tokens above them that the lock takes out of the evictable
        ones (the round's admission counted on them)."""
        need = sum(len(n.key) for n in nodes)
        if need > budget:
            return None
        last = nodes[-1]
        moved = self.inc_lock_ref(last)  # the whole path: nothing on it is evicted from either tier
        if need + moved > budget:
            self.dec_lock_ref(last)
            return None
        allocator = self.token_to_kv_pool_allocator
        if allocator.available_size() < need:
            self.evict(need - allocator.available_size())
        dev = allocator.alloc(need)
        if dev is None:
            self.dec_lock_ref(last)
            return None
        host = torch.cat([n.host_value for n in nodes])
        op = CacheOperation(LOAD, dev, host, node=last, fence=self.fence_fn())
        pos = 0
        for n in nodes:
            n.value, n.loading = dev[pos : pos + len(n.key)], op
            self._add_device_tokens(n, len(n.key))
            pos += len(n.key)
        self.stats.load_ops += 1
        self.ops.append(op)
        return self.controller.load(op)

    def _prefetch(
        self, key: RadixKey, path: list[Any], budget: float
    ) -> tuple[CacheOperation | None, bool]:
        """Read the storage blocks that continue the tree's match into host slots (locking the
        matched path takes its device tokens out of the evictable ones: within `budget`), or
        wait for another request's read of them. Returns the read to wait for, and whether the
        request is done with storage: it issued a read, or no block adds to its match (short of
        budget or host room, it looks again next round)."""
        b = self.block_size
        start = sum(len(n.key) for n in path) // b * b
        keys: list[str] = []
        for k in block_hashes(key.token_ids, b, key.extra_key, start_block=start // b):
            if (reading := self._reading.get(k)) is not None:
                return reading, False  # another request's: it matches again once they land
            if not self.storage.exists(k):
                break
            keys.append(k)
        if not keys:
            return None, True
        last = path[-1] if path else self.root_node
        if self.inc_lock_ref(last) > budget:
            self.dec_lock_ref(last)
            return None, False
        host = self.alloc_host(len(keys) * b)
        if host is None:
            self.dec_lock_ref(last)
            return None, False
        op = CacheOperation(STORAGE_READ, self._empty(), host, node=last, keys=keys)
        op.block_size, op.start = b, start
        op.key = key[: start + len(keys) * b]
        self._reading.update(dict.fromkeys(keys, op))
        self.ops.append(op)
        return self.controller.storage_read(op), True

    # ---- backups -------------------------------------------------------------------------------

    def backup_async(self, node: Any) -> None:
        host = self.alloc_host(len(node.key))
        if host is None:
            return  # the host is full of locked KV: the node stays device-only for now
        node.host_value = host
        op = CacheOperation(BACKUP, node.value, host, node=node, fence=self.fence_fn())
        node.backing_up = op
        self.inc_lock_ref(node)
        self.ops.append(op)
        self.controller.backup(op)

    def backup_now(self, node: Any) -> bool:
        """Copy an unlocked device node to the host before its slots are freed."""
        host = self.alloc_host(len(node.key))
        if host is None:
            return False
        fence = self.fence_fn()
        if fence is not None:
            fence.wait()
        self.controller.backup_now(host, node.value)
        node.host_value = host
        self.stats.backup_tokens += len(node.key)
        return True

    # ---- storage writes ------------------------------------------------------------------------

    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        super().cache_finished_req(req, is_insert)  # type: ignore[misc]
        if is_insert and self.storage is not None:
            self._write_storage(req)

    def _write_storage(self, req: Any) -> None:
        b = self.block_size
        tokens = (req.origin_input_ids + req.output_ids)[: req.kv_committed_len]
        tokens = tokens[: len(tokens) // b * b]
        keys = block_hashes(tokens, b, req.extra_key)
        missing = [i for i, k in enumerate(keys) if not self.storage.exists(k)]
        queued = sum(len(op.device_indices) for op in self.ops if op.kind == STORAGE_WRITE)
        if not missing or queued + len(missing) * b > self.token_to_kv_pool_allocator.size:
            return  # (a disk this far behind: the bytes waiting for it stay within a pool's)
        match = self.match_prefix(RadixKey(tokens, req.extra_key))
        if len(match.device_indices) < len(tokens):
            return
        dev = torch.cat([match.device_indices[i * b : (i + 1) * b] for i in missing])
        self.inc_lock_ref(match.last_node)
        op = CacheOperation(
            STORAGE_WRITE, dev, self._empty(), node=match.last_node, fence=self.fence_fn()
        )
        op.keys, op.block_size = [keys[i] for i in missing], b
        self.ops.append(op)
        self.controller.storage_write(op)

    # ---- completion (scheduler thread) ---------------------------------------------------------

    def poll(self) -> None:
        """Apply every finished operation; forget requests whose copies are all done. A storage
        write whose bytes are off the device unlocks its device slots now, not when the disk
        is done (a slow disk held the device pool: requests waited with nothing running)."""
        for op in self.ops:
            if op.kind == STORAGE_WRITE and op.device_read.is_set():
                self._unlock(op)
        for op in [op for op in self.ops if op.done.is_set()]:
            self._finish(op)
        for req in [r for r, ops in self._waiting.items() if all(o.done.is_set() for o in ops)]:
            del self._waiting[req]

    def poll_backups(self) -> None:
        """Finish the done backups only: they change no tree structure, so this is safe in
        the middle of an operation that holds nodes of the tree (eviction)."""
        for op in [op for op in self.ops if op.kind == BACKUP and op.done.is_set()]:
            self._finish(op)

    def wait_for(self, op: CacheOperation) -> None:
        op.done.wait()
        if op in self.ops:
            self._finish(op)

    def _finish(self, op: CacheOperation) -> None:
        self.ops.remove(op)
        if op.kind == STORAGE_READ:
            for k in op.keys:
                del self._reading[k]
        if op.error is not None:
            raise RuntimeError(f"hierarchical cache {op.kind} failed: {op.error!r}") from op.error
        n = len(op.device_indices)
        if op.kind in (LOAD, BACKUP):
            attr = "loading" if op.kind == LOAD else "backing_up"
            node = op.node
            while node is not self.root_node and getattr(node, attr) is op:
                setattr(node, attr, None)
                node = node.parent
            if op.kind == LOAD:
                self.stats.host_hit_tokens += n
            else:
                self.stats.backup_tokens += n
        elif op.kind == STORAGE_READ:
            got = op.blocks * op.block_size
            added = self.insert_host(op.key[: op.start + got], op.start, op.host_indices[:got])
            self.host_pool.free(op.host_indices[got:])
            self.stats.storage_hit_tokens += added
        else:
            self.stats.storage_write_tokens += op.blocks * op.block_size
        self._unlock(op)

    def _unlock(self, op: CacheOperation) -> None:
        """Let go of the tree path the operation locked (once)."""
        if op.node is not self.root_node:
            self.dec_lock_ref(op.node)
            op.node = self.root_node
