"""Overlap scheduling: the FutureMap and the forward thread (seed 000 §10.2–10.4, DESIGN §4).

The overlap loop launches step N+1 before it has processed step N's result, so step N+1 cannot
know the tokens step N sampled. Each launched step gets a range of *future slots*; its sampled
ids are stored there on the worker, and the next step names them by input id `-slot`, resolved
on the worker right before its forward. The scheduler never waits on a token to launch a step.

ForwardThread runs the steps in launch order on one thread, so the scheduler's Python (result
processing, streaming, scheduling) runs while torch computes (its ops release the GIL). On CUDA
the thread issues its work on its own stream after the scheduler's stream and never waits for
the device: a step's inputs go up through pinned memory, its sampled tensors come back the same
way with an event (HostCopy) that only the scheduler waits on, so the thread queues step N+1
behind step N while N runs. A step's sampling can be launched later than its forward
(`launch_sample`): the grammar mask and the penalties of a step need the previous step's
tokens, which only result processing commits.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from radixserve.layers.sampler import SampleOutput, SamplingBatchInfo
from radixserve.managers.tp_worker import GenerationBatchResult
from radixserve.model_executor.forward_batch import ModelWorkerBatch, int64_on
from radixserve.model_executor.model_runner import InputLogprobs


class FutureMap:
    """A ring of next-token ids. A slot is written by one step's sampling and read by the next
    step's forward, so it lives two steps; the ring holds four full batches (slot 0 unused, so
    a future id is always negative). Each slot remembers the request row and rid it was
    allocated for (invariant 9: `check_owner`)."""

    def __init__(self, max_batch_size: int, device: str = "cpu") -> None:
        self.capacity = 4 * max_batch_size
        self.buf = torch.zeros(self.capacity + 1, dtype=torch.int64, device=device)
        self.owner: list[tuple[int | None, str] | None] = [None] * (self.capacity + 1)
        self.next = 1

    def alloc(self, owners: list[tuple[int | None, str]]) -> list[int]:
        n = len(owners)
        if n > self.capacity:
            raise ValueError(f"a batch of {n} exceeds the future map ({self.capacity})")
        if self.next + n > self.capacity + 1:
            self.next = 1
        slots = list(range(self.next, self.next + n))
        self.next += n
        for slot, owner in zip(slots, owners, strict=True):
            self.owner[slot] = owner
        return slots

    def check_owner(self, slot: int, row: int | None, rid: str) -> None:
        assert self.owner[slot] == (row, rid), (
            f"future slot {slot} belongs to {self.owner[slot]}, read by {(row, rid)}"
        )

    def resolve(self, input_ids: list[int]) -> torch.Tensor:
        """The step's input ids on the device, every id -k replaced by the token stored in
        slot k. Whether there are futures is read from the host list: no device sync."""
        ids = int64_on(input_ids, self.buf.device.type)
        if min(input_ids, default=0) >= 0:
            return ids
        return torch.where(ids < 0, self.buf[(-ids).clamp(min=0)], ids)

    def store(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.buf[slots] = token_ids


class ForwardFence:
    """Passed once a step's forward has written its KV (the hierarchical cache's copies of
    that KV wait here). It never waits for the step's sampling, which may wait for the
    scheduler; on CUDA it waits for the forward stream's work up to that point."""

    def __init__(self) -> None:
        self._issued = threading.Event()
        self._cuda_event: Any = None

    def set(self, stream: Any) -> None:
        if stream is not None:
            self._cuda_event = torch.cuda.Event()
            self._cuda_event.record(stream)
        self._issued.set()

    def wait(self) -> None:
        self._issued.wait()
        if self._cuda_event is not None:
            self._cuda_event.synchronize()


