"""Shared fixtures: tiny random HF models built locally (no downloads), the default model and
its tokenizer (built from the GGUF once per session: seconds each time)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from rs_testing import make_tiny_model_dir

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_sessionstart(session):
    """Build the cpu_paged attention kernel once, up front (tens of seconds on a fresh
    machine), instead of inside whichever server start needs it first. A build failure is
    left to the tests that use the kernel, which then fail with its message."""
    from radixserve.layers.cpu_kernels import KernelBuildError, load_cpu_kernels

    try:
        load_cpu_kernels()
    except KernelBuildError:
        pass


@pytest.fixture(autouse=True)
def _close_schedulers(monkeypatch):
    """Stop the forward thread of every in-process Scheduler a test builds (the thread holds
    the model; left running, each test's model would stay in memory)."""
    from radixserve.managers.scheduler import Scheduler

    built: list[Scheduler] = []
    init = Scheduler.__init__

    def tracking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(Scheduler, "__init__", tracking_init)
    yield
    for s in built:
        s.close()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_llama")), "llama")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from radixserve.model_loader.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path: str) -> Any:
    """The default model's tokenizer, shared by every module: do not modify it (deepcopy)."""
    from radixserve.model_loader.weights import load_tokenizer

    return load_tokenizer(default_model_path)
