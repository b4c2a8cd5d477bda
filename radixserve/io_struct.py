"""Every message that crosses a process boundary (HTTP/TokenizerManager ↔ Scheduler ↔ Detokenizer).

GenerateReqInput → TokenizedGenerateReqInput → (Scheduler: Req) → BatchTokenIDOutput
→ (Detokenizer) → BatchStrOutput → TokenizerManager → response dict.

Plain dataclasses of builtins (and SamplingParams) so they pickle cheaply over ZMQ.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve.sampling_params import SamplingParams


def new_rid() -> str:
    return uuid.uuid4().hex


# The logprob fields of a request that take a value for every prompt or one per prompt.
PER_PROMPT_LOGPROB_FIELDS = ("return_logprob", "top_logprobs_num", "logprob_start_len")


@dataclass
class GenerateReqInput:
    """A user request as the HTTP server or Engine received it (one or a batch)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    # (each a value for every prompt, or a list of one per prompt of a batch: SGLang's)
    return_logprob: bool | list[bool] = False
    top_logprobs_num: int | list[int] = 0
    logprob_start_len: int | list[int] = -1
    return_text_in_logprobs: bool = False
    extra_key: str | None = None
    priority: int | None = None
    routing_key: str | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    data_parallel_rank: int | None = None  # which --dp-size replica serves it (None: any)
    # The LoRA adapter (its --lora-paths name; SGLang's field name), or one per prompt.
    lora_path: str | list[str | None] | None = None
    # Set by the native /generate endpoint, never by a client: there SGLang's router prepends
    # the prefill server's prompt token logprobs to the decode server's answer (one prompt,
    # n = 1, not streamed: it merges nothing else), so a decode server leaves its copy of those
    # out (the OpenAI endpoints get no such merge: there it gives them).
    router_merges_prompt_logprobs: bool = False
    # False for the server's own probe (/health_generate): not a user request in the metrics.
    log_metrics: bool = True

    @property
    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        if self.input_ids is None:
            raise ValueError("either text or input_ids must be given")
        return len(self.input_ids) == 0 or isinstance(self.input_ids[0], int)

    @property
    def batch_size(self) -> int:
        if self.is_single:
            return 1
        return len(self.text if self.text is not None else self.input_ids)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> GenerateReqInput:
        """The i-th request of a batch, as a single request."""
        sp = self.sampling_params
        rid = self.rid
        return GenerateReqInput(
            text=self.text[i] if self.text is not None else None,  # type: ignore[index]
            input_ids=self.input_ids[i] if self.input_ids is not None else None,  # type: ignore[index]
            sampling_params=sp[i] if isinstance(sp, list) else sp,
            rid=rid[i] if isinstance(rid, list) else None if rid is None else f"{rid}_{i}",
            stream=self.stream,
            return_logprob=_item(self.return_logprob, i),
            top_logprobs_num=_item(self.top_logprobs_num, i),
            logprob_start_len=_item(self.logprob_start_len, i),
            return_text_in_logprobs=self.return_text_in_logprobs,
            extra_key=self.extra_key,
            priority=self.priority,
            routing_key=self.routing_key,
            **self.pairing(i),
            data_parallel_rank=self.data_parallel_rank,
            lora_path=_item(self.lora_path, i),
            log_metrics=self.log_metrics,
        )

    def pairing(self, k: int) -> dict[str, Any]:
        """The P/D fields of sub-request k, in SGLang's order: choice j = k // batch_size of
        prompt i = k % batch_size. A list holds one value per prompt or one per sub-request.
        Every sub-request pairs on a room of its own, one both servers (expanding the same
        body) agree on: a room given once is room + k (SGLang's), a prompt's room with n > 1
        is room + j (request_checks refuses a body where these collide)."""
        batch = self.batch_size

        def pick(value: Any) -> Any:
            if not isinstance(value, list):
                return value
            return value[k] if len(value) > batch else value[k % batch]

        room = self.bootstrap_room
        if isinstance(room, int):
            room += k
        elif isinstance(room, list) and len(room) == batch:
            room = room[k % batch] + k // batch
        else:
            room = pick(room)
        return {
            "bootstrap_host": pick(self.bootstrap_host),
            "bootstrap_port": pick(self.bootstrap_port),
            "bootstrap_room": room,
        }


def _item(value: Any, i: int) -> Any:
    """A per-prompt list's i-th value, or the one value every prompt shares."""
    return value[i] if isinstance(value, list) else value


@dataclass
class TokenizedGenerateReqInput:
    """Sent TokenizerManager → Scheduler."""

    rid: str
    input_text: str | None
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    extra_key: str | None = None
    priority: int | None = None
    routing_key: str | None = None
    return_text_in_logprobs: bool = False  # read by the TokenizerManager only
    # P/D disaggregation (SGLang's router sets them): the prefill server's bootstrap address
    # and the room that pairs the request across the prefill and decode servers.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    data_parallel_rank: int | None = None  # --dp-size: the replica asked for (None: any)
    lora_id: str | None = None  # the LoRA adapter's name (its KV namespace is in extra_key)
    log_metrics: bool = True  # False: the server's own (warm-up, probe), not in the counters


