"""LoRA adapters through the HTTP API (the real app around the fake TokenizerManager of
tests/entrypoints/conftest.py): the OpenAI `model` names an adapter (`name` or
`<served-model-name>:name`) or `lora_path` does, /v1/models lists the adapters, and a name
that is neither is a 404 while a contradiction is a 400."""

from __future__ import annotations

import json
import os

import pytest

USER = [{"role": "user", "content": "hi"}]


def _adapter(path: str) -> str:
    os.makedirs(path)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"r": 2, "lora_alpha": 4}, f)
    open(os.path.join(path, "adapter_model.safetensors"), "wb").close()
    return path


@pytest.fixture
def served(tmp_path, fake_tm, make_client):
    paths = {"ad1": _adapter(str(tmp_path / "one")), "ad2": _adapter(str(tmp_path / "two"))}
    paths["team:v3"] = _adapter(str(tmp_path / "three"))  # (a name with a colon)
    tm = fake_tm
    tm.lora_paths = dict(paths)
    with make_client(tm) as client:
        base = client.get("/v1/models").json()["data"][0]["id"]
        yield client, tm, paths, base


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_model_or_lora_path_picks_the_adapter(served, path):
    client, tm, _, base = served
    body = {"prompt": "ab"} if path == "/v1/completions" else {"messages": USER}
    for extra, lora, model in [
        ({}, None, base),
        ({"model": base}, None, base),
        ({"model": "ad1"}, "ad1", "ad1"),
        ({"model": f"{base}:ad2"}, "ad2", f"{base}:ad2"),
        ({"lora_path": "ad2"}, "ad2", base),
        ({"model": "ad1", "lora_path": "ad1"}, "ad1", "ad1"),
        ({"model": "team:v3"}, "team:v3", "team:v3"),
        ({"model": f"{base}:team:v3"}, "team:v3", f"{base}:team:v3"),  # (was a 404)
    ]:
        r = client.post(path, json={**body, **extra, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert tm.requests[-1].lora_path == lora, extra
        assert r.json()["model"] == model
    r = client.post(path, json={**body, "model": "nope"})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = client.post(path, json={**body, "model": f"{base}:nope"})
    assert r.status_code == 404
    r = client.post(path, json={**body, "model": "ad1", "lora_path": "ad2"})
    assert r.status_code == 400 and "ad1" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_adapter_unloaded_as_its_request_ends_leaves_the_response_whole(served, path):
    """The adapter was looked up again once the request had ended, and an unload in that
    moment (it is allowed then) turned a served request into a 404 "does not exist"."""
    client, tm, _, _ = served
    generate = tm.generate_request

    async def then_unloaded(obj, request=None):
        async for item in generate(obj, request):
            yield item
        tm.lora_paths.pop("ad1", None)  # what /unload_lora_adapter does as the request ends

    tm.generate_request = then_unloaded
    body = {"prompt": "ab"} if path == "/v1/completions" else {"messages": USER}
    r = client.post(path, json={**body, "model": "ad1", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "ad1" and "ad1" not in tm.lora_paths


def test_streamed_chunks_name_the_adapter(served):
    client, _, _, _ = served
    body = {"prompt": "ab", "model": "ad1", "stream": True, "max_tokens": 2}
    with client.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert chunks and all(c["model"] == "ad1" for c in chunks)


def test_models_lists_the_adapters(served):
    client, _, paths, base = served
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [base, "ad1", "ad2", "team:v3"]
    assert data[1]["parent"] == base and data[1]["root"] == paths["ad1"]
    assert data[0]["root"] == "/models/tiny-llama.gguf"  # (was null; SGLang and vLLM fill it)
    one = client.get("/v1/models/ad2").json()
    assert one["id"] == "ad2" and one["root"] == paths["ad2"] and one["parent"] == base
    assert client.get(f"/v1/models/{base}").json()["id"] == base
    assert client.get("/v1/models/nope").status_code == 404
    assert client.get(f"/v1/models/{base}:team:v3").json()["id"] == "team:v3"


def test_generate_passes_lora_path(served):
    client, tm, _, _ = served
    r = client.post("/generate", json={"text": ["a", "b"], "lora_path": ["ad1", None]})
    assert r.status_code == 200, r.text
    assert tm.requests[-1].lora_path == ["ad1", None]
