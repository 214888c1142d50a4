"""Per-repeat measurements -> medians, paired ratios, a text table and a JSON document."""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# metric key -> table label; every metric is a rate (higher is better)
METRICS: dict[str, str] = {
    "output_tok_s": "offline output tok/s",
    "total_tok_s": "offline total (prompt+output) tok/s",
    "req_s": "offline requests/s",
    "decode_tok_s": "batch-1 decode tok/s",
    "prefill_tok_s": "prefill tok/s",
}


@dataclass(slots=True)
class Sample:
    """One repeat of one engine: wall seconds of each phase."""

    throughput_s: float
    decode_s: float
    prefill_s: float


@dataclass(slots=True)
class Workload:
    num_requests: int
    prompt_tokens: int      # sum over requests
    output_tokens: int      # sum of requested (useful) output tokens
    decode_tokens: int      # batch-1 decode length
    prefill_tokens: int     # batch-1 prefill prompt length


def rates(s: Sample, w: Workload) -> dict[str, float]:
    return {
        "output_tok_s": w.output_tokens / s.throughput_s,
        "total_tok_s": (w.prompt_tokens + w.output_tokens) / s.throughput_s,
        "req_s": w.num_requests / s.throughput_s,
        "decode_tok_s": w.decode_tokens / s.decode_s,
        "prefill_tok_s": w.prefill_tokens / s.prefill_s,
    }


def summarize(samples: dict[str, list[Sample]], w: Workload, baseline: str = "hf",
              target: str = "tokenmill") -> dict[str, Any]:
    """Median rate per engine and metric; ratio = median over repeats of target/baseline
    measured in the same repeat (pairs cancel slow phases of a noisy machine)."""
    per_run = {name: [rates(s, w) for s in runs] for name, runs in samples.items()}
    median = {name: {k: statistics.median(r[k] for r in runs) for k in METRICS}
              for name, runs in per_run.items() if runs}
    out: dict[str, Any] = {"median": median, "runs": per_run,
                           "raw_seconds": {n: [asdict(s) for s in runs] for n, runs in samples.items()}}
    if baseline in per_run and target in per_run:
        pairs = list(zip(per_run[target], per_run[baseline]))
        out["ratio"] = {k: statistics.median(t[k] / b[k] for t, b in pairs) for k in METRICS}
    return out


def format_table(summary: dict[str, Any], w: Workload, baseline: str = "hf", target: str = "tokenmill") -> str:
    med = summary["median"]
    ratio = summary.get("ratio", {})
    labels = dict(METRICS)
    labels["decode_tok_s"] += f" ({w.decode_tokens} tokens)"
    labels["prefill_tok_s"] += f" ({w.prefill_tokens}-token prompt)"
    width = max(len(v) for v in labels.values())
    lines = [f"{'metric':<{width}}  {'HF transformers':>15}  {'tokenmill':>10}  {'ratio':>6}",
             "-" * (width + 39)]
    for key, label in labels.items():
        b = f"{med[baseline][key]:.1f}" if baseline in med else "-"
        t = f"{med[target][key]:.1f}" if target in med else "-"
        r = f"{ratio[key]:.2f}x" if key in ratio else "-"
        lines.append(f"{label:<{width}}  {b:>15}  {t:>10}  {r:>6}")
    return "\n".join(lines)


def paired_ratios(summary: dict[str, Any], target: str, anchor: str) -> dict[str, float]:
    """Median over repeats of target/anchor, each pair measured in the same repeat."""
    pairs = list(zip(summary["runs"][target], summary["runs"][anchor]))
    return {k: statistics.median(t[k] / a[k] for t, a in pairs) for k in METRICS}


def format_engines_table(summary: dict[str, Any], w: Workload, anchor: str | None) -> str:
    """One row per engine (median rates), and its same-repeat ratio to `anchor` per metric."""
    keys = ("output_tok_s", "decode_tok_s", "prefill_tok_s")
    heads = ("offline out tok/s", f"decode tok/s (B=1, {w.decode_tokens})", f"prefill tok/s ({w.prefill_tokens})")
    width = max(len(n) for n in summary["median"]) + 2
    lines = [f"{'engine':<{width}}" + "".join(f"{h:>28}" for h in heads), "-" * (width + 28 * len(heads))]
    for name, med in summary["median"].items():
        ratio = paired_ratios(summary, name, anchor) if anchor and anchor in summary["median"] else None
        cells = [f"{med[k]:.1f}" + (f" ({ratio[k]:.2f}x)" if ratio else "") for k in keys]
        lines.append(f"{name:<{width}}" + "".join(f"{c:>28}" for c in cells))
    if anchor:
        lines.append(f"(ratios: median over repeats of engine / {anchor}, same repeat)")
    return "\n".join(lines)


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the shared leading run of two token lists (greedy agreement)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
