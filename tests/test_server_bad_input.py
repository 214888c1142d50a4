"""Every kind of bad request gets the right status and an OpenAI-style error body, and the
server keeps serving afterwards (live server, SmolLM2, max_model_len 2048)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server_fixtures import SERVED_NAME, ServerProcess, get_server

pytestmark = pytest.mark.slow

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def comp(**kw) -> dict:
    return {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 2, **kw}


def chat(**kw) -> dict:
    return {"model": SERVED_NAME, "messages": MSG, "max_tokens": 2, **kw}


# (id, path, body: dict | bytes, content-type, status, param or None)
CASES = [
    ("malformed-json", C, b'{"prompt": "x",', None, 400, None),
    ("json-not-object", C, b'[1, 2]', None, 400, None),
    ("empty-body", C, b"", None, 400, None),
    ("invalid-utf8", C, b'{"prompt": "\xff\xfe\xfd"}', None, 400, None),
    ("lone-surrogate", C, b'{"prompt": "\\ud800 x", "max_tokens": 2}', None, 400, "prompt"),
    ("nan-temperature", C, b'{"prompt": "x", "temperature": NaN}', None, 400, "temperature"),
    ("not-json-content-type", C, json.dumps(comp()).encode(), "text/plain", 400, None),
    ("float-top_k", C, comp(top_k=1.5), None, 400, "top_k"),
    ("float-top_k-integral", C, comp(top_k=2.0), None, 400, "top_k"),
    ("bool-max_tokens", C, comp(max_tokens=True), None, 400, "max_tokens"),
    ("string-n", C, comp(n="2"), None, 400, "n"),
    ("negative-temperature", C, comp(temperature=-0.5), None, 400, "temperature"),
    ("huge-temperature", C, comp(temperature=3.0), None, 400, "temperature"),
    ("top_p-zero", C, comp(top_p=0.0), None, 400, "top_p"),
    ("top_p-above-one", C, comp(top_p=1.5), None, 400, "top_p"),
    ("top_k-below-minus-one", C, comp(top_k=-2), None, 400, "top_k"),
    ("min_p-above-one", C, comp(min_p=2.0), None, 400, "min_p"),
    ("presence-penalty-range", C, comp(presence_penalty=3.0), None, 400, "presence_penalty"),
    ("repetition-penalty-zero", C, comp(repetition_penalty=0.0), None, 400, "repetition_penalty"),
    # found by schemathesis: 5e-324 is 0 in float32 -> logits/0 = inf -> NaN probs in the sampler
    ("repetition-penalty-denormal", CHAT, chat(repetition_penalty=5e-324), None, 400, "repetition_penalty"),
    ("max_tokens-zero", C, comp(max_tokens=0), None, 400, "max_tokens"),
    ("max_tokens-negative", C, comp(max_tokens=-5), None, 400, "max_tokens"),
    ("max_tokens-beyond-context", C, comp(max_tokens=5000), None, 400, "max_tokens"),
    ("chat-max_tokens-beyond-context", CHAT, chat(max_completion_tokens=4096), None, 400,
     "max_completion_tokens"),
    ("min_tokens-above-max", C, comp(min_tokens=5), None, 400, "min_tokens"),
    ("prompt-too-long", C, comp(prompt="hello " * 3000), None, 400, "prompt"),
    ("chat-prompt-too-long", CHAT, chat(messages=[{"role": "user", "content": "hello " * 3000}]), None, 400,
     "messages"),
    ("empty-prompt", C, comp(prompt=""), None, 400, "prompt"),
    ("empty-prompt-list", C, comp(prompt=[]), None, 400, "prompt"),
    ("token-id-out-of-range", C, comp(prompt=[1, 10 ** 9]), None, 400, "prompt"),
    ("negative-token-id", C, comp(prompt=[-1]), None, 400, "prompt"),
    ("missing-prompt", C, {"model": SERVED_NAME}, None, 400, "prompt"),
    ("n-zero", C, comp(n=0), None, 400, "n"),
    ("n-too-large", C, comp(n=1000), None, 400, "n"),
    ("logprobs-too-many", C, comp(logprobs=21), None, 400, "logprobs"),
    ("empty-stop-string", C, comp(stop=""), None, 400, "stop"),
    ("stop-token-out-of-vocab", C, comp(stop_token_ids=[10 ** 7]), None, 400, "stop_token_ids"),
    ("seed-string", C, comp(seed="42"), None, 400, "seed"),
    ("logit-bias", C, comp(logit_bias={"1": 5.0}), None, 400, "logit_bias"),
    ("empty-messages", CHAT, chat(messages=[]), None, 400, "messages"),
    ("missing-messages", CHAT, {"model": SERVED_NAME}, None, 400, "messages"),
    ("unknown-role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), None, 400, "messages.0.role"),
    ("message-not-object", CHAT, chat(messages=["hi"]), None, 400, "messages.0"),
    ("image-content", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     None, 400, "messages.0.content"),
    ("top_logprobs-without-logprobs", CHAT, chat(top_logprobs=2), None, 400, "top_logprobs"),
    ("tools-unsupported", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), None, 400, "tools"),
    ("unknown-model", C, comp(model="gpt-17"), None, 404, "model"),
    ("chat-unknown-model", CHAT, chat(model="gpt-17"), None, 404, "model"),
    ("oversized-body", C, json.dumps(comp(prompt="x" * (9 << 20))).encode(), None, 413, None),
]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return get_server("main")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("path,body,ctype,status,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(http, path, body, ctype, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=content, headers={"content-type": ctype or "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err
    # the server is still fine
    assert http.get("/health").status_code == 200


def test_unknown_route_and_method(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = http.get(C)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_openai_client_sees_typed_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=SERVED_NAME, prompt="x", extra_body={"top_k": 1.5})
    assert e.value.body["param"] == "top_k"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=SERVED_NAME, messages=MSG, temperature=-1)
    # and good requests still work right after
    r = client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=3)
    assert r.usage.completion_tokens >= 1
