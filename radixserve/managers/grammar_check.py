"""GrammarCheck: compile a request's grammar in the main process before dispatch, so that a bad
json_schema / regex / ebnf is an HTTP 400 with the compiler's message (the scheduler compiles
it again in its own process, from its own cache). Called by the TokenizerManager on an
executor thread: compiling a large schema must not stall the event loop."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from radixserve.managers.request_checks import RequestError
from radixserve.sampling_params import SamplingParams


class GrammarCheck:
    def __init__(
        self, backend_name: str, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        self.backend_name = backend_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._backend: Any = None  # created on the first constrained request
        self._lock = threading.Lock()  # checks run on several executor threads

    def check(self, sp: SamplingParams) -> None:
        """Raise RequestError when the request's grammar cannot be used."""
        if sp.json_schema is None and sp.regex is None and sp.ebnf is None:
            return
        if self.backend_name == "none":
            raise RequestError("constrained decoding is disabled (--grammar-backend none)")
        from radixserve.constrained.xgrammar_backend import (
            SERVED_ANY_WHITESPACE,
            XGrammarBackend,
            grammar_key,
        )

        with self._lock:
            if self._backend is None:  # (the grammar the scheduler serves: GrammarManager's)
                self._backend = XGrammarBackend(
                    self.tokenizer,
                    self.vocab_size,
                    self.eos_token_ids,
                    any_whitespace=SERVED_ANY_WHITESPACE,
                )
        key = grammar_key(sp)
        assert key is not None
        message = self._backend.validate(*key)
        if message is not None:
            raise RequestError(message)

    def close(self) -> None:
        """Stop the compiles in flight: a check waiting on one returns at once."""
        with self._lock:
            if self._backend is not None:
                self._backend.close()

    def compiling(self) -> bool:
        """Whether a compile is still running (C++ cannot stop one; the process's exit would
        wait for it)."""
        with self._lock:
            return self._backend is not None and self._backend.compiling()
