"""`tokenmill tune`: the scheduler setting with the highest goodput that still meets the SLA.

A *setting* is a value for each searched serving flag (default axes: --max-num-seqs,
--max-num-batched-tokens, --max-idle-batched-tokens). A *point* is one setting driven at one
request rate with the `bench serve` load generator; it meets the SLA when every request
finished and its P95 TTFT and P95 TPOT are within the targets. A setting's score is the best
goodput (requests/s that meet the SLA one by one) over its points that meet the SLA.

Search: coordinate ascent from the engine's own defaults. Axis by axis, every value is tried
with the other axes at the best setting so far, and the best value is kept (ties keep the
earlier). That is sum(|axis|) settings instead of the grid's product, which is what fits a
time budget on a small machine; the table shows everything that was measured. Each setting
climbs the rate ladder until a rate misses the SLA (higher rates only queue more). Like
`bench compare`, every point gets a fresh server (no rate inherits a warm prefix cache).
"""
from __future__ import annotations

import argparse
import asyncio
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from tokenmill.bench.anchors import ManagedServer, tokenmill_spec
from tokenmill.bench.machine import machine_header, machine_info
from tokenmill.bench.metrics_math import BenchMetrics, compute_metrics
from tokenmill.bench.serve import load_requests, parse_rates, quiet_http_logs, run_load, save_json, warm_up
from tokenmill.bench.sharegpt import Request

DEFAULT_AXES = ("max-num-seqs=4,8,12,16,24,32", "max-num-batched-tokens=128,256,512,1024",
                "max-idle-batched-tokens=512,2048")
MIN_POINT_SECONDS = 30.0      # do not start a point with less budget than this left

Setting = dict[str, int]


@dataclass(slots=True)
class Point:
    setting: Setting
    rate: float
    goodput: float
    output_throughput: float
    ttft_p95_ms: float
    tpot_p95_ms: float
    completed: int
    failed: int
    meets_sla: bool


def parse_axes(items: Sequence[str]) -> list[tuple[str, list[int]]]:
    """["max-num-seqs=4,8"] -> [("max-num-seqs", [4, 8])]."""
    axes = []
    for item in items:
        flag, sep, values = item.partition("=")
        try:
            parsed = [int(v) for v in values.split(",") if v.strip()]
        except ValueError:
            parsed = []
        if not sep or not flag or not parsed or min(parsed) < 1:
            raise ValueError(f"bad --axis {item!r}: expected FLAG=V1,V2,... with positive integers")
        axes.append((flag.removeprefix("--"), parsed))
    return axes


def engine_defaults(device: str) -> Setting:
    """The values the engine uses when the flags are not given (the tuner's starting point)."""
    from tokenmill.config import SCHEDULER_DEFAULTS

    seqs, budget, idle = SCHEDULER_DEFAULTS["cpu" if device == "cpu" else "gpu"]
    return {"max-num-seqs": seqs, "max-num-batched-tokens": budget, "max-idle-batched-tokens": idle}


def setting_flags(setting: Setting) -> list[str]:
    return [part for flag, value in setting.items() for part in (f"--{flag}", str(value))]


def setting_label(setting: Setting) -> str:
    return " ".join(f"{flag}={value}" for flag, value in setting.items())


def invalid_reason(setting: Setting) -> str | None:
    """Combinations the engine refuses, skipped instead of started."""
    idle, budget = setting.get("max-idle-batched-tokens"), setting.get("max-num-batched-tokens")
    if idle is not None and budget is not None and idle < budget:
        return "max-idle-batched-tokens < max-num-batched-tokens"
    return None


def sla_met(m: BenchMetrics, sla: dict[str, float]) -> bool:
    return (m.failed == 0 and m.completed > 0
            and m.ttft.p95 <= sla["ttft"] and m.tpot.p95 <= sla["tpot"])


def score(points: Sequence[Point]) -> float:
    return max((p.goodput for p in points if p.meets_sla), default=0.0)


