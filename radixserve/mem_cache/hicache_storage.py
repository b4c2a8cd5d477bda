"""The storage tier of the hierarchical cache: KV blocks keyed by the prefix's chain hash.

A prefix is cut into blocks of `block_size` tokens; block i's key is
sha256(key of block i-1, extra_key, the block's token ids), so a key names the whole prefix up
to the end of its block, and the same prefix maps to the same key in every process and after a
restart. HiCacheFile keeps one file per block in a directory namespaced by what the KV values
depend on besides the tokens: the model (its absolute path and the name, size and mtime of its
weight files), how it runs (dtype, quantization, dummy weights' seed, context length) and the KV
layout, so a server never reads KV another model, or the same path's older weights, computed.

A block file is a 16-byte header (magic, payload length, crc32 of the key and the payload)
and the payload; it is written to a temporary name and renamed, so a reader never sees half a
block, and a block that fails its checks on read (truncated, corrupted, foreign, or another
block's file under this key) is a miss: its key leaves the index and its file is deleted, so
the prefix is recomputed and written again. The temporary files of a server killed in the
middle of a write are removed at the next start.

The cache controller's storage thread calls get/set; the scheduler thread only asks `exists`,
which is answered from an in-memory index (the directory listing at start-up plus what this
process wrote) and, for a key it lacks, one stat of the block's file, at most once per
MISS_RECHECK_S: blocks another process writes (a --dp-size replica, a second server on the
directory) are found, and a key asked again and again costs no disk access. The block count
that get_server_info reports is the directory's, listed again at most once per BLOCK_COUNT_S.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import struct
import tempfile
import threading
import time
import zlib
from abc import ABC, abstractmethod
from typing import Any

import torch

logger = logging.getLogger(__name__)

STORAGE_BACKENDS = ("file",)
# A block file's header: magic, payload bytes, crc32 of the key and the payload (block_crc).
# Part of the namespace, so a change of format starts a new directory instead of reading old
# blocks as corrupt.
BLOCK_HEADER = struct.Struct("<4sQI")
BLOCK_MAGIC = b"RSKV"
# 2: block keys tell no extra key from the key "None"; 3: the checksum covers the key.
FILE_FORMAT = 3
# The files of a model directory whose contents decide the KV (the weights and the config).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
# A temporary block file this old was left by a process killed in the middle of a write (a
# write takes milliseconds); younger ones may be another live server's, sharing the directory.
STALE_TMP_S = 600.0
# How long a key found missing is taken as missing before its file is looked for again.
MISS_RECHECK_S = 1.0
# The directory's block count (get_server_info, on the scheduler thread) is listed again at
# most this often, and at most 1% of the time: a million-block directory takes a second.
BLOCK_COUNT_S = 1.0


def block_hashes(
    token_ids: list[int], block_size: int, extra_key: str | None = None, start_block: int = 0
) -> list[str]:
    """Chain hashes of the whole blocks of token_ids (the last partial block has none)."""
    # No extra key and the key "None" are apart (formatted, both read "None": a request could
    # read the blocks of a namespace it did not name).
    seed = b"\x00" if extra_key is None else b"\x01" + extra_key.encode()
    prev = hashlib.sha256(b"radixserve-hicache:" + seed).digest()
    out: list[str] = []
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        h = hashlib.sha256(prev)
        h.update(torch.tensor(block, dtype=torch.int64).numpy().tobytes())
        prev = h.digest()
        if i >= start_block:
            out.append(h.hexdigest())
    return out


def block_crc(key: str, data: bytes) -> int:
    """crc32 of the key, then the payload: another block's file copied or renamed under this
    key (well formed, the right size) fails the check instead of being served as its KV."""
    return zlib.crc32(data, zlib.crc32(key.encode()))


class HiCacheStorage(ABC):
    """A key → bytes store of KV blocks. get/set may be slow (disk, network); exists is cheap."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The block's bytes, or None when it is missing, unreadable, or fails its checks
        (then it is deleted: a miss, recomputed and written again)."""

    @abstractmethod
    def set(self, key: str, data: bytes) -> bool:
        """Store a block; True when it is stored. False when the write failed (a full disk):
        nothing of it is left behind and exists(key) stays False (a later write retries)."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Forget a block (it failed a check on read): exists(key) is False afterwards."""

    def num_blocks(self) -> int:
        return 0


