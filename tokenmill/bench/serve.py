"""`tokenmill bench serve`: load generator for any OpenAI-compatible streaming server.

Requests arrive by a gamma process (shape = burstiness, mean gap = 1/rate; burstiness 1 is
Poisson, rate inf sends everything at t=0), at most `max_concurrency` in flight. Each request
streams (`stream: true`, `include_usage`) with greedy sampling and `ignore_eos` so the server
produces exactly the requested number of tokens. Timings are taken on the client at each SSE
chunk that carries text. The whole run is bounded: count = num_prompts, time = --max-duration.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import httpx
import numpy as np

from tokenmill.bench.datasets import DatasetConfig, build_requests
from tokenmill.bench.machine import machine_header, machine_info
from tokenmill.bench.metrics_math import BenchMetrics, RequestResult, compute_metrics, parse_sla
from tokenmill.bench.sharegpt import Request

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def parse_rates(text: str) -> list[float]:
    """"1,2,inf" -> [1.0, 2.0, inf]."""
    rates = [float(x) for x in str(text).split(",") if x.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"request rates must be > 0 (or inf), got {text!r}")
    return rates


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait after each of n requests before sending the next (gamma distributed)."""
    if math.isinf(rate):
        return [0.0] * n
    theta = 1.0 / (rate * burstiness)
    return np.random.default_rng(seed).gamma(shape=burstiness, scale=theta, size=n).tolist()


