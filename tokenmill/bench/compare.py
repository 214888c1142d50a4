"""`tokenmill bench compare`: one workload, one seed, against each server in turn + HF offline.

Servers run one at a time (never two on the 2 shared cores at once); each is started afresh
for every request rate (so no rate inherits a warm prompt cache) and warmed up with a short
burst of prompts that are not in the workload. HF transformers `generate` with static batches
runs the same prompts offline for an output-throughput anchor. The side-by-side table gives
ratio = tokenmill / anchor: above 1 is better for throughputs, worse for latencies.
"""
from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path
from typing import Any, Sequence

from tokenmill.bench.anchors import ManagedServer, ServerSpec, llama_server_spec, tokenmill_spec
from tokenmill.bench.metrics_math import parse_sla
from tokenmill.bench.machine import machine_header, machine_info
from tokenmill.bench.serve import (load_requests, parse_rates, quiet_http_logs, run_rate, save_json,
                                   warm_up)
from tokenmill.bench.sharegpt import Request
from tokenmill.hub import resolve_model

# (label, path into run["metrics"], higher_is_better)
ROWS: list[tuple[str, tuple[str, ...], bool]] = [
    ("successful requests", ("completed",), True),
    ("failed requests", ("failed",), False),
    ("duration (s)", ("duration_s",), False),
    ("request throughput (req/s)", ("request_throughput",), True),
    ("goodput (req/s)", ("goodput",), True),
    ("output throughput (tok/s)", ("output_throughput",), True),
    ("total throughput (tok/s)", ("total_token_throughput",), True),
    *[(f"{stat} {m.upper()} (ms)", (m, key), False)
      for m in ("ttft", "tpot", "itl", "e2el") for stat, key in (("mean", "mean"), ("median", "median"), ("P95", "p95"))],
]


def _get(run: dict[str, Any], path: tuple[str, ...]) -> float | None:
    v: Any = run["metrics"]
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return None if v is None else float(v)


def _fmt(v: float | None) -> str:
    return "-" if v is None else (f"{v:.0f}" if v == int(v) and abs(v) < 1e6 else f"{v:.2f}")


def side_by_side(runs: dict[str, list[dict[str, Any]]], hf: dict[str, Any] | None, sla: str,
                 target: str = "tokenmill") -> str:
    """Per request rate: each metric for every server, and target/anchor ratios."""
    names = sorted(runs, key=lambda n: n != target)  # target first, anchors in their order
    anchors = [n for n in names if n != target]
    w = max([12] + [len(n) + 2 for n in names] + [len(a) + 5 for a in anchors])
    head = f"{'metric':<28}" + "".join(f"{n:>{w}}" for n in names) + "".join(f"{'tm/' + a:>{w}}" for a in anchors)
    lines = [f"goodput SLA: {sla}; ratio = tokenmill / anchor (>1: better for throughput, worse for latency)"]
    rates = [r["request_rate"] for r in runs[names[0]]]
    for i, rate in enumerate(rates):
        lines += ["", f"request rate {rate} req/s", head, "-" * len(head)]
        for label, path, _ in ROWS:
            vals = {n: _get(runs[n][i], path) if i < len(runs[n]) else None for n in names}
            ratios = []
            for a in anchors:
                t, b = vals.get(target), vals[a]
                ratios.append(f"{t / b:.2f}x" if t is not None and b else "-")
            lines.append(f"{label:<28}" + "".join(f"{_fmt(vals[n]):>{w}}" for n in names)
                         + "".join(f"{r:>{w}}" for r in ratios))
        if hf and str(rate) == "inf" and target in runs:
            tm = _get(runs[target][i], ("output_throughput",))
            lines.append(f"HF generate, static batch {hf['batch_size']}, {hf['requests']} requests: "
                         f"{hf['output_tok_s']:.2f} output tok/s offline; tokenmill/HF = "
                         f"{(tm or 0) / hf['output_tok_s']:.2f}x")
    return "\n".join(lines)


def hf_offline(model_path: Path, requests: Sequence[Request], dtype: str, batch_size: int,
               threads: int, max_seconds: float) -> dict[str, Any]:
    """Static batches in dataset order; stops after the batch that crosses max_seconds and
    reports throughput over the batches that ran."""
    import torch

    from tokenmill.bench.hf_runner import HFRunner

    torch.set_num_threads(threads)
    runner = HFRunner(model_path, getattr(torch, dtype))
    runner.throughput([Request(r.prompt, r.prompt_token_ids, 4) for r in requests[:4]], 4)  # warm-up
    secs, done = 0.0, 0
    while done < len(requests) and secs < max_seconds:
        chunk = requests[done:done + batch_size]
        secs += runner.throughput(chunk, batch_size)
        done += len(chunk)
    ran = requests[:done]
    out = sum(r.output_len for r in ran)
    return {"batch_size": batch_size, "dtype": dtype, "requests": done, "seconds": secs, "output_tokens": out,
            "output_tok_s": out / secs,
            "total_tok_s": (out + sum(len(r.prompt_token_ids) for r in ran)) / secs}


