"""The grammar backend for constrained decoding (json_schema / regex / ebnf), built on xgrammar.

Owns the xgrammar TokenizerInfo and GrammarCompiler for one model, a thread pool that compiles
grammars off the caller's thread, and a cache of compilations keyed by (kind, text). The
TokenizerManager calls `validate` to answer a bad grammar with HTTP 400 before dispatch; the
Scheduler calls `get_future` when a constrained request arrives, parks the request until the
future is done, then gives it a `Grammar` (one matcher per request) from `new_matcher`.

Per decode step the Scheduler allocates one packed mask for the batch (`allocate_vocab_mask`),
lets every constrained request fill its row (`Grammar.fill_vocab_mask`; other rows stay all
allowed), applies it to the logits before sampling (`apply_vocab_mask`, or `unpack_vocab_mask`
for SamplingBatchInfo.vocab_mask), and after sampling feeds the token back (`accept_token`).

Mask layout (xgrammar's): int32 [B, ceil(V / 32)], bit j of word w = token 32 * w + j is
ALLOWED. Rows are built on the CPU (the matchers live there) and moved to the logits' device.
"""

from __future__ import annotations

import json
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import xgrammar as xgr

from radixserve.args import grammar_timeout_s

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from radixserve.sampling_params import SamplingParams

GRAMMAR_KINDS = ("json", "regex", "ebnf")
ANY_JSON = "$$ANY$$"  # json_schema value meaning "any JSON value" (response_format json_object)
GrammarKey = tuple[str, str]  # (kind, text), kind in GRAMMAR_KINDS

# How long a request waits for its grammar to compile (from its arrival; SGLang's
# SGLANG_GRAMMAR_TIMEOUT): a schema that takes longer is refused. Compiles run on a few threads
# (xgrammar releases the GIL), so one slow schema does not hold up every other new grammar.
GRAMMAR_TIMEOUT_S = grammar_timeout_s()  # (checked at start: ServerArgs)
COMPILE_WORKERS = 4
# JSON schemas are served without free whitespace (a model's stray newlines cannot run a
# constrained output to max_tokens); the TokenizerManager's check validates that same grammar.
SERVED_ANY_WHITESPACE = False
# xgrammar's compile time grows faster than the schema: 200 levels of nesting take 0.6 s,
# 1,500 take minutes; 20,000 properties take 30 s. Past these it is refused before compiling.
MAX_SCHEMA_DEPTH = 128
MAX_SCHEMA_NODES = 10_000
# A grammar's size after compiling grows faster than its text: an enum of 10,000 strings
# (160 KB) compiles to 35 MB, one of 100,000 (1.7 MB) to about 500 MB in 45 s, in both the
# TokenizerManager's check and the scheduler. A longer text is refused before compiling, and the
# cache of compiled grammars keeps at most GRAMMAR_CACHE_BYTES of them (it kept 1024 of any size).
MAX_GRAMMAR_CHARS = 256 * 1024
GRAMMAR_CACHE_BYTES = 256 * 2**20
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed check.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


@dataclass(frozen=True)
class InvalidGrammar:
    """The result of compiling a grammar that the compiler rejected; `message` says why."""

    key: GrammarKey
    message: str


def grammar_key(sp: SamplingParams) -> GrammarKey | None:
    """The cache key of a request's grammar, or None when it is unconstrained."""
    if sp.json_schema is not None:
        return ("json", sp.json_schema)
    if sp.regex is not None:
        return ("regex", sp.regex)
    if sp.ebnf is not None:
        return ("ebnf", sp.ebnf)
    return None


