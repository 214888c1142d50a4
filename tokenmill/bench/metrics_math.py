"""Per-request timings -> the serving metrics table (vLLM `benchmark_serving` definitions).

- TTFT: request sent -> first content token received.
- TPOT: (E2E - TTFT) / (output_tokens - 1); the first token is excluded, and requests with a
  single output token have no TPOT.
- ITL: every gap between consecutive content chunks of every request (pooled).
- Goodput: requests/s whose own TTFT / TPOT / E2E all meet the SLA (milliseconds).
Percentiles interpolate linearly (numpy's default), all latencies are reported in ms.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

PERCENTILES = (50.0, 95.0, 99.0)
SLA_KEYS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times are seconds."""

    success: bool
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0                              # end to end
    itl: list[float] = field(default_factory=list)    # gaps between content chunks
    start: float = 0.0                                # send time relative to benchmark start
    error: str = ""
    text: str = ""                                    # generated text, only when asked for

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class Stat:
    mean: float
    median: float
    p95: float
    p99: float
    count: int


def stat(values_s: Sequence[float]) -> Stat:
    """Mean / percentiles in ms; all zeros when there is nothing to summarize."""
    if not values_s:
        return Stat(0.0, 0.0, 0.0, 0.0, 0)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p95, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
    return Stat(float(ms.mean()), p50, p95, p99, len(ms))


def parse_sla(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:40"] -> {"ttft": 500.0, "tpot": 40.0} (milliseconds)."""
    out: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in SLA_KEYS:
            raise ValueError(f"bad goodput SLA {item!r}: expected one of {SLA_KEYS} as KEY:MS")
        out[key] = float(value)
    return out


def meets_sla(r: RequestResult, sla: dict[str, float]) -> bool:
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    for key, limit_ms in sla.items():
        v = values[key]
        if v is not None and v * 1000.0 > limit_ms:  # a 1-token request has no TPOT to violate
            return False
    return True


@dataclass(slots=True)
class BenchMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    ttft: Stat
    tpot: Stat
    itl: Stat
    e2el: Stat


def compute_metrics(results: Sequence[RequestResult], duration_s: float,
                    sla: dict[str, float] | None = None) -> BenchMetrics:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    d = max(duration_s, 1e-9)
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    return BenchMetrics(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        total_input=total_in, total_output=total_out,
        request_throughput=len(ok) / d, output_throughput=total_out / d,
        total_token_throughput=(total_in + total_out) / d,
        goodput=(sum(meets_sla(r, sla) for r in ok) / d) if sla else None,
        ttft=stat([r.ttft for r in ok]), tpot=stat(tpots),
        itl=stat([g for r in ok for g in r.itl]), e2el=stat([r.latency for r in ok]))
