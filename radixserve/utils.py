"""Small process utilities: ports and IPC names, ZMQ sockets, child-process set-up, logging."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

# The longest path of a Unix socket (sockaddr_un's sun_path, less its NUL): ZMQ refuses an
# ipc endpoint past it.
MAX_IPC_PATH = 107
# The socket directory of one server or Engine: /tmp/radixserve-XXXXXXXX, holding its owner's pid.
IPC_DIR_PREFIX = "radixserve-"
IPC_OWNER_FILE = "owner.pid"


@dataclass(frozen=True)
class PortArgs:
    """IPC endpoints between the three processes."""

    tokenizer_ipc: str  # detokenizer → tokenizer manager
    scheduler_input_ipc: str  # tokenizer manager → scheduler
    detokenizer_ipc: str  # scheduler → detokenizer
    ipc_dir: str = ""  # the directory of their socket files (removed at shutdown)

    @classmethod
    def new(cls) -> PortArgs:
        base = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
        if len(base) + len("/detokenizer") > MAX_IPC_PATH:  # a long TMPDIR (SLURM's, CI's)
            os.rmdir(base)
            base = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX, dir="/tmp")
        remove_dead_ipc_dirs(os.path.dirname(base))
        with open(os.path.join(base, IPC_OWNER_FILE), "w") as f:
            f.write(_owner())
        return cls(
            tokenizer_ipc=f"ipc://{base}/tokenizer",
            scheduler_input_ipc=f"ipc://{base}/scheduler",
            detokenizer_ipc=f"ipc://{base}/detokenizer",
            ipc_dir=base,
        )


def remove_dead_ipc_dirs(parent: str) -> list[str]:
    """Remove the socket directories in `parent` whose owner process is gone: a server or
    Engine killed with SIGKILL cannot remove its own (shutdown does). A directory without an
    owner file, or another user's, is left alone. Returns the directories removed."""
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        if not name.startswith(IPC_DIR_PREFIX):
            continue
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, IPC_OWNER_FILE)) as f:
                owner_pid, namespace = f.read().split()
            pid = int(owner_pid)
        except (OSError, ValueError):
            continue
        # (a pid of another pid namespace, another container's sharing /tmp, says nothing here)
        if namespace != _pid_namespace() or _process_exists(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _owner() -> str:
    return f"{os.getpid()} {_pid_namespace()}"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux
        return "-"


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process has the pid now
        return True
    return True


def zmq_socket(ctx: Any, kind: int, endpoint: str, bind: bool) -> Any:
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)
    if kind == zmq.PULL:
        sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the body with `n` torch intra-op threads on this thread (OpenMP's count is per
    calling thread), then restore the previous count; None changes nothing."""
    import torch

    prev = torch.get_num_threads()
    if n is None or n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


_PROGRESS_LOCK = threading.RLock()


def progress_bar(*args: Any, **kwargs: Any) -> Any:
    """tqdm(*args, **kwargs) with a thread lock. tqdm's default lock includes a
    multiprocessing semaphore; made in a scheduler process, which the server stops with
    SIGTERM, it was never released, and Python's resource tracker printed a "leaked semaphore"
    warning at every shutdown. The bars here run in one process, so a thread lock is enough."""
    from tqdm import tqdm

    tqdm.set_lock(_PROGRESS_LOCK)
    return tqdm(*args, **kwargs)


def configure_logging(level: str = "info", prefix: str = "") -> None:
    fmt = f"[%(asctime)s{(' ' + prefix) if prefix else ''}] %(levelname)s %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, datefmt="%H:%M:%S", force=True)


def exit_failed_start(name: str, ready: Any, e: Exception, *, stack: bool = False) -> NoReturn:
    """A child process that could not start: log why (with the stack where it is the
    project's own fault), tell the parent over `ready` in one line, exit 1."""
    log = logging.getLogger(f"radixserve.{name}")
    stack = stack or log.isEnabledFor(logging.DEBUG)
    log.error("%s failed to start: %s: %s", name, type(e).__name__, e, exc_info=stack)
    if ready is not None:
        try:
            ready.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        except OSError:  # the parent already gave up (e.g. another TP rank failed first)
            pass
    sys.exit(1)


def open_missing_std_fds() -> None:
    """Open /dev/null on whichever of stdin/stdout/stderr the process was started without
    (`0<&-`): the next file opened took its number, uvloop's epoll took 0, and libuv aborted
    on closing it at exit (SIGABRT, the clean-up skipped)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def configure_child_process(name: str, log_level: str = "info") -> None:
    """Logging, and keep non-model processes off the model's cores (one torch thread)."""
    configure_logging(log_level, name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent shuts us down on Ctrl-C
    # A process group of its own: a signal to the server's group (systemctl stop, `timeout`,
    # a closed terminal's SIGHUP) reaches the parent alone, which stops the children after
    # answering what is in flight; they died of it first, and the parent reported a crash.
    with contextlib.suppress(OSError):
        os.setpgrp()
    try:  # die with the parent, even when it is SIGKILLed
        libc = ctypes.CDLL("libc.so.6")
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        libc.prctl(15, f"rs::{name}".encode()[:15])  # PR_SET_NAME: top, ps -L, /proc/*/comm
    except (OSError, AttributeError):
        pass
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before prctl took effect
        os._exit(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if name != "scheduler":
        try:
            import torch

            torch.set_num_threads(1)
        except ImportError:
            pass
    try:
        import setproctitle  # type: ignore[import-not-found]

        setproctitle.setproctitle(f"radixserve::{name}")
    except ImportError:
        pass