def _specs(args: argparse.Namespace, names: list[str], gguf: Path) -> list[ServerSpec]:
    specs = []
    for n in names:
        if n == "tokenmill":
            specs.append(tokenmill_spec(args.model, args.port, args.parallel, args.ctx_per_seq, args.threads,
                                        args.dtype, extra=shlex.split(args.tokenmill_args)))
        elif n == "tokenmill-default":    # the engine's scheduler defaults: what `tokenmill tune` must beat
            specs.append(tokenmill_spec(args.model, args.port, None, args.ctx_per_seq, args.threads, args.dtype,
                                        extra=shlex.split(args.tokenmill_default_args), name=n))
        elif n == "llama.cpp":
            specs.append(llama_server_spec(args.llama_server, gguf, args.port, args.parallel, args.ctx_per_seq,
                                           args.threads))
        elif n != "hf":
            raise ValueError(f"unknown anchor {n!r}")
    return specs


def run_compare(args: argparse.Namespace) -> dict[str, Any]:
    print(machine_header(), flush=True)
    quiet_http_logs()
    names = [n.strip() for n in args.anchors.split(",") if n.strip()]
    gguf = resolve_model(args.model)
    specs = _specs(args, names, gguf)
    requests = load_requests(args)
    runs: dict[str, list[dict[str, Any]]] = {}
    commands: dict[str, list[str]] = {}
    for spec in specs:
        print(f"[compare {time.strftime('%H:%M:%S')}] starting {spec.name}: {' '.join(spec.cmd)}", flush=True)
        commands[spec.name] = spec.cmd
        runs[spec.name] = []
        for rate in parse_rates(args.request_rate):
            # a fresh server per rate: every rate starts with a cold prefix/prompt cache
            with ManagedServer(spec, args.startup_timeout):
                warm_up(spec.base_url, spec.served_model, args.endpoint)
                runs[spec.name].append(run_rate(spec.base_url, spec.served_model, requests, rate, args,
                                                label=spec.name))
    hf = None
    if "hf" in names:
        print(f"[compare {time.strftime('%H:%M:%S')}] HF transformers generate, static batch {args.hf_batch_size}",
              flush=True)
        hf = hf_offline(gguf, requests, args.dtype, args.hf_batch_size, args.threads, args.hf_max_seconds)
    workload = {"num_requests": len(requests), "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                "output_tokens": sum(r.output_len for r in requests)}
    if args.merge_result:  # servers measured by an earlier run with the same workload
        old = json.loads(Path(args.merge_result).read_text(encoding="utf-8"))
        if old.get("workload") != workload:
            raise ValueError(f"{args.merge_result} measured another workload: {old.get('workload')} != {workload}")
        runs = {**{k: v for k, v in old["runs"].items() if k not in runs}, **runs}
        hf = hf or old.get("hf")
        commands = {**old.get("commands", {}), **commands}
    sla = " ".join(args.goodput)
    table = side_by_side(runs, hf, sla) if runs else ""
    print(f"\n{args.dataset}, {len(requests)} prompts, seed {args.seed}, {args.parallel} parallel, "
          f"{args.threads} threads\n{table}", flush=True)
    if hf and not runs:
        print(f"HF generate: {hf['output_tok_s']:.2f} output tok/s")
    doc = {"benchmark": "compare", "machine": machine_info(), "gguf": str(gguf), "commands": commands,
           "config": {k: v for k, v in vars(args).items() if k != "func"},
           "workload": workload,
           "runs": runs, "hf": hf, "table": table}
    if args.save_result:
        save_json(Path(args.save_result), doc)
        print(f"wrote {args.save_result}")
    if args.plot and runs:
        from tokenmill.bench.plots import plot_runs
        plot_runs(runs, Path(args.plot), title=f"{args.model}: {args.dataset}, {len(requests)} prompts, "
                                               f"{args.parallel} parallel, {args.threads} threads",
                  hf_output_tok_s=hf["output_tok_s"] if hf else None, sla_ms=parse_sla(args.goodput))
        print(f"wrote {args.plot}")
    return doc
