"""Scheduler statistics (counters and gauges) and the new_token_ratio tracker (DESIGN §4)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

RETRACT_DECODE_STEPS = 20
DECAY_STEPS = 600


class NewTokenRatioTracker:
    """How much of each running request's remaining max_new_tokens admission reserves.

    Starts at min(0.7 × conservativeness, 1), decays linearly to init × 0.14 over 600 decode
    steps without retraction, and jumps back up after a retraction.
    """

    def __init__(self, conservativeness: float = 1.0) -> None:
        self.init = min(0.7 * conservativeness, 1.0)
        self.min = self.init * 0.14
        self.decay = (self.init - self.min) / DECAY_STEPS
        self.value = self.init

    def on_decode_step(self) -> None:
        self.value = max(self.value - self.decay, self.min)

    def on_retract(self, reqs: list[Any]) -> None:
        out = sum(len(r.output_ids) for r in reqs)
        total_max = sum(r.max_new_tokens for r in reqs)
        self.value = min(1.0, (out + RETRACT_DECODE_STEPS * len(reqs)) / (total_max + 1))


@dataclass
class SchedulerStats:
    # Clients' requests only: the server's own (its warm-up, /health_generate's probes) are
    # not counted (a probe every 10 s added 8,640 requests a day).
    num_requests: int = 0  # arrived
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_retractions: int = 0
    num_prefill_batches: int = 0
    num_decode_batches: int = 0
    # Speculative decoding, over the request-steps that verified at least one draft.
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_committed_tokens: int = 0  # accepted drafts plus bonus tokens

    def on_verify(self, drafts: int, accepted: int, committed: int) -> None:
        self.spec_verify_ct += 1
        self.spec_draft_tokens += drafts
        self.spec_accepted_tokens += accepted
        self.spec_committed_tokens += committed

    def on_arrival(self, req: Any) -> None:
        self.num_requests += req.log_metrics

    def on_finished(self, req: Any) -> None:
        """However it ends (num_requests - num_finished is what is in flight)."""
        if req.log_metrics:
            self.num_finished += 1
            reason = req.finished_reason
            self.num_aborted += bool(reason and reason["type"] == "abort")

    def on_aborted(self, req: Any) -> None:
        """A request aborted outside a step's results (queued, running, or refused on its
        arrival: more were counted aborted than had arrived, when admission counted them)."""
        if req.log_metrics:
            self.num_aborted += 1
            self.num_finished += 1

    def on_first_admission(self, req: Any) -> None:
        if req.log_metrics:
            self.prompt_tokens += len(req.origin_input_ids)
            self.cached_tokens += req.cached_tokens

    def snapshot(self, **gauges: Any) -> dict[str, Any]:
        out = asdict(self)
        out["spec_accept_length"] = (
            self.spec_committed_tokens / self.spec_verify_ct if self.spec_verify_ct else 0.0
        )
        out["spec_accept_rate"] = (
            self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0
        )
        out.update(gauges)
        return out
