"""The scheduler's side of speculative decoding (mixed into Scheduler).

Each decode round, `_prepare_verify` asks every running request for a draft tree (NGRAM: from
its own text; STANDALONE: a chain the draft model fills in on the worker), lets the
SpecController keep what pays by the measured costs, and sets the batch up to verify it.
`process_verify_result` commits what acceptance kept, stopping where a request finishes, and
frees the slots of every node it did not commit, so that only committed tokens ever reach the
output or the radix cache (invariant 5). Speculative steps run in the normal loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from radixserve.args import ServerArgs
from radixserve.managers.schedule_batch import Req, ScheduleBatch
from radixserve.speculative.adaptive import RequestSpecState, SpecController
from radixserve.speculative.ngram import NgramConfig, NgramIndex
from radixserve.speculative.spec_info import (
    DraftTree,
    SpecAlgorithm,
    SpecVerifyInput,
    SpecVerifyOutput,
)
from radixserve.speculative.spec_worker import SpecWorker

if TYPE_CHECKING:
    from radixserve.managers.scheduler_output import BatchSnapshot


class SpecSchedulerMixin:
    tp_worker: Any
    allocator: Any
    tree_cache: Any
    req_to_token_pool: Any
    page_size: int
    stats: Any
    waiting_queue: list[Req]

    def init_speculative(self, server_args: ServerArgs, tokenizer: Any) -> None:
        self.spec_algorithm = SpecAlgorithm.of(server_args.speculative_algorithm)
        self.spec_worker: SpecWorker | None = None
        if not self.spec_algorithm.is_none():
            self.spec_worker = SpecWorker(server_args, self.tp_worker, tokenizer)
            self.spec_controller = SpecController(
                server_args.speculative_verify_tokens - 1,
                adaptive=not server_args.speculative_disable_adaptive,
                draft_model=self.spec_algorithm.has_draft_model(),
            )
            self.ngram_config = NgramConfig(
                server_args.speculative_ngram_min_match_window_size,
                server_args.speculative_ngram_max_match_window_size,
                server_args.speculative_ngram_max_bfs_breadth,
                server_args.speculative_ngram_branch_length,
            )

    def _record_step_cost(self, batch: ScheduleBatch, seconds: float) -> None:
        """Price the target forward by its tokens, and a draft forward by its requests."""
        ctrl, worker = self.spec_controller, self.spec_worker
        assert worker is not None
        draft_s = 0.0
        if batch.spec_info is not None and worker.last_draft is not None:
            forwards, draft_s = worker.last_draft
            ctrl.record_draft(batch.batch_size(), draft_s / max(forwards, 1))
        ctrl.record_forward(len(batch.input_ids), seconds - draft_s)

    def _prepare_verify(self, batch: ScheduleBatch) -> bool:
        """Propose a draft tree per request and set the batch up to verify what pays of them
        (SpecController.select); False (plain decode) when nothing is proposed, speculating
        does not pay by the measured costs, or the nodes do not fit in the KV pool."""
        ctrl = self.spec_controller
        draft_model = self.spec_algorithm.has_draft_model()
        backlog = bool(self.waiting_queue)
        budgets = []
        for r in batch.reqs:
            if r.spec is None:
                r.spec = RequestSpecState()
            budget = 0
            if r.grammar is None:  # grammar-constrained requests decode without drafts
                room = r.max_new_tokens - len(r.output_ids) - 1  # the bonus token is extra
                budget = max(0, min(ctrl.max_drafts, room))
            budgets.append(budget)
        # Chains as deep as each budget are the best any proposal can be (the same expected
        # gain for fewer tokens): if even they do not pay, no NGRAM proposal is needed but the
        # ones that start a shadow check, and the step decodes plainly at no further cost.
        chains = [
            DraftTree.chain([r.output_ids[-1]] * (n + 1))
            for r, n in zip(batch.reqs, budgets, strict=True)
        ]
        if not draft_model and ctrl.select(batch.reqs, chains, backlog) is None:
            for r, n in zip(batch.reqs, budgets, strict=True):
                if n and r.spec.wants_shadow():
                    r.spec.start_shadow(self._ngram_proposal(r, n))
            return False
        if draft_model:  # placeholders: the draft model fills them in on the worker
            proposals = chains
        else:
            proposals = [
                self._ngram_proposal(r, n) if n else c
                for r, n, c in zip(batch.reqs, budgets, chains, strict=True)
            ]
        trees = ctrl.select(batch.reqs, proposals, backlog)
        if trees is not None:
            need = batch.verify_slots_needed(trees)
            if need > self.allocator.available_size() + self.tree_cache.evictable_size():
                trees = None
        if not draft_model:  # what was not verified is checked against the real tokens
            for r, full, kept in zip(batch.reqs, proposals, trees or proposals, strict=True):
                if trees is None or kept.num_drafts == 0:
                    r.spec.start_shadow(full)
        if trees is None:
            return False
        batch.prepare_for_verify(trees, draft_model)
        return True

    def _ngram_proposal(self, r: Req, budget: int) -> DraftTree:
        if r.ngram is None:
            r.ngram = NgramIndex([], self.ngram_config)
        r.ngram.sync(r.origin_input_ids, r.output_ids)
        return r.ngram.propose(budget)

    def cap_to_draft_kv(self, req: Any) -> None:
        """Before a finished or aborted request's KV goes into the cache: only the tokens with
        both models' KV (a request ending in a plain step, or aborted, had the target's KV of
        its last tokens and not the draft's: a later request drafting from them was
        rejected)."""
        if self.spec_algorithm.has_draft_model():
            req.kv_committed_len = min(req.kv_committed_len, req.draft_kv_len)

    def process_verify_result(
        self, snap: BatchSnapshot, spec: SpecVerifyInput, result: SpecVerifyOutput
    ) -> None:
        """Commit each request's accepted tokens one by one, stopping where it finishes (EOS,
        a stop string or max_new_tokens inside an accepted run: the rest is dropped), and free
        the slots of every node past what it committed (invariant 5)."""
        to_stream: list[Req] = []
        ps = self.page_size
        for i, req in enumerate(snap.reqs):
            s, tree = spec.seq_lens[i], spec.trees[i]
            tokens = result.tokens[i]
            appended = 0
            for j, token in enumerate(tokens):
                logprob = None
                if req.return_logprob and result.logprobs is not None:
                    tops = result.top_logprobs[i] if result.top_logprobs else None
                    logprob = (result.logprobs[i][j], tops[j] if tops else None)
                self._append_token(req, token, logprob)
                appended += 1
                if req.finished():
                    break
            committed = s + appended  # the root and the accepted drafts before the last token
            if tree.num_drafts:
                # Drafts after the token that finished the request were dropped: not accepted
                # (as SGLang counts them; the stats' accept length and rate stay honest).
                accepted = min(len(result.accepted_nodes[i]), appended)
                req.spec.on_verify(max(tree.depths), accepted, appended, tree.num_drafts)
                self.stats.on_verify(tree.num_drafts, accepted, appended)
            elif appended:
                req.spec.on_plain_token(tokens[0])
            if self.spec_algorithm.has_draft_model():
                # The draft wrote positions up to s (catch-up) and s + 1 .. s + drafts - 1.
                req.draft_kv_len = min(s + max(tree.num_drafts, 1), committed)
            req.kv_committed_len = committed
            if req.finished():
                self._on_finished(req)
            else:
                keep = -(-committed // ps) * ps  # the last page stays whole
                end = s + len(tree)
                if keep < end:
                    row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
                    self.allocator.free(row[keep:end].to(torch.int64))
                req.kv_allocated_len = committed
            to_stream.append(req)
        self.stream_output(to_stream)
