"""The storage tier of the hierarchical cache: KV blocks keyed by the prefix's chain hash.

A prefix is cut into blocks of `block_size` tokens; block i's key is
sha256(key of block i-1, extra_key, the block's token ids), so a key names the whole prefix up
to the end of its block, and the same prefix maps to the same key in every process and after a
restart. HiCacheFile keeps one file per block in a directory namespaced by the model and KV
layout (a different model or dtype never reads another's blocks). Files are written to a
temporary name and renamed, so a reader never sees half a block.

The cache controller's storage thread calls get/set; the scheduler thread only asks `exists`,
which is answered from an in-memory index (the directory listing at start-up plus what this
process wrote), so a lookup never touches the disk on the scheduling path.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from abc import ABC, abstractmethod

import torch

STORAGE_BACKENDS = ("file",)


def block_hashes(
    token_ids: list[int], block_size: int, extra_key: str | None = None, start_block: int = 0
) -> list[str]:
    """Chain hashes of the whole blocks of token_ids (the last partial block has none)."""
    prev = hashlib.sha256(f"radixserve-hicache:{extra_key}".encode()).digest()
    out: list[str] = []
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        h = hashlib.sha256(prev)
        h.update(torch.tensor(block, dtype=torch.int64).numpy().tobytes())
        prev = h.digest()
        if i >= start_block:
            out.append(h.hexdigest())
    return out


class HiCacheStorage(ABC):
    """A key → bytes store of KV blocks. get/set may be slow (disk, network); exists is cheap."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The block's bytes, or None when it is missing or unreadable."""

    @abstractmethod
    def set(self, key: str, data: bytes) -> bool:
        """Store a block; True when it is stored."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    def num_blocks(self) -> int:
        return 0


class HiCacheFile(HiCacheStorage):
    """One file per block under `<root>/<namespace>/`."""

    def __init__(self, root: str, namespace: str) -> None:
        self.dir = os.path.join(os.path.expanduser(root), namespace)
        os.makedirs(self.dir, exist_ok=True)
        self._lock = threading.Lock()
        self._index = {name[: -len(".kv")] for name in os.listdir(self.dir) if name.endswith(".kv")}

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key + ".kv")

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except OSError:
            with self._lock:
                self._index.discard(key)
            return None

    def set(self, key: str, data: bytes) -> bool:
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
        except OSError:
            return False
        with self._lock:
            self._index.add(key)
        return True

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def num_blocks(self) -> int:
        with self._lock:
            return len(self._index)


def storage_namespace(model_id: str, device_buffers: list[torch.Tensor], block_size: int) -> str:
    """A directory name that changes with the model and the KV layout (shapes, dtypes, block)."""
    layout = [(tuple(b.shape[1:]), str(b.dtype)) for b in device_buffers]
    digest = hashlib.sha256(repr((model_id, layout, block_size)).encode()).hexdigest()[:16]
    base = os.path.basename(model_id.rstrip("/")) or "model"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in base)[:48]
    return f"{safe}-{digest}"


def create_storage(
    backend: str, root: str, model_id: str, device_buffers: list[torch.Tensor], block_size: int
) -> HiCacheStorage:
    if backend == "file":
        return HiCacheFile(root, storage_namespace(model_id, device_buffers, block_size))
    raise ValueError(f"unknown hierarchical cache storage backend {backend!r}")
