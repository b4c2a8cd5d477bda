"""The two-level KV page table: ReqToTokenPool → TokenToKVPoolAllocator → MHATokenToKVPool.

* ReqToTokenPool: int32 table [size + 1, max_context_len]; row r, column i holds the KV slot of
  token i of the request that owns row r. Row 0 is reserved (padding rows point at it).
* TokenToKVPoolAllocator: free list over slots 1..size (slot 0 takes padding writes).
  Page-aware when page_size > 1: allocation hands out whole pages, freeing returns pages whose
  slots are all free again.
* MHATokenToKVPool: per-layer K and V tensors [size + 1, num_kv_heads, head_dim], in the
  model's dtype or, with --kv-cache-dtype fp8_e5m2 / fp8_e4m3, one byte per element (no scales).

Owned by the Scheduler (through TpModelWorker/ModelRunner); the RadixCache frees into the
allocator. Nothing here needs a model or a GPU.
"""

from __future__ import annotations

import torch

# The fp8 KV dtypes (--kv-cache-dtype fp8_e5m2 / fp8_e4m3) and their largest finite values.
FP8_MAX = {torch.float8_e5m2: 57344.0, torch.float8_e4m3fn: 448.0}


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in a KV pool's dtype. An fp8 pool saturates at its largest finite value: a plain cast
    makes e5m2's inf past it (torch's e4m3fn cast saturates on CPU; this does not rely on it),
    and one infinite key makes its rows' softmax NaN."""
    limit = FP8_MAX.get(dtype)
    if limit is not None and x.dtype != dtype:
        x = x.clamp(-limit, limit)
    return x.to(dtype)


class ReqToTokenPool:
    """Maps request rows to the KV slots of their tokens."""

    def __init__(self, size: int, max_context_len: int, device: str = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros(
            (size + 1, max_context_len), dtype=torch.int32, device=device
        )
        self.free_slots: list[int] = list(range(1, size + 1))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int = 1) -> list[int] | None:
        if need_size > len(self.free_slots):
            return None
        rows, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return rows

    def free(self, row: int | list[int]) -> None:
        rows = [row] if isinstance(row, int) else list(row)
        for r in rows:
            assert 1 <= r <= self.size, f"bad request row {r}"
        self.free_slots.extend(rows)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start : start + len(slots)] = slots.to(torch.int32)

    def clear(self) -> None:
        self.free_slots = list(range(1, self.size + 1))

    def check_integrity(self) -> None:
        assert len(set(self.free_slots)) == len(self.free_slots), "a request row is freed twice"
        assert all(1 <= r <= self.size for r in self.free_slots), "row 0 leaked into free rows"


class TokenToKVPoolAllocator:
    """Free list of KV slots. `size` usable slots numbered 1..size; slot 0 is never handed out."""

    def __init__(self, size: int, page_size: int = 1, device: str = "cpu") -> None:
        assert size % page_size == 0, "pool size must be a multiple of page_size"
        self.size = size
        self.page_size = page_size
        self.device = device
        self.clear()

    def clear(self) -> None:
        # Pages are numbered 1..num_pages; page p owns slots [p*ps, p*ps + ps). With page_size 1 a
        # page is a slot. Slot 0..ps-1 (page 0) is reserved for padding writes.
        self.num_pages = self.size // self.page_size
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self._release: list[torch.Tensor] = []

    def available_size(self) -> int:
        self._merge_released()
        return len(self.free_pages) * self.page_size

    def _merge_released(self) -> None:
        if self._release:
            self.free_pages = torch.cat([self.free_pages, *self._release])
            self._release = []

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Allocate need_size slots (whole pages when page_size > 1); None if the pool is short."""
        if self.page_size == 1:
            self._merge_released()
            if need_size > len(self.free_pages):
                return None
            out, self.free_pages = self.free_pages[:need_size], self.free_pages[need_size:]
            return out
        assert need_size % self.page_size == 0, "paged alloc must be page-aligned"
        pages = self.alloc_pages(need_size // self.page_size)
        if pages is None:
            return None
        return self.pages_to_slots(pages)

    def alloc_pages(self, num_pages: int) -> torch.Tensor | None:
        self._merge_released()
        if num_pages > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:num_pages], self.free_pages[num_pages:]
        return out

    def pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    def free(self, indices: torch.Tensor) -> None:
        """Return slots to the pool. With pages, a page is returned when its first slot is freed;
        callers free whole pages (the radix cache and Req bookkeeping keep page alignment)."""
        if indices.numel() == 0:
            return
        indices = indices.to(torch.int64).cpu()
        if self.page_size == 1:
            self._release.append(indices.clone())
        else:
            self._release.append(torch.unique(indices // self.page_size))

    def check_integrity(self) -> None:
        self._merge_released()
        pages = self.free_pages
        assert len(torch.unique(pages)) == len(pages), "a KV slot/page is freed twice"
        if len(pages):
            assert int(pages.min()) >= 1 and int(pages.max()) <= self.num_pages, "bad page id"


class MHATokenToKVPool:
    """Per-layer K and V buffers indexed by slot."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str = "cpu",
        page_size: int = 1,
    ) -> None:
        self.size = size
        self.dtype = dtype
        self.device = device
        self.num_layers = num_layers
        rows = size + page_size  # slot ids up to size + page_size - 1 when page 0 is reserved
        shape = (rows, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        self.k_buffer[layer_id][loc] = to_kv_dtype(k, self.dtype)
        self.v_buffer[layer_id][loc] = to_kv_dtype(v, self.dtype)

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots `src` into slots `dst`, every layer (speculative decoding
        moves an accepted tree path onto its request's position-ordered slots)."""
        src, dst = src.to(self.device), dst.to(self.device)
        for buf in (*self.k_buffer, *self.v_buffer):
            buf[dst] = buf[src]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )
