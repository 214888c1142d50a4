"""Where a decode step's time goes: engine step time at batch B, and a torch.profiler split of
that step into matmuls, attention, elementwise ops and everything else (Python, scheduler,
sampler, detokenizer).

    .venv/bin/python benchmarks/profile_decode.py --batch 1 --quantization rtn4
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams
from tokenmill.bench.machine import machine_header

MATMUL = ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::_weight_int8pack_mm",
          "aten::_weight_int4pack_mm_for_cpu", "aten::bmm", "aten::_int_mm", "tokenmill")
ATTENTION = ("paged_decode_attention", "scaled_dot_product")


def category(name: str) -> str:
    if any(m in name for m in ATTENTION):
        return "attention"
    if name in MATMUL or "nf4_linear" in name or "int4pack" in name or "int8pack" in name:
        return "matmul"
    return "other ops"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_header())
    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization, max_model_len=2048,
              max_num_seqs=max(args.batch, 1), kv_cache_memory=1 << 30, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4 * args.steps + 64, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [(i * 7 + j) % 40000 + 100 for j in range(args.context)], params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.waiting + engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(args.steps // 4):
            engine.step()
        rounds.append((time.perf_counter() - t) / (args.steps // 4) * 1000)
    step = statistics.median(rounds)
    print(f"decode step B={args.batch} ({args.dtype}, {args.quantization or 'no quantization'}): {step:.2f} ms "
          f"median of 5 ({args.batch / step * 1000:.1f} tok/s)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = (time.perf_counter() - t) / args.steps * 1000
    totals: dict[str, float] = defaultdict(float)
    per_op: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.cpu_parent is not None if hasattr(evt, "cpu_parent") else False:
            continue
    # self time of every op, attributed to a category
    for evt in prof.key_averages():
        ms = evt.self_cpu_time_total / 1000 / args.steps
        totals[category(evt.key)] += ms
        per_op[evt.key] += ms
    ops = sum(totals.values())
    print(f"profiled step {wall:.2f} ms (profiler overhead included); ops' self time {ops:.2f} ms")
    for cat in ("matmul", "attention", "other ops"):
        print(f"  {cat:10s} {totals[cat]:7.2f} ms  {totals[cat] / wall:6.1%}")
    print(f"  {'python/rest':10s} {wall - ops:7.2f} ms  {(wall - ops) / wall:6.1%}")
    print("top ops by self time (ms per step):")
    for key, ms in sorted(per_op.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {ms:7.3f}  {key}")


if __name__ == "__main__":
    main()
