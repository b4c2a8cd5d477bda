"""The command line: every command's --help prints its usage (argparse formats each flag's
help with %, so a flag whose text holds a literal % once made `serve --help` raise); bad
values, paths and formats end a command with one line and exit 2, before any process starts
where they can be known then; `generate` renders --chat-template."""

from __future__ import annotations

import os
import re

import pytest

from radixserve.__main__ import BENCH_KINDS, main
from radixserve.args import ServerArgs


@pytest.mark.parametrize(
    "argv", [["serve"], ["generate"], *(["bench", kind] for kind in BENCH_KINDS)], ids=" ".join
)
def test_every_command_prints_its_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out


# Each value was once accepted: read as "unset" (0, nan), failing later inside a child process
# with a traceback (--num-threads -1, --random-seed 2**64, --log-level bogus, a model path that
# holds no model), or serving nothing (--context-length -5, --port 70000).
BAD_FLAGS = [
    (["--context-length", "0"], "--context-length must be >= 1"),
    (["--context-length", "-5"], "--context-length must be >= 1"),
    (["--max-prefill-tokens", "0"], "--max-prefill-tokens must be >= 1"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be >= 1, or -1"),
    (["--chunked-prefill-size", "-5"], "--chunked-prefill-size must be >= 1, or -1"),
    (["--num-threads", "0"], "--num-threads must be >= 1"),
    (["--num-threads", "-1"], "--num-threads must be >= 1"),
    (["--random-seed", "-1"], "--random-seed must be >= 0"),
    (["--random-seed", str(2**64)], "--random-seed must be < 2\\*\\*63"),
    (["--port", "0"], "--port must be a port"),
    (["--port", "70000"], "--port must be a port"),
    (["--mem-fraction-static", "0"], "--mem-fraction-static must be between 0 and 1"),
    (["--mem-fraction-static", "2"], "--mem-fraction-static must be between 0 and 1"),
    (["--mem-fraction-static", "nan"], "--mem-fraction-static must be between 0 and 1"),
    (["--schedule-conservativeness", "-1"], "--schedule-conservativeness must be a finite"),
    (["--schedule-conservativeness", "nan"], "--schedule-conservativeness must be a finite"),
    (["--schedule-conservativeness", "inf"], "--schedule-conservativeness must be a finite"),
    (["--watchdog-timeout", "0"], "--watchdog-timeout must be > 0"),
    (["--watchdog-timeout", "nan"], "--watchdog-timeout must be > 0"),
    (["--log-level", "bogus"], "--log-level must be one of"),
    (["--api-key", ""], "--api-key is empty"),
    (["--api-key", " "], "--api-key is empty"),  # (no client can send it)
    (["--served-model-name", ""], "--served-model-name is empty"),
    (["--api-key", "sekrit "], "--api-key starts or ends with whitespace"),  # (a 401 always)
    (["--api-key", "s€krit"], "--api-key must be printable ASCII"),
    (["--api-key", "se\tkrit"], "--api-key must be printable ASCII"),
    (
        ["--dp-size", "100000"],
        "--dp-size 100000 is more than 8 replicas per CPU",
    ),  # (too many open files)
    # out of range though their feature is off (accepted, and ignored)
    (["--hicache-size", "-1"], "--hicache-ratio must be > 0 and --hicache-size >= 0"),
    (["--hicache-ratio", "nan"], "--hicache-ratio must be > 0"),
    (["--speculative-ngram-branch-length", "0"], "NGRAM breadth and branch length"),
    (["--speculative-ngram-min-match-window-size", "0"], "NGRAM match windows"),
    (["--disaggregation-bootstrap-port", "0"], "--disaggregation-bootstrap-port must be a port"),
    (["--num-threads", "100000"], "--num-threads 100000 is more than 8 per CPU"),  # (segfault)
    (["--enable-hierarchical-cache", "--hicache-ratio", "nan"], "--hicache-ratio must be > 0"),
    (["--enable-hierarchical-cache", "--hicache-ratio", "inf"], "--hicache-ratio must be > 0"),
    (["--enable-hierarchical-cache", "--hicache-ratio", "0.5"], "--hicache-ratio 0.5: the host"),
    (  # (found after the model loaded: "" wrote into the working directory)
        ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"]
        + ["--hicache-storage-dir", ""],
        "--hicache-storage-dir is empty",
    ),
    (["--node-rank", "5"], "--node-rank 5 needs --nnodes > 5"),
    (["--model-path", "/nonexistent/model"], "--model-path '/nonexistent/model' does not exist"),
    (["--tokenizer-path", "/nonexistent/tok"], "--tokenizer-path '/nonexistent/tok' does not"),
]


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf"])
def test_a_bad_grammar_timeout_in_the_environment_is_refused_at_start(value, monkeypatch):
    # It was read where a grammar first compiled: every structured-output request a 500 with a
    # traceback ("abc"), or a 400 "did not compile within -1 s", the server up and ready.
    monkeypatch.setenv("RADIXSERVE_GRAMMAR_TIMEOUT", value)
    with pytest.raises(ValueError, match="RADIXSERVE_GRAMMAR_TIMEOUT must be a number of seconds"):
        ServerArgs()


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize("flags, message", BAD_FLAGS, ids=lambda v: " ".join(v)[:40])
def test_a_bad_flag_ends_the_command_with_usage_and_one_line(command, flags, message, capsys):
    argv = [command, *(["hi"] if command == "generate" else []), *flags]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and "Traceback" not in err
    assert re.search(f"error: {message}", err), err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
        (["--raw", "--system", "be brief"], "--system needs the chat template; drop --raw"),
    ],
)
def test_bad_generate_values_end_with_usage_and_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and "Traceback" not in err and message in err