class Tuner:
    def __init__(self, args: argparse.Namespace, requests: Sequence[Request]) -> None:
        self.args = args
        self.requests = requests
        self.sla = {"ttft": args.ttft_p95, "tpot": args.tpot_p95}
        self.deadline = time.monotonic() + args.budget_minutes * 60
        self.measured: dict[tuple[tuple[str, int], ...], list[Point]] = {}
        self.skipped: list[tuple[Setting, str]] = []

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    @staticmethod
    def key(setting: Setting) -> tuple[tuple[str, int], ...]:
        return tuple(sorted(setting.items()))

    def points_of(self, setting: Setting) -> list[Point]:
        """What `setting` measured so far (nothing if it was not)."""
        return self.measured.get(self.key(setting), [])

    def measure(self, setting: Setting) -> list[Point]:
        key = self.key(setting)
        if key in self.measured:
            return self.measured[key]
        if (reason := invalid_reason(setting)) is not None or self.left_s() < MIN_POINT_SECONDS:
            self.skipped.append((setting, reason or "budget spent"))
            return []
        points: list[Point] = []
        for rate in parse_rates(self.args.request_rate):
            if self.left_s() < MIN_POINT_SECONDS:
                self.skipped.append((setting, f"budget spent before rate {rate:g}"))
                break
            points.append(self.measure_point(setting, rate))
            if not points[-1].meets_sla:
                break
        self.measured[key] = points
        return points

    def measure_point(self, setting: Setting, rate: float) -> Point:
        a = self.args
        spec = tokenmill_spec(a.model, a.port, None, a.max_model_len, a.threads, a.dtype,
                              extra=setting_flags(setting) + shlex.split(a.serve_args), name="tune")
        with ManagedServer(spec, a.startup_timeout):
            warm_up(spec.base_url, spec.served_model, a.endpoint)
            results, duration = asyncio.run(run_load(
                spec.base_url, spec.served_model, self.requests, rate, a.burstiness, a.max_concurrency, a.seed,
                a.endpoint, min(a.max_duration, max(self.left_s(), 1.0)), progress=not a.no_progress))
        m = compute_metrics(results, duration, self.sla)
        point = Point(dict(setting), rate, m.goodput or 0.0, m.output_throughput, m.ttft.p95, m.tpot.p95,
                      m.completed, m.failed, sla_met(m, self.sla))
        print(f"[tune {time.strftime('%H:%M:%S')}] {setting_label(setting)} rate {rate:g}: goodput "
              f"{point.goodput:.3f} req/s, TTFT P95 {point.ttft_p95_ms:.0f} ms, TPOT P95 {point.tpot_p95_ms:.1f} ms, "
              f"{'meets' if point.meets_sla else 'misses'} the SLA ({self.left_s() / 60:.1f} min left)", flush=True)
        return point

    def search(self, start: Setting, axes: Sequence[tuple[str, list[int]]]) -> Setting:
        best = dict(start)
        self.measure(best)
        for flag, values in axes:
            for value in values:
                candidate = {**best, flag: value}
                if score(self.measure(candidate)) > score(self.points_of(best)):
                    best = candidate
        return best

    def points(self) -> list[Point]:
        return [p for pts in self.measured.values() for p in pts]


def format_table(points: Sequence[Point], best: Setting | None, sla: dict[str, float]) -> str:
    w = max([8] + [len(setting_label(p.setting)) + 2 for p in points])
    head = f"{'setting':<{w}}{'rate':>6}{'goodput':>10}{'out tok/s':>11}{'TTFT P95':>10}{'TPOT P95':>10}  SLA"
    lines = [f"SLA: TTFT P95 <= {sla['ttft']:g} ms, TPOT P95 <= {sla['tpot']:g} ms, no failed request; "
             "goodput in req/s, latencies in ms; * = the chosen setting", head, "-" * len(head)]
    for p in points:
        mark = "*" if best is not None and p.setting == best else " "
        lines.append(f"{mark}{setting_label(p.setting):<{w - 1}}{p.rate:>6g}{p.goodput:>10.3f}{p.output_throughput:>11.1f}"
                     f"{p.ttft_p95_ms:>10.0f}{p.tpot_p95_ms:>10.1f}  {'meets' if p.meets_sla else 'misses'}")
    return "\n".join(lines)


