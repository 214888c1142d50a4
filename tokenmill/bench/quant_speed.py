"""`tokenmill bench quant-speed`: the speed side of the quantization table, every variant in one
run. Variants are `label=MODEL[@METHOD]` as in `bench quality` (MODEL may be a directory written
by `tokenmill quantize`). All engines stay loaded with the same KV budget, and each repeat
measures every variant in a rotated order, so a noisy neighbour hits all of them alike:
- batch-1 decode tok/s: 32-token prompt, `--decode-tokens` new tokens (time includes the prefill);
- prefill tok/s: one `--prefill-tokens` prompt, 1 output token, the median of `--prefill-samples`
  back-to-back prefills per repeat (one ~0.1 s prefill swung by 15 % between repeats alone);
- offline output tok/s: ShareGPT requests all at once (`--offline-repeats` times, default 1:
  it is the long measurement);
- weight bytes as stored.
Medians over repeats; ratios against the first variant.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tokenmill.bench.machine import machine_header, machine_info
from tokenmill.bench.quality import parse_variants
from tokenmill.bench.report import write_json
from tokenmill.bench.sharegpt import sample_requests
from tokenmill.bench.tm_runner import TokenmillRunner


def _log(msg: str) -> None:
    print(f"[quant-speed {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_quant_speed(args: argparse.Namespace) -> dict[str, Any]:
    if args.prefill_samples < 1 or args.repeats < 1:
        raise ValueError("--prefill-samples and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    print(machine_header(), flush=True)
    variants = parse_variants(args.variants, args.model)
    runners: dict[str, TokenmillRunner] = {}
    for v in variants:
        extra = {"quantization": v.quantization} if v.quantization else {}
        runners[v.label] = TokenmillRunner(v.model, args.dtype, args.max_num_seqs, args.kv_cache_memory,
                                           num_threads=args.threads, **extra)
    first = runners[variants[0].label]
    requests = sample_requests(first.llm.get_tokenizer(), args.num_prompts, 512, 256, seed=args.seed)
    decode_prompt = requests[0].prompt_token_ids[:32]
    prefill_prompt = [t for r in requests for t in r.prompt_token_ids][:args.prefill_tokens]
    output_tokens = sum(r.output_len for r in requests)
    for label, r in runners.items():       # warm-up: kernels compiled, allocator primed
        r.decode(decode_prompt, 8)
        r.prefill(prefill_prompt)
    labels = [v.label for v in variants]
    decode: dict[str, list[float]] = {k: [] for k in labels}
    prefill: dict[str, list[float]] = {k: [] for k in labels}
    offline: dict[str, list[float]] = {k: [] for k in labels}
    for rep in range(args.repeats):
        order = labels[rep % len(labels):] + labels[:rep % len(labels)]
        for label in order:
            d, _ = runners[label].decode(decode_prompt, args.decode_tokens)
            p = statistics.median(runners[label].prefill(prefill_prompt) for _ in range(args.prefill_samples))
            decode[label].append(args.decode_tokens / d)
            prefill[label].append(len(prefill_prompt) / p)
            _log(f"repeat {rep + 1}: {label} decode {decode[label][-1]:.1f} tok/s, prefill {prefill[label][-1]:.1f} tok/s")
    for rep in range(args.offline_repeats):
        for label in labels[rep % len(labels):] + labels[:rep % len(labels)]:
            secs = runners[label].throughput(requests)
            offline[label].append(output_tokens / secs)
            _log(f"offline {rep + 1}: {label} {offline[label][-1]:.1f} output tok/s ({secs:.1f}s)")
    rows = []
    for v in variants:
        runner = runners[v.label].llm.engine.runner
        rows.append({"label": v.label, "model": v.model, "quantization": v.quantization,
                     "weight_bytes": runner.weight_bytes,
                     "decode_tok_s": statistics.median(decode[v.label]),
                     "prefill_tok_s": statistics.median(prefill[v.label]),
                     "offline_output_tok_s": statistics.median(offline[v.label]) if offline[v.label] else None,
                     "decode_runs": decode[v.label], "prefill_runs": prefill[v.label],
                     "offline_runs": offline[v.label]})
    base = rows[0]
    lines = [f"{'variant':14s} {'weights MB':>10s} {'decode tok/s':>13s} {'x':>6s} {'prefill tok/s':>14s} "
             f"{'x':>6s} {'offline tok/s':>14s} {'x':>6s}", "-" * 92]
    for r in rows:
        off = r["offline_output_tok_s"]
        off_s = f"{off:14.1f} {off / base['offline_output_tok_s']:5.2f}x" if off else f"{'-':>14s} {'-':>6s}"
        lines.append(f"{r['label']:14s} {r['weight_bytes'] / 1e6:10.1f} {r['decode_tok_s']:13.1f} "
                     f"{r['decode_tok_s'] / base['decode_tok_s']:5.2f}x {r['prefill_tok_s']:14.1f} "
                     f"{r['prefill_tok_s'] / base['prefill_tok_s']:5.2f}x {off_s}")
    table = "\n".join(lines)
    print(f"\n{args.num_prompts} ShareGPT prompts ({output_tokens} output tokens), dtype {args.dtype}, "
          f"{args.threads} threads; decode/prefill median of {args.repeats} (prefill: each the median of "
          f"{args.prefill_samples}), offline median of {args.offline_repeats}\n")
    print(table, flush=True)
    doc = {"benchmark": "quant-speed", "machine": machine_info(), "args": vars(args) | {"func": None},
           "rows": rows, "table": table}
    if args.output_json:
        write_json(Path(args.output_json), doc)
        _log(f"wrote {args.output_json}")
    return doc


def add_quant_speed_parser(sub: Any) -> None:
    p = sub.add_parser("quant-speed", help="decode / prefill / offline speed of quantized variants, one run")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--variants", default=None, help="label=MODEL[@METHOD],... (first = baseline)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--offline-repeats", type=int, default=1)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--prefill-samples", type=int, default=5, help="prefills per repeat (their median counts)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output-json", default="benchmarks/results/quant_speed.json")
