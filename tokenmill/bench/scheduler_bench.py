"""`tokenmill bench scheduler EXPERIMENT`: one scheduler feature switched on and off, same workload.

Each experiment runs a tokenmill server per configuration (the first configuration is the
feature, the last the baseline). Repeats use seeds seed, seed+1, ... and alternate which
configuration goes first, so drift of the shared machine hits both sides. Every server is
started fresh per (configuration, repeat): no repeat inherits another's prefix cache. The
table shows per-configuration medians over repeats and the median of the per-repeat
(paired) ratios feature / baseline.

  prefix        prefix caching on vs off: TTFT of 100 questions behind a ~1,000-token prompt
  multiturn     prefix caching on vs off: TTFT of turns >= 2 of closed-loop conversations
  interference  chunked prefill (256 / 512 token budgets) vs unchunked: ITL of decoding streams
  priority      --scheduling-policy priority vs fcfs under overload: TTFT of priority-0 requests
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.bench import scenarios as sc
from tokenmill.bench.args import SCHEDULER_EXPERIMENTS
from tokenmill.bench.anchors import ManagedServer, tokenmill_spec
from tokenmill.bench.metrics_math import RequestResult, stat
from tokenmill.bench.machine import machine_header, machine_info
from tokenmill.bench.serve import compact_record, quiet_http_logs, save_json, warm_up

Numbers = dict[str, float]
COUNTERS = ("tokenmill:prefix_cache_queries", "tokenmill:prefix_cache_hits", "tokenmill:num_preemptions")


@dataclass
class Experiment:
    name: str
    what: str
    max_model_len: int
    configs: dict[str, list[str]]                      # label -> extra flags; first = feature, last = baseline
    workload: sc.Workload
    summarize: Callable[[sc.Groups, Numbers], Numbers]
    headline: str                                      # the metric the target is about
    target: str


def scrape_counters(base_url: str) -> Numbers:
    """Cumulative engine counters from /metrics (summed over label sets)."""
    text = httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text
    out = dict.fromkeys(COUNTERS, 0.0)
    for fam in text_string_to_metric_families(text):
        if fam.name in out:
            out[fam.name] += sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return out


def _ms(results: list[RequestResult], key: str, pct: str) -> float:
    ok = [r for r in results if r.success]
    values = [g for r in ok for g in r.itl] if key == "itl" else [getattr(r, key) for r in ok]
    return float(getattr(stat(values), pct))


def _hit_rate(delta: Numbers) -> float:
    q = delta["tokenmill:prefix_cache_queries"]
    return 100.0 * delta["tokenmill:prefix_cache_hits"] / q if q else 0.0


def _failed(groups: sc.Groups) -> float:
    return float(sum(not r.success for rs in groups.values() for r in rs))


def summarize_prefix(groups: sc.Groups, delta: Numbers) -> Numbers:
    q = groups["question"]
    return {"TTFT P50 (ms)": _ms(q, "ttft", "median"), "TTFT P95 (ms)": _ms(q, "ttft", "p95"),
            "E2E P50 (ms)": _ms(q, "latency", "median"), "prefix cache hit rate (%)": _hit_rate(delta),
            "failed requests": _failed(groups)}


def summarize_multiturn(groups: sc.Groups, delta: Numbers) -> Numbers:
    first, later = groups["turn 1"], groups["turns >= 2"]
    return {"TTFT P50 turns>=2 (ms)": _ms(later, "ttft", "median"), "TTFT P95 turns>=2 (ms)": _ms(later, "ttft", "p95"),
            "TTFT P50 turn 1 (ms)": _ms(first, "ttft", "median"), "mean prompt tokens turns>=2":
            statistics.fmean([r.prompt_len for r in later]) if later else 0.0,
            "requests (turns>=2)": float(len(later)), "prefix cache hit rate (%)": _hit_rate(delta),
            "failed requests": _failed(groups)}


def summarize_interference(groups: sc.Groups, delta: Numbers) -> Numbers:
    s, long_ = groups["stream"], groups["long prompt"]
    gaps = [g for r in s if r.success for g in r.itl]
    return {"stream ITL P95 (ms)": _ms(s, "itl", "p95"), "stream ITL P50 (ms)": _ms(s, "itl", "median"),
            "stream ITL P99 (ms)": _ms(s, "itl", "p99"), "stream ITL max (ms)": 1000.0 * max(gaps, default=0.0),
            "stream E2E P50 (ms)": _ms(s, "latency", "median"), "long prompts sent": float(len(long_)),
            "long-prompt TTFT P50 (ms)": _ms(long_, "ttft", "median"), "failed requests": _failed(groups)}


def summarize_priority(groups: sc.Groups, delta: Numbers) -> Numbers:
    hi, lo = groups["high"], groups["low"]
    return {"high-priority TTFT P95 (ms)": _ms(hi, "ttft", "p95"),
            "high-priority TTFT P50 (ms)": _ms(hi, "ttft", "median"),
            "low-priority TTFT P95 (ms)": _ms(lo, "ttft", "p95"),
            "low-priority TTFT P50 (ms)": _ms(lo, "ttft", "median"),
            "all E2E P50 (ms)": _ms(hi + lo, "latency", "median"),
            "preemptions": delta["tokenmill:num_preemptions"], "failed requests": _failed(groups)}


def _wl(fn: Callable[..., Any], params: Any) -> sc.Workload:
    return functools.partial(fn, w=params)


EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (
    Experiment("prefix", "prefix caching: 100 questions behind one ~1,000-token system prompt, one at a time",
               2048,
               {"caching on": [], "caching off": ["--no-enable-prefix-caching"]},
               _wl(sc.prefix_workload, sc.PrefixWorkload()), summarize_prefix, "TTFT P50 (ms)", "ratio <= 0.2"),
    Experiment("multiturn", "prefix caching: 16 ShareGPT conversations, up to 4 turns each, replayed closed-loop",
               2048,
               {"caching on": [], "caching off": ["--no-enable-prefix-caching"]},
               _wl(sc.multiturn_workload, sc.MultiturnWorkload()), summarize_multiturn,
               "TTFT P50 turns>=2 (ms)", "lower with caching"),
    Experiment("interference", "chunked prefill: 8 streams decode 128 tokens while 2,000-token prompts arrive "
                               "every 2.5 s", 2304,
               {"chunked 256": ["--max-num-batched-tokens", "256"], "chunked 512": ["--max-num-batched-tokens", "512"],
                "unchunked": ["--no-enable-chunked-prefill"]},
               _wl(sc.interference_workload, sc.InterferenceWorkload()), summarize_interference,
               "stream ITL P95 (ms)", "ratio <= 1/3"),
    Experiment("priority", "priority scheduling: 120 ShareGPT requests (output <= 128) at 6 req/s Poisson, "
                           "20% priority 0, 32 seats", 1024,
               {"priority": ["--scheduling-policy", "priority"], "fcfs": []},
               _wl(sc.priority_workload, sc.PriorityWorkload()), summarize_priority,
               "high-priority TTFT P95 (ms)", "lower under priority"),
)}

assert tuple(EXPERIMENTS) == SCHEDULER_EXPERIMENTS, "keep bench/args.py's names in step"


def run_one(exp: Experiment, label: str, seed: int, args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    spec = tokenmill_spec(args.model, args.port, args.max_num_seqs, exp.max_model_len, args.threads, args.dtype,
                          extra=exp.configs[label], name=label)
    with ManagedServer(spec, args.startup_timeout):
        warm_up(spec.base_url, spec.served_model, "/v1/completions")
        before = scrape_counters(spec.base_url)
        groups, seconds = asyncio.run(sc.run_workload(spec.base_url, spec.served_model, tokenizer, exp.workload, seed))
        after = scrape_counters(spec.base_url)
    delta = {k: after[k] - before[k] for k in COUNTERS}
    numbers = exp.summarize(groups, delta)
    numbers["wall time (s)"] = seconds
    print(f"[{exp.name} {time.strftime('%H:%M:%S')}] {label} seed {seed}: "
          + ", ".join(f"{k} {v:.1f}" for k, v in numbers.items()), flush=True)
    raw = {g: [compact_record(r) for r in rs] for g, rs in groups.items()}
    return {"seed": seed, "numbers": numbers, "counters": delta, "requests": raw}


def table(exp: Experiment, runs: dict[str, list[dict[str, Any]]]) -> str:
    labels = list(runs)
    base = labels[-1]
    keys = list(runs[base][0]["numbers"])
    w = max(14, *(len(lb) + 2 for lb in labels))
    head = f"{'metric (median of ' + str(len(runs[base])) + ')':<32}" + "".join(f"{lb:>{w}}" for lb in labels) \
        + "".join(f"{lb + '/' + base:>{max(w, len(lb) + len(base) + 3)}}" for lb in labels[:-1])
    lines = [f"{exp.name}: {exp.what}", f"headline: {exp.headline}, target {exp.target}", head, "-" * len(head)]
    for k in keys:
        meds = [statistics.median(r["numbers"][k] for r in runs[lb]) for lb in labels]
        row = f"{k:<32}" + "".join(f"{m:>{w}.2f}" for m in meds)
        for lb in labels[:-1]:
            pairs = [a["numbers"][k] / b["numbers"][k] for a, b in zip(runs[lb], runs[base]) if b["numbers"][k]]
            ratio = f"{statistics.median(pairs):.3f}x" if pairs else "-"
            row += f"{ratio:>{max(w, len(lb) + len(base) + 3)}}"
        lines.append(row)
    return "\n".join(lines)


def run_scheduler_bench(args: argparse.Namespace) -> dict[str, Any]:
    print(machine_header(), flush=True)
    from tokenmill.hub import resolve_model
    from tokenmill.model.loader import load_tokenizer

    quiet_http_logs()
    tokenizer = load_tokenizer(resolve_model(args.model))
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    docs = {}
    for name in names:
        exp = EXPERIMENTS[name]
        runs: dict[str, list[dict[str, Any]]] = {lb: [] for lb in exp.configs}
        for rep in range(args.repeats):
            order = list(exp.configs) if rep % 2 == 0 else list(reversed(exp.configs))
            for label in order:
                runs[label].append(run_one(exp, label, args.seed + rep, args, tokenizer))
        text = table(exp, runs)
        print("\n" + text + "\n", flush=True)
        doc = {"benchmark": f"scheduler/{name}", "machine": machine_info(), "what": exp.what,
               "max_model_len": exp.max_model_len,
               "max_num_seqs": args.max_num_seqs, "configs": exp.configs, "repeats": args.repeats,
               "threads": args.threads, "dtype": args.dtype, "table": text, "runs": runs}
        if args.output_dir:
            path = Path(args.output_dir) / f"scheduler_{name}.json"
            save_json(path, doc)
            print(f"wrote {path}")
        docs[name] = doc
    return docs
