"""Scheduler: the batch-centric state machine (seed 000 §9–§10, DESIGN §4).

State: waiting_queue, running_batch, chunked_req, last_batch. Each step:
get_next_batch_to_run (merge the last extend batch into running, prefill first, else decode)
→ run_batch (TpModelWorker) → process_batch_result (append tokens, finish, free, stream).
The overlap loop (default) launches step N on the forward thread, then processes step N−1's
result while N runs (see overlap_utils); `--disable-overlap-schedule` runs the normal loop.
Receives TokenizedGenerateReqInput / AbortReq / control requests through `process_input_requests`
and emits BatchTokenIDOutput through the `send_output` callable given to the constructor (a
ZMQ socket's send in the served engine, a list's append in tests).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from radixserve.args import ServerArgs
from radixserve.distributed.tp_sync import TpSync
from radixserve.io_struct import (
    FLUSH_WAIT_S,
    AbortReq,
    BatchTokenizedGenerateReqInput,
    DashboardSnapshotReq,
    DashboardSnapshotReqOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    LoadLoRAAdapterReq,
    LoRAUpdateReqOutput,
    RoomRefusedReq,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
)
from radixserve.layers.sampler import SamplingBatchInfo, needs_processing
from radixserve.lora.adapter import NO_LORA, LoRAError, parse_lora_paths
from radixserve.managers.grammar_manager import GrammarManager
from radixserve.managers.live_stats import LiveStats
from radixserve.managers.overlap_utils import ForwardThread, FutureMap, InFlightStep
from radixserve.managers.schedule_batch import Req, ScheduleBatch, finish_abort
from radixserve.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from radixserve.managers.scheduler_output import BatchSnapshot, SchedulerOutputMixin
from radixserve.managers.scheduler_stats import NewTokenRatioTracker, SchedulerStats
from radixserve.managers.tp_worker import TpModelWorker
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.hiradix_cache import HiRadixCache, create_hiradix_cache
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.mem_cache.radix_stats import tree_stats
from radixserve.speculative.scheduler_mixin import SpecSchedulerMixin
from radixserve.utils import torch_threads

logger = logging.getLogger(__name__)

ABORTED_BY_CLIENT = "aborted by the client"
# The served loop's wait for input while only grammar compiles or cache copies are pending.
WAIT_POLL_MS = 5


def cpus_for_overlap(device: str) -> bool:
    """Whether the overlap loop can run here without slowing the forward down. On CUDA the
    forward runs on the GPU. On CPU the scheduler's Python and the forward's intra-op threads
    share the cores, and the forward thread runs an OpenMP team of its own next to the main
    thread's (which loading the model created): T threads each, so 2T - 1 threads libgomp
    manages. With more of those than CPUs, libgomp stops spin-waiting and every parallel
    region hands over through futexes: measured on 2 cores, the forward thread's small ops
    ran 1.6-2x slower and overlapping lost 7-49% at every concurrency (docs/performance.md).
    So on CPU it needs a CPU for each thread of both teams (e.g. SMT siblings, or
    --num-threads at most half the CPUs); else the normal loop runs."""
    if device != "cpu":
        return True
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return cpus >= 2 * torch.get_num_threads()


def overlap_on_every_rank(tp_sync: Any, mine: bool) -> bool:
    """Whether the TP ranks run the overlap loop: only where every rank would. The overlap
    loop frees a finished request a step later than the normal one, so ranks on machines of
    other core counts (or started with other --num-threads, a node's own flag) scheduled
    different batches and a collective failed (or the integrity check stopped the server)."""
    chosen = [c for (c,) in tp_sync.group.all_gather_ints([int(mine)])]
    if mine and not all(chosen):
        logger.info("the normal loop on every rank: TP rank %d runs it", chosen.index(0))
    return all(chosen)


class Scheduler(SchedulerOutputMixin, SpecSchedulerMixin):
    def __init__(
        self,
        server_args: ServerArgs,
        send_output: Callable[[Any], None],
        tokenizer: Any = None,
        tp_worker: TpModelWorker | None = None,
        dp_rank: int = 0,
    ) -> None:
        self.server_args = server_args
        self.dp_rank = dp_rank  # which --dp-size replica this is (reported in server info)
        self.send_output = send_output
        self.tokenizer = tokenizer  # only for stop strings; may be None
        self.tp_worker = tp_worker or TpModelWorker(server_args, tokenizer=tokenizer)
        if dp_rank:  # each replica its own random draws (the weights came from the seed alone):
            # with one seed, replicas that had drawn as often sampled the same tokens, and n > 1
            # choices spread over them came back in identical pairs.
            torch.manual_seed(server_args.random_seed + dp_rank)
        runner = self.tp_worker.model_runner
        # The forward runs with the model's intra-op threads; the served scheduler runs the rest
        # of its work on one (run_scheduler_process), so that no second OpenMP team spins next
        # to the forward's.
        self.model_threads: int | None = getattr(runner, "num_threads", None)
        self.model_config = runner.model_config
        self.req_to_token_pool = runner.req_to_token_pool
        self.allocator = runner.token_to_kv_pool_allocator
        self.max_total_num_tokens = runner.max_total_num_tokens
        self.max_running_requests = runner.max_running_requests
        self.context_len = runner.context_len
        self.page_size = server_args.page_size
        self.lora_names = set(parse_lora_paths(server_args.lora_paths))
        tp_group = getattr(self.tp_worker, "tp_group", None)
        # With TP every rank runs this scheduler on the same inputs (TpSync); see step().
        self.tp_sync = (
            TpSync(tp_group) if tp_group is not None and tp_group.world_size > 1 else None
        )
        if server_args.disable_radix_cache:
            self.tree_cache: Any = ChunkCache(
                self.req_to_token_pool, self.allocator, self.page_size
            )
        elif server_args.enable_hierarchical_cache:  # HiCache (no TP: no logical clock needed)
            self.tree_cache = create_hiradix_cache(
                server_args,
                self.req_to_token_pool,
                self.allocator,
                runner.token_to_kv_pool,
                runner.model_path,
                self.context_len,
            )
        else:
            self.tree_cache = RadixCache(
                self.req_to_token_pool,
                self.allocator,
                self.page_size,
                server_args.radix_eviction_policy,
                # TP ranks must evict the same nodes: a logical clock orders accesses the same
                # way on every rank, where time.monotonic() may tie on one rank and not another.
                **({"clock": itertools.count().__next__} if self.tp_sync is not None else {}),
            )
        # The hierarchical cache's copies wait for the forward that writes their KV.
        self.hicache = self.tree_cache if isinstance(self.tree_cache, HiRadixCache) else None
        if self.hicache is not None:
            self.hicache.set_compute_fence(self._last_launched_step)
        self.policy = SchedulePolicy(
            server_args.schedule_policy, self.tree_cache, server_args.random_seed
        )
        self.waiting_queue: list[Req] = []
        self.running_batch = self._new_batch([])
        self.chunked_req: Req | None = None
        self.ending: list[Req] = []  # overlap: left the running batch, last token in flight
        self.decode_waits_for_reservations = False  # P/D decode: no room until KV arrives
        self.last_batch: ScheduleBatch | None = None
        self.grammar_manager = GrammarManager(
            server_args.grammar_backend,
            tokenizer,
            self.model_config.vocab_size,
            self.model_config.eos_token_ids,
        )
        self.ratio = NewTokenRatioTracker(server_args.schedule_conservativeness)
        self.stats = SchedulerStats()
        self.live = LiveStats()  # the dashboard's recent steps and tokens per second
        self.chunked_prefill_size = (
            server_args.chunked_prefill_size if server_args.chunked_prefill_enabled else None
        )
        if self.chunked_prefill_size is not None:
            asked = self.chunked_prefill_size
            self.chunked_prefill_size = max(
                self.page_size, asked // self.page_size * self.page_size
            )
            if self.chunked_prefill_size != asked:
                logger.warning(
                    "--chunked-prefill-size %d is not a multiple of --page-size %d: chunks of %d",
                    asked,
                    self.page_size,
                    self.chunked_prefill_size,
                )
        self.init_speculative(server_args, tokenizer)
        # Speculative steps run in the normal loop (their results decide the next step's input).
        self.enable_overlap = (
            not server_args.disable_overlap_schedule
            and cpus_for_overlap(self.tp_worker.device)
            and self.spec_worker is None
        )
        if self.tp_sync is not None:
            self.enable_overlap = overlap_on_every_rank(self.tp_sync, self.enable_overlap)
        self.result_queue: deque[tuple[BatchSnapshot, InFlightStep]] = deque()
        # Flushes answered by step() (see _flush_may_wait), with the time they may wait until.
        self.pending_flushes: list[tuple[FlushCacheReq, float]] = []
        self.forward_thread: ForwardThread | None = None
        # P/D disaggregation: the prefill side's bootstrap server and transfers, or the decode
        # side's reservations and arriving KV (radixserve.disaggregation).
        self.disagg: Any = None
        if server_args.disaggregation_mode == "prefill":
            from radixserve.disaggregation.prefill import PrefillBootstrap

            self.disagg = PrefillBootstrap(self)
        elif server_args.disaggregation_mode == "decode":
            from radixserve.disaggregation.decode import DecodePrealloc

            self.disagg = DecodePrealloc(self)

    def _last_launched_step(self) -> Any:
        """The hierarchical cache's fence: the last step the overlap loop launched (its KV is
        written once it is done); None when nothing is in flight."""
        return self.result_queue[-1][1].forward_done if self.result_queue else None

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch(reqs, self.req_to_token_pool, self.allocator, self.tree_cache)

    # -- input ----------------------------------------------------------------------------------
    def process_input_requests(self, msgs: list[Any]) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.handle_generate_request(msg)
            elif isinstance(msg, BatchTokenizedGenerateReqInput):
                for one in msg.batch:
                    self.handle_generate_request(one)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg)
            elif isinstance(msg, FlushCacheReq):
                if self._flush_may_wait():
                    self.pending_flushes.append((msg, time.monotonic() + FLUSH_WAIT_S))
                else:
                    self._reply(msg, self.flush_cache())
            elif isinstance(msg, RoomRefusedReq):
                if self.disagg is not None:
                    self.disagg.on_refused(msg)
            elif isinstance(msg, LoadLoRAAdapterReq):
                self._reply(msg, self.load_lora_adapter(msg))
            elif isinstance(msg, UnloadLoRAAdapterReq):
                self._reply(msg, self.unload_lora_adapter(msg))
            elif isinstance(msg, GetServerInfoReq):
                self._reply(msg, GetServerInfoReqOutput(self.get_server_info()))
            elif isinstance(msg, DashboardSnapshotReq):
                self._reply(msg, DashboardSnapshotReqOutput(self.dashboard_snapshot()))
            else:
                logger.error("scheduler got an unknown message %r", type(msg))

    def _reply(self, req: Any, reply: Any) -> None:
        """A control request's answer, with its call id (see io_struct)."""
        reply.call_id = req.call_id
        self.send_output(reply)

    def handle_generate_request(self, recv: TokenizedGenerateReqInput) -> None:
        req = Req(
            recv.rid,
            recv.input_ids,
            recv.sampling_params,
            self.model_config.eos_token_ids,
            origin_input_text=recv.input_text,
            stream=recv.stream,
            return_logprob=recv.return_logprob,
            top_logprobs_num=recv.top_logprobs_num,
            logprob_start_len=recv.logprob_start_len,
            extra_key=recv.extra_key,
            priority=recv.priority,
            routing_key=recv.routing_key,
            lora_id=recv.lora_id,
        )
        req.bootstrap_host = recv.bootstrap_host
        req.bootstrap_port = recv.bootstrap_port
        req.bootstrap_room = recv.bootstrap_room
        req.log_metrics = recv.log_metrics
        self.stats.on_arrival(req)
        error = self._validate(req)
        if error is not None:
            self._reject(req, error)
            return
        sp = req.sampling_params
        # Never generate past the context window, nor past what the KV pool holds for one
        # request (SGLang's max_req_len; the last token's KV is never written): such a
        # request ends by length; it was aborted as "no longer fits" once it filled the pool.
        pool_room = self.max_total_num_tokens + 1
        room = min(self.context_len, pool_room) - len(req.origin_input_ids)
        req.open_ended = sp.max_new_tokens is None
        if sp.max_new_tokens is None or sp.max_new_tokens > room:
            sp.max_new_tokens = room
        if self.grammar_manager.key_of(req) is not None:
            error = self.grammar_manager.add(req)  # waits in the grammar queue until compiled
            if error is not None:
                self._reject(req, error)
            return
        self._enqueue(req)

    def _enqueue(self, req: Req) -> None:
        """To the waiting queue; a P/D request first pairs with its peer (its bootstrap room).
        Without a room a P/D server serves the request alone, as a plain server would."""
        if self.disagg is not None and req.bootstrap_room is not None:
            self.disagg.add(req)
        else:
            self.waiting_queue.append(req)

    def _reject(self, req: Req, message: str) -> None:
        self._finish_queued_abort(req, message, status_code=400)

    def move_ready_grammar_requests(self) -> None:
        statuses = None
        if self.tp_sync is not None:  # every rank admits the same ones in the same round
            statuses = self.tp_sync.agree_statuses(self.grammar_manager.statuses())
        ready, failed = self.grammar_manager.pop_ready(statuses)
        for req in ready:
            self._enqueue(req)
        for req, message in failed:
            self._reject(req, message)

    def _validate(self, req: Req) -> str | None:
        n = len(req.origin_input_ids)
        if n == 0:
            return "the prompt is empty"
        if n >= self.context_len:
            return (
                f"the prompt has {n} tokens, which does not fit the context length of "
                f"{self.context_len} tokens"
            )
        if n + 1 > self.max_total_num_tokens:
            return (
                f"the prompt has {n} tokens but the KV cache holds only "
                f"{self.max_total_num_tokens}; it can never be scheduled"
            )
        if (
            max(req.origin_input_ids) >= self.model_config.vocab_size
            or min(req.origin_input_ids) < 0
        ):
            return "the prompt has a token id outside the vocabulary"
        if (  # (the TokenizerManager checked the fields' types and ranges)
            self.server_args.disaggregation_mode == "decode"
            and req.bootstrap_room is not None
            and not req.bootstrap_host
        ):
            return "a request with a bootstrap_room needs the prefill server's bootstrap_host"
        if req.lora_id is not None and req.lora_id not in self.lora_names:
            return f"no LoRA adapter named {req.lora_id!r} is loaded"
        return None

    def abort_request(self, recv: AbortReq) -> None:
        """Abort wherever the request is: the grammar queue, the waiting queue (queued requests
        hold no KV and finish at once), or in flight — running, chunked, or only in the batch
        that just ran (before it merges into running) — where it is released at the next
        round (`release_aborted`) or at its next result."""

        def hit(r: Req) -> bool:
            return recv.abort_all or r.rid == recv.rid

        for queue in (self.grammar_manager.queue, self.waiting_queue):
            for req in [r for r in queue if hit(r)]:
                queue.remove(req)
                self._finish_queued_abort(req, ABORTED_BY_CLIENT)
        if self.disagg is not None:
            self.disagg.abort(hit)
        for req in self._in_flight_reqs():
            if hit(req) and not req.finished():
                req.to_abort = ABORTED_BY_CLIENT

    def _in_flight_reqs(self) -> list[Req]:
        reqs = list(self.running_batch.reqs)
        if self.last_batch is not None:
            reqs += [r for r in self.last_batch.reqs if all(r is not x for x in reqs)]
        if self.chunked_req is not None and all(self.chunked_req is not x for x in reqs):
            reqs.append(self.chunked_req)
        return reqs

    def _finish_queued_abort(self, req: Req, message: str, status_code: int | None = None) -> None:
        """A request that holds no KV (new, queued, or retracted) ends here."""
        req.finished_reason = finish_abort(message, status_code)
        if self.disagg is not None:
            self.disagg.on_aborted(req)
        self.stats.on_aborted(req)
        self.stream_output([req])

    def release_aborted(self) -> None:
        """Finish the aborted requests between steps, so they free their KV now rather than
        after another forward: waiting (e.g. retracted while the abort was pending), running,
        and the chunked request."""
        for req in [r for r in self.waiting_queue if r.to_abort is not None]:
            self.waiting_queue.remove(req)
            self._finish_queued_abort(req, req.to_abort)
        aborted = [r for r in self.running_batch.reqs if r.to_abort is not None]
        for req in aborted:
            req.finished_reason = finish_abort(req.to_abort)
            if self.disagg is not None:
                self.disagg.on_aborted(req)
            self.cap_to_draft_kv(req)
            self.tree_cache.cache_finished_req(req)
            self.stats.on_aborted(req)
        if aborted:
            self.running_batch.filter_batch()
            self.stream_output(aborted)
        chunked = self.chunked_req
        if chunked is not None and chunked.to_abort is not None:
            self._abort_chunked(chunked)
            self.stream_output([chunked])

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> ScheduleBatch | None:
        """Run one iteration of the loop; returns the batch it ran or launched (or None)."""
        overlap = self.enable_overlap and self.spec_worker is None
        batch = self._overlap_step() if overlap else self._normal_step()
        self.last_batch = batch
        self.live.on_step(batch, self.stats)
        if batch is None and self.hicache is not None:
            self.hicache.wait_idle(0.005)  # only cache copies run: wait for one, don't spin
        if self.server_args.enable_integrity_checks:
            self.check_integrity()
            if self.tp_sync is not None:  # invariant 10: every rank scheduled this step
                self.tp_sync.check_schedule(batch, self.allocator, self.tree_cache)
        if self.pending_flushes:
            self._answer_flushes()
        return batch

    def _flush_may_wait(self) -> bool:
        """Whether a flush waits (answered by step(), the loop serving meanwhile): for the
        last step of requests that have all finished (it was refused as "requests are
        running" right after a response), or, with none held, for the hierarchical cache's
        copies of their KV (a slow storage tier held the whole loop for up to FLUSH_WAIT_S)."""
        if self.has_work(cache_copies=False):
            return self._only_finished_left()
        return self.hicache is not None and self.hicache.has_pending()

    def _answer_flushes(self) -> None:
        now, waiting = time.monotonic(), []
        for msg, deadline in self.pending_flushes:
            if now < deadline and self._flush_may_wait():
                waiting.append((msg, deadline))
            else:  # (refused if new requests came meanwhile, or the copies did not land)
                self._reply(msg, self.flush_cache())
        self.pending_flushes = waiting

    def _normal_step(self) -> ScheduleBatch | None:
        batch = self.get_next_batch_to_run()
        if batch is not None:
            snapshot = BatchSnapshot.of(batch)
            start = time.perf_counter()
            result = self.run_batch(batch, snapshot)
            if self.spec_worker is not None and batch.forward_mode.is_decode():
                self._record_step_cost(batch, time.perf_counter() - start)
            self.process_batch_result(snapshot, result)
        return batch

    def _overlap_step(self) -> ScheduleBatch | None:
        """One iteration of event_loop_overlap: launch this step, then process the previous
        one while it runs (seed 000 §10.2)."""
        if self.forward_thread is None:
            self.future_map = FutureMap(self.max_running_requests, self.tp_worker.device)
            self.forward_thread = ForwardThread(self.tp_worker, self.future_map, self.model_threads)
        batch = self.get_next_batch_to_run()
        if batch is not None:
            snapshot, mwb = self._snapshot_for_launch(batch)
            last = self.result_queue[-1][0] if self.result_queue else None
            if (
                last is not None
                and last.forward_mode.is_extend()
                and batch.forward_mode.is_extend()
            ):
                # Two prefills in a row: the first one's tokens go out before the second runs
                # (otherwise its TTFT grows by a whole prefill).
                self._process_next_result()
            self.result_queue.append((snapshot, self.forward_thread.launch(mwb, snapshot.futures)))
        while len(self.result_queue) > (batch is not None):
            self._process_next_result()
        self.launch_batch_sample_if_needed()
        return batch

    def _snapshot_for_launch(self, batch: ScheduleBatch) -> tuple[BatchSnapshot, Any]:
        """Everything the step and its result processing read, taken before anything else
        changes the requests (processing a result may finish some of them)."""
        snapshot = BatchSnapshot.of(batch)
        mwb = batch.get_model_worker_batch()
        rows = [(r.req_pool_idx, r.rid) for r in batch.reqs]
        slots = self.future_map.alloc(rows)
        sampled = [r for r, chunk in zip(batch.reqs, snapshot.chunk_rows, strict=True) if not chunk]
        # Grammar masks and penalties read every previous token: that sampling waits until
        # the previous step's result is processed (`launch_batch_sample_if_needed`).
        if not any(r.grammar is not None or needs_processing(r) for r in sampled):
            pending = [int(r.pending_future is not None) for r in batch.reqs]
            mwb.sampling_info = SamplingBatchInfo.from_reqs(
                batch.reqs, self.model_config.vocab_size, self.tp_worker.device, pending
            )
        if self.server_args.enable_integrity_checks:  # invariant 9
            for r in batch.reqs:
                if r.pending_future is not None:
                    self.future_map.check_owner(r.pending_future, r.req_pool_idx, r.rid)
        for r, slot, chunk in zip(batch.reqs, slots, snapshot.chunk_rows, strict=True):
            if not chunk:
                r.pending_future = slot
        snapshot.futures = slots
        return snapshot, mwb

    def launch_batch_sample_if_needed(self) -> None:
        if not self.result_queue:
            return
        snapshot, step = self.result_queue[-1]
        if step.sample_launched:
            return
        # Every earlier step is processed: the requests' outputs and grammars are up to date.
        info = SamplingBatchInfo.from_reqs(
            snapshot.reqs, self.model_config.vocab_size, self.tp_worker.device
        )
        mask = self.grammar_manager.vocab_mask(snapshot.reqs, skip=snapshot.chunk_rows)
        self.forward_thread.launch_sample(step, info, mask)

    def _process_next_result(self) -> None:
        snapshot, step = self.result_queue.popleft()
        self.process_batch_result(snapshot, step.wait())

    def event_loop(self, recv_requests: Callable[[], list[Any]]) -> None:
        """SGLang's event_loop_overlap (or event_loop_normal with --disable-overlap-schedule);
        the served process runs the same iterations with its heartbeat (scheduler_process)."""
        while True:
            self.process_input_requests(recv_requests())
            if self.step() is None:
                self.on_idle()

    def on_idle(self) -> None:
        """Called when nothing ran; the served loop sleeps on its socket instead of spinning."""
        time.sleep(0.001)

    def _last_batch_unfinished(self) -> bool:
        return self.last_batch is not None and any(not r.finished() for r in self.last_batch.reqs)

    def _only_finished_left(self) -> bool:
        """Whether every request the scheduler still holds has finished: their last step's
        result is in flight (overlap) or they leave the running batch at the next step. A
        flush right after a response (its client has it all) is answered after that step; it
        was refused as "requests are running"."""
        held = [*self.running_batch.reqs, *(r for snap, _ in self.result_queue for r in snap.reqs)]
        if self.last_batch is not None:
            held += self.last_batch.reqs
        return (
            not self.waiting_queue
            and not self.chunked_req
            and not self.grammar_manager.queue
            and not (self.disagg is not None and self.disagg.has_work())
            and all(r.finished() for r in held)
        )

    def has_work(self, cache_copies: bool = True) -> bool:
        """Requests to serve, or (`cache_copies`) the hierarchical cache's copies in flight."""
        return bool(
            self.waiting_queue
            or self.running_batch.reqs
            or self.chunked_req
            or self._last_batch_unfinished()
            or self.grammar_manager.queue
            or self.result_queue
            or (cache_copies and self.hicache is not None and self.hicache.has_pending())
            or (self.disagg is not None and self.disagg.has_work())
        )

    def poll_timeout_ms(self, idle_ms: int) -> int:
        """How long the served loop may wait for input before the next step: 0 with compute
        to do; waiting only for grammar compiles or the hierarchical cache's copies, which
        end on other threads without waking the loop, WAIT_POLL_MS (it polled them flat out,
        a core's worth of CPU beside the compile); with a P/D peer to wait for, until its
        message (the channel's socket is polled too) or the peer's own interval; else idle_ms."""
        busy = (
            self.waiting_queue
            or (self.running_batch.reqs and not self.decode_waits_for_reservations)
            or self.chunked_req
            or self.result_queue
            or self._last_batch_unfinished()
        )
        if busy:
            return 0
        timeout = idle_ms
        if self.grammar_manager.queue or (self.hicache is not None and self.hicache.has_pending()):
            timeout = min(timeout, WAIT_POLL_MS)
        if self.disagg is not None and self.disagg.has_work():
            timeout = min(timeout, self.disagg.poll_interval_ms())
        return timeout

    def poll_sockets(self) -> list[Any]:
        """Sockets whose messages should wake the served loop besides its input."""
        return [self.disagg.channel.inbound] if self.disagg is not None else []

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if self.hicache is not None:
            self.hicache.poll()  # apply finished cache copies (loads, backups, storage)
        last = self.last_batch
        if last is not None and last.forward_mode.is_extend():
            # Requests that just prefilled join the running batch (minus the chunked one); their
            # prompts go into the tree now, so later requests share them.
            decoding = {id(r) for r in last.decoding_reqs}
            # A P/D prefill request ends with its first token: it never decodes here.
            last.filter_batch(
                [
                    r
                    for r in last.reqs
                    if not r.finished() and r is not self.chunked_req and r.disagg_target is None
                ]
            )
            for r in last.reqs:
                if id(r) not in decoding:
                    self.tree_cache.cache_unfinished_req(r)
            if last.reqs:
                self.running_batch.merge_batch(last)
        self.running_batch.filter_batch()
        # Overlap: the step in flight gives these their last token. Another step would compute
        # a token to discard, and its KV slot could be the one the pool lacks (a request that
        # fits the pool exactly was aborted one token before its end). They hold their rows
        # until that step's result is processed.
        self.ending = [r for r in self.running_batch.reqs if r.ends_with_pending_token()]
        if self.ending:
            self.running_batch.filter_batch(
                [r for r in self.running_batch.reqs if not r.ends_with_pending_token()]
            )
        if self.disagg is not None:
            self.poll_disaggregation()
        self.release_aborted()
        new_batch = self.get_new_batch_prefill()
        self.refuse_past_queue_limit()
        if new_batch is not None:
            return new_batch
        if self.running_batch.is_empty():
            return None
        return self.update_running_batch(self.running_batch)

    def refuse_past_queue_limit(self) -> None:
        """--max-queued-requests: new requests that this round could not start wait, up to
        that many; the latest to arrive past it get a 503 now (SGLang bounds its waiting queue
        alike), or with --schedule-policy priority the lowest-ranked (SGLang's: a newcomer
        that ranks higher takes the place of one that ranks lower; on a tie, it is refused).
        Retracted requests are not new: they always wait."""
        limit = self.server_args.max_queued_requests
        if limit is None:
            return
        new = [r for r in self.waiting_queue if not r.admitted]
        if len(new) <= limit:
            return
        if self.server_args.schedule_policy == "priority":
            new.sort(key=lambda r: (-(r.priority or 0), r.arrival_time))
        else:
            new.sort(key=lambda r: r.arrival_time)
        for req in new[limit:]:
            self.waiting_queue.remove(req)
            message = f"the request queue is full ({limit} waiting, --max-queued-requests)"
            self._finish_queued_abort(req, message + "; retry later", status_code=503)

    def poll_disaggregation(self) -> None:
        """The peer's messages; on the decode side, requests whose KV arrived join the running
        batch as if they had just prefilled here (their first token is streamed now)."""
        arrived = self.disagg.poll()
        if not arrived:
            return
        joining = [r for r in arrived if not r.finished()]
        for req in arrived:
            if req.finished():  # its first token already ends it (EOS, max_new_tokens 1, stop)
                self._on_finished(req)
        if joining:
            self.running_batch.merge_batch(self._new_batch(joining))
        self.stream_output(arrived)

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if self.grammar_manager.queue:
            self.move_ready_grammar_requests()
        if self.chunked_req is None and not self.waiting_queue:
            return None
        running = self.running_batch.reqs
        occupying = running + self.ending  # the request rows in use
        if len(occupying) >= self.max_running_requests and self.chunked_req is None:
            return None
        order = self.policy.calc_priority(self.waiting_queue, running, self.chunked_req)
        # Mixed decode tokens come out of the chunk budget; where they would leave less than a
        # page of it, no prompt could be admitted (a prompt takes whole pages), so this round
        # does not mix (with page 16, chunks of 16 and one request running, none was admitted
        # until every running request had finished).
        chunk = self.chunked_prefill_size
        mixed = (
            self.server_args.enable_mixed_chunk
            and bool(running)
            and (chunk is None or chunk - len(running) >= self.page_size)
        )
        adder = PrefillAdder(
            self.tree_cache,
            self.allocator,
            occupying,
            self.ratio.value,
            self.server_args.max_prefill_tokens,
            chunk,
            self.max_running_requests,
            self.page_size,
            mixed_decode_tokens=len(running) if mixed else 0,
            max_loras=self.server_args.max_loras_per_batch,
        )
        if self.chunked_req is not None:
            if self.chunked_req.chunk_to_cache:  # share the chunk it computed last round
                self.chunked_req.chunk_to_cache = False
                self.tree_cache.cache_unfinished_req(self.chunked_req)
            self.chunked_req.init_next_chunk()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        # An adapter that does not fit beside the running ones (--max-loras-per-batch) gets
        # its turn once they drain: no request of an adapter is admitted meanwhile, whatever
        # the policy's order (LPM put the running adapter's requests, cached, first).
        lora_blocked = any(not adder.lora_fits(r) for r in self.waiting_queue)
        for req in list(self.waiting_queue):
            if adder.new_chunked_req is not None or self.chunked_req is not None:
                break
            if req.rid in order.held and adder.can_run_list:
                continue  # in-batch prefix caching: a representative computes it first
            if not adder.lora_fits(req) or (lora_blocked and req.lora_id is not None):
                # --max-loras-per-batch other adapters are in the batch already. Requests of
                # adapters behind it wait too (SGLang stops admitting there): those of the
                # running adapters kept them in the batch, and a steady stream of them kept
                # this one waiting for ever. Base-model requests hold no adapter: they pass.
                lora_blocked = True
                continue
            if self.hicache is not None and not self.hicache.prepare(req, adder.rem_total_tokens):
                continue  # its prefix is loading from the host / storage tier
            if not order.matched:
                req.init_next_round_input(self.tree_cache)
            if adder.add_one_req(req) != AddReqResult.CONTINUE:
                break
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        intermediate = self.chunked_req if self.chunked_req in adder.can_run_list else None
        if intermediate is not None:  # this round computes an intermediate chunk
            intermediate.chunk_to_cache = True
        can_run = adder.can_run_list
        if not can_run:
            return None
        admitted = {id(r) for r in can_run}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        for r in can_run:
            if not r.admitted:
                r.admitted = True
                r.cached_tokens = len(r.prefix_indices)
                self.stats.on_first_admission(r)
        batch = self._new_batch(can_run)
        batch.chunked_req = intermediate
        batch.prepare_for_extend()
        self.stats.num_prefill_batches += 1
        # The running requests decode beside every chunk, intermediate ones included (SARATHI's
        # decode-maximal batching, SGLang's mix_with_running): mixing only the last chunk left
        # them waiting for a long prompt's whole prefill, as with mixing off.
        if mixed and self._decode_fits(self.running_batch):
            batch.mix_with_running(self.running_batch)
            self.running_batch = self._new_batch([])
        return batch

    def update_running_batch(self, batch: ScheduleBatch) -> ScheduleBatch | None:
        """Make room for one decode step: evict, wait for requests ending in the step in flight
        (overlap), retract running requests (one stays), retract the chunked request, wait
        where P/D reservations hold the room, and only then abort (never crash). With
        speculative decoding the step verifies draft trees when that pays and fits."""
        self.decode_waits_for_reservations = False
        if self.spec_worker is not None and self._prepare_verify(batch):
            self.ratio.on_decode_step()
            return batch
        if not self._decode_fits(batch) and self.hicache is not None:
            self._await_cache_copies(lambda: self._decode_fits(batch))
        if not self._decode_fits(batch) and self.ending:
            # Overlap: requests whose last token is in flight give their slots back once that
            # step's result is processed. Wait for it (one round) rather than retract or abort
            # (a request that fits the pool alone was aborted beside one ending).
            return None
        if not self._decode_fits(batch):
            retracted = batch.retract_decode(lambda reqs: self._decode_fits(self._new_batch(reqs)))
            if retracted:
                self.stats.num_retractions += len(retracted)
                self.waiting_queue = retracted + self.waiting_queue
                self.ratio.on_retract(batch.reqs + retracted)
                logger.info("retracted %d requests; KV pool is full", len(retracted))
            if not self._decode_fits(batch):
                self._retract_chunked_req()
            if not self._decode_fits(batch) and self.disagg and self.disagg.holds_reservations():
                # P/D decode: reservations for requests whose KV is on its way hold the rest of
                # the pool. The last request waits, its KV kept, rather than end as if it could
                # never fit: the KV arrives (and the two retract as usual) or the reservation
                # fails and frees its slots. (Retracted, it re-prefilled thousands of times.)
                self.decode_waits_for_reservations = True
                return None
            if not self._decode_fits(batch):
                last = batch.reqs[0]
                if last.pending_future is not None:
                    # Overlap: its step in flight computes a token (its KV is written): take
                    # it first (one round), as the normal loop would have; it was dropped.
                    return None
                last.finished_reason = finish_abort(
                    "the request no longer fits in the KV cache (prompt + output exceed the pool)",
                    status_code=400 if not last.output_ids else None,
                )
                self.tree_cache.cache_finished_req(last, is_insert=False)
                self.stats.on_aborted(last)
                self.stream_output([last])
                batch.filter_batch()
                return None
        else:
            self.ratio.on_decode_step()
        batch.prepare_for_decode()
        return batch

    def _retract_chunked_req(self) -> None:
        """The request being prefilled in chunks gives back its KV (it starts again later)
        before a running request is aborted: its next chunk gets no budget while the running
        requests' reservations fill the pool, so it held its slots until the last running
        request ran out of room and was aborted though it fits the pool alone."""
        req = self.chunked_req
        if req is None or any(req is r for snap, _ in self.result_queue for r in snap.reqs):
            return  # (a chunk of it in flight: its slots are being written)
        self.tree_cache.cache_finished_req(req, is_insert=False)
        req.reset_for_retract()
        self.chunked_req = None
        self.waiting_queue.insert(0, req)
        self.stats.num_retractions += 1
        logger.info("retracted the chunked request; KV pool is full")

    def _await_cache_copies(
        self,
        fits: Callable[[], bool],
        limit_s: float = 30.0,
        pending: Callable[[], bool] | None = None,
    ) -> None:
        """Slots held by the hierarchical cache's copies in flight (write-through backups of
        finished requests' KV, loads) come back when the copies land: wait for them, a bounded
        time, before retracting or aborting a request for want of room. `pending`: what is
        waited for (default: the copies that hold device slots; a storage write past its
        device read frees none)."""
        hicache = self.hicache
        assert hicache is not None
        pending = pending or hicache.holds_device_slots
        deadline = time.monotonic() + limit_s
        while not fits() and pending() and time.monotonic() < deadline:
            hicache.wait_idle(0.05)
            hicache.poll()

    def _decode_fits(self, batch: ScheduleBatch) -> bool:
        need = batch.decode_slots_needed()
        return need <= self.allocator.available_size() + self.tree_cache.evictable_size()

    def run_batch(self, batch: ScheduleBatch, snapshot: BatchSnapshot) -> Any:
        """One whole step in the normal loop."""
        mwb = batch.get_model_worker_batch()
        mask = self.grammar_manager.vocab_mask(batch.reqs, skip=snapshot.chunk_rows)
        if batch.spec_info is None:
            mwb.sampling_info = SamplingBatchInfo.from_reqs(
                batch.reqs, self.model_config.vocab_size, self.tp_worker.device
            )
        with torch_threads(self.model_threads):
            if batch.spec_info is not None:
                assert self.spec_worker is not None
                return self.spec_worker.forward_verify(mwb, batch.spec_info, batch.reqs, mask)
            if self.spec_worker is not None and batch.forward_mode.is_extend():
                return self.spec_worker.forward_extend(mwb, mask)
            return self.tp_worker.forward_batch_generation(mwb, mask)

    def close(self) -> None:
        """Stop the forward thread (tests build many schedulers in one process)."""
        if self.forward_thread is not None:
            self.forward_thread.close()
            self.forward_thread = None
        if self.hicache is not None:
            self.hicache.close()
        if self.disagg is not None:
            self.disagg.close()
            self.disagg = None
        self.grammar_manager.close()

    # -- control (LoRA adapters loaded and unloaded while serving, the cache, info) --------------
    def load_lora_adapter(self, req: LoadLoRAAdapterReq) -> LoRAUpdateReqOutput:
        manager = getattr(self.tp_worker.model_runner, "lora_manager", None)
        if manager is None:
            return LoRAUpdateReqOutput(False, NO_LORA)
        if req.restore and req.lora_name in self.lora_names:
            return LoRAUpdateReqOutput(True)
        error = None
        try:
            manager.load(req.lora_name, req.lora_path)
        except LoRAError as e:
            error = str(e)
        except Exception as e:  # a file no check foresaw: the adapter is refused, not the server
            logger.exception("loading LoRA adapter %r failed", req.lora_name)
            error = f"cannot load LoRA adapter {req.lora_name!r}: {type(e).__name__}: {e}"
        if self.tp_sync is not None:  # every rank serves the adapter, or none does
            agreed = self.tp_sync.agree(error)
            if agreed is not None and error is None:
                manager.unload(req.lora_name)
            error = agreed
        if error is not None:
            return LoRAUpdateReqOutput(False, error)
        self.lora_names.add(req.lora_name)
        return LoRAUpdateReqOutput(True)

    def unload_lora_adapter(self, req: UnloadLoRAAdapterReq) -> LoRAUpdateReqOutput:
        """Refused while a request of the adapter is anywhere in the scheduler (the
        TokenizerManager has waited for those it sent)."""
        name = req.lora_name
        manager = getattr(self.tp_worker.model_runner, "lora_manager", None)
        if manager is None or name not in self.lora_names:
            if req.restore:
                return LoRAUpdateReqOutput(True)
            return LoRAUpdateReqOutput(False, f"no LoRA adapter named {name!r} is loaded")
        live = [*self._in_flight_reqs(), *self.waiting_queue, *self.grammar_manager.queue]
        if self.disagg is not None:
            live += self.disagg.queued_reqs()
        users = sum(1 for r in live if r.lora_id == name and not r.finished())
        if users:
            return LoRAUpdateReqOutput(
                False, f"{users} requests still use LoRA adapter {name!r}; unload it after them"
            )
        # A launched step reads its requests' adapters in its forward, and a request that
        # ended at the step before it (by a stop token) is still in it: its forward goes first.
        for snapshot, step in self.result_queue:
            if any(r.lora_id == name for r in snapshot.reqs):
                step.done.wait()
        manager.unload(name)
        self.lora_names.discard(name)
        return LoRAUpdateReqOutput(True)

    def flush_cache(self) -> FlushCacheReqOutput:
        if self.has_work(cache_copies=False):
            return FlushCacheReqOutput(False, "cannot flush the cache while requests are running")
        if self.hicache is not None and self.hicache.has_pending():
            # (a FlushCacheReq waits up to FLUSH_WAIT_S for them first: _flush_may_wait)
            return FlushCacheReqOutput(
                False,
                "cannot flush the cache while the hierarchical cache's copies are in flight "
                f"(still after {FLUSH_WAIT_S:g} s: a slow storage tier?); try again",
            )
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        return FlushCacheReqOutput(True)

    def startup_summary(self) -> dict[str, Any]:
        """What the server's start-up line reports (sent with the scheduler's "ready")."""
        runner = self.tp_worker.model_runner
        args = self.server_args
        backend = getattr(runner, "attn_backend", None)
        graphs = getattr(runner, "cuda_graph_runner", None)
        return {
            "dtype": str(getattr(runner, "dtype", "")).removeprefix("torch."),
            "device": self.tp_worker.device,
            "threads": self.model_threads or torch.get_num_threads(),
            "attention_backend": getattr(backend, "name", None),
            "quantization": args.quantization,
            "chunked_prefill_size": self.chunked_prefill_size,
            "overlap": self.enable_overlap,
            "speculative_algorithm": args.speculative_algorithm,
            # decode steps replayed from CUDA graphs: the largest batch a graph covers
            "cuda_graph_max_bs": graphs.batch_sizes[-1] if graphs is not None else None,
        }

    def get_server_info(self) -> dict[str, Any]:
        used = (
            self.max_total_num_tokens
            - self.allocator.available_size()
            - self.tree_cache.evictable_size()
        )
        # Queued: the waiting queue, and the requests P/D holds outside it (waiting for their
        # peer's reservation or KV: the metrics and /get_load showed a server holding 60 of
        # them as idle).
        queued = [*self.waiting_queue, *(self.disagg.queued_reqs() if self.disagg else [])]
        info = self.stats.snapshot(
            # The running batch, the request prefilling in chunks, those that just prefilled.
            running=sum(not r.finished() for r in self._in_flight_reqs()),
            queued=len(queued),
            # What the queue will add to the KV (SGLang's /get_load counts it: its router
            # balances on it; a long queue looked like an idle server).
            queued_tokens=sum(len(r.origin_input_ids) + len(r.output_ids) for r in queued),
            token_usage=used / self.max_total_num_tokens,
            num_used_tokens=used,
            num_grammar_queue_reqs=len(self.grammar_manager.queue),
            **self.live.rates(),
            new_token_ratio=self.ratio.value,
            available_tokens=self.allocator.available_size(),
            evictable_tokens=self.tree_cache.evictable_size(),
            protected_tokens=self.tree_cache.protected_size(),
            max_total_num_tokens=self.max_total_num_tokens,
            max_running_requests=self.max_running_requests,
            free_request_rows=self.req_to_token_pool.available_size(),
            dp_rank=self.dp_rank,
        )
        if self.hicache is not None:
            info.update(self.hicache.tier_stats())
        if self.spec_worker is not None:  # what the speculation controller has measured
            info["spec_step_cost_ms"] = self.spec_controller.measured_costs_ms()
        if self.disagg is not None:  # requests waiting for their P/D peer, transfers
            info["disaggregation"] = self.disagg.stats()
        if getattr(self.tp_worker.model_runner, "lora_manager", None) is not None:
            info["lora_adapters"] = sorted(self.lora_names)
        return info

    def dashboard_snapshot(self) -> dict[str, Any]:
        """get_server_info plus what the dashboard draws: the chunked request, the recent steps,
        tokens per second (LiveStats) and a bounded walk of the tree (only done here)."""
        info = self.get_server_info()
        info["chunked"] = int(self.chunked_req is not None)
        info["grammar_queue"] = len(self.grammar_manager.queue)
        info.update(self.live.snapshot())
        info["tree"] = tree_stats(self.tree_cache.root_node)
        return info

    def check_integrity(self) -> None:
        self.tree_cache.check_integrity()
        self.allocator.check_integrity()
        self.req_to_token_pool.check_integrity()
        if not self.has_work():
            self.assert_drained()

    def assert_drained(self) -> None:
        """Invariant 12: with nothing running, every slot is free or evictable, no lock held."""
        free = self.allocator.available_size() + self.tree_cache.evictable_size()
        assert free == self.max_total_num_tokens, (
            f"KV slots leaked: {free} free+evictable of {self.max_total_num_tokens}"
        )
        assert self.tree_cache.protected_size() == 0, "a radix node is still locked"
        rows = self.req_to_token_pool.available_size()
        assert rows == self.req_to_token_pool.size, "a request row leaked"
        if self.hicache is not None:
            self.hicache.check_drained()
