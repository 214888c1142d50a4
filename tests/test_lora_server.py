"""LoRA over HTTP, in-process on a tiny model: the `model` field picks an adapter, /v1/models
lists adapters with their parent, and runtime loads only come from inside --lora-dir."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.tiny_models import save_tiny_model_dir
from tests.tiny_server import BASE, make_client
from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.lora.peft_format import random_adapter
from tokenmill.model.loader import read_model_config


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    model = Path(save_tiny_model_dir(root / "model"))
    cfg = read_model_config(model)
    lora_dir = root / "adapters"
    static = random_adapter(root / "static", cfg, 8, seed=1, std=0.5)        # outside lora_dir: operator's
    random_adapter(lora_dir / "runtime", cfg, 4, seed=2, std=1.0)
    random_adapter(root / "secret", cfg, 4, seed=3)                           # must stay unreachable
    (lora_dir / "escape").symlink_to(root / "secret")
    return model, static, lora_dir


@pytest.fixture(scope="module")
def client(setup):
    model, static, lora_dir = setup
    with make_client(model, enable_lora=True, lora_modules=[f"static={static}"], lora_dir=str(lora_dir)) as c:
        yield c


def complete(client: TestClient, model: str, prompt: str = "hello world") -> dict:
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_model_field_selects_the_adapter(client, setup):
    model, static, _ = setup
    via_http = complete(client, "static")
    assert via_http["model"] == "static"
    offline = LLM(str(model), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20, enable_lora=True)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = offline.generate(["hello world"], params, use_tqdm=False, lora_request=LoRARequest("s", 1, str(static)))
    base = offline.generate(["hello world"], params, use_tqdm=False)
    assert via_http["choices"][0]["text"] == want[0].outputs[0].text != base[0].outputs[0].text
    assert complete(client, BASE)["choices"][0]["text"] == base[0].outputs[0].text


def test_models_lists_adapters_with_their_parent(client, setup):
    data = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert data[BASE]["parent"] is None
    assert data["static"]["parent"] == BASE and data["static"]["root"] == str(setup[1])


def test_runtime_load_use_and_unload(client):
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": "runtime"})
    assert r.status_code == 200, r.text
    assert "rt" in {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert complete(client, "rt")["choices"][0]["text"] != complete(client, BASE)["choices"][0]["text"]
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": "runtime"})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "rt"}).status_code == 200
    gone = client.post("/v1/completions", json={"model": "rt", "prompt": "hi", "max_tokens": 2})
    assert gone.status_code == 404
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "rt"}).status_code == 404


@pytest.mark.parametrize("path", ["../secret", "escape", "/etc", "{root}/secret", "missing"])
def test_paths_outside_lora_dir_or_not_adapters_get_400(client, setup, path):
    path = path.format(root=setup[2].parent)
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
    assert r.status_code == 400, r.text
    body = r.json()["error"]
    assert body["type"] == "invalid_request_error" and body["param"] == "lora_path"
    if path != "missing":
        assert "outside the LoRA directory" in body["message"]
    assert "x" not in {m["id"] for m in client.get("/v1/models").json()["data"]}


def test_runtime_loading_needs_lora_dir(setup):
    model, static, _ = setup
    with make_client(model, enable_lora=True) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "s", "lora_path": str(static)})
        assert r.status_code == 400 and "--lora-dir" in r.json()["error"]["message"]
    assert os.path.isdir(static)
