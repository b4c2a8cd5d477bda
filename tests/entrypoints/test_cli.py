"""The command line: every command's --help prints its usage (argparse formats each flag's
help with %, so a flag whose text holds a literal % once made `serve --help` raise)."""

from __future__ import annotations

import pytest

from radixserve.__main__ import BENCH_KINDS, main


@pytest.mark.parametrize(
    "argv", [["serve"], ["generate"], *(["bench", kind] for kind in BENCH_KINDS)], ids=" ".join
)
def test_every_command_prints_its_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out