def run_tune(args: argparse.Namespace) -> dict[str, Any]:
    print(machine_header(), flush=True)
    quiet_http_logs()
    axes = parse_axes(args.axis or DEFAULT_AXES)
    start = engine_defaults(args.device)
    requests = load_requests(args)
    tuner = Tuner(args, requests)
    print(f"[tune] {len(requests)} {args.dataset} prompts, rates {args.request_rate}, budget "
          f"{args.budget_minutes:g} min; start at the engine defaults: {setting_label(start)}", flush=True)
    best = tuner.search(start, axes)
    points = tuner.points()
    best_score = score(tuner.points_of(best))
    table = format_table(points, best if best_score > 0 else None, tuner.sla)
    print("\n" + table)
    for setting, reason in tuner.skipped:
        print(f"not measured: {setting_label(setting)} ({reason})")
    if best_score > 0:
        best_point = max((p for p in points if p.setting == best and p.meets_sla), key=lambda p: p.goodput)
        print(f"\nbest: {' '.join(setting_flags(best))}  -> goodput {best_score:.3f} req/s at rate "
              f"{best_point.rate:g} (defaults: {score(tuner.measure(start)):.3f} req/s)")
        print("check it against the defaults in one run:\n  tokenmill bench compare --anchors tokenmill,tokenmill-default "
              f"--model {args.model} --dtype {args.dtype} --ctx-per-seq {args.max_model_len} "
              f"--tokenmill-args {shlex.quote(' '.join(setting_flags(best) + shlex.split(args.serve_args)))} "
              f"--tokenmill-default-args {shlex.quote(args.serve_args)} --dataset {args.dataset} "
              f"--num-prompts {args.num_prompts} --max-prompt-tokens {args.max_prompt_tokens} "
              f"--max-output-tokens {args.max_output_tokens} --seed {args.seed} --request-rate {args.request_rate} "
              f"--goodput ttft:{args.ttft_p95:g} tpot:{args.tpot_p95:g}")
    else:
        print("\nno measured setting met the SLA at any rate tried")
    doc = {"benchmark": "tune", "machine": machine_info(), "sla_ms": tuner.sla,
           "config": {k: v for k, v in vars(args).items() if k != "func"},
           "axes": axes, "start": start, "best": best if best_score > 0 else None, "best_goodput": best_score,
           "points": [asdict(p) for p in points],
           "skipped": [{"setting": s, "reason": r} for s, r in tuner.skipped], "table": table}
    if args.save_result:
        save_json(Path(args.save_result), doc)
        print(f"wrote {args.save_result}")
    return doc


def add_tune_args(p: argparse.ArgumentParser) -> None:
    from tokenmill.bench.args import add_workload_args

    p.add_argument("model", nargs="?", default="smollm2-135m-instruct", help="known model name, .gguf or HF dir")
    p.add_argument("--ttft-p95", type=float, default=500.0, help="SLA: P95 time to first token, ms")
    p.add_argument("--tpot-p95", type=float, default=40.0, help="SLA: P95 time per output token, ms")
    p.add_argument("--axis", action="append", default=None, metavar="FLAG=V1,V2,...",
                   help=f"a `tokenmill serve` flag and its candidate values, repeatable (default: {' '.join(DEFAULT_AXES)})")
    p.add_argument("--budget-minutes", type=float, default=30.0, help="stop measuring after this long")
    p.add_argument("--serve-args", default="", help="fixed extra `tokenmill serve` flags, e.g. '--quantization int8'")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="whose engine defaults to start from")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8125)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    add_workload_args(p, request_rate="1,2,4,8", num_prompts=60, with_sla=False)

