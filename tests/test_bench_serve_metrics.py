"""Serving-benchmark math: percentiles, TPOT without the first token, goodput, arrivals, tables."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tokenmill.bench.compare import side_by_side
from tokenmill.bench.metrics_math import RequestResult, compute_metrics, meets_sla, parse_sla, stat
from tokenmill.bench.serve import arrival_gaps, format_table, parse_rates, run_record


def _req(ttft: float, latency: float, tokens: int, prompt: int = 10, itl: list[float] | None = None) -> RequestResult:
    return RequestResult(True, prompt_len=prompt, output_tokens=tokens, ttft=ttft, latency=latency, itl=itl or [])


def test_stat_percentiles_in_ms() -> None:
    s = stat([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert s.count == 100
    assert s.mean == pytest.approx(50.5)
    assert s.median == pytest.approx(50.5)
    assert s.p95 == pytest.approx(95.05)
    assert s.p99 == pytest.approx(99.01)
    assert stat([]).count == 0 and stat([]).p99 == 0.0
    one = stat([0.25])
    assert (one.mean, one.median, one.p95, one.p99) == (250.0, 250.0, 250.0, 250.0)


def test_tpot_excludes_first_token() -> None:
    # TTFT 1 s (prefill), then 4 more tokens over 0.4 s -> 100 ms per output token, not 280 ms
    r = _req(ttft=1.0, latency=1.4, tokens=5)
    assert r.tpot == pytest.approx(0.1)
    assert _req(ttft=1.0, latency=1.0, tokens=1).tpot is None
    assert RequestResult(False, output_tokens=5, ttft=1, latency=2).tpot is None


def test_compute_metrics_counts_and_throughput() -> None:
    rs = [_req(0.1, 1.1, 11, prompt=5, itl=[0.1] * 10), _req(0.3, 0.3, 1, prompt=7),
          RequestResult(False, prompt_len=100, error="boom")]
    m = compute_metrics(rs, duration_s=2.0)
    assert (m.completed, m.failed, m.total_input, m.total_output) == (2, 1, 12, 12)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(6.0)
    assert m.total_token_throughput == pytest.approx(12.0)
    assert m.tpot.count == 1 and m.tpot.mean == pytest.approx(100.0)  # the 1-token request has no TPOT
    assert m.itl.count == 10 and m.ttft.mean == pytest.approx(200.0)
    assert m.goodput is None


def test_goodput_per_request_sla() -> None:
    sla = parse_sla(["ttft:500", "tpot:40"])
    assert sla == {"ttft": 500.0, "tpot": 40.0}
    good = _req(0.4, 0.4 + 9 * 0.03, 10)          # ttft 400 ms, tpot 30 ms
    slow_ttft = _req(0.6, 0.6 + 9 * 0.03, 10)     # ttft 600 ms
    slow_tpot = _req(0.1, 0.1 + 9 * 0.05, 10)     # tpot 50 ms
    single = _req(0.2, 0.2, 1)                    # no TPOT: judged on TTFT only
    assert [meets_sla(r, sla) for r in (good, slow_ttft, slow_tpot, single)] == [True, False, False, True]
    assert not meets_sla(RequestResult(False), sla)
    m = compute_metrics([good, slow_ttft, slow_tpot, single], duration_s=4.0, sla=sla)
    assert m.goodput == pytest.approx(0.5)
    assert compute_metrics([good], 1.0, parse_sla(["e2el:100"])).goodput == 0.0
    with pytest.raises(ValueError):
        parse_sla(["latency:5"])
    with pytest.raises(ValueError):
        parse_sla(["ttft"])


def test_arrivals_gamma_mean_and_inf() -> None:
    assert parse_rates("1,2.5,inf") == [1.0, 2.5, math.inf]
    with pytest.raises(ValueError):
        parse_rates("0")
    assert arrival_gaps(5, math.inf, 1.0, 0) == [0.0] * 5
    for burstiness in (1.0, 0.5, 4.0):
        gaps = arrival_gaps(20000, 4.0, burstiness, seed=1)
        assert np.mean(gaps) == pytest.approx(0.25, rel=0.05)
        # gamma variance = shape * scale^2 = 1 / (rate^2 * burstiness): bursty < 1 means more spread
        assert np.var(gaps) == pytest.approx(1 / (16 * burstiness), rel=0.1)
    assert arrival_gaps(10, 2.0, 1.0, 7) == arrival_gaps(10, 2.0, 1.0, 7)


def test_tables_render() -> None:
    sla = {"ttft": 500.0}
    rs = [_req(0.1, 0.5, 5, itl=[0.1] * 4)]
    m = compute_metrics(rs, 1.0, sla)
    text = format_table(m, "x", sla)
    assert "Request goodput (req/s) [ttft:500]:" in text and "P99 TPOT (ms):" in text
    runs = {"tokenmill": [run_record(math.inf, rs, 1.0, sla)],
            "llama.cpp": [run_record(math.inf, rs, 2.0, sla)]}
    table = side_by_side(runs, {"batch_size": 4, "requests": 1, "output_tok_s": 2.5}, "ttft:500")
    line = next(x for x in table.splitlines() if x.startswith("output throughput"))
    assert line.split()[-1] == "2.00x"  # tokenmill 5 tok/s vs llama.cpp 2.5 tok/s
    assert "tokenmill/HF = 2.00x" in table
