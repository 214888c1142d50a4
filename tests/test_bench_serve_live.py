"""`bench serve` load generator against a live tokenmill server (shared with the server tests)."""
from __future__ import annotations

import asyncio
import math

import pytest

from tests.server_fixtures import SERVED_NAME, get_server
from tokenmill.bench.metrics_math import compute_metrics, parse_sla
from tokenmill.bench.serve import CHAT, run_load
from tokenmill.bench.sharegpt import Request

pytestmark = pytest.mark.slow

OUT = 8


def _requests(n: int) -> list[Request]:
    return [Request(f"Request {i}: write a short list of fruits and colors.", [0] * 12, OUT) for i in range(n)]


def test_load_generator_against_tokenmill() -> None:
    srv = get_server("main")
    results, duration = asyncio.run(run_load(srv.url, SERVED_NAME, _requests(10), rate=20.0, burstiness=1.0,
                                             max_concurrency=4, seed=0, max_duration_s=90, progress=False))
    assert [r.error for r in results] == [""] * 10
    assert all(r.success and r.output_tokens == OUT for r in results)  # ignore_eos + usage honoured
    for r in results:
        assert 0 < r.ttft <= r.latency
        assert 1 <= len(r.itl) <= OUT - 1 and all(g >= 0 for g in r.itl)
        assert r.tpot is not None and r.tpot > 0
    starts = sorted(r.start for r in results)
    assert starts[-1] > 0.05  # arrivals were spread out, not all at t=0
    m = compute_metrics(results, duration, parse_sla(["ttft:60000", "tpot:60000"]))
    assert m.completed == 10 and m.total_output == 10 * OUT
    assert m.goodput == pytest.approx(10 / duration)


def test_chat_endpoint_and_errors_are_results() -> None:
    srv = get_server("main")
    ok, _ = asyncio.run(run_load(srv.url, SERVED_NAME, _requests(2), math.inf, endpoint=CHAT,
                                 max_duration_s=60, progress=False))
    assert all(r.success and r.output_tokens == OUT for r in ok)
    bad, _ = asyncio.run(run_load(srv.url, "no-such-model", _requests(2), math.inf, max_duration_s=60,
                                  progress=False))
    assert all(not r.success and r.error.startswith("HTTP 4") for r in bad)