class Grammar:
    """One request's matcher: the grammar state after the tokens accepted so far.

    Invariant: once the stop token (EOS) has been accepted the matcher is terminated, and its
    mask row allows only the EOS ids (xgrammar itself refuses to fill a terminated matcher).
    """

    def __init__(self, matcher: xgr.GrammarMatcher, eos_token_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = list(eos_token_ids)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) when the grammar forbids it."""
        return self.matcher.accept_token(int(token_id))

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding rejections)."""
        self.matcher.rollback(num_tokens)

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        """Write this request's allowed tokens into row `row` of a CPU mask from
        `allocate_vocab_mask`."""
        if self.matcher.is_terminated():
            mask[row] = 0
            for tid in self.eos_token_ids:
                mask[row, tid // 32] |= _bit(tid % 32)
        else:
            self.matcher.fill_next_token_bitmask(mask, row)


class XGrammarBackend:
    """Compiles grammars for one tokenizer and vocab; see the module docstring for the protocol.

    `vocab_size` is the model's (the logits' width), which may exceed len(tokenizer); the extra
    ids are never allowed. `eos_token_ids` are the model's stop tokens: a constrained request
    may emit one only where its grammar is complete, and must emit one there.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: Sequence[int] | None = None,
        num_workers: int = COMPILE_WORKERS,
        any_whitespace: bool = True,
        max_cache_entries: int = 1024,
    ) -> None:
        if eos_token_ids is None:
            eos_token_ids = [tokenizer.eos_token_id]
        self.vocab_size = vocab_size
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.any_whitespace = any_whitespace
        self.max_cache_entries = max_cache_entries
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, self.eos_token_ids)
        # Our cache replaces xgrammar's (unbounded by default), so each grammar is held once.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        self._pool = _CompilePool(num_workers)
        self._cache: OrderedDict[GrammarKey, Future[xgr.CompiledGrammar | InvalidGrammar]] = (
            OrderedDict()
        )
        self._sizes: dict[GrammarKey, int] = {}  # the compiled ones' bytes, of those cached
        self.cache_bytes = 0
        # Compiles done since the cache was last trimmed. (Their callbacks run inside the
        # compile pool's lock, which get_future takes inside this one's: they only queue.)
        self._compiled: queue.SimpleQueue[tuple[GrammarKey, Future[Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()

    # -- compilation ---------------------------------------------------------------------------
    def get_future(self, key: GrammarKey) -> Future[xgr.CompiledGrammar | InvalidGrammar]:
        """A Future of `xgr.CompiledGrammar | InvalidGrammar` for `key`, compiled on a worker
        thread; the same key returns the same Future (so the same compiled object)."""
        kind, text = key
        if kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self._compile, key)
                future.add_done_callback(lambda f: self._compiled.put((key, f)))
                self._cache[key] = future
            else:
                self._cache.move_to_end(key)
            self._trim_cache()
        return future

    def _trim_cache(self) -> None:
        """Count the compiles done since the last call against the cache's bytes, then drop the
        least recently used grammars past its entries or bytes (the newest stays: its requests
        hold it anyway). Called with the lock held."""
        while not self._compiled.empty():
            key, future = self._compiled.get()
            if self._cache.get(key) is not future:
                continue  # (it left the cache while it compiled)
            result = None if future.cancelled() or future.exception() else future.result()
            size = result.memory_size_bytes if isinstance(result, xgr.CompiledGrammar) else 0
            self._sizes[key] = size
            self.cache_bytes += size
        while len(self._cache) > 1 and (
            len(self._cache) > self.max_cache_entries or self.cache_bytes > GRAMMAR_CACHE_BYTES
        ):
            old, _ = self._cache.popitem(last=False)
            self.cache_bytes -= self._sizes.pop(old, 0)

    def validate(
        self, kind: str, text: str, timeout: float | None = GRAMMAR_TIMEOUT_S
    ) -> str | None:
        """Why the grammar cannot be served (the compiler's error, keywords of a schema that
        it would not enforce, a grammar that admits no output, a compile past `timeout`
        seconds), else None. Blocks until compiled; the result stays cached."""
        if kind not in GRAMMAR_KINDS:
            return f"unknown grammar kind {kind!r}"
        if len(text) > MAX_GRAMMAR_CHARS:
            return (
                f"invalid {kind} grammar: {len(text)} characters, more than the "
                f"{MAX_GRAMMAR_CHARS} served (its compiled form grows faster than its text)"
            )
        if kind == "regex" and (escape := unsupported_regex_escape(text)) is not None:
            implied = " (the whole output matches the pattern: drop it)" if escape in "AZz" else ""
            return f"invalid regex grammar: the escape \\{escape} is not supported{implied}"
        if kind == "json" and text != ANY_JSON:
            try:
                schema = json.loads(text)
            except ValueError:
                schema = None  # the compiler says what is wrong with it
            except RecursionError:  # (deeper than Python's recursion limit)
                return (
                    f"invalid json grammar: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels"
                )
            too_large = schema_too_large(schema)
            if too_large:
                return f"invalid json grammar: {too_large}"
            try:
                unenforced = sorted(set(unenforced_keywords(schema)))
            except RecursionError:
                unenforced = []
            if unenforced:
                return _unenforced_message(unenforced)
        future = self.get_future((kind, text))
        try:
            result = future.result(timeout)
        except FutureTimeout:
            self._pool.abandon(future)  # others' compiles need not wait behind it
            return timeout_message(kind, timeout or 0.0)
        if isinstance(result, InvalidGrammar):
            return result.message
        return self._admits_no_output(kind, result)

    def _admits_no_output(self, kind: str, compiled: xgr.CompiledGrammar) -> str | None:
        """A message when the grammar allows no first token, or (a JSON schema) only the end
        of the output: an empty text is no JSON value."""
        mask = self.allocate_vocab_mask(1)
        self.new_matcher(compiled).fill_vocab_mask(mask, 0)
        allowed = (~self.unpack_vocab_mask(mask, self.vocab_size)[0]).nonzero().flatten()
        if allowed.numel() == 0:
            return f"invalid {kind} grammar: it admits no output"
        if kind == "json" and set(allowed.tolist()) <= set(self.eos_token_ids):
            return "invalid json grammar: the schema admits no value"
        return None

    def _compile(self, key: GrammarKey) -> xgr.CompiledGrammar | InvalidGrammar:
        kind, text = key
        try:
            if kind == "json" and text == ANY_JSON:
                return self.compiler.compile_builtin_json_grammar()
            if kind == "json":
                try:
                    schema = rewrite_for_xgrammar(json.loads(text))
                    # (checked here, once per schema: what is left beside a keyword read
                    # alone could not be folded in)
                    ignored = sorted(set(ignored_siblings(schema)))
                    if ignored:
                        return InvalidGrammar(key, _unenforced_message(ignored))
                    text = json.dumps(schema)
                except (ValueError, RecursionError):
                    pass  # the compiler says what is wrong with it
                return self.compiler.compile_json_schema(text, any_whitespace=self.any_whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(text)
            return self.compiler.compile_grammar(text)
        except Exception as e:  # whatever the compiler raises belongs to this grammar only
            return InvalidGrammar(key, _clean_message(kind, e))

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> Grammar:
        """A fresh per-request matcher (state: nothing accepted yet)."""
        return Grammar(xgr.GrammarMatcher(compiled), self.eos_token_ids)

    def close(self) -> None:
        """Fail the compiles not yet done (their waiters wake at once) and stop the workers
        (one compiling in C++ ends when its compile does)."""
        self._pool.close()

    def compiling(self) -> bool:
        """Whether a compile thread is still inside a compile (closed or not)."""
        return self._pool.compiling()

    # -- masks ---------------------------------------------------------------------------------
    def allocate_vocab_mask(self, batch_size: int) -> torch.Tensor:
        """A CPU int32 mask [batch_size, ceil(V / 32)] with every token allowed in every row."""
        return xgr.allocate_token_bitmask(batch_size, self.vocab_size)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, mask: torch.Tensor) -> None:
        """Set the forbidden logits [B, V] to -inf in place, on the logits' device."""
        mask = mask.to(logits.device, non_blocking=True)
        if logits.dtype in (torch.float32, torch.float16, torch.bfloat16):
            xgr.apply_token_bitmask_inplace(logits, mask)
        else:
            forbidden = XGrammarBackend.unpack_vocab_mask(mask, logits.shape[-1])
            logits.masked_fill_(forbidden, float("-inf"))

    @staticmethod
    def unpack_vocab_mask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Packed mask [B, W] → bool [B, vocab_size], True = forbidden (SamplingBatchInfo's
        vocab_mask convention)."""
        shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
        bits = (mask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift; & 1 keeps one bit
        return bits.view(mask.shape[0], -1)[:, :vocab_size] == 0


class _CompilePool:
    """Compile threads whose close() fails every compile not yet done, the one running
    included: whoever waits on it (a request's grammar check, a stopping server's last
    requests) is answered at once. (A ThreadPoolExecutor cancels only those not started.) A
    compile running in C++ cannot be stopped: its thread ends when it does, and the
    interpreter's exit waits for it (a daemon thread still inside xgrammar at exit crashed
    the process; a stopped server exits without waiting: http_server.launch_server). A
    compile whose waiter gave up (abandon) gets a thread of its own beside the workers, up to
    MAX_ABANDONED: four slow schemas refused for their time held every worker, and every
    grammar after them was refused too."""

    MAX_ABANDONED = 16

    def __init__(self, num_workers: int) -> None:
        self._num_workers = num_workers
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._pending: set[Future] = set()
        self._abandoned: set[Future] = set()  # running, their waiters gone
        self._running = 0  # jobs inside fn now
        self._lock = threading.Lock()
        self._closed = False

    def compiling(self) -> bool:
        with self._lock:
            return self._running > 0

    def abandon(self, future: Future) -> None:
        """Its waiter gave up: while it runs, its thread is not one of the workers."""
        with self._lock:
            # (once per compile: every request for a schema waits on its one future, and a
            # thread per waiter that gave up made 41 threads of 40 timed-out requests)
            if future in self._pending and future.running() and future not in self._abandoned:
                self._abandoned.add(future)
                if len(self._abandoned) <= self.MAX_ABANDONED:
                    self._start_thread()

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._work, name=f"grammar_{len(self._threads)}")
        self._threads.append(thread)
        thread.start()

    def submit(self, fn: Any, *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                future.set_exception(RuntimeError("the grammar backend is closed"))
                return future
            self._pending.add(future)
            if len(self._threads) < self._num_workers:
                self._start_thread()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._retire():
                self._jobs.put(job)
                return
            future, fn, args = job
            with self._lock:
                if future not in self._pending or not future.set_running_or_notify_cancel():
                    self._pending.discard(future)
                    continue  # failed by close(), or cancelled
                self._running += 1
            try:
                result = fn(*args)
            except BaseException as e:  # (fn returns its errors; this is a bug's traceback)
                self._settle(future, exception=e)
            else:
                self._settle(future, result=result)

    def _retire(self) -> bool:
        """Whether this thread is one more than the workers and the abandoned compiles need
        (one started for an abandoned compile that has ended): it then ends."""
        with self._lock:
            wanted = self._num_workers + min(len(self._abandoned), self.MAX_ABANDONED)
            if len(self._threads) <= wanted:
                return False
            self._threads.remove(threading.current_thread())
            return True

    def _settle(self, future: Future, result: Any = None, exception: Any = None) -> None:
        with self._lock:
            self._running -= 1
            self._abandoned.discard(future)
            if future not in self._pending:
                return  # failed by close() meanwhile
            self._pending.discard(future)
            if exception is not None:
                future.set_exception(exception)
            else:
                future.set_result(result)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, set()
            for future in pending:
                if not future.done():  # (a cancelled one is done)
                    future.set_exception(RuntimeError("the grammar backend is closed"))
            for _ in self._threads:
                self._jobs.put(None)


def build_tokenizer_info(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int]
) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with the tokenizer's special tokens (chat markers and
    the like) blanked: xgrammar never allows a token with an empty string, so a grammar can no
    longer emit `<|im_start|>` as text. The stop tokens are allowed separately, at the end."""
    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
    )
    encoded = [""] * vocab_size
    for token, idx in tokenizer.get_vocab().items():
        if idx < vocab_size:
            encoded[idx] = token
    special = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special |= {i for i, tok in added.items() if getattr(tok, "special", False)}
    for idx in special:
        if idx < vocab_size:
            encoded[idx] = ""
    return xgr.TokenizerInfo(
        encoded,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=list(eos_token_ids),
        add_prefix_space=detected.add_prefix_space,
    )


