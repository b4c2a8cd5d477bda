"""The host tier of the hierarchical cache: KV buffers in host memory and their slot allocator.

HostKVPool mirrors the device KV pool's layout (one host buffer per device buffer: every
layer's K and V) with its own slot numbering, so a page of KV can be copied device → host
(a backup), host → device (a load-back) and host ↔ bytes (the storage tier). On CUDA the host
buffers are pinned so the copies run asynchronously on the cache controller's stream; on CPU
"device" and "host" are both host memory, but they stay separate tiers with real copies.

Owned by HiRadixCache; the copies themselves are issued by HiCacheController.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.mem_cache.memory_pool import TokenToKVPoolAllocator


def buffer_bytes_per_token(buffers: list[torch.Tensor]) -> int:
    """Bytes one token's KV takes over all buffers (every layer's K and V)."""
    return sum(b[0].numel() * b.element_size() for b in buffers)


class HostKVPool:
    """Host buffers shaped like the device buffers, with slots 1..size (page 0 is reserved)."""

    def __init__(self, device_buffers: list[torch.Tensor], size: int, page_size: int = 1) -> None:
        assert size > 0 and size % page_size == 0, "host pool size must be whole pages"
        self.size = size
        self.page_size = page_size
        self.device_buffers = device_buffers
        pin = any(b.is_cuda for b in device_buffers) and torch.cuda.is_available()
        rows = size + page_size
        self.buffers = [
            torch.zeros((rows, *b.shape[1:]), dtype=b.dtype, device="cpu", pin_memory=pin)
            for b in device_buffers
        ]
        self.allocator = TokenToKVPoolAllocator(size, page_size, "cpu")
        self.row_bytes = [b[0].numel() * b.element_size() for b in self.buffers]

    # ---- slots -------------------------------------------------------------------------------

    def alloc(self, n: int) -> torch.Tensor | None:
        return self.allocator.alloc(n)

    def free(self, indices: torch.Tensor) -> None:
        self.allocator.free(indices)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def clear(self) -> None:
        self.allocator.clear()

    # ---- copies (run on the cache controller's threads) ----------------------------------------

    def backup_from_device(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """host[host_indices] = device[device_indices], every buffer."""
        for host, dev in zip(self.buffers, self.device_buffers, strict=True):
            idx = device_indices.to(dev.device, non_blocking=True)
            # Blocking (on the copy thread): a non-blocking device-to-host copy returns before
            # its data is there, and the index-assign read it at once (garbage on a GPU).
            host[host_indices] = dev.index_select(0, idx).to("cpu")

    def load_to_device(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        """device[device_indices] = host[host_indices], every buffer."""
        for host, dev in zip(self.buffers, self.device_buffers, strict=True):
            idx = device_indices.to(dev.device, non_blocking=True)
            dev[idx] = host[host_indices].to(dev.device, non_blocking=True)

    def read_device_bytes(self, device_indices: torch.Tensor) -> bytes:
        """The KV of device slots, serialized buffer by buffer (a storage block)."""
        parts = []
        for dev in self.device_buffers:
            rows = dev.index_select(0, device_indices.to(dev.device)).to("cpu").contiguous()
            parts.append(rows.reshape(-1).view(torch.uint8))
        return torch.cat(parts).numpy().tobytes()

    def write_host_bytes(self, host_indices: torch.Tensor, data: bytes) -> bool:
        """Fill host slots from bytes made by read_device_bytes; False if the size is wrong,
        leaving the slots untouched. The storage backend has verified the bytes (length and
        checksum: HiCacheFile.get), so a wrong size means another layout's block."""
        n = len(host_indices)
        if len(data) != n * sum(self.row_bytes):
            return False
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        pos = 0
        for host, row in zip(self.buffers, self.row_bytes, strict=True):
            chunk = flat[pos : pos + n * row]
            host[host_indices] = chunk.view(host.dtype).reshape(n, *host.shape[1:])
            pos += n * row
        return True

    def check_integrity(self) -> None:
        self.allocator.check_integrity()


def device_kv_buffers(kv_pool: Any) -> list[torch.Tensor]:
    """The device pool's per-slot buffers (every layer's K, then every layer's V)."""
    return [*kv_pool.k_buffer, *kv_pool.v_buffer]


def host_pool_tokens(
    device_tokens: int,
    bytes_per_token: int,
    ratio: float,
    size_gb: float,
    page_size: int,
    replicas: int = 1,
) -> int:
    """--hicache-size GB when > 0, else --hicache-ratio × the device pool; whole pages, at
    least the device pool (every device node may need its host copy), and within the host's
    available memory (as SGLang checks: an absurd value failed as a raw allocation error, or
    a size past the RAM was zero-filled until the OOM killer came), with the tiers of the
    other `replicas` (--dp-size) starting beside it (each checked the whole memory alone)."""
    if size_gb > 0:
        n = int(size_gb * 2**30) // bytes_per_token
        flag = f"--hicache-size {size_gb:g}"
    else:
        n = int(min(device_tokens * ratio, 2**62))
        flag = f"--hicache-ratio {ratio:g}"
    n = n // page_size * page_size
    if n < device_tokens:
        raise ValueError(
            f"the hierarchical cache's host tier ({n} tokens) must hold at least the device KV "
            f"pool ({device_tokens} tokens): raise --hicache-ratio (>= 1) or --hicache-size"
        )
    available = available_host_bytes()
    if available is not None and n * bytes_per_token * replicas > available:
        tiers = f" (× {replicas} replicas of --dp-size)" if replicas > 1 else ""
        raise ValueError(
            f"{flag} asks for a {n * bytes_per_token / 2**30:.1f} GiB host tier{tiers}; this "
            f"machine has {available / 2**30:.1f} GiB available: lower it"
        )
    return n


def available_host_bytes() -> int | None:
    """Memory the host can still give (MemAvailable), or None where it is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
