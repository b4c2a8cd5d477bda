"""Result processing: append sampled tokens, finish requests, free their memory, stream deltas.

Mixed into Scheduler. Intermediate prefill chunks emit nothing (invariant 11). A request that
finishes gives its KV to the tree (cache_finished_req); one still running after its prefill has
its prompt inserted at once (cache_unfinished_req) so later requests can share it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.io_struct import BatchTokenIDOutput
from radixserve.managers.schedule_batch import Req, ScheduleBatch, finish_abort

if TYPE_CHECKING:
    from radixserve.managers.tp_worker import GenerationBatchResult


class SchedulerOutputMixin:
    tree_cache: Any
    tokenizer: Any
    stats: Any
    chunked_req: Req | None
    send_output: Any
    server_args: Any
    grammar_manager: Any

    def process_batch_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        if batch.forward_mode.is_decode():
            self.stats.num_decode_batches += 1
        decoding = {id(r) for r in batch.decoding_reqs}
        to_stream: list[Req] = []
        for i, req in enumerate(batch.reqs):
            if req.is_chunked > 0:  # an intermediate chunk: no token, nothing streamed
                req.is_chunked -= 1
                if req.to_abort is not None:
                    self._abort_chunked(req)
                    to_stream.append(req)
                else:  # share the computed chunk at once (and move the lock onto it)
                    self.tree_cache.cache_unfinished_req(req)
                continue
            if req.finished():  # aborted while in flight
                continue
            req.output_ids.append(result.next_token_ids[i])
            self.stats.generation_tokens += 1
            if req.return_logprob and result.logprobs is not None:
                req.output_token_logprobs.append((result.logprobs[i], result.next_token_ids[i]))
                if result.top_logprobs is not None and req.top_logprobs_num:
                    req.output_top_logprobs.append(result.top_logprobs[i][: req.top_logprobs_num])
            if req.grammar is not None:
                self.grammar_manager.accept(req, result.next_token_ids[i])
            req.check_finished(self.tokenizer)
            if req.finished():
                self.tree_cache.cache_finished_req(req)
                self.stats.num_finished += 1
                if req.finished_reason and req.finished_reason["type"] == "abort":
                    self.stats.num_aborted += 1
            elif batch.forward_mode.is_extend() and id(req) not in decoding:
                self.tree_cache.cache_unfinished_req(req)
            to_stream.append(req)
        self.stream_output(to_stream)

    def _abort_chunked(self, req: Req) -> None:
        req.finished_reason = finish_abort(req.to_abort or "aborted")
        self.tree_cache.cache_finished_req(req, is_insert=False)
        self.stats.num_aborted += 1
        if self.chunked_req is req:
            self.chunked_req = None

    def stream_output(self, reqs: list[Req]) -> None:
        """Send each request's new tokens (streaming requests every `stream_interval` tokens,
        the others once they finish)."""
        interval = self.server_args.stream_interval
        out = BatchTokenIDOutput([], [], [], [], [], [], [], [], [], [])
        for req in reqs:
            if not req.finished():
                if not req.stream:
                    continue
                if (len(req.output_ids) - req.sent_len) < interval and req.sent_len > 0:
                    continue
            self._append_output(out, req)
        if out.rids:
            self.send_output(out)

    def _append_output(self, out: BatchTokenIDOutput, req: Req) -> None:
        sp = req.sampling_params
        start = req.sent_len
        req.sent_len = len(req.output_ids)
        out.rids.append(req.rid)
        out.finished_reasons.append(req.finished_reason)
        out.output_ids.append(req.output_ids[start:])
        out.skip_special_tokens.append(sp.skip_special_tokens)
        out.spaces_between_special_tokens.append(sp.spaces_between_special_tokens)
        out.no_stop_trim.append(sp.no_stop_trim)
        out.stop_strs.append(sp.stop_strs)
        out.prompt_tokens.append(len(req.origin_input_ids))
        out.completion_tokens.append(len(req.output_ids))
        out.cached_tokens.append(req.cached_tokens)
        if req.return_logprob:
            out.output_token_logprobs.append(req.output_token_logprobs[start:])
            out.output_top_logprobs.append(req.output_top_logprobs[start:])
        else:
            out.output_token_logprobs.append(None)
            out.output_top_logprobs.append(None)
