"""PNG figures from run records (`serve.run_record`): latency CDFs and the rate sweep.

`runs` maps a server label to its list of run records (one per request rate). Row 1: TTFT and
ITL CDFs, one line per (server, rate). Row 2, only for a sweep: output throughput and
P95 TTFT / TPOT versus request rate (x categorical so that `inf` has a place).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _cdf(ax: Any, values_s: list[float], label: str) -> None:
    if not values_s:
        return
    x = np.sort(np.asarray(values_s) * 1000.0)
    ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label, drawstyle="steps-post")


def _rate_label(rec: dict[str, Any]) -> str:
    r = rec["request_rate"]
    return "inf" if r == "inf" else f"{float(r):g}"


def plot_runs(runs: dict[str, list[dict[str, Any]]], path: Path, title: str = "",
              hf_output_tok_s: float | None = None, sla_ms: dict[str, float] | None = None) -> None:
    """`hf_output_tok_s`: HF's offline figure, drawn as a line on the throughput panel;
    `sla_ms`: goodput limits (ttft/tpot) drawn on the latency panel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    is_sweep = any(len(v) > 1 for v in runs.values())
    fig, axes = plt.subplots(2 if is_sweep else 1, 2, figsize=(13, 9 if is_sweep else 4.8), squeeze=False)
    ttft_ax, itl_ax = axes[0]
    for server, recs in runs.items():
        for rec in recs:
            ok = [r for r in rec["requests"] if r["success"]]
            label = f"{server} rate={_rate_label(rec)}" if is_sweep else server
            _cdf(ttft_ax, [r["ttft"] for r in ok], label)
            _cdf(itl_ax, [g for r in ok for g in r["itl"]], label)
    for ax, name in ((ttft_ax, "TTFT"), (itl_ax, "inter-token latency")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms, log scale)")
        ax.set_ylabel("fraction of " + ("requests" if name == "TTFT" else "token gaps"))
        ax.set_title(f"{name} CDF")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if is_sweep:
        tput_ax, lat_ax = axes[1]
        labels = [_rate_label(r) for r in max(runs.values(), key=len)]
        for server, recs in runs.items():
            xs = list(range(len(recs)))      # positions; rates are shown as tick labels
            tput_ax.plot(xs, [r["metrics"]["output_throughput"] for r in recs], marker="o", label=server)
            lat_ax.plot(xs, [r["metrics"]["ttft"]["p95"] for r in recs], marker="o", label=f"{server} P95 TTFT")
            lat_ax.plot(xs, [r["metrics"]["tpot"]["p95"] for r in recs], marker="s", linestyle="--",
                        label=f"{server} P95 TPOT")
        if hf_output_tok_s:
            tput_ax.axhline(hf_output_tok_s, color="gray", linestyle=":",
                            label="HF generate, offline static batches")
        for key, style in (("ttft", "-."), ("tpot", ":")):
            if sla_ms and key in sla_ms:
                lat_ax.axhline(sla_ms[key], color="black", linestyle=style, linewidth=1,
                               label=f"SLA {key.upper()} {sla_ms[key]:g} ms")
        tput_ax.set_ylim(bottom=0)
        tput_ax.set_ylabel("output throughput (tok/s)")
        tput_ax.set_title("throughput vs request rate")
        lat_ax.set_yscale("log")
        lat_ax.set_ylabel("P95 latency (ms, log scale)")
        lat_ax.set_title("P95 latency vs request rate")
        for ax in (tput_ax, lat_ax):
            ax.set_xticks(range(len(labels)), labels)
            ax.set_xlabel("request rate (req/s)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
