"""The scheduler's side of tensor parallelism: every rank runs the same schedule.

Rank 0 alone receives requests from the TokenizerManager; `broadcast_requests` hands each loop
iteration's messages to every rank (SGLang's broadcast of recv_reqs, on the gloo cpu group), so
every rank's Scheduler sees the same inputs in the same order and — holding its own radix tree,
pools and waiting queue — makes the same decisions. Sampled tokens agree because the worker
broadcasts rank 0's (TpModelWorker.sample). Only rank 0 sends outputs to the detokenizer.

The same decisions need the same inputs beyond the requests: `check_ranks_agree` refuses, at
start, ranks that run other flags or model files than rank 0; what each rank does on its own
is agreed before it counts — an adapter load (`agree`: served only where every rank loaded it)
and a grammar compile (`agree_statuses`: admitted once every rank's is done).

With --enable-integrity-checks, `check_schedule` compares a digest of each step's schedule
(forward mode, rids, sequence and prefix lengths, allocated slots, free and evictable slot
counts) across ranks and fails loudly on the first step where they differ (invariant 10).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

from radixserve.distributed.parallel_state import TpGroup

INT63 = (1 << 63) - 1


# ServerArgs that may differ between the nodes of one TP group: where each finds its files,
# what only node 0 uses (HTTP, logging, parsers), local resources, and the KV pool (its size is
# agreed at start, the smallest of the ranks').
NODE_LOCAL_ARGS = frozenset(
    (
        "model_path",
        "tokenizer_path",
        "speculative_draft_model_path",
        "chat_template",
        "sampling_defaults",
        "served_model_name",
        "tool_call_parser",
        "reasoning_parser",
        "hicache_storage_dir",
        "node_rank",
        "dist_init_addr",
        "host",
        "port",
        "api_key",
        "disable_dashboard",
        "enable_metrics",
        "log_level",
        "num_threads",
        "watchdog_timeout",
        "mem_fraction_static",
        "max_total_tokens",
    )
)
# Files of a model whose contents must agree across ranks; each is read only at its two ends
# (a different fine-tune of the same shapes differs there, and gigabytes are never hashed).
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".gguf", ".model", ".tiktoken", ".txt")
SAMPLE_BYTES = 1 << 20


def rank_fingerprint(server_args: Any, model_path: str) -> dict[str, Any]:
    """What every TP rank must run alike: its flags (but NODE_LOCAL_ARGS; LoRA adapters by
    name) and its model files (names, sizes, and a digest of each one's ends)."""
    from radixserve.lora.adapter import parse_lora_paths

    args = {k: v for k, v in dataclasses.asdict(server_args).items() if k not in NODE_LOCAL_ARGS}
    args["lora_paths"] = sorted(parse_lora_paths(server_args.lora_paths or ()))
    return {"args": args, "model": model_files_digest(model_path)}


def model_files_digest(path: str) -> list[tuple[str, int, str]]:
    if os.path.isfile(path):
        files = [(os.path.basename(path), path)]
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(MODEL_FILE_SUFFIXES))
        files = [(n, os.path.join(path, n)) for n in names]
    out = []
    for name, file in files:
        size = os.path.getsize(file)
        h = hashlib.sha256()
        with open(file, "rb") as f:
            h.update(f.read(SAMPLE_BYTES))
            if size > SAMPLE_BYTES:
                f.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
                h.update(f.read())
        out.append((name, size, h.hexdigest()))
    return out


def check_ranks_agree(group: TpGroup, server_args: Any, model_path: str) -> None:
    """Refuse to start a TP group whose ranks run different models or flags (a node started
    with other weights served garbage; other flags failed in a collective with a bare gloo
    error). Every rank raises the same ValueError, naming what differs."""
    everyone = group.all_gather_object(rank_fingerprint(server_args, model_path))
    first = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        keys = sorted(set(first["args"]) | set(theirs["args"]))
        diffs = [
            f"--{k.replace('_', '-')} {theirs['args'].get(k)!r} (rank 0: {first['args'].get(k)!r})"
            for k in keys
            if theirs["args"].get(k) != first["args"].get(k)
        ]
        if theirs["model"] != first["model"]:
            mine = {name: (size, digest) for name, size, digest in first["model"]}
            other = {name: (size, digest) for name, size, digest in theirs["model"]}
            differ = sorted(n for n in set(mine) | set(other) if mine.get(n) != other.get(n))
            diffs.append(f"model files differ from rank 0's: {', '.join(differ)}")
        if diffs:
            raise ValueError(
                f"TP rank {rank} does not run what rank 0 runs: {'; '.join(diffs)}. Every node "
                "needs the same model files and the same flags"
            )


class ScheduleDivergedError(RuntimeError):
    """The TP ranks scheduled different steps: their outputs can no longer be trusted."""


class TpSync:
    def __init__(self, group: TpGroup) -> None:
        self.group = group
        self.step_no = 0

    def broadcast_requests(self, msgs: list[Any] | None) -> list[Any]:
        """Rank 0's messages of this iteration on every rank (others pass None)."""
        return self.group.broadcast_object(msgs)

    def agree(self, error: str | None) -> str | None:
        """The ranks' verdict on something each did alone (e.g. loading an adapter): None when
        every rank succeeded, else every failed rank's message, the same on all ranks."""
        errors = self.group.all_gather_object(error)
        failed = [f"TP rank {rank}: {e}" for rank, e in enumerate(errors) if e is not None]
        return "; ".join(failed) or None

    def agree_statuses(self, mine: list[int]) -> list[int]:
        """The grammar queue's statuses the ranks agree on (GrammarManager.statuses; every
        rank queues the same requests): READY where every rank's compile is done, EXPIRED
        where any rank's deadline passed first, else PENDING. Nobody waits for a compile."""
        from radixserve.managers.grammar_manager import EXPIRED, PENDING, READY

        if not mine:
            return []
        columns = zip(*self.group.all_gather_ints(mine), strict=True)
        return [
            READY if all(s == READY for s in c) else EXPIRED if EXPIRED in c else PENDING
            for c in columns
        ]

    def check_schedule(self, batch: Any, allocator: Any, tree_cache: Any) -> None:
        self.step_no += 1
        mine = schedule_digest(batch, allocator.available_size(), tree_cache.evictable_size())
        everyone = self.group.all_gather_ints(mine)
        if any(row != everyone[0] for row in everyone):
            table = "; ".join(
                f"rank {r}: digest {d[0]:x}, {d[1]} reqs, {d[2]} free, {d[3]} evictable"
                for r, d in enumerate(everyone)
            )
            raise ScheduleDivergedError(
                f"TP ranks scheduled different steps at step {self.step_no} ({table}); "
                "every rank must make the same scheduling decisions"
            )


def schedule_digest(batch: Any, available: int, evictable: int) -> list[int]:
    """[hash, number of requests, free slots, evictable slots] of one step's schedule."""
    h = hashlib.blake2b(digest_size=8)
    if batch is not None:
        h.update(str(batch.forward_mode).encode())
        h.update(repr([r.rid for r in batch.reqs]).encode())
        h.update(repr(list(batch.seq_lens)).encode())
        h.update(repr(list(batch.prefix_lens)).encode())
        h.update(batch.out_cache_loc.cpu().numpy().tobytes())
    n = len(batch.reqs) if batch is not None else 0
    return [int.from_bytes(h.digest(), "little") & INT63, n, available, evictable]
