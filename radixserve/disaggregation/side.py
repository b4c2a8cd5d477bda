"""What both sides of a P/D pair hold: the scheduler, the layout the peer must match (pool,
vocabulary, model, backend), the KV transfer backend, the control channel (bound on `port`;
0: a free one) and the counters."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from radixserve.disaggregation.channel import ControlChannel
from radixserve.disaggregation.transfer import KVLayout, create_transfer, transfer_host


class DisaggSide:
    ANSWERS_PINGS = False

    def __init__(self, scheduler: Any, port: int) -> None:
        self.s = scheduler
        args = scheduler.server_args
        kv_pool = scheduler.tp_worker.model_runner.token_to_kv_pool
        self.timeout = args.disaggregation_timeout
        backend = args.disaggregation_transfer_backend
        vocab_size = scheduler.model_config.vocab_size
        model = model_fingerprint(args, scheduler.tp_worker.model_runner.model_path)
        self.layout = KVLayout.of(kv_pool, scheduler.page_size, vocab_size, backend, model)
        host = transfer_host(args.host)
        self.transfer = create_transfer(backend, kv_pool, host)
        # (the prefill side answers pings on a thread of its own, never late: see channel)
        self.channel = ControlChannel(args.host, port, host, answer_pings=self.ANSWERS_PINGS)
        self.num_transferred = 0
        self.num_failed = 0

    def holds_reservations(self) -> bool:
        """Slots are held for requests that will run here later (decode: KV on its way)."""
        return False

    def close(self) -> None:
        self.channel.close()
        self.transfer.close()


def model_fingerprint(server_args: Any, model_path: str) -> str:
    """The weights a side runs, as both compare them: its config and weight files (sizes and a
    digest of each one's ends, as TP ranks compare theirs; a single file's name aside, which
    may differ between machines), --quantization, and the seed of dummy weights. Servers of
    two models of the same shapes paired, and the decode side continued the prefill side's KV
    under other weights: a 200 with tokens neither gives."""
    from radixserve.distributed.tp_sync import model_files_digest
    from radixserve.mem_cache.hicache_storage import WEIGHT_SUFFIXES

    single = os.path.isfile(model_path)
    files = [
        ("" if single else name, size, digest)
        for name, size, digest in model_files_digest(model_path)
        if name == "config.json" or name.endswith(WEIGHT_SUFFIXES)
    ]
    sa = server_args
    seed = sa.random_seed if sa.load_format == "dummy" else None
    data = repr((files, sa.quantization, seed)).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def adapter_of(req: Any) -> str | None:
    """The LoRA adapter a request is served with, as both sides compare it: the adapter part
    of its cache namespace ("lora:<name>:<hash of its files>"); None for the base model. Two
    servers with different adapters (or files) under one name paired, and the decode side
    continued the prefill side's KV under other weights."""
    key = req.extra_key
    return None if key is None or not key.startswith("lora:") else key.split("|", 1)[0]


def prompt_fingerprint(input_ids: list[int]) -> str:
    """What both sides compare before a transfer: two requests that share a bootstrap room
    (a client reusing rooms) paired with each other and swapped their outputs."""
    data = b"".join(t.to_bytes(4, "little", signed=True) for t in input_ids)
    return hashlib.blake2b(data, digest_size=16).hexdigest()