def _unenforced_message(keywords: list[str]) -> str:
    return (
        "invalid json grammar: the schema uses keywords that constrained decoding cannot "
        f"enforce: {', '.join(keywords)}"
    )


def timeout_message(kind: str, seconds: float = GRAMMAR_TIMEOUT_S) -> str:
    return (
        f"invalid {kind} grammar: it did not compile within {seconds:g} s "
        "(RADIXSERVE_GRAMMAR_TIMEOUT); simplify it"
    )


# Schema keywords xgrammar accepts without enforcing them (checked against xgrammar 0.2.9: a
# value they forbid is still generated), so a response could end with "stop" and not match.
_UNENFORCED = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",  # (draft 7's name of the two above)
    "contains",
)
# Keywords whose value is a schema, a list of schemas ("items" is either: a list in drafts
# 4-7), or a map of name → schema.
_SUBSCHEMA = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "prefixItems",
    "anyOf",
    "oneOf",
    "allOf",
)
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")


def _subschema_slots(schema: dict) -> Iterator[tuple[str, dict | list, Any]]:
    """(path from `schema`, container, key) for each direct subschema of `schema`: read it as
    container[key], replace it there. Each keyword is visited once (visited twice, "items"
    nested n deep took 2^n steps)."""
    for key in _SUBSCHEMA:
        value = schema.get(key)
        if isinstance(value, dict):
            yield key, schema, key
        elif isinstance(value, list):
            for i in range(len(value)):
                yield f"{key}/{i}", value, i
    for key in _SUBSCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name in value:
                yield f"{key}/{name}", value, name


