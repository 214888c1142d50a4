"""Clients that go away get their requests aborted and their KV blocks freed (live server)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.server_fixtures import SERVED_NAME, ServerProcess, get_server

pytestmark = pytest.mark.slow

LONG = {"model": SERVED_NAME, "max_tokens": 1500, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return get_server("main")


def wait_idle(server: ServerProcess, timeout: float = 10.0) -> float:
    """Seconds until /metrics shows nothing running or waiting and an empty KV cache."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if (server.metric("tokenmill:num_requests_running") == 0
                and server.metric("tokenmill:num_requests_waiting") == 0
                and server.metric("tokenmill:kv_cache_usage_perc") == 0):
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"engine not idle after {timeout}s: running="
                         f"{server.metric('tokenmill:num_requests_running')} "
                         f"kv={server.metric('tokenmill:kv_cache_usage_perc')}")


def test_20_dropped_streams_free_everything(server):
    wait_idle(server)
    finished_before = server.metric("tokenmill:request_success_total", default=0.0)

    async def stream_then_drop(client: httpx.AsyncClient, i: int, dropped: asyncio.Event,
                               mid_stream: list[int]) -> int:
        body = {**LONG, "stream": True}
        if i % 2:
            body["messages"] = [{"role": "user", "content": f"Tell me a long story number {i}."}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = f"Story number {i}: once upon a time"
            path = "/v1/completions"
        chunks = 0
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()    # held: a dropped generator would close the stream at `break`
            async for line in lines:
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks >= 3:
                        break
            mid_stream.append(i)
            await dropped.wait()      # everyone is mid-stream: now all hang up together
        return chunks                  # leaving the block closes the connection mid-stream

    async def run() -> tuple[float, list[int]]:
        dropped, mid_stream = asyncio.Event(), []
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=40)) as client:
            tasks = [asyncio.create_task(stream_then_drop(client, i, dropped, mid_stream)) for i in range(20)]
            deadline = time.monotonic() + 120      # a busy 2-core CI machine starts 20 streams slowly
            while len(mid_stream) < 20 and not any(t.done() for t in tasks) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            # in flight = running + waiting: the longest streams may have been preempted for KV space
            in_flight = server.metric("tokenmill:num_requests_running") + server.metric("tokenmill:num_requests_waiting")
            dropped.set()
            return in_flight, await asyncio.gather(*tasks)

    in_flight_at_drop, chunks = asyncio.run(run())
    assert in_flight_at_drop == 20 and all(c >= 3 for c in chunks)
    took = wait_idle(server)
    assert took < 5.0
    # the engine really stopped: no more tokens are produced
    gen = server.metric("tokenmill:generation_tokens_total")
    time.sleep(0.5)
    assert server.metric("tokenmill:generation_tokens_total") == gen
    text = httpx.get(server.url + "/metrics").text
    assert 'finished_reason="abort"' in text
    assert server.metric("tokenmill:request_success_total") >= finished_before + 20
    # and it still serves
    r = httpx.post(server.url + "/v1/completions", json={"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"prompt": "Write a very long essay:"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a very long essay."}]}),
])
def test_non_streaming_disconnect_aborts(server, path, extra):
    wait_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + path, json={**LONG, **extra}, timeout=httpx.Timeout(60, read=1.5))
    took = wait_idle(server)
    assert took < 5.0


def test_stream_read_to_the_end_after_drops(server):
    """A normal stream still ends with [DONE] (the abort path did not disturb the loop)."""
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 4, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] in ("stop", "length")
