"""The scheduler process: ZMQ in (TokenizerManager), ZMQ out (Detokenizer), the event loop.

A crash here is logged with its traceback and ends the process with a non-zero status; the
parent watches its children and shuts the server down rather than hang. Every loop iteration
writes the time into a shared `heartbeat` value, so the server can tell a scheduler stuck in
one step from a long generation that streams nothing (and reads it without depending on its
own event loop keeping up with the output).

With --tp-size N there is one such process per TP rank, all in one torch.distributed group.
Rank 0 alone talks to the TokenizerManager and the Detokenizer; each loop iteration it
broadcasts the messages it received to the other ranks (TpSync), which then run the same
step. Every rank reports "ready" (or its error) on its own pipe.

With --dp-size N there is one per data-parallel replica instead (dp_rank, started through
data_parallel_controller.run_replica_process), each with its own input socket and heartbeat;
all of them send to the one detokenizer.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from typing import Any

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50


def run_scheduler_process(
    server_args: Any,
    port_args: Any,
    ready: Any = None,
    heartbeat: Any = None,
    tp_rank: int = 0,
    dp_rank: int = 0,
) -> None:
    from radixserve.utils import configure_child_process, exit_failed_start, zmq_socket

    name = "scheduler" if server_args.tp_size == 1 else f"scheduler-tp{tp_rank}"
    configure_child_process(name, server_args.log_level)
    import torch
    import zmq

    from radixserve.distributed.parallel_state import init_tp_group
    from radixserve.managers.scheduler import Scheduler
    from radixserve.managers.tokenizer_utils import load_tokenizer_for
    from radixserve.managers.tp_worker import TpModelWorker

    try:
        tp = init_tp_group(
            tp_rank,
            server_args.tp_size,
            server_args.dist_init_addr,
            server_args.device,
            tp_rank - server_args.local_tp_ranks.start,
        )
        if tp.world_size > 1:
            from radixserve.distributed.tp_sync import check_ranks_agree
            from radixserve.model_loader.loader import resolve_model_path

            check_ranks_agree(tp, server_args, resolve_model_path(server_args.model_path))
        ctx = zmq.Context(2)
        recv = send = None
        if tp_rank == 0:  # the other ranks get their inputs from rank 0 and send nothing
            recv = zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc, bind=True)
            send = zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_ipc, bind=False)
        tokenizer = load_tokenizer_for(server_args)
        worker = (
            TpModelWorker(server_args, tp=tp, tokenizer=tokenizer) if tp.world_size > 1 else None
        )
        scheduler = Scheduler(
            server_args, send.send_pyobj if send else _drop_output, tokenizer, worker, dp_rank
        )
    except Exception as e:  # (a ValueError is a refusal of the flags or files: its message)
        exit_failed_start(name, ready, e, stack=not isinstance(e, ValueError))
    if ready is not None:
        info = {**scheduler.tp_worker.get_memory_info(), **scheduler.startup_summary()}
        ready.send({"status": "ready", **info})
        ready.close()
    # From here on this thread's own work (scheduling, results, small tensor ops) runs on one
    # intra-op thread; the forward and sampling take the model's threads (torch_threads in
    # Scheduler.run_batch, or the overlap loop's forward thread). A small op then never opens
    # a parallel region (under load each one waits milliseconds for a preempted thread), and
    # the overlap loop never has a second OpenMP team spinning next to the forward's.
    torch.set_num_threads(1)
    poller = zmq.Poller()
    if recv is not None:
        poller.register(recv, zmq.POLLIN)
    for sock in scheduler.poll_sockets():  # e.g. a P/D peer's messages wake the loop too
        poller.register(sock, zmq.POLLIN)

    def recv_requests() -> list[Any]:
        msgs: list[Any] = []
        events = dict(poller.poll(scheduler.poll_timeout_ms(IDLE_POLL_MS)))
        while recv in events:
            msgs.append(recv.recv_pyobj())
            events = dict(poller.poll(0))
        return msgs

    try:
        while True:
            if heartbeat is not None:
                heartbeat.value = time.monotonic()  # system-wide clock: the parent compares
            msgs = recv_requests() if recv is not None else None
            if scheduler.tp_sync is not None:
                msgs = scheduler.tp_sync.broadcast_requests(msgs)
            scheduler.process_input_requests(msgs)
            scheduler.step()
    except Exception as e:
        logger.error("scheduler crashed: %s\n%s", e, traceback.format_exc())
        sys.exit(1)


def _drop_output(msg: Any) -> None:
    """TP ranks other than 0 compute the same outputs as rank 0, which alone sends them."""