@dataclass
class BatchTokenizedGenerateReqInput:
    """Sent TokenizerManager → Scheduler: the sub-requests of one batch (or n > 1) in one
    message, so the scheduler receives them together and can prefill them in one batch (as
    separate messages, an idle scheduler could wake on the first alone)."""

    batch: list[TokenizedGenerateReqInput]


@dataclass
class AbortReq:
    """Sent TokenizerManager → Scheduler: drop the request wherever it is."""

    rid: str
    abort_all: bool = False


@dataclass
class RoomRefusedReq:
    """Sent TokenizerManager → Scheduler: a P/D request was refused before the scheduler saw
    it (a 400 or 503 of the TokenizerManager); the peer paired on its room is told."""

    room: int
    host: str | None
    port: int | None
    message: str


# How long a FlushCacheReq may wait in the scheduler for the hierarchical cache's copies of
# finished requests' KV (the TokenizerManager waits longer for its answer).
FLUSH_WAIT_S = 30.0


# Control requests carry a call id that their replies echo: with --dp-size, the N replies of
# one broadcast are told from a late reply to an earlier one that timed out.
@dataclass
class FlushCacheReq:
    call_id: int = 0


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""
    call_id: int = 0


@dataclass
class LoadLoRAAdapterReq:
    """Load a LoRA adapter into the running server (SGLang's /load_lora_adapter)."""

    lora_name: str
    lora_path: str
    call_id: int = 0
    # Undoing an unload some data-parallel replicas refused: those that still hold the
    # adapter answer success (TokenizerManager._undo_on_replicas).
    restore: bool = False


@dataclass
class UnloadLoRAAdapterReq:
    lora_name: str
    call_id: int = 0
    restore: bool = False  # undoing a load: a replica without the adapter answers success


@dataclass
class LoRAUpdateReqOutput:
    success: bool
    message: str = ""
    call_id: int = 0


@dataclass
class GetServerInfoReq:
    call_id: int = 0


@dataclass
class GetServerInfoReqOutput:
    """Scheduler statistics and gauges (counters since start)."""

    info: dict[str, Any]
    call_id: int = 0


@dataclass
class DashboardSnapshotReq:
    call_id: int = 0


@dataclass
class DashboardSnapshotReqOutput:
    """get_server_info plus the dashboard's live view (Scheduler.dashboard_snapshot)."""

    info: dict[str, Any]
    call_id: int = 0


@dataclass
class BatchTokenIDOutput:
    """Scheduler → Detokenizer: per-request token deltas of one scheduler step.

    All lists are aligned by position; entry i belongs to rids[i].
    """

    rids: list[str]
    finished_reasons: list[dict[str, Any] | None]
    # New output tokens since the last message for this rid.
    output_ids: list[list[int]]
    # Decode state that the detokenizer needs for the first message of a rid.
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    stop_strs: list[list[str]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    # Logprobs of the new tokens (None when not requested).
    output_token_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_top_logprobs: list[list[list[tuple[float, int]]] | None] = field(default_factory=list)
    input_token_logprobs: list[list[tuple[float | None, int]] | None] = field(default_factory=list)
    input_top_logprobs: list[list[list[tuple[float, int]] | None] | None] = field(
        default_factory=list
    )
    # Speculative decoding (empty when it is off): per request, verify steps with drafts,
    # tokens committed per such step, draft tokens proposed and accepted.
    spec_verify_ct: list[int] = field(default_factory=list)
    spec_accept_length: list[float] = field(default_factory=list)
    spec_draft_tokens: list[int] = field(default_factory=list)
    spec_accepted_tokens: list[int] = field(default_factory=list)
    # With a request's first message: its last prompt tokens, decoded before the output and
    # left out of it (a SentencePiece decoder strips the first output token's leading space
    # from a text that starts there), as SGLang's detokenizer does.
    decode_context: list[list[int]] = field(default_factory=list)


@dataclass
class BatchStrOutput:
    """Detokenizer → TokenizerManager: the text delta of each request in one step."""

    rids: list[str]
    finished_reasons: list[dict[str, Any] | None]
    output_strs: list[str]  # text delta since the last message
    output_ids: list[list[int]]  # token delta since the last message
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_top_logprobs: list[list[list[tuple[float, int]]] | None] = field(default_factory=list)
    input_token_logprobs: list[list[tuple[float | None, int]] | None] = field(default_factory=list)
    input_top_logprobs: list[list[list[tuple[float, int]] | None] | None] = field(
        default_factory=list
    )
    spec_verify_ct: list[int] = field(default_factory=list)
    spec_accept_length: list[float] = field(default_factory=list)
    spec_draft_tokens: list[int] = field(default_factory=list)
    spec_accepted_tokens: list[int] = field(default_factory=list)
    # Requests the detokenizer could not decode: they finish here with an abort, and the
    # TokenizerManager stops them in the scheduler.
    failed_rids: list[str] = field(default_factory=list)


@dataclass
class SchedulerError:
    """Scheduler → TokenizerManager: a request was rejected before or while running."""

    rid: str
    message: str
    status_code: int = 400
