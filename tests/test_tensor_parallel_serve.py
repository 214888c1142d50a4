"""Tensor parallelism end to end: two torchrun "nodes" on two loopback addresses serving an
OpenAI request, and a rank killed mid-stream ending the stream and the server (exit != 0)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server_fixtures import free_port
from tests.tiny_models import save_tiny_model_dir

ROOT = Path(__file__).parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def wait_healthy(url: str, procs: list[subprocess.Popen], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[:6]} exited with {p.returncode}:\n{p.stdout.read()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server not healthy")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_two_torchrun_nodes_serve_one_request(tmp_path):
    model = save_tiny_model_dir(tmp_path / "qwen2", arch="qwen2")
    master, http = free_port(), free_port()
    serve = ["-m", "tokenmill.cli", "serve", model, "--tensor-parallel-size", "2", "--dtype", "float32",
             "--max-model-len", "128", "--kv-cache-memory", "8M", "--num-threads", "1", "--port", str(http)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    nodes = [subprocess.Popen([*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
                               "--master-addr", "127.0.0.1", "--master-port", str(master),
                               "--local-addr", f"127.0.0.{rank + 1}", *serve],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    try:
        url = f"http://127.0.0.1:{http}"
        wait_healthy(url, nodes)
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hello world", "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        # SIGTERM to node 0's torchrun: it forwards it to rank 0 (and itself exits 1, as torchrun does
        # on a signal); rank 0 drains and tells rank 1 to stop, whose torchrun then exits 0
        stop(nodes[:1])
        assert "server stopped" in nodes[0].stdout.read()
        assert nodes[1].wait(timeout=60) == 0, nodes[1].stdout.read()[-3000:]


@pytest.mark.slow
def test_killing_a_rank_mid_stream_ends_stream_and_server():
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "smollm2-135m-instruct",
                               "--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "1024",
                               "--kv-cache-memory", "64M", "--port", str(port)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(server.stdout), daemon=True).start()
    try:
        wait_healthy(url, [])
        [worker] = spawned_children(server.pid)
        body = {"model": "smollm2-135m-instruct", "prompt": "Tell me a long story.", "max_tokens": 900,
                "ignore_eos": True, "stream": True}
        events, ended = [], None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            try:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        if len(events) == 5:
                            os.kill(worker, signal.SIGKILL)
                            killed = time.monotonic()
                ended = "closed"
            except httpx.HTTPError as exc:
                ended = type(exc).__name__
        assert len(events) >= 5 and time.monotonic() - killed < 30
        # the client learns: an error event ends the stream, or the connection drops
        assert "error" in events[-1] or ended != "closed", events[-3:]
        assert not any(e.get("choices", [{}])[0].get("finish_reason") for e in events), "stream finished normally"
        assert server.wait(timeout=30) != 0
        assert any("tensor-parallel worker rank 1" in line and "died" in line for line in log), "".join(log)[-3000:]
    finally:
        stop([server])


def spawned_children(pid: int) -> list[int]:
    """multiprocessing 'spawn' children (the workers; not its resource tracker)."""
    children = [int(c) for c in subprocess.check_output(["pgrep", "-P", str(pid)], text=True).split()]
    return [c for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