class HostCopy:
    """A sampled step's tensors on their way to the host. On CUDA they are copied into pinned
    memory without waiting and an event marks the copies done, so the forward thread goes on
    to queue the next step while this one runs; the scheduler waits on the event when it
    processes the result. On CPU the tensors are already there."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.event: Any = None

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        if self.stream is None:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def record(self) -> None:
        if self.stream is not None:
            self.event = torch.cuda.Event()
            self.event.record(self.stream)

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class InFlightStep:
    """One launched step: its snapshot, then its logits, then its sampled tensors (or its
    error), and once the scheduler waits for it, its result."""

    def __init__(self, mwb: ModelWorkerBatch, slots: list[int], device: str) -> None:
        self.mwb = mwb
        self.slots = int64_on(slots, device)
        self.logits: torch.Tensor | None = None
        self.input_logprobs: InputLogprobs | None = None
        self.sampled: SampleOutput | None = None
        self.host_copy: HostCopy | None = None
        self.result: GenerationBatchResult | None = None
        self.error: BaseException | None = None
        self.sample_launched = mwb.sampling_info is not None
        self.done = threading.Event()
        self.forward_done = ForwardFence()

    def wait(self) -> GenerationBatchResult:
        """The step's result, once its sampled tokens are on the host."""
        self.done.wait()
        if self.error is None and self.result is None:
            assert self.sampled is not None and self.host_copy is not None
            try:
                self.host_copy.wait()
                self.result = GenerationBatchResult.from_sample(
                    self.sampled, self.mwb, self.input_logprobs
                )
            except BaseException as e:  # an error the device reports only now
                self.error = e
            self.sampled = self.input_logprobs = None
        if self.error is not None:
            raise RuntimeError(f"the forward step failed: {self.error!r}") from self.error
        assert self.result is not None
        return self.result


class ForwardThread:
    def __init__(self, worker: Any, future_map: FutureMap, num_threads: int | None) -> None:
        self.worker = worker
        self.future_map = future_map
        self.device = worker.device
        self.num_threads = num_threads or torch.get_num_threads()  # the model's intra-op threads
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.stream = torch.cuda.Stream() if self.device == "cuda" else None
        self.thread = threading.Thread(target=self._run, name="radixserve-forward", daemon=True)
        self.thread.start()

    def launch(self, mwb: ModelWorkerBatch, slots: list[int]) -> InFlightStep:
        """Queue the forward (and its sampling, if mwb carries its SamplingBatchInfo)."""
        step = InFlightStep(mwb, slots, self.device)
        if self.stream is not None:  # the step's tensors come from the scheduler's stream
            self.stream.wait_stream(torch.cuda.current_stream())
        self.jobs.put(lambda: self._forward(step))
        return step

    def launch_sample(
        self, step: InFlightStep, info: SamplingBatchInfo, vocab_mask: torch.Tensor | None
    ) -> None:
        assert not step.sample_launched
        step.sample_launched = True
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
        self.jobs.put(lambda: self._sample(step, info, vocab_mask))

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=10)

    def _run(self) -> None:
        # OpenMP's thread count is per calling thread: a new thread starts from OMP_NUM_THREADS
        # (1 in our child processes), not from the model's torch.set_num_threads.
        torch.set_num_threads(self.num_threads)
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with torch.inference_mode(), ctx:
            while (job := self.jobs.get()) is not None:
                job()

    def _forward(self, step: InFlightStep) -> None:
        try:
            out = self.worker.forward(step.mwb, self.future_map.resolve(step.mwb.input_ids))
            step.logits, step.input_logprobs = out.next_token_logits, out.input_logprobs
        except BaseException as e:  # reported by wait(); the scheduler fails loudly there
            step.error = e
        step.forward_done.set(self.stream)
        info = step.mwb.sampling_info
        if isinstance(info, SamplingBatchInfo):
            self._sample(step, info, None)

    def _sample(
        self, step: InFlightStep, info: SamplingBatchInfo, vocab_mask: torch.Tensor | None
    ) -> None:
        try:
            if step.error is None:
                assert step.logits is not None
                out = self.worker.sample(step.logits, info, vocab_mask, step.mwb)
                self.future_map.store(step.slots, out.next_token_ids)
                step.host_copy = copy = HostCopy(self.stream)
                step.sampled = _sample_output_on(copy, out)
                if step.input_logprobs is not None:
                    step.input_logprobs = _input_logprobs_on(copy, step.input_logprobs)
                copy.record()
        except BaseException as e:
            step.error = e
        finally:
            step.logits = None
            step.done.set()


def _sample_output_on(copy: HostCopy, out: SampleOutput) -> SampleOutput:
    top = out.top_logprobs
    return SampleOutput(
        copy.copy(out.next_token_ids),
        None if out.logprobs is None else copy.copy(out.logprobs),
        None if top is None else (copy.copy(top[0]), copy.copy(top[1])),
    )


def _input_logprobs_on(copy: HostCopy, lp: InputLogprobs) -> InputLogprobs:
    top = lp.top
    return InputLogprobs(
        copy.copy(lp.token_logprobs),
        None if top is None else (copy.copy(top[0]), copy.copy(top[1])),
    )