# The letter escapes xgrammar's regex reads as Python's re and PCRE do; it refuses some others
# (\b, \p, \u) and reads the rest as the letter itself: \A(yes|no)\Z matched "AyesZ".
_REGEX_LETTER_ESCAPES = frozenset("dDwWsSnrtfvaxce")


def unsupported_regex_escape(pattern: str) -> str | None:
    """The first letter escaped in `pattern` that xgrammar would read as that letter."""
    i = pattern.find("\\")
    while 0 <= i < len(pattern) - 1:
        c = pattern[i + 1]
        if c.isascii() and c.isalpha() and c not in _REGEX_LETTER_ESCAPES:
            return c
        i = pattern.find("\\", i + 2)  # (past the escaped character: "\\\\A" is "\\" "A")
    return None


def schema_too_large(schema: object) -> str | None:
    """Why the schema is past what compiles in reasonable time (MAX_SCHEMA_DEPTH levels of
    nesting, MAX_SCHEMA_NODES subschemas), else None."""
    nodes, stack = 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            return f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels"
        if nodes > MAX_SCHEMA_NODES:
            return f"the schema has more than {MAX_SCHEMA_NODES} subschemas"
        stack.extend((container[key], depth + 1) for _, container, key in _subschema_slots(node))
    return None


def unenforced_keywords(schema: object, path: str = "#") -> Iterator[str]:
    """`keyword at path` for every keyword of a JSON schema that xgrammar would not enforce
    (a schema's data, as in enum or const, is not searched)."""
    if not isinstance(schema, dict):
        return
    for key in _UNENFORCED:
        if key in schema:
            yield f"{key} at {path}"
    if schema.get("uniqueItems") is True:
        yield f"uniqueItems at {path}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        yield f"allOf of several schemas at {path}"
    if "multipleOf" in schema and schema.get("type") != "integer":
        yield f"multipleOf of a non-integer at {path}"
    if ("minLength" in schema or "maxLength" in schema) and (
        "pattern" in schema or "format" in schema
    ):  # (xgrammar takes the pattern or format alone)
        yield f"minLength/maxLength beside pattern or format at {path}"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        yield f"$ref to another document ({ref}) at {path}"
    if _missing_required(schema) and (
        schema.get("additionalProperties", True) is not True or "patternProperties" in schema
    ):  # (names of neither properties nor anything else: rewrite_for_xgrammar adds them)
        yield f"required names not in properties at {path}"
    for sub_path, container, key in _subschema_slots(schema):
        yield from unenforced_keywords(container[key], f"{path}/{sub_path}")


