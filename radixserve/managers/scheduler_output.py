"""Result processing: append sampled tokens, finish requests, free their memory, stream deltas.

Mixed into Scheduler. Intermediate prefill chunks emit nothing (invariant 11). A request that
finishes gives its KV to the tree (cache_finished_req); one still running after its prefill has
its prompt inserted when it joins the running batch (Scheduler.get_next_batch_to_run), and a
chunked request its computed chunks before its next chunk, so later requests can share them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.io_struct import BatchTokenIDOutput
from radixserve.managers.schedule_batch import (
    DECODE_CONTEXT,
    Req,
    ScheduleBatch,
    finish_abort,
    finish_length,
)
from radixserve.model_executor.forward_batch import ForwardMode
from radixserve.speculative.spec_info import SpecVerifyInput

# A request that does not stream still sends its tokens this often (SGLang's
# DEFAULT_FORCE_STREAM_INTERVAL), so that output flows from a server busy with long ones.
FORCE_STREAM_INTERVAL = 50


@dataclass
class BatchSnapshot:
    """What processing a step's result needs, taken when the step was launched (invariant 7):
    the live batch is filtered and merged again before the overlap loop processes it."""

    reqs: list[Req]
    forward_mode: ForwardMode
    chunk_rows: list[bool]  # an intermediate prefill chunk: no token
    retractions: list[int]  # a request retracted since the launch drops this step's token
    futures: list[int] | None = None  # overlap: the future slot of each row's token
    spec: SpecVerifyInput | None = None  # a speculative verify step

    @classmethod
    def of(cls, batch: ScheduleBatch) -> BatchSnapshot:
        return cls(
            list(batch.reqs),
            batch.forward_mode,
            [r is batch.chunked_req for r in batch.reqs],
            [r.num_retractions for r in batch.reqs],
            spec=batch.spec_info,
        )


class SchedulerOutputMixin:
    tree_cache: Any
    tokenizer: Any
    stats: Any
    chunked_req: Req | None
    send_output: Any
    server_args: Any
    grammar_manager: Any
    spec_worker: Any
    disagg: Any

    def process_batch_result(self, snap: BatchSnapshot, result: Any) -> None:
        """Append each row's token. In the overlap loop a request may have finished, been
        aborted or been retracted after this step was launched: its token is dropped (its
        slots were freed with it, and a retracted request computes the token again)."""
        if snap.forward_mode.is_decode():
            self.stats.num_decode_batches += 1
        if snap.spec is not None:
            self.process_verify_result(snap, snap.spec, result)
            return
        if self.spec_worker is not None and snap.forward_mode.is_extend():
            for req in snap.reqs:  # the draft model ran over the same tokens
                req.draft_kv_len = req.kv_committed_len
        to_stream: list[Req] = []
        for i, req in enumerate(snap.reqs):
            if result.input_token_logprobs is not None and not req.finished():
                req.input_token_logprobs.extend(result.input_token_logprobs[i])
                if req.top_logprobs_num:
                    k = req.top_logprobs_num
                    req.input_top_logprobs.extend(t[:k] for t in result.input_top_logprobs[i])
            if snap.chunk_rows[i]:  # an intermediate chunk: no token, nothing streamed
                continue
            if req.finished() or req.num_retractions != snap.retractions[i]:
                continue
            token = result.next_token_ids[i]
            if snap.futures is None or req.pending_future == snap.futures[i]:
                req.pending_future = None
            logprob = None
            if req.return_logprob and result.logprobs is not None:
                top = result.top_logprobs[i] if result.top_logprobs is not None else None
                logprob = (result.logprobs[i], top)
            self._append_token(req, token, logprob)
            if req.spec is not None:
                req.spec.on_plain_token(token)
            if req.finished():
                self._on_finished(req)
            to_stream.append(req)
        self.stream_output(to_stream)

    def _append_token(self, req: Req, token: int, logprob: tuple[float, Any] | None) -> None:
        if req.sampling_params.max_new_tokens == 0 and req.to_abort is None:
            # A prompt-only request (its prompt logprobs: SGLang's scoring): the prefill's
            # token is not part of it.
            req.finished_reason = finish_length(0)
            return
        if req.grammar is not None and req.to_abort is not None:
            # Its mask row was left open (GrammarManager.vocab_mask): the token is no output.
            req.finished_reason = finish_abort(req.to_abort)
            return
        req.output_ids.append(token)
        self.stats.generation_tokens += req.log_metrics
        if logprob is not None:
            req.output_token_logprobs.append((logprob[0], token))
            if logprob[1] is not None and req.top_logprobs_num:
                req.output_top_logprobs.append(logprob[1][: req.top_logprobs_num])
        if req.grammar is not None:
            self.grammar_manager.accept(req, token)
        req.check_finished(self.tokenizer)

    def _on_finished(self, req: Req) -> None:
        self.cap_to_draft_kv(req)
        # A P/D prefill request keeps its KV until the transfer to the decode server is done.
        if self.disagg is None or not self.disagg.on_finished(req):
            self.tree_cache.cache_finished_req(req)
        self.stats.on_finished(req)

    def _abort_chunked(self, req: Req) -> None:
        req.finished_reason = finish_abort(req.to_abort or "aborted")
        if self.disagg is not None:
            self.disagg.on_aborted(req)
        self.tree_cache.cache_finished_req(req, is_insert=False)
        self.stats.on_aborted(req)
        if self.chunked_req is req:
            self.chunked_req = None

    def stream_output(self, reqs: list[Req]) -> None:
        """Send each request's new tokens: streaming requests every `stream_interval` tokens,
        the others every FORCE_STREAM_INTERVAL (SGLang's: the server shows progress, and
        /health_generate sees output from a server busy with long ones) and when they finish."""
        interval = self.server_args.stream_interval
        out = BatchTokenIDOutput([], [], [], [], [], [], [], [], [], [])
        for req in reqs:
            if not req.finished():
                due = interval if req.stream else FORCE_STREAM_INTERVAL
                if (len(req.output_ids) - req.sent_len) < due and (
                    req.sent_len > 0 or not req.stream
                ):
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
        out.decode_context.append(req.origin_input_ids[-DECODE_CONTEXT:] if start == 0 else [])
        out.skip_special_tokens.append(sp.skip_special_tokens)
        out.spaces_between_special_tokens.append(sp.spaces_between_special_tokens)
        out.no_stop_trim.append(sp.no_stop_trim)
        out.stop_strs.append(sp.stop_strs)
        out.prompt_tokens.append(len(req.origin_input_ids))
        out.completion_tokens.append(len(req.output_ids))
        out.cached_tokens.append(req.cached_tokens)
        if self.spec_worker is not None:
            st = req.spec
            out.spec_verify_ct.append(st.verify_ct if st else 0)
            out.spec_accept_length.append(
                st.committed / st.verify_ct if st and st.verify_ct else 0.0
            )
            out.spec_draft_tokens.append(st.drafts if st else 0)
            out.spec_accepted_tokens.append(st.accepted if st else 0)
        if req.return_logprob:
            out.output_token_logprobs.append(req.output_token_logprobs[start:])
            out.output_top_logprobs.append(req.output_top_logprobs[start:])
        else:
            out.output_token_logprobs.append(None)
            out.output_top_logprobs.append(None)
        if req.return_logprob and not req.input_logprobs_sent:  # once, with the first output
            req.input_logprobs_sent = True
            out.input_token_logprobs.append(req.input_token_logprobs)
            out.input_top_logprobs.append(req.input_top_logprobs if req.top_logprobs_num else [])
        else:
            out.input_token_logprobs.append(None)
            out.input_top_logprobs.append(None)
