"""HiCacheController: the background copies between the KV tiers.

Two worker threads, each with an urgent queue served before its background queue:
* the copy thread: loads (host → device, a request waits for them) before backups
  (device → host, write-through);
* the storage thread: reads (storage → host) before writes (to storage).
A storage write reads its blocks off the device on the copy thread first (a memory copy), sets
`device_read` (the scheduler then lets go of those device slots) and hands the bytes to the
storage thread: the device pool never waits for the disk.
The scheduler thread never waits for a copy: it issues an operation, keeps scheduling, and
picks up finished operations with `HiRadixCache.poll` (HiRadixCache applies their effect on
the tree there, on the scheduler thread, so the tree has one writer).

An operation that reads device KV waits first for its `fence`: the forward step that was the
last one launched when the operation was issued (the overlap loop may still be computing KV
the tree already indexes). On CUDA the copies run on the controller's own stream, and the
thread waits for that stream before it marks an operation done.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.mem_cache.hicache_storage import HiCacheStorage
from radixserve.mem_cache.memory_pool_host import HostKVPool

logger = logging.getLogger(__name__)

LOAD, BACKUP, STORAGE_READ, STORAGE_WRITE = "load", "backup", "storage_read", "storage_write"


@dataclass(eq=False)
class CacheOperation:
    """One copy between tiers. `node` is the tree node whose state the operation changes (its
    lock is held until HiRadixCache finishes the operation); `blocks` is what a storage
    read found (a prefix of `keys`) or how many blocks a storage write stored."""

    kind: str
    device_indices: torch.Tensor
    host_indices: torch.Tensor
    node: Any = None
    fence: Any = None  # something with .wait(): the forward the copy must follow
    keys: list[str] = field(default_factory=list)
    block_size: int = 0
    start: int = 0  # storage read: the token position where the first block starts
    key: Any = None  # storage read: the tokens up to the end of the last block
    blocks: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    # storage write: the blocks' bytes, read off the device (then `device_read` is set)
    payload: list[bytes] | None = None
    device_read: threading.Event = field(default_factory=threading.Event)


class _Worker:
    """One thread draining an urgent and a background queue of operations."""

    def __init__(
        self, name: str, run: Callable[[CacheOperation], _Worker | None], cond: Any
    ) -> None:
        self.urgent: deque[CacheOperation] = deque()
        self.background: deque[CacheOperation] = deque()
        self.run = run
        self.cond = cond  # shared with the controller: a finished op wakes a waiting scheduler
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def put(self, op: CacheOperation, urgent: bool) -> None:
        with self.cond:
            (self.urgent if urgent else self.background).append(op)
            self.cond.notify_all()

    def _next(self) -> CacheOperation | None:
        with self.cond:
            while not (self.urgent or self.background or self.closed):
                self.cond.wait()
            if self.urgent:
                return self.urgent.popleft()
            if self.background:
                return self.background.popleft()
            return None

    def _loop(self) -> None:
        while (op := self._next()) is not None:
            then = None
            try:
                if op.fence is not None:
                    op.fence.wait()
                then = self.run(op)
            except BaseException as e:  # reported to the scheduler by HiRadixCache.poll
                logger.exception("hierarchical cache %s failed", op.kind)
                op.error = e
            if then is not None:  # its next stage runs on that worker, which finishes it
                then.put(op, urgent=False)
                continue
            with self.cond:
                op.done.set()
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout=10)


class HiCacheController:
    def __init__(self, host_pool: HostKVPool, storage: HiCacheStorage | None = None) -> None:
        self.host_pool = host_pool
        self.storage = storage
        cuda = any(b.is_cuda for b in host_pool.device_buffers)
        self.stream = torch.cuda.Stream() if cuda else None
        self.cond = threading.Condition()
        self.copier = _Worker("radixserve-hicache-copy", self._copy, self.cond)
        self.storer = (
            _Worker("radixserve-hicache-storage", self._store, self.cond) if storage else None
        )

    # ---- issuing (scheduler thread) ------------------------------------------------------------

    def load(self, op: CacheOperation) -> CacheOperation:
        self.copier.put(op, urgent=True)
        return op

    def backup(self, op: CacheOperation) -> CacheOperation:
        self.copier.put(op, urgent=False)
        return op

    def storage_read(self, op: CacheOperation) -> CacheOperation:
        assert self.storer is not None
        self.storer.put(op, urgent=True)
        return op

    def storage_write(self, op: CacheOperation) -> CacheOperation:
        """Read the blocks off the device (copy thread), then write them (storage thread)."""
        assert self.storer is not None
        self.copier.put(op, urgent=False)
        return op

    def backup_now(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """A synchronous device → host copy (write-back on eviction: the device slots are
        reused right after)."""
        self._copy(CacheOperation(BACKUP, device_indices, host_indices))

    def wait_any(self, timeout: float) -> None:
        """Sleep until some operation finishes (or the timeout): the scheduler's idle wait."""
        with self.cond:
            self.cond.wait(timeout)

    def close(self) -> None:
        self.copier.close()
        if self.storer is not None:
            self.storer.close()

    # ---- running (worker threads) --------------------------------------------------------------

    def _copy(self, op: CacheOperation) -> _Worker | None:
        if op.kind == STORAGE_WRITE:
            return self._read_for_storage(op)
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with torch.inference_mode(), ctx:
            if op.kind == LOAD:
                self.host_pool.load_to_device(op.device_indices, op.host_indices)
            else:
                self.host_pool.backup_from_device(op.host_indices, op.device_indices)
        if self.stream is not None:
            self.stream.synchronize()
        return None

    def _read_for_storage(self, op: CacheOperation) -> _Worker:
        """A storage write's first stage: its blocks' bytes; the storage thread does the rest."""
        assert self.storer is not None
        b = op.block_size
        with torch.inference_mode():
            op.payload = [
                self.host_pool.read_device_bytes(op.device_indices[i * b : (i + 1) * b])
                for i in range(len(op.keys))
            ]
        with self.cond:
            op.device_read.set()
            self.cond.notify_all()  # a scheduler waiting for room: these slots are free to go
        op.fence = None
        return self.storer

    def _store(self, op: CacheOperation) -> None:
        """A read stops at the first block that is missing or fails its checks (deleted: a
        miss, so it is recomputed and written again); `blocks` = the blocks read. A write
        skips the blocks already stored; `blocks` = the blocks it stored (a full disk stores
        none)."""
        assert self.storage is not None
        b = op.block_size
        with torch.inference_mode():
            if op.kind == STORAGE_READ:
                for i, key in enumerate(op.keys):
                    data = self.storage.get(key)
                    rows = op.host_indices[i * b : (i + 1) * b]
                    if data is None or not self.host_pool.write_host_bytes(rows, data):
                        if data is not None:
                            self.storage.delete(key)  # checksummed but the wrong size: foreign
                        self._purge(op.keys[i + 1 :])
                        break
                    op.blocks = i + 1
                return
            assert op.payload is not None  # (read off the device by the copy thread)
            for key, data in zip(op.keys, op.payload, strict=True):
                if not self.storage.exists(key):
                    op.blocks += self.storage.set(key, data)
            op.payload = None

    def _purge(self, keys: list[str]) -> None:
        """After a failed read: check the blocks the read will not use, so that damaged ones
        (a damaged directory rarely has only one) are deleted now and all rewritten by the
        write that follows the request's recomputation, not one per later read."""
        assert self.storage is not None
        for key in keys:
            self.storage.get(key)