# Keywords that only name or describe (pydantic writes them beside $ref, enum, anyOf, ...).
_ANNOTATIONS = frozenset(
    ("title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly")
    + ("$schema", "$id", "$anchor", "$comment", "$defs", "definitions")
    # OpenAPI's, which pydantic writes: a discriminated union's `discriminator` names the
    # property whose `const` in each branch does the constraining
    + ("discriminator", "example")
)


def _is_annotation(key: str) -> bool:
    """Whether a schema keyword constrains nothing (an `x-` extension neither)."""
    return key in _ANNOTATIONS or key.startswith("x-")


# Keywords xgrammar 0.2.9 reads alone, ignoring the keywords beside them in their schema.
_ALONE = ("anyOf", "oneOf", "allOf", "$ref", "enum", "const")


def _constraints(schema: dict, but: str) -> dict:
    """The keywords of `schema` that constrain its value, but `but` and annotations."""
    return {k: v for k, v in schema.items() if k != but and not _is_annotation(k)}


def ignored_siblings(schema: object, path: str = "#") -> Iterator[str]:
    """`keywords beside X at path` where a schema (as rewrite_for_xgrammar leaves it) still
    constrains its value beside a keyword xgrammar reads alone: they would not be enforced
    (`properties` beside `anyOf` generated a string for an integer, and "stop")."""
    if not isinstance(schema, dict):
        return
    for key in _ALONE:
        if key in schema:
            beside = sorted(_constraints(schema, key))
            if beside:
                yield f"{', '.join(beside)} beside {key} at {path}"
            break
    for sub_path, container, key in _subschema_slots(schema):
        yield from ignored_siblings(container[key], f"{path}/{sub_path}")


