"""How a prompt's KV moves from the prefill server's pool into the decode server's pool.

Both sides describe their pool, vocabulary and backend (`KVLayout`); the decode side hands the
prefill side a `descriptor()` of where its pool lives and which slots it reserved; the prefill
side's `send` writes its slots' K and V there, one layer buffer at a time, contiguous runs of
slots coalesced into one copy each. Two backends:

* `mooncake`: Mooncake's transfer engine (the one SGLang uses) in P2P-handshake mode over
  TCP: every layer buffer is registered once; the prefill side writes straight into the
  decode side's memory (`batch_transfer_sync_write`), no metadata server needed.
* `fake`: no transfer engine; `send` gathers the slots' K and V into one tensor that rides on
  the control channel's "done" message, and the decode side's `receive` scatters it into its
  slots. Same protocol and bookkeeping, for machines where Mooncake does not install.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import asdict, dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)
MOONCAKE_BATCH = 512  # copies per batch_transfer_sync_write
HOST_IP_ENV = "RADIXSERVE_HOST_IP"  # the address to advertise when bound to 0.0.0.0 or ::


class TransferError(RuntimeError):
    """The KV of a request could not be moved; the request fails on both sides."""


@dataclass(frozen=True)
class KVLayout:
    """What the two sides must share. The model too (two of the same shapes paired); the
    vocabulary: a first token the decode model has no embedding for crashed its scheduler; and
    the backend: a `fake` prefill side sent the KV
    in `done` to a Mooncake decode side that ignores it there (its pool stayed unwritten)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    vocab_size: int
    transfer_backend: str
    model: str  # (side.model_fingerprint)

    @classmethod
    def of(
        cls, kv_pool: Any, page_size: int, vocab_size: int, backend: str, model: str
    ) -> KVLayout:
        k = kv_pool.k_buffer[0]
        shape = (kv_pool.num_layers, k.shape[1], k.shape[2], str(k.dtype))
        return cls(*shape, page_size, vocab_size, backend, model)

    def mismatch(self, other: dict[str, Any]) -> str | None:
        """Why a decode server's layout (`other`) cannot pair with this prefill server's."""
        mine = asdict(self)
        backend = mine.pop("transfer_backend")
        if other.get("transfer_backend") != backend:
            return (
                f"the transfer backends differ: decode {other.get('transfer_backend')} vs "
                f"prefill {backend}; start both with the same --disaggregation-transfer-backend"
            )
        model = mine.pop("model")
        if other.get("model") != model:
            return (
                f"the prefill and decode servers run different models (fingerprint decode "
                f"{other.get('model')} vs prefill {model}: their config or weight files, or "
                "--quantization); serve the same model files on both"
            )
        diffs = [f"{k} {other.get(k)!r} vs {v!r}" for k, v in mine.items() if other.get(k) != v]
        if not diffs:
            return None
        return (
            "the prefill and decode servers' models or KV pools differ (decode vs prefill: "
            + ", ".join(diffs)
            + "); serve the same model with the same dtype and page size on both"
        )


