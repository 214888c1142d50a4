"""API key, full queue, a bounded schemathesis run, then SIGTERM — in that order, on the
`guarded` server (API key, 2 seats, queue of 2, max_model_len 128). The SIGTERM test ends the
server, so it stays last in this file."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_fixtures import API_KEY, SERVED_NAME, ServerProcess, get_server

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return get_server("guarded")


def test_api_key_required_on_v1_only(server):
    url = server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": "Basic x"}):
        r = httpx.get(url + "/v1/models", headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == 401
        r = httpx.post(url + "/v1/completions", headers=headers, json={"prompt": "x"})
        assert r.status_code == 401
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200
    for path in ("/health", "/metrics", "/version"):      # operational routes stay open
        assert httpx.get(url + path).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0).completions.create(
        model=SERVED_NAME, prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def _open_stream(url: str, max_tokens: int) -> httpx.Response:
    client = httpx.Client(timeout=120)
    req = client.build_request("POST", url + "/v1/completions", headers=AUTH, json={
        "model": SERVED_NAME, "prompt": "Count slowly:", "max_tokens": max_tokens, "ignore_eos": True,
        "stream": True, "temperature": 0})
    return client.send(req, stream=True)


def test_full_queue_is_503_with_retry_after(server):
    # 2 seats: two long streams run, two more wait in the queue (limit 2), the fifth is refused
    running = [_open_stream(server.url, 100) for _ in range(2)]
    lines = [r.iter_lines() for r in running]
    for it in lines:                         # both produce tokens -> both hold a seat
        assert next(ln for ln in it if ln.startswith("data: {"))
    queued = [_open_stream(server.url, 100) for _ in range(2)]
    try:
        r = httpx.post(server.url + "/v1/completions", headers=AUTH,
                       json={"model": SERVED_NAME, "prompt": "one more", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == 503 and r.json()["error"]["type"] == "server_error"
    finally:
        for resp in running + queued:
            resp.close()
    # once the drops are processed the server accepts work again
    deadline = time.monotonic() + 15
    while server.metric("tokenmill:num_requests_running") + server.metric("tokenmill:num_requests_waiting") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    r = httpx.post(server.url + "/v1/completions", headers=AUTH,
                   json={"model": SERVED_NAME, "prompt": "again", "max_tokens": 2})
    assert r.status_code == 200


SCHEMATHESIS = shutil.which("schemathesis", path=str(Path(sys.executable).parent))


def test_schemathesis_finds_no_server_errors(server, tmp_path):
    """Property-based fuzzing of every route in /openapi.json: no 5xx, ever. Bounded: a few
    examples per operation, one worker (the queue of 2 must not fill: 503 counts as 5xx)."""
    assert SCHEMATHESIS is not None, "schemathesis is a test dependency (pyproject [test])"
    cmd = [SCHEMATHESIS, "run", server.url + "/openapi.json", "-H", f"Authorization: Bearer {API_KEY}",
           "--checks", "not_a_server_error", "--max-examples", os.environ.get("TOKENMILL_SCHEMATHESIS_EXAMPLES", "12"),
           "--phases", "examples,fuzzing",
           "--request-timeout", "30", "--workers", "1", "--seed", "7", "--no-color",
           "--generation-database", "none", "--suppress-health-check", "all"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert httpx.get(server.url + "/health").status_code == 200


def test_sigterm_drains_in_flight_streams_then_exits_0(server):
    """Last test of the module: it stops the server."""
    results: dict[int, list[str]] = {}
    started = threading.Barrier(3)

    def stream(i: int) -> None:
        with httpx.stream("POST", server.url + "/v1/chat/completions", headers=AUTH, timeout=120, json={
                "model": SERVED_NAME, "messages": [{"role": "user", "content": f"Tell story {i}"}],
                "max_tokens": 24, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            got = []
            for line in r.iter_lines():
                if line:
                    got.append(line)
                    if len(got) == 2:
                        started.wait(timeout=60)
            results[i] = got

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(stream, i) for i in range(2)]
        started.wait(timeout=60)             # both streams are producing tokens
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # draining: new work and health checks are refused with 503, not dropped
        r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert httpx.get(server.url + "/health").status_code == 503
        for f in futures:
            f.result(timeout=120)
    assert server.proc.wait(timeout=60) == 0
    for got in results.values():
        assert got[-1] == "data: [DONE]"
        usage = json.loads(got[-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 24          # every in-flight stream finished in full
        finishes = [json.loads(ln[6:])["choices"][0]["finish_reason"] for ln in got[:-2]]
        assert finishes[-1] == "length"
    assert "draining" in server.log()
