"""The scheduler process: ZMQ in (TokenizerManager), ZMQ out (Detokenizer), the event loop.

A crash here is logged with its traceback and ends the process with a non-zero status; the
parent watches its children and shuts the server down rather than hang. Every loop iteration
writes the time into a shared `heartbeat` value, so the server can tell a scheduler stuck in
one step from a long generation that streams nothing (and reads it without depending on its
own event loop keeping up with the output).
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
    server_args: Any, port_args: Any, ready: Any = None, heartbeat: Any = None
) -> None:
    from radixserve.utils import configure_child_process, zmq_socket

    configure_child_process("scheduler", server_args.log_level)
    import zmq

    from radixserve.managers.scheduler import Scheduler
    from radixserve.managers.tokenizer_utils import load_tokenizer_for

    try:
        ctx = zmq.Context(2)
        recv = zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc, bind=True)
        send = zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_ipc, bind=False)
        tokenizer = load_tokenizer_for(server_args)
        scheduler = Scheduler(server_args, send.send_pyobj, tokenizer)
    except Exception as e:
        logger.error("scheduler failed to start: %s\n%s", e, traceback.format_exc())
        if ready is not None:
            ready.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        sys.exit(1)
    if ready is not None:
        info = {**scheduler.tp_worker.get_memory_info(), **scheduler.startup_summary()}
        ready.send({"status": "ready", **info})
        ready.close()
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)

    def recv_requests() -> list[Any]:
        msgs = []
        timeout = 0 if scheduler.has_work() else IDLE_POLL_MS
        while poller.poll(timeout):
            msgs.append(recv.recv_pyobj())
            timeout = 0
        return msgs

    try:
        while True:
            if heartbeat is not None:
                heartbeat.value = time.monotonic()  # system-wide clock: the parent compares
            scheduler.process_input_requests(recv_requests())
            scheduler.step()
    except Exception as e:
        logger.error("scheduler crashed: %s\n%s", e, traceback.format_exc())
        sys.exit(1)