def _merge(a: dict, b: dict) -> dict | None:
    """One schema that means `a` and `b` both, or None where that needs more than putting
    their keywords together (the same keyword with other values; names that one's
    additionalProperties or patternProperties rule on and the other's properties add)."""
    out = dict(a)
    for key, value in b.items():
        if key not in out or out[key] == value or _is_annotation(key):
            out.setdefault(key, value)
        elif key == "required" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = out[key] + [n for n in value if n not in out[key]]
        elif key == "properties" and isinstance(value, dict) and isinstance(out[key], dict):
            both = set(value) & set(out[key])
            if any(value[n] != out[key][n] for n in both):
                return None
            out[key] = {**out[key], **value}
        else:
            return None
    for one, other in ((a, b), (b, a)):  # (each rules on the names its properties lack)
        rules = "additionalProperties" in one or "patternProperties" in one
        if rules and set(other.get("properties") or {}) - set(one.get("properties") or {}):
            return None
    return out


def _json_type(value: Any, kind: Any) -> bool:
    kinds = kind if isinstance(kind, list) else [kind]
    checks = {
        "null": value is None,
        "boolean": isinstance(value, bool),
        "integer": isinstance(value, int)
        and not isinstance(value, bool)
        or isinstance(value, float)
        and value.is_integer(),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "string": isinstance(value, str),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
    }
    return any(checks.get(k, False) for k in kinds)


