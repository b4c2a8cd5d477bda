"""`bench overhead`'s arguments and its CPU breakdown by server process (no server started)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from radixserve.bench import overhead


def test_one_output_token_is_refused_before_anything_starts(capsys):
    """TPOT needs two tokens: a TypeError ended the run after a minute of setup."""
    with pytest.raises(SystemExit) as exit_:
        overhead.main(["--output-len", "1", "--model-path", "/nonexistent"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --output-len: must be >= 2 (TPOT" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "comm, cmd, expected",
    [
        # setproctitle installed: the command line is the title, the comm its first 15 bytes
        ("radixserve::sch", "radixserve::scheduler", "scheduler"),
        ("radixserve::sch", "radixserve::scheduler-tp1", "scheduler-tp1"),
        ("radixserve::det", "radixserve::detokenizer", "detokenizer"),
        # without it: prctl's comm
        ("rs::detokenizer", "/venv/bin/python -c from multiprocessing.spawn ...", "detokenizer"),
        ("python", "/venv/bin/python -m radixserve serve --model-path m", "http+tokenizer"),
        ("python", "python -c from multiprocessing.resource_tracker ...", "resource_tracker"),
        ("bash", "bash -c sleep 1", "bash 42"),
    ],
)
def test_process_labels(comm, cmd, expected):
    assert overhead.process_label(comm, cmd, 42) == expected


def test_a_child_named_by_configure_child_process_is_labelled_by_its_name():
    """configure_child_process's setproctitle rewrites the comm that prctl set ("rs::...") to
    "radixserve::sch": the breakdown showed "radixserve::sch 1234" for the scheduler."""
    code = (
        "from radixserve.utils import configure_child_process\n"
        "configure_child_process('scheduler', 'warning')\n"
        "print('ready', flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 10
        while overhead._name(child.pid) != "scheduler" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert overhead._name(child.pid) == "scheduler"
    finally:
        child.kill()
        child.wait(timeout=10)
