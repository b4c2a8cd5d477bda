"""Req (one request's scheduling state) and ScheduleBatch (the requests of one step).

Length semantics of a Req (seed 000 §6):
  fill_ids            origin_input_ids + output_ids (cut at the chunk end while chunking)
  prefix_indices      KV slots already present for fill_ids[:len(prefix_indices)]
  kv_committed_len    tokens whose KV is written; kv_allocated_len >= it (invariant 5)
  cache_protected_len leading tokens whose slots the radix tree owns (locked via last_node)

ScheduleBatch owns slot allocation for a step: prepare_for_extend / prepare_for_decode write
the new slots into req_to_token and build the flat tensors that TpModelWorker turns into a
ForwardBatch. filter_batch / merge_batch keep every per-request list aligned (invariant 6).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from radixserve.managers.tokenizer_utils import before_a_cut_character, from_a_character_start
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.radix_cache import RadixKey
from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch
from radixserve.sampling_params import SamplingParams
from radixserve.speculative.spec_info import DraftTree, SpecVerifyInput

# Prompt tokens decoded before a request's output, by the detokenizer and the stop-string match
# (SGLang's 5): a SentencePiece decoder strips the leading space of the text it decodes.
DECODE_CONTEXT = 5

EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)


def finish_stop(matched: int | str | None) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_abort(message: str = "aborted", status_code: int | None = None) -> dict[str, Any]:
    """status_code marks a rejection the client must see as an error (HTTP status)."""
    reason: dict[str, Any] = {"type": "abort", "message": message}
    if status_code is not None:
        reason["status_code"] = status_code
    return reason


class Req:
    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: Sequence[int] = (),
        *,
        origin_input_text: str | None = None,
        stream: bool = False,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        extra_key: str | None = None,
        priority: int | None = None,
        routing_key: str | None = None,
        logprob_start_len: int = -1,
        lora_id: str | None = None,
    ) -> None:
        self.rid = rid
        self.lora_id = lora_id
        self.origin_input_text = origin_input_text
        self.origin_input_ids = list(origin_input_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.stream = stream
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.extra_key = extra_key
        self.priority = priority
        self.routing_key = routing_key
        self.output_ids: list[int] = []
        self.fill_ids: list[int] = []
        self.prefix_indices: torch.Tensor = EMPTY_SLOTS
        self.extend_input_len = 0
        self.last_node: Any = None
        self.req_pool_idx: int | None = None
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.cache_protected_len = 0
        self.chunk_to_cache = False  # an intermediate chunk ran; insert it before the next one
        # Overlap loop: the future slot holding the token sampled by the step in flight, which
        # output_ids does not have yet; the next decode step reads it as input id -slot.
        self.pending_future: int | None = None
        self.finished_reason: dict[str, Any] | None = None
        self.to_abort: str | None = None
        self.admitted = False
        self.log_metrics = True  # False: the server's own request, not in SchedulerStats
        self.open_ended = False  # no max_new_tokens given: it ends at EOS or the context's end
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (first admission)
        self.num_retractions = 0
        self.sent_len = 0  # output tokens already handed to the detokenizer
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        # Prompt logprobs of tokens [logprob_start_len, prompt length); the prompt length (none)
        # unless asked for. The first prompt token has no logprob: (None, token), top None.
        n = len(self.origin_input_ids)
        self.logprob_start_len = n
        if return_logprob and logprob_start_len != -1:
            self.logprob_start_len = logprob_start_len
        self.input_token_logprobs: list[tuple[float | None, int]] = []
        self.input_top_logprobs: list[list[tuple[float, int]] | None] = []
        if self.logprob_start_len == 0 and n:
            self.input_token_logprobs.append((None, self.origin_input_ids[0]))
            self.input_top_logprobs.append(None)
        # The next prompt position whose logprob no step has been given yet.
        self.input_logprob_pos = max(self.logprob_start_len, 1)
        self.input_logprobs_sent = False
        self.arrival_time = time.monotonic()
        self.grammar: Any = None
        self.grammar_deadline = 0.0  # GrammarManager: when its compile has taken too long
        # Speculative decoding: counters and acceptance history (RequestSpecState), the NGRAM
        # index of the request's text, and how many leading positions hold draft-model KV.
        self.spec: Any = None
        self.ngram: Any = None
        self.draft_kv_len = 0
        # P/D disaggregation: the prefill server's bootstrap address and the room that pairs
        # this request across the two servers; on the prefill side the decode server's
        # reservation (where its KV goes), on both the time it may wait for its peer until.
        self.bootstrap_host: str | None = None
        self.bootstrap_port: int | None = None
        self.bootstrap_room: int | None = None
        self.disagg_target: dict[str, Any] | None = None
        self.disagg_deadline = 0.0
        self.disagg_reserved = False  # decode side: its slots were reserved (the peer knows)

    # -- lengths --------------------------------------------------------------------------------
    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def last_token_input(self) -> int:
        """The next decode step's input id: the last output token, or a future reference."""
        return -self.pending_future if self.pending_future is not None else self.output_ids[-1]

    @property
    def max_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens or 0

    def ends_with_pending_token(self) -> bool:
        """The token of the step in flight (overlap) is its last: it reaches max_new_tokens."""
        limit = self.sampling_params.max_new_tokens
        return (
            self.pending_future is not None
            and limit is not None
            and len(self.output_ids) + 1 >= limit
        )

    def schedule_input_logprobs(self, start: int, end: int) -> tuple[int, int]:
        """Of positions [start, end) that a step runs, those [lo, hi) whose hidden state scores
        the next prompt token (empty when none is wanted); they count as scheduled now (the
        overlap loop launches a request's next chunk before the last one's result is in)."""
        lo = self.input_logprob_pos - 1
        hi = min(end, len(self.origin_input_ids) - 1)
        if lo >= hi:
            return start, start
        assert lo >= start, f"{self.rid}: prompt position {lo} ran before its logprob was asked"
        self.input_logprob_pos = hi + 1
        return lo, hi

    def init_next_round_input(self, tree_cache: Any) -> None:
        """Recompute fill_ids and the cached prefix before (re-)admission."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        match = tree_cache.match_prefix(self.prefix_match_key())
        self.prefix_indices = match.device_indices
        self.last_node = match.last_node
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def prefix_match_key(self) -> RadixKey:
        """The part of fill_ids a cached prefix may cover: at least one token must run through
        the model to produce the next logits, and every position whose prompt logprob is
        wanted (a cached token has no logits)."""
        max_prefix = len(self.fill_ids) - 1
        if self.input_logprob_pos < len(self.origin_input_ids):
            max_prefix = min(max_prefix, self.input_logprob_pos - 1)
        return RadixKey(self.fill_ids[:max_prefix], self.extra_key)

    def init_next_chunk(self) -> None:
        """After cache_unfinished_req moved the computed chunk into prefix_indices."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def reset_for_retract(self) -> None:
        self.prefix_indices = EMPTY_SLOTS
        self.last_node = None
        self.req_pool_idx = None
        self.kv_committed_len = self.kv_allocated_len = self.cache_protected_len = 0
        self.chunk_to_cache = False
        self.pending_future = None  # a step in flight for it is dropped (num_retractions)
        self.draft_kv_len = 0
        self.extend_input_len = 0
        self.num_retractions += 1

    # -- finishing ------------------------------------------------------------------------------
    def check_finished(self, tokenizer: Any = None) -> None:
        if self.finished():
            return
        if self.to_abort is not None:
            self.finished_reason = finish_abort(self.to_abort)
            return
        sp = self.sampling_params
        last = self.output_ids[-1]
        if len(self.output_ids) >= sp.min_new_tokens:
            if last in (sp.stop_token_ids or ()):
                self.finished_reason = finish_stop(last)
                return
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.finished_reason = finish_stop(last)
                return
            if sp.stop_strs and tokenizer is not None:
                try:
                    matched = self._match_stop_str(tokenizer)
                except Exception as e:  # fails this request only, never the scheduler
                    self.finished_reason = finish_abort(f"matching stop strings failed: {e!r}")
                    return
                if matched is not None:
                    self.finished_reason = finish_stop(matched)
                    return
        if sp.max_new_tokens is not None and len(self.output_ids) >= sp.max_new_tokens:
            self.finished_reason = finish_length(len(self.output_ids))

    def _match_stop_str(self, tokenizer: Any) -> str | None:
        """The stop string that ends in the text the newest token added, if any (vLLM's
        rule): one written before min_new_tokens was reached does not count later (it ended
        the request at min_new_tokens and the text was cut back before it)."""
        # The tail decoded spans as many tokens as the longest stop string has UTF-8 bytes (a
        # token holds at least one: an emoji can take four of a byte-level vocabulary), plus
        # one for a token that straddles its start.
        max_len = max(
            len(s.encode("utf-8", "surrogatepass")) for s in self.sampling_params.stop_strs
        )
        n = max_len + 1
        ids = self.output_ids[-n:]
        tail = self._decode_tail(tokenizer, ids)
        # A window that starts inside a character: a byte-fallback decoder (Llama 2, Mistral,
        # Gemma) makes the whole byte run U+FFFD, the stop's own characters too; start up to
        # 3 tokens earlier (a UTF-8 character has 4 bytes at most).
        for extra in range(1, 4):
            if not tail.startswith("\ufffd") or len(ids) == len(self.output_ids):
                break
            ids = self.output_ids[-(n + extra) :]
            tail = self._decode_tail(tokenizer, ids)
        # Where the newest token's text starts (it may complete a character before).
        prev, whole = ids[:-1], len(ids) == len(self.output_ids)
        before = self._decode_tail(tokenizer, prev, whole)
        new = len(os.path.commonprefix((tail, before)))
        found = self._stops_from(tail, new)
        # Or after the characters before the one the tokens before it end inside: a
        # byte-fallback decoder read the complete ones in their byte run U+FFFD too ('🙂'
        # before the first byte of 'Ω'), and a stop string they completed before
        # min_new_tokens was taken for new. (Decoded only to drop a stop found.)
        if found and before.endswith("\ufffd"):
            cut = before_a_cut_character(lambda t: self._decode_tail(tokenizer, t, whole), prev)
            if cut is not None:
                new = max(new, len(os.path.commonprefix((tail, cut[1]))))
                found = self._stops_from(tail, new)
        # Of those it completes, the one that starts first in the text (not in the list): the
        # text is cut there.
        return min(found, key=lambda f: f[0])[1] if found else None

    def _stops_from(self, tail: str, new: int) -> list[tuple[int, str]]:
        """(start, stop string) of each stop's first occurrence in `tail` that ends at its
        character `new` or later: one that the text from `new` on completes."""
        found = [
            (tail.find(s, max(0, new - len(s) + 1)), s) for s in self.sampling_params.stop_strs
        ]
        return [(i, s) for i, s in found if i >= 0]

    def _decode_tail(self, tokenizer: Any, ids: list[int], whole: bool | None = None) -> str:
        """The text of `ids`, the output's last tokens; where they are the whole output
        (`whole`), decoded after the prompt's last tokens as the detokenizer decodes them (a
        SentencePiece decoder strips a leading space: a stop string " world" at the start of
        the output was never matched)."""
        if whole is None:
            whole = len(ids) == len(self.output_ids)
        context = self.origin_input_ids[-DECODE_CONTEXT:] if whole else []
        if not context:
            return tokenizer.decode(ids, skip_special_tokens=False)
        head = tokenizer.decode(context, skip_special_tokens=False)
        # (from a character's start, as the detokenizer decodes the output)
        context, head = from_a_character_start(tokenizer, context, head, skip_special_tokens=False)
        text = tokenizer.decode(context + ids, skip_special_tokens=False)
        # (where the prompt ends inside a character, the output's text starts with it whole)
        return text[len(os.path.commonprefix((head, text))) :]

    def __repr__(self) -> str:
        return f"Req(rid={self.rid}, in={len(self.origin_input_ids)}, out={len(self.output_ids)})"


