"""The multi-turn benchmark (`python -m radixserve bench multiturn`) on a tiny random model:
both configurations serve the same conversations with identical greedy outputs, and the
hierarchical cache serves more of the prompts from cache when the conversations outgrow the
device pool."""

from __future__ import annotations

import json

import pytest
from rs_testing import make_tiny_served_model

from radixserve.bench.multiturn import build_parser, main, make_turns


def test_turns_are_reproducible_and_sized():
    args = build_parser().parse_args(["--num-clients", "3", "--num-rounds", "2"])
    turns = make_turns(args, vocab_size=320)
    assert len(turns) == 3 and all(len(c) == 2 for c in turns)
    assert all(len(t) == args.request_length for c in turns for t in c)
    assert turns == make_turns(args, vocab_size=320)


def test_hierarchical_cache_beats_the_plain_cache(tmp_path, capsys):
    model = make_tiny_served_model(str(tmp_path / "tiny"))
    out = tmp_path / "results.jsonl"
    main(
        [
            "--model-path", model,
            "--max-total-tokens", "256",
            "--num-clients", "4",
            "--num-rounds", "3",
            "--request-length", "80",
            "--output-length", "4",
            "--dtype", "float32",
            "--hicache-args", '{"enable_hierarchical_cache": true, "hicache_ratio": 6}',
            "--check-outputs",
            "--output-file", str(out),
        ]
    )  # fmt: skip
    assert "greedy outputs identical across runs: True" in capsys.readouterr().out
    radix, hicache = (json.loads(line) for line in out.read_text().splitlines())
    assert radix["config"] == "radix" and hicache["config"] == "hicache"
    assert hicache["cache_hit_ratio"] > radix["cache_hit_ratio"]
    assert hicache["hicache_host_hit_tokens"] > 0


@pytest.mark.parametrize(
    "hicache_args, message",
    [
        (
            '{"enable_hierarchical_cach": true}',
            "--hicache-args: 'enable_hierarchical_cach' is not a ServerArgs field "
            "(did you mean enable_hierarchical_cache?)",
        ),
        ('{"no_such_thing": 1}', "--hicache-args: 'no_such_thing' is not a ServerArgs field"),
        (
            '{"enable_hierarchical_cache": true, "hicache_ratio": -1}',
            "the hicache config: --hicache-ratio must be > 0",
        ),
    ],
)
def test_bad_hicache_args_are_refused_before_any_run(hicache_args, message, monkeypatch, capsys):
    """An unknown key was a TypeError traceback from ServerArgs(**kwargs), after the whole
    radix run."""
    import radixserve.bench.multiturn as multiturn

    monkeypatch.setattr(multiturn, "run_config", lambda *a: pytest.fail("a config ran"))
    with pytest.raises(SystemExit) as exit_:
        main(["--hicache-args", hicache_args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1] and "Traceback" not in err
