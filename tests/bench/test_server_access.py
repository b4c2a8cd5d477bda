"""How the bench clients reach a server: the API key of a server started with `--api-key`
(`--api-key`, else $OPENAI_API_KEY, on every request of `bench serving`, `bench soak` and
`bench overhead`; a 401 is one line that names the fix) and, for `bench serving` without
`--tokenizer`, the served model's tokenizer from GET /get_model_info. Fake servers over
`httpx.MockTransport`; no model is loaded."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable

import httpx
import pytest

from radixserve.bench import client, datasets, serving, soak
from radixserve.bench.datasets import BenchRequest

KEY = "sekret"


class KeyedServer:
    """/generate, /v1/completions, /v1/models, /get_model_info and /flush_cache behind
    `Authorization: Bearer <key>` (401 otherwise, as radixserve's ApiKeyMiddleware);
    records the Authorization header of every request."""

    def __init__(self, key: str | None = KEY, info: dict | None = None, info_status: int = 200):
        self.key = key
        self.info = info if info is not None else {}
        self.info_status = info_status
        self.seen: list[tuple[str, str | None]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        auth = request.headers.get("authorization")
        self.seen.append((request.url.path, auth))
        if self.key is not None and auth != f"Bearer {self.key}":
            return httpx.Response(401, json={"error": {"message": "invalid or missing API key"}})
        path = request.url.path
        if path == "/get_model_info":
            return httpx.Response(self.info_status, json=self.info)
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 512}]})
        if path == "/flush_cache":
            return httpx.Response(200, text="ok")
        body = json.loads(request.content)
        if path == "/generate":
            n = body["sampling_params"]["max_new_tokens"]
            events = [{"text": "x" * i, "meta_info": {"completion_tokens": i}} for i in (1, n)]
        else:
            n = body["max_tokens"]
            events = [
                {"choices": [{"text": "x"}], "usage": {"completion_tokens": i}} for i in (1, n)
            ]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode())


def _serving_args(*extra: str):
    return serving.build_parser().parse_args(
        ["--num-prompts", "2", "--random-input-len", "6", "--random-output-len", "3"]
        + ["--disable-tqdm", *extra]
    )


def _through(monkeypatch: pytest.MonkeyPatch, server: Callable) -> None:
    """Every client `bench serving` makes talks to `server` (main() takes no transport)."""
    real = client.make_client
    monkeypatch.setattr(
        serving, "make_client", lambda cfg, transport=None: real(cfg, httpx.MockTransport(server))
    )


# -- the API key -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["radixserve", "openai"])
def test_serving_sends_the_key_from_openai_api_key(backend, monkeypatch, word_tokenizer, tmp_path):
    """SGLang's bench_serving sends $OPENAI_API_KEY on every backend; the client sent nothing,
    and every request of a run against a server with --api-key failed with HTTP 401."""
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    server = KeyedServer()
    out = tmp_path / "result.jsonl"
    args = _serving_args("--backend", backend, "--flush-cache", "--output-file", str(out))
    result = serving.run(args, tokenizer=word_tokenizer, transport=httpx.MockTransport(server))
    assert result["completed"] == 2 and result["failed"] == 0
    assert {auth for _, auth in server.seen} == {f"Bearer {KEY}"}
    assert "/flush_cache" in [path for path, _ in server.seen]
    if backend == "openai":
        assert result["model"] == "tiny"  # /v1/models answered, not the "default" fallback


def test_the_api_key_flag_wins_over_the_env_var_and_stays_out_of_the_output(
    monkeypatch, word_tokenizer, tmp_path
):
    monkeypatch.setenv("OPENAI_API_KEY", "stale")
    server = KeyedServer()
    out = tmp_path / "result.jsonl"
    args = _serving_args("--api-key", KEY, "--output-file", str(out))
    result = serving.run(args, tokenizer=word_tokenizer, transport=httpx.MockTransport(server))
    assert result["completed"] == 2
    assert {auth for _, auth in server.seen} == {f"Bearer {KEY}"}
    assert KEY not in out.read_text() and "api_key" not in result


def test_no_key_sends_no_authorization_header(monkeypatch, word_tokenizer):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    server = KeyedServer(key=None)
    result = serving.run(
        _serving_args(), tokenizer=word_tokenizer, transport=httpx.MockTransport(server)
    )
    assert result["completed"] == 2 and {auth for _, auth in server.seen} == {None}


@pytest.mark.parametrize(
    "env, flags, message",
    [
        (None, [], "the server wants an API key: pass --api-key or set OPENAI_API_KEY"),
        (KEY, ["--api-key", "wrong"], "the server refused the API key"),
    ],
)
@pytest.mark.parametrize("backend", ["radixserve", "openai"])
def test_a_401_ends_serving_with_one_line(backend, env, flags, message, monkeypatch, capsys):
    """Not a silent fallback (the "default" model, the default tokenizer) and a run of
    failed requests."""
    if env is None:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    else:
        monkeypatch.setenv("OPENAI_API_KEY", env)
    _through(monkeypatch, KeyedServer())
    monkeypatch.setattr(datasets, "load_tokenizer", lambda path: pytest.fail("loaded a tokenizer"))
    with pytest.raises(SystemExit) as exit_:
        serving.main(["--backend", backend, "--num-prompts", "2", "--disable-tqdm", *flags])
    assert str(exit_.value).startswith("HTTP 401 from GET /get_model_info: ")
    assert message in str(exit_.value) and "\n" not in str(exit_.value)
    assert "Traceback" not in capsys.readouterr().err


def test_a_401_on_a_request_names_the_fix(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    cfg = client.ClientConfig("radixserve", "http://fake")

    async def go():
        async with client.make_client(cfg, httpx.MockTransport(KeyedServer())) as c:
            return await client.send_request(c, cfg, BenchRequest("hi", 2, 3))

    rec = asyncio.run(go())
    assert not rec.success
    assert rec.error == (
        "AuthError: HTTP 401 from POST /generate: the server wants an API key: pass --api-key "
        "or set OPENAI_API_KEY"
    )


def test_discover_model_raises_on_401_instead_of_answering_default(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)

    async def go(server: Callable) -> str:
        cfg = client.ClientConfig("openai", "http://fake")
        async with client.make_client(cfg, httpx.MockTransport(server)) as c:
            return await client.discover_model(c)

    with pytest.raises(client.AuthError, match="HTTP 401 from GET /v1/models"):
        asyncio.run(go(KeyedServer()))
    assert asyncio.run(go(lambda r: httpx.Response(404))) == "default"  # another server


@pytest.mark.parametrize("flags, env", [(["--api-key", KEY], "stale"), ([], KEY)])
def test_soak_sends_the_key(flags, env, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", env)
    server = KeyedServer(key="not-this-one")  # every request is refused: the run stops at once
    cfg = soak.config_from_args(soak.build_parser().parse_args(["--duration", "1", *flags]))
    assert KEY not in repr(cfg)
    with pytest.raises(client.AuthError, match="the server refused the API key"):
        asyncio.run(soak.soak(cfg, httpx.MockTransport(server)))
    assert server.seen == [("/v1/models", f"Bearer {KEY}")]


def test_soak_ends_a_401_with_one_line(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)

    server = KeyedServer()
    real = client.make_client
    monkeypatch.setattr(
        soak, "make_client", lambda cfg, transport=None: real(cfg, httpx.MockTransport(server))
    )
    with pytest.raises(SystemExit) as exit_:
        soak.main(["--duration", "1", "--model", "tiny"])
    assert str(exit_.value) == (
        "HTTP 401 from GET /v1/models: the server wants an API key: pass --api-key or set "
        "OPENAI_API_KEY"
    )


def test_overhead_sends_the_servers_api_key(monkeypatch):
    """`bench overhead` starts its servers with the server options it is given, --api-key
    among them; its client sent no key, and every request failed."""
    from radixserve.bench import overhead

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    server = KeyedServer()
    _through(monkeypatch, server)
    requests = [BenchRequest("hello", 5, 3)]
    metrics, cpu = overhead._served("http://fake", os.getpid(), requests, "radixserve", KEY)
    assert metrics["completed"] == 1 and "bench client" in cpu
    assert {auth for _, auth in server.seen} == {f"Bearer {KEY}"}


# -- the served model's tokenizer ------------------------------------------------------------------
@pytest.fixture
def loaded(monkeypatch, word_tokenizer) -> list:
    """The paths `bench serving` loads tokenizers from (the word tokenizer stands in)."""
    paths: list = []

    def load(path):
        paths.append(path)
        return word_tokenizer

    monkeypatch.setattr(datasets, "load_tokenizer", load)
    return paths


def test_without_tokenizer_the_served_models_is_used(loaded, tmp_path, capsys):
    """It was the default model's: a tiny model's 100-token prompts arrived as ~650 tokens."""
    served = tmp_path / "model"
    served.mkdir()
    server = KeyedServer(key=None, info={"model_path": "x", "tokenizer_path": str(served)})
    result = serving.run(_serving_args(), transport=httpx.MockTransport(server))
    assert loaded == [str(served)] and result["tokenizer"] == str(served)
    assert server.seen[0][0] == "/get_model_info"
    assert f"tokenizer: {served} (the served model's)" in capsys.readouterr().err


def test_the_model_path_serves_when_no_tokenizer_path_exists_here(loaded, tmp_path):
    served = tmp_path / "model.gguf"
    served.write_bytes(b"")
    info = {"model_path": str(served), "tokenizer_path": "org/remote-tokenizer"}
    server = KeyedServer(key=None, info=info)
    serving.run(_serving_args(), transport=httpx.MockTransport(server))
    assert loaded == [str(served)]


@pytest.mark.parametrize(
    "info, status, why",
    [
        ({}, 404, "GET /get_model_info answered HTTP 404"),  # not radixserve
        (
            {"model_path": "/no/such/dir", "tokenizer_path": None},
            200,
            "GET /get_model_info names no path on this machine (/no/such/dir)",
        ),
    ],
)
def test_the_default_models_tokenizer_is_the_fallback_said_in_one_line(
    info, status, why, loaded, capsys
):
    server = KeyedServer(key=None, info=info, info_status=status)
    serving.run(_serving_args(), transport=httpx.MockTransport(server))
    assert loaded == [None]  # datasets.load_tokenizer(None): the default model's
    lines = [line for line in capsys.readouterr().err.splitlines() if "tokenizer" in line]
    assert lines == [
        f"warning: {why}; the prompts are built with the default model's tokenizer "
        "(pass the served model's with --tokenizer)"
    ]


def test_a_tokenizer_flag_asks_the_server_nothing(loaded, tmp_path):
    server = KeyedServer(key=None)
    serving.run(_serving_args("--tokenizer", str(tmp_path)), transport=httpx.MockTransport(server))
    assert loaded == [str(tmp_path)] and "/get_model_info" not in dict(server.seen)
