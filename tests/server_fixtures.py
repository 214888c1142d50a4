"""Live `tokenmill serve` processes for the server tests (real SmolLM2 on loopback).

Loading the model dominates the cost of a server test, so there are only two server
configurations and they are shared: `main` (plain, for the API tests) and `guarded` (API key,
2 seats, queue of 2, short context: auth, queue-full, schemathesis and finally SIGTERM). The
first test that needs a server starts both processes at once so they load in parallel; each
is stopped when the session ends. Server logs go to files that tests can read (for the
periodic stats line) and that are printed if start-up fails.
"""
from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tokenmill.parallel.worker import free_loopback_port

MODEL = "smollm2-135m-instruct"
SERVED_NAME = "smollm2"
STARTUP_TIMEOUT_S = float(os.environ.get("TOKENMILL_TEST_STARTUP_TIMEOUT", "300"))
API_KEY = "test-key-123"
CONFIGS = {
    "main": ["--max-num-seqs", "64"],     # the disconnect tests hold 20 streams at once
    "guarded": ["--api-key", API_KEY, "--max-num-seqs", "2", "--max-queue-len", "2", "--max-model-len", "128",
                "--shutdown-timeout", "60"],
}
BASE_ARGS = ["--max-model-len", "2048", "--kv-cache-memory", "256M", "--dtype", "auto",
             "--served-model-name", SERVED_NAME, "--disable-uvicorn-access-log", "--log-stats-interval", "1"]


free_port = free_loopback_port


@dataclass
class ServerProcess:
    extra_args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerProcess":
        fd, name = tempfile.mkstemp(prefix="tokenmill-server-", suffix=".log")
        self.log_path = Path(name)
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", MODEL, "--host", "127.0.0.1",
               "--port", str(self.port), *BASE_ARGS, *self.extra_args]
        self.proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent)
        os.close(fd)
        return self

    def wait_ready(self) -> "ServerProcess":
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S}s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def metric(self, name: str, default: float | None = None) -> float:
        """Sum of a metric's samples (e.g. 'tokenmill:num_requests_running') from /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
        if not values:
            if default is not None:
                return default
            raise KeyError(name)
        return sum(values)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def load_tokenizer():
    """The tokenizer the server uses, for checking usage counts."""
    from tokenmill.hub import fetch
    from tokenmill.model.loader import load_tokenizer as _load

    return _load(fetch(MODEL))


_servers: dict[str, ServerProcess] = {}


def get_server(name: str) -> ServerProcess:
    """The running server of configuration `name` (started, with all others, on first use)."""
    if not _servers:
        for key, args in CONFIGS.items():
            _servers[key] = ServerProcess(list(args)).start()
        atexit.register(stop_all)
    srv = _servers[name]
    if srv.proc.poll() is not None and srv.proc.returncode != 0:
        raise RuntimeError(f"server {name!r} exited with {srv.proc.returncode}:\n{srv.log()[-4000:]}")
    return srv.wait_ready()


def stop_all() -> None:
    for srv in _servers.values():
        srv.stop()
        if srv.log_path is not None and not os.environ.get("TOKENMILL_KEEP_SERVER_LOGS"):
            srv.log_path.unlink(missing_ok=True)
