"""Anchor server command lines (equal resources, --no-repack) and the plot writer."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from tokenmill.bench.anchors import llama_server_spec, tokenmill_spec
from tokenmill.bench.metrics_math import RequestResult
from tokenmill.bench.serve import run_record


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_equal_resources_and_no_repack() -> None:
    ll = llama_server_spec("true", Path("/m.gguf"), 9001, parallel=8, ctx_per_seq=512, threads=2)
    assert "--no-repack" in ll.cmd and "-cb" in ll.cmd
    assert (_flag(ll.cmd, "-np"), _flag(ll.cmd, "-c"), _flag(ll.cmd, "-t")) == ("8", "4096", "2")
    assert _flag(ll.cmd, "--host") == "127.0.0.1" and ll.base_url == "http://127.0.0.1:9001"
    tm = tokenmill_spec("smollm2-135m-instruct", 9002, parallel=8, ctx_per_seq=512, threads=2, dtype="bfloat16")
    assert (_flag(tm.cmd, "--max-num-seqs"), _flag(tm.cmd, "--max-model-len"), _flag(tm.cmd, "--num-threads")) \
        == ("8", "512", "2")
    assert _flag(tm.cmd, "--host") == "127.0.0.1"
    with pytest.raises(FileNotFoundError):
        llama_server_spec("no-such-llama-server-binary", Path("/m.gguf"), 1, 1, 1, 1)


def test_plot_sweep_png(tmp_path: Path) -> None:
    from tokenmill.bench.plots import plot_runs

    rs = [RequestResult(True, 10, 5, ttft=0.1 * i, latency=0.5 + 0.1 * i, itl=[0.1] * 4) for i in range(1, 6)]
    runs = {name: [run_record(rate, rs, 2.0, {"ttft": 500.0}) for rate in (1.0, math.inf)]
            for name in ("tokenmill", "llama.cpp")}
    out = tmp_path / "sweep.png"
    plot_runs(runs, out, title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot_runs({"tokenmill": runs["tokenmill"][:1]}, tmp_path / "one.png")
    assert (tmp_path / "one.png").stat().st_size > 1000