def test_generate_uses_the_chat_template_flag_and_reports_request_errors(tmp_path, capsys):
    """--chat-template is the template generate renders (it was ignored); a request the
    engine refuses is one line and exit 2, not a traceback."""
    from rs_testing import make_tiny_served_model

    model = make_tiny_served_model(str(tmp_path / "m"))
    template = tmp_path / "t.jinja"
    template.write_text("{{ raise_exception('this template refuses') }}")
    common = ["--model-path", model, "--dtype", "float32", "--max-total-tokens", "1024"]
    assert main(["generate", "hi", *common, "--chat-template", str(template)]) == 2
    err = capsys.readouterr().err
    assert "radixserve generate: error: cannot apply the chat template" in err
    assert "this template refuses" in err and "Traceback" not in err
    assert main(["generate", "hi", *common, "--raw", "--max-new-tokens", "5000"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the model's context length" in err and "Traceback" not in err


def test_a_load_format_that_contradicts_the_path_is_refused_at_start(tmp_path, capsys):
    from rs_testing import make_tiny_model_dir

    model = make_tiny_model_dir(str(tmp_path / "m"))
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    for path, fmt, message in (
        (model, "gguf", "--load-format gguf needs a .gguf file"),
        (str(gguf), "safetensors", "--load-format safetensors needs a model directory"),
        (str(gguf), "dummy", "--load-format dummy needs a model directory"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--model-path", path, "--load-format", fmt])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
    from radixserve import Engine

    with pytest.raises(ValueError, match="--load-format gguf needs a .gguf file"):
        Engine(model_path=model, load_format="gguf")


def test_a_model_path_without_a_model_is_refused_before_anything_starts(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a model")
    for path, message in (
        (tmp_path, "is a directory without config.json"),
        (tmp_path / "notes.txt", "is neither a .gguf file nor a directory"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--model-path", str(path)])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
    # A file whose format --load-format names need not be called .gguf.
    from radixserve.model_loader.loader import check_model_path

    check_model_path(str(tmp_path / "notes.txt"), load_format="gguf")


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"architectures": ["GemmaForCausalLM"]},
            "unsupported architecture 'GemmaForCausalLM'",
        ),
        ({"num_attention_heads": None}, "the model's config lacks 'num_attention_heads'"),
    ],
)
def test_a_config_that_cannot_be_served_is_refused_before_anything_starts(
    tmp_path, capsys, change, message
):
    """Only with --context-length was the config read up front: else the scheduler found it,
    a traceback after the start-up's seconds (and a bare KeyError for a missing field)."""
    import json

    from rs_testing import make_tiny_model_dir

    model = make_tiny_model_dir(str(tmp_path / "m"))
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None}
    config_path.write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model-path", model])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    from radixserve import Engine

    with pytest.raises(ValueError, match=message):
        Engine(model_path=model)


def test_a_model_directory_without_tokenizer_files_is_refused_before_anything_starts(
    tmp_path, capsys
):
    """Weights and config.json only: the scheduler loaded the weights and then died with a
    transformers traceback about converting slow tokenizers; now one line names the directory
    and --tokenizer-path, which serves it."""
    from rs_testing import make_tiny_model_dir, save_byte_tokenizer

    model = make_tiny_model_dir(str(tmp_path / "m"))
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model-path", model])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"the model directory '{model}' holds no tokenizer files" in err
    assert "pass --tokenizer-path" in err
    from radixserve import Engine

    with pytest.raises(FileNotFoundError, match="holds no tokenizer files"):
        Engine(model_path=model)
    empty = tmp_path / "tok"
    empty.mkdir()
    with pytest.raises(SystemExit):
        main(["serve", "--model-path", model, "--tokenizer-path", str(empty)])
    assert f"--tokenizer-path '{empty}' holds no tokenizer files" in capsys.readouterr().err
    save_byte_tokenizer(str(empty), 320)
    from radixserve.model_loader.loader import check_tokenizer_path

    check_tokenizer_path(model, str(empty))  # a tokenizer elsewhere serves the model


def test_a_chat_template_that_cannot_render_is_refused_before_anything_starts(tmp_path, capsys):
    """Not UTF-8: a UnicodeDecodeError traceback after the model had loaded (exit 3); a Jinja
    syntax error: the server started and every chat request got a 400 blaming the client."""
    from rs_testing import make_tiny_served_model

    model = make_tiny_served_model(str(tmp_path / "m"))
    binary, broken = tmp_path / "binary.jinja", tmp_path / "broken.jinja"
    binary.write_bytes(b"\xff\xfe{{ messages }}")
    broken.write_text("{% for m in messages %}{{ m.content }")
    for path, message in (
        (binary, "cannot be read as UTF-8 text"),
        (broken, "is not a valid Jinja template: line 1: unexpected '}'"),
    ):
        for command in ("serve", "generate"):
            argv = [command, *(["hi"] if command == "generate" else [])]
            with pytest.raises(SystemExit) as exit_:
                main([*argv, "--model-path", model, "--chat-template", str(path)])
            assert exit_.value.code == 2
            err = capsys.readouterr().err
            assert message in err and "Traceback" not in err


def test_a_context_longer_than_the_models_positions_needs_saying_so(tmp_path, capsys, monkeypatch):
    # --context-length 10**8 once hung the start-up building a rotary table of 10**8 rows.
    from rs_testing import make_tiny_model_dir

    from radixserve.model_loader.loader import (
        ALLOW_LONGER_CONTEXT_ENV,
        check_context_length,
        load_model_config,
    )

    path = make_tiny_model_dir(str(tmp_path / "m"))
    cfg = load_model_config(path, "safetensors")
    trained = cfg.max_position_embeddings
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model-path", path, "--context-length", str(10**8)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"longer than the model's {trained} positions; set {ALLOW_LONGER_CONTEXT_ENV}=1" in err
    assert not check_context_length(cfg, trained) and not check_context_length(cfg, None)
    monkeypatch.setenv(ALLOW_LONGER_CONTEXT_ENV, "1")
    assert check_context_length(cfg, 2 * trained)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serving", "--num-prompts", "-5"], "--num-prompts: must be >= 1, got -5"),
        (["serving", "--request-rate", "nan"], "--request-rate: must be > 0.0, got nan"),
        (["serving", "--random-range-ratio", "2"], "must be >= 0.0 and <= 1.0, got 2"),
        (["one-batch", "--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
        (["offline", "--num-prompts", "0"], "--num-prompts: must be >= 1, got 0"),
        (["hf-baseline", "--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
        (["soak", "--duration", "-1"], "--duration: must be > 0.0, got -1"),
        (["multiturn", "--num-clients", "0"], "--num-clients: must be >= 1, got 0"),
        (["perplexity", "--window", "1"], "--window: must be >= 2, got 1"),
        (["one-batch", "--model-path", "/nonexistent/m"], "'/nonexistent/m' does not exist"),
    ],
    ids=lambda v: " ".join(v)[:40] if isinstance(v, list) else "",
)
def test_a_bad_bench_value_is_one_line_and_exit_2(argv, message, capsys):
    # Each once ended in a traceback (numpy's negative dimensions, max() of an empty batch,
    # ServerArgs' max_total_tokens 0, a missing model) or ran with nonsense.
    try:
        code = main(["bench", *argv])
    except SystemExit as e:  # argparse's own error
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_bench_against_a_server_that_is_not_there_is_one_line(capsys):
    from radixserve.utils import free_port

    argv = ["bench", "soak", "--duration", "5", "--port", str(free_port())]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "radixserve bench soak: error: ConnectError" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["perplexity", "--window", "2000"], "--window 2000 exceeds the model's context length"),
        (
            ["one-batch", "--input-len", "1000", "--output-len", "100", "--batch-size", "1"],
            "= 1100 tokens exceeds the model's context length",
        ),
    ],
)
def test_a_bench_longer_than_the_models_context_is_one_line(tmp_path, capsys, argv, message):
    """A RuntimeError traceback from the KV pool ("the expanded size of the tensor (1032)
    must match the existing size (2000)")."""
    from rs_testing import make_tiny_served_model

    model = make_tiny_served_model(str(tmp_path / "m"), context=1024)
    code = main(["bench", *argv, "--model-path", model, "--dtype", "float32"])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """The bind error came from uvicorn once every rank had loaded the model (minutes)."""
    import socket

    from rs_testing import make_tiny_served_model

    from radixserve.entrypoints import engine, http_server

    model = make_tiny_served_model(str(tmp_path / "m"))
    monkeypatch.setattr(engine, "Subprocesses", lambda *a, **k: pytest.fail("children started"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert "pick another --port" in http_server._port_in_use("127.0.0.1", port)
        assert main(["serve", "--model-path", model, "--port", str(port)]) == 1
    assert http_server._port_in_use("127.0.0.1", port) is None


def test_sglangs_full_parallelism_flag_names_are_accepted():
    """--tensor-parallel-size / --data-parallel-size, SGLang's own names (--tp-size, --tp
    are its short forms), were unrecognized arguments."""
    import argparse

    from radixserve.args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--tensor-parallel-size", "1", "--data-parallel-size", "2"])
    args = ServerArgs.from_cli_args(ns)
    assert (args.tp_size, args.dp_size) == (1, 2)


def test_device_cuda_without_cuda_and_a_host_not_of_this_machine_say_so():
    """--device cuda on a machine without CUDA failed in the scheduler after 30 s with a
    traceback; an address not of this machine was blamed on the port."""
    import torch

    from radixserve.args import ServerArgs
    from radixserve.entrypoints import http_server

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda: no CUDA device is available"):
            ServerArgs(device="cuda").resolve()
    why = http_server._port_in_use("192.0.2.1", 30000)  # (TEST-NET-1: no machine's address)
    assert why is not None and "--host 192.0.2.1 is not an address of this machine" in why


def test_generate_says_in_one_line_why_the_engine_did_not_start(tmp_path, capsys, monkeypatch):
    """An engine that failed to start (its scheduler's error, logged there) ended generate
    with the parent's traceback as well."""
    from rs_testing import make_tiny_served_model

    from radixserve.entrypoints import engine

    def failing(*_: object, **__: object) -> None:
        raise RuntimeError("the scheduler failed to start: MemoryError: too large")

    monkeypatch.setattr(engine, "Engine", failing)
    model = make_tiny_served_model(str(tmp_path / "m"))
    capsys.readouterr()  # (what making the model printed)
    assert main(["generate", "hi", "--model-path", model]) == 1
    err = capsys.readouterr().err
    assert (
        err == "radixserve generate: error: the scheduler failed to start: MemoryError: too large\n"
    )


@pytest.mark.parametrize("damage", ["no weights", "cut short"])
def test_a_model_directory_without_whole_weights_is_refused_before_anything_starts(
    tmp_path, capsys, damage
):
    """Missing or truncated weights were found by the scheduler 20-50 s later, a traceback."""
    from rs_testing import make_tiny_served_model

    model = make_tiny_served_model(str(tmp_path / "m"))
    weights = os.path.join(model, "model.safetensors")
    if damage == "no weights":
        os.remove(weights)
    else:
        os.truncate(weights, os.path.getsize(weights) - 100)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model-path", model])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "holds no weights" in err if damage == "no weights" else "is cut short" in err
    assert "Traceback" not in err


def test_sglang_s_enable_metrics_flag_is_accepted():
    """A launch command carried over from SGLang (--enable-metrics) failed: unrecognized."""
    import argparse

    from radixserve.args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args(["--enable-metrics"])).enable_metrics
