"""Fixtures for the model-loader tests: the real default model (fetched once by `make setup`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Until the package is installed (pip install -e .) or pytest sets pythonpath, make the repo
# root importable so `pytest tests/model_loader` works from a fresh checkout.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture(scope="session")
def default_gguf() -> str:
    """Path of the default model's GGUF in the default cache (downloads only if missing)."""
    from radixserve.model_loader.default_model import ensure_default_model

    return ensure_default_model()