def _payload(model: str, req: Request, endpoint: str, max_tokens: int,
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {**(extra or {}), "model": model, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


async def send_request(client: httpx.AsyncClient, base_url: str, endpoint: str, model: str, req: Request,
                       t0: float, max_tokens: int | None = None, extra: dict[str, Any] | None = None,
                       keep_text: bool = False) -> RequestResult:
    """Stream one request; never raises (errors become a failed result). `extra` adds body
    fields (e.g. `priority`); `keep_text` stores the generated text in the result."""
    res = RequestResult(success=False, prompt_len=len(req.prompt_token_ids))
    body = _payload(model, req, endpoint, max_tokens or req.output_len, extra)
    pieces: list[str] = []
    st = time.perf_counter()
    res.start = st - t0
    last = st
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", base_url + endpoint, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens", usage_tokens)
                if text := _chunk_text(chunk):
                    if keep_text:
                        pieces.append(text)
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - st
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
        res.latency = time.perf_counter() - st
        res.output_tokens = usage_tokens if usage_tokens is not None else chunks
        res.success = chunks > 0
        res.text = "".join(pieces)
        if not res.success:
            res.error = "no content in the stream"
    except (httpx.HTTPError, json.JSONDecodeError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(base_url: str, model: str, requests: Sequence[Request], rate: float, burstiness: float = 1.0,
                   max_concurrency: int | None = None, seed: int = 0, endpoint: str = COMPLETIONS,
                   max_duration_s: float = 1800.0, request_timeout_s: float = 600.0,
                   progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send every request once on the arrival schedule; returns results in request order and the
    wall duration. Requests still running at max_duration_s are cancelled and count as failed."""
    from tqdm import tqdm

    limit = max_concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    gaps = arrival_gaps(len(requests), rate, burstiness, seed)
    bar = tqdm(total=len(requests), desc=f"rate {rate:g}", disable=not progress, leave=False)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s), limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()

        async def one(req: Request) -> RequestResult:
            async with sem:
                r = await send_request(client, base_url, endpoint, model, req, t0)
            bar.update(1)
            return r

        tasks: list[asyncio.Task[RequestResult]] = []
        for req, gap in zip(requests, gaps):
            tasks.append(asyncio.create_task(one(req)))
            if gap:
                await asyncio.sleep(gap)
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, max_duration_s - (time.perf_counter() - t0)))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0
    bar.close()
    results = [t.result() if t in done else RequestResult(False, error="cancelled at --max-duration")
               for t in tasks]
    return results, duration


def format_table(m: BenchMetrics, title: str = "Serving Benchmark Result", sla: dict[str, float] | None = None) -> str:
    """vLLM-style result block."""
    w = 58
    rows: list[str] = [f"{' ' + title + ' ':=^{w}}"]

    def row(label: str, value: Any) -> None:
        v = f"{value:.2f}" if isinstance(value, float) else str(value)
        rows.append(f"{label:<{w - 12}}{v:>12}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", m.duration_s)
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput)
    if m.goodput is not None:
        sla_text = " ".join(f"{k}:{v:g}" for k, v in (sla or {}).items())
        row(f"Request goodput (req/s) [{sla_text}]:" if sla_text else "Request goodput (req/s):", m.goodput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    for key, name in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                      ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        s = getattr(m, key)
        rows.append(f"{name:-^{w}}")
        short = key.upper()
        row(f"Mean {short} (ms):", s.mean)
        row(f"Median {short} (ms):", s.median)
        row(f"P95 {short} (ms):", s.p95)
        row(f"P99 {short} (ms):", s.p99)
    rows.append("=" * w)
    return "\n".join(rows)


def run_record(rate: float, results: Sequence[RequestResult], duration: float,
               sla: dict[str, float], metrics: BenchMetrics | None = None) -> dict[str, Any]:
    """JSON-able record of one run: the metrics (computed unless given) plus every request's
    raw timings."""
    m = metrics or compute_metrics(results, duration, sla)
    return {"request_rate": "inf" if math.isinf(rate) else rate, "metrics": asdict(m),
            "requests": [compact_record(r) for r in results]}


def save_json(path: Path, doc: dict[str, Any]) -> None:
    """Result files hold every request's raw timings: one compact line, not pretty-printed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, separators=(",", ":")) + "\n", encoding="utf-8")


def compact_record(r: RequestResult) -> dict[str, Any]:
    """A request's raw timings for JSON: times rounded to 10 us, no generated text."""
    d = asdict(r)
    d.pop("text")
    for k in ("ttft", "latency", "start"):
        d[k] = round(d[k], 5)
    d["itl"] = [round(x, 5) for x in r.itl]
    return d


def served_model(base_url: str) -> str:
    r = httpx.get(base_url + "/v1/models", timeout=10, trust_env=False)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def dataset_config(args: argparse.Namespace) -> DatasetConfig:
    return DatasetConfig(name=args.dataset, num_prompts=args.num_prompts, seed=args.seed,
                         max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
                         input_len=args.random_input_len, output_len=args.random_output_len,
                         range_ratio=args.random_range_ratio, prefix_len=args.prefix_len, max_turns=args.max_turns)


def load_requests(args: argparse.Namespace) -> list[Request]:
    from tokenmill.hub import resolve_model
    from tokenmill.model.loader import load_tokenizer

    tok = load_tokenizer(resolve_model(args.tokenizer))
    return build_requests(tok, dataset_config(args))


WARMUP_PROMPTS = [f"Warm-up request {i}: list the first ten prime numbers." for i in range(4)]


def warm_up(base_url: str, model: str, endpoint: str) -> None:
    """A small concurrent burst, so batched code paths are compiled/allocated before timing.
    Its prompts never occur in a workload, so it leaves nothing in a prefix cache to hit."""
    burst = [Request(p, [], 8) for p in WARMUP_PROMPTS]
    warm, _ = asyncio.run(run_load(base_url, model, burst, math.inf, progress=False,
                                   endpoint=endpoint, max_duration_s=180))
    if not all(w.success for w in warm):
        raise RuntimeError(f"warm-up request to {base_url} failed: {[w.error for w in warm]}")


def run_rate(base_url: str, model: str, requests: Sequence[Request], rate: float, args: argparse.Namespace,
             label: str = "") -> dict[str, Any]:
    """One timed run at one request rate, printed as a table; returns its record."""
    sla = parse_sla(args.goodput)
    results, duration = asyncio.run(run_load(
        base_url, model, requests, rate, args.burstiness, args.max_concurrency, args.seed,
        args.endpoint, args.max_duration, progress=not args.no_progress))
    m = compute_metrics(results, duration, sla)
    print(format_table(m, f"{label} rate={rate:g}".strip(), sla), flush=True)
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        print(f"errors: {errors[:3]}", flush=True)
    return run_record(rate, results, duration, sla, m)


def sweep(base_url: str, model: str, requests: Sequence[Request], args: argparse.Namespace,
          label: str = "") -> list[dict[str, Any]]:
    """One run per request rate against an already running server. The same prompts repeat
    across rates, so a server with a prefix cache answers later rates partly from it;
    `bench compare` restarts each server per rate instead."""
    warm_up(base_url, model, args.endpoint)
    return [run_rate(base_url, model, requests, rate, args, label) for rate in parse_rates(args.request_rate)]


def quiet_http_logs() -> None:
    """httpx logs every request at INFO, which would bury the progress bar and tables."""
    import logging
    logging.getLogger("httpx").setLevel(logging.WARNING)


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    print(machine_header(), flush=True)
    quiet_http_logs()
    base_url = args.base_url.rstrip("/")
    model = args.model or served_model(base_url)
    requests = load_requests(args)
    runs = sweep(base_url, model, requests, args)
    doc = {"benchmark": "serve", "base_url": base_url, "model": model, "machine": machine_info(),
           "config": {k: v for k, v in vars(args).items() if k != "func"}, "runs": {model: runs}}
    if args.save_result:
        save_json(Path(args.save_result), doc)
        print(f"wrote {args.save_result}")
    if args.plot:
        from tokenmill.bench.plots import plot_runs
        plot_runs(doc["runs"], Path(args.plot), title=f"{model} @ {base_url}")
        print(f"wrote {args.plot}")
    return doc
