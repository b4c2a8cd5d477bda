"""radixserve's C++ CPU kernels (csrc/): built once per machine with the local compiler,
cached, and loaded as torch ops (`torch.ops.radixserve.*`): `decode_attention` (the cpu_paged
attention backend), `extend_attention` and `cascade_prefix_attention` (its bf16 tile kernels
for prompts and shared prefixes, built on CPUs with AVX512-BF16), `q4_linear`, `q4_dense`,
`q8_linear`, `q8_dense` and, on CPUs with AVX-512 VNNI, `q4_tiled_linear` / `q8_tiled_linear`
and the MLP's `q4_tiled_silu_mul` / `q8_tiled_silu_mul` (int4 and int8 weights,
`--quantization`; quant_linear.cpp), on CPUs with AVX512-BF16 `bf16_tiled_linear` /
`bf16_tiled_silu_mul` (bf16 weights in tiles; bf16_linear.cpp, linear.py; with LoRA deltas
inside, `bf16_tiled_linear_lora` / `bf16_tiled_silu_mul_lora` after `bf16_tiled_lora_shrink`)
and the fused element-wise steps of a layer (`rms_norm`, `add_rms_norm`, `rotary_embedding`,
`silu_and_mul`; fused_ops.py), LoRA
adapters' deltas of a decode step (`lora_delta`; lora/manager.py), and
`torch.classes.radixserve.DecodeStep`, which runs a decode step's layers through them in one
call (decode_step.py).
`-ffp-contract=off` keeps a*b + c*d two roundings, as the PyTorch reference computes it.

The build needs a C++ compiler (g++ or clang++) and ninja (a pip dependency); it takes about
45 seconds on two cores, is logged while it runs, and lands in
$RADIXSERVE_KERNEL_CACHE (default ~/.cache/radixserve/kernels) under a name that hashes the
source, the flags, the torch version and the CPU's instruction sets, so that a cache shared
between machines never loads a binary built for another CPU. Later starts load the cached
library directly (no compiler needed then). Builders of one cache take turns (an flock on
the build directory's `build.flock`, which the kernel releases if its holder dies); so torch's
own `lock` file found by the holder was left by a build that was killed, and is removed
rather than waited on forever.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

CACHE_ENV_VAR = "RADIXSERVE_KERNEL_CACHE"
_SOURCES = (
    "decode_attention.cpp",
    "extend_attention.cpp",
    "quant_linear.cpp",
    "w8a8_linear.cpp",
    "bf16_linear.cpp",
    "fused_ops.cpp",
    "lora_ops.cpp",
    "decode_step.cpp",
)
_HEADERS = ("kernels.h", "vec_math.h")  # included by the sources: part of the build's name too
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
_lock = threading.Lock()
_loaded = False


class KernelBuildError(RuntimeError):
    pass


def kernel_cache_dir() -> str:
    return os.environ.get(CACHE_ENV_VAR) or os.path.join(
        os.path.expanduser("~"), ".cache", "radixserve", "kernels"
    )


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _build_name(paths: list[str]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    h.update(" ".join(_CFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    return f"radixserve_cpu_{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _builders_take_turns(build_dir: str) -> Iterator[None]:
    """Hold build_dir's flock (waiting, with a log line, while another process builds)."""
    fd = os.open(os.path.join(build_dir, "build.flock"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that builds the CPU kernels in %s", build_dir)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (releases the flock)


def build_paths() -> tuple[list[str], str, str, str]:
    """(the sources, the build's name, its directory in the cache, the library's path)."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
    sources = [os.path.join(here, s) for s in _SOURCES]
    name = _build_name(sources + [os.path.join(here, h) for h in _HEADERS])
    build_dir = os.path.join(kernel_cache_dir(), name)
    return sources, name, build_dir, os.path.join(build_dir, f"{name}.so")


def load_cpu_kernels() -> None:
    """Make the `torch.ops.radixserve` kernels available, building them on first use."""
    global _loaded
    with _lock:
        if _loaded:
            return
        sources, name, build_dir, library = build_paths()
        # torch's builder holds build_dir/lock while it compiles and links: a library seen
        # then may be half written, so go through load(), which waits for the lock.
        if os.path.isfile(library) and not os.path.exists(os.path.join(build_dir, "lock")):
            torch.ops.load_library(library)
            _loaded = True
            return
        os.makedirs(build_dir, exist_ok=True)
        with _builders_take_turns(build_dir):
            baton = os.path.join(build_dir, "lock")
            stale = os.path.exists(baton)  # no live builder holds it (they take turns above)
            if stale:
                logger.warning("removing %s, left by a kernel build that was killed", baton)
                os.remove(baton)
            elif os.path.isfile(library):  # built by the process this one waited for
                torch.ops.load_library(library)
                _loaded = True
                return
            logger.info(
                "building the CPU kernels (first use on this machine, about a minute) in %s",
                build_dir,
            )
            start = time.perf_counter()
            try:
                from torch.utils.cpp_extension import load

                load(  # (ninja's: only what is missing or stale is built)
                    name=name,
                    sources=sources,
                    extra_cflags=_CFLAGS,
                    build_directory=build_dir,
                    is_python_module=False,
                    verbose=False,
                )
            except Exception as exc:  # no compiler, no ninja, a compile error
                raise KernelBuildError(
                    "could not build radixserve's CPU kernels (they need a C++ compiler such "
                    "as g++ and the ninja package); install them, or run with "
                    "--attention-backend torch_native (int4 then uses ATen's kernel). "
                    f"Cause: {exc}"
                ) from exc
            logger.info("built the CPU kernels in %.1f s", time.perf_counter() - start)
        _loaded = True


@functools.lru_cache(maxsize=1)
def cpu_kernels_available() -> bool:
    """Whether radixserve's C++ CPU kernels load (built on first use); where they do not,
    int4 layers take ATen's int4 kernel and bf16 weights oneDNN's layout."""
    try:
        load_cpu_kernels()
    except KernelBuildError as exc:
        logger.warning(
            "int4 layers use ATen's int4 kernel and bf16 weights oneDNN's, since %s", exc
        )
        return False
    return True