def contiguous_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) runs where both slot lists advance by one together."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            start_s, start_d, n = runs[-1]
            runs[-1] = (start_s, start_d, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


def _buffers(kv_pool: Any) -> list[torch.Tensor]:
    return [*kv_pool.k_buffer, *kv_pool.v_buffer]


class FakeTransfer:
    """The KV rides on the control channel (see the module docstring)."""

    name = "fake"
    remote_writes = False  # the decode side writes what it receives itself

    def __init__(self, kv_pool: Any, host: str) -> None:
        self.kv_pool = kv_pool

    def descriptor(self) -> dict[str, Any]:
        return {}

    def send(self, peer: dict[str, Any], src: list[int], dst: list[int]) -> Any:
        index = torch.tensor(src, dtype=torch.int64, device=self.kv_pool.device)
        # As bytes: torch cannot unpickle an fp8 tensor (--kv-cache-dtype fp8_*).
        return torch.stack([buf[index] for buf in _buffers(self.kv_pool)]).cpu().view(torch.uint8)

    def receive(self, payload: Any, dst: list[int]) -> None:
        buffers = _buffers(self.kv_pool)
        if not isinstance(payload, torch.Tensor) or payload.shape[:2] != (len(buffers), len(dst)):
            raise TransferError("the KV payload does not match the reserved slots")
        index = torch.tensor(dst, dtype=torch.int64, device=self.kv_pool.device)
        for buf, part in zip(buffers, payload, strict=True):
            if part.dtype != torch.uint8 or part.shape[1:-1] != buf.shape[1:-1]:
                raise TransferError("the KV payload does not match the pool's layout")
            buf[index] = part.view(buf.dtype).to(buf.device)

    def close(self) -> None:
        pass


class MooncakeTransfer:
    """Mooncake's transfer engine over TCP (P2P handshake: peers are named host:rpc_port)."""

    name = "mooncake"
    remote_writes = True  # the prefill side writes into the decode side's memory

    def __init__(self, kv_pool: Any, host: str) -> None:
        os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's glog: errors only
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise RuntimeError(
                "--disaggregation-transfer-backend mooncake needs Mooncake's transfer engine: "
                "pip install mooncake-transfer-engine-non-cuda (CPU; it needs Debian's "
                "libibverbs1: `make mooncake`), or mooncake-transfer-engine on CUDA; or use "
                f"--disaggregation-transfer-backend fake ({e})"
            ) from None
        self.kv_pool = kv_pool
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"Mooncake's transfer engine failed to start on {host}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.buffers = _buffers(kv_pool)
        addrs = [b.data_ptr() for b in self.buffers]
        sizes = [b.numel() * b.element_size() for b in self.buffers]
        if self.engine.batch_register_memory(addrs, sizes) != 0:
            raise RuntimeError("Mooncake could not register the KV pool's buffers")
        self.token_bytes = self.buffers[0][0].numel() * self.buffers[0].element_size()
        logger.info(
            "Mooncake transfer engine at %s (%d KV buffers registered)", self.session, len(addrs)
        )

    def descriptor(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "addrs": [b.data_ptr() for b in self.buffers],
            "token_bytes": self.token_bytes,
        }

    def send(self, peer: dict[str, Any], src: list[int], dst: list[int]) -> None:
        if peer.get("token_bytes") != self.token_bytes or len(peer.get("addrs", ())) != len(
            self.buffers
        ):
            raise TransferError("the decode server's KV buffers do not match this server's")
        tb = self.token_bytes
        runs = contiguous_runs(src, dst)
        local, remote, lengths = [], [], []
        for buf, peer_addr in zip(self.buffers, peer["addrs"], strict=True):
            base = buf.data_ptr()
            for s, d, n in runs:
                local.append(base + s * tb)
                remote.append(peer_addr + d * tb)
                lengths.append(n * tb)
        # One batch per MOONCAKE_BATCH copies: its TCP transport refuses a batch of more than
        # about 2,100 (a fragmented pool: KV buffers x runs), and the pair could stay broken.
        for i in range(0, len(local), MOONCAKE_BATCH):
            batch = slice(i, i + MOONCAKE_BATCH)
            ret = self.engine.batch_transfer_sync_write(
                peer["session"], local[batch], remote[batch], lengths[batch]
            )
            if ret != 0:
                raise TransferError(f"Mooncake's write to {peer['session']} failed (status {ret})")

    def receive(self, payload: Any, dst: list[int]) -> None:
        """The bytes are already in place: the prefill side wrote them into this pool."""

    def close(self) -> None:
        try:
            self.engine.batch_unregister_memory([b.data_ptr() for b in self.buffers])
        except Exception:  # best effort at shutdown
            pass


def transfer_host(host: str) -> str:
    """The address peers reach this server at. A wildcard bind is not an address: then
    $RADIXSERVE_HOST_IP, else the address of the interface that routes off this machine, else
    what the host name resolves to (alone, that was often a loopback address, 127.0.1.1 on
    Debian, 127.0.0.1 in containers: a peer on another machine was sent to its own)."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    if os.environ.get(HOST_IP_ENV):
        return os.environ[HOST_IP_ENV]
    address = _routed_address() or socket.gethostbyname(socket.gethostname())
    if ipaddress.ip_address(address).is_loopback:
        logger.warning(
            "peers on other machines cannot reach this server at %s: set %s to its address",
            address,
            HOST_IP_ENV,
        )
    return address


def _routed_address() -> str | None:
    """The local address of the route to a public one (a UDP connect sends no packet)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("8.8.8.8", 80))
        except OSError:  # no route off this machine
            return None
        address = s.getsockname()[0]
    return None if address == "0.0.0.0" else address


def create_transfer(name: str, kv_pool: Any, host: str) -> FakeTransfer | MooncakeTransfer:
    """`host`: the address peers reach this server at (transfer_host)."""
    cls = {"fake": FakeTransfer, "mooncake": MooncakeTransfer}[name]
    return cls(kv_pool, host)