def _fold_siblings(out: dict) -> dict:
    """`out` (a copy) with the keywords beside one that xgrammar reads alone folded into it,
    where that keeps the schema's meaning: into each branch of anyOf / oneOf (S and one of
    the Bi is one of S-and-Bi), into allOf's one schema, and a `type` beside enum / const as
    the values of that type. What is left is refused (ignored_siblings)."""
    for key in ("anyOf", "oneOf"):
        branches = out.get(key)
        siblings = _constraints(out, key)
        if isinstance(branches, list) and siblings:
            merged = [_merge(siblings, b) if isinstance(b, dict) else None for b in branches]
            if all(m is not None for m in merged):
                kept = {k: v for k, v in out.items() if k not in siblings}
                return {**kept, key: merged}
            return out
    one = out.get("allOf")
    if isinstance(one, list) and len(one) == 1 and isinstance(one[0], dict):
        siblings = _constraints(out, "allOf")
        merged = _merge(siblings, one[0])
        if merged is not None:
            kept = {k: v for k, v in out.items() if k not in siblings and k != "allOf"}
            folded = {**kept, **merged}
            return _fold_siblings(folded) if any(k in merged for k in _ALONE) else folded
        return out
    values = out["enum"] if isinstance(out.get("enum"), list) else None
    if values is None and "const" in out:
        values = [out["const"]]
    if values is not None and "type" in out and set(_constraints(out, "type")) <= {"enum", "const"}:
        kind = out.pop("type")
        out.pop("const", None)
        out["enum"] = [v for v in values if _json_type(v, kind)]
    return out


# A JSON string's characters, written unescaped: no quote, backslash or control character.
_PLAIN_CHAR = '[^"\\\\\\x00-\\x1f]'


def _missing_required(schema: dict) -> list[str]:
    """The names `required` lists that `properties` does not: xgrammar 0.2.9 ignores them
    (`{"required": ["name"]}` generated `{}`)."""
    required, properties = schema.get("required"), schema.get("properties")
    if not isinstance(required, list):
        return []
    known = properties if isinstance(properties, dict) else {}
    return [n for n in required if isinstance(n, str) and n not in known]


def rewrite_for_xgrammar(schema: Any) -> Any:
    """A copy of `schema` that xgrammar 0.2.9 enforces as the schema reads:
    - each string schema bounded by minLength / maxLength (and no pattern or format) written
      as the pattern of as many plain characters. xgrammar compiles such a string as any
      characters but quote, backslash, CR and LF, so a tab or another control character could
      be generated raw inside it: the output was not JSON (json.loads refuses it) and a
      forced tool call was not parsed. The pattern keeps its reading (escapes were not
      allowed either) without them.
    - each name `required` lists and `properties` does not added to `properties` as any value
      (where no other keyword constrains the object's other names: unenforced_keywords
      refuses the rest), which xgrammar then requires.
    - the keywords beside anyOf / oneOf / allOf / enum / const folded into them where that
      keeps the meaning (`_fold_siblings`): xgrammar reads those alone."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if any(key in out for key in _ALONE):  # (first: the branches then get the rest too)
        out = _fold_siblings(out)
    for key in (*_SUBSCHEMA, *_SUBSCHEMA_MAPS):  # copied before their slots are replaced
        if isinstance(out.get(key), (dict, list)):
            out[key] = type(out[key])(out[key])
    for _, container, key in _subschema_slots(out):
        container[key] = rewrite_for_xgrammar(container[key])
    missing = _missing_required(out)
    if missing:
        known = out.get("properties")
        out["properties"] = {
            **(known if isinstance(known, dict) else {}),
            **dict.fromkeys(missing, {}),
        }
    bounds = (out.get("minLength"), out.get("maxLength"))
    kind = out.get("type")
    if (
        (kind == "string" or (isinstance(kind, list) and "string" in kind))  # (a pattern
        and bounds != (None, None)  # bounds only the strings of a type list)
        and "pattern" not in out
        and "format" not in out
        and all(b is None or (type(b) is int and b >= 0) for b in bounds)
    ):
        low, high = out.pop("minLength", None) or 0, out.pop("maxLength", None)
        out["pattern"] = f"^{_PLAIN_CHAR}{{{low},{'' if high is None else high}}}$"
    return out


def _bit(j: int) -> int:
    """The int32 value with only bit j set (bit 31 is the sign bit)."""
    return -(1 << 31) if j == 31 else 1 << j


def _clean_message(kind: str, e: Exception) -> str:
    text = _LOG_PREFIX.sub("", str(e).strip()).strip()
    return f"invalid {kind} grammar: {text or type(e).__name__}"
