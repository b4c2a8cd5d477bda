"""GrammarManager: the scheduler's side of constrained decoding (seed 003 act 6).

A constrained request waits in the grammar queue while its grammar compiles on a worker thread;
the scheduler moves it to the waiting queue once compiled (or rejects it with the compiler's
message). Each step the manager builds the vocab mask of the batch's constrained rows, and
after sampling it advances every matcher by the sampled token. The xgrammar backend is created
on the first constrained request, so unconstrained serving never pays for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from radixserve.managers.schedule_batch import Req, finish_abort, finish_stop

logger = logging.getLogger(__name__)

# A queued request's compile, as GrammarManager.statuses reports it.
PENDING, READY, EXPIRED = 0, 1, 2


class GrammarManager:
    def __init__(self, backend_name: str, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]):
        self.backend_name = backend_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.queue: list[Req] = []
        self._backend: Any = None

    @property
    def backend(self) -> Any:
        if self._backend is None:
            from radixserve.constrained.xgrammar_backend import (
                SERVED_ANY_WHITESPACE,
                XGrammarBackend,
            )

            self._backend = XGrammarBackend(
                self.tokenizer, self.vocab_size, self.eos_ids, any_whitespace=SERVED_ANY_WHITESPACE
            )
        return self._backend

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()

    def key_of(self, req: Req) -> tuple[str, str] | None:
        sp = req.sampling_params
        if sp.json_schema is None and sp.regex is None and sp.ebnf is None:
            return None
        from radixserve.constrained.xgrammar_backend import grammar_key

        return grammar_key(sp)

    def add(self, req: Req) -> str | None:
        """Start compiling the request's grammar; returns an error when none can be used."""
        if self.backend_name == "none" or self.tokenizer is None:
            return "constrained decoding is disabled (--grammar-backend none)"
        key = self.key_of(req)
        assert key is not None
        from radixserve.constrained.xgrammar_backend import GRAMMAR_TIMEOUT_S

        req.grammar = self.backend.get_future(key)
        req.grammar_deadline = time.monotonic() + GRAMMAR_TIMEOUT_S
        self.queue.append(req)
        return None

    def statuses(self) -> list[int]:
        """Each queued request's state here: PENDING, READY (its compile is done, or it was
        aborted) or EXPIRED (past its deadline, GRAMMAR_TIMEOUT_S from its arrival)."""
        now = time.monotonic()
        return [
            READY
            if req.to_abort is not None or req.grammar.done()
            else EXPIRED
            if now > req.grammar_deadline
            else PENDING
            for req in self.queue
        ]

    def pop_ready(
        self, statuses: list[int] | None = None
    ) -> tuple[list[Req], list[tuple[Req, str]]]:
        """Requests whose grammar compiled (with a fresh matcher), and those it rejected or
        that waited past their deadline. `statuses` (default: this process's) says which are
        which: tensor-parallel ranks pass the ones they agreed on (TpSync.agree_statuses)."""
        from radixserve.constrained.xgrammar_backend import InvalidGrammar, timeout_message

        statuses = self.statuses() if statuses is None else statuses
        ready, failed, still = [], [], []
        for req, status in zip(self.queue, statuses, strict=True):
            if status == PENDING:
                still.append(req)
            elif req.to_abort is not None:
                failed.append((req, req.to_abort))
            elif status == EXPIRED:
                failed.append((req, timeout_message(self.key_of(req)[0])))
                req.grammar = None
            else:
                try:
                    result = req.grammar.result()
                    if not isinstance(result, InvalidGrammar):
                        req.grammar = self.backend.new_matcher(result)
                        ready.append(req)
                        continue
                    message = result.message
                except Exception as e:  # a failed compile fails this request, not the server
                    message = f"the grammar could not be compiled: {e!r}"
                req.grammar = None
                failed.append((req, message))
        self.queue = still
        return ready, failed

    def vocab_mask(
        self, reqs: Sequence[Req], skip: Sequence[bool] | None = None
    ) -> torch.Tensor | None:
        """[B, V] bool (True = forbidden) for a batch with constrained rows, else None. Rows in
        `skip` (intermediate prefill chunks) and finished requests are left open."""
        rows = [
            i
            for i, r in enumerate(reqs)
            if r.grammar is not None and not r.finished() and not (skip and skip[i])
        ]
        if not rows:
            return None
        packed = self.backend.allocate_vocab_mask(len(reqs))
        for i in rows:
            try:
                reqs[i].grammar.fill_vocab_mask(packed, i)
            except Exception as e:  # this row stays unmasked; its request ends at its result
                logger.exception("grammar mask of %s failed", reqs[i].rid)
                packed[i] = -1
                reqs[i].to_abort = f"the grammar failed: {e!r}"
        mask = self.backend.unpack_vocab_mask(packed, self.vocab_size)
        for i in rows:
            if bool(mask[i].all()):  # no token allowed: sampling would pick among -inf
                mask[i] = False
                reqs[i].to_abort = "the grammar admits no next token from the model's vocabulary"
        return mask

    def accept(self, req: Req, token: int) -> None:
        """Advance the matcher; finish the request when the grammar completes or breaks."""
        if req.grammar is None or req.finished():
            return
        try:
            accepted = req.grammar.accept_token(token)
        except Exception as e:
            logger.exception("grammar of %s failed", req.rid)
            req.finished_reason = finish_abort(f"the grammar failed: {e!r}")
            return
        if not accepted:
            req.finished_reason = finish_abort("the sampled token violates the grammar")
        elif req.grammar.is_terminated():
            req.finished_reason = finish_stop(token if token in self.eos_ids else None)
