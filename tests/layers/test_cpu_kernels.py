"""Building and loading radixserve's CPU kernels (layers/cpu_kernels.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from radixserve.layers import cpu_kernels


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start(tmp_path):
    """torch's builder holds build_dir/lock while it compiles; a build killed then leaves it
    behind, and every later start used to wait on it forever. The next process now takes the
    builders' flock first, so a lock it finds is stale: removed, and the library loads."""
    if not cpu_kernels.cpu_kernels_available():
        pytest.skip("radixserve's CPU kernels are not built on this machine")
    _, name, build_dir, _ = cpu_kernels.build_paths()
    cache = tmp_path / "kernels"
    shutil.copytree(build_dir, cache / name)  # (mtimes kept: ninja finds it up to date)
    (cache / name / "lock").touch()
    code = (
        "import torch\n"
        "from radixserve.layers.cpu_kernels import load_cpu_kernels\n"
        "load_cpu_kernels()\n"
        "print(torch.ops.radixserve.bf16_tiled_supported())\n"
    )
    env = {**os.environ, cpu_kernels.CACHE_ENV_VAR: str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    assert "left by a kernel build that was killed" in out.stderr
    assert not (cache / name / "lock").exists()