class HiCacheFile(HiCacheStorage):
    """One file per block under `<root>/<namespace>/`: BLOCK_HEADER, then the payload."""

    def __init__(self, root: str, namespace: str) -> None:
        self.dir = os.path.join(os.path.expanduser(root), namespace)
        os.makedirs(self.dir, exist_ok=True)
        self._lock = threading.Lock()
        self._write_failed = False
        names = os.listdir(self.dir)
        self._index = {name[: -len(".kv")] for name in names if name.endswith(".kv")}
        self._misses: dict[str, float] = {}  # key -> when its file was last found missing
        self._count, self._count_due = len(self._index), -math.inf
        self._remove_stale_temporaries(name for name in names if name.endswith(".tmp"))

    def _remove_stale_temporaries(self, names: Any) -> None:
        """Temporary files of a server killed in the middle of a write (older than STALE_TMP_S)."""
        now = time.time()
        for name in names:
            path = os.path.join(self.dir, name)
            try:
                if now - os.stat(path).st_mtime > STALE_TMP_S:
                    os.remove(path)
            except OSError:
                pass  # another server removed or renamed it first

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key + ".kv")

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                header = f.read(BLOCK_HEADER.size)
                data = f.read()
        except OSError:
            with self._lock:
                self._index.discard(key)
            return None
        if len(header) == BLOCK_HEADER.size:
            magic, length, crc = BLOCK_HEADER.unpack(header)
            if magic == BLOCK_MAGIC and length == len(data) and crc == block_crc(key, data):
                return data
        logger.warning(
            "hierarchical cache: storage block %s is damaged or another block's; deleted", key
        )
        self.delete(key)
        return None

    def set(self, key: str, data: bytes) -> bool:
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(BLOCK_HEADER.pack(BLOCK_MAGIC, len(data), block_crc(key, data)))
                f.write(data)
            os.replace(tmp, self._path(key))
        except OSError as e:
            if tmp is not None:
                _unlink(tmp)
            self._warn_write_failed(e)
            return False
        with self._lock:
            self._index.add(key)
        return True

    def delete(self, key: str) -> None:
        with self._lock:
            self._index.discard(key)
            self._misses[key] = time.monotonic()
        _unlink(self._path(key))

    def _warn_write_failed(self, error: OSError) -> None:
        """Once per instance: a full disk fails every later write the same way."""
        if not self._write_failed:
            self._write_failed = True
            logger.warning("hierarchical cache: storage write to %s failed: %s", self.dir, error)

    def exists(self, key: str) -> bool:
        """In the index, or written since by another process (found by a stat of its file,
        at most once per MISS_RECHECK_S per key)."""
        now = time.monotonic()
        with self._lock:
            if key in self._index:
                return True
            if now - self._misses.get(key, -math.inf) < MISS_RECHECK_S:
                return False
        found = os.path.isfile(self._path(key))
        with self._lock:
            if found:
                self._index.add(key)
                self._misses.pop(key, None)
            else:
                if len(self._misses) >= 65536:  # (bounded: the oldest half goes)
                    for k in list(self._misses)[: len(self._misses) // 2]:
                        del self._misses[k]
                self._misses[key] = now
        return found

    def num_blocks(self) -> int:
        """The block files in the directory, every process's (the index holds what this one
        listed at start, wrote or looked up: a --dp-size replica's lacks the others' blocks)."""
        now = time.monotonic()
        if now >= self._count_due:
            try:
                with os.scandir(self.dir) as entries:
                    self._count = sum(e.name.endswith(".kv") for e in entries)
            except OSError:
                pass  # (the directory was removed: the last count stands)
            self._count_due = now + max(BLOCK_COUNT_S, 100 * (time.monotonic() - now))
        return self._count


def _unlink(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def weight_files(path: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of the files a model's weights come from: the file itself (a
    .gguf), or a directory's weights and config.json. Cheap (no content hash of gigabytes);
    replacing the weights changes their mtime."""
    if os.path.isfile(path):
        st = os.stat(path)
        return [(os.path.basename(path), st.st_size, st.st_mtime_ns)]
    if not os.path.isdir(path):
        return []
    out = []
    for name in sorted(os.listdir(path)):
        if name == "config.json" or name.endswith(WEIGHT_SUFFIXES):
            st = os.stat(os.path.join(path, name))
            out.append((name, st.st_size, st.st_mtime_ns))
    return out


def model_identity(server_args: Any, model_path: str) -> dict[str, Any]:
    """What the KV of a token sequence depends on besides the KV layout: the weights (the
    absolute path the model runner loaded, and its files' identity) and how they are run.
    LoRA adapters need nothing here: a request's adapter is in its extra_key, hence in its
    blocks' keys."""
    sa = server_args
    path = os.path.realpath(os.path.expanduser(model_path))
    return {
        "path": path,
        "files": weight_files(path),
        "dtype": sa.dtype,
        "quantization": sa.quantization,
        "dummy_seed": sa.random_seed if sa.load_format == "dummy" else None,
        "context_length": sa.context_length,  # may stretch the rotary table (YaRN)
    }


def storage_namespace(
    identity: dict[str, Any], device_buffers: list[torch.Tensor], block_size: int
) -> str:
    """A directory name that changes with the model's identity (model_identity), the KV layout
    (shapes, dtypes, block size) and the block file format."""
    layout = [(tuple(b.shape[1:]), str(b.dtype)) for b in device_buffers]
    items = sorted(identity.items())
    digest = hashlib.sha256(repr((FILE_FORMAT, items, layout, block_size)).encode()).hexdigest()
    base = os.path.basename(identity["path"].rstrip("/")) or "model"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in base)[:48]
    return f"{safe}-{digest[:16]}"


def check_block_size(block_size: int, context_len: int, pool_tokens: int) -> None:
    """Only whole blocks are stored: a block longer than any request can be (the context
    length, the device KV pool) was accepted, and nothing was ever written to the storage
    tier."""
    if block_size > min(context_len, pool_tokens):
        raise ValueError(
            f"--hicache-storage-block-size {block_size} is longer than any request can be "
            f"(the context length is {context_len} tokens, the device KV pool {pool_tokens}): "
            "no block would ever be stored; lower it"
        )


def create_storage(
    backend: str,
    root: str,
    identity: dict[str, Any],
    device_buffers: list[torch.Tensor],
    block_size: int,
) -> HiCacheStorage:
    if backend == "file":
        return HiCacheFile(root, storage_namespace(identity, device_buffers, block_size))
    raise ValueError(f"unknown hierarchical cache storage backend {backend!r}")