class ScheduleBatch:
    """The requests of one forward step and the memory they hold."""

    def __init__(
        self,
        reqs: list[Req],
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        tree_cache: Any,
        forward_mode: ForwardMode = ForwardMode.DECODE,
    ) -> None:
        self.reqs = reqs
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.forward_mode = forward_mode
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.out_cache_loc: torch.Tensor = EMPTY_SLOTS
        self.prefix_lens: list[int] = []
        self.extend_lens: list[int] = []
        self.seq_lens: list[int] = [r.kv_committed_len for r in reqs]
        self.decoding_reqs: list[Req] = []  # requests mixed into an extend batch
        self.chunked_req: Req | None = None  # the request this step computes a middle chunk of
        self.spec_info: SpecVerifyInput | None = None  # a speculative verify step
        # Prompt logprobs of an extend step (see ModelWorkerBatch).
        self.input_logprob_indices: list[int] = []
        self.input_logprob_targets: list[int] = []
        self.input_logprob_counts: list[int] = []
        self.page_size = allocator.page_size

    def is_empty(self) -> bool:
        return not self.reqs

    def batch_size(self) -> int:
        return len(self.reqs)

    # -- allocation -----------------------------------------------------------------------------
    def _alloc_slots(self, reqs: list[Req], starts: list[int], ends: list[int]) -> torch.Tensor:
        """Give tokens [start, end) of each request a KV slot; write them into req_to_token."""
        need_tokens = self.new_slots_needed(reqs, starts, ends)
        if self.allocator.available_size() < need_tokens:
            self.tree_cache.evict(need_tokens - self.allocator.available_size())
        ps = self.page_size
        if ps == 1:
            slots = self.allocator.alloc(need_tokens)
            if slots is None:
                raise MemoryError("KV pool exhausted after admission control")
            out, pos = [], 0
            for r, s, e in zip(reqs, starts, ends, strict=True):
                part = slots[pos : pos + e - s]
                pos += e - s
                self.req_to_token_pool.write(r.req_pool_idx, s, part)
                out.append(part)
        else:
            pages = self.allocator.alloc_pages(need_tokens // ps)
            if pages is None:
                raise MemoryError("KV pool exhausted after admission control")
            out, page_pos = [], 0
            table = self.req_to_token_pool.req_to_token
            for r, s, e in zip(reqs, starts, ends, strict=True):
                parts = []
                if s % ps:  # continue the partly filled last page
                    last = int(table[r.req_pool_idx, s - 1])
                    n = min(e, (s // ps + 1) * ps) - s
                    parts.append(torch.arange(last + 1, last + 1 + n, dtype=torch.int64))
                n_pages = -(-e // ps) - -(-s // ps)
                new = self.allocator.pages_to_slots(pages[page_pos : page_pos + n_pages])
                page_pos += n_pages
                parts.append(new[: e - s - sum(len(p) for p in parts)])
                part = torch.cat(parts)
                self.req_to_token_pool.write(r.req_pool_idx, s, part)
                out.append(part)
        for r, e in zip(reqs, ends, strict=True):
            r.kv_allocated_len = max(r.kv_allocated_len, e)
        return torch.cat(out) if out else EMPTY_SLOTS

    def new_slots_needed(
        self, reqs: Sequence[Req], starts: Sequence[int], ends: Sequence[int]
    ) -> int:
        ps = self.page_size
        if ps == 1:
            return sum(e - s for s, e in zip(starts, ends, strict=True))
        return sum((-(-e // ps) - -(-s // ps)) * ps for s, e in zip(starts, ends, strict=True))

    # -- extend ---------------------------------------------------------------------------------
    def prepare_for_extend(self) -> None:
        self.forward_mode = ForwardMode.EXTEND
        self.spec_info = None
        reqs = self.reqs
        rows = self.req_to_token_pool.alloc(sum(r.req_pool_idx is None for r in reqs))
        if rows is None:
            raise MemoryError("no free request rows after admission control")
        for r in reqs:
            if r.req_pool_idx is None:
                r.req_pool_idx = rows.pop()
                r.kv_allocated_len = 0
            if len(r.prefix_indices):
                self.req_to_token_pool.write(r.req_pool_idx, 0, r.prefix_indices)
        self.prefix_lens = [len(r.prefix_indices) for r in reqs]
        self.seq_lens = [len(r.fill_ids) for r in reqs]
        self.extend_lens = [s - p for s, p in zip(self.seq_lens, self.prefix_lens, strict=True)]
        self.out_cache_loc = self._alloc_slots(reqs, self.prefix_lens, self.seq_lens)
        self.input_ids, self.positions = [], []
        self.input_logprob_indices, self.input_logprob_targets = [], []
        self.input_logprob_counts = []
        for r, p, s in zip(reqs, self.prefix_lens, self.seq_lens, strict=True):
            lo, hi = r.schedule_input_logprobs(p, s)
            base = len(self.input_ids)
            self.input_logprob_indices.extend(range(base + lo - p, base + hi - p))
            self.input_logprob_targets.extend(r.origin_input_ids[lo + 1 : hi + 1])
            self.input_logprob_counts.append(hi - lo)
            self.input_ids.extend(r.fill_ids[p:s])
            self.positions.extend(range(p, s))
            r.kv_committed_len = s
            r.extend_input_len = s - p

    def mix_with_running(self, running: ScheduleBatch) -> None:
        """Append running decode requests as 1-token extends (ForwardMode.MIXED)."""
        running.prepare_for_decode()
        self.forward_mode = ForwardMode.MIXED
        self.decoding_reqs = list(running.reqs)
        self.reqs = self.reqs + running.reqs
        self.input_ids = self.input_ids + running.input_ids
        self.positions = self.positions + running.positions
        self.prefix_lens = self.prefix_lens + [s - 1 for s in running.seq_lens]
        self.extend_lens = self.extend_lens + [1] * len(running.reqs)
        self.input_logprob_counts = self.input_logprob_counts + [0] * len(running.reqs)
        self.seq_lens = self.seq_lens + running.seq_lens
        self.out_cache_loc = torch.cat([self.out_cache_loc, running.out_cache_loc])

    # -- decode ---------------------------------------------------------------------------------
    def decode_slots_needed(self) -> int:
        seq = [r.kv_committed_len for r in self.reqs]
        return self.new_slots_needed(self.reqs, seq, [s + 1 for s in seq])

    def prepare_for_decode(self) -> None:
        self.forward_mode = ForwardMode.DECODE
        self.spec_info = None
        reqs = self.reqs
        starts = [r.kv_committed_len for r in reqs]
        ends = [s + 1 for s in starts]
        self.out_cache_loc = self._alloc_slots(reqs, starts, ends)
        self.input_ids = [r.last_token_input() for r in reqs]
        self.positions = starts
        self.prefix_lens = starts
        self.extend_lens = [1] * len(reqs)
        self.seq_lens = ends
        for r, e in zip(reqs, ends, strict=True):
            r.kv_committed_len = e

    # -- speculative verify -------------------------------------------------------------------
    def verify_slots_needed(self, trees: Sequence[DraftTree]) -> int:
        seq = [r.kv_committed_len for r in self.reqs]
        return self.new_slots_needed(
            self.reqs, seq, [s + len(t) for s, t in zip(seq, trees, strict=True)]
        )

    def prepare_for_verify(self, trees: list[DraftTree], draft_model: bool = False) -> None:
        """Give every tree node a slot at row positions seq_len .. seq_len + len(tree) − 1.
        Nothing is committed here: the result commits the accepted path and frees the rest
        (kv_allocated_len runs ahead of kv_committed_len until then, invariant 5)."""
        self.forward_mode = ForwardMode.DECODE
        reqs = self.reqs
        starts = [r.kv_committed_len for r in reqs]
        ends = [s + len(t) for s, t in zip(starts, trees, strict=True)]
        self.out_cache_loc = self._alloc_slots(reqs, starts, ends)
        self.input_ids = [tok for t in trees for tok in t.tokens]
        self.positions = [s + d for s, t in zip(starts, trees, strict=True) for d in t.depths]
        self.prefix_lens = starts
        self.extend_lens = [len(t) for t in trees]
        self.seq_lens = ends
        catch_up = []
        if draft_model:  # the tokens whose draft KV is missing, the root included
            for r, s in zip(reqs, starts, strict=True):
                catch_up.append((r.origin_input_ids + r.output_ids)[r.draft_kv_len : s + 1])
        self.spec_info = SpecVerifyInput(trees, starts, catch_up, [r.draft_kv_len for r in reqs])

    # -- membership -----------------------------------------------------------------------------
    def filter_batch(self, keep: Sequence[Req] | None = None) -> None:
        """Keep only unfinished requests (or exactly `keep`); per-request state stays aligned."""
        if keep is None:
            keep = [r for r in self.reqs if not r.finished()]
        self.reqs = list(keep)
        self.seq_lens = [r.kv_committed_len for r in self.reqs]
        self.decoding_reqs = []

    def merge_batch(self, other: ScheduleBatch) -> None:
        self.reqs = self.reqs + [r for r in other.reqs if r not in self.reqs]
        self.seq_lens = [r.kv_committed_len for r in self.reqs]

    # -- retraction -----------------------------------------------------------------------------
    def retract_decode(self, need_tokens_fn) -> list[Req]:
        """Retract requests (fewest outputs first, then longest input) until the rest can decode.

        `need_tokens_fn(batch)` says whether the remaining batch fits. Retracted requests free
        their KV without inserting into the tree and keep their output_ids (they re-prefill).
        At least one request is always kept.
        """
        order = sorted(
            self.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True
        )
        retracted: list[Req] = []
        while len(order) > 1 and not need_tokens_fn(order):
            r = order.pop()
            self.tree_cache.cache_finished_req(r, is_insert=False)
            r.reset_for_retract()
            retracted.append(r)
        self.reqs = [r for r in self.reqs if r not in retracted]
        self.seq_lens = [r.kv_committed_len for r in self.reqs]
        return retracted

    # -- to the worker --------------------------------------------------------------------------
    def get_model_worker_batch(self) -> ModelWorkerBatch:
        """Snapshot this step for the worker (copies the req_to_token rows it reads)."""
        rows = [r.req_pool_idx for r in self.reqs]
        table = self.req_to_token_pool.req_to_token
        # Narrow first: indexing the whole table's rows starts an OpenMP region, which costs
        # milliseconds when the other serving processes hold the cores.
        kv_rows = table[:, : max(self.seq_lens)].index_select(0, torch.tensor(rows))
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=list(self.input_ids),
            positions=list(self.positions),
            req_pool_indices=rows,
            seq_lens=list(self.seq_lens),
            prefix_lens=list(self.prefix_lens),
            extend_lens=list(self.extend_lens),
            out_cache_loc=self.out_cache_loc,
            kv_rows=kv_rows.to(torch.int64),
            return_logprob=any(r.return_logprob for r in self.reqs),
            top_logprobs_num=max((r.top_logprobs_num for r in self.reqs), default=0),
            rids=[r.rid for r in self.reqs],
            spec_info=self.spec_info,
            lora_ids=[r.lora_id for r in self.reqs] if any(r.lora_id for r in self.reqs) else None,
            **self._input_logprob_fields(),
        )

    def _input_logprob_fields(self) -> dict[str, Any]:
        if not self.forward_mode.is_extend() or not self.input_logprob_indices:
            return {}
        assert len(self.input_logprob_counts) == len(self.reqs)
        return {
            "input_logprob_indices": list(self.input_logprob_indices),
            "input_logprob_targets": list(self.input_logprob_targets),
            "input_logprob_counts": list(self.input_logprob_counts),
        }

    def get_forward_batch(self, device: str) -> ForwardBatch:
        return self.get_model_worker_batch().to_forward_batch(device)
